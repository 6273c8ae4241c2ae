"""`metrale bench structured` runs end to end on the CPU (a tiny config shape, the bundled
tokenizer, a few steps) and writes its record: both batch sizes and temperatures, the
constrained rows really decode under the tool-call grammar (no row ever samples a token
the grammar refuses)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from metrale.bench import structured
from metrale.engine.intake import BUNDLED_MODEL_DIR

REPO = Path(__file__).resolve().parents[2]


def test_bench_structured_writes_its_record(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    structured.add_arguments(parser)
    args = parser.parse_args(
        [
            "--config-dir", str(REPO / "bench" / "configs" / "tiny-2k"),
            "--tokenizer", str(BUNDLED_MODEL_DIR), "--device", "cpu", "--batches", "1,3",
            "--temperatures", "0,0.7", "--steps", "12", "--context", "16",
            "--out-dir", str(tmp_path),
        ]
    )  # fmt: skip
    figures = structured.run(args)
    (record,) = tmp_path.glob("*-structured-tiny-2k.json")
    saved = json.loads(record.read_text())
    assert saved["instrument"] == "structured" and saved["figures"].keys() == figures.keys()
    for key in ("C1_t0", "C3_t0", "C1_t0.7", "C3_t0.7"):
        entry = figures[key]
        assert math.isfinite(entry["overhead_pct"])
        assert entry["constrained"]["fed_steps_timed"] > 0
        assert entry["constrained"]["requests_completed"] >= 0
        assert math.isfinite(entry["synchronous_step"]["overhead_pct"])
        constrained = entry["synchronous_step"]["constrained"]
        assert constrained["fill_ms_median"] > 0
        assert constrained["failed_rows"] == 0  # every sampled token was one the grammar allows
        assert constrained["calls_completed"] + constrained["tokens_in_open_calls"] > 0
