#!/usr/bin/env bash
# One GPU session on an H200 (torch 2.11 image, no package index): GPU tests, kernel bench,
# latency/throughput instruments with the HF peer, and the serve ladder against a real
# `metrale serve`. Every part is independent: a failing part is logged and the next one runs.
#
# Usage (from the repository root, with the server wheels in .whl/: bash tools/device_wheels.sh):
#   OUT=/some/dir bash tools/gpu_session.sh [parts...]
# parts: quick kerneltests kernels latency8b latency06b throughput serve  (default: all)
#        mtp (MTP speculation: GPU tests, bundled-model speedup at C=1/32, qwen3-8b MTP step cost)
#        structured (grammar overhead per step, issue 17) lora (multi-LoRA throughput, issue 16)
#        lorakernels (issue 16: the LoRA group ops per form, tools/bench_lora_kernels.py, and the
#        LoRA kernel tests)
#        translate (NLLB-200-distilled-600M shape, random weights, bf16 beam 4 at batch 1 and 32
#        against transformers generate, issue 18)
#        kvtiers (issue 19: qwen3-8b 8k prefix from the host / disk KV tier vs cold, disk
#        bandwidth, high-speed swap decode at a 32k context against the resident run;
#        KV_DISK_DIR picks the disk, default /var/tmp) kvprofile (the host-tier hit's TTFT in parts)
#        alltests (every test marked gpu: tests/gpu and the two CUDA sampler modules in tests/unit)
#        hybridttft (issue 15) vision (issue 21)
#        hybrid (issue 23: recurrent-kernel and hybrid-graph GPU tests, Nemotron-H-8B shape batch-1
#        decode with graphs against HF and its roofline, then the serve ladder C=1..64;
#        HYBRID_LADDER overrides the rungs)
#        fp8kv (issue 22, FP8 KV: tests/gpu/test_fp8_kv.py, then the serve rung C=128 on the
#        qwen3-8b shape with --kv-cache-dtype auto and fp8, one server each; FP8KV_SERVE=0 skips it)
#        fp8serve (issue 22: the C=128 serve rung on the qwen3-8b shape, bf16 weights and KV against
#        --quantization fp8 --kv-cache-dtype fp8, one server each)
#        moe (issue 23: the MoE GPU tests, then batch-1 decode latency of the Qwen3-30B-A3B and
#        Mixtral-8x7B shapes, random bf16 weights, graphs on, roofline from the active bytes)
#        moeserve (the C=1..64 serve ladder of the Qwen3-30B-A3B shape, ISL 128, OSL 512)
#        alltestsp (the same tests in four pytest processes side by side: about a third of the time)
#        latency8bcompiled (latency8b against HF with static cache + torch.compile)
#        fp8 (issue 22: qwen3-8b batch-1 decode with bf16 weights and with --quantization fp8, each
#        against its roofline, one record: tools/bench_fp8.py) fp8tests (tests/gpu/test_fp8_linear.py)
#        fp8kernels (the FP8 GEMV / GEMM alone against bf16 on qwen3-8b shapes, for tuning)
#        prefetch (the L2 prefetch experiment: its tests, then 0.6B / 8B / 8B FP8 batch-1 decode
#        with METRALE_L2_PREFETCH=0 and 1)
#        (serve: PEER_COMPILE=1 PEER_TIMEOUT=420 gives the ladder's HF peer the same configuration;
#        PEER=0 skips the HF peer of latency8b and serve, for a quick no-regression check;
#        SAMPLED=1 adds the sampled ladder (t 0.8, top-p 0.95, top-k 50) and a second greedy one;
#        SAMPLED_MODES="sampled" runs the sampled ladder alone; a mode ending in -cN, e.g.
#        "greedy-c4 sampled-c4", runs its client as N processes; CLIENTS=N sets it for all;
#        every rung records the client's and the server processes' CPU seconds)
#        ceiling gemv serveab graphtime sampler  (diagnostics: engine-only decode ceiling at C=128, the GEMV
#        microbenchmark, and the serve rung C=128 with the engine in its own process vs a thread)
set -u
OUT=${OUT:-/tmp/metrale-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The device copy of the tree has no .git: records take the commit from here (pass it in).
export METRALE_COMMIT=${METRALE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -d .whl ] && ! python3 -c "import fastapi, uvicorn, xgrammar" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-}
PARTS=${*:-quick latency8b latency06b throughput serve kerneltests kernels}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/nvidia.csv" 2>&1
stamp() { echo "=== $(date +%T) $*"; }
# The serve rung C=128 (ISL 128, OSL 1024) on the qwen3-8b shape, one server with extra flags
# $2, outputs under $OUT/$1.
serve_rung_8b() {
  local name=$1 flags=$2
  if [ ! -d /tmp/qwen3-8b ]; then
    cp -r bench/configs/qwen3-8b /tmp/qwen3-8b
    python3 -c "from metrale.bench.synthetic import write_synthetic_tokenizer as w; w('/tmp/qwen3-8b')"
  fi
  stamp "serve qwen3-8b C=128, $flags"
  mkdir -p "$OUT/$name"
  # shellcheck disable=SC2086
  python3 -m metrale.cli serve /tmp/qwen3-8b --load-format dummy --max-model-len 2048 \
    --max-num-seqs 128 $flags --served-model-name qwen3-8b --port 8888 \
    --log-level INFO >"$OUT/$name/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 180); do
    curl -sf localhost:8888/health >/dev/null 2>&1 && break
    # a server that died (an import error, a bad flag) ends the wait: no device time lost
    kill -0 $server 2>/dev/null || { echo "server died:"; tail -3 "$OUT/$name/server.log"; return 1; }
    sleep 1
  done
  timeout 300 python3 -m metrale.cli bench serve --url http://127.0.0.1:8888 --model qwen3-8b \
    --shape qwen3-8b --vocab 151936 --concurrency 128 --isl 128 --osl 1024 --device cuda \
    --server-info "metrale serve --load-format dummy --max-model-len 2048 --max-num-seqs 128 $flags" \
    --out-dir "$OUT/$name" >"$OUT/$name/serve.log" 2>&1
  echo "ladder rc=$?"; tail -4 "$OUT/$name/serve.log"
  kill -TERM $server; wait $server; echo "server exit=$?"
  grep -E "KV cache dtype|loaded .* KV|weights" "$OUT/$name/server.log" | head -4
}

for part in $PARTS; do
  case $part in
  quick)
    stamp engine gpu tests
    timeout 120 python3 -m pytest tests/gpu/test_decode_runner.py tests/gpu/test_engine_gpu.py -q \
      -p no:cacheprovider --timeout 100 >"$OUT/gpu_engine_tests.log" 2>&1
    echo "rc=$?"; tail -6 "$OUT/gpu_engine_tests.log"
    ;;
  alltests)
    stamp every gpu-marked test
    timeout 560 python3 -m pytest tests/gpu tests/unit/test_sampling_sampler.py tests/unit/test_sampling_cuda.py -m gpu -q -p no:cacheprovider --timeout 300 \
      >"$OUT/gpu_all_tests.log" 2>&1
    echo "rc=$?"; tail -8 "$OUT/gpu_all_tests.log"
    ;;
  alltestsp)
    stamp "every gpu-marked test, four pytest processes side by side (tiny models, small KV pools)"
    # Balanced on the H200 of 2026-12-02 (seconds alone, four side by side): kernels+gemv 344;
    # spec+engine+decode runner 95 and MoE ~300; FP8 linear 163 + FP8 KV 43 and the LoRA
    # kernels ~80; the rest ~380. Each group stays under ALLTESTS_TIMEOUT (560 s).
    G1="tests/gpu/test_kernels.py tests/gpu/test_gemv.py"
    G2="tests/gpu/test_spec_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_decode_runner.py tests/gpu/test_moe_kernels.py"
    G3="tests/gpu/test_fp8_linear.py tests/gpu/test_fp8_kv.py tests/gpu/test_lora_kernels.py tests/gpu/test_lora_epilogue.py"
    # the fourth: every other gpu test module, and the two CUDA sampler modules of tests/unit
    G4="$(ls tests/gpu/test_*.py | grep -v -e test_kernels.py -e test_gemv.py -e test_spec_gpu.py \
      -e test_engine_gpu.py -e test_decode_runner.py -e test_fp8_linear.py -e test_fp8_kv.py \
      -e test_moe_kernels.py -e test_lora_kernels.py -e test_lora_epilogue.py | tr '\n' ' ')"
    G4="$G4 tests/unit/test_sampling_sampler.py tests/unit/test_sampling_cuda.py"
    i=0
    for g in "$G1" "$G2" "$G3" "$G4"; do
      i=$((i+1))
      timeout ${ALLTESTS_TIMEOUT:-560} python3 -m pytest $g -m gpu -q -p no:cacheprovider --timeout 300 \
        >"$OUT/gpu_tests_$i.log" 2>&1 &
    done
    wait
    for i in 1 2 3 4; do echo "group $i:"; tail -3 "$OUT/gpu_tests_$i.log"; done
    ;;
  fp8kv)
    stamp "fp8 KV: kernel and engine tests (issue 22)"
    timeout 400 python3 -m pytest tests/gpu/test_fp8_kv.py -m gpu -q -s -p no:cacheprovider \
      --timeout 300 >"$OUT/fp8kv_tests.log" 2>&1
    echo "rc=$?"; grep -E "fp8 KV vs|passed|failed|Error" "$OUT/fp8kv_tests.log" | tail -6
    if [ "${FP8KV_SERVE:-1}" = 1 ]; then
      for kvd in auto fp8; do
        serve_rung_8b "fp8kv-$kvd" "--kv-cache-dtype $kvd"
      done
    fi
    ;;
  fp8serve)
    # issue 22: C=128 with FP8 weights and FP8 KV against bf16 weights and KV, one run
    serve_rung_8b fp8serve-bf16 "--kv-cache-dtype auto"
    serve_rung_8b fp8serve-fp8 "--quantization fp8 --kv-cache-dtype fp8"
    ;;
  hybridttft)
    stamp "hybrid prefix cache: Nemotron-H-8B shape, 4k-token cached prefix, warm vs cold TTFT (issue 15)"
    timeout 240 python3 -m metrale.cli bench ttft --config-dir bench/configs/nemotron-h-8b \
      --shape nemotron-h-8b --device cuda --dtype bfloat16 --prompt-len 4160 --cached-len 4096 \
      --repeats 3 --out-dir "$OUT" >"$OUT/hybridttft.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/hybridttft.log"
    ;;
  hybrid)
    stamp "hybrid: recurrent kernels and graphed hybrid decode tests (issue 23)"
    timeout 400 python3 -m pytest tests/gpu/test_ssm_kernels.py tests/gpu/test_hybrid_graphs.py -q \
      -p no:cacheprovider --timeout 380 >"$OUT/gpu_hybrid_tests.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/gpu_hybrid_tests.log"
    stamp "hybrid: Nemotron-H-8B shape batch-1 decode, graphs on, vs HF (issue 23)"
    timeout 420 python3 -m metrale.cli bench latency --config-dir bench/configs/nemotron-h-8b \
      --shape nemotron-h-8b --device cuda --dtype bfloat16 --max-model-len 2048 --tokens 256 \
      --max-num-seqs 8 $( [ "${PEER:-1}" = 1 ] || echo --no-peer ) --out-dir "$OUT" \
      >"$OUT/latency_hybrid.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/latency_hybrid.log"
    grep -iE "graphs|startup|Error" "$OUT/latency_hybrid.log" | tail -4
    stamp "hybrid: Nemotron-H-8B shape serve ladder"
    rm -rf /tmp/nemotron-h-8b && cp -r bench/configs/nemotron-h-8b /tmp/nemotron-h-8b
    python3 -c "from metrale.bench.synthetic import write_synthetic_tokenizer as w; w('/tmp/nemotron-h-8b')"
    [ "${PEER:-1}" = 1 ] && timeout ${PEER_TIMEOUT:-300} python3 -c "
import json
from metrale.bench.hf_peer import hf_generate_tok_s
peer = {f'C={b}': hf_generate_tok_s('bench/configs/nemotron-h-8b', b, 128, 16) for b in (1, 64)}
json.dump(peer, open('$OUT/serve_hybrid_peer.json', 'w'), indent=1)
print(peer)" >"$OUT/serve_hybrid_peer.log" 2>&1
    echo "peer rc=$?"; tail -3 "$OUT/serve_hybrid_peer.log"
    python3 -m metrale.cli serve /tmp/nemotron-h-8b --load-format dummy --max-model-len 2048 \
      --max-num-seqs 64 --served-model-name nemotron-h-8b --port 8889 --log-level INFO \
      >"$OUT/server_hybrid.log" 2>&1 &
    server=$!
    for _ in $(seq 1 180); do
      curl -sf localhost:8889/health >/dev/null 2>&1 && break
      sleep 1
    done
    timeout 420 python3 -m metrale.cli bench serve --url http://127.0.0.1:8889 \
      --model nemotron-h-8b --shape nemotron-h-8b --vocab 131072 \
      --concurrency "${HYBRID_LADDER:-1,8,32,64}" --isl 128 --osl 512 --device cuda \
      --server-info "metrale serve --load-format dummy --max-model-len 2048 --max-num-seqs 64" \
      $( [ -f "$OUT/serve_hybrid_peer.json" ] && echo --peer-json "$OUT/serve_hybrid_peer.json" ) \
      --out-dir "$OUT" >"$OUT/serve_hybrid.log" 2>&1
    echo "ladder rc=$?"; tail -6 "$OUT/serve_hybrid.log"
    kill -TERM $server; wait $server; echo "server exit=$?"
    grep -iE "summary|graphs|SSM|error" "$OUT/server_hybrid.log" | head -8
    ;;
  vision)
    stamp "vision: Qwen2.5-VL-7B shape, one 448x448 image, C=1 and C=16 against transformers (issue 21)"
    timeout 300 python3 tools/bench_vision.py bench/configs/qwen2.5-vl-7b --image 448x448 \
      --concurrency 1,16 --out "$OUT" >"$OUT/vision.log" 2>&1
    echo "rc=$?"; tail -30 "$OUT/vision.log" | grep -E "images_per_s|ttft|record|Error" | head -16
    ;;
  structured)
    stamp structured output: grammar overhead per step, qwen3-8b shape, C=1 and C=64
    timeout 400 python3 -m metrale.cli bench structured --config-dir bench/configs/qwen3-8b \
      --shape qwen3-8b --device cuda --batches 1,64 --out-dir "$OUT" >"$OUT/structured.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/structured.log"
    ;;
  translate)
    stamp translate: gpu tests, then nllb-600m shape bf16 beam 4, batch 1 and 32, vs transformers generate
    timeout 150 python3 -m pytest tests/gpu/test_translate_gpu.py -q -p no:cacheprovider --timeout 140 \
      >"$OUT/gpu_translate_tests.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/gpu_translate_tests.log"
    timeout 300 python3 -m metrale.cli bench translate --shape nllb-600m --device cuda \
      --dtype bfloat16 --peer transformers --batch-sizes 1,32 --num-beams 4 --sentences 64 \
      --batch1-sentences 16 --max-tokens 64 --step-graphs --log-level INFO --out-dir "$OUT" \
      >"$OUT/translate.log" 2>&1
    echo "rc=$?"; tail -8 "$OUT/translate.log"
    ;;
  kvtiers)
    stamp KV tiers: qwen3-8b 8k prefix from host and disk tiers vs cold, high-speed swap at 32k
    timeout 540 python3 -m metrale.cli bench kv-tiers --config-dir bench/configs/qwen3-8b \
      --shape qwen3-8b --device cuda --dtype bfloat16 --prompt-len 8192 --repeats 3 \
      --disk-dir "${KV_DISK_DIR:-/var/tmp}" --hss-device cuda --hss-config-dir bench/configs/qwen3-8b \
      --hss-window-blocks 64 --hss-context-tokens 32768 --hss-decode-tokens 32 --out-dir "$OUT" >"$OUT/kvtiers.log" 2>&1
    echo "rc=$?"; tail -5 "$OUT/kvtiers.log"; grep -iE "Error|FAILED" "$OUT/kvtiers.log" | tail -3
    ;;
  kvprofile)
    stamp "KV tiers: where a host-tier hit's TTFT goes (qwen3-8b, 8k prefix, profile of one warm request)"
    timeout 240 python3 tools/profile_kv_restore.py --config-dir bench/configs/qwen3-8b \
      --prompt-len 8192 --repeats 3 --out-dir "$OUT" >"$OUT/kvprofile.log" 2>&1
    echo "rc=$?"; grep -A8 '"summary"' "$OUT/kvprofile.log"; tail -1 "$OUT/kvprofile.log"
    ;;
  lora)
    stamp multi-LoRA: 8 rank-16 adapters at C=64 and batch-1 decode, against the base model
    timeout 500 python3 -m metrale.cli bench lora --config-dir bench/configs/qwen3-8b \
      --shape qwen3-8b --device cuda --adapters 8 --rank 16 --concurrency 64 \
      --out-dir "$OUT" >"$OUT/lora.log" 2>&1
    echo "rc=$?"; tail -12 "$OUT/lora.log"
    ;;
  lorakernels)
    stamp "multi-LoRA kernels: tests, then us per group op by form (qwen3-8b shapes, rank 16)"
    timeout 300 python3 -m pytest tests/gpu/test_lora_kernels.py tests/gpu/test_lora_epilogue.py \
      tests/gpu/test_gemv.py -q -p no:cacheprovider >"$OUT/lorakernels-tests.log" 2>&1
    echo "tests rc=$?"; tail -3 "$OUT/lorakernels-tests.log"
    timeout 400 python3 tools/bench_lora_kernels.py --out "$OUT/lora_kernels.json" \
      >"$OUT/lora_kernels.log" 2>&1
    echo "rc=$?"; tail -8 "$OUT/lora_kernels.log"
    ;;
  kerneltests)
    stamp kernel tests
    timeout 200 python3 -m pytest tests/gpu/test_kernels.py -q -p no:cacheprovider --timeout 190 \
      >"$OUT/gpu_kernel_tests.log" 2>&1
    echo "rc=$?"; tail -6 "$OUT/gpu_kernel_tests.log"
    ;;
  kernels)
    stamp kernel bench
    timeout 110 python3 -m metrale.bench.kernels --out "$OUT/kernels.json" >"$OUT/kernels.log" 2>&1
    echo "rc=$?"; tail -25 "$OUT/kernels.log"
    ;;
  spec)
    stamp speculation gpu tests and the verify cost curve, qwen3-8b
    timeout 200 python3 -m pytest tests/gpu/test_spec_gpu.py tests/gpu/test_decode_runner.py -q -s \
      -p no:cacheprovider --timeout 190 >"$OUT/gpu_spec_tests.log" 2>&1
    echo "rc=$?"; grep -E "identical|passed|failed" "$OUT/gpu_spec_tests.log" | tail -4
    timeout 240 python3 -m metrale.cli bench spec-cost --config-dir bench/configs/qwen3-8b \
      --shape qwen3-8b --out-dir "$OUT" >"$OUT/spec_cost.log" 2>&1
    echo "rc=$?"; grep -E "^batch|projected|measured|record" "$OUT/spec_cost.log"
    ;;
  mtp)
    stamp MTP: gpu tests, bundled model speedup at batch 1 and 32, MTP step cost on qwen3-8b
    timeout 200 python3 -m pytest tests/gpu/test_spec_gpu.py -q -s -k mtp \
      -p no:cacheprovider --timeout 190 >"$OUT/gpu_mtp_tests.log" 2>&1
    echo "rc=$?"; grep -E "identical|passed|failed" "$OUT/gpu_mtp_tests.log" | tail -4
    for c in 1 32; do
      timeout 200 python3 -m metrale.cli bench spec --device cuda --methods mtp --k 3 \
        --gate off --workload continue --no-repeat --prompts 32 --max-tokens 128 \
        --concurrency $c --out-dir "$OUT" >"$OUT/spec_mtp_c$c.log" 2>&1
      echo "rc=$?"; grep -E "speedup|record" "$OUT/spec_mtp_c$c.log"
    done
    timeout 300 python3 -m metrale.cli bench spec-cost --config-dir bench/configs/qwen3-8b \
      --shape qwen3-8b --mtp --ks 1,2,3,4 --batches 1,32 --measure-batches 32 \
      --out-dir "$OUT" >"$OUT/spec_cost_mtp.log" 2>&1
    echo "rc=$?"; grep -E "^batch|projected|measured|record" "$OUT/spec_cost_mtp.log"
    timeout 120 python3 tools/profile_mtp.py --config-dir bench/configs/qwen3-8b --shape qwen3-8b \
      --k 4 --out-dir "$OUT" >"$OUT/profile_mtp_8b.log" 2>&1
    echo "rc=$?"; grep -E "^1 |^32 |record" "$OUT/profile_mtp_8b.log"
    timeout 120 python3 tools/profile_mtp.py --config-dir metrale/assets/tiny-code \
      --shape metrale-tiny-code --k 3 --out-dir "$OUT" >"$OUT/profile_mtp_tiny.log" 2>&1
    echo "rc=$?"; grep -E "^1 |^32 |record" "$OUT/profile_mtp_tiny.log"
    ;;
  latency8b)
    stamp latency qwen3-8b
    timeout 180 python3 -m metrale.cli bench latency --config-dir bench/configs/qwen3-8b \
      --max-model-len 2048 --tokens 256 --max-num-seqs 8 $( [ "${PEER:-1}" = 1 ] || echo --no-peer ) \
      --out-dir "$OUT" >"$OUT/latency8b.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/latency8b.log"; grep -iE "startup|Error" "$OUT/latency8b.log" | tail -3
    ;;
  latency8bcompiled)
    stamp latency qwen3-8b, HF peer with static cache + torch.compile
    timeout 480 python3 -m metrale.cli bench latency --config-dir bench/configs/qwen3-8b \
      --max-model-len 2048 --tokens 256 --max-num-seqs 8 --peer-compile --out-dir "$OUT" \
      >"$OUT/latency8bcompiled.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/latency8bcompiled.log"; grep -iE "compile failed|Error" "$OUT/latency8bcompiled.log" | tail -3
    ;;
  latency06b)
    stamp latency qwen3-0.6b
    timeout 90 python3 -m metrale.cli bench latency --config-dir bench/configs/qwen3-0.6b \
      --max-model-len 2048 --tokens 512 --max-num-seqs 8 --out-dir "$OUT" >"$OUT/latency06b.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/latency06b.log"
    ;;
  throughput)
    stamp throughput qwen3-0.6b
    timeout 150 python3 -m metrale.cli bench throughput --config-dir bench/configs/qwen3-0.6b \
      --max-model-len 4096 --max-num-seqs 256 --out-dir "$OUT" >"$OUT/throughput.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/throughput.log"
    ;;
  ceiling)
    for c in ${CEILING_C:-128}; do
      stamp decode ceiling qwen3-8b C=$c
      timeout 200 python3 tools/decode_ceiling.py bench/configs/qwen3-8b --concurrency $c \
        --out "$OUT/ceiling$c.json" >"$OUT/ceiling$c.log" 2>&1
      echo "rc=$?"; tail -14 "$OUT/ceiling$c.log"
    done
    ;;
  graphtime)
    stamp graph replay time qwen3-8b, PDL on/off, cuBLAS
    timeout 240 python3 tools/graph_step_time.py bench/configs/qwen3-8b --out "$OUT/graphtime.json" \
      >"$OUT/graphtime.log" 2>&1
    echo "rc=$?"; grep -E "^(gemv|cublas)|_replay_ms" "$OUT/graphtime.log" | head -8
    ;;
  sampler)
    stamp sampler torch path vs kernel by batch
    timeout 150 python3 tools/bench_sampler.py --out "$OUT/sampler.json" >"$OUT/sampler.log" 2>&1
    echo "rc=$?"; tail -24 "$OUT/sampler.log"
    ;;
  prefetch)
    # the L2 prefetch experiment (METRALE_L2_PREFETCH, kernels/triton_prefetch.py): its GPU
    # tests, then batch-1 decode of Qwen3-0.6B, Qwen3-8B and Qwen3-8B FP8 with it off and on
    stamp "l2 prefetch: GPU tests"
    timeout 200 python3 -m pytest tests/gpu/test_prefetch.py -m gpu -q -p no:cacheprovider \
      >"$OUT/prefetch_tests.log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/prefetch_tests.log"
    for v in 0 1; do
      mkdir -p "$OUT/prefetch$v"
      stamp "l2 prefetch=$v: latency qwen3-0.6b, qwen3-8b (no peer), fp8 bench"
      METRALE_L2_PREFETCH=$v timeout 90 python3 -m metrale.cli bench latency \
        --config-dir bench/configs/qwen3-0.6b --max-model-len 2048 --tokens 512 --max-num-seqs 8 \
        --no-peer --out-dir "$OUT/prefetch$v" >"$OUT/prefetch$v/l06.log" 2>&1
      grep -E "step_ms_median|roofline_ratio" "$OUT/prefetch$v/l06.log" | tail -2
      METRALE_L2_PREFETCH=$v timeout 150 python3 tools/bench_fp8.py --config-dir \
        bench/configs/qwen3-8b --no-block --out-dir "$OUT/prefetch$v" >"$OUT/prefetch$v/fp8.log" 2>&1
      grep -E "^(bf16|fp8) " "$OUT/prefetch$v/fp8.log"
    done
    ;;
  fp8)
    stamp "fp8 weights: qwen3-8b batch-1 decode, bf16 vs --quantization fp8, each vs its roofline"
    timeout 560 python3 tools/bench_fp8.py --config-dir bench/configs/qwen3-8b --out-dir "$OUT" \
      >"$OUT/fp8.log" 2>&1
    echo "rc=$?"; tail -16 "$OUT/fp8.log"; grep -iE "weights:|Error" "$OUT/fp8.log" | tail -4
    ;;
  fp8kernels)
    stamp "fp8 weights: the projections alone, bf16 GEMV vs FP8 GEMV, FP8 GEMM vs cuBLAS bf16"
    timeout 420 python3 tools/bench_fp8.py --kernels --out-dir "$OUT" >"$OUT/fp8_kernels.log" 2>&1
    echo "rc=$?"; tail -40 "$OUT/fp8_kernels.log"
    ;;
  fp8tests)
    stamp "fp8 weights: kernel, graph and engine tests (tests/gpu/test_fp8_linear.py)"
    timeout 540 python3 -m pytest tests/gpu/test_fp8_linear.py -q -p no:cacheprovider --timeout 300 \
      >"$OUT/fp8_tests.log" 2>&1
    echo "rc=$?"; tail -8 "$OUT/fp8_tests.log"
    ;;
  gemv)
    stamp gemv bench
    timeout 150 python3 tools/bench_gemv.py --out "$OUT/gemv.json" >"$OUT/gemv.log" 2>&1
    echo "rc=$?"; tail -30 "$OUT/gemv.log"
    ;;
  serveab)
    rm -rf /tmp/qwen3-8b && cp -r bench/configs/qwen3-8b /tmp/qwen3-8b
    python3 -c "from metrale.bench.synthetic import write_synthetic_tokenizer as w; w('/tmp/qwen3-8b')"
    for mode in process thread; do
      stamp serve C=128 engine $mode
      extra=""; [ $mode = thread ] && extra=--engine-in-process
      python3 -m metrale.cli serve /tmp/qwen3-8b --load-format dummy --max-model-len 2048 \
        --max-num-seqs 128 --served-model-name qwen3-8b --port 8888 --log-level INFO $extra \
        >"$OUT/server_$mode.log" 2>&1 &
      server=$!
      for _ in $(seq 1 120); do curl -sf localhost:8888/health >/dev/null 2>&1 && break; sleep 1; done
      timeout 150 python3 -m metrale.cli bench serve --url http://127.0.0.1:8888 --model qwen3-8b \
        --shape qwen3-8b --vocab 151936 --concurrency "${ABLADDER:-128}" --isl 128 --osl 512 \
        --device cuda --server-info "engine $mode" --out-dir "$OUT/ab_$mode" >"$OUT/serve_$mode.log" 2>&1
      echo "rc=$?"; grep "C=" "$OUT/serve_$mode.log"
      kill -TERM $server; wait $server; echo "server exit=$?"
    done
    ;;
  serve)
    stamp serve qwen3-8b
    rm -rf /tmp/qwen3-8b && cp -r bench/configs/qwen3-8b /tmp/qwen3-8b
    python3 -c "from metrale.bench.synthetic import write_synthetic_tokenizer as w; w('/tmp/qwen3-8b')"
    [ "${PEER:-1}" = 1 ] && timeout ${PEER_TIMEOUT:-150} python3 -c "
import json, torch
from metrale.bench.hf_peer import hf_generate_tok_s
compiled = '${PEER_COMPILE:-0}' == '1'
peer = {f'C={b}': hf_generate_tok_s('bench/configs/qwen3-8b', b, 128, 16, try_compile=compiled)
        for b in (1, 128)}
json.dump(peer, open('$OUT/serve_peer.json', 'w'), indent=1)
print(peer)" >"$OUT/serve_peer.log" 2>&1
    echo "peer rc=$?"; tail -3 "$OUT/serve_peer.log"
    python3 -m metrale.cli serve /tmp/qwen3-8b --load-format dummy --max-model-len 2048 \
      --max-num-seqs 128 --served-model-name qwen3-8b --port 8888 --log-level INFO \
      >"$OUT/server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 120); do
      curl -sf localhost:8888/health >/dev/null 2>&1 && break
      sleep 1
    done
    # the HTTP process and the engine process: each rung records their CPU seconds
    pids="$server$(pgrep -P $server | sed 's/^/,/' | tr -d '\n')"
    timeout 300 python3 -m metrale.cli bench serve --url http://127.0.0.1:8888 --model qwen3-8b \
      --watch-pids "$pids" --client-processes "${CLIENTS:-1}" \
      --shape qwen3-8b --vocab 151936 --concurrency "${LADDER:-1,128}" --isl 128 --osl 1024 \
      --device cuda --server-info "metrale serve --load-format dummy --max-model-len 2048 --max-num-seqs 128" \
      $( [ -f "$OUT/serve_peer.json" ] && echo --peer-json "$OUT/serve_peer.json" ) --out-dir "$OUT" \
      >"$OUT/serve.log" 2>&1
    echo "ladder rc=$?"; tail -6 "$OUT/serve.log"
    if [ "${SAMPLED:-0}" = 1 ]; then
      # issue 23: the sampled ladder (t 0.8, top-p 0.95, top-k 50) on the same server,
      # interleaved with a second greedy ladder so drift shows
      for mode in ${SAMPLED_MODES:-sampled greedy2 sampled2}; do
        stamp "serve qwen3-8b, $mode ladder"
        sargs=""; case $mode in sampled*) sargs="--temperature 0.8 --top-p 0.95 --top-k 50";; esac
        # a mode ending in -cN runs its client as N processes (e.g. greedy-c4)
        clients=${CLIENTS:-1}; case $mode in *-c[0-9]*) clients=${mode##*-c};; esac
        mkdir -p "$OUT/serve-$mode"
        timeout 200 python3 -m metrale.cli bench serve --url http://127.0.0.1:8888 --model qwen3-8b \
          --watch-pids "$pids" --client-processes "$clients" \
          --shape qwen3-8b --vocab 151936 --concurrency "${LADDER:-1,128}" --isl 128 --osl 1024 \
          --device cuda --server-info "metrale serve --load-format dummy --max-model-len 2048 --max-num-seqs 128 ($mode)" \
          $sargs --out-dir "$OUT/serve-$mode" >"$OUT/serve_$mode.log" 2>&1
        echo "rc=$?"; grep "C=" "$OUT/serve_$mode.log"
      done
      curl -s localhost:8888/metrics | grep -E "^metrale_sampler" | head -12
    fi
    kill -TERM $server; wait $server; echo "server exit=$?"
    grep -iE "summary|graphs|KV|error" "$OUT/server.log" | head -8
    ;;
  moe)
    stamp "MoE GPU tests (issue 23)"
    timeout 500 python3 -m pytest tests/gpu/test_moe_kernels.py -q -p no:cacheprovider --timeout 300 \
      >"$OUT/moe_tests.log" 2>&1
    echo "rc=$?"; tail -6 "$OUT/moe_tests.log"
    for shape in qwen3-30b-a3b mixtral-8x7b; do
      stamp "latency $shape (batch 1, bf16 random weights, graphs on)"
      timeout 590 python3 -m metrale.cli bench latency --config-dir bench/configs/$shape \
        --max-model-len 2048 --tokens 256 --max-num-seqs 8 $( [ "${PEER:-1}" = 1 ] || echo --no-peer ) \
        --out-dir "$OUT" >"$OUT/latency_$shape.log" 2>&1
      echo "rc=$?"; tail -16 "$OUT/latency_$shape.log"
      grep -iE "graphs|kernels:|startup|Error" "$OUT/latency_$shape.log" | tail -5
    done
    ;;
  moeserve)
    stamp "serve ladder qwen3-30b-a3b C=1..64"
    rm -rf /tmp/qwen3-30b-a3b && cp -r bench/configs/qwen3-30b-a3b /tmp/qwen3-30b-a3b
    python3 -c "from metrale.bench.synthetic import write_synthetic_tokenizer as w; w('/tmp/qwen3-30b-a3b')"
    python3 -m metrale.cli serve /tmp/qwen3-30b-a3b --load-format dummy --max-model-len 2048 \
      --max-num-seqs 64 --served-model-name qwen3-30b-a3b --port 8888 --log-level INFO \
      >"$OUT/server_moe.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do
      curl -sf localhost:8888/health >/dev/null 2>&1 && break
      sleep 1
    done
    timeout 420 python3 -m metrale.cli bench serve --url http://127.0.0.1:8888 --model qwen3-30b-a3b \
      --shape qwen3-30b-a3b --vocab 151936 --concurrency "${MOELADDER:-1,2,4,8,16,32,64}" --isl 128 \
      --osl 512 --device cuda \
      --server-info "metrale serve --load-format dummy --max-model-len 2048 --max-num-seqs 64" \
      --out-dir "$OUT" >"$OUT/serve_moe.log" 2>&1
    echo "ladder rc=$?"; tail -10 "$OUT/serve_moe.log"
    kill -TERM $server; wait $server; echo "server exit=$?"
    grep -iE "summary|graphs|KV|error" "$OUT/server_moe.log" | head -8
    ;;
  esac
done
stamp done
