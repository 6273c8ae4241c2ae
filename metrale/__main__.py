"""`python -m metrale ...`: the `metrale` command (`metrale.cli.main`)."""

from __future__ import annotations

import sys

from metrale.cli import main

if __name__ == "__main__":
    sys.exit(main())
