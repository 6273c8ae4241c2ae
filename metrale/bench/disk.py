"""The disk a bench's files live on: emptying the page cache of files (`drop_page_cache`),
the mount that holds a path (`filesystem_of`), and the disk's own write / read bandwidth
(`disk_bandwidth`).

Owner: bench. Invariants:
- `drop_page_cache` reports what worked (files advised, whether `drop_caches` was written),
  never claims more; a record carries that report beside the figures it qualifies.
- `disk_bandwidth` removes its probe file; its read is timed only after the file was
  dropped from the page cache as far as `drop_page_cache` could.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: Bytes per write and read of the bandwidth probe.
_CHUNK = 8 << 20


def drop_page_cache(paths: list[Path], global_drop: bool = True) -> dict[str, Any]:
    """Push `paths` out of the page cache: fsync + `posix_fadvise(DONTNEED)` each, then (with
    `global_drop`) write 3 to `/proc/sys/vm/drop_caches` where that is allowed. Returns what
    worked."""
    os.sync()
    advised = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += 1
        finally:
            os.close(fd)
    if not global_drop:
        return {"fadvise_dontneed_files": advised, "drop_caches": "not tried (--no-drop-caches)"}
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        dropped: bool | str = True
    except OSError as exc:
        dropped = f"not writable: {exc.strerror}"
    return {"fadvise_dontneed_files": advised, "drop_caches": dropped}


def filesystem_of(path: Path) -> dict[str, str]:
    """The mount holding `path` (from /proc/mounts: its mount point, type and source), so a
    record says whether its "disk" was a disk (tmpfs or overlay-on-RAM would not be)."""
    best = {"mount": "", "type": "unknown", "source": "unknown"}
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return best
    resolved = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1]
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best["mount"]):
            best = {"mount": mount, "type": parts[2], "source": parts[0]}
    return best


def disk_bandwidth(directory: Path, size_mb: int, global_drop: bool = True) -> dict[str, Any]:
    """Write `size_mb` MiB to a file in `directory` (8 MiB writes, then fsync), drop it from
    the page cache, read it back; GB/s both ways (1 GB = 1e9 bytes)."""
    path = directory / "bandwidth-probe.bin"
    chunk = os.urandom(_CHUNK)
    n = max(1, (size_mb << 20) // _CHUNK)
    start = time.perf_counter()
    with path.open("wb", buffering=0) as f:
        for _ in range(n):
            f.write(chunk)
        os.fsync(f.fileno())
    write_s = time.perf_counter() - start
    cache = drop_page_cache([path], global_drop)
    start = time.perf_counter()
    read = 0
    with path.open("rb", buffering=0) as f:
        while data := f.read(_CHUNK):
            read += len(data)
    read_s = time.perf_counter() - start
    path.unlink()
    size = n * _CHUNK
    return {
        "bytes": size,
        "filesystem": filesystem_of(directory),
        "write_gb_s": size / write_s / 1e9,
        "read_gb_s": read / read_s / 1e9,
        "method": "8 MiB buffered writes + fsync; read after fsync + posix_fadvise(DONTNEED)"
        + (
            " + drop_caches"
            if cache["drop_caches"] is True
            else f" (drop_caches {cache['drop_caches']})"
        ),
        "page_cache": cache,
    }
