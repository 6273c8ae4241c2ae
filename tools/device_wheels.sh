#!/usr/bin/env bash
# The server wheels a GPU device session carries (`.whl/`, gitignored; pass `carry: [".whl"]`):
# the device image has torch, triton and transformers but no FastAPI, uvicorn, pydantic or
# xgrammar, and installs nothing from a registry. `tools/gpu_session.sh` installs them into
# /tmp/site when it finds `.whl/`.
#
# Usage (from the repository root, on this machine): bash tools/device_wheels.sh
#
# Downloads cp312 manylinux wheels without their dependencies (those would pull torch), then
# checks that every wheel's requirements (markers evaluated for CPython 3.12 on Linux) are met
# by the set itself or by what the image provides (DEVICE_HAS), and fails naming any that is
# not: a new FastAPI once required opentelemetry-api, and the device's server died at import.
set -eu
DEST=${DEST:-.whl}
WHEELS="xgrammar apache-tvm-ffi fastapi starlette annotated-doc opentelemetry-api uvicorn h11
anyio sniffio pydantic pydantic-core annotated-types typing-inspection prometheus-client
uvloop httptools idna click"
mkdir -p "$DEST"
# shellcheck disable=SC2086
pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d "$DEST" \
  $WHEELS 2>&1 | grep -v "^WARNING: Location" || true
python3 - "$DEST" <<'EOF'
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What the device image provides (KINDS.md / H200 sessions): these need no wheel.
DEVICE_HAS = {"torch", "triton", "transformers", "numpy", "typing-extensions", "safetensors",
              "tokenizers", "jinja2", "pillow", "packaging"}
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                               "sys_platform": "linux", "platform_system": "Linux",
                               "platform_machine": "x86_64", "implementation_name": "cpython",
                               "extra": ""}
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {canonicalize_name(re.split(r"-\d", w.name, maxsplit=1)[0]) for w in wheels} | DEVICE_HAS
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            if canonicalize_name(req.name) not in have:
                missing.append(f"{w.name} needs {req}")
print(f"{len(wheels)} wheels in {sys.argv[1]}")
if missing:
    print("missing on the device:\n  " + "\n  ".join(missing))
    sys.exit(1)
EOF
