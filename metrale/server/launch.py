"""`metrale serve`: load the model, bind the port, run uvicorn, drain on SIGTERM / Ctrl-C.

Owner: server. `add_serve_parser` adds the subcommand (its own flags are
`serve_flags.py`'s; engine flags derive from `EngineConfig` through
`metrale.engine_flags.add_engine_arguments`); `serve` runs it.

Invariants:
- Loopback (127.0.0.1) unless `--host` says otherwise; binding 0.0.0.0 logs a warning, all
  the more without an API key.
- The port is bound before the "listening" summary is logged, so the summary never lies; a
  port in use is a one-line error, not a traceback. The summary counts KV blocks as the
  engine's gauges do: usable blocks, plus the pool's one null block named apart.
- SIGTERM or Ctrl-C: stop accepting connections and new requests, let in-flight requests
  finish for `--shutdown-grace` seconds, then end the rest with an error frame / 503, stop
  the engine thread and exit 0. A second Ctrl-C exits at once.
- The engine handle is a `SupervisedEngine`: a dead engine fails its in-flight requests at
  once and, unless `--no-restart-engine-on-failure`, is restarted without restarting the
  server. With `--data-parallel-size N` (> 1) it is a `ReplicatedEngine` over N supervised
  `EngineProcess` replicas (`metrale.engine.replicas`): a dead replica's requests fail, the
  others keep serving.
- vLLM's common serve flags are accepted with vLLM's meaning; one asking for a feature that
  is not built (`--tensor-parallel-size 2`) is a start-up error naming the feature.
- An M2M100/NLLB checkpoint is served by `metrale.server.translation` (beam search on a
  driver thread of this process), with the same address, auth and summary line rules.
- Importing this module is cheap (no FastAPI/uvicorn/torch until the command runs).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import inspect
import logging
import os
import signal
import socket
import time
from pathlib import Path
from types import FrameType
from typing import Any

from metrale.engine.router import DEFAULT_LOAD_MARGIN
from metrale.errors import InvalidRequestError, MetraleError
from metrale.server.serve_flags import (
    API_KEY_ENV,
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_SHUTDOWN_GRACE_S,
    add_server_arguments,
    add_vllm_compat_flags,
)

# `_check_vllm_compat_flags`: the name the API-surface tests import from here.
from metrale.server.serve_flags import check_vllm_compat_flags as _check_vllm_compat_flags

logger = logging.getLogger("metrale.server")


def add_serve_parser(subparsers: Any) -> None:
    from metrale.engine_flags import add_engine_arguments, add_log_level

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Serve MODEL (a checkpoint directory; default: the bundled model) over "
        "/v1/completions, /v1/chat/completions, /v1/messages, /v1/models, /health, /metrics.",
    )
    add_log_level(parser)
    # The serve-only flags get their own --help section; the engine's follow, by topic.
    add_server_arguments(parser)
    add_vllm_compat_flags(parser)
    add_engine_arguments(parser, positional_model=True)
    parser.set_defaults(handler=serve_from_args)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequestError(f"cannot resolve --host {host!r}: {exc}", param="host") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise InvalidRequestError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", param="port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_from_args(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise MetraleError("metrale serve needs the server extras: pip install 'metrale[server]'")
    from metrale.engine_flags import engine_config_from_args, served_model_names

    _check_vllm_compat_flags(args)
    lora_updates = bool(args.enable_lora_runtime_updates)
    config = engine_config_from_args(args, **({"enable_lora": True} if lora_updates else {}))
    from metrale.server.auth import read_key_file

    api_key = list(args.api_key or [])
    if args.api_key_file:
        try:
            api_key += read_key_file(args.api_key_file)
        except OSError as exc:
            raise InvalidRequestError(
                f"cannot read --api-key-file {args.api_key_file}: {exc.strerror or exc}",
                param="api_key_file",
            ) from None
    if not api_key and os.environ.get(API_KEY_ENV):
        api_key = [os.environ[API_KEY_ENV]]
    if args.prefix_cache_isolation == "api-key" and not api_key:
        raise InvalidRequestError(
            "--prefix-cache-isolation api-key needs at least one --api-key",
            param="prefix_cache_isolation",
        )
    if not 0 <= args.port < 65536:
        raise InvalidRequestError(f"--port must be in 0..65535, got {args.port}", param="port")
    if args.shutdown_grace < 0:
        raise InvalidRequestError("--shutdown-grace must be >= 0", param="shutdown_grace")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise InvalidRequestError("--max-prompt-tokens must be >= 1", param="max_prompt_tokens")
    from metrale.server.reasoning import get_reasoning_parser
    from metrale.server.tool_parsers import get_parser

    if args.tool_call_parser:
        get_parser(args.tool_call_parser)  # an unknown name fails here, naming the choices
    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)
    if args.enable_auto_tool_choice:
        logger.info("--enable-auto-tool-choice: accepted (tool_choice 'auto' is always on)")
    return serve(
        config,
        host=args.host,
        port=args.port,
        api_key=api_key,
        shutdown_grace=args.shutdown_grace,
        log_level=str(args.log_level).upper(),
        engine_process=not args.engine_in_process,
        max_prompt_tokens=args.max_prompt_tokens,
        prefix_cache_isolation=args.prefix_cache_isolation,
        restart_engine=args.restart_engine_on_failure,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_name=served_model_names(args) or None,
        strict_request_fields=args.strict_request_fields,
        max_logprobs=args.max_logprobs,
        uvicorn_log_level=args.uvicorn_log_level,
        pooling=args.pooling,
        src_lang=args.src_lang,
        tgt_lang=args.tgt_lang,
        enable_lora_runtime_updates=lora_updates,
        data_parallel_size=args.data_parallel_size,
        data_parallel_load_margin=args.data_parallel_load_margin,
    )


def serve(
    config: Any,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | list[str] | None = None,
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S,
    log_level: str = "INFO",
    engine_process: bool = True,
    restart_engine: bool = True,
    served_model_name: list[str] | None = None,
    uvicorn_log_level: str | None = None,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    data_parallel_size: int = 1,
    data_parallel_load_margin: int = DEFAULT_LOAD_MARGIN,
    **app_options: Any,
) -> int:
    """Load `config`'s model and serve it until stopped. `app_options`: `create_app`'s
    request policy keywords (prompt limits, parsers, strict fields, logprobs, pooling, the
    LoRA endpoints), passed to it unread, so their defaults live there only."""
    import uvicorn

    from metrale.engine.async_engine import AsyncEngine, EngineHandle
    from metrale.engine.engine import resolve_model_dir
    from metrale.engine.engine_process import EngineProcess
    from metrale.engine.supervisor import SupervisedEngine
    from metrale.models.m2m100_config import is_encoder_decoder_dir
    from metrale.server.app import create_app

    inspect.signature(create_app).bind(None, **app_options)  # a wrong name fails before loading
    model_dir = resolve_model_dir(config.model)
    if is_encoder_decoder_dir(model_dir):
        return _serve_translation(config, host, port, api_key, log_level, src_lang, tgt_lang)
    logger.info(
        "loading model %s (device %s, dtype %s, engine %s) ...",
        model_dir,
        config.device,
        config.dtype,
        f"{data_parallel_size} replicas, each in its own process"
        if data_parallel_size > 1
        else "in its own process"
        if engine_process
        else "on a thread of this process",
    )
    start = time.perf_counter()

    def build() -> EngineHandle:
        return EngineProcess(config) if engine_process else AsyncEngine.from_config(config)

    engine: EngineHandle
    if data_parallel_size > 1:
        engine = _replicated(config, data_parallel_size, data_parallel_load_margin, restart_engine)
    else:
        engine = SupervisedEngine(build, restart=restart_engine)
    info = engine.info
    logger.info("model loaded in %.1f s", time.perf_counter() - start)

    sock = _bind(host, port)
    app = create_app(engine, api_key=api_key, served_model_name=served_model_name, **app_options)
    _freeze_startup_objects()
    drainer = _Drainer(engine, shutdown_grace)
    server = _make_server_class()(
        uvicorn.Config(
            app,
            log_config=None,
            log_level=uvicorn_log_level
            or (log_level.lower() if log_level == "DEBUG" else "warning"),
            access_log=log_level == "DEBUG",
            timeout_graceful_shutdown=max(1, int(shutdown_grace + 2)),
            timeout_keep_alive=5,
            lifespan="on",
        ),
        drainer,
    )
    if log_level != "DEBUG" and uvicorn_log_level is None:
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)

    if host in ("0.0.0.0", "::"):
        logger.warning(
            "listening on all interfaces (%s)%s", host, "" if api_key else " WITHOUT an API key"
        )
    logger.info(
        "serving %s on %s %s | KV %d usable blocks (+1 null) x %d tokens | max_model_len %d | "
        "max_num_seqs %d | prefix caching %s | %s%s",
        info.served_model_name,
        info.device,
        info.dtype,
        info.num_total_blocks,
        info.kv_block_size,
        info.max_model_len,
        config.max_num_seqs,
        "on" if config.enable_prefix_caching else "off",
        _url(sock),
        " (API key required)" if api_key else "",
    )
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    logger.info("server stopped")
    return 0


def _freeze_startup_objects() -> None:
    """Move every object alive after start-up (the app, its routes and models, the
    tokenizer, torch) out of the collector's reach, as the engine process does: a full
    collection then scans only what serving allocates. Measured (issue 26): ~211k tracked
    objects made a full collection take ~106 ms on this project's CPU machine
    (`tools/host_costs_cpu.py`), and one striking while 16 streams started held their tokens
    back (the CPU ladder's C=16 rung: TTFT ~190-230 ms for a batch of requests whose tokens
    then came in 1-7 chunks)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "start-up objects frozen for the collector (%d, %.0f ms)",
        gc.get_freeze_count(), 1000 * (time.perf_counter() - start),
    )  # fmt: skip


def _replicated(config: Any, size: int, load_margin: int, restart: bool) -> Any:
    """`size` supervised `EngineProcess` replicas (each on its own GPU on CUDA, sharing the
    cores on the CPU) behind a `ReplicatedEngine`."""
    from metrale.engine.engine_process import EngineProcess
    from metrale.engine.replicas import ReplicatedEngine, build_replicas, replica_envs
    from metrale.engine.supervisor import SupervisedEngine

    envs = replica_envs(config.device, size)

    def factory(env: dict[str, str]) -> Any:
        def build() -> Any:
            return EngineProcess(config, child_env=env)

        return lambda: SupervisedEngine(build, restart=restart)

    replicas = build_replicas([factory(env) for env in envs])
    for index, (replica, env) in enumerate(zip(replicas, envs, strict=True)):
        logger.info(
            "data-parallel replica %d: %s %s, %d KV blocks%s", index, replica.info.device,
            replica.info.dtype, replica.info.num_total_blocks,
            "".join(f", {k}={v}" for k, v in env.items()),
        )  # fmt: skip
    return ReplicatedEngine(replicas, load_margin=load_margin)


def _serve_translation(
    config: Any,
    host: str,
    port: int,
    api_key: str | list[str] | None,
    log_level: str,
    src_lang: str | None,
    tgt_lang: str | None,
) -> int:
    """Serve an M2M100/NLLB checkpoint (`metrale.server.translation`): beam search on a
    driver thread of this process; the engine's flags that apply are device, dtype,
    max_model_len, num_kv_blocks and block_size."""
    import uvicorn

    from metrale.engine.translate import TranslationService, Translator
    from metrale.server.translation import create_translation_app

    translator = Translator(
        config.model,
        device=config.device,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        num_kv_blocks=config.num_kv_blocks,
        block_size=config.block_size,
        src_lang=src_lang,
        tgt_lang=tgt_lang,
    )
    for code, param in ((src_lang, "src_lang"), (tgt_lang, "tgt_lang")):
        if code is not None:
            translator.lang_id(code, param)  # a bad deployment default fails at start-up
    name = config.served_model_name or Path(config.model).name
    app = create_translation_app(TranslationService(translator), model_name=name, api_key=api_key)
    sock = _bind(host, port)
    logger.info(
        "serving translation model %s on %s %s | decoder KV %d blocks x %d | %s",
        name,
        translator.model.device_name(),
        translator.model.dtype_name(),
        translator.model.num_total_blocks(),
        translator.model.block_size,
        _url(sock),
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            log_level=log_level.lower() if log_level == "DEBUG" else "warning",
            access_log=log_level == "DEBUG",
            lifespan="on",
        )
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


class _Drainer:
    """The graceful-shutdown sequence, started by the first SIGTERM / SIGINT."""

    def __init__(self, engine: Any, grace: float) -> None:
        self.engine = engine
        self.grace = grace
        self.started = False

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self.engine.begin_drain()
        open_requests = self.engine.num_open_requests()
        logger.info(
            "shutting down: %d request(s) in flight, %.0f s to finish", open_requests, self.grace
        )
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.call_soon_threadsafe(loop.call_later, self.grace, self._expire)

    def _expire(self) -> None:
        if self.engine.num_open_requests():
            logger.warning(
                "ending %d request(s) still running after the %.0f s grace period",
                self.engine.num_open_requests(),
                self.grace,
            )
            self.engine.abort_all("the server shut down before the request finished")


def _make_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a handled SIGTERM / SIGINT drains and exits 0."""

        def __init__(self, config: uvicorn.Config, drainer: _Drainer) -> None:
            super().__init__(config)
            self.drainer = drainer

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutting down (exit status 128+n); the
            # drain is the graceful answer to them, so the process exits 0 instead.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()
            if sig in (signal.SIGINT, signal.SIGTERM):
                self.drainer.start()

    return Server
