"""`metrale bench plot` on the committed records writes valid PNGs, headless (Agg), and skips
records it does not chart.

Owner: tests (bench).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from metrale.bench.plot import load_records, plot_records

REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "bench" / "records"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_the_committed_records_headless(tmp_path: Path) -> None:
    # A fresh interpreter with no display: the command must pick Agg itself.
    code = (
        "import sys; from metrale.cli import main; rc = main(sys.argv[1:]); "
        "import matplotlib; assert matplotlib.get_backend().lower() == 'agg', "
        "matplotlib.get_backend(); sys.exit(rc)"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "MPLBACKEND": "",
        "HOME": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, "-c", code, "bench", "plot", str(RECORDS), "--out", str(tmp_path / "c")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.split()]
    names = {p.name for p in written}
    assert {"serve-ladder-qwen3-8b.png", "decode-roofline.png",
            "history-latency-qwen3-8b.png", "history-serve-qwen3-8b.png"} <= names, names  # fmt: skip
    for path in written:
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, path
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 600 and height >= 300, (path, width, height)


def test_unchartable_records_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"instrument": "gpu-tests", "figures": {}}))
    (tmp_path / "b.json").write_text("not json")
    (tmp_path / "c.json").write_text(
        json.dumps({"instrument": "serve", "figures": [], "model_shape": "x"})
    )
    records = load_records([tmp_path])
    assert [r["instrument"] for r in records] == ["gpu-tests", "serve"]
    assert plot_records(records, tmp_path / "out") == []
    only = plot_records(load_records([RECORDS]), tmp_path / "lat", ["latency"])
    assert not any(p.name.startswith(("history-serve", "history-throughput")) for p in only)
