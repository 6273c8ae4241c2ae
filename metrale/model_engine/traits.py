"""The model-engine interface: `SequenceState`, the pass I/O types and the `Model` protocols.

This module mirrors `spec/traits.rs` of the seed (Metrale's Rust engine) in Python, with the
seed's names. A `DevicePtr` becomes a `torch.Tensor` (None for NULL) and a `stream: u64`
becomes an optional torch stream (None for the default stream).

Owner: model-engine. The scheduler reaches a model only through the classes here, so a test
model can stand in for a real one. As in the seed (traits.rs + traits/model/*.rs) the parts
live in their own modules and this one gathers them: `sequence` (SequenceState and the pass
I/O types), `protocols` (streams, lifecycle, forward, logits) and `capabilities` (adapters,
SSM state, verify, draft, vision, EP, device feed, circuit).

Invariants:
- Importing this module never imports torch: the scheduler core is pure Python.
- Each capability a model lacks keeps the seed's default: a neutral value (False, 0, None, an
  empty list) or an `Unsupported` error that names the method. No default silently drops work.
- Methods the seed marks **required** are abstract only where every model must provide them to
  be driven by the scheduler (`alloc_sequence`, `cache_sequence`, `free_sequence`,
  `prefill_chunk`, `decode_batch`, `vocab_size`); the other required-in-the-seed methods refuse
  with `Unsupported` until a model implements them.
"""

from __future__ import annotations

from metrale.model_engine.capabilities import (
    ModelAdapters,
    ModelCircuit,
    ModelDeviceFeed,
    ModelDraft,
    ModelEp,
    ModelSsmState,
    ModelVerify,
    ModelVision,
)
from metrale.model_engine.protocols import (
    ModelForward,
    ModelLifecycle,
    ModelLogits,
    ModelStreams,
)
from metrale.model_engine.sequence import (
    DECODE_BATCH_LADDER,
    DETACHED_SLOT,
    FED_TOKEN,
    BeamReq,
    ChunkedPrefillPageMetadata,
    FeedSource,
    ForwardDisclosure,
    ForwardSelect,
    MixedBatchResult,
    MixedForwardResult,
    PrefillSlice,
    PrefixReclaim,
    PromptTokenLogprob,
    SequenceState,
    SlotGuardLike,
    Stream,
    Tensor,
    VerifyBatchedOpts,
    blocks_for,
    blocks_needed,
    padded_batch_n,
)

__all__ = [
    "DECODE_BATCH_LADDER",
    "DETACHED_SLOT",
    "FED_TOKEN",
    "BeamReq",
    "ChunkedPrefillPageMetadata",
    "FeedSource",
    "ForwardDisclosure",
    "ForwardSelect",
    "MixedBatchResult",
    "MixedForwardResult",
    "Model",
    "ModelAdapters",
    "ModelCircuit",
    "ModelDeviceFeed",
    "ModelDraft",
    "ModelEp",
    "ModelForward",
    "ModelLifecycle",
    "ModelLogits",
    "ModelSsmState",
    "ModelStreams",
    "ModelVerify",
    "ModelVision",
    "PrefillSlice",
    "PrefixReclaim",
    "PromptTokenLogprob",
    "SequenceState",
    "SlotGuardLike",
    "Stream",
    "Tensor",
    "VerifyBatchedOpts",
    "blocks_for",
    "blocks_needed",
    "padded_batch_n",
]


class Model(
    ModelLifecycle,
    ModelForward,
    ModelLogits,
    ModelAdapters,
    ModelSsmState,
    ModelVerify,
    ModelDraft,
    ModelVision,
    ModelEp,
    ModelDeviceFeed,
    ModelCircuit,
):
    """The whole model-engine interface; one implementation per model family."""
