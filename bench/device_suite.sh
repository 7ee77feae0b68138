#!/usr/bin/env bash
# The GPU machine's one-call suite: GPU tests, then the benchmarks, newest work first, so a call
# cut short by the 10-minute limit still brings back what is new. Each step writes its own file
# under $OUT; at most 8 files come back, so logs go to stdout except pytest.log (the machine) and
# tests-suite.log (the GPU tests).
# Before each call, here: bash bench/stamp_commit.sh (writes the git-computed commit label and a
# fingerprint of the tree to .devcache/commit; the copy of the tree there has no usable .git).
# Then run through the device tool from the repo root, carrying .devcache and .whl (the wheels
# missing there, made by bench/fetch_device_wheels.sh):  bash bench/device_suite.sh
# Every result records the commit from that stamp (bench/commit.py): "-dirty" if the tree
# differed from HEAD when stamped, "-stale" if it changed after the stamp, "unknown" without one.
# Results land in $OUT (JSON + pytest.log); copy them into benchmarks/results/ afterwards.
# Steps can be skipped to fit the device time left: FT_SKIP_TESTS, FT_SKIP_SERVE, FT_SKIP_PAGED,
# FT_SKIP_DECODE, FT_SKIP_AGENTIC, FT_SKIP_CPU, FT_SKIP_HTTP, FT_SKIP_CACHE, FT_SKIP_SIGNAL, FT_SKIP_INTERFERENCE (any value); FT_TESTS
# (a, b, all) picks the GPU test group; FT_EXTRA_TESTS adds
# test files; FT_CACHE_* set the expert-cache benchmark's arguments (FT_CACHE_PREFETCH: the lookahead's
# values, default 0,2 with the model's routing).
set -uo pipefail
[ -f .devcache/commit ] || echo "warning: no .devcache/commit: results will say commit unknown (run bench/stamp_commit.sh here first)"
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ft-device-out}
mkdir -p "$OUT"
source bench/device_env.sh
step() { echo "=== $* ($(date +%T))"; }
step tests
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-200; free -g | head -2; } > "$OUT/pytest.log" 2>&1
# the GPU tests take more than one call's 10 minutes (Triton compiles): FT_TESTS=a (default) or
# b picks half of them, all both (not yet timed as groups: the old single list got through
# about 230 of its 390 tests in 270 s)
GROUP_A="tests/test_gpu_production.py tests/test_paged_attention.py tests/test_kernels.py tests/test_attention.py
  tests/test_reference.py tests/test_decode_runner.py tests/test_serving_engine.py tests/test_cpu_executor.py
  tests/test_expert_cache.py tests/test_expert_cache_gpu.py tests/test_hostcall.py"
GROUP_B="tests/test_expert_control.py tests/test_gpt_oss.py tests/test_quantized_models.py tests/test_cpu_quantized.py
  tests/test_prefill_stream.py tests/test_expert_cache_quant.py tests/test_sliding_ring.py"
case "${FT_TESTS:-a}" in a) TESTS=$GROUP_A ;; b) TESTS=$GROUP_B ;; *) TESTS="$GROUP_A $GROUP_B" ;; esac
# the control kernel's fuzz tests compile a Triton kernel per random shape (~19 s a test on the
# H200: 12 of them took a whole call); they run here under the interpreter, FT_FUZZ=1 keeps them
FUZZ=(); [ -n "${FT_FUZZ:-}" ] || FUZZ=(-k "not fuzzed")
# file by file (bench/device_tests.sh, FT_PER_FILE seconds each, default 150): a file that needs
# longer (Triton compiles on a fresh machine) costs only its own share, and the log says which
[ -n "${FT_SKIP_TESTS:-}" ] || FT_TAG=suite FT_K="${FUZZ[1]:-}" timeout ${FT_TESTS_TIMEOUT:-300} \
  bash bench/device_tests.sh $TESTS ${FT_EXTRA_TESTS:-} >/dev/null; tail -30 "$OUT/tests-suite.log"
step "CPU branch signal: host-function node vs doorbell (one layer's work; then the real split step)"
if [ -z "${FT_SKIP_SIGNAL:-}" ]; then
  FREETOKEN_CPU_BRANCH=hostfn timeout 150 python3 -m bench.split_overlap --q 2,4 --c 2,4 --name split_overlap-hostfn 2>&1 | grep "^{'q\|rror" | cut -c1-300
  timeout 150 python3 -m bench.split_overlap --q 2,4 --c 2,4 --name split_overlap-doorbell 2>&1 | grep "^{'q\|rror" | cut -c1-300
  timeout 200 python3 -m bench.expert_cache --layers 12 --modes split,cpu-only,cache \
    --fill-shares 0.3,0.4 --threads 14 --cache-warmup 400 --name expert_cache-doorbell 2>&1 | grep "^{'mode\|rror" | cut -c1-300
fi
step "interference: decoding streams while a 32k prompt prefills (decode between layers vs alongside)"
[ -n "${FT_SKIP_INTERFERENCE:-}" ] || timeout 300 python3 -m bench.interference --full-size --long 32768 \
  --settings interleave,overlap 2>&1 | grep "^{'setting\|rror" | cut -c1-400
step expert_cache: 12-layer slice, a third of the experts in VRAM slots, lookahead off and on
# (--prefetch: the model's routers predict; replayed trace routes cannot be predicted)
PF=${FT_CACHE_PREFETCH:-$([ "${FT_CACHE_ROUTING:-model}" = model ] && echo 0,2 || echo 0)}
[ -n "${FT_SKIP_CACHE:-}" ] || timeout ${FT_CACHE_TIMEOUT:-300} python3 -m bench.expert_cache --layers ${FT_CACHE_LAYERS:-12} \
  --capacity ${FT_CACHE_CAPACITY:-0.33} --routing ${FT_CACHE_ROUTING:-model} --prefetch $PF ${FT_CACHE_ARGS:-} 2>&1 | grep -v '^ ' | tail -24
step serve_engine: full-size shape, decode graphs per batch size
[ -n "${FT_SKIP_SERVE:-}" ] || timeout 200 python3 -m bench.serve_engine --full-size --no-prefix-cache --steps 64 \
  --prompt-tokens 512 2>&1 | grep -E 'level:|Error|error|Traceback|wrote' | tail -12
step serve: HTTP, demo model
[ -n "${FT_SKIP_HTTP:-}" ] || timeout ${FT_SERVE_TIMEOUT:-200} python3 -m bench.serve --tokens 64 2>&1 | tail -8
step paged_attention
[ -n "${FT_SKIP_PAGED:-}" ] || timeout 150 python3 -m bench.paged_attention --no-reference 2>&1 | grep -E 'wrote|Error' | tail -3
step decode
[ -n "${FT_SKIP_DECODE:-}" ] || timeout 200 python3 -m bench.decode --experts-on ${FT_DECODE_ON:-gpu,cpu} --tokens ${FT_DECODE_TOKENS:-64} 2>&1 | tail -6
step agentic
[ -n "${FT_SKIP_AGENTIC:-}" ] || timeout 300 python3 -m bench.agentic --full-size 2>&1 | grep -v '^ ' | tail -14
step cpu_attention: the C++ decode attention against the torch path, 6 and 16 threads
if [ -z "${FT_SKIP_CPU:-}" ]; then
  for t in 6 16; do timeout 120 python3 -m bench.cpu_attention --threads $t 2>&1 | grep "^{'sha\|rror" | cut -c1-300
    [ -f "$OUT/cpu_attention-gpu.json" ] && mv "$OUT/cpu_attention-gpu.json" "$OUT/cpu_attention-t$t-gpu.json"; done
fi
step cpu_experts
[ -n "${FT_SKIP_CPU:-}" ] || timeout 240 python3 -m bench.cpu_experts --experts ${FT_CPU_EXPERTS:-768} --batches 1,2,4,8,32 2>&1 | tail -4
step done
