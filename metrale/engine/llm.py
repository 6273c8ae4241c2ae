"""`LLM`: the offline API users know from vLLM: `generate`, `chat`, `embed`.

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
from metrale.engine.engine import Engine
from metrale.engine.request import RequestOutput
from metrale.engine.vision import has_media, split_media
from metrale.errors import InvalidRequestError
from metrale.sampling.params import SamplingParams
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
        self.engine = Engine(self.config, max_prefill_chunk=max_prefill_chunk, proposer=proposer)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use without `sampling_params`: `SamplingParams()` with the
        model's generation-config defaults (temperature, top_p, top_k, min_p,
        repetition_penalty) applied; change it with `.replace(...)`."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        items = _as_prompt_list(prompts)
        params = _params_list(sampling_params, len(items), self.get_default_sampling_params)
        return self._run([(_split_prompt(p), sp) for p, sp in zip(items, params)])

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
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        conversations = (
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        )
        params = _params_list(sampling_params, len(conversations), self.get_default_sampling_params)
        tok = self.engine.tokenizer
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
                assert self.engine.vision is not None
                token_ids, vision = self.engine.vision.build(token_ids, images)
            prompts.append((text, token_ids))
            visions.append(vision)
        return self._run(list(zip(prompts, params)), visions)

    def _run(
        self,
        work: list[tuple[tuple[str | None, list[int] | None], SamplingParams]],
        visions: Sequence[Any] | None = None,
    ) -> list[RequestOutput]:
        """`visions[i]`: prompt i's images (`VisionInputs`) or None."""
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in work]
        visions = list(visions) if visions is not None else [None] * len(work)
        # Validate all first: prompt ids and token budgets, without queueing anything.
        for (text, token_ids), sp in work:
            engine.check_prompt(text if token_ids is None else None, token_ids, sp)
        added: list[str] = []
        try:
            for rid, ((text, token_ids), sp), vision in zip(ids, work, visions, strict=True):
                engine.add_request(
                    rid, text, sp, prompt_token_ids=token_ids, final_only=True, vision=vision
                )
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
