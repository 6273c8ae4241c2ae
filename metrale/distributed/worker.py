"""A tensor-parallel worker process: `python -m metrale.distributed.worker '<spec json>'`,
started by rank 0 (`launch.load_tensor_parallel`), one per rank above 0.

Owner: distributed.

Invariants:
- The process exits (at once, `os._exit`) when its loop ends (rank 0's `STOP`, or a failed collective once rank 0
  is gone), and within a second of its parent's exit, whatever it is doing (a watchdog
  thread), so no worker outlives the engine that started it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    logging.basicConfig(
        level=logging.WARNING, format=f"tp rank {spec['rank']}: %(levelname)s %(message)s"
    )
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    from metrale.distributed.launch import worker_main

    code = worker_main(spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing left to release: skip the interpreter's slow teardown


if __name__ == "__main__":
    sys.exit(main(sys.argv))
