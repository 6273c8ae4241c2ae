"""`TensorParallelModule`: a rank's sharded architecture module behind the interface
`TransformerModel` calls (`forward`, `compute_logits`, and every other attribute passed
through), and the worker ranks' step loop.

Owner: distributed.

Invariants:
- Every rank runs the same module calls in the same order. While the model loads (the
  profile and warm-up forwards of start-up), every rank runs them itself, in lockstep; once
  rank 0 is `armed` (the engine is serving), each of its calls first sends the command, and
  the workers, in `serve_steps`, run the same call on the same inputs.
- `compute_logits` returns the full vocabulary on every rank (each rank's slice,
  all-gathered, the padding cut off); only rank 0's are sampled.
- A failed collective on rank 0 raises `EngineDeadError` naming the ranks whose process has
  died (`health`), never a bare backend error; a worker ends its loop on `STOP` or when a
  collective fails (rank 0 gone).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from metrale.distributed import protocol
from metrale.distributed.group import TensorParallel
from metrale.errors import EngineDeadError
from metrale.kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class TensorParallelModule(nn.Module):
    """The rank's sharded module (`inner`) as the engine sees a whole one."""

    def __init__(self, inner: nn.Module, tp: TensorParallel, vocab_size: int) -> None:
        super().__init__()
        self.inner = inner
        self.tp = tp
        self.full_vocab = vocab_size
        #: Rank 0 only, once serving: each call sends its command to the workers first.
        self.armed = False
        #: Rank 0: returns a message naming the dead ranks ("" when all live).
        self.health: Callable[[], str] = lambda: ""
        #: Rank 0: waits for the workers to exit after `STOP`.
        self.on_close: Callable[[], object] = lambda: None
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    # ------------------------------------------------------------------ calls

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[Any],
        **kwargs: Any,
    ) -> torch.Tensor:
        if kwargs:
            raise ValueError(f"tensor parallel forwards take no {', '.join(kwargs)}")
        if self.armed:
            head, payload = protocol.pack_forward(input_ids, positions, meta)
            self._collective(lambda: (self.tp.send_command(head), self.tp.send_command(payload)))
        return self._collective(lambda: self.inner(input_ids, positions, meta, kv_caches))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.armed:
            head = protocol.header(protocol.LOGITS, int(hidden.shape[0]))

            def send() -> None:
                self.tp.send_command(head)
                self.tp.broadcast(hidden.contiguous())

            self._collective(send)
        return self._collective(lambda: self._logits(hidden))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner.compute_logits(hidden)
        return self.tp.all_gather_last(local)[:, : self.full_vocab]

    def _collective(self, call: Callable[[], Any]) -> Any:
        if not self.tp.is_driver:
            return call()
        try:
            return call()
        except RuntimeError as exc:
            dead = self.health()
            raise EngineDeadError(
                f"tensor parallel collective failed ({dead or 'no rank has exited yet'}): {exc}"
            ) from exc

    def close(self) -> None:
        """Rank 0: tell the workers to leave their loop (best effort: they may be gone) and
        wait for them to exit; idempotent."""
        if self.closed or not self.tp.is_driver:
            return
        self.closed = True
        if self.armed:
            self.armed = False
            try:
                self.tp.send_command(protocol.header(protocol.STOP))
            except RuntimeError as exc:
                logger.warning("tensor parallel: STOP not delivered (%s)", exc)
        self.on_close()


def serve_steps(module: TensorParallelModule, kv_caches: Sequence[Any], dtype: torch.dtype) -> int:
    """A worker's loop: run rank 0's commands until `STOP`; returns the steps run."""
    tp = module.tp
    hidden_size = module.inner.config.hidden_size
    steps = 0
    with torch.inference_mode():
        while True:
            head = tp.send_command(torch.zeros(protocol.HEADER_LEN, dtype=torch.int64), idle=True)
            command = int(head[0])
            if command == protocol.STOP:
                return steps
            if command == protocol.FORWARD:
                payload = torch.empty(protocol.payload_len(head), dtype=torch.int64)
                tp.send_command(payload)
                ids, positions, meta = protocol.unpack_forward(head, payload, tp.device)
                module(ids, positions, meta, kv_caches)
                steps += 1
            elif command == protocol.LOGITS:
                hidden = torch.empty(int(head[1]), hidden_size, dtype=dtype, device=tp.device)
                module.compute_logits(tp.broadcast(hidden))
            else:
                raise RuntimeError(f"tensor parallel worker {tp.rank}: unknown command {command}")
