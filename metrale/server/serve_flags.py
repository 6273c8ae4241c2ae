"""`metrale serve`'s own flags: the server group (address, auth, shutdown, limits, parsers,
translation defaults) and vLLM's common serve flags, with the check of those flags that
asks for a feature metrale has not built (the engine's flags are `metrale.engine_flags`').

Owner: server. Invariants:
- A vLLM flag is accepted only with vLLM's meaning; one asking for a feature that is not
  built (`--no-enable-chunked-prefill`) is refused by
  `check_vllm_compat_flags` with an error naming the flag.
- Importing this module is cheap (argparse and the sampling limits only).
"""

from __future__ import annotations

import argparse
import logging

from metrale.errors import InvalidRequestError
from metrale.sampling.params import MAX_LOGPROBS

logger = logging.getLogger("metrale.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8888
DEFAULT_SHUTDOWN_GRACE_S = 5.0
API_KEY_ENV = "METRALE_API_KEY"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve-only flags, in their own `--help` section."""
    server = parser.add_argument_group("server", "HTTP address, auth and shutdown")
    server.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1)")
    server.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port (default 8888; 0: any free port, see the summary line)",
    )
    server.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this key (Bearer or x-api-key) on /v1/*; repeat for several keys, each "
        f"its own tenant (default: ${API_KEY_ENV})",
    )
    server.add_argument(
        "--api-key-file",
        default=None,
        help="read more API keys from this file, one per line ('#' comments; default: none)",
    )
    server.add_argument(
        "--prefix-cache-isolation",
        choices=("none", "api-key"),
        default="none",
        help="none: one prefix cache shared by all clients | api-key: blocks keyed by the "
        "request's API key, so one tenant's cache hits never show in another's timing "
        "(default: none)",
    )
    server.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        help="seconds in-flight requests may finish after SIGTERM (default 5)",
    )
    server.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="refuse prompts of more tokens (400) before templating or tokenizing them when "
        "their length alone rules them out (default: the context length less one)",
    )
    server.add_argument(
        "--restart-engine-on-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="when the engine process dies, fail its in-flight requests at once (503) and "
        "start a new one (default on; counted in metrale_engine_restarts_total)",
    )
    server.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine on a thread of the server process instead of its own process "
        "(slower under many concurrent streams: both then share one GIL; default: off)",
    )
    # Tool-call and reasoning parsers (the chat routes' output split).
    chat = server
    chat.add_argument(
        "--tool-call-parser",
        default=None,
        help="the tool-call format: hermes (qwen), qwen3_coder, llama3_json, mistral "
        "(default: read from the chat template, else hermes)",
    )
    chat.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on (default: off, no effect)",
    )
    chat.add_argument(
        "--reasoning-parser",
        default=None,
        help="split <think>...</think> into reasoning_content / thinking blocks: qwen3, "
        "deepseek_r1 (default: off; Anthropic requests with thinking enabled use qwen3's tags)",
    )
    server.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse (400) a request-body field no one defines, as OpenAI does; by default it "
        "is ignored with a warning and counted in metrale_ignored_request_fields_total, as "
        "vLLM does (default: off)",
    )
    server.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"most logprobs (top alternatives) a request may ask for, at most {MAX_LOGPROBS} "
        f"(default {MAX_LOGPROBS})",
    )
    server.add_argument(
        "--pooling",
        choices=("last", "mean"),
        default="last",
        help="how /v1/embeddings pools a prompt's final hidden states: the last token's or "
        "the mean of all (L2-normalised; default: last)",
    )
    server.add_argument(
        "--uvicorn-log-level",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default=None,
        help="uvicorn's own log level (default: warning, or debug with --log-level DEBUG)",
    )
    server.add_argument(
        "--src-lang",
        default=None,
        help="M2M100/NLLB checkpoints: source language code of requests without src_lang "
        "(default: none, src_lang required)",
    )
    server.add_argument(
        "--tgt-lang",
        default=None,
        help="M2M100/NLLB checkpoints: target language code of requests without tgt_lang "
        "(default: none, tgt_lang required)",
    )
    server.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
        "key; implies --enable-lora; default: off)",
    )


def add_vllm_compat_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's common serve flags, with vLLM's meaning where metrale has the feature."""
    compat = parser.add_argument_group(
        "vLLM compatibility", "vLLM's serve flags, accepted with the same meaning"
    )
    compat.add_argument(
        "-tp",
        dest="tensor_parallel_size",
        type=int,
        default=argparse.SUPPRESS,
        help="vLLM's short form of --tensor-parallel-size (default: 1)",
    )
    compat.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="long prompts are prefilled in chunks of --max-num-batched-tokens; metrale always "
        "does this (default on; --no-enable-chunked-prefill is refused)",
    )
    compat.add_argument(
        "--disable-log-requests",
        "--no-enable-log-requests",
        action="store_true",
        help="no per-request log lines; metrale logs none unless --log-level DEBUG (default: off)",
    )
    compat.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted and without effect: metrale never runs code from a checkpoint "
        "(default: off)",
    )


def check_vllm_compat_flags(args: argparse.Namespace) -> None:
    if not args.enable_chunked_prefill:
        raise InvalidRequestError(
            "--no-enable-chunked-prefill: metrale always chunks long prefills (by "
            "--max-num-batched-tokens); an unchunked prefill mode is not built",
            param="enable_chunked_prefill",
        )
    if args.trust_remote_code:
        logger.info("--trust-remote-code has no effect: metrale never runs checkpoint code")
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"--max-logprobs must be in 0..{MAX_LOGPROBS}, got {args.max_logprobs}",
            param="max_logprobs",
        )
