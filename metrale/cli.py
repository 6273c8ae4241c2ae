"""The `metrale` command: `generate`, `translate`, `serve`, `top`, `bench`.

Owner: cli. Engine flags are derived from `EngineConfig`'s fields in one place,
`metrale.engine_flags` (`add_engine_arguments` / `engine_config_from_args`, re-exported here),
so every subcommand spells them alike (`--max-model-len`, `--num-kv-blocks`,
`--enable-prefix-caching/--no-enable-prefix-caching`).

Invariants:
- A bad flag value exits with status 2 and a one-line message naming the flag; no traceback.
- Subcommands import their heavy modules lazily, so `metrale --help` is fast.
- Under `torchrun`, ranks above 0 of an engine command (`generate`, `serve`, `bench`) run a
  tensor-parallel worker (`metrale.distributed.launch.torchrun_worker`) instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from metrale.engine_flags import (
    FLAG_HELP,
    add_engine_arguments,
    add_log_level,
    engine_config_from_args,
)
from metrale.errors import MetraleError

__all__ = [
    "FLAG_HELP",
    "add_engine_arguments",
    "add_log_level",
    "build_parser",
    "engine_config_from_args",
    "main",
]


def _generate(args: argparse.Namespace) -> int:
    from metrale.engine.llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    # Flags left unset take the model's generation-config defaults (temperature: greedy).
    given = {
        name: value
        for name, value in (
            ("top_p", args.top_p),
            ("top_k", args.top_k),
            ("min_p", args.min_p),
            ("repetition_penalty", args.repetition_penalty),
        )
        if value is not None
    }
    params = llm.get_default_sampling_params().replace(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed_request,
        stop=args.stop or [],
        **given,
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate([args.prompt], params)
    out = outputs[0].outputs[0]
    sys.stdout.write(out.text)
    sys.stdout.write("\n")
    logging.getLogger("metrale").info(
        "%d tokens, finish_reason=%s", len(out.token_ids), out.finish_reason
    )
    return 0


def _early_stopping(value: str) -> bool | str:
    choices = {"true": True, "false": False, "never": "never"}
    if value.lower() not in choices:
        raise argparse.ArgumentTypeError(f"must be true, false or never, got {value!r}")
    return choices[value.lower()]


def _translate(args: argparse.Namespace) -> int:
    from metrale.engine.translate import Translator
    from metrale.model_engine.beam import BeamParams

    translator = Translator(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
    )
    params = BeamParams(
        num_beams=args.num_beams,
        n=args.n,
        length_penalty=args.length_penalty,
        early_stopping=args.early_stopping,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
    )
    outputs = translator.translate(args.text, args.src, args.tgt, params)
    for out in outputs:
        for choice in out.outputs:
            sys.stdout.write(choice.text + "\n")
            logging.getLogger("metrale").info(
                "%d tokens, score %.4f, finish_reason=%s",
                len(choice.token_ids),
                choice.cumulative_logprob,
                choice.finish_reason,
            )
    return 0


def _add_translate_parser(sub: argparse._SubParsersAction) -> None:
    tr = sub.add_parser("translate", help="translate text with an M2M100/NLLB checkpoint")
    add_log_level(tr)
    tr.add_argument("text", nargs="+", help="the text(s) to translate, one output line each")
    tr.add_argument("--model", required=True, help="M2M100/NLLB checkpoint directory (required)")
    tr.add_argument("--src", required=True, help="source language code, e.g. eng_Latn (required)")
    tr.add_argument("--tgt", required=True, help="target language code, e.g. fra_Latn (required)")
    tr.add_argument("--num-beams", type=int, default=4, help="beam width (default: 4)")
    tr.add_argument("--n", type=int, default=1, help="hypotheses printed per text (default: 1)")
    tr.add_argument(
        "--length-penalty", type=float, default=1.0, help="score = logprob / len**lp (default: 1)"
    )
    tr.add_argument(
        "--early-stopping",
        type=_early_stopping,
        default=False,
        help="true, false or never, as in transformers (default: false)",
    )
    tr.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    tr.add_argument("--min-tokens", type=int, default=0, help="tokens before EOS (default: 0)")
    tr.add_argument("--no-repeat-ngram-size", type=int, default=0, help="0: off (default: 0)")
    tr.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto)")
    tr.add_argument("--dtype", default="auto", help="auto: float32 on cpu (default: auto)")
    tr.add_argument(
        "--max-model-len", type=int, default=None, help="decoder tokens at most (default: 256)"
    )
    tr.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="decoder KV blocks (default: 1 GiB of them, at most 4096)",
    )
    tr.set_defaults(handler=_translate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_log_level(gen)
    gen.add_argument("prompt", help="the prompt text")
    req = gen.add_argument_group("request", "sampling of this one request")
    req.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    req.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default: 0)")
    req.add_argument("--top-p", type=float, default=None, help="(default: the model's, else 1)")
    req.add_argument("--top-k", type=int, default=None, help="(default: the model's, else 0: off)")
    req.add_argument("--min-p", type=float, default=None, help="(default: the model's, else 0)")
    req.add_argument(
        "--repetition-penalty", type=float, default=None, help="(default: the model's, else 1)"
    )
    req.add_argument(
        "--seed-request",
        type=int,
        default=None,
        help="sampling seed of the request (default: none)",
    )
    req.add_argument("--stop", action="append", help="stop string, repeatable (default: none)")
    req.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template (default: off)"
    )
    add_engine_arguments(gen)
    gen.set_defaults(handler=_generate)
    _add_translate_parser(sub)

    try:
        from metrale.server.launch import add_serve_parser
    except ImportError:  # the server extras are not installed
        pass
    else:
        add_serve_parser(sub)
    from metrale.top.cli import add_top_parser

    add_top_parser(sub)
    try:
        from metrale.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun, ranks above 0 of an engine command serve rank 0's model steps (its
    exit code); None on rank 0 or without torchrun (the command runs as usual)."""
    from metrale.distributed.launch import torchrun_worker, torchrun_world
    from metrale.engine.intake import resolve_model_dir

    world = torchrun_world()
    if world is None or world.rank == 0:
        return None
    config = engine_config_from_args(args)
    return torchrun_worker(config, resolve_model_dir(config.model), world)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if "RANK" in os.environ and hasattr(args, "tensor_parallel_size"):
            worker = _torchrun_worker(args)
            if worker is not None:
                return worker
        return int(args.handler(args) or 0)
    except MetraleError as exc:
        parser.exit(2, f"metrale: error: {exc.message}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
