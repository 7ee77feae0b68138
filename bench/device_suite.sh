#!/usr/bin/env bash
# The GPU machine's one-call suite: GPU tests, server (engine loop, then HTTP), agentic replay,
# full-size decode, CPU executor.
# Newest work first, so a call cut short by the 10-minute limit still brings back what is new.
# Before each call, here: bash bench/stamp_commit.sh (writes the git-computed commit label and
# a fingerprint of the tree to .devcache/commit; the copy of the tree there has no usable .git).
# Then run through the device tool from the repo root, carrying .devcache and .whl (the wheels
# missing there, made by bench/fetch_device_wheels.sh):  bash bench/device_suite.sh
# Every result records the commit from that stamp (bench/commit.py): "-dirty" if the tree
# differed from HEAD when stamped, "-stale" if it changed after the stamp, "unknown" without
# one; nothing is typed (FT_COMMIT is gone).
# Results land in $OUT (JSON + logs); copy them into benchmarks/results/ afterwards.
# Steps can be skipped to fit the device time left: FT_SKIP_TESTS, FT_SKIP_CPU, FT_SKIP_DECODE,
# FT_SKIP_AGENTIC (any value); the serve step always runs.
set -uo pipefail
[ -f .devcache/commit ] || echo "warning: no .devcache/commit: results will say commit unknown (run bench/stamp_commit.sh here first)"
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ft-device-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | head -20; free -g; } > "$OUT/machine.txt" 2>&1
step() { echo "=== $* ($(date +%T))"; }
step tests
[ -n "${FT_SKIP_TESTS:-}" ] || timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/test_reference.py tests/test_cpu_executor.py tests/test_kernels.py tests/test_deltanet_chunks.py tests/test_attention.py tests/test_decode_runner.py \
  2>&1 | tail -25 | tee "$OUT/pytest.log"
step serve_engine
timeout 180 python3 -m bench.serve_engine --profile ${FT_SERVE_ENGINE_ARGS:-} 2>&1 | grep -v '^ *["{}]' | tail -40
step serve_engine_graphs
timeout 180 python3 -m bench.serve_engine --cuda-graphs 2>&1 | grep -E 'level:|graph|Error|error' | tail -12
step serve
timeout ${FT_SERVE_TIMEOUT:-240} python3 -m bench.serve --tokens 64 2>&1 | tail -6
step agentic
[ -n "${FT_SKIP_AGENTIC:-}" ] || timeout 400 python3 -m bench.agentic --full-size 2>&1 | tee "$OUT/agentic.log" | grep -v '^ ' | tail -14
step decode
[ -n "${FT_SKIP_DECODE:-}" ] || timeout 400 python3 -m bench.decode --experts-on ${FT_DECODE_ON:-gpu,cpu} --tokens ${FT_DECODE_TOKENS:-64} --profile 2>&1 | tail -40
step cpu_experts
[ -n "${FT_SKIP_CPU:-}" ] || timeout 240 python3 -m bench.cpu_experts --experts ${FT_CPU_EXPERTS:-768} --batches 1,2,4,8,32 2>&1 | tail -4
step done
