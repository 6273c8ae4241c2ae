"""The README's `metrale top` screenshot: serve the bundled model (CPU, MTP speculation),
keep it busy with concurrent completions, scrape it for a few seconds as the live dashboard
does, and record the rich view as SVG (rich's own export) and as PNG (the same text drawn
with Pillow in DejaVu Sans Mono, which matplotlib ships).

Usage (a minute on 2 CPU cores):
    PYTHONPATH=. python tools/top_screenshot.py --out docs

Writes `<out>/top.svg`, `<out>/top.png` and `<out>/top.txt` (the `--once` text frame).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from metrale.top.frame import Window
from metrale.top.scrape import scrape
from metrale.top.view import render_rich, render_text

SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\ndef walk(path):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def parse_args(argv):\n",
]


def _serve() -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "metrale.cli", "serve", "--device", "cpu", "--port", "0",
         "--num-kv-blocks", "512", "--speculative-config", SPEC],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace")
        found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if found and "serving" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, found.group(1)
    raise RuntimeError("metrale serve exited before listening")


def _load(url: str, stop: threading.Event, i: int) -> None:
    while not stop.is_set():
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 40, "temperature": 0.7,
                "stream": False}  # fmt: skip
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            urllib.request.urlopen(request, timeout=120).read()
        except OSError:  # the server is shutting down
            return
        i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=6)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, url = _serve()
    stop = threading.Event()
    try:
        threads = [
            threading.Thread(target=_load, args=(url, stop, i), daemon=True)
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        window = Window()
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            window.add(scrape(url))
            time.sleep(1.0)
        window.add(scrape(url))
        frame = window.frame(url)
        stop.set()
    finally:
        proc.terminate()
        proc.wait(30)
    (out / "top.txt").write_text(render_text(frame))
    from rich.console import Console

    console = Console(record=True, width=142, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_rich(frame, f"under load: {args.clients} clients, CPU"))
    _png(console.export_text(clear=False), out / "top.png")
    console.save_svg(str(out / "top.svg"), title="metrale top")
    print(out / "top.svg", out / "top.png", out / "top.txt")


def _png(text: str, path: Path) -> None:
    from pathlib import Path as _P

    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font_path = _P(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSansMono.ttf"
    font = ImageFont.truetype(str(font_path), 15)
    lines = text.rstrip("\n").split("\n")
    _, top, _, bottom = font.getbbox("M")
    cw, ch = font.getlength("M"), int((bottom - top) * 1.45) + 2
    width = int(cw * max(len(line) for line in lines)) + 40
    image = Image.new("RGB", (width, ch * len(lines) + 40), (24, 26, 33))
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((20, 20 + i * ch), line, font=font, fill=(225, 228, 232))
    image.save(path)


if __name__ == "__main__":
    main()
