"""Translation and beam search for users: `Translator` (M2M100/NLLB checkpoints),
`BeamSearchParams` and `beam_search` (decoder-only models, vLLM's `LLM.beam_search` shape).

Owner: engine. `LLM.translate`, `LLM.beam_search`, `metrale translate` and the server's
translation requests come here; the search itself is `metrale.model_engine.beam`.

`Translator(step_graphs=True)` runs the decoder step through `EncDecStepGraphs` (CUDA graphs
over the batch ladder on a GPU).

`TranslationService` runs one `BeamSearchDriver` on a thread of its own for the server:
requests submitted from any thread join the running ones, so concurrent requests' beams share
each decoder forward.

Invariants:
- A language code is resolved to a token id of the checkpoint's tokenizer before anything
  runs; a code the tokenizer lacks is an `InvalidRequestError` naming it (HTTP 400).
- A translation's source is `[src_lang] + text tokens + [</s>]` (NLLB's and M2M100's
  layout); the decoder starts from `decoder_start_token_id` with the target code forced as
  its first generated token, which the output does not include, nor the closing EOS.
- Every call validates all of its inputs before any request starts; a call that raises
  leaves no block held.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metrale.cache.block_pool import blocks_for
from metrale.engine.request import CompletionOutput, RequestOutput
from metrale.errors import InvalidRequestError
from metrale.kernels import kernels_for
from metrale.model_engine.beam import (
    BeamOutput,
    BeamParams,
    BeamRequest,
    BeamSearchDriver,
    DecoderOnlyBeamBackend,
)
from metrale.model_engine.encdec_model import EncoderDecoderModel, load_encoder_decoder
from metrale.model_engine.factory import resolve_device, resolve_dtype
from metrale.models.m2m100_config import is_encoder_decoder_dir
from metrale.tokenizer.sentencepiece_vocab import SentencePieceVocab, has_sentencepiece_layout
from metrale.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "TranslationService",
    "Translator",
    "beam_search",
    "is_encoder_decoder_dir",
]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams` (`beam_width`, `max_tokens`, `length_penalty`) plus
    transformers' `early_stopping`, `min_tokens`, `no_repeat_ngram_size` and `n`."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0
    #: Sequences returned per prompt; None returns all `beam_width` (vLLM's behaviour).
    n: int | None = None
    #: vLLM's fields that this search does not offer; any other value is refused.
    ignore_eos: bool = False
    temperature: float = 0.0

    def to_beam_params(self) -> BeamParams:
        if self.ignore_eos:
            raise InvalidRequestError("beam search does not support ignore_eos", param="ignore_eos")
        if self.temperature != 0.0:
            raise InvalidRequestError(
                "beam search is deterministic: temperature must be 0", param="temperature"
            )
        return BeamParams(
            num_beams=self.beam_width,
            n=self.beam_width if self.n is None else self.n,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
        )


@dataclass
class BeamSearchSequence:
    #: Prompt and generated tokens (vLLM's `tokens`).
    tokens: list[int]
    output_token_ids: list[int]
    text: str
    #: `sum logprob / length ** length_penalty` (transformers' `sequences_scores`).
    score: float
    finish_reason: str


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    #: Prompt tokens whose KV was read from the prefix cache.
    num_cached_tokens: int = 0


def _prompt_ids(tok: Tokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return tok.encode(str(prompt["prompt"]))
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt"
        )
    ids = list(prompt)
    if not ids or not all(isinstance(t, int) for t in ids):
        raise InvalidRequestError(
            "a prompt is text, a prompt dict or a non-empty list of token ids", param="prompt"
        )
    return ids


def beam_search(
    model: Any, tokenizer: Tokenizer, prompts: Sequence[Any], params: BeamSearchParams
) -> list[BeamSearchOutput]:
    """Beam search on a decoder-only `TransformerModel` (idle: the offline `LLM` calls it
    between `generate` calls). Prefix-cache blocks are reclaimed if the pool is short."""
    bp = params.to_beam_params()
    eos = sorted(model.eos_token_ids() or tokenizer.eos_token_ids)
    vocab = model.vocab_size()
    reqs = []
    for i, p in enumerate(prompts):
        ids = _prompt_ids(tokenizer, p)
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"prompt {i} has a token id outside the vocabulary or no tokens", param="prompt"
            )
        if len(ids) + bp.max_tokens > model.max_context_len():
            raise InvalidRequestError(
                f"prompt {i}: {len(ids)} tokens + max_tokens {bp.max_tokens} exceed the "
                f"context length {model.max_context_len()}",
                param="max_tokens",
            )
        reqs.append(BeamRequest(f"beam-{i}", ids, bp))
    need = sum(
        bp.num_beams * blocks_for(len(r.prompt) + bp.max_tokens, model.block_size) for r in reqs
    )
    if model.num_free_blocks() < need:
        model.reclaim_prefix_blocks(need - model.num_free_blocks())
    backend = DecoderOnlyBeamBackend(model)
    outs = BeamSearchDriver(backend, eos).run(reqs)

    result = []
    for r, o in zip(reqs, outs):
        seqs = [
            BeamSearchSequence(
                r.prompt + h.token_ids,
                h.token_ids,
                tokenizer.decode(h.token_ids),
                h.score,
                h.finish_reason,
            )
            for h in o.hypotheses
        ]
        result.append(BeamSearchOutput(seqs, backend.reused_prompt_tokens.get(r.request_id, 0)))
    return result


class Translator:
    """An M2M100/NLLB checkpoint served by beam search, offline."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int | None = None,
        num_kv_blocks: int | None = None,
        block_size: int = 16,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        step_graphs: bool = False,
        kv_cache_dtype: str = "auto",
        torch_ops: bool = False,
    ) -> None:
        """`step_graphs`: decoder steps through `EncDecStepGraphs` (CUDA graphs over the
        batch ladder on a GPU; on the CPU the same static body, eagerly). `kv_cache_dtype`:
        only "auto" (float8 KV is refused for this model). `torch_ops`: the torch reference
        ops even on CUDA (a comparison for the benchmarks; the default takes the Triton
        projections and paged attention there)."""
        self.model_dir = str(model_dir)
        #: `tokenizer.json` (NLLB), or M2M100's sentencepiece files.
        self.tokenizer: Tokenizer | SentencePieceVocab = (
            SentencePieceVocab.from_dir(model_dir)
            if has_sentencepiece_layout(model_dir)
            else Tokenizer.from_dir(model_dir)
        )
        dev = resolve_device(device)
        max_len = max_model_len or 256
        self.model: EncoderDecoderModel = load_encoder_decoder(
            model_dir,
            device=dev,
            dtype=resolve_dtype(dtype, dev),
            max_model_len=max_len,
            num_blocks=num_kv_blocks,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            ops=kernels_for(dev, use_triton=False) if torch_ops else None,
        )
        if step_graphs:
            self.model.enable_step_graphs()
        cfg = self.model.config
        self.eos = cfg.eos_token_id
        self.default_src = src_lang
        self.default_tgt = tgt_lang
        self._ids = itertools.count()
        #: Beam steps, forks and copy-on-write copies of the last `translate` call.
        self.last_stats: dict[str, int] = {}

    def lang_id(self, code: str | None, param: str) -> int:
        if not code:
            raise InvalidRequestError(
                f"{param} is required (a language code such as eng_Latn)", param=param
            )
        tid = self.tokenizer.token_to_id(code)
        if tid is None or tid >= self.model.vocab_size():
            raise InvalidRequestError(
                f"{param} {code!r} is not a language code of this model's tokenizer", param=param
            )
        return tid

    def request(
        self,
        source: str | Sequence[int],
        src_lang: str | None,
        tgt_lang: str | None,
        params: BeamParams,
    ) -> BeamRequest:
        src = self.lang_id(src_lang or self.default_src, "src_lang")
        tgt = self.lang_id(tgt_lang or self.default_tgt, "tgt_lang")
        if isinstance(source, str):
            body = self.tokenizer.encode(source, add_special_tokens=False)
        else:
            body = [int(t) for t in source]
            if any(not 0 <= t < self.model.vocab_size() for t in body):
                raise InvalidRequestError(
                    "a source token id is outside the vocabulary", param="prompt"
                )
        limit = self.model.module.positions.shape[0] - self.model.config.pad_token_id - 2
        if len(body) + 2 > limit:
            raise InvalidRequestError(
                f"the source has {len(body) + 2} tokens, over the model's {limit} positions",
                param="prompt",
            )
        if params.max_tokens + 2 > self.model.max_model_len:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} is over this translator's limit "
                f"{self.model.max_model_len - 2}",
                param="max_tokens",
            )
        return BeamRequest(
            f"tr-{next(self._ids)}",
            [self.model.config.decoder_start_token_id],
            params,
            source=[src, *body, self.eos],
            forced=[tgt],
        )

    def run(self, reqs: Sequence[BeamRequest]) -> list[BeamOutput]:
        driver = BeamSearchDriver(self.model, [self.eos])
        outs = driver.run(reqs)
        self.last_stats = {
            "forwards": driver.forwards,
            "forks": driver.forks,
            "cow_copies": driver.cow_copies,
        }
        return outs

    def translate(
        self,
        texts: Sequence[str | Sequence[int]],
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        params: BeamParams | None = None,
    ) -> list[RequestOutput]:
        params = params or BeamParams()
        reqs = [self.request(t, src_lang, tgt_lang, params) for t in texts]
        outs = self.run(reqs)
        return [self.to_output(text, r, o) for text, r, o in zip(texts, reqs, outs)]

    def to_output(self, text: str | Sequence[int], r: BeamRequest, o: BeamOutput) -> RequestOutput:
        """One request's `RequestOutput`: its hypotheses, best first, EOS dropped."""
        choices = []
        for i, h in enumerate(o.hypotheses):
            ids = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
            choices.append(
                CompletionOutput(
                    index=i,
                    text=self.tokenizer.decode(ids),
                    token_ids=ids,
                    cumulative_logprob=h.score,
                    finish_reason=h.finish_reason,
                )
            )
        return RequestOutput(
            request_id=r.request_id,
            prompt=text if isinstance(text, str) else None,
            prompt_token_ids=list(r.source or []),
            outputs=choices,
            finished=True,
        )


class TranslationService:
    """A `Translator` behind a driver thread: `submit` returns a future of the outputs;
    every submitted request's beams batch with the others' in each decoder forward.

    Invariants: a future is resolved exactly once (outputs, or the step's exception, or
    cancelled by `cancel` / `shutdown`, whose requests are aborted and free their blocks)."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self._driver = BeamSearchDriver(translator.model, [translator.eos])
        self._cv = threading.Condition()
        self._incoming: list[tuple[list[BeamRequest], list[Any], Future[list[RequestOutput]]]] = []
        self._cancels: list[Future[list[RequestOutput]]] = []
        self._jobs: dict[
            str,
            tuple[list[BeamRequest], list[Any], Future[list[RequestOutput]], dict[str, BeamOutput]],
        ] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def driver(self) -> BeamSearchDriver:
        return self._driver

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="metrale-translate", daemon=True
            )
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(
        self,
        texts: Sequence[str | Sequence[int]],
        src_lang: str | None,
        tgt_lang: str | None,
        params: BeamParams,
    ) -> Future[list[RequestOutput]]:
        """Validate (raising `InvalidRequestError` at once) and queue `texts`."""
        reqs = [self.translator.request(t, src_lang, tgt_lang, params) for t in texts]
        fut: Future[list[RequestOutput]] = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("the translation service has shut down")
            self._incoming.append((reqs, list(texts), fut))
            self._cv.notify_all()
        self.start()
        return fut

    def cancel(self, fut: Future[list[RequestOutput]]) -> None:
        """Abort the submission's requests (a client went away); the future is cancelled."""
        with self._cv:
            self._cancels.append(fut)
            self._cv.notify_all()

    def _loop(self) -> None:
        driver = self._driver
        while True:
            with self._cv:
                while not (
                    self._stopped or self._incoming or self._cancels or driver.has_unfinished()
                ):
                    self._cv.wait()
                if self._stopped:
                    break
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
            for reqs, texts, fut in incoming:
                job = (reqs, texts, fut, {})
                for r in reqs:
                    driver.add_request(r)
                    self._jobs[r.request_id] = job
            for fut in cancels:
                self._drop(fut)
            if not driver.has_unfinished():
                continue
            try:
                finished = driver.step()
            except BaseException as exc:  # the driver freed every request's blocks
                logger.exception("translation step failed")
                for _, _, f, _ in {id(j[2]): j for j in self._jobs.values()}.values():
                    if not f.done():
                        f.set_exception(exc)
                self._jobs.clear()
                continue
            for out in finished:
                job = self._jobs.pop(out.request_id, None)
                if job is None:
                    continue
                reqs, texts, fut, done = job
                done[out.request_id] = out
                if len(done) == len(reqs) and not fut.done():
                    fut.set_result(
                        [
                            self.translator.to_output(t, r, done[r.request_id])
                            for t, r in zip(texts, reqs)
                        ]
                    )
        with self._cv:
            never_started, self._incoming = self._incoming, []
        for _, _, fut in never_started:
            fut.cancel()
        for rid in list(self._jobs):
            _, _, fut, _ = self._jobs.pop(rid)
            driver.abort_request(rid)
            fut.cancel()

    def _drop(self, fut: Future[list[RequestOutput]]) -> None:
        for rid, job in list(self._jobs.items()):
            if job[2] is fut:
                self._driver.abort_request(rid)
                del self._jobs[rid]
        fut.cancel()
