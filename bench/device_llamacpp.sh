#!/usr/bin/env bash
# llama.cpp side by side on the GPU machine (bench/llamacpp.py), in device calls carrying .llama
# (bash bench/fetch_llamacpp.sh here first), .devcache and .whl:
#   bash bench/device_llamacpp.sh build   starts the CUDA build of llama-bench (sm_90, static) in
#       the background at nice 19 into /tmp/ft-llama-build and returns; `wait` waits for it and
#       brings the binary back xz-compressed in 15 MB pieces ($OUT/llama-bench.xz.*: copy them
#       into .llama/ here, so a later call on a fresh machine needs no build)
#   bash bench/device_llamacpp.sh restore   the binary from .llama/llama-bench.xz.* into the build
#       folder, alone: a call carrying only the binary (42 MB), so the next call on the same warm
#       machine has room in its carry for the warm kernel cache
#   bash bench/device_llamacpp.sh run [bench.expert_cache args]   restores the binary from
#       .llama/llama-bench.xz.* when the build folder is gone, then runs bench.expert_cache
#       --llamacpp (the same weights written as a GGUF, llama-bench before our rows)
#   bash bench/device_llamacpp.sh prefill [bench.prefill_stream args]   the same for prefill
#       (bench.prefill_stream --llamacpp; the slice's GGUF is shared with `run`)
set -uo pipefail
OUT=${OUT:-/tmp/ft-device-out}
B=/tmp/ft-llama-build
mkdir -p "$OUT"
case "${1:-}" in
  build)
    ( setsid nice -n 19 python3 -m bench.llamacpp --build-only --cuda --build-dir $B > "$OUT/llama-build.log" 2>&1 & ) ;;
  wait)
    while pgrep -f "bench.llamacpp --build-only" > /dev/null; do sleep 5; done
    tail -3 "$OUT/llama-build.log"
    [ -f $B/bin/llama-bench ] && xz -T0 -6 -c $B/bin/llama-bench | split -b 15M - "$OUT/llama-bench.xz." && ls -la "$OUT" ;;
  restore|run|prefill)
    what=$1
    shift
    while pgrep -f "bench.llamacpp --build-only" > /dev/null; do sleep 5; done  # a build still running
    if [ ! -x $B/bin/llama-bench ] && ls .llama/llama-bench.xz.* > /dev/null 2>&1; then
      # to a temporary name first: build() takes an executable llama-bench as finished
      mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/.llama-bench.part \
        && chmod +x $B/bin/.llama-bench.part && mv $B/bin/.llama-bench.part $B/bin/llama-bench
    fi
    if [ "$what" = restore ]; then
      ls -la $B/bin; $B/bin/llama-bench --help > /dev/null 2>&1; rc=$?; echo "llama-bench rc $rc"; exit $rc
    elif [ "$what" = run ]; then python3 -m bench.expert_cache --llamacpp --llamacpp-build $B "$@"
    else python3 -m bench.prefill_stream --llamacpp --llamacpp-build $B "$@"; fi ;;
  *) echo "usage: $0 build|wait|restore|run|prefill [args]"; exit 2 ;;
esac
