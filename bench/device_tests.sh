#!/usr/bin/env bash
# GPU tests file by file, each under its own time limit, into one log ($OUT/tests-<tag>.log), so
# one slow file (Triton compiles) cannot eat a whole device call. Usage, through the device tool:
#   FT_TAG=a1 bash bench/device_tests.sh tests/test_x.py tests/test_y.py ...
# FT_PER_FILE (seconds, default 150) limits each file; FT_K passes a -k filter; FT_ARGS more pytest
# arguments (e.g. -o faulthandler_timeout=60: every thread's stack when a test runs past 60 s).
set -uo pipefail
OUT=${OUT:-/tmp/ft-device-out}; mkdir -p "$OUT"
LOG="$OUT/tests-${FT_TAG:-run}.log"
source bench/device_env.sh
K=(); [ -n "${FT_K:-}" ] && K=(-k "$FT_K")
for f in "$@"; do
  echo "=== $f ($(date +%T))" >> "$LOG"
  timeout "${FT_PER_FILE:-150}" python3 -m pytest -q -p no:cacheprovider -rfE --tb=short "${K[@]}" ${FT_ARGS:-} "$f" >> "$LOG" 2>&1
  echo "=== rc $? ($(date +%T))" >> "$LOG"
done
grep -E '^===|passed|failed|error' "$LOG" | tail -60
