"""`metrale top --url http://HOST:PORT [--api-key K] [--once] [--interval S]`.

Owner: top.

Invariants:
- `--once` scrapes twice, `--interval` seconds apart (so rates exist), prints one plain-text
  frame and exits 0.
- A server that cannot be reached, or that refuses the key, on the first scrape: one line on
  stderr and exit 1 (unreachable) or 2 (key, URL); never a traceback. Once running, a failed
  scrape shows in the header and the dashboard keeps trying.
- Ctrl-C leaves the live view and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from metrale.top.frame import Window
from metrale.top.scrape import TopError, normalize_url, scrape
from metrale.top.view import render_rich, render_text

API_KEY_ENV = "METRALE_API_KEY"


def add_top_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "top",
        help="live dashboard of a running server (/metrics, /v1/models)",
        description="Watch a metrale server: requests, tok/s, TTFT/ITL percentiles, KV and "
        "prefix cache, preemptions, errors, speculation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8888", help="the server")
    parser.add_argument(
        "--api-key", default=None, help=f"key for /v1/models (default: ${API_KEY_ENV})"
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between scrapes (refresh)"
    )
    parser.add_argument(
        "--once", action="store_true", help="print one plain-text frame (two scrapes) and exit"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per request")
    parser.add_argument("--log-level", default="WARNING", help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        url = normalize_url(args.url)
        if args.interval <= 0:
            raise TopError("--interval must be > 0", exit_code=2)
        key = args.api_key or os.environ.get(API_KEY_ENV) or None
        window = Window()
        window.add(scrape(url, key, args.timeout))
        if args.once:
            time.sleep(args.interval)
            window.add(scrape(url, key, args.timeout))
            sys.stdout.write(render_text(window.frame(url)))
            return 0
    except TopError as exc:
        sys.stderr.write(f"metrale top: {exc.message}\n")
        return exc.exit_code
    return _live(url, key, args, window)


def _live(url: str, key: str | None, args: argparse.Namespace, window: Window) -> int:
    from rich.console import Console
    from rich.live import Live

    status = ""
    console = Console()
    try:
        with Live(render_rich(window.frame(url)), console=console, screen=False) as live:
            while True:
                time.sleep(args.interval)
                try:
                    window.add(scrape(url, key, args.timeout))
                    status = f"scraped {time.strftime('%H:%M:%S')}; Ctrl-C quits"
                except TopError as exc:
                    status = f"last scrape failed: {exc.message}"
                live.update(render_rich(window.frame(url), status))
    except KeyboardInterrupt:
        return 0
