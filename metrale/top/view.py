"""Drawing a `Frame`: `sections` lays it out as titled label/value rows once; `render_text`
prints them as plain text (`--once`, scripts, tests) and `render_rich` as rich panels (the
live view and its SVG screenshot).

Owner: top.

Invariants:
- Both renderings show the same rows in the same order; a value not known yet is `-`.
- The speculation and LoRA sections appear only when the frame has them.
- Importing this module does not import rich (`render_rich` does).
"""

from __future__ import annotations

from typing import Any

from metrale.top.frame import Frame

Section = tuple[str, list[tuple[str, str]]]


def _num(value: float | None, fmt: str = "{:,.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _switches(counts: dict[str, int]) -> str:
    """`global 1/2, row 3/4`: the throughput gate's switches off / on, per scope."""
    scopes = sorted({key.split("->")[0] for key in counts})
    return (
        ", ".join(f"{s} {counts.get(f'{s}->off', 0)}/{counts.get(f'{s}->on', 0)}" for s in scopes)
        or "-"
    )


def sections(frame: Frame) -> list[Section]:
    out: list[Section] = [
        (
            "server",
            [
                ("url", frame.url),
                ("model", frame.model),
                ("dtype", frame.dtype),
                ("device", frame.device),
                ("max model len", _num(frame.max_model_len, "{:d}")),
                ("engine alive", "yes" if frame.engine_alive else "NO"),
            ],
        ),
        (
            "requests",
            [
                ("running", str(frame.running)),
                ("waiting", str(frame.waiting)),
                ("swapped", str(frame.swapped)),
                ("http in flight", str(frame.http_active)),
                ("http total", f"{frame.requests_total:,}"),
                (
                    "finished",
                    ", ".join(f"{k} {v:,}" for k, v in sorted(frame.finished.items())) or "-",
                ),
            ],
        ),
        (
            "throughput",
            [
                (
                    "prompt tok/s",
                    _num(frame.prompt_tok_s) if frame.rate_interval_s else "- (2 scrapes)",
                ),
                ("generation tok/s", _num(frame.generation_tok_s)),
                ("prompt tokens", f"{frame.prompt_tokens:,}"),
                ("generation tokens", f"{frame.generation_tokens:,}"),
            ],
        ),
        (
            f"latency ({frame.latency_scope})",
            [
                ("TTFT p50", _ms(frame.ttft_p50)),
                ("TTFT p99", _ms(frame.ttft_p99)),
                ("ITL p50", _ms(frame.itl_p50)),
                ("ITL p99", _ms(frame.itl_p99)),
            ],
        ),
        (
            "KV cache",
            [
                ("blocks total", f"{frame.kv_total:,}"),
                ("blocks used", f"{frame.kv_used:,}"),
                ("blocks cached", f"{frame.kv_cached:,}"),
                ("not free", _pct(frame.kv_usage)),
                ("prefix hit rate", _pct(frame.prefix_hit_rate)),
            ],
        ),
        (
            "trouble",
            [
                ("preemptions", f"{frame.preemptions:,}"),
                ("timeouts", f"{frame.timeouts:,}"),
                ("aborts", f"{frame.aborts:,}"),
                (
                    "errors",
                    ", ".join(f"{k}: {v:,}" for k, v in sorted(frame.errors.items())) or "none",
                ),
            ],
        ),
    ]
    if frame.spec is not None:
        spec = frame.spec
        out.append(
            (
                "speculation",
                [
                    ("drafts", f"{spec.drafts:,}"),
                    ("draft tokens", f"{spec.draft_tokens:,}"),
                    ("accepted tokens", f"{spec.accepted_tokens:,}"),
                    ("acceptance", _pct(spec.acceptance)),
                    ("acceptance (recent)", _pct(spec.acceptance_recent)),
                    (
                        "per position",
                        " ".join(f"{p:.2f}" for p in spec.per_position) or "-",
                    ),
                    ("verify steps", f"{spec.verify_steps:,}"),
                    ("gate off/on", _switches(spec.gate_switches)),
                ],
            )
        )
    if frame.lora is not None:
        out.append(("LoRA", [(k, f"{v:,.6g}") for k, v in sorted(frame.lora.items())]))
    return out


def render_text(frame: Frame) -> str:
    lines = []
    for title, rows in sections(frame):
        lines.append(f"[{title}]")
        width = max(len(label) for label, _ in rows)
        lines.extend(f"  {label:<{width}}  {value}" for label, value in rows)
    return "\n".join(lines) + "\n"


def render_rich(frame: Frame, status: str = "") -> Any:
    """A rich renderable: one panel per section, two columns of panels."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    panels = []
    for title, rows in sections(frame):
        table = Table.grid(padding=(0, 2))
        table.add_column(style="dim")
        table.add_column(justify="right", style="bold")
        for label, value in rows:
            style = "red" if (label == "engine alive" and value == "NO") else ""
            table.add_row(label, Text(value, style=style))
        panels.append(Panel(table, title=title, border_style="cyan", width=46))
    header = Text(f"metrale top  {frame.url}  ", style="bold")
    header.append(status or "refresh every scrape; Ctrl-C quits", style="dim")
    return Group(header, Columns(panels))
