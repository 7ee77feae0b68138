#!/usr/bin/env bash
# The next GPU plan (benchmarks/README.md, "Next on the GPU machine") in three device calls of
# under ten minutes each (the session's 30 minutes), every step under its own time limit, its logs in one file and its
# JSON results in one tarball (a call brings back at most eight files from $OUT).
#   here:   bash bench/stamp_commit.sh
#   device: bash bench/device_plan.sh 1    (carry .devcache and .whl), then 2, then 3, back to
#           back (a machine left idle 30 s is given back; a fresh one costs a minute or more)
# Call 1: the GPU tests of the kernels new since the last GPU run; the C++ error-path probe;
# the kernel timings of this plan (split-key sink attention, the decode kernels' k-sum); the
# full-size Qwen3.6 step's profile.
# Call 2: the 12-layer DeepSeek-V4 slice resident (profile), CPU-only and cached; GLM-5's
# resident (profile) and cached.
# Call 3: the GPU tests not run lately; decoding beside a 32k prefill on an idle host.
set -uo pipefail
STAGE=${1:?usage: bash bench/device_plan.sh 1|2|3}
OUT=${OUT:-/tmp/ft-device-out}
mkdir -p "$OUT"
LOG="$OUT/plan$STAGE.log"
source bench/device_env.sh
# step SECONDS NAME COMMAND...: the command's output into the log, under a time limit
step() {
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T))" >> "$LOG"
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "=== rc $? $name ($(date +%T))" >> "$LOG"
}
case "$STAGE" in
1)  # time limits add up to 570 s
  # first the kernels that became the default on CUDA since the last GPU run (shared expert,
  # k-sum, DeltaNet value split) and the model-level graph replays that run them
  FT_TAG=plan1 FT_PER_FILE=60 bash bench/device_tests.sh tests/test_shared_expert_kernels.py > /dev/null
  FT_TAG=plan1 FT_PER_FILE=80 FT_K="delta or sum_pairs or moe_decode or inactive" bash bench/device_tests.sh \
    tests/test_kernels.py > /dev/null
  FT_TAG=plan1 FT_PER_FILE=90 bash bench/device_tests.sh tests/test_gpu_production.py > /dev/null
  step 80 probe python3 -m bench.probe_cpp_errors
  FT_TAG=plan1 FT_PER_FILE=60 FT_K="checks_bank_shapes or bad_expert_id" bash bench/device_tests.sh \
    tests/test_cpu_quantized.py > /dev/null
  step 30 csa-b1 python3 -m freetoken.kernels.csa_decode 1
  step 30 csa-b8 python3 -m freetoken.kernels.csa_decode 8
  step 60 decode-profile python3 -m bench.decode --experts-on gpu --tokens 32 --profile
  step 80 quant-experts python3 -m bench.quant_experts --batches 1,4
  ;;
2)  # 595 s
  step 115 deepseek_v4-resident python3 -m bench.large_models --arch deepseek_v4 --layers 12 --modes resident \
    --profile --name large_models-deepseek_v4-12l-profile
  step 210 deepseek_v4-cache python3 -m bench.large_models --arch deepseek_v4 --layers 12 --modes cpu-only,cache \
    --threads 6 --cache-warmup 1200 --name large_models-deepseek_v4-12l-fused
  step 270 glm_moe_dsa python3 -m bench.large_models --arch glm_moe_dsa --layers 12 --modes resident,cache \
    --threads 6 --cache-warmup 1200 --profile --name large_models-glm_moe_dsa-12l-fused
  ;;
3)  # 530 s (test_quantized_models and test_prefill_stream: a later call)
  FT_TAG=plan3 FT_PER_FILE=100 bash bench/device_tests.sh tests/test_kernels.py tests/test_serving_engine.py > /dev/null
  FT_TAG=plan3 FT_PER_FILE=120 FT_K=on_cuda bash bench/device_tests.sh tests/test_expert_cache_quant.py > /dev/null
  step 210 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap
  ;;
4)  # the sixth session's last call (its ~560 s of device time left): the split sink-attention
  # kernel on (its tests, its timing with errors), the C++ literal-message checks, the largest
  # DeepSeek-V4 / GLM-5 slices the host RAM holds (issue 14)
  FT_TAG=plan4 FT_PER_FILE=60 FT_K=sink bash bench/device_tests.sh tests/test_csa_kernels.py > /dev/null
  step 25 csa-b1 python3 -m freetoken.kernels.csa_decode 1
  step 235 deepseek_v4-28l python3 -m bench.large_models --arch deepseek_v4 --layers 28 \
    --modes resident,cpu-only,cache --threads 6 --cache-warmup 1200 --name large_models-deepseek_v4-28l
  step 40 probe python3 -m bench.probe_cpp_errors forward_bad_scale,bad_act,qbanks_bad_scale
  step 170 glm_moe_dsa-20l python3 -m bench.large_models --arch glm_moe_dsa --layers 20 --modes resident,cache \
    --threads 6 --cache-warmup 1200 --name large_models-glm_moe_dsa-20l
  ;;
*) echo "stage 1, 2, 3 or 4"; exit 2 ;;
esac
# the JSON results in one file (each keeps its own name inside)
(cd "$OUT" && ls ./*.json >/dev/null 2>&1 && tar czf "results-plan$STAGE.tgz" ./*.json && rm -f ./*.json)
grep -E '^===|passed|failed|tok/s|Error' "$LOG" | tail -40
tail -5 "$OUT"/tests-plan*.log 2>/dev/null
