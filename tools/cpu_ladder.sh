#!/usr/bin/env bash
# Issue 26's CPU ladder in one run: llama-server, vLLM-CPU and metrale on the "small" and
# "tiny" random Qwen3s of peers_cpu (set up once by its setup.sh, ~15 min), each driven by
# the same client (peers_cpu/run.py: streaming /v1/completions, token-id prompts, ISL 64,
# OSL 64, 32 requests a rung, C=1,4,16, greedy, ignore_eos). metrale is served separately
# (its own PID, stopped by it) and driven as an OpenAI URL. Results: $OUT/<engine>-<size>.json;
# then tools/cpu_ladder_record.py writes the bench/records/ record from them.
#
#   OUT=/tmp/ladder bash tools/cpu_ladder.sh
#
# Environment: OUT (results), MODELS (checkpoints, made once by peers_cpu/make_model.py),
# PEERS (peers_cpu; default ../shared/peers_cpu next to this checkout, else
# /work/shared/peers_cpu), PYTHON (metrale's interpreter; default .venv/bin/python of this
# checkout, else /work/main/.venv/bin/python), ENGINES (default "llamacpp vllm metrale";
# vllm is skipped when ~/.cache/metrale-peers/vllm is absent), SIZES (default "small tiny"),
# BUSY=1 (a second process spins on core 0 during every run: issue 26's stall test),
# METRALE_ARGS (extra `metrale serve` flags), RECORD=0 (no record).
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$REPO/../shared/peers_cpu}
[ -f "$PEERS/run.py" ] || PEERS=/work/shared/peers_cpu
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=/work/main/.venv/bin/python
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/metrale-peers}
OUT=${OUT:-/tmp/ladder}; MODELS=${MODELS:-/tmp/peersm}
ENGINES=${ENGINES:-llamacpp vllm metrale}; SIZES=${SIZES:-small tiny}
PORT=${PORT:-8931}
for need in "$PEERS/run.py" "$PYTHON"; do
  [ -e "$need" ] || { echo "cpu_ladder: missing $need (set PEERS / PYTHON)" >&2; exit 2; }
done
mkdir -p "$OUT" "$MODELS"
BUSY_PID=
if [ "${BUSY:-0}" = 1 ]; then
  taskset -c 0 python3 -c "while True: pass" & BUSY_PID=$!
  echo "busy process $BUSY_PID spinning on core 0"
fi
cleanup() { [ -n "$BUSY_PID" ] && kill "$BUSY_PID" 2>/dev/null; [ -n "${SERVER_PID:-}" ] && kill "$SERVER_PID" 2>/dev/null; }
trap cleanup EXIT
for size in $SIZES; do
  M=$MODELS/$size
  [ -f "$M/model-f32.gguf" ] || "$PEERS_DIR/convert/bin/python" "$PEERS/make_model.py" "$M" --size "$size"
  ARGS=(--model "$M" --concurrency 1,4,16 --requests 32 --isl 64 --osl 64 --threads 2)
  for engine in $ENGINES; do
    if [ "$engine" != metrale ]; then
      if [ "$engine" = vllm ] && [ ! -d "$PEERS_DIR/vllm" ]; then
        echo "vllm $size skipped: $PEERS_DIR/vllm is not set up"; continue
      fi
      python3 "$PEERS/run.py" "${ARGS[@]}" --engine "$engine" --out "$OUT/$engine-$size.json" \
        >"$OUT/$engine-$size.log" 2>&1; echo "$engine $size rc=$?"
      continue
    fi
    start=$(date +%s.%N)
    # shellcheck disable=SC2086
    (cd "$REPO" && PYTHONPATH=. HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false exec "$PYTHON" \
      -m metrale.cli serve "$M" --port "$PORT" --served-model-name m ${METRALE_ARGS:-} \
      >"$OUT/metrale-server-$size.log" 2>&1) &
    SERVER_PID=$!
    for _ in $(seq 1 600); do curl -sf "localhost:$PORT/health" >/dev/null 2>&1 && break; sleep 0.1; done
    ready=$(python3 -c "print(round($(date +%s.%N) - $start, 2))")
    echo "metrale $size ready after $ready s"
    echo "$ready" >"$OUT/metrale-$size.ready"
    python3 "$PEERS/run.py" "${ARGS[@]}" --engine "openai-url=http://127.0.0.1:$PORT" \
      --served-name m --out "$OUT/metrale-$size.json" >"$OUT/metrale-$size.log" 2>&1
    echo "metrale $size rc=$?"
    kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
  done
done
if [ "${RECORD:-1}" = 1 ]; then
  (cd "$REPO" && PYTHONPATH=. "$PYTHON" tools/cpu_ladder_record.py "$OUT" --busy "${BUSY:-0}")
fi
