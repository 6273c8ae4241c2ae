"""Start-up progress: weights shard by shard (bytes and rate), then KV sizing, graph capture
and kernel warm-up, as a progress bar on a terminal or as plain log lines otherwise.

Owner: model-engine (start-up). The loader (`metrale.models.loader.load_weights`) and the
factory (`metrale.model_engine.factory.load_model`) take a `LoadProgress` argument and call it
between shards and phases; `Engine` builds one with `load_progress()` unless given one.

Invariants:
- Nothing here is global: a reporter is an object passed down, and `NullProgress` (the
  loader's default) does nothing.
- Never on a step's path: called once per tensor at most, and only while loading.
- `LogProgress` writes one log line per shard and per finished phase (logger
  `metrale.progress`, INFO), so a non-TTY start-up (a server under systemd, a test) still
  says where it is; `BarProgress` draws a rich bar only when the stream is a terminal.
- Importing this module is cheap: rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger("metrale.progress")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop always returns


class LoadProgress:
    """What a load reports. The base class does nothing (it is `NullProgress`); reporters
    override the calls they show."""

    def begin_weights(self, num_files: int, total_bytes: int) -> None:
        """Weight reading starts: `num_files` safetensors files of `total_bytes` bytes."""

    def advance(self, nbytes: int) -> None:
        """`nbytes` more weight bytes were copied into the model (one tensor)."""

    def shard_done(self, index: int, path: Path, nbytes: int) -> None:
        """File `index` (0-based) of the checkpoint, `nbytes` on disk, is fully read."""

    def end_weights(self) -> None:
        """Every shard is read."""

    def begin_phase(self, name: str) -> None:
        """A start-up phase after the weights starts (KV sizing, graph capture, warm-up)."""

    def end_phase(self, name: str, detail: str = "") -> None:
        """That phase is done; `detail` says what it produced."""

    def close(self) -> None:
        """The load is over (or failed): release the terminal."""


NullProgress = LoadProgress


class _Counts(LoadProgress):
    """Bytes, files and times shared by both reporters."""

    def __init__(self) -> None:
        self.num_files = 0
        self.total_bytes = 0
        self.done_bytes = 0
        self.started = 0.0
        self.phase_started: dict[str, float] = {}

    def begin_weights(self, num_files: int, total_bytes: int) -> None:
        self.num_files, self.total_bytes, self.done_bytes = num_files, total_bytes, 0
        self.started = time.perf_counter()

    def shard_done(self, index: int, path: Path, nbytes: int) -> None:
        self.done_bytes += nbytes

    def rate(self) -> float:
        elapsed = time.perf_counter() - self.started
        return self.done_bytes / elapsed if elapsed > 0 else 0.0

    def shard_line(self, index: int, path: Path, nbytes: int) -> str:
        return (
            f"weights: shard {index + 1}/{self.num_files} {path.name} ({human_bytes(nbytes)}), "
            f"{human_bytes(self.done_bytes)} / {human_bytes(self.total_bytes)} "
            f"at {human_bytes(self.rate())}/s"
        )

    def weights_line(self) -> str:
        elapsed = time.perf_counter() - self.started
        return (
            f"weights: {self.num_files} file(s), {human_bytes(self.done_bytes)} in "
            f"{elapsed:.2f}s ({human_bytes(self.rate())}/s)"
        )

    def begin_phase(self, name: str) -> None:
        self.phase_started[name] = time.perf_counter()

    def phase_line(self, name: str, detail: str) -> str:
        took = time.perf_counter() - self.phase_started.pop(name, time.perf_counter())
        return f"{name}: {detail + ', ' if detail else ''}{took:.2f}s"


class LogProgress(_Counts):
    """Plain log lines: one per shard, one for the weights, one per finished phase."""

    def __init__(self, log: logging.Logger = logger) -> None:
        super().__init__()
        self.log = log

    def shard_done(self, index: int, path: Path, nbytes: int) -> None:
        super().shard_done(index, path, nbytes)
        self.log.info("%s", self.shard_line(index, path, nbytes))

    def end_weights(self) -> None:
        self.log.info("%s", self.weights_line())

    def end_phase(self, name: str, detail: str = "") -> None:
        self.log.info("%s", self.phase_line(name, detail))


class BarProgress(_Counts):
    """A rich progress bar of the weight bytes (with rate), then a spinner per phase; the
    finished lines stay on the terminal."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )

        self.console = Console(file=stream)
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        )
        self.task: Any = None
        self.status: Any = None

    def begin_weights(self, num_files: int, total_bytes: int) -> None:
        super().begin_weights(num_files, total_bytes)
        self.bar.start()
        self.task = self.bar.add_task(f"weights 0/{num_files}", total=total_bytes)

    def advance(self, nbytes: int) -> None:
        if self.task is not None:
            self.bar.advance(self.task, nbytes)

    def shard_done(self, index: int, path: Path, nbytes: int) -> None:
        super().shard_done(index, path, nbytes)
        if self.task is not None:
            self.bar.update(
                self.task,
                completed=self.done_bytes,
                description=f"weights {index + 1}/{self.num_files}",
            )

    def end_weights(self) -> None:
        if self.task is not None:
            self.bar.remove_task(self.task)
            self.task = None
        self.bar.stop()
        self._print(self.weights_line())

    def begin_phase(self, name: str) -> None:
        super().begin_phase(name)
        self.status = self.console.status(f"{name} ...")
        self.status.start()

    def end_phase(self, name: str, detail: str = "") -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        self._print(self.phase_line(name, detail))

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        self.bar.stop()
        if self.status is not None:
            self.status.stop()
            self.status = None


def load_progress(stream: TextIO | None = None) -> LoadProgress:
    """A bar when `stream` (default: stdout) is a terminal, else log lines."""
    stream = stream if stream is not None else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if tty:
        try:
            return BarProgress(stream)
        except ImportError:  # rich missing: fall back to the lines
            pass
    return LogProgress()
