#!/usr/bin/env bash
# One measurement call on a lent GPU machine (no network there): install the service's packages from the wheels
# carried in .whl-svc/ (docs/benchmarks.md says how they are fetched), then run the stages named as arguments, each
# under its own time limit, writing reports and logs under $OUT. Stages:
#   service   Qwen3-0.6B shape: the service at its shipped settings (current and long workloads, 64 chats), the
#             engine called directly (also with stop strings, streamed, and sampled at temperature 1.0) and plain
#             generate's best configurations, in one process
#   fallback  a Phi-2-shaped model (outside the native list): the engine's fallback path against plain generate
#   fallback-profile  the same model's fallback step timed part by part on the host (docs/results/cpu-fallback-profile.py),
#             at the shipped prefill pieces and at 4x larger ones
#   constrained  the cost of one grammar-constrained request (forced tool call, tool_choice auto) to the batch
#   long-generate  plain generate's baselines on the long workload, alone on the device
#   ttft      live chats' time to first token through the service against the engine: idle, 64 at once, during a
#             batch; ttft-every-step: the same with every engine step's tokens streamed (STREAM_INTERVAL_MS=0)
#   suite     xpu-jobs doctor, then the tests that touch the device with XPUJOBS_TEST_BACKEND=cuda
#   engine-check  bench.generation --check, then the engine (base and 4 mixed adapters) and plain generate
#   decode-attention  the paged decode-attention kernel's launch configurations (bench/decode_attention.py)
#   batch-sizes  the engine (both workloads) at decode batches of at most 256, 512 and 1024 rows
#   profile   the shipped engine's device kernel time per kind and decode step against wall time (bench/profile_decode.py)
#   training  fine-tuning throughput against a plain Trainer + PEFT script, with and without packing (bench/training.py)
#   priority  live requests' time to first token while a batch runs in the same engine, at live and at batch
#             priority (bench/generation.py's engine-live variant on the long workload)
# Usage: bash bench/gpu_run.sh service fallback
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-svc/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the stack's own processes find the `xpu-jobs` entry points through python -m, and the wheels through PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, celery, redis, fastapi; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'celery', celery.__version__, 'redis-py', redis.__version__, 'fastapi', fastapi.__version__)" \
  | tee -a "$OUT/gpu.txt"
git log -1 --format='%H %s' >> "$OUT/gpu.txt" 2>/dev/null || true

# the tests that touch the device (SUITE_TESTS overrides)
DEVICE_TESTS="tests/test_engine.py tests/test_engine_architectures.py tests/test_kv_cache.py tests/test_inference.py
  tests/test_inference_api.py tests/test_streaming.py tests/test_structured_outputs.py tests/test_batches.py
  tests/test_fine_tune_e2e.py tests/test_bad_input.py tests/test_launcher.py tests/test_reconciler.py
  tests/test_worker_faults.py tests/test_training.py tests/test_qlora_serving.py tests/test_reclaimable.py"

stage() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/stages.txt"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  tail -25 "$OUT/$name.log"
}

for s in "$@"; do
  case $s in
    service)
      stage service 420 python3 -m bench.generation --model qwen3-0.6b --device cuda --workloads current,long \
        --generate-prompts 256 --service-first --chats 64 \
        --variants service,current:engine-cold,current:engine,current:engine-stop,current:engine-stream,current:engine-sample,current:engine-adapters,current:generate-bs256,current:generate-static-bs256,long:engine,long:generate-bs256 \
        --out "$OUT/h200-service.json" ;;
    fallback)
      stage fallback 150 python3 -m bench.generation --model phi2-0.6b --device cuda \
        --variants generate-bs256,generate-static-bs256,engine --out "$OUT/h200-fallback.json" ;;
    fallback-profile)
      stage fallback-profile 150 python3 docs/results/cpu-fallback-profile.py 256 128 cuda phi2-0.6b
      stage fallback-profile-32k 150 python3 docs/results/cpu-fallback-profile.py 256 128 cuda phi2-0.6b 32768 ;;
    constrained)  # one request under a grammar (a forced tool call, tool_choice auto) among 128 plain ones
      stage constrained 150 python3 -m bench.constrained --model qwen3-0.6b --device cuda --workloads wide \
        --variants plain,one-tool,one-auto --out "$OUT/h200-constrained.json" ;;
    long-generate)  # plain generate's baselines on the long workload, alone (the engine's cache is not there)
      stage long-generate 240 python3 -m bench.generation --model qwen3-0.6b --device cuda --workloads long \
        --generate-prompts 256 --variants long:generate-bs256,long:generate-static-bs256 \
        --out "$OUT/h200-long-generate.json" ;;
    ttft)  # live chats' time to first token: idle, 64 at once, during a batch; then every step's tokens streamed
      stage ttft 200 python3 -m bench.ttft --model qwen3-0.6b --requests 64 --batch-lines 512 --out "$OUT/h200-ttft.json" ;;
    ttft-every-step)
      stage ttft-every-step 200 python3 -m bench.ttft --model qwen3-0.6b --requests 64 --batch-lines 0 \
        --stack-env XPUJOBS_ENGINE_STREAM_INTERVAL_MS=0 --out "$OUT/h200-ttft-every-step.json" ;;
    suite)  # xpu-jobs doctor, then the tests that touch the device, with the suite's backend set to cuda
      stage doctor 120 python3 -m worker.cli doctor
      stage suite ${SUITE_LIMIT:-420} env XPUJOBS_TEST_BACKEND=cuda python3 -m pytest -q -p no:cacheprovider \
        --timeout 300 ${SUITE_TESTS:-$DEVICE_TESTS} ;;
    engine-check)  # the engine's greedy tokens against generate on the device, then engine, adapters and generate
      stage engine-check 300 python3 -m bench.generation --model qwen3-0.6b --device cuda --check --generate-prompts 256 \
        --variants current:engine,current:engine-adapters,current:generate-bs256 --out "$OUT/h200-engine-check.json" ;;
    decode-attention)  # the paged decode-attention kernel alone, per launch configuration
      stage decode-attention 150 python3 -m bench.decode_attention --device cuda --out "$OUT/h200-decode-attention.json" ;;
    batch-sizes)  # the engine at XPUJOBS_ENGINE_MAX_BATCH_SIZE 256, 512 and 1024, both workloads
      for n in 256 512 1024; do
        stage batch-$n 150 env XPUJOBS_ENGINE_MAX_BATCH_SIZE=$n python3 -m bench.generation --model qwen3-0.6b \
          --device cuda --workloads current,long --variants engine --out "$OUT/h200-batch-$n.json"
      done ;;
    profile)  # device kernel time per kind and step against wall time, the base and 4 mixed LoRA adapters
      stage profile 240 python3 -m bench.profile_decode --model qwen3-0.6b --device cuda --adapters 0,4 \
        --out "$OUT/h200-profile.json" ;;
    training)  # a job's training against a plain Trainer + PEFT script, with and without packing
      stage training 330 python3 -m bench.training --model qwen3-0.6b --device cuda --steps 40 --warmup 5 \
        --rounds 3 --batch-size 8 --examples 2000 --longest 2048 --out "$OUT/h200-training.json" ;;
    priority)
      stage priority 150 python3 -m bench.generation --model qwen3-0.6b --device cuda --workloads long \
        --variants long:engine-live --live-requests 64 --live-interval 0.1 --out "$OUT/h200-priority.json" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
# the service stacks' own logs (API, workers, Redis), one archive
tar -czf "$OUT/stack-logs.tgz" /tmp/xpujobs-bench-*/stack.log /tmp/xpujobs-bench-*/logs 2>/dev/null || true
