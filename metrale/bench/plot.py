"""`metrale bench plot RECORDS... --out DIR`: PNG charts of the benchmark records.

Owner: bench. Reads the JSON records `write_record` writes (files, or directories of them) and
draws, with matplotlib's headless Agg backend:
- `serve-ladder-<shape>.png`: the newest serve ladder (3 rungs or more) of each model shape,
  aggregate tok/s and TPOT against concurrency, with the peer measured in the same run;
- `decode-roofline.png`: the newest batch-1 decode (`latency`) of each shape against its HBM
  roofline and the peer of that run;
- `history-<instrument>-<shape>.png`: an instrument's headline figure over the records' commits
  (time order), to catch regressions.

Invariants:
- The Agg backend is selected before pyplot is imported; no display is needed or opened.
- A record this module does not understand (another instrument, an older shape of figures)
  is skipped, never an error; an empty selection writes nothing and says so.
- Output names depend only on the records, so re-running over the same records rewrites the
  same files (`make plots`).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Instruments with a history chart, and their headline figure(s): label -> reader.
HISTORY: dict[str, dict[str, Callable[[dict[str, Any]], float | None]]] = {}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", nargs="+", help="record files or directories of them")
    p.add_argument("--out", default="docs/charts", help="directory for the PNGs")
    p.add_argument(
        "--instrument",
        action="append",
        choices=["latency", "serve", "throughput"],
        help="history charts only for these instruments (repeatable; default: all three)",
    )


def load_records(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every record under `paths` (JSON files, or directories' `*.json`), oldest first."""
    records = []
    for raw in paths:
        path = Path(raw)
        files = sorted(path.glob("*.json")) if path.is_dir() else [path]
        for f in files:
            try:
                record = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                logger.warning("skipping %s: %s", f, exc)
                continue
            if isinstance(record, dict) and "instrument" in record:
                record["_file"] = f.name
                records.append(record)
    return sorted(records, key=lambda r: (str(r.get("time", "")), r["_file"]))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ladder(record: dict[str, Any]) -> list[dict[str, Any]]:
    figures = record.get("figures")
    if not isinstance(figures, list):
        return []
    return sorted(
        (f for f in figures if isinstance(f, dict) and "concurrency" in f),
        key=lambda f: f["concurrency"],
    )


def _peer_points(record: dict[str, Any]) -> list[tuple[int, float, bool]]:
    """(batch, tok/s, compiled) of a serve record's peer runs."""
    peers = record.get("peer_figures")
    if not isinstance(peers, dict):
        return []
    out = []
    for value in peers.values():
        if isinstance(value, dict) and "batch" in value and "tok_s" in value:
            out.append((int(value["batch"]), float(value["tok_s"]), bool(value.get("compiled"))))
    return sorted(out)


def plot_serve_ladder(record: dict[str, Any], out: Path) -> Path:
    plt = _pyplot()
    rungs = _ladder(record)
    conc = [f["concurrency"] for f in rungs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(conc, [f["aggregate_tok_s"] for f in rungs], "o-", label="metrale")
    ax2.plot(conc, [f["tpot_ms"]["p50"] for f in rungs], "o-", label="metrale p50")
    ax2.plot(conc, [f["tpot_ms"]["p99"] for f in rungs], "o--", alpha=0.6, label="metrale p99")
    peers = _peer_points(record)
    for compiled in (False, True):
        pts = [(b, t) for b, t, c in peers if c is compiled]
        if pts:
            name = "HF compiled" if compiled else "HF eager"
            ax1.plot(*zip(*pts), "s:", label=f"{name} (same run)")
            # A static batch of b streams at t tok/s in total spends b / t s per token each.
            ax2.plot([b for b, _ in pts], [1000 * b / t for b, t in pts], "s:", label=name)
    for ax, label in ((ax1, "aggregate output tok/s"), (ax2, "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_yscale("log")
    ax2.set_yscale("log")
    cfg = record.get("config", {})
    fig.suptitle(
        f"serve ladder, {record.get('model_shape')} on {record.get('device')} "
        f"(ISL {cfg.get('isl')}, OSL {cfg.get('osl')}; commit {record.get('commit')})",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / f"serve-ladder-{record.get('model_shape')}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roofline(records: list[dict[str, Any]], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.27
    for i, rec in enumerate(records):
        fig_ = rec["figures"]
        peer = rec.get("peer_figures") or {}
        bars = [
            ("metrale", fig_["tok_s"], "tab:blue"),
            ("HBM roofline", fig_["roofline_tok_s"], "tab:gray"),
            ("HF peer", peer.get("tok_s") if isinstance(peer, dict) else None, "tab:orange"),
        ]
        for j, (label, value, color) in enumerate(bars):
            if value is None:
                continue
            ax.bar(i + (j - 1) * width, value, width, color=color, label=label if i == 0 else None)
            ax.text(
                i + (j - 1) * width, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=7
            )
    ax.set_xticks(
        range(len(records)),
        [
            f"{r['model_shape']} ({r.get('commit')})\n"
            f"{r['figures']['tok_s'] / r['figures']['roofline_tok_s']:.0%} of the roofline"
            for r in records
        ],
    )
    ax.set_yscale("log")
    ax.set_ylabel("batch-1 decode tok/s")
    ax.set_title(f"batch-1 decode vs its roofline ({records[0].get('device')})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "decode-roofline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rung(conc: int) -> Callable[[dict[str, Any]], float | None]:
    def read(record: dict[str, Any]) -> float | None:
        return next(
            (f["aggregate_tok_s"] for f in _ladder(record) if f["concurrency"] == conc), None
        )

    return read


def _field(name: str) -> Callable[[dict[str, Any]], float | None]:
    def read(record: dict[str, Any]) -> float | None:
        figures = record.get("figures")
        value = figures.get(name) if isinstance(figures, dict) else None
        return float(value) if isinstance(value, int | float) else None

    return read


HISTORY.update(
    latency={"tok/s": _field("tok_s"), "roofline tok/s": _field("roofline_tok_s")},
    serve={"C=1 tok/s": _rung(1), "C=128 tok/s": _rung(128)},
    throughput={"output tok/s": _field("output_tok_s")},
)


def plot_history(
    instrument: str, shape: str, records: list[dict[str, Any]], out: Path
) -> Path | None:
    """The instrument's headline series over `records` (time order) on one axis; the dotted
    line is the first series' best, so a regression shows as a drop below it."""
    readers = HISTORY[instrument]
    series = {label: [read(r) for r in records] for label, read in readers.items()}
    first = next(iter(readers))
    if sum(v is not None for v in series[first]) < 2:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    xs = list(range(len(records)))
    values: list[float] = []
    for label, ys in series.items():
        pts = [(x, v) for x, v in zip(xs, ys) if v is not None]
        if pts:
            ax.plot(*zip(*pts), "o-" if label == first else "s--", label=label)
            values += [v for _, v in pts]
    ax.axhline(max(v for v in series[first] if v is not None), color="gray", ls=":", lw=1)
    if max(values) > 20 * min(values):
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_xticks(xs, [str(r.get("commit", "?"))[:7] for r in records], rotation=60, fontsize=7)
    ax.set_xlabel("commit (record time order)")
    ax.set_ylabel("tok/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{instrument} {shape} over commits ({records[-1].get('device')})", fontsize=10)
    fig.tight_layout()
    path = out / f"history-{instrument}-{shape}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_records(
    records: list[dict[str, Any]], out: Path, instruments: Iterable[str] | None = None
) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    by_kind: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_kind[(r["instrument"], str(r.get("model_shape")))].append(r)
    for (instrument, _), recs in sorted(by_kind.items()):
        if instrument != "serve":
            continue
        ladders = [r for r in recs if len(_ladder(r)) >= 3]
        if ladders:
            written.append(plot_serve_ladder(ladders[-1], out))
    latest = [
        recs[-1]
        for (instrument, _), recs in sorted(by_kind.items())
        if instrument == "latency" and isinstance(recs[-1].get("figures"), dict)
        and "roofline_tok_s" in recs[-1]["figures"]
    ]  # fmt: skip
    if latest:
        written.append(plot_roofline(latest, out))
    wanted = set(instruments or HISTORY)
    for (instrument, shape), recs in sorted(by_kind.items()):
        if instrument in wanted and instrument in HISTORY:
            path = plot_history(instrument, shape, recs, out)
            if path is not None:
                written.append(path)
    return written


def run(args: argparse.Namespace) -> None:
    records = load_records(args.records)
    written = plot_records(records, Path(args.out), args.instrument)
    if not written:
        print(f"no chartable records among {len(records)} read")
    for path in written:
        print(path)
