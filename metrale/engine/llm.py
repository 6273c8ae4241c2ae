"""`LLM`: the offline API users know from vLLM: `generate`, `chat`, `embed`, `beam_search`;
and `translate` for M2M100/NLLB checkpoints (served by a `Translator`, not the engine).

Owner: engine.

Invariants:
- Every prompt of a call is validated before any is queued, so a bad one raises and queues
  nothing; the engine stays usable for the next call.
- `chat` takes image parts (`image_url` with a data: URL, `image` with a PIL image or bytes)
  on a vision-language model; each is decoded, preprocessed and expanded into its pad tokens
  before anything is queued.
- Outputs come back in the order of the prompts given, whatever order they finished in.
- `sampling_params=None` means `get_default_sampling_params()`: `SamplingParams()` with the
  model's generation_config.json defaults (unless `generation_config="none"`), as in vLLM.
  `SamplingParams` passed in are used exactly as given.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metrale.config import EngineConfig
from metrale.engine.cpu_threads import apply_engine_threads
from metrale.engine.engine import Engine
from metrale.engine.request import LoRARequest, RequestOutput
from metrale.engine.translate import (
    BeamSearchOutput,
    BeamSearchParams,
    Translator,
    beam_search,
    is_encoder_decoder_dir,
)
from metrale.engine.vision import has_media, split_media
from metrale.errors import InvalidRequestError
from metrale.model_engine.beam import BeamParams
from metrale.sampling.params import SamplingParams
from metrale.tokenizer.sentencepiece_vocab import SentencePieceVocab
from metrale.tokenizer.tokenizer import Tokenizer

PromptInput = str | Sequence[int] | Mapping[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        max_prefill_chunk = kwargs.pop("max_prefill_chunk", None)
        # A `Proposer` instance in place of the configured method's (tests, custom drafts).
        proposer = kwargs.pop("proposer", None)
        unknown = set(kwargs) - set(EngineConfig.field_names())
        if unknown:
            raise InvalidRequestError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **kwargs)
        self._ids = itertools.count()
        #: The M2M100/NLLB checkpoint's translator; None for decoder-only models.
        self.translator: Translator | None = None
        if model is not None and is_encoder_decoder_dir(model):
            c = self.config
            self.translator = Translator(
                model,
                device=c.device,
                dtype=c.dtype,
                max_model_len=c.max_model_len,
                num_kv_blocks=c.num_kv_blocks,
                block_size=c.block_size,
            )
            return
        if self.config.cpu_threads is not None:  # else the caller's torch setting stands
            apply_engine_threads(self.config, reserve=0)
        self.engine = Engine(self.config, max_prefill_chunk=max_prefill_chunk, proposer=proposer)

    def get_tokenizer(self) -> Tokenizer | SentencePieceVocab:
        if self.translator is not None:
            return self.translator.tokenizer
        return self.engine.tokenizer

    def translate(
        self,
        texts: str | Sequence[str | Sequence[int]],
        *,
        src_lang: str,
        tgt_lang: str,
        num_beams: int = 4,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        max_tokens: int = 128,
        min_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
        n: int = 1,
    ) -> list[RequestOutput]:
        """Translate each text (or source token ids) by beam search; each output's choices
        are its best `n` hypotheses, best first (`cumulative_logprob` holds the beam score,
        `sum logprob / length ** length_penalty`)."""
        if self.translator is None:
            raise InvalidRequestError(
                "translate needs an M2M100/NLLB checkpoint; this model is decoder-only",
                param="model",
            )
        items = [texts] if isinstance(texts, str) else list(texts)
        params = BeamParams(
            num_beams=num_beams,
            n=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            no_repeat_ngram_size=no_repeat_ngram_size,
        )
        return self.translator.translate(items, src_lang, tgt_lang, params)

    def beam_search(
        self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's best beams (`params.n`, default all
        `beam_width`), best first, as transformers' `generate(num_beams=...)` ranks them."""
        if self.translator is not None:
            raise InvalidRequestError(
                "beam_search serves decoder-only models; use translate", param="model"
            )
        if self.engine.has_unfinished():
            raise InvalidRequestError("beam_search needs an idle engine (requests are running)")
        return beam_search(
            self.engine.model, self.engine.tokenizer, _as_prompt_list(prompts), params
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use without `sampling_params`: `SamplingParams()` with the
        model's generation-config defaults (temperature, top_p, top_k, min_p,
        repetition_penalty) applied; change it with `.replace(...)`."""
        return self._require_engine().default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or one (or None: the base model) per
        prompt; an adapter is loaded on first use (the engine needs `enable_lora=True` or
        `lora_modules`)."""
        items = _as_prompt_list(prompts)
        params = _params_list(sampling_params, len(items), self.get_default_sampling_params)
        adapters = self._adapter_ids(lora_request, len(items))
        return self._run([(_split_prompt(p), sp) for p, sp in zip(items, params)], adapters)

    def _adapter_ids(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[int]:
        if lora_request is None:
            return [0] * count
        if isinstance(lora_request, LoRARequest):
            return [self.engine.lora_adapter_id(lora_request)] * count
        requests = list(lora_request)
        if len(requests) != count:
            raise InvalidRequestError(
                f"got {len(requests)} lora_request entries for {count} prompts",
                param="lora_request",
            )
        return [0 if r is None else self.engine.lora_adapter_id(r) for r in requests]

    def embed(
        self, prompts: PromptInput | Sequence[PromptInput], pooling: str = "last"
    ) -> list[RequestOutput]:
        """Each prompt's embedding: its final hidden states pooled ("last" token or "mean"),
        L2-normalised, in `RequestOutput.embedding` (the one generated token is not part of
        it)."""
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        items = _as_prompt_list(prompts)
        return self._run([(_split_prompt(p), params) for p in items])

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        params = _params_list(sampling_params, len(conversations), self.get_default_sampling_params)
        tok = self._require_engine().tokenizer
        prompts: list[tuple[str | None, list[int] | None]] = []
        visions: list[Any] = []
        for conv in conversations:
            messages, images = [dict(m) for m in conv], []
            if has_media(messages):
                if self.engine.vision is None:
                    raise InvalidRequestError(
                        "this model does not take image input", param="messages"
                    )
                messages, images = split_media(messages)
            text = tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
            token_ids = tok.encode(text, add_special_tokens=False)
            vision = None
            if images:
                engine = self._require_engine()
                assert engine.vision is not None
                token_ids, vision = engine.vision.build(token_ids, images)
            prompts.append((text, token_ids))
            visions.append(vision)
        adapters = self._adapter_ids(lora_request, len(conversations))
        return self._run(list(zip(prompts, params)), adapters, visions)

    def _require_engine(self) -> Engine:
        if self.translator is not None:
            raise InvalidRequestError(
                "this is an M2M100/NLLB translation model: use LLM.translate", param="model"
            )
        return self.engine

    def _run(
        self,
        work: list[tuple[tuple[str | None, list[int] | None], SamplingParams]],
        adapters: list[int] | None = None,
        visions: Sequence[Any] | None = None,
    ) -> list[RequestOutput]:
        """`adapters[i]`, `visions[i]`: prompt i's adapter id and its images (`VisionInputs`)
        or None."""
        engine = self._require_engine()
        ids = [f"llm-{next(self._ids)}" for _ in work]
        visions = list(visions) if visions is not None else [None] * len(work)
        # Validate all first: prompt ids and token budgets, without queueing anything.
        for (text, token_ids), sp in work:
            engine.check_prompt(text if token_ids is None else None, token_ids, sp)
        added: list[str] = []
        try:
            for i, (rid, ((text, token_ids), sp)) in enumerate(zip(ids, work)):
                engine.add_request(
                    rid, text, sp, prompt_token_ids=token_ids, final_only=True,
                    adapter_id=adapters[i] if adapters else 0,
                    vision=visions[i] if visions else None,
                )  # fmt: skip
                added.append(rid)
            finals: dict[str, RequestOutput] = {}
            while len(finals) < len(ids):
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
            raise
        return [finals[rid] for rid in ids]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt of token ids
    return items


def _split_prompt(prompt: PromptInput) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"]), None
        raise InvalidRequestError(
            "a prompt dict needs 'prompt' or 'prompt_token_ids'", param="prompt"
        )
    return None, list(prompt)


def _params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    n: int,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if sampling_params is None:
        return [default()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(
            f"{len(params)} sampling params given for {n} prompts", param="sampling_params"
        )
    return params
