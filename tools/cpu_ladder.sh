#!/usr/bin/env bash
# Issue 26's CPU ladder in one run: llama-server, vLLM-CPU and metrale on the "small" and
# "tiny" random Qwen3s of ../shared/peers_cpu (set up once by its setup.sh, ~15 min), each
# driven by the same client (peers_cpu/run.py: streaming /v1/completions, token-id prompts,
# ISL 64, OSL 64, 32 requests a rung, C=1,4,16, greedy, ignore_eos). metrale is served
# separately and driven as an OpenAI URL. Results: $OUT/<engine>-<size>.json, and
# `python3 ../shared/peers_cpu/table.py $OUT/*.json` prints the table.
#
#   OUT=/tmp/ladder bash tools/cpu_ladder.sh
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS=${PEERS:-$REPO/../shared/peers_cpu}
OUT=${OUT:-/tmp/ladder}; MODELS=${MODELS:-/tmp/peersm}
mkdir -p "$OUT" "$MODELS"
for size in small tiny; do
  M=$MODELS/$size
  [ -f "$M/model-f32.gguf" ] || ~/.cache/metrale-peers/convert/bin/python "$PEERS/make_model.py" "$M" --size $size
  ARGS=(--model "$M" --concurrency 1,4,16 --requests 32 --isl 64 --osl 64 --threads 2)
  for engine in llamacpp vllm; do
    python3 "$PEERS/run.py" "${ARGS[@]}" --engine $engine --out "$OUT/$engine-$size.json" \
      >"$OUT/$engine-$size.log" 2>&1; echo "$engine $size rc=$?"
  done
  start=$(date +%s.%N)
  (cd "$REPO" && PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python -m metrale.cli serve "$M" --port 8931 \
    --served-model-name m >"$OUT/metrale-server-$size.log" 2>&1) &
  for _ in $(seq 1 300); do curl -sf localhost:8931/health >/dev/null 2>&1 && break; sleep 0.2; done
  echo "metrale $size ready after $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s"
  python3 "$PEERS/run.py" "${ARGS[@]}" --engine openai-url=http://127.0.0.1:8931 --served-name m \
    --out "$OUT/metrale-$size.json" >"$OUT/metrale-$size.log" 2>&1; echo "metrale $size rc=$?"
  pkill -f "metrale.cli serve $M"; sleep 2
done
