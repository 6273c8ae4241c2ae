"""`metrale bench kv-tiers` runs end to end on the CPU (the tiny-2k shape, short prompts, one
repeat) and writes its record: the timed prefix really comes back whole from the host tier,
and after a restart from the disk tier (every block a disk hit, none recomputed); the disk
probe measures both directions; high-speed swap decodes the fully resident run's tokens."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from metrale.bench import kv_tiers

REPO = Path(__file__).resolve().parents[2]


def test_bench_kv_tiers_writes_its_record(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    kv_tiers.add_arguments(parser)
    prompt_len = 128
    args = parser.parse_args(
        [
            "--config-dir", str(REPO / "bench" / "configs" / "tiny-2k"), "--device", "cpu",
            "--prompt-len", str(prompt_len), "--repeats", "1", "--host-prompts", "2",
            "--disk-probe-mb", "8", "--disk-dir", str(tmp_path / "disk"), "--no-drop-caches",
            "--hss-window-blocks", "2", "--hss-decode-tokens", "16",
            "--out-dir", str(tmp_path / "records"),
        ]
    )  # fmt: skip
    figures = kv_tiers.run(args)
    (record,) = (tmp_path / "records").glob("*-kv-tiers-tiny-2k.json")
    saved = json.loads(record.read_text())
    assert saved["instrument"] == "kv-tiers" and saved["figures"].keys() == figures.keys()
    blocks = prompt_len // 16
    assert figures["host_cached_tokens"] == prompt_len
    assert figures["host_placement_before_reuse"] == {
        "device": 0, "host": blocks, "disk": 0, "blocks": blocks
    }  # fmt: skip
    assert figures["disk_placement_before_restart"]["disk"] == blocks
    assert figures["restart_indexed_blocks"] >= blocks
    assert figures["disk_cached_tokens"] == prompt_len
    assert figures["disk_hits_blocks"] == blocks  # served from disk, not recomputed
    for key in ("host_over_cold", "disk_over_cold", "host_restore_gb_s", "disk_restore_gb_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key
    disk = figures["disk"]
    assert disk["bytes"] == 8 << 20 and disk["read_gb_s"] > 0 and disk["write_gb_s"] > 0
    assert disk["page_cache"]["fadvise_dontneed_files"] == 1
    assert disk["filesystem"]["mount"] and disk["filesystem"]["type"] != "unknown"
    assert figures["page_cache_before_restart"]["fadvise_dontneed_files"] >= blocks
    hss = figures["high_speed_swap"]
    assert hss["tokens_identical"] and hss["device"] == "cpu"
    assert hss["context_tokens"] == 8 * hss["window_tokens"]
    assert hss["context_blocks"] > hss["device_pool_blocks_hss"] and hss["host_blocks_stored"] > 0
    assert not any((tmp_path / "disk").iterdir())  # the temporary tier directory is removed
