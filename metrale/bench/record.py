"""Benchmark records: one JSON object per run under `bench/records/`, holding the commit, the
machine, the configuration and the figures, so every claim is a ratio someone can reproduce.

Owner: bench.

Invariants:
- A record always carries `instrument`, `device`, `commit`, `model_shape`, `config`, `figures`
  and `peer_figures` (None when no peer ran), plus the command line that produced it.
- File names sort by time and never overwrite each other.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

RECORDS_DIR = Path("bench") / "records"


def git_commit() -> str:
    """`$METRALE_COMMIT` when set (a copy of the tree whose .git is stale or absent, as on the
    device machine), else `git rev-parse HEAD` (+ "-dirty")."""
    if os.environ.get("METRALE_COMMIT"):
        return os.environ["METRALE_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def device_name(device: str = "auto") -> str:
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu:{platform.processor() or platform.machine()} x{os.cpu_count()}"


def write_record(
    instrument: str,
    *,
    model_shape: str,
    config: dict[str, Any],
    figures: Any,
    peer_figures: Any = None,
    device: str = "auto",
    out_dir: str | Path = RECORDS_DIR,
    notes: str = "",
) -> Path:
    now = dt.datetime.now(dt.UTC)
    record = {
        "instrument": instrument,
        "device": device_name(device),
        "commit": git_commit(),
        "model_shape": model_shape,
        "config": config,
        "figures": figures,
        "peer_figures": peer_figures,
        "time": now.isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "notes": notes,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{now:%Y%m%dT%H%M%S}-{instrument}-{model_shape}.json"
    n = 1
    while path.exists():
        path = out / f"{now:%Y%m%dT%H%M%S}-{instrument}-{model_shape}-{n}.json"
        n += 1
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
