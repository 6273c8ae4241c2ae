"""The package layering (README, Layout): no unit of `metrale/` imports from a unit above it,
and the pure-Python scheduling core and speculation package import no torch.

A unit is a package (`metrale/engine/`) or a top-level module (`metrale/config.py`). `TIERS`
lists them bottom to top; a unit may import only from units of lower tiers (or from itself).
Every import counts: module-level, inside functions and under `TYPE_CHECKING` alike, so a lazy
import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import metrale

PACKAGE = Path(metrale.__file__).resolve().parent
ROOT = "__init__"  # `from metrale import X` for a name that is no unit: the package root

#: Bottom to top. The order is the one the code keeps today; units in one tier are independent.
TIERS: list[set[str]] = [
    # `progress`: the start-up reporter the loader and the factory are handed (no imports).
    {"errors", "progress", "version"},
    # Leaves: typed errors only (kernels: none at all).
    {"kernels", "cache", "tokenizer", "spec", "model_config"},
    # Building blocks over the leaves; `config` reads the speculative config (`spec`).
    {"layers", "sampling", "config"},
    {"models", "engine_flags"},
    # The Model interface and TransformerModel; the scheduler reads only `model_engine.traits`.
    {"model_engine"},
    # Tensor parallelism: rank 0's module wrapper and the workers, which load through the
    # factory (`model_engine` knows only its `ModelSharding` protocol).
    {"distributed"},
    {"scheduler"},
    {"engine"},
    {"server", "bench", "top"},
    {"cli", ROOT},
    # `python -m metrale`: runs `cli`.
    {"__main__"},
]
RANK = {unit: rank for rank, tier in enumerate(TIERS) for unit in tier}


def _unit(path: Path, package: Path) -> str:
    parts = path.relative_to(package).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imported_units(path: Path, package_dir: Path) -> list[tuple[int, str, str]]:
    """(line, imported module, unit) of every `metrale` import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ["metrale", *path.relative_to(package_dir).parent.parts]
    found = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            modules = (
                [f"{base}.{alias.name}" for alias in node.names] if base == "metrale" else [base]
            )
        for module in modules:
            parts = module.split(".")
            if parts[0] != "metrale":
                continue
            unit = parts[1] if len(parts) > 1 and parts[1] in RANK else ROOT
            found.append((node.lineno, module, unit))
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    """Every import of a unit from a unit at its own tier or above, as `file:line: ...`."""
    errors = []
    for path in sorted(package.rglob("*.py")):
        unit = _unit(path, package)
        if unit not in RANK:
            errors.append(f"{path.relative_to(package.parent)}: unit {unit!r} is in no tier")
            continue
        for line, module, target in _imported_units(path, package):
            if target != unit and RANK[target] >= RANK[unit]:
                errors.append(
                    f"{path.relative_to(package.parent)}:{line}: {unit} (tier {RANK[unit]}) "
                    f"imports {module} ({target}, tier {RANK[target]})"
                )
    return errors


def test_no_unit_imports_from_a_unit_above_it() -> None:
    errors = upward_imports()
    assert not errors, "upward imports:\n" + "\n".join(errors)


def test_the_scan_reports_an_upward_import(tmp_path: Path) -> None:
    # A copy of two units, one importing upward in a function body, is reported with its line.
    (tmp_path / "metrale" / "layers").mkdir(parents=True)
    (tmp_path / "metrale" / "models").mkdir()
    (tmp_path / "metrale" / "__init__.py").write_text("")
    (tmp_path / "metrale" / "models" / "config.py").write_text("X = 1\n")
    (tmp_path / "metrale" / "layers" / "common.py").write_text(
        "def f():\n    from metrale.models.config import X\n    return X\n"
    )
    errors = upward_imports(tmp_path / "metrale")
    assert errors == [
        "metrale/layers/common.py:2: layers (tier 2) imports metrale.models.config (models, tier 3)"
    ]


def test_scheduler_and_spec_import_no_torch() -> None:
    code = "import metrale.scheduler, metrale.spec, sys; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=PACKAGE.parent)
