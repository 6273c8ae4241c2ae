"""The package's version, in one place (`metrale.__version__`, `GET /version`, the wheel's
metadata through `pyproject.toml`)."""

__version__ = "0.1.0"
