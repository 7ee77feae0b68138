#!/usr/bin/env bash
# The next GPU plan (benchmarks/README.md, "Next on the GPU machine") in three device calls of
# under ten minutes each (the session's 30 minutes), every step under its own time limit, its logs in one file and its
# JSON results in one tarball (a call brings back at most eight files from $OUT).
#   here:   bash bench/stamp_commit.sh
#   device: bash bench/device_plan.sh 1    (carry .devcache and .whl), then 2, then 3, back to
#           back (a machine left idle 30 s is given back; a fresh one costs a minute or more)
# Call 0: the CPU kernels' rows on huge-page banks (issue 12), the prefill threshold with AMX.
# Call 1: the int8-activation CPU path (--cpu-act int8, issue 12): its tests on the Xeon (VNNI),
# the CPU executor's GB/s at 6 and 16 threads against host read, exact and int8 in one run.
# Call 2: the same on the models: V4's 12-layer slice CPU-only and cached with int8, the
# full-size Qwen3.6 shape's MXFP4 cache rows (issue 10's rows with a 4-bit pool).
# Call 3: the Qwen3.6 MXFP4 rows with int8; test_expert_cache_quant.py -k on_cuda with time enough.
# Call 4 (if time is left): short prompts jumping in between an interleaved prompt's layers;
# the 40-layer streamed prefill.
# Call 5: fla's DeltaNet prefill, the 40-layer streamed prefill with it, the interleaved 32k prompt.
# Call 6: fla's tests and the production configs again, the interleaved 32k prompt again.
# Call 9: the interference rows with the warm-up and the GIL switch interval.
# Call 8: fla in the engine call by call; the CPU kernels' bf16/fp8 rows on huge banks.
# Call 11: call 10 again with the wider warm-up, then the rest of call 0's CPU rows.
# Call 12: decode steps inside streamed prefill passes (issue 11), their GPU tests.
# Call 13: the float32 CUDA test of it, the CUDA streamed prefill tests, its interference row again.
# Call 14: the interference rows with decode steps between a layer's halves too (MID_LAYER).
# Call 15: the doorbell's late-thread fix on the GPU, one CUDA streamed-prefill case.
# Call 16: the control kernel's warm-up on the GPU, two CUDA streamed-prefill cases.
# Call 17: GLM-5's 20-layer slice CPU-only (issue 14).
# Call 18: the prompt chunks' MoE graphs: tests, chunked prefill with and without.
# Call 19: the 32k interference rows with and without them.
# Call 21: the graphs with the DeltaNet mixers, the headroom rule: tests, chunked prefill, interference.
# Call 22: the prefill graphs up to 2,048-token chunks: chunked prefill, interference.
# Call 23: the control kernel's compile time per call size (fill_cap), the streamed-prefill test.
# Call 24: the control kernel's large variants with more warps.
# Call 25: the control kernel's pair buckets, its GPU tests, the interference row with cost_model.
# Call 26: the CUDA streamed-prefill cases with the bucketed control kernel, the production configs.
# Call 27: the 32k interference row with the experts offloaded behind the cache (--moe cache).
# Call 28: the CPU int8 kernels with VBMI and the L2 look-ahead on the Xeon (issue 12), the fixed
# control test, the 32k interference row again (issue 9: how far two runs of it differ).
# Call 29: the control test again; the 32k interference row with the collector frozen and timed.
# Call 30: the 32k interference row with the page gather's kept buffers and without, allocator events counted.
# Call 31: the 32k interference row twice with cuDNN left out. Call 32: the CPU executor's fixed cost per call.
# Call 33: one prompt chunk's layers profiled (layer 3's extra device time). Call 34: the 32k row with halves.
# Call 35: decode steps between layers read a hook later (deferred), against waiting ones.
# Call 36: where the host synchronises in the loaded window (sync debug mode). Call 37: its long host calls.
# Call 38: the pair with larger launch queues, and point costs on the device's clock. Call 39: the
# Xeon's fixed cost per CPU call by part. Call 40: the host's long calls with the larger queues.
# Call 41: the 32k row with the first-token gap floor and 4x queues by default, host and device costs.
# Call 42: where the host's long calls come from (Python frames); the 32k row with device costs by default.
# Call 43: the first loaded row of a process, layer events on; the stall filter in a second process.
# Calls 44-46: a short prompt's forward by its own clock (BY_CLOCK), start marks, and both against
# fd9e29e's pacing. Calls 47-49 (written for the next session): waiting for steps before eager
# points, start_marks and BY_CLOCK each alone, the tail points' cycles (TAIL_CYCLES). Call 50:
# the CPU executor at 15 threads beside 16 and 6, each row routed afresh.
# Call 51: the polled overlap (decode graphs on a high-priority stream from the loop's thread).
# Call 52: the polled overlap on an 8k prompt, stacks and progress lines. Call 53: the 32k interleave
# rows after the decode runner's whole-buffer input copy. Call 54: the 32k rows after a throwaway
# 8k loaded window (--warm-loaded).
# Call 72: OpenMP's spin A/B on the CPU branch; pure-CPU decode on the Xeon beside llama.cpp.
# Call 73: the host thread's wait for a step (runtime/host_wait.py) at 14 and 16 threads on the 40-layer MXFP4 slice.
# Call 89: the control kernel in the real step, 8 warps and 4,096-slot chunks against 4 and 1,024.
# Call 91: the control kernel's fuzz cases past seed 12 and the cache's hostfn GPU tests.
# Call 93: the cache step's trims (shared expert before the wait, no cast or copy kernels), tested and timed;
# the control kernel with a cold L2. Call 94: the 14/16-thread side-by-side with the resident row.
# Call 100: issue 9's CPU side at the real shape (40 layers, CPU-only on the Xeon); 101 with a 4k prompt.
# Calls 102-103: the 40-layer CPU rows at 2k: the expert pieces' A/B, then the mixed forward beside the interleave.
# Calls 95-97 (thirtieth session): issue 9's 32k rows in fresh processes (GPU) and on the Xeon's cores
# (CPU), then plan 93's tests. Call 92: plan 83's drift row with the C++ executor's dynamic schedule against its static default.
# Call 90: plan 85's 14/16-thread rows beside llama.cpp three times (the ratio moved 1.18x-1.72x).
# Call 83: plan 82 again with room for the compiles: the GPU tests, verbose, and a shorter drift run.
# Call 82: the GPU tests of the cache after the control kernel's new decode variants; the split under a hog started mid-run.
# Call 81: call 80's A/B again after its capture fix (6 threads, no llama.cpp; carry the warm cache).
# Call 80: the doorbell's wait on the main stream against the side stream, beside llama.cpp at 6 and 16 threads.
# Call 79: the control kernel's time per call by warps and scan block; a step's host split and timeline.
# Call 78: fixed fill shares 0.2-0.4, fill-only and the cache at 14 and 16 threads beside llama.cpp.
# Call 77: the Xeon's pure-CPU rows with torch kept to the row's threads, and the step by part.
# Call 76: plan 70 again after host_wait (16-thread rows beside llama.cpp in one run), the spin A/B at 16.
# Call 7: fla's engine test, the 32k interference rows with the ceiling and the pacer, a prefill profile.
set -uo pipefail
STAGE=${1:?usage: bash bench/device_plan.sh N, N from 0 to 103}
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
# prefill_kernel_rows TAG PER_FILE LIMIT_ON LIMIT_OFF: the prefill kernels' CUDA tests (each file
# under PER_FILE s), then the 12-layer pass rows with FREETOKEN_PREFILL_KERNELS=1 (profiled) and =0
prefill_kernel_rows() {
  export FREETOKEN_PREFILL_KERNELS=1
  FT_TAG=$1 FT_PER_FILE=$2 FT_K="causal_conv or moe_grouped or fused_linear or deltanet_layer or gated_rms or sum_pairs or no_expert or router or grouped_kernel" \
    bash bench/device_tests.sh tests/test_kernels.py tests/test_layers.py tests/test_quant_kernels.py > /dev/null
  step "$3" prefill-12 python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering double \
    --no-resident --compute-pass --compute-subs 8192 --profile --name prefill_stream-profile-conv
  step "$4" prefill-12-before env FREETOKEN_PREFILL_KERNELS=0 python3 -m bench.prefill_stream --layers 12 \
    --lengths 8192,32768 --buffering double --no-resident --compute-pass --compute-subs 8192 \
    --name prefill_stream-profile-noconv
}
# fixed_cost_rows TAG: issue 12's batch-1 rows with --fixed-cost (experts from cache beside the DRAM
# rows), MXFP4 and NVFP4 at 6 and 16 threads, as cpu_experts-FORMAT-TAG-tTHREADS
fixed_cost_rows() {
  step 120 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  for f in mxfp4 nvfp4; do
    for t in 6 16; do
      step 60 "$1-$f-t$t" python3 -m bench.cpu_experts --format $f --experts 512 --threads $t \
        --batches 1,4 --iters 20 --fixed-cost --name "cpu_experts-$f-$1-t$t"
    done
  done
}
# cpu_rows "FORMATS" "THREADS": the C++ executor's batch 1 and 4 rows on huge-page banks (issue 12),
# after building it (a 45 s step limit had killed the JIT build three times in stage 8)
cpu_rows() {
  step 120 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  for f in $1; do
    for t in $2; do
      step 45 "cpu_experts-$f-t$t" python3 -m bench.cpu_experts --format $f --experts 512 --threads $t \
        --batches 1,4 --iters 20 --name "cpu_experts-$f-huge-t$t"
    done
  done
}
# the AMX prefill threshold: torch's GEMMs against the C++ kernel on prefill chunks
prefill_threshold() {
  step 100 cpu_experts-bf16-prefill python3 -m bench.cpu_experts --format bf16 --experts 256 --threads 6 \
    --batches 16,32,64,128,256,512 --iters 4 --name cpu_experts-bf16-prefill-threshold-t6
}
case "$STAGE" in
0)  # 580 s: the CPU kernels on the engine's huge-page banks (bench.cpu_experts since db6c38e), with
  # the prefetches as volatile asm (GCC 12 had dropped them; GCC 13 here kept them: a check that
  # nothing changed), int8 against exact, and torch's GEMMs against the C++ kernel on prefill
  # chunks with AMX (FLOAT_TORCH_THRESHOLD: 256 since stage 8 measured it)
  FT_TAG=plan0 FT_PER_FILE=90 bash bench/device_tests.sh tests/test_cpu_prefetch.py tests/test_cpu_executor.py > /dev/null
  cpu_rows "bf16 mxfp4 nvfp4 fp8_block" "6 16"
  prefill_threshold
  ;;
1)  # 560 s
  FT_TAG=plan1 FT_PER_FILE=120 bash bench/device_tests.sh tests/test_cpu_int8_act.py tests/test_cpu_quantized.py > /dev/null
  # the HCA compressor's split form (off until timed: csa_decode.SPLIT_SLOTS) against one program
  FT_TAG=plan1 FT_PER_FILE=60 FT_K=compress bash bench/device_tests.sh tests/test_csa_kernels.py > /dev/null
  step 25 csa-b1 python3 -m freetoken.kernels.csa_decode 1
  for f in mxfp4 nvfp4; do
    for t in 6 16; do
      step 65 "cpu_experts-$f-t$t" python3 -m bench.cpu_experts --format $f --experts 2048 --threads $t \
        --batches 1,4 --iters 30 --name "cpu_experts-$f-int8-t$t"
    done
  done
  ;;
2)  # 580 s
  step 200 deepseek_v4-int8 python3 -m bench.large_models --arch deepseek_v4 --layers 12 --modes cpu-only,cache \
    --threads 6 --cache-warmup 1200 --cpu-act int8 --name large_models-deepseek_v4-12l-int8
  step 370 qwen-mxfp4 python3 -m bench.large_models --arch qwen3_5_moe --expert-format mxfp4 --modes cache,cpu-only \
    --threads 6 --cpu-act exact --name large_models-qwen3_5_moe-mxfp4-exact
  ;;
3)  # 570 s
  step 200 qwen-mxfp4-int8 python3 -m bench.large_models --arch qwen3_5_moe --expert-format mxfp4 --modes cache,cpu-only \
    --threads 6 --cpu-act int8 --name large_models-qwen3_5_moe-mxfp4-int8
  FT_TAG=plan3 FT_PER_FILE=300 FT_K=on_cuda bash bench/device_tests.sh tests/test_expert_cache_quant.py > /dev/null
  ;;
4)  # if the session has time left: short prompts jumping in between an interleaved prompt's
  # layers (TTFT behind a 32k prompt, issue 9), and the 40-layer streamed prefill (issue 11)
  step 240 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap
  step 300 prefill-stream-40 python3 -m bench.prefill_stream --layers 40 --lengths 4096,16384,32768 \
    --buffering double,on-demand
  ;;
5)  # 560 s: flash-linear-attention's DeltaNet prefill (kernels/fla_delta.py) against the torch
  # rule, its tests beside the production configs against transformers; the 40-layer streamed
  # prefill with it (issue 11: the 32k pass was compute-bound at 2.6 s); the interleaved 32k
  # prompt with the cost model that no longer collapses to 32-token chunks (issue 9: 346 tok/s)
  FT_TAG=plan5 FT_PER_FILE=110 bash bench/device_tests.sh tests/test_deltanet_chunks.py tests/test_gpu_production.py > /dev/null
  step 60 deltanet-prefill python3 -m bench.deltanet_prefill --lengths 512,2048,8192,32768
  step 160 prefill-stream-40-fla python3 -m bench.prefill_stream --layers 40 --lengths 8192,16384,32768 \
    --buffering double --name prefill_stream-40l-fla
  step 190 interference-interleave python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --name interference-full-costmodel
  ;;
6)  # 520 s: fla's tests with time for its autotuning, the production configs against transformers
  # (the reference models imported with fla hidden: tests/conftest.py), the interleaved 32k prompt
  # with the chunk doubling out of MIN_PREFILL (stage 5 found the chunks stuck at 32 tokens)
  FT_TAG=plan6 FT_PER_FILE=200 bash bench/device_tests.sh tests/test_deltanet_chunks.py > /dev/null
  FT_TAG=plan6 FT_PER_FILE=120 bash bench/device_tests.sh tests/test_gpu_production.py > /dev/null
  step 190 interference-interleave python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --name interference-full-chunkgrowth
  ;;
7)  # 560 s, written for the next session: fla's engine test at 128-wide heads and the rest of its
  # tests; the interleaved 32k prompt with GAP_CEILING and the overlapped one with LayerPacer
  # (issue 9); where a prefill chunk's time goes now that DeltaNet is on fla (issue 11)
  FT_TAG=plan7 FT_PER_FILE=200 bash bench/device_tests.sh tests/test_deltanet_chunks.py > /dev/null
  step 250 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap \
    --name interference-full-ceiling-pacer
  step 100 prefill-profile python3 -m bench.prefill --lengths 2048,8192
  ;;
8)  # 540 s: fla in the engine checked call by call against our rule (stage 7's engine test held
  # bf16 logits to 3%, which this random model's own bf16 noise exceeds: transformers' bf16 run
  # is ~30% off its fp32 run); the CPU kernels' bf16 and fp8 rows on huge-page banks and the
  # AMX prefill threshold (issue 12; stage 0 without the rows stage 1 already has)
  FT_TAG=plan8 FT_PER_FILE=200 bash bench/device_tests.sh tests/test_deltanet_chunks.py > /dev/null
  step 60 fla-engine-diag python3 -m bench.fla_engine_diag
  cpu_rows "bf16 fp8_block" "6 16"
  prefill_threshold
  ;;
9)  # 510 s: the 32k interference rows with the load-time prefill warm-up (stage 7's interleaved
  # run had a 0.75 s autotune inside its first long chunk) and the overlap with a 0.2 ms GIL
  # switch interval against Python's 5 ms (stage 7's overlapped prompt: 591 tok/s); the bf16 and
  # fp8 rows stage 8 lost to the C++ executor's build (45 s limits: build it first)
  step 330 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap,overlap-gil5ms \
    --name interference-full-warmup-gil
  cpu_rows "bf16 fp8_block" "6"
  ;;
10) # 300 s: the 32k interference rows with the warm-ups the full-size bench engine had skipped
  # (bench/fullsize.py builds its engine without Engine.__init__: no fla warm-up, no prefill
  # warm-up; stages 7 and 9 had 0.75 s and 3.4 s inside one layer of the first long chunk)
  step 290 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap \
    --name interference-full-warm
  ;;
11) # 420 s: stage 10 again with the warm-up's wider lengths and the chunk doubling cap (7c74452,
  # not yet run on a GPU), then the rest of stage 0's CPU rows on huge-page banks (issue 12)
  step 290 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,overlap \
    --name interference-full-warm2
  cpu_rows "mxfp4 nvfp4" "6 16"
  cpu_rows "bf16" "16"
  ;;
12) # 560 s: decode steps between the layers of streamed prefill passes (issue 11: a stream decoding
  # beside a 32k prompt with the experts offloaded), against decode between passes only
  FT_TAG=plan12 FT_PER_FILE=170 FT_K=cuda bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  step 370 interference-cache python3 -m bench.interference --full-size --moe cache --expert-cache 16GB \
    --long 32768 --settings budget,interleave --warm-long 4096 --name interference-full-cache
  ;;
13) # 560 s, written for the next session: the float32 CUDA test of decode inside streamed passes
  # (stage 12's bf16 version drifted 2-10%, the size of a real fault; ~50 s a case), the
  # interference rows again with passes kept whole beside decode rows (153a26e). The other CUDA
  # streamed prefill tests need a call of their own: one case took ~190 s in stage 12
  FT_TAG=plan13 FT_PER_FILE=240 FT_K=cuda_decode_steps FT_ARGS="-o faulthandler_timeout=220" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  step 260 interference-cache python3 -m bench.interference --full-size --moe cache --expert-cache 16GB \
    --long 32768 --settings interleave --warm-long 4096 --cache-warmup 240 --name interference-full-cache-whole
  ;;
14) # 330 s, written for the next session: the 32k interference rows with the experts in VRAM and
  # decode steps also between each layer's mixer and MLP (interleave.MID_LAYER, off by default) against
  # whole layers only (issue 9: p99 2.28x at 19994bd, the layer's fixed part over the gap's room)
  step 320 interference python3 -m bench.interference --full-size --long 32768 --settings interleave-halves,interleave-layers \
    --name interference-full-midlayer
  ;;
15) # 560 s: the doorbell's late-thread fix (the thread took a ring made before it started as
  # already seen: "rung 1, seq 1, entered 0"; the split cases of the quantized cache test failed
  # with it in plans 3 and earlier), then one CUDA streamed-prefill case (~190 s alone)
  FT_TAG=plan15 FT_PER_FILE=120 bash bench/device_tests.sh tests/test_hostcall.py > /dev/null
  FT_TAG=plan15 FT_PER_FILE=300 FT_K=on_cuda bash bench/device_tests.sh tests/test_expert_cache_quant.py > /dev/null
  FT_TAG=plan15 FT_PER_FILE=230 FT_K="cuda_streamed and double-32768" FT_ARGS="-o faulthandler_timeout=210" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
16) # 450 s, written for the next session: the control kernel's warm-up (a8d0563: K a runtime int,
  # the prefill variants compiled at allocate; the test asserts no compile after it), then the
  # CUDA streamed-prefill cases that plan 15's compiles had timed out, two at first
  FT_TAG=plan16 FT_PER_FILE=60 FT_K=before_its_thread bash bench/device_tests.sh tests/test_hostcall.py > /dev/null
  FT_TAG=plan16 FT_PER_FILE=180 bash bench/device_tests.sh tests/test_expert_control.py > /dev/null
  FT_TAG=plan16 FT_PER_FILE=230 FT_K="cuda_streamed and (double-32768 or single)" FT_ARGS="-o faulthandler_timeout=220" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
17) # 460 s: GLM-5's 20-layer slice CPU-only (issue 14: the row the 20-layer run had no time for;
  # 92.4 GB of NVFP4 in host RAM, as the cache row held them)
  step 450 glm-20l-cpu python3 -m bench.large_models --arch glm_moe_dsa --layers 20 --modes cpu-only \
    --threads 6 --name large_models-glm_moe_dsa-20l-cpu-only
  ;;
18) # 400 s: the prompt chunks' MoE graphs (runtime/prefill_graphs.py, issue 9): their tests, then a
  # prompt in chunks of 32 to 512 tokens with the graphs and eagerly (ms per chunk: the host time saved)
  FT_TAG=plan18 FT_PER_FILE=170 bash bench/device_tests.sh tests/test_prefill_graphs.py > /dev/null
  step 220 prefill-graphs python3 -m bench.prefill --lengths 2048 --chunks 32,64,128,256,512 --total 1024 \
    --name prefill-graphs
  ;;
19) # 420 s: the 32k interference rows, experts in VRAM, with the MoE prefill graphs and without (issue 9)
  step 410 interference python3 -m bench.interference --full-size --long 32768 --settings interleave,interleave-eager-moe \
    --name interference-full-prefill-graphs
  ;;
20) # 380 s: where stage 16's two files spent their time (both ran out of it with no output): each
  # test's duration and, past a minute in one test, every thread's stack
  FT_TAG=plan20 FT_PER_FILE=170 FT_ARGS="-v --durations=0 -o faulthandler_timeout=60" \
    bash bench/device_tests.sh tests/test_expert_control.py > /dev/null
  FT_TAG=plan20 FT_PER_FILE=200 FT_K="cuda_streamed and single" FT_ARGS="-v -o faulthandler_timeout=90" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
21) # 410 s: the prompt chunks' graphs with the DeltaNet mixers too, and the chunk growth on
  # measured headroom (interleave.HEADROOM): their tests, the chunked prefill rows, the 32k
  # interference row with graphs (stage 19 has the eager row of f56b5de)
  FT_TAG=plan21 FT_PER_FILE=110 bash bench/device_tests.sh tests/test_prefill_graphs.py > /dev/null
  step 120 prefill-graphs python3 -m bench.prefill --lengths 2048 --chunks 32,128,512 --total 1024 \
    --name prefill-graphs-mixers
  step 175 interference python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --name interference-full-prefill-graphs-mixers
  ;;
22) # 560 s, written for the next session: the prefill graphs' tests on the post-review code (8d9f7cc
  # and later: results copied out, pad rows zeroed, layer costs by kind), then the graphs up to
  # 2,048-token chunks (--prefill-graph-tokens 2048; stage 21 at 512: the cost model took eager
  # 2,046-token chunks, p99 2.21x), the chunked rows up to 2,048 and the 32k interference row with them
  FT_TAG=plan22 FT_PER_FILE=110 bash bench/device_tests.sh tests/test_prefill_graphs.py > /dev/null
  step 200 prefill-graphs python3 -m bench.prefill --lengths 2048 --chunks 128,512,1024,2048 --total 4096 \
    --graph-tokens 2048 --name prefill-graphs-2048
  step 200 interference python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --prefill-graph-tokens 2048 --name interference-full-prefill-graphs-2048
  ;;
23) # 470 s: the control kernel's compile per call size, K sized by fill_cap against K = pairs
  # (stage 20: the streamed-prefill test spent its 90 s in the warm-up's compiles), then that test
  step 230 control-compile python3 -m bench.control_compile --experts 256 --layers 40 --slots 2048 --old-max 1024
  FT_TAG=plan23 FT_PER_FILE=220 FT_K="cuda_streamed and single" FT_ARGS="-v --durations=0 -o faulthandler_timeout=200" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
24) # 220 s: the control kernel's 2,048- and 4,096-pair variants at control_warps' 8 and 16 warps
  # (stage 23 at 4 warps: 42 and 51 s of compile), checked against the reference
  step 150 control-compile python3 -m bench.control_compile --pairs 2048,4096 --old-max 0 --name control-compile-warps
  ;;
25) # 560 s, written for the next session: the control kernel's five pair buckets (the whole
  # warm-up's compile, fresh cache), test_expert_control.py whole on the GPU, the 32k interference
  # row with graphs to 2,048 and the cost_model field (which layer is each forward's costliest)
  step 130 control-compile python3 -m bench.control_compile --old-max 0 --name control-compile-buckets
  # the fuzz cases compile a Triton variant per (bucket, K, scan block, top-k, peek, policy): on a
  # fresh machine the file ran 9 tests in 170 s (plan 20); every other test here, the new buckets'
  FT_TAG=plan25 FT_PER_FILE=200 FT_K="not fuzzed" FT_ARGS="--durations=10" \
    bash bench/device_tests.sh tests/test_expert_control.py > /dev/null
  step 200 interference python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --prefill-graph-tokens 2048 --name interference-full-costs
  ;;
26) # 570 s: the CUDA streamed-prefill cases on the bucketed control kernel (stage 23 passed
  # `single-4096` only; the others had run out of time in the warm-up's compiles), the decode steps
  # inside streamed passes, then the production configs against transformers
  FT_TAG=plan26 FT_PER_FILE=420 FT_K="cuda and not single" FT_ARGS="-v --durations=0 -o faulthandler_timeout=300" \
    bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  FT_TAG=plan26 FT_PER_FILE=140 bash bench/device_tests.sh tests/test_gpu_production.py > /dev/null
  ;;
27) # 400 s: the 32k interference row with the experts behind the cache (16 GB of slots), decode
  # inside the streamed passes, on the bucketed control kernel (issue 10/11's row of stage 13)
  step 390 interference-cache python3 -m bench.interference --full-size --moe cache --expert-cache 16GB \
    --long 32768 --settings interleave --warm-long 4096 --cache-warmup 240 --name interference-full-cache-buckets
  ;;
28) # 560 s: issue 12's CPU rows after the VBMI int8 kernel and the t2 default (each run times the
  # VNNI kernel beside it: cpp_int8_vnni_gbs), t0 against it at 6 threads; their tests on the Xeon;
  # the control test fixed after plan 25; the 32k interference row of plan 25 once more
  FT_TAG=plan28 FT_PER_FILE=100 bash bench/device_tests.sh tests/test_cpu_int8_act.py tests/test_cpu_prefetch.py > /dev/null
  FT_TAG=plan28 FT_PER_FILE=60 FT_K=fill_cap bash bench/device_tests.sh tests/test_expert_control.py > /dev/null
  step 120 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  for f in mxfp4 nvfp4; do
    for t in 6 16; do
      step 45 "cpu_experts-$f-t$t" python3 -m bench.cpu_experts --format $f --experts 2048 --threads $t \
        --batches 1,4 --iters 30 --name "cpu_experts-$f-vbmi-t$t"
    done
    FREETOKEN_CPU_PREFETCH_HINT=t0 step 45 "cpu_experts-$f-t6-t0" python3 -m bench.cpu_experts --format $f \
      --experts 2048 --threads 6 --batches 1,4 --iters 30 --name "cpu_experts-$f-vbmi-t6-hintt0"
  done
  step 160 interference python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --prefill-graph-tokens 2048 --name interference-full-costs-rerun
  ;;
29) # 560 s, written for the next session: the control test fixed twice (CUDA routes and shares),
  # then the 32k interference row twice with the start-up objects frozen out of the garbage
  # collector and every collection timed (gc_pauses_loaded; gap_kinds), and once without the freeze
  FT_TAG=plan29 FT_PER_FILE=60 FT_K=fill_cap bash bench/device_tests.sh tests/test_expert_control.py > /dev/null
  for run in 1 2; do
    step 160 "interference-gc-$run" python3 -m bench.interference --full-size --long 32768 --settings interleave \
      --prefill-graph-tokens 2048 --name "interference-full-gc-$run"
  done
  step 160 interference-nofreeze python3 -m bench.interference --full-size --long 32768 --settings interleave \
    --prefill-graph-tokens 2048 --gc-freeze off --name interference-full-gc-off
  ;;
30) # 520 s: the 32k interference row with the prefill attention's page gather into kept buffers
  # (kernels/page_gather.py) and without, the allocator's events counted; the control test fixed
  # a third time (its residency came on CUDA)
  FT_TAG=plan30 FT_PER_FILE=120 FT_K="fill_cap or workspace" bash bench/device_tests.sh tests/test_expert_control.py tests/test_page_gather.py > /dev/null
  I="python3 -m bench.interference --full-size --long 32768 --settings interleave --prefill-graph-tokens 2048"
  step 300 interference-ws-1 $I --gather-workspace on --name interference-full-ws-1
  step 120 interference-nows $I --gather-workspace off --name interference-full-ws-off
  step 120 interference-ws-2 $I --gather-workspace on --name interference-full-ws-2
  step 120 interference-nows-exp env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $I --gather-workspace off \
    --name interference-full-ws-off-expandable
  ;;
31) # 500 s, written for the next session: the 32k interference row twice with cuDNN left out of the
  # prefill attention (61b68ca on): does the first forward's 70-105 ms gap stay gone, and where
  # does p99 settle (issue 9); each stretch of prompt work timed on the device and the host
  # (--layer-events: is layer 3's extra cost device work or host work around it?); the page
  # gather's buffers after the review's fixes (its CUDA tests)
  I="python3 -m bench.interference --full-size --long 32768 --settings interleave --prefill-graph-tokens 2048 --layer-events on"
  FT_TAG=plan31 FT_PER_FILE=60 bash bench/device_tests.sh tests/test_page_gather.py > /dev/null
  step 300 interference-nocudnn-1 $I --name interference-full-nocudnn-1
  step 140 interference-nocudnn-2 $I --name interference-full-nocudnn-2
  ;;
32) # 370 s, written for the next session: issue 12's fixed cost per call on the Xeon (--fixed-cost:
  # one expert and the same top-k from cache, beside the DRAM rows), MXFP4 and NVFP4, 6 and 16 threads
  fixed_cost_rows fixedcost
  ;;
33) # 200 s: layer 3's extra device time (issue 9: plan 31's --layer-events, 1-2.5 ms above the later
  # attention layers): one 2,046-token chunk at a 24k context, events per layer with the gather
  # workspace on and off, and its kernels per layer under the profiler, graphed and all eager
  step 280 layer-profile python3 -m bench.layer_profile --context 24576 --chunk 2046 --detail 2,3,4,7,11
  ;;
34) # 420 s: the 32k row with decode steps between each layer's halves too (MID_LAYER), now that the
  # prefill graphs and the headroom rule let chunks grow (plan 14 met the p99 with halves, at 397
  # tok/s); whole layers between them for the same machine; --layer-events says which stretches
  # follow a decode step (plan 33: layer 3 alone costs what layer 7 does, 4.18 ms at 24k)
  step 560 interference-halves python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave-halves,interleave-layers,interleave-halves --name interference-full-halves
  ;;
35) # 420 s: decode steps between layers that read their tokens a hook later (runtime/deferred_step.py):
  # its CUDA test; the 32k row with deferred steps and with waiting ones, twice each, in one process
  FT_TAG=plan35 FT_PER_FILE=150 FT_K=deferred bash bench/device_tests.sh tests/test_interleave.py > /dev/null
  step 440 interference-deferred python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave,interleave-wait,interleave,interleave-wait --name interference-full-deferred
  ;;
36) # 300 s: where the host waits inside the first attention layer of each forward (plan 35: with
  # deferred steps, layer 3's launch took 10-15 ms of host time, the device's queue behind it)
  step 400 interference-syncs python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --sync-debug on --settings interleave,interleave-wait --name interference-full-syncs
  ;;
37) # 200 s: what the host waits on inside layer 3 with deferred steps (plan 36: no synchronising
  # operator there): the host's calls of 1 ms or more under the profiler (runtime calls included)
  step 200 interference-hostprof python3 -m bench.interference --full-size --long 16384 --prefill-graph-tokens 2048 \
    --host-profile on --settings interleave --name interference-full-hostprof
  ;;
38) # 480 s, written for the next session (issue 9): the deferred/waiting pair with the CUDA launch
  # queues four times larger (plan 37: launches after a deferred step waited up to 6.5 ms each)
  # first the deferred steps' CUDA tests at the review's fixes (d13ca9f: picks over the slots' range)
  FT_TAG=plan38 FT_PER_FILE=150 FT_K=deferred bash bench/device_tests.sh tests/test_interleave.py > /dev/null
  # the pair and the deferred steps with point costs on the device's clock (interleave-devcost)
  I="python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048"
  CUDA_SCALE_LAUNCH_QUEUES=4x step 380 interference-queues4x $I --layer-events on \
    --settings interleave,interleave-wait,interleave-devcost --name interference-full-queues4x
  ;;
40) # 200 s, written for the next session (issue 9): the host's long calls with the larger queues
  CUDA_SCALE_LAUNCH_QUEUES=4x step 200 interference-queues4x-prof python3 -m bench.interference --full-size \
    --long 16384 --prefill-graph-tokens 2048 --settings interleave --host-profile on --name interference-full-queues4x-hostprof
  ;;
39) # 300 s, written for the next session (issue 12): the Xeon's fixed cost per call by part after the
  # vector quantization and the kept layouts (moe_cpu.timing), MXFP4 / NVFP4 at 6 and 16 threads
  fixed_cost_rows fixedcost-parts
  ;;
41) # 330 s (issue 9): the 32k row twice each, deferred steps with host-time and device-time point
  # costs, after the first-token forwards' 50 ms gap floor and with the launch queues at 4x by
  # default (freetoken/__init__.py)
  step 330 interference-firsttoken python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave,interleave-devcost,interleave,interleave-devcost --name interference-full-firsttoken
  ;;
42) # 330 s (issue 9): where the host's longest calls come from with deferred steps (the profiler's
  # Python frames, 16k), then the 32k row with the defaults (device-time point costs) twice and on
  # host time once
  step 150 interference-stacks python3 -m bench.interference --full-size --long 16384 --prefill-graph-tokens 2048 \
    --settings interleave --host-profile stacks --name interference-full-hoststacks
  step 300 interference-defaults python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave,interleave-hostcost,interleave --name interference-full-defaults
  ;;
43) # 510 s, written for the next session (issue 9): the first loaded row of a process, whose chunk
  # sizing collapsed in four of five processes (p99 2.33-2.79x against 1.83-1.99x after it), with
  # each point's device and host time after a decode step (layer_timeline.after_step): is the
  # first row's layer-3 stall device work or device idle while the host is blocked?
  # then a second process that starts with the stall filter (interleave.STALL_FILTER): does the
  # first row keep its chunks and its p99 without the stalled points in its samples?
  step 250 interference-firstrow python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave,interleave --name interference-full-firstrow-events
  step 260 interference-nostall python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-events on --settings interleave-nostall,interleave,interleave-nostall --name interference-full-nostall
  ;;
44) # 530 s (issue 9): three fresh processes of two 32k rows each, after the first-token forwards
  # go by their own clock and teach no layer costs (a 200-token forward had split at layer 24 of
  # 40: two gaps of 30 and 21 ms per stream where one would do); over_2x_gaps lists each gap past
  # 2x once, with what ran in it
  for n in 1 2 3; do
    step $([ $n = 1 ] && echo 230 || echo 150) interference-floor$n python3 -m bench.interference --full-size \
      --long 32768 --prefill-graph-tokens 2048 --settings interleave-byclock,interleave-byclock --name interference-full-floor$n
  done
  ;;
45) # 530 s (issue 9): plan 44 again after each forward's first cycle is timed from a mark at the
  # forward's start (on the host's clock it had carried the host's work between forwards,
  # charged mostly to layer 3: costliest in 28-31 of 37-40 forwards, chunks collapsed)
  for n in 1 2 3; do
    step $([ $n = 1 ] && echo 230 || echo 150) interference-startmark$n python3 -m bench.interference --full-size \
      --long 32768 --prefill-graph-tokens 2048 --settings interleave-both,interleave-both --name interference-full-startmark$n
  done
  ;;
46) # 320 s (issue 9): plans 44-45 against fd9e29e's pacing on one machine: two processes of three
  # 32k rows, alternating (interleave-before: the short forward at the learned costs, each
  # forward's first cycle on the host's clock)
  step 200 interference-ab1 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-before,interleave-both,interleave-before --name interference-full-ab1
  step 120 interference-ab2 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-both,interleave-before,interleave-both --name interference-full-ab2
  ;;
47) # 400 s, written for the next session (issue 9): steps before eagerly launched points waited
  # for (interleave-eagerwait: the loop's wait_before_eager, off by default) and every step waited
  # (interleave-wait) against the deferred default (plan 46's anatomy: 7 of 11 gaps past 2x were
  # the host reaching the hook after a full-attention layer 12-14 ms after the step before it):
  # two processes, alternating
  step 230 interference-eagerwait1 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-eagerwait,interleave,interleave-wait,interleave-eagerwait --name interference-full-eagerwait1
  step 150 interference-eagerwait2 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave-eagerwait,interleave-wait,interleave --name interference-full-eagerwait2
  ;;
48) # 330 s, written for the next session (issue 9): the loop's start_marks and interleave.BY_CLOCK
  # each alone against the defaults (start_marks never ran alone; BY_CLOCK, alone in plan 44 and
  # with start_marks in 45-46, brought gaps past 2x at the forwards' ends in 13 of 15 rows)
  step 200 interference-marks python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-startmarks,interleave,interleave-startmarks --name interference-full-startmarks-ab
  step 130 interference-byclock python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-byclock,interleave,interleave-byclock --name interference-full-byclock-ab
  ;;
49) # 330 s, written for the next session (issue 9): interleave.TAIL_CYCLES (the points after a
  # forward's last decode step learn their costs at its end; without it they keep the costs they
  # were first given, at the first chunk's short context) against the default, two processes
  step 200 interference-tail1 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-tail,interleave,interleave-tail --name interference-full-tail1
  step 130 interference-tail2 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave-tail,interleave --name interference-full-tail2
  ;;
50) # ~100 s (limits 480), written for the next session (issue 12): the batch-1 rows at 16 threads were disturbed
  # in every call (13-16 GB/s against 67-92 at batch 4): 15 threads beside 16 and 6, each row
  # routed afresh (the VNNI-only int8 kernel against the VBMI one without the L3 carry-over)
  step 120 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  for f in mxfp4 nvfp4; do
    for t in 6 15 16; do
      step 60 "threads-$f-t$t" python3 -m bench.cpu_experts --format $f --experts 512 --threads $t \
        --batches 1,4 --iters 20 --name "cpu_experts-$f-fresh-t$t"
    done
  done
  ;;
51) # 520 s (issue 9): the polled overlap (DecodeOverlap.POLLED: decode graphs on the high-priority
  # stream launched from the loop's thread at the prompt's hooks and LayerPacer's waits, spaced by
  # --decode-slowdown; overlap-b2b back to back) against the interleave (plans 47 and 49: 2.0-2.9x
  # in first rows, the host held 12-15 ms in layer 3 behind a decode graph on the same stream)
  FT_TAG=plan51 FT_PER_FILE=150 FT_K=cuda bash bench/device_tests.sh tests/test_overlap.py > /dev/null
  I="python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048"
  step 300 interference-polled1 $I --settings overlap-polled,interleave,overlap-b2b,overlap-polled --name interference-full-polled1
  step 160 interference-polled2 $I --settings interleave,overlap-polled,overlap-b2b --name interference-full-polled2
  ;;
52) # ~400 s (limits 570), written for the next session (issue 9): plan 51 ran out of time with no polled
  # row done. First the shared-workspace race alone (bench/graph_race.py: two GEMM graphs replayed
  # at once on two streams, captured on their own streams, then on one). Then the CUDA tests of the
  # decode graphs (now on their own capture stream, the whole input buffer copied) and the overlap.
  # Then an 8k prompt with every thread's stack every 60 s and a progress line every 5 s (a stall:
  # the layers stop; a crawl: they creep): the polled overlap, the worker's, the interleave
  step 90 graph-race timeout -k 10 85 python3 -m bench.graph_race --name graph_race
  FT_TAG=plan52 FT_PER_FILE=120 FT_K="cuda or graphs_replay" bash bench/device_tests.sh tests/test_gpu_production.py tests/test_overlap.py > /dev/null
  step 240 interference-polled-8k python3 -m bench.interference --full-size --long 8192 --prefill-graph-tokens 2048 \
    --layer-events on --stacks-every 60 --progress-every 5 --settings overlap-polled,overlap,interleave \
    --name interference-full-polled-8k
  ;;
53) # ~230 s (limit 260), written for the next session (issue 9): the 32k interleave rows after the decode
  # runner's input copy stopped going through a pageable temporary (a [:, :b] slice of the pinned
  # buffer with b < rows: every interleaved step of two streams in a 4-slot bench). The host's
  # 12-15 ms in layer 3 after a deferred step was the most common gap past 2x; the first rows
  # missed in all 14 processes so far (2.01-2.86x)
  step 260 interference-hostcopy python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave,interleave --name interference-full-hostcopy
  ;;
54) # ~330 s (limits 380), written for the next session (issue 9): the first loaded row of a process missed
  # the p99 in all 14 processes so far, each row with a loop (and interleaver) of its own: the
  # process's first loaded window, not the row's learning. Two processes whose rows come after
  # a throwaway 8k loaded window (--warm-loaded): if their first rows hold, a warm-up window at
  # start-up is the server's answer
  for p in 1 2; do
    step 190 "interference-warmloaded$p" python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
      --warm-loaded 8192 --settings interleave,interleave --name "interference-full-warmloaded$p"
  done
  ;;
55) # ~330 s (limits 200 + 200), issue 9: which Python line holds the host in the first attention layer
  # after a deferred decode step (11 ms of host against 2.4 in the other attention layers at 8k,
  # plan 52; the profiler named aten::mm and cudaMemcpyAsync but no frame): --layer-lines stamps
  # each line of the prompt's stretches (bench/line_trace.py). An 8k pair, then a 32k first row
  step 200 interference-lines-8k python3 -m bench.interference --full-size --long 8192 --prefill-graph-tokens 2048 \
    --layer-lines on --settings interleave,interleave --name interference-full-lines-8k
  step 200 interference-lines-32k python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-lines on --settings interleave --name interference-full-lines-32k
  ;;
56) # ~420 s (limits 60 + 150 + 330), issue 9: plan 55 found the host held 3.6-7 ms in layer 3's q/k/v
  # F.linear right after a deferred decode step. bench/launch_block.py: is it any launch on the
  # stream behind the decode graph, or cuBLAS's, and does a step on its own stream (ordered by
  # events) leave the host free. Then the deferred steps' CUDA test with the step stream, and the
  # 32k rows alternating the step stream (interleave-side, new) with the default
  step 60 launch-block python3 -m bench.launch_block --name launch_block
  FT_TAG=plan56 FT_PER_FILE=150 FT_K="deferred and cuda" bash bench/device_tests.sh tests/test_interleave.py > /dev/null
  step 330 interference-side python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave-side,interleave,interleave-side,interleave --name interference-full-side
  ;;
57) # ~330 s (limit 330), issue 9: plan 56 ruled out the launch queue (bench.launch_block's probe
  # launches after a decode graph took 0.01-0.1 ms; the step stream left the 12-15 ms gaps). Is
  # the F.linear that holds the host a wait for the GIL? The line tracer now keeps the thread's
  # CPU time beside each slow line (asleep or off the CPU: ~0), and interleave-gil runs the row
  # at a 0.1 ms switch interval
  step 330 interference-gil python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --layer-lines on --settings interleave,interleave-gil,interleave,interleave-gil --name interference-full-gil
  ;;
58) # ~330 s (limits 60 + 90 + 260), issue 9: plan 57 showed the thread on the CPU all through the
  # 4.6 ms F.linear (not the GIL: a 0.1 ms switch interval changed nothing): cuBLAS picking a
  # kernel for a row count it had not met, once per forward. Rows now padded to multiples of 64 and
  # every padded count warmed at load (model/linear.py). launch_block's new-rows cases show the
  # pick's cost; then the linear tests, and a fresh process's 32k rows (the first row missed in
  # every process so far)
  step 60 launch-block python3 -m bench.launch_block --name launch_block-rows
  FT_TAG=plan58 FT_PER_FILE=90 FT_K="linear_pad" bash bench/device_tests.sh tests/test_kernels.py > /dev/null
  step 260 interference-padrows python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows
  ;;
59) # ~480 s (limits 3 x 160), issue 9: the padded GEMM rows (ccd13a6) held the p99 in the first row
  # of one fresh process (1.72x, then 1.73x). Three more fresh processes, two rows each: does
  # every first row hold now
  for p in 1 2 3; do
    step 160 "interference-padrows$p" python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
      --settings interleave,interleave --name "interference-full-padrows$p"
  done
  ;;
60) # ~450 s (limits 150 + 150 + 150), issue 9 at other prompt lengths with the padded rows (8k and
  # 16k: new row counts weigh more where a forward is shorter), then issue 11's decode inside
  # streamed passes (--moe cache, 2.4x before) with them
  step 150 interference-padrows-8k python3 -m bench.interference --full-size --long 8192 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-8k
  step 150 interference-padrows-16k python3 -m bench.interference --full-size --long 16384 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-16k
  step 150 interference-padrows-cache python3 -m bench.interference --full-size --long 32768 --moe cache \
    --settings interleave --name interference-full-padrows-cache
  ;;
61) # ~420 s (limit 420), issue 9's CPU side on the Xeon host: the demo engine on the host's cores
  # alone (no GPU visible), a 32k prompt while two streams decode, with decode steps between the
  # attention layers' key pieces (kernels/split_keys.py) and without, and the CPU default (one
  # mixed forward). On the 2-core dev machine: 2.24x against 2.95-3.07x, bounded there by the
  # decode step's own tail (twenty-first session)
  CUDA_VISIBLE_DEVICES= step 420 interference-cpu-keys python3 -m bench.interference --long 32768 \
    --settings interleave,interleave-nokeys,interleave,budget --name interference-32k-xeon-keys
  ;;
62) # ~240 s (limits 2 x 120): the CPU prefill attention's key pieces (kernels/split_keys.py, the
  # default in fp32 since 9683ad1) against the whole-context path on the Xeon host, where torch's
  # CPU flash kernel may use AMX: 1.1-2.1x faster on the 2-core dev machine
  for t in 6 14; do
    CUDA_VISIBLE_DEVICES= step 120 "cpu-prefill-attention-t$t" python3 -m bench.cpu_prefill_attention --threads "$t" \
      --name "cpu_prefill_attention-xeon-t$t"
  done
  ;;
63) # ~560 s (limits 4 x ~80 + 2 x 160), the first call of the twenty-second session: the GPU tests
  # of the changes that had not met a GPU (the wider GEMM warm-up, the routers through linear(),
  # the per-layer stacking context, the shared per-head gather, the jump-in's point costs), the key
  # pieces' tests on this host's torch, then plan 59's fresh processes of two 32k rows each
  FT_TAG=plan63 FT_PER_FILE=90 FT_K="linear_pad" bash bench/device_tests.sh tests/test_kernels.py > /dev/null
  FT_TAG=plan63 FT_PER_FILE=80 bash bench/device_tests.sh tests/test_gpu_production.py tests/test_split_keys.py > /dev/null
  FT_TAG=plan63 FT_PER_FILE=90 FT_K="cuda" bash bench/device_tests.sh tests/test_interleave.py > /dev/null
  for p in 1 2; do
    step 160 "interference-padrows$p" python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
      --settings interleave,interleave --name "interference-full-padrows-s22-$p"
  done
  ;;
64) # ~590 s (limits 100 + 220 + 140 + 130), issue 10: experts cut into pieces (experts/pieces.py), so a
  # layer's one or two missed Mixtral experts split between the fills and the CPU: the pieced GPU
  # tests, then the Mixtral trace rows (8 layers, 6 threads; 24 of the 64 experts in VRAM: the VRAM
  # llama.cpp's -ncmoe 5 gives its 3 GPU layers, where 0.33 gave us 21) at 1, 2 and 4 pieces
  # with LRU, at 1 and 4 with the LFU policy (fewer misses on these traces in bench/policy_sim.py),
  # and the Qwen3.6 12-layer slice at 1 and 2 pieces
  FT_TAG=plan64 FT_PER_FILE=100 bash bench/device_tests.sh tests/test_expert_pieces.py > /dev/null
  step 220 mixtral-pieces python3 -m bench.expert_cache --shape mixtral --layers 8 --capacity 0.375 --batch 1 \
    --threads 6 --modes cache,split --fill-shares 0.5 --pieces 1,2,4 --cache-warmup 700 \
    --routing trace:.devcache/humaneval_2_routing.jsonl --name expert_cache-mixtral-pieces-t6
  step 140 mixtral-pieces-lfu python3 -m bench.expert_cache --shape mixtral --layers 8 --capacity 0.375 --batch 1 \
    --threads 6 --modes cache --pieces 1,4 --policy lfu --cache-warmup 700 \
    --routing trace:.devcache/humaneval_2_routing.jsonl --name expert_cache-mixtral-pieces-lfu-t6
  step 130 qwen-pieces python3 -m bench.expert_cache --layers 12 --capacity 0.33 --batch 1 --threads 6 \
    --modes cache,split --fill-shares 0.5 --pieces 1,2 --name expert_cache-qwen-pieces-t6
  ;;
65) # ~550 s (limits 260 + 150 + 140), issue 10: plan 64 again, smaller. There every step ran out of
  # time: the banks' re-layout allocated a fresh scratch per copy (its page faults every copy; now one
  # reused scratch) and the Mixtral cache rows needed 700 warm-up steps. Mixtral trace at
  # 1 and 4 pieces (the adaptive split and r=0.4), the Qwen3.6 slice at 1 and 2, then the CUDA tests
  step 260 mixtral-pieces python3 -m bench.expert_cache --shape mixtral --layers 8 --capacity 0.375 --batch 1 \
    --threads 6 --modes cache,split --fill-shares 0.4 --pieces 1,4 --cache-warmup 500 \
    --routing trace:.devcache/humaneval_2_routing.jsonl --name expert_cache-mixtral-pieces-t6
  step 150 qwen-pieces python3 -m bench.expert_cache --layers 12 --capacity 0.33 --batch 1 --threads 6 \
    --modes cache,split --fill-shares 0.4 --pieces 1,2 --name expert_cache-qwen-pieces-t6
  FT_TAG=plan65 FT_PER_FILE=140 FT_K="cuda" bash bench/device_tests.sh tests/test_expert_pieces.py > /dev/null
  ;;
66) # ~570 s (limits 330 + 240), issue 10: plans 64-65's pieced rows printed nothing after the cut (1 s).
  # A review found the likely cause in compiles, not a hang: a new piece count is a new fill-list size
  # (K_PAD) and scan block for the control kernel, whose five prefill variants the cache compiled at
  # allocate (~70 s; the bench no longer does since 477d117), and new autotunes of the decode, grouped
  # and transfer kernels for the smaller intermediate size. The Mixtral trace at 1 and 4 pieces with
  # every thread's stack at 320 s if it still runs, then the pieced CUDA tests
  step 330 mixtral-pieces python3 -X faulthandler -c "import faulthandler, runpy, sys
faulthandler.dump_traceback_later(320, exit=True)
sys.argv = ['expert_cache'] + '--shape mixtral --layers 8 --capacity 0.375 --batch 1 --threads 6 --modes cache,split --fill-shares 0.4 --pieces 1,4 --cache-warmup 500 --routing trace:.devcache/humaneval_2_routing.jsonl --name expert_cache-mixtral-pieces-t6'.split()
runpy.run_module('bench.expert_cache', run_name='__main__')"
  FT_TAG=plan66 FT_PER_FILE=240 FT_K="cuda" bash bench/device_tests.sh tests/test_expert_pieces.py > /dev/null
  ;;
67) # ~560 s (limits 200 + 360), issue 10 after plan 66: the Qwen3.6 12-layer slice at 1 and 2 pieces; then llama.cpp built
  # (its binary comes back in pieces for .llama/, so later calls run it side by side without a build)
  step 200 qwen-pieces python3 -m bench.expert_cache --layers 12 --capacity 0.33 --batch 1 --threads 6 \
    --modes cache,split --fill-shares 0.4 --pieces 1,2 --name expert_cache-qwen-pieces-t6
  bash bench/device_llamacpp.sh build  # after the rows: the build takes every core (~330 s)
  step 360 llama-wait bash bench/device_llamacpp.sh wait
  ;;
68) # ~520 s (limits 470 + 60), issue 10 (b): the full 40-layer Qwen3.6 shape with MXFP4 experts (a bf16
  # GGUF of 40 layers, ~67 GB, does not fit this machine's 64 GB disk) side by side with llama.cpp on
  # the same values (our MXFP4 banks written as ggml MXFP4 by its converter's repack), 15 of 40
  # layers' experts in VRAM (-ncmoe 25; capacity 0.375), 6 threads. llama.cpp builds in the
  # background (~330 s, nice 19) while the weights are made and the GGUF written; its rows run
  # first, ours after, nothing else running; its binary comes back in pieces for .llama/
  bash bench/device_llamacpp.sh build
  step 470 large-llamacpp python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 6 --llamacpp --name large_models-qwen3_5_moe-mxfp4-llamacpp
  step 60 llama-back bash bench/device_llamacpp.sh wait
  ;;
69) # ~510 s (limits 60 + 250 + 190), issue 10 (a): carry .llama/llama-bench.xz.aa .ab .ac (plan 68's
  # binary), .llama/llama.cpp.tar.xz, .whl, .devcache/commit (not .devcache whole: 64 MiB). The
  # 12-layer Qwen3.6 slice in bf16 side by side with llama.cpp at 6 threads (whole experts), then
  # the pieced CUDA tests (dense, and quantized since 5cd6889) with every thread's stack at 110 s
  # (plans 64-65 never finished a pieced step: compiles or a hang, to be told apart)
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 250 qwen-llamacpp bash bench/device_llamacpp.sh run --layers 12 --capacity 0.33 --batch 1 --threads 6 \
    --modes cache,split --fill-shares 0.4 --name expert_cache-llamacpp-s23-t6
  FT_TAG=plan69 FT_PER_FILE=190 FT_K="cuda" FT_ARGS="-o faulthandler_timeout=110" \
    bash bench/device_tests.sh tests/test_expert_pieces.py > /dev/null
  ;;
70) # ~560 s (limits 60 + 480), issue 10 (b), plan 68 again with llama.cpp's binary carried: carry
  # .llama/llama-bench.xz.aa .ab .ac, .llama/llama.cpp.tar.xz (the converter), .whl and
  # .devcache/commit (8 paths, ~63 MB of the 64 MiB: not .devcache whole). In plan 68 llama.cpp's
  # build took 321 s and our rows then ran out of time behind the C++ executor's first build; here
  # that build runs first, then the 40-layer MXFP4 rows side by side at 6 and 16 threads
  # (llama.cpp's four rows first, then ours: cache at 6 and 16, then cpu-only)
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 480 large-llamacpp python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 6,16 --llamacpp --name large_models-qwen3_5_moe-mxfp4-llamacpp
  ;;
71) # ~330 s (limits 60 + 300), issue 10 (b) after plan 70: the 40-layer MXFP4 cache rows at 6 threads
  # with the lookahead (--prefetch 0,4,8; ft's --expert-prefetch). The 85.4 tok/s row ran at 0.47 of
  # its floor: a layer's fills cannot start before its router, so the link idles through the
  # attention and the GPU experts of every layer; the lookahead copies the next layer's predicted
  # misses meanwhile (on the 12-layer bf16 slice it lost, 141.8 against 153.0: there the link was
  # busy already; MXFP4 experts are a quarter of the bytes)
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 300 large-prefetch python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --prefetch 0,4,8 --name large_models-qwen3_5_moe-mxfp4-prefetch
  ;;
72) # ~520 s (limits 60 + 2 x 110 + 240), twenty-fourth session: carry .llama/llama-bench.xz.aa .ab .ac,
  # .llama/llama.cpp.tar.xz, .whl, .devcache/commit. (1) OpenMP's spin on this host: torch's OpenMP
  # threads spun ~300,000 iterations after each parallel op on the cores the C++ pools use; since
  # freetoken/omp_env.py a process starts with GOMP_SPINCOUNT=10000 unless it is set. CPU-only and
  # split rows of the 12-layer bf16 slice at 6 threads with the old value set, then with the new
  # default. (2) Pure-CPU decode on the Xeon (GPU hidden): the 12-layer MXFP4 slice with the CPU's
  # dense rows and DeltaNet kernels, llama.cpp on the same GGUF values with -ngl 0, 6 and 14 threads
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 110 omp-spin-300000 env GOMP_SPINCOUNT=300000 python3 -m bench.expert_cache --layers 12 --capacity 0.33 \
    --batch 1 --threads 6 --modes cpu-only,split --fill-shares 0.5 --name expert_cache-omp300000-t6
  step 110 omp-spin-default python3 -m bench.expert_cache --layers 12 --capacity 0.33 \
    --batch 1 --threads 6 --modes cpu-only,split --fill-shares 0.5 --name expert_cache-ompdefault-t6
  CUDA_VISIBLE_DEVICES= step 240 cpu-llamacpp python3 -m bench.large_models --arch qwen3_5_moe --layers 12 \
    --expert-format mxfp4 --modes cpu-only --threads 6,14 --llamacpp --llamacpp-build $B \
    --name large_models-qwen3_5_moe-12-mxfp4-cpu-xeon
  ;;
89) # ~555 s (limits 45 + 240 + 150 + 90 + 30), twenty-eighth session: plan 82's timeline put the control kernel
  # at 29.9 us a call in the real step, against 17.8 in plan 79's replayed graph of 40 calls alone. The
  # 6-thread cache row with its timeline at the default decode variant (8 warps, 4,096-slot chunks) and
  # at plan 79's old one (4, 1,024; --control-variant, new), then the kernel alone (bench.control_speed,
  # now with the fused acc output). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz: it lacks the
  # decode variants with the fused outputs, so each row's first process compiles them (plan 83's tests spent
  # minutes so: hence 240 s for the first row); merge the returned delta here (bench/merge_warm_cache.sh).
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 240 ctl-default-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-ctl-default-t6
  step 150 ctl-w4b1024-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --control-variant 4,1024 \
    --name large_models-qwen3_5_moe-40-mxfp4-ctl-w4b1024-t6
  # the kernel alone, now over 64 route sets (misses as served; plan 79's 4 sets were all hits after a cycle),
  # and the default variant over 4 sets again: whether hits alone explain its 17.8 us
  step 90 control-speed python3 -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8 \
    --warps 4,8 --blocks 1024,4096 --name control_speed-3840-acc
  step 30 control-speed-4sets python3 -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8 \
    --warps 8 --blocks 4096 --route-sets 4 --name control_speed-3840-acc-4sets
  ;;
92) # ~330 s (limits 45 + 140 + 140), twenty-eighth session: plan 83's hog on 4 of the CPU branch's 14 pinned
  # cores took the r = 0.4 step from 9.9 to 25.8 ms: each layer's call waits for its slowest worker, and the
  # static schedule gives the hogged ones a whole share. FREETOKEN_CPU_SCHEDULE=dynamic (chunks from a shared
  # counter, moe_cpu.cpp's Share) against the default, each its own process, drift rows without fill-only.
  # Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 140 drift-static python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 14 --drift-hog 4 --drift-steps 200 \
    --name large_models-qwen3_5_moe-40-mxfp4-drift-static-t14
  FREETOKEN_CPU_SCHEDULE=dynamic step 140 drift-dynamic python3 -m bench.large_models --arch qwen3_5_moe \
    --layers 40 --expert-format mxfp4 --modes cache --capacity 0.375 --threads 14 --drift-hog 4 --drift-steps 200 \
    --name large_models-qwen3_5_moe-40-mxfp4-drift-dynamic-t14
  ;;
91) # ~500 s (limits 300 + 200), twenty-eighth session: the GPU tests plans 83-88 had no time for: the control
  # kernel's fuzz cases past seed 12 (fused cpu_route/acc outputs, 8-warp decode variants) and the cache's
  # hostfn cases. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz (merged after plan 89).
  step 300 fuzz python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_expert_control.py -k "not large_buckets"
  step 200 cache-hostfn python3 -m pytest -v -p no:cacheprovider tests/test_expert_cache_gpu.py -k hostfn
  ;;
90) # ~250-480 s (limits 160 each: plan 85's took 52 s on a warm machine; the first here exports the GGUF),
  # twenty-eighth session, issue 10 (b): plan 85's command three times in one call (the 14-thread ratio
  # moved from 1.18x to 1.72x between plans 84 and 85 on one machine; both engines moved).
  # Carry as plan 78 (llama.cpp's binary and source, .whl, .devcache/commit).
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  for i in 1 2 3; do
    step 160 cache-llama-t14-16-$i python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
      --modes cache,fill-only --capacity 0.375 --threads 14,16 --llamacpp --llamacpp-build $B \
      --name large_models-qwen3_5_moe-40-mxfp4-cache-llama-t14-16-run$i
  done
  ;;
88) # ~120 s (limit 115): the graph-equals-eager doorbell tests (the control kernel's fused outputs in a graph)
  step 115 graph-doorbell python3 -m pytest -v -p no:cacheprovider tests/test_expert_cache_gpu.py -k "graph_equals_eager and doorbell"
  ;;
87) # ~150 s (limit 150): plan 86 passed the test alone in 45 s; after the lookahead test, with stacks after 50 s
  step 150 split-after-lookahead python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=50 \
    tests/test_expert_cache_gpu.py -k "test_lookahead_copies_are_ordered or test_split_within_bf16_rounding"
  ;;
86) # ~110 s (limit 110): where test_split_within_bf16_rounding stays (past 200 s in plans 82 and 85; it
  # passed in 5 s before): every thread's stack after 60 s (pytest's faulthandler_timeout)
  step 110 split-stacks python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=60 \
    tests/test_expert_cache_gpu.py -k test_split_within_bf16_rounding
  ;;
85) # ~450 s (limits 230 + 220), on plan 84's warm machine: the cache's GPU tests plan 83 had no time for
  # (its kernels compiled there), then plan 84's rows at 14 and 16 threads beside llama.cpp. Carry as plan 84.
  B=/tmp/ft-llama-build
  step 230 cache-gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_expert_cache_gpu.py \
    -k "not hostfn"
  step 220 cache-llama-t14-16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,fill-only --capacity 0.375 --threads 14,16 --llamacpp --llamacpp-build $B \
    --name large_models-qwen3_5_moe-40-mxfp4-cache-llama-t14-16
  ;;
84) # ~400 s (limit 420), on plan 83's warm machine: the adaptive cache at 14 threads (100.7 tok/s there)
  # and fill-only beside llama.cpp in one process, for a ratio measured in one run. Carry as plan 78.
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 420 cache-llama-t14 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,fill-only --capacity 0.375 --threads 14 --llamacpp --llamacpp-build $B \
    --name large_models-qwen3_5_moe-40-mxfp4-cache-llama-t14
  ;;
83) # ~560 s (limits 45 + 300 + 190), plan 82's tests and drift row with room: its tests ran out of their 200 s
  # in compiles after 3 passed (the new control variants are not in the warm cache) and its drift row's 800
  # steps under the hog did not end in 150 s. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 300 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=15 tests/test_expert_control.py \
    tests/test_expert_cache_gpu.py -k "not large_buckets and not hostfn"
  step 190 drift python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,fill-only --capacity 0.375 --threads 14 --drift-hog 4 --drift-steps 300 \
    --name large_models-qwen3_5_moe-40-mxfp4-drift-t14
  ;;
82) # ~490 s (limits 50 + 200 + 150 + 70), twenty-seventh session, issue 10 (b): carry .whl, .devcache/commit and
  # .devcache/warm-cache.tgz (without it the first compiles ate plan 80's limits). The cache's GPU tests
  # (decode control calls now compile at 8 warps with 4,096-slot scan chunks; never run on a GPU yet), then
  # the 40-layer cache at 14 threads with a host-memory hog started on 4 of the CPU branch's cores after
  # the split decided (--drift-hog: share.py's hold watch, new), beside fill-only under no hog.
  step 50 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 200 gpu-tests python3 -m pytest -x -q -p no:cacheprovider tests/test_expert_cache_gpu.py tests/test_host_wait.py \
    tests/test_expert_control.py -k "not large_buckets"
  step 150 drift python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,fill-only --capacity 0.375 --threads 14 --drift-hog 4 --drift-steps 800 \
    --name large_models-qwen3_5_moe-40-mxfp4-drift-t14
  # the 6-thread cache step with the control kernel's fused outputs (189a5e2) against plan 81's 79.0-80.6
  # tok/s, its timeline saying what the control kernel and the small kernels now take
  step 70 cache-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-fused-t6
  ;;
81) # (historical: FREETOKEN_BELL_WAIT existed from 20e96cc until the session's review removed it)
  # ~200 s (limits 50 + 75 + 75), twenty-seventh session: plan 80's main-stream rows failed their graph
  # capture (join waited on a side stream that never joined the capture; fixed) and its compiles ran
  # without the warm cache. The 40-layer cache at 6 threads, main-stream wait then side-stream wait.
  # Carry .whl, .devcache/commit, .devcache/warm-cache.tgz
  step 50 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FREETOKEN_BELL_WAIT=main step 75 wait-main python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes cache --capacity 0.375 --threads 6 --name large_models-qwen3_5_moe-40-mxfp4-waitmain-t6
  FREETOKEN_BELL_WAIT=side step 75 wait-side python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes cache --capacity 0.375 --threads 6 --name large_models-qwen3_5_moe-40-mxfp4-waitside-t6
  ;;
80) # ~480 s (limits 50 + 120 + 90 + 240), twenty-seventh session, issue 10: plan 79's cache step took 1.5 ms
  # of host time in its graph's launch (77 us without the CPU branch) with a fork and a join to the
  # side stream in each layer; the wait kernel now runs where the caller joins (FREETOKEN_BELL_WAIT=main,
  # one stream) and decode control calls take 8 warps and 4,096-slot scan chunks. The GPU tests of the
  # split, the old side-stream wait in its own process, then the new default beside llama.cpp.
  # Carry as plan 78: .llama/llama-bench.xz.aa .ab .ac, .llama/llama.cpp.tar.xz, .whl, .devcache/commit
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 50 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 120 gpu-tests python3 -m pytest -x -q -p no:cacheprovider tests/test_expert_cache_gpu.py tests/test_host_wait.py
  FREETOKEN_BELL_WAIT=side step 90 wait-side python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes cache --capacity 0.375 --threads 6,16 --timeline \
    --name large_models-qwen3_5_moe-40-mxfp4-waitside
  step 240 wait-main python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 6,16 --llamacpp --llamacpp-build $B --timeline \
    --name large_models-qwen3_5_moe-40-mxfp4-waitmain-llamacpp
  ;;
79) # ~330 s (limits 150 + 60 + 200), twenty-seventh session, issue 10: plan 78's timelines gave the
  # control kernel 27 us a call (1.1 ms of a 12-17 ms step) and ~1.7 ms a step of idle device between
  # steps. The kernel's time per call by warps and scan block (bench/control_speed.py), then fill-only
  # and the cache at 6 threads with the host's split of a step (launch, wait, read) and the timeline.
  # Carry .whl and .devcache/commit
  step 150 control-speed python3 -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8,32 \
    --name control_speed-3840
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 200 large-host python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes fill-only,cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-host-t6
  ;;
78) # ~480 s (limits 60 + 420), twenty-sixth session, issue 10 (b) at 14-16 threads: the cache held 85-92
  # tok/s at every thread count (llama.cpp 55-68 at 14-16) with the climb's probes flat over r = 0.5-0.7.
  # Fixed fill shares below the climb's range (more misses on the CPU, fewer fills on the critical
  # path), fill-only, and the adaptive cache at 14 and 16 threads, llama.cpp in the same process;
  # each row's replayed steps by kernel and idle gap (--timeline: where the 85-92 tok/s ceiling goes).
  # Carry as plan 70: .llama/llama-bench.xz.aa .ab .ac, .llama/llama.cpp.tar.xz, .whl, .devcache/commit
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 420 large-split python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,split,fill-only --fill-shares 0.2,0.3,0.4 --capacity 0.375 --threads 14,16 --llamacpp \
    --llamacpp-build $B --timeline --name large_models-qwen3_5_moe-40-mxfp4-split-t14-16
  ;;
77) # ~420 s (limits 60 + 240 + 120), twenty-sixth session: carry .llama/llama-bench.xz.aa .ab .ac,
  # .llama/llama.cpp.tar.xz, .whl, .devcache/commit. Plan 72's pure-CPU rows again (GPU hidden): in
  # plan 72 our torch ops and dense kernels ran on all 16 cores at "6 threads"; bench.large_models now
  # gives the row's thread count to torch too. Then the step by part at 6 and 14 threads
  # (bench/cpu_step_parts.py: the dense rows kernel, the experts, DeltaNet, attention, the rest)
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  CUDA_VISIBLE_DEVICES= step 240 cpu-llamacpp python3 -m bench.large_models --arch qwen3_5_moe --layers 12 \
    --expert-format mxfp4 --modes cpu-only --threads 6,14 --llamacpp --llamacpp-build $B \
    --name large_models-qwen3_5_moe-12-mxfp4-cpu-xeon-samethreads
  CUDA_VISIBLE_DEVICES= step 120 cpu-parts python3 -m bench.cpu_step_parts --layers 12 --expert-format mxfp4 \
    --threads 6,14 --name cpu_step_parts-qwen3_5_moe-12-mxfp4-xeon
  ;;
76) # ~450 s (limits 60 + 400 + 100), twenty-sixth session, issue 10 (b): plan 70 again after
  # runtime/host_wait.py (the launching thread asleep in a blocking event where the step has a CPU
  # branch), so the 16-thread rows and llama.cpp's come from one run; then the 16-thread cpu-only
  # row with the old spin (FREETOKEN_HOST_WAIT=spin), the A/B in the same machine. Carry as plan 70:
  # .llama/llama-bench.xz.aa .ab .ac, .llama/llama.cpp.tar.xz, .whl, .devcache/commit
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  (lscpu | head -24; nproc; python3 -c "from freetoken.experts.cpu import physical_cores as p; print('physical', p())") >> "$LOG" 2>&1
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 400 large-llamacpp-block python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 6,16 --llamacpp --name large_models-qwen3_5_moe-40-mxfp4-llamacpp-waitblock
  FREETOKEN_HOST_WAIT=spin step 100 wait-spin-t16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes cpu-only --capacity 0.375 --threads 16 \
    --name large_models-qwen3_5_moe-mxfp4-waitspin-t16
  ;;
73) # ~400 s (limits 60 + 230 + 100), twenty-fifth session, issue 10 (b): plan 70's 16-thread rows fell to 9.2
  # (cache) and 7.8 tok/s (cpu-only) against 91.2 and 39.2 at 6 threads. The host thread that
  # launches a step spin-waits for it (CUDA's default on a many-core host), on a core the 15 pinned
  # workers of a 16-thread executor need. The rows with that thread asleep in a blocking event
  # (FREETOKEN_HOST_WAIT auto: block where the step has a CPU branch) at 16 and 14 threads (14: the
  # engine's default on this host), then the 16-thread cpu-only row with the old spin again (the
  # ratio in one run)
  (lscpu | head -24; nproc; python3 -c "from freetoken.experts.cpu import physical_cores as p; print('physical', p())") >> "$LOG" 2>&1
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 230 wait-block python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 16,14 --name large_models-qwen3_5_moe-mxfp4-waitblock
  FREETOKEN_HOST_WAIT=spin step 100 wait-spin-t16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes cpu-only --capacity 0.375 --threads 16 \
    --name large_models-qwen3_5_moe-mxfp4-waitspin-t16
  ;;
74) # ~260 s (limits 50 + 200), plan 73's first half for a session with little device time left: the 40-layer
  # MXFP4 cache and cpu-only rows at 16 threads with the launching thread asleep (runtime/host_wait.py)
  step 50 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 200 wait-block-t16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 16 --name large_models-qwen3_5_moe-mxfp4-waitblock-t16
  ;;
75) # ~120 s (limit 150), the least of plan 74 (carry .devcache/warm-cache.tgz too: the C++ build in it): the
  # 40-layer MXFP4 cpu-only row at 16 threads with the launching thread asleep (runtime/host_wait.py)
  step 150 wait-block-cpuonly-t16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cpu-only --capacity 0.375 --threads 16 --name large_models-qwen3_5_moe-mxfp4-waitblock-cpuonly-t16
  ;;
93) # ~300 s (limits 45 + 110 + 25 + 25 + 120), twenty-ninth session: the cache step's trims, tested and
  # timed. The MoE block's shared expert now runs before the CPU branch's wait (the cached executor's
  # Pending.join), the wait kernel lands the CPU part in the activations' dtype (no cast kernel), and the
  # decode kernels read the control kernel's int32 slot routes (no copy kernel): ~80 device activities a
  # step fewer. Their GPU tests; the control kernel alone with an L2-thrashing kernel between calls
  # (bench.control_speed --thrash-mb, new: 18 us alone against 29.9 in the step); plan 89's 6-thread
  # timeline row again. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  # (the budget left after failed starts: ~240 s; the timed row first, then the tests, the thrash rows last)
  step 110 trims-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-trims-t6
  step 120 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=8 tests/test_expert_cache_gpu.py \
    tests/test_hostcall.py tests/test_quant_kernels.py -k "not hostfn and (cache or bell or int32 or takes_the or graph)"
  for mb in 0 64; do
    step 25 control-thrash-$mb python3 -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8 \
      --warps 4,8 --blocks 1024,4096 --thrash-mb $mb --name control_speed-3840-thrash$mb
  done
  ;;
94) # ~200 s (limit 180), twenty-ninth session, after 93 on the same machine (its compiles kept): plan 90's
  # side-by-side at 14 and 16 threads once, with the resident row now (the issue's floor is the measured
  # resident step plus the missed bytes over B_P + B_H; without the row it was the resident floor's
  # estimate, so of_floor read 0.39-0.61). Carry as plan 90.
  B=/tmp/ft-llama-build
  [ -x $B/bin/llama-bench ] || { mkdir -p $B/bin && cat .llama/llama-bench.xz.* | xz -d > $B/bin/llama-bench \
    && chmod +x $B/bin/llama-bench; }
  step 180 resident-cache-llama-t14-16 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
    --expert-format mxfp4 --modes resident,cache,fill-only --capacity 0.375 --threads 14,16 --llamacpp \
    --llamacpp-build $B --name large_models-qwen3_5_moe-40-mxfp4-resident-cache-llama-t14-16
  ;;
95) # ~560 s (limits 320 + 220), thirtieth session, issue 9 on a fresh machine with no warm cache: plan 59's
  # fresh processes of two 32k rows each (the padded GEMM rows, ccd13a6, held the p99 in the first row of the
  # one process measured so far, 1.72x then 1.73x; every first row had missed before). The first process
  # carries the machine's set-up (the demo model, Triton's compiles, fla's autotuning). Carry .whl and .devcache/commit.
  step 320 interference-padrows1 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-s30-1
  step 220 interference-padrows2 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-s30-2
  ;;
96) # ~540 s (limits 420 + 110), thirtieth session, issue 9's CPU side on the Xeon host (plan 61, never run): the
  # demo engine on the host's cores alone (no GPU visible), a 32k prompt while two streams decode, with decode
  # steps between the attention layers' key pieces (kernels/split_keys.py) and without, and the CPU default
  # (one mixed forward). On the 2-core dev machine 2.24x against 2.95-3.07x, bounded there by the decode
  # step's own tail. Then plan 62's 14-thread row (the key pieces against the whole-context attention).
  CUDA_VISIBLE_DEVICES= step 420 interference-cpu-keys python3 -m bench.interference --long 32768 \
    --settings interleave,interleave-nokeys,interleave,budget --name interference-32k-xeon-keys
  CUDA_VISIBLE_DEVICES= step 110 cpu-prefill-attention-t14 python3 -m bench.cpu_prefill_attention --threads 14 \
    --name cpu_prefill_attention-xeon-t14
  ;;
97) # ~420 s (limits 200 + 45 + 150), thirtieth session, after 95-96 (a fresh machine if it was given back): a third
  # fresh process of plan 59's rows, then plan 93's GPU tests of the cache step's trims
  step 200 interference-padrows3 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-s30-3
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 150 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=8 tests/test_expert_cache_gpu.py \
    tests/test_hostcall.py tests/test_quant_kernels.py -k "not hostfn and (cache or bell or int32 or takes_the or graph)"
  ;;
98) # ~260 s at most (limits 3 x 40 + 140), thirtieth session: plan 96 put the demo's CPU engine on the Xeon (16
  # vCPUs, GPU hidden, torch's and the expert pool's threads at every core) at a p99 of 3.8-4.3x and the 32k
  # prompt at 248-299 tok/s, slower than the 2-core dev machine (454-481): the demo end to end at 4, 8 and
  # 16 threads, a 16k interleave row at 8 (plan 97's GPU tests of the trims: a later call).
  # Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  for t in 4 8 16; do
    CUDA_VISIBLE_DEVICES= step 40 "demo-cpu-t$t" python3 -m bench.demo_cpu --prompt 8192 --tokens 48 --cpu-threads $t \
      --name "demo-xeon-8k-t$t"
  done
  CUDA_VISIBLE_DEVICES= step 140 interference-cpu-t8 python3 -m bench.interference --long 16384 --cpu-threads 8 \
    --settings interleave --name interference-16k-xeon-t8
  ;;
99) # ~90 s (limits 3 x 35), thirtieth session, plan 98's first part for the device time left after failed
  # starts: the demo's CPU engine end to end on the Xeon (GPU hidden) at 4, 8 and 16 threads
  for t in 4 8 16; do
    CUDA_VISIBLE_DEVICES= step 35 "demo-cpu-t$t" python3 -m bench.demo_cpu --prompt 8192 --tokens 48 --cpu-threads $t \
      --name "demo-xeon-8k-t$t"
  done
  ;;
100) # ~570 s at most, thirty-first session, issue 9's CPU side at the real shape: plans 96-99 measured the demo,
  # whose decode step is mostly its 127 MB lm_head and fixed costs (7.4 ms for two streams at 8 threads)
  # while a prompt layer's fixed part is ~6 ms: a gap of a step and one layer is past 2x by construction.
  # The CPU-only engine on the Xeon (GPU hidden) at the full 40 layers of the Qwen3.6 shape (bf16, 64 GB
  # of host banks): an 8k prompt while two streams decode, decode steps between layers and between the
  # pieces of a prompt chunk's experts (experts/split_experts.py: a MoE block reads 1.6 GB whatever the
  # chunk), then without the expert pieces. Carry .whl and .devcache/commit.
  CUDA_VISIBLE_DEVICES= step 570 interference-cpu-40 python3 -m bench.interference --full-size --moe cpu \
    --layers 40 --long 8192 --settings interleave,interleave-noexperts --name interference-8k-xeon-40l
  ;;
101) # ~400 s at most, plan 100 cut to the device time left after failed starts: a 4k prompt. Carry .whl,
  # .devcache/commit and .devcache/warm-cache.tgz (the C++ build: the fresh machine's first build took ~60 s)
  CUDA_VISIBLE_DEVICES= step 400 interference-cpu-40 python3 -m bench.interference --full-size --moe cpu \
    --layers 40 --long 4096 --settings interleave,interleave-noexperts --name interference-4k-xeon-40l
  ;;
102) # ~560 s at most, thirty-first session, for the next: the 40-layer CPU-only rows (now float32 compute over
  # bf16 weights, as Engine on the CPU) with a 2k prompt: the expert pieces' A/B. The 1k row of this
  # session took ~180 s with its set-up (the prompt at 14 tok/s beside the two streams). Carry .whl,
  # .devcache/commit and .devcache/warm-cache.tgz.
  CUDA_VISIBLE_DEVICES= step 560 interference-cpu-40-ab python3 -m bench.interference --full-size --moe cpu \
    --layers 40 --long 2048 --settings interleave,interleave-noexperts --progress-every 30 \
    --name interference-2k-xeon-40l-ab
  ;;
103) # ~560 s at most: the same shape's default CPU scheduling (one mixed forward) beside the interleave
  CUDA_VISIBLE_DEVICES= step 560 interference-cpu-40-mixed python3 -m bench.interference --full-size --moe cpu \
    --layers 40 --long 2048 --settings budget,interleave --progress-every 30 --name interference-2k-xeon-40l-mixed
  ;;
104) # ~540 s at most (limits 200 + 330), thirty-second session: plan 102 on an H100 host's Xeon (GPU hidden) gave
  # the 40-layer CPU-only interleave rows (2k prompt): p99 1.84x with the expert pieces, 2.06x without. The
  # same shape's default CPU scheduling (the decode rows and a prompt chunk in one forward), then the GPU
  # tests of what changed since the last GPU run (expert pieces through split_experts.launch on CUDA
  # engines, the cache step's trims). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  CUDA_VISIBLE_DEVICES= step 200 interference-cpu-40-mixed python3 -m bench.interference --full-size --moe cpu \
    --layers 40 --long 2048 --settings budget --progress-every 30 --name interference-2k-xeon-40l-mixed
  step 330 gpu-tests python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_interleave.py \
    tests/test_expert_pieces.py tests/test_glm_moe_dsa.py tests/test_expert_cache_gpu.py tests/test_split_experts.py \
    -k "cuda or gpu or cache or bell or graph or pieces"
  ;;
105) # ~470 s at most (limits 45 + 280 + 110 + 2 x 25), thirty-second session: the expert cache's slot routes go to
  # the decode kernels as int64 again (int32 ones were autotuned apart from the resident path's int64 ids:
  # test_cache_modes_agree failed on the H100, plans 93 and 104). The cache's GPU tests, all but hostfn, with
  # time for the compiles (plan 104's step ran out at 330 s, the first call on a fresh machine), then the
  # trims' timed row at that dtype and plan 93's cold-L2 control rows. Carry .whl, .devcache/commit and
  # .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 280 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=10 tests/test_expert_cache_gpu.py \
    tests/test_hostcall.py tests/test_quant_kernels.py -k "not hostfn and (cache or bell or int32 or takes_the or graph or lookahead or split)"
  step 110 trims-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-int64routes-t6
  for mb in 0 64; do
    step 25 control-thrash-$mb python3 -m bench.control_speed --layers 40 --experts 256 --slots 3840 --pairs 8 \
      --warps 4,8 --blocks 1024,4096 --thrash-mb $mb --name control_speed-3840-thrash$mb
  done
  ;;
106) # ~545 s at most (limits 45 + 120 + 180 + 200), thirty-third session: plan 105 passed the cache's GPU tests
  # with int64 slot routes; test_executor_takes_int32_routes still failed (the executor handed int32 routes
  # to the decode kernels: now widened for every path). That test and the graph tests after it (the step ran
  # out), the trims' timed row with more time (setup ~20 s, then the cache row), plan 97's third 32k
  # process. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 120 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=6 tests/test_quant_kernels.py \
    -k "int32 or cuda_graph or takes_the"
  step 180 trims-t6 python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes cache --capacity 0.375 --threads 6 --timeline --name large_models-qwen3_5_moe-40-mxfp4-int64routes-t6
  step 200 interference-padrows3 python3 -m bench.interference --full-size --long 32768 --prefill-graph-tokens 2048 \
    --settings interleave,interleave --name interference-full-padrows-s33-3
  ;;
107) # ~475 s at most (limits 45 + 150 + 280), thirty-third session: plan 106 failed the executor's torch path on
  # CUDA (two equal calls differed: index_add_'s atomics; now a fixed-order sum over each token's pairs). Its
  # test again, then issue 10 (b)'s resident row on an H100 beside the cache and fill-only rows at 6 and 14
  # threads in one process, so the analytic floor uses the resident step measured on the same machine
  # (plan 94's without llama.cpp). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 150 gpu-tests python3 -m pytest -v -p no:cacheprovider --durations=6 tests/test_quant_kernels.py \
    tests/test_expert_cache_gpu.py -k "int32 or takes_the or cache_modes_agree"
  step 280 resident-cache python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 \
    --modes resident,cache,fill-only --capacity 0.375 --threads 6,14 --name large_models-qwen3_5_moe-40-mxfp4-resident-t6-14
  ;;
108) # ~500 s at most (45 + 4 files x 110), thirty-third session: the GPU sides of the engine's end-to-end test
  # files after the last sessions' scheduling changes (CPU engines interleave by default; a prompt alone keeps
  # only layer points; one varlen forward per CPU step): the production configs, the overlap, the streamed
  # prefill and the interleave, each file under its own limit. Carry .whl, .devcache/commit and
  # .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan108 FT_PER_FILE=110 FT_K="cuda or gpu or graph" bash bench/device_tests.sh tests/test_gpu_production.py \
    tests/test_interleave.py tests/test_overlap.py tests/test_prefill_stream.py > /dev/null
  ;;
109) # ~545 s at most (45 + 200 + 300), thirty-third session, for the next: issue 11's exactness at 16,384 tokens on
  # the GPU (test_cuda_streamed_prefill_equals_resident at 16,384 tokens passed in single calls at a491362; the new
  # test_cuda_checkpoints_in_streamed_passes_restore has not run on a GPU yet; plan 108 ran
  # out after 4 of its 6 CUDA cases at 110 s), then the 12-layer streamed-prefill rows at HEAD with the single
  # buffer beside the double from 1k to 32k (the loss without the second buffer against length), a 64-token
  # prompt (experts_skipped > 0: a short prompt loads only its routed experts, never yet shown on a GPU; the required
  # results/prefill_stream-gpu.json was a two-row run). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan109 FT_PER_FILE=200 FT_K="cuda" bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  step 300 prefill-stream-12 python3 -m bench.prefill_stream --layers 12 --lengths 64,1024,4096,16384,32768 \
    --buffering double,single --name prefill_stream
  ;;
110) # ~525 s at most (45 + 3 x 160), for the next (issue 12): the quantized models against transformers on CUDA
  # (test_cuda_logits_and_greedy_match_transformers_on_dequantized_weights, new: resident and cache, fp32 1e-4,
  # 32 greedy steps; not yet run on a GPU), the quantized cache and GPT-OSS test files on CUDA, each file under
  # its own limit. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan110 FT_PER_FILE=160 FT_K="cuda or gpu" bash bench/device_tests.sh tests/test_quantized_models.py \
    tests/test_expert_cache_quant.py tests/test_gpt_oss.py > /dev/null
  ;;
111) # ~560 s at most (90 + 130 + 90 + 180 + 70), thirty-fourth session: what plans 109 and 110 ran out before
  # (109: 5 of test_prefill_stream's 7 CUDA cases in 200 s; 110: 2 of test_quantized_models' 12 in 160 s, 8 of
  # test_expert_cache_quant's 14), and GPT-OSS's cache test with fill-only's CPU experts counted outside the
  # streamed passes (plan 110 failed it: the 8-token prompt's pass runs the first request's decode steps frozen,
  # misses on the CPU, by design). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 90 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan111a FT_PER_FILE=130 FT_K="cuda_checkpoints or passes and 24" bash bench/device_tests.sh \
    tests/test_prefill_stream.py > /dev/null
  FT_TAG=plan111b FT_PER_FILE=90 FT_K="gpu" bash bench/device_tests.sh tests/test_gpt_oss.py > /dev/null
  FT_TAG=plan111c FT_PER_FILE=180 FT_K="cuda and cache and (mxfp4-experts or nvfp4-experts)" \
    bash bench/device_tests.sh tests/test_quantized_models.py > /dev/null
  FT_TAG=plan111d FT_PER_FILE=70 FT_K="gpu_engine and (mxfp4-0.5 or nvfp4-1)" bash bench/device_tests.sh \
    tests/test_expert_cache_quant.py > /dev/null
  ;;
112) # ~580 s at most (60 + 300 + 220), for the next (issue 12): the CUDA quantized tests no call has reached yet.
  # Plans 110-111 and the thirty-fourth session's single calls ran: test_quantized_models' fp8-experts resident and
  # cache, mxfp4-experts and nvfp4-experts cache (4 of 12, ~45-80 s each with compiles); test_expert_cache_quant's 8
  # cache_equals_resident cases and gpu_engine fp8_block-1, mxfp4-0.5, nvfp4-1. The rest here, each file under its
  # own limit. Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 60 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan112a FT_PER_FILE=300 FT_K="cuda and (all or experts and resident and not fp8)" \
    bash bench/device_tests.sh tests/test_quantized_models.py > /dev/null
  FT_TAG=plan112b FT_PER_FILE=220 FT_K="gpu_engine and (fp8_block-0.5 or mxfp4-1 or nvfp4-0.5)" \
    bash bench/device_tests.sh tests/test_expert_cache_quant.py > /dev/null
  ;;
113) # ~350 s at most, for the next (issue 11): why a 32k streamed pass beat all-resident chunked prefill by 1.49x
  # (plan 109: 0.620 s against 0.925 s, 12 layers). The same passes with every expert resident (resident-pass:
  # their compute alone, nothing streamed; also the non-expert bound of a 16k/32k pass) beside the resident
  # rows chunked at 2,048 (the engine's default), 8,192 and 32,768: if larger chunks close the gap, the chunked
  # path is bound by per-chunk host work, not the GPU; the pass's experts in sub-chunks of 8,192 too (more rows
  # per expert GEMM). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 250 prefill-compute python3 -m bench.prefill_stream --layers 12 --lengths 2048,8192,16384,32768 \
    --buffering double --resident-chunks 2048,8192,32768 --compute-pass --compute-subs 2048,8192 \
    --name prefill_stream-compute
  # the sampling penalties (82f3ebd) on the GPU engine: graphs per batch size and the deferred step's device pick
  FT_TAG=plan113p FT_PER_FILE=100 FT_K="cuda" bash bench/device_tests.sh tests/test_penalties.py > /dev/null
  ;;
114) # ~560 s at most, for the next (issue 11): llama.cpp in the same run as the 12-layer double rows (the issue's
  # llamacpp_tok_s; the same-call ratio so far is from 6857486). llama.cpp's CUDA build runs in the background
  # (~330 s, nice 19) while the experts are made and the slice's GGUF written; its rows (default micro-batch,
  # -ub 4096, resident) run before ours. Carry .llama/llama.cpp.tar.xz, .whl, .devcache/commit (and the bf16
  # warm cache if it fits: 64 MiB in all). The binary comes back in pieces for .llama/.
  bash bench/device_llamacpp.sh build
  step 540 prefill-llama python3 -m bench.prefill_stream --llamacpp --llamacpp-build /tmp/ft-llama-build \
    --layers 12 --lengths 1024,4096,16384 --buffering double --name prefill_stream-llamacpp-12
  step 20 llama-back bash bench/device_llamacpp.sh wait
  ;;
115) # ~540 s at most, for the next (issue 11): the pass's experts in sub-chunks of EXPERT_SUB (8,192) tokens
  # (runtime/prefill_stream.py; plan 113: a 32k pass's compute 0.407 s against 0.506 s at 2,048, and the 32k
  # double pass was compute-bound at 0.548 s against the 0.370 s floor). Its CUDA exactness cases first, then the
  # 12-layer rows at HEAD into the issue's file (prefill_stream-gpu.json), double and single 1k-32k, with
  # llama.cpp in the same run at 1k/4k/16k (its default micro-batch prefills at ~250 tok/s there). First run
  # `bash bench/device_llamacpp.sh restore` carrying .llama/llama-bench.xz.* (42 MB that leave no room for the warm
  # cache in one carry), then this one at once, carrying .whl, .devcache/commit, .devcache/warm-cache.tgz
  # and .llama/llama.cpp.tar.xz (the GGUF converter). The compute rows also try whole-pass expert sub-chunks
  # (32,768): whether EXPERT_SUB should grow where memory allows.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan115 FT_PER_FILE=100 FT_K="cuda and equals_resident" bash bench/device_tests.sh \
    tests/test_prefill_stream.py > /dev/null
  step 400 prefill-stream-12 python3 -m bench.prefill_stream --llamacpp --llamacpp-build /tmp/ft-llama-build \
    --llamacpp-lengths 1024,4096,16384 --layers 12 --lengths 1024,4096,8192,16384,32768 \
    --buffering double,single --compute-pass --compute-subs 8192,32768 --name prefill_stream
  ;;
118) # ~220 s at most, for the next (issue 11): the 40-layer double rows with the pass's expert sub-chunks
  # (the latest are from 2026-12-03). Carry .whl, .devcache/commit and .devcache/warm-cache.tgz.
  step 200 prefill-stream-40 python3 -m bench.prefill_stream --layers 40 --lengths 4096,16384,32768 \
    --buffering double --no-resident --name prefill_stream-40l-esub
  ;;
116) # ~460 s at most, for the next (issue 12): what plan 112 left (its test_quantized_models file ran out at 300 s
  # after 5 of 8) and the GPU engine's fp8_block r = 0.5 case (plan 112 failed it on its bf16
  # tokens parting at token 8, its fp32 part passing; a failure now reports fp32's logits of the two picks). Carry .whl, .devcache/commit and a
  # warm cache with the quantized kernels trimmed to fit (the whole one is over the carry limit beside the wheels).
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  FT_TAG=plan116a FT_PER_FILE=260 FT_K="cuda and nvfp4 and (all or resident)" \
    bash bench/device_tests.sh tests/test_quantized_models.py > /dev/null
  FT_TAG=plan116b FT_PER_FILE=150 FT_K="gpu_engine and fp8_block-0.5" bash bench/device_tests.sh \
    tests/test_expert_cache_quant.py > /dev/null
  ;;
117) # ~420 s at most: Qwen3-Next-80B-A3B's shape (48 layers of 512 experts, top-10; read as Qwen3.5-MoE's layers
  # since fe37e24) with MXFP4 experts (41 GB in host RAM) decoding with the expert cache at 37.5% and CPU-only, 6
  # and 16 threads: the 80B on one GPU plus host RAM. Carry .whl, .devcache/commit and a warm cache.
  step 45 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  step 360 qwen3-next-80b python3 -m bench.large_models --arch qwen3_next --expert-format mxfp4 \
    --modes cache,cpu-only --capacity 0.375 --threads 6,16 --name large_models-qwen3_next-mxfp4
  ;;
119) # ~230 s at most, for the next (issue 12): the GPU engine's fp8_block cases after its bf16 check took
  # near-ties (plan 116: r = 0.5 parted at step 7, the cache on fp32's argmax, the resident path 0.10
  # below it). Carry .devcache/commit, the quantized warm cache and only the wheels the tests import
  # (llguidance, fla_core, einops): the whole cache and every wheel are over the carry limit.
  FT_TAG=plan119 FT_PER_FILE=220 FT_K="gpu_engine and fp8_block" bash bench/device_tests.sh \
    tests/test_expert_cache_quant.py > /dev/null
  ;;
120) # ~330 s at most, for the next (issue 11): where a compute-bound 32k pass goes. Plan 115 (H100, 7f239eb):
  # the 12-layer 32k pass took 0.645 s against a 0.391 s floor, its compute alone 0.512 s (experts in
  # 8,192-token sub-chunks) or 0.464 s (32,768), far from what its FLOPs (attention at 32k, the
  # experts, the DeltaNet and attention projections) need on an H100. GPU time by kernel
  # of that pass, both sub-chunk sizes; then plan 117 if time is left. Carry .whl, .devcache/commit
  # and .devcache/warm-cache.tgz (the bf16 one).
  step 300 prefill-profile python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering double \
    --no-resident --compute-pass --compute-subs 8192,32768 --profile --name prefill_stream-profile
  ;;
121) # ~400 s at most, for the next: the all-in-VRAM prefill of the full 40 layers, which the streamed pass
  # now outruns (plan 118: 22,228 tok/s at 32k with every expert offloaded, against 12.6-15.3k for
  # all-resident chunks of 2,048 on 2026-12-03): chunks of 2,048 and 8,192 and the resident pass
  # (experts in 8,192-token sub-chunks) in one run, whether the engine's resident prefill should take
  # larger chunks by default. The 64.4 GB of experts twice in VRAM (the streamed rows' pool is freed
  # first) may need the H200 (needs_h200). Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  step 380 prefill-resident-40 python3 -m bench.prefill_stream --layers 40 --lengths 8192,32768 \
    --buffering double --resident-chunks 2048,8192 --compute-pass --compute-subs 8192 --name prefill_stream-40l-resident
  ;;
122) # ~560 s at most, for the next (issue 11): the 32k pass's routed experts through torch's grouped GEMM
  # (CUTLASS on sm90, kernels/moe_grouped.py moe_grouped_mm) against our Triton tiles: the kernels alone
  # on the full-size expert shape at a pass's sub-chunk sizes, their CUDA tests, then the 12-layer
  # resident-pass rows with both (8k and 32k, sub-chunks of 8,192 and 32,768) and the kernel
  # profile of each 32k row (plan 120's question in the same call). Also the pass's attention
  # pieces (2,048 queries over 2k-32k keys) by SDPA backend: flash, which runs, against cuDNN's. Carry .whl, .devcache/commit,
  # .devcache/warm-cache.tgz.
  step 60 grouped-gemm python3 -m bench.grouped_gemm --tokens 2048,8192,32768 --name grouped_gemm
  step 45 attention-backends python3 -m bench.attention_backends --name attention_backends
  step 60 grouped-tests python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "moe_grouped or no_expert"
  step 330 prefill-grouped-mm python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering double \
    --no-resident --compute-pass --compute-subs 8192,32768 --grouped-mm off,on --profile --name prefill_stream-grouped-mm
  ;;
123) # ~330 s at most, for the next (issue 11): plan 120's profile of a 32k pass named two of its costs
  # that are not compute: the DeltaNet conv's copy and generic depthwise kernel (46.7 of 391 ms) and the MoE
  # block's unaligned 1,281-row in_proj GEMM (23.5 ms, cutlass_75 align1). The conv is now one Triton kernel
  # (kernels/causal_conv.py) and CUDA fused projections are padded to 16-byte rows (FusedLinear._pad): the
  # 12-layer pass rows with the profile again (and the resident pass with its token mixers in pieces of
  # 8,192 beside 2,048: plan 121's 40-layer pass, 20.8k tok/s at 32k, ran slower than chunks of 8,192, 25.3k),
  # the same rows without the two changes (FREETOKEN_PREFILL_KERNELS=0, same machine), the new kernel's and
  # the padding's CUDA tests, the 40-layer rows (streamed, resident pass, chunks of 2,048 and 8,192); the
  # production configs against transformers went to plan 124. Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  export FREETOKEN_PREFILL_KERNELS=1  # off by default until this call
  step 120 prefill-12 python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering double \
    --no-resident --compute-pass --compute-subs 8192,32768 --mixer-subs 2048,8192 --profile --name prefill_stream-profile-conv
  step 60 prefill-12-before env FREETOKEN_PREFILL_KERNELS=0 python3 -m bench.prefill_stream --layers 12 \
    --lengths 8192,32768 --buffering double --no-resident --compute-pass --compute-subs 8192,32768 \
    --name prefill_stream-profile-noconv
  FT_TAG=plan123 FT_PER_FILE=75 FT_K="causal_conv or moe_grouped or fused_linear or deltanet_layer or gated_rms or sum_pairs or no_expert or router or grouped_kernel" bash bench/device_tests.sh \
    tests/test_kernels.py tests/test_layers.py tests/test_quant_kernels.py > /dev/null
  step 150 prefill-40 python3 -m bench.prefill_stream --layers 40 --lengths 8192,32768 --buffering double \
    --resident-chunks 2048,8192 --compute-pass --compute-subs 8192 --mixer-subs 2048,8192 --profile --name prefill_stream-40l-conv
  step 60 grouped python3 -m bench.grouped_gemm --name grouped_gemm-m128  # tiles of 128 pairs against 64
  ;;
125) # ~280 s at most: plan 123 cut to fit what device time was left (no machine for an hour): the new
  # prefill kernels' CUDA tests first, then the 12-layer rows with them and without, then the grouped
  # GEMM's tiles of 128 against 64. Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  prefill_kernel_rows plan125 70 60 45
  step 40 grouped python3 -m bench.grouped_gemm --tokens 2048,8192,32768 --reps 5 --name grouped_gemm-m128
  ;;
126) # ~200 s at most: plan 125 cut again (359 s of device time left after an hour of failed starts): the
  # new prefill kernels' CUDA tests and the 12-layer rows with them and without. Carry as plan 125.
  prefill_kernel_rows plan126 55 50 40
  ;;
127) # ~520 s at most: plan 125 on a machine with no warm cache (the thirty-ninth session's checkout had
  # none: every Triton kernel compiles on the device, so the rows get longer limits). Carry .whl and
  # .devcache/commit.
  prefill_kernel_rows plan127 70 170 100
  step 60 grouped python3 -m bench.grouped_gemm --tokens 2048,8192,32768 --reps 5 --name grouped_gemm-m128
  ;;
128) # ~420 s at most: plan 123's 40-layer rows alone (streamed, resident pass, resident chunks of 2,048
  # and 8,192, profiled: is a 2,048-token chunk host-bound?), the kernels on. May need the H200 (the
  # pool twice in VRAM, plan 121). Carry .whl, .devcache/commit (and the warm cache plan 127 returned).
  export FREETOKEN_PREFILL_KERNELS=1
  step 400 prefill-40 python3 -m bench.prefill_stream --layers 40 --lengths 8192,32768 --buffering double \
    --resident-chunks 2048,8192 --compute-pass --compute-subs 8192 --mixer-subs 2048,8192 --profile --name prefill_stream-40l-conv
  ;;
129) # ~300 s at most: --idle-step-tokens (new) on the Qwen3.6 shape's 40 layers, experts in VRAM: a long
  # prompt's TTFT through the serving loop with nothing else decoding, steps of 2,048 (the old
  # behaviour), 4,096, 8,192 and auto (what the memory plan allows on this card), 8k and 32k prompts.
  # Carry .whl and .devcache/commit.
  step 300 idle-prefill python3 -m bench.idle_prefill --full-size --layers 40 --lengths 8192,32768 \
    --idle 2048,4096,8192,auto --reps 2 --name idle_prefill-40l
  ;;
130) # ~430 s at most: for a session with little device time, what matters first: the grouped kernels'
  # k-sum without a zero fill (on by default, never run on a GPU) in its CUDA tests, then plan 129's
  # idle-step rows. Carry .whl and .devcache/commit.
  FT_TAG=plan130 FT_PER_FILE=95 FT_K="moe_grouped or sum_pairs or no_expert or grouped_kernel" \
    bash bench/device_tests.sh tests/test_kernels.py tests/test_quant_kernels.py > /dev/null
  step 240 idle-prefill python3 -m bench.idle_prefill --full-size --layers 40 --lengths 8192,32768 \
    --idle 2048,8192,auto --reps 2 --name idle_prefill-40l
  ;;
131) # ~200 s at most: plan 130's CUDA tests alone (the default-on k-sum), for the last minutes of a
  # session's device time. Carry .whl and .devcache/commit.
  FT_TAG=plan131 FT_PER_FILE=95 FT_K="moe_grouped or sum_pairs or no_expert or grouped_kernel" \
    bash bench/device_tests.sh tests/test_kernels.py tests/test_quant_kernels.py > /dev/null
  ;;
132) # ~330 s at most: plan 130 cut to fit ~490 s of device time: the k-sum's CUDA tests, then the
  # idle-step rows of 2,048 against auto, one rep. Carry .whl and .devcache/commit.
  FT_TAG=plan132 FT_PER_FILE=80 FT_K="moe_grouped or sum_pairs or no_expert or grouped_kernel" \
    bash bench/device_tests.sh tests/test_kernels.py tests/test_quant_kernels.py > /dev/null
  step 170 idle-prefill python3 -m bench.idle_prefill --full-size --layers 40 --lengths 8192,32768 \
    --idle 2048,auto --reps 1 --name idle_prefill-40l
  ;;
124) # ~250 s at most, for the next: what plan 123 left for lack of device time, the production configs
  # against transformers on CUDA with the DeltaNet conv kernel and the padded projections, and the streamed
  # pass against the resident path. Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  export FREETOKEN_PREFILL_KERNELS=1
  FT_TAG=plan124 FT_PER_FILE=100 bash bench/device_tests.sh tests/test_gpu_production.py > /dev/null
  FT_TAG=plan124 FT_PER_FILE=140 FT_K="cuda and equals_resident" bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
133) # ~600 s at most (the C++ build first): the fortieth session's CPU kernels on the Xeon host, the GPU hidden (no CUDA
  # needed; runs on any machine kind): the expert executor's token blocks on and off (FP8, MXFP4, bf16
  # banks, 6 threads, prompt-sized calls), the FP8 dense rows kernel per weight, then a decode step of
  # the 12-layer Qwen3.6 slice with FP8 projections kept against dequantized to fp32. Carry .whl and
  # .devcache/commit.
  CUDA_VISIBLE_DEVICES= step 120 cpu-build python3 -c "from freetoken.experts.cpu import extension; extension()"
  for f in fp8_block mxfp4 bf16; do
    for tb in 0 1; do
      FREETOKEN_CPU_TOKEN_BLOCK=$tb CUDA_VISIBLE_DEVICES= step 40 "tokenblock-$f-$tb" python3 -m bench.cpu_experts \
        --format $f --experts 256 --threads 6 --batches 64,256,512 --iters 3 --name "cpu_experts-$f-tokenblock$tb-t6"
    done
  done
  CUDA_VISIBLE_DEVICES= step 60 gemv-fp8 python3 -m bench.cpu_gemv --dtypes fp8 --threads 6 --rows 1,2,4,16,32 \
    --name cpu_gemv-fp8-t6
  for d in fp8_block fp8_dequant; do
    CUDA_VISIBLE_DEVICES= step 120 "dense-$d" python3 -m bench.large_models --arch qwen3_5_moe --layers 12 \
      --expert-format fp8_block --modes cpu-only --compute-dtype float32 --threads 6 --tokens 32 \
      --dense-format $d --name "large_models-qwen3_5_moe-12-fp8-dense-$d-t6"
  done
  ;;
134) # ~420 s at most: the prefill kernels' CUDA tests alone (conv, fused router, gated norm, padded
  # fused projections, the DeltaNet layer), the one thing left before FREETOKEN_PREFILL_KERNELS
  # turns on by default: plan 127 ran them with 70 s a file and a cold Triton cache, and both
  # files ran out of time with no failure (test_kernels 10 passed, test_quant_kernels 7; plan 131's
  # k-sum cases then passed in full). Carry .whl, .devcache/commit, .devcache/warm-cache.tgz (the
  # forty-first session's, which holds these kernels' compiles).
  export FREETOKEN_PREFILL_KERNELS=1
  FT_TAG=plan134 FT_PER_FILE=200 FT_K="causal_conv or fused_linear or deltanet_layer or gated_rms or router" \
    bash bench/device_tests.sh tests/test_kernels.py tests/test_layers.py > /dev/null
  FT_TAG=plan134 FT_PER_FILE=150 FT_K="cuda and equals_resident" bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  ;;
135) # ~330 s at most: issue 11's last gap, a device timeline of the streamed 32k pass (bench/copy_timeline.py):
  # plan 127 put the 12-layer pass at 1.24x its transfer floor and plan 128 the 40-layer one at 1.11x, though
  # their compute alone fits under the floor. Does the copy engine slow under compute, idle waiting for a
  # region, or the compute wait? One profiled pass per size after the timed one. Carry .whl, .devcache/commit,
  # .devcache/warm-cache.tgz.
  step 150 timeline-12 python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering double \
    --no-resident --timeline --name prefill_stream-timeline-12l
  step 170 timeline-40 python3 -m bench.prefill_stream --layers 40 --lengths 32768 --buffering double \
    --no-resident --timeline --name prefill_stream-timeline-40l
  ;;
136) # ~330 s at most: plan 135's timeline showed the copy engine idle ~21 ms after each attention layer of a
  # 32k pass (two regions: layer j+1's copy waits for layer j-1's experts, and a long prompt's attention
  # layer computes ~50 ms against a 29 ms copy). Triple buffering (a third region, two layers ahead) against
  # double on a pool of three layers' slots, timelines of both. Carry .whl, .devcache/commit,
  # .devcache/warm-cache.tgz.
  step 160 triple-12 python3 -m bench.prefill_stream --layers 12 --lengths 8192,32768 --buffering triple,double \
    --slots 768 --no-resident --timeline --name prefill_stream-triple-12l
  step 170 triple-40 python3 -m bench.prefill_stream --layers 40 --lengths 16384,32768 --buffering triple,double \
    --slots 768 --no-resident --timeline --name prefill_stream-triple-40l
  ;;
137) # ~300 s at most: plan 136 was noisy (the same double 40-layer row took 2.0 s against 1.36-1.38 in plans
  # 128 and 135) and its timelines traced the host, which slows it. Triple against double twice each,
  # alternating, timelines of the device only; and double with the pass's mixers in pieces of 8,192
  # (a quarter of the launches: is the pass host-bound?). Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  step 130 abab-12 python3 -m bench.prefill_stream --layers 12 --lengths 32768 --buffering triple,double,triple,double \
    --slots 768 --no-resident --timeline --name prefill_stream-abab-12l
  step 150 abab-40 python3 -m bench.prefill_stream --layers 40 --lengths 32768 --buffering triple,double,triple,double \
    --slots 768 --no-resident --timeline --name prefill_stream-abab-40l
  step 130 msub-40 python3 -m bench.prefill_stream --layers 40 --lengths 32768 --buffering double \
    --stream-mixer-subs 2048,8192,2048,8192 --no-resident --timeline --name prefill_stream-msub-40l
  ;;
138) # ~330 s at most: plan 137 found the 32k pass paced by the host (copy and compute idle together; mixers
  # in pieces of 8,192 cut the copy gaps from ~280 to 138 ms) and triple buffering no better than double.
  # The loader's per-layer routed-set sync (the host in lockstep with the device) is now skipped for
  # passes of 4,096 tokens or more: rows without it (double and triple, pieces of 2,048 and 8,192) and
  # with it (--sync-free-tokens 0, double) in one run each. The sync-free step printed no row in 150 s. Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  step 150 nosync-40 python3 -m bench.prefill_stream --layers 40 --lengths 32768 --buffering double,triple \
    --slots 768 --stream-mixer-subs 2048,8192 --sync-free-tokens 4096 --no-resident --timeline --name prefill_stream-nosync-40l
  step 110 sync-40 python3 -m bench.prefill_stream --layers 40 --lengths 32768 --buffering double \
    --slots 768 --stream-mixer-subs 2048,8192 --sync-free-tokens 0 --no-resident --timeline --name prefill_stream-sync-40l
  ;;
139) # ~300 s at most: the prefill kernels' load-time proof and the streamed passes on CUDA (tests: `triple`,
  # and the slot tables uploaded on the copy stream), then on the 12-layer slice, alternating in one process:
  # the synced pass against the sync-free one (plan 138's sync-free 40-layer step printed no row in 150 s, most
  # likely the bench compiling the decode cache's control kernel for 768 slots first; the bench no longer
  # compiles it), each with the slot tables on the compute stream and on the copy stream
  # (experts/stream.py TABLE_ON_COPY). Python stacks dumped (SIGABRT) if a step runs past its limit.
  # Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  FT_TAG=plan139 FT_PER_FILE=150 FT_K="cuda" bash bench/device_tests.sh tests/test_prefill_proof.py \
    tests/test_prefill_stream.py > /dev/null  # the load-time proof; the streamed passes with `triple`
  step 110 nosync-12 env PYTHONFAULTHANDLER=1 timeout -s ABRT 100 python3 -m bench.prefill_stream --layers 12 \
    --lengths 32768 --buffering double --sync-free-tokens 0,4096,0,4096 --table-on-copy 0,1 --no-resident \
    --name prefill_stream-nosync-12l
  ;;
140) # ~330 s at most: plan 139's choices on the 40 layers with the engine's mixer pieces of 8,192 (plan 137-138:
  # the host no longer paces the pass there, 35 ms of host gaps, but the copy engine still idles ~15 ms after
  # each attention layer: the next region frees only when that layer's compute ends, which a third region
  # removes; `triple` was measured only with pieces of 2,048). double and triple (768 slots) x synced and
  # sync-free x tables on the compute or the copy stream, in one process; then pieces of 2,048 synced
  # against sync-free (where plan 138 found 557 ms of host gaps).
  step 230 modes-40 env PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m bench.prefill_stream --layers 40 \
    --lengths 32768 --buffering double,triple --slots 768 --stream-mixer-subs 8192 --sync-free-tokens 0,4096 \
    --table-on-copy 0,1 --no-resident --name prefill_stream-modes-40l
  step 100 nosync2048-40 env PYTHONFAULTHANDLER=1 timeout -s ABRT 90 python3 -m bench.prefill_stream --layers 40 \
    --lengths 32768 --buffering double --stream-mixer-subs 2048 --sync-free-tokens 0,4096,0,4096 --no-resident \
    --name prefill_stream-nosync2048-40l
  ;;
141) # ~480 s at most: plans 139 and 140 cut to one call for a session with little device time: the CUDA
  # tests, then the 40-layer modes step (no 12-layer rows, no pieces of 2,048).
  FT_TAG=plan141 FT_PER_FILE=150 FT_K="cuda" bash bench/device_tests.sh tests/test_prefill_proof.py \
    tests/test_prefill_stream.py > /dev/null
  step 230 modes-40 env PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m bench.prefill_stream --layers 40 \
    --lengths 32768 --buffering double,triple --slots 768 --stream-mixer-subs 8192 --sync-free-tokens 0,4096 \
    --table-on-copy 0,1 --no-resident --name prefill_stream-modes-40l
  ;;
142) # ~330 s at most: plan 141 cut further for ~450 s of device time: the two CUDA cases of the slot tables on
  # the copy stream, then the 40-layer modes step.
  FT_TAG=plan142 FT_PER_FILE=100 FT_K="cuda_streamed_prefill_equals_resident and True" bash bench/device_tests.sh \
    tests/test_prefill_stream.py > /dev/null
  step 230 modes-40 env PYTHONFAULTHANDLER=1 timeout -s ABRT 220 python3 -m bench.prefill_stream --layers 40 \
    --lengths 32768 --buffering double,triple --slots 768 --stream-mixer-subs 8192 --sync-free-tokens 0,4096 \
    --table-on-copy 0,1 --no-resident --name prefill_stream-modes-40l
  ;;
143) # ~420 s at most: TABLE_ON_COPY and SYNC_FREE_TOKENS=4096 now on by default (plan 140): the CUDA cases of
  # the streamed passes with them, then through the serving loop: TTFT of 8k and 32k prompts alone on the
  # 40 layers with the experts behind the GPU cache (streamed passes), tables on the compute stream then
  # on the copy stream. Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  FT_TAG=plan143 FT_PER_FILE=150 FT_K="cuda" bash bench/device_tests.sh tests/test_prefill_stream.py > /dev/null
  step 260 idle-cache-40 env PYTHONFAULTHANDLER=1 timeout -s ABRT 250 python3 -m bench.idle_prefill --full-size \
    --layers 40 --experts cache --lengths 8192,32768 --idle auto --reps 2 --table-on-copy 0,1 \
    --name idle_prefill-cache-40l
  ;;
144) # ~330 s at most: the 12-layer slice's 32k pass with the new defaults and mixer pieces of 8,192 against its
  # bound (max(floor, the resident compute of the same pass)), tables on the compute stream then on the
  # copy stream; then the Xeon's rows of the fp4 decode-once kernels (float and bf16 activations, 6 and 16
  # threads, the GPU hidden). Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  step 150 bound-12 env PYTHONFAULTHANDLER=1 timeout -s ABRT 140 python3 -m bench.prefill_stream --layers 12 \
    --lengths 8192,32768 --buffering double --stream-mixer-subs 8192 --table-on-copy 0,1 --compute-pass \
    --compute-subs 8192 --name prefill_stream-bound-12l
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  CUDA_VISIBLE_DEVICES= step 80 once-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 6 \
    --batches 64,512 --iters 8 --decode-once 0,4 --name cpu_experts-mxfp4-decode-once-f32-xeon-t6
  CUDA_VISIBLE_DEVICES= step 80 once-t16 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 16 \
    --batches 64,512 --iters 8 --decode-once 0,4 --name cpu_experts-mxfp4-decode-once-f32-xeon-t16
  ;;
145) # ~400 s at most: the fp4 kernels' block scales decoded once per call against per chunk (moe_cpu
  # FREETOKEN_CPU_ROW_SCALES; the same bits), A/B in one process on the Xeon, where the kernels are bound by
  # their instructions (issue 12's 80% of host read): MXFP4 and NVFP4 at 6 and 14 threads, batch 1 and 4 from
  # DRAM and the cached top-k, float, bf16 and int8 activations; the GPU hidden. Carry .whl, .devcache/commit.
  # (Written when set_row_scales took a bool; since 17da23c's successor it takes a mask: 1,0 would be AVX2 only.)
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  for t in 6 14; do for f in mxfp4 nvfp4; do
    CUDA_VISIBLE_DEVICES= step 95 rowscales-$f-t$t python3 -m bench.cpu_experts --format $f --experts 512 --threads $t \
      --batches 1,4 --iters 30 --fixed-cost --row-scales 1,0 --name cpu_experts-$f-rowscales-xeon-t$t
  done; done
  ;;
146) # ~330 s at most: plan 145 again after the kernels became templates on the block-scale choice (no branch
  # in their loops: plan 145's float and int8 rows from DRAM ran 2-8% slower with the scales on), at 6 threads,
  # then the 12-layer MXFP4 slice's CPU-only and cache decode with FREETOKEN_CPU_ROW_SCALES=3, 0, 3, 0 (3: every kernel; the default is 1, AVX2 only)
  # (one process each). Carry .whl, .devcache/commit, .devcache/warm-cache.tgz.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  for f in mxfp4 nvfp4; do
    CUDA_VISIBLE_DEVICES= step 60 rowscales-$f-t6 python3 -m bench.cpu_experts --format $f --experts 512 --threads 6 \
      --batches 1,4 --iters 30 --fixed-cost --row-scales 3,0 --name cpu_experts-$f-rowscales-tpl-xeon-t6
  done
  for rs in 3 0 3 0; do
    FREETOKEN_CPU_ROW_SCALES=$rs step 60 lm-rs$rs python3 -m bench.large_models --arch qwen3_5_moe --layers 12 \
      --expert-format mxfp4 --modes cpu-only,cache --capacity 0.33 --threads 6 --tokens 64 \
      --name large_models-qwen3_5_moe-12-mxfp4-rowscales$rs-tpl-t6-$RANDOM
  done
  ;;
147) # ~420 s at most: why the 4-bit kernels read ~9 GB/s a core from DRAM at 6 threads (about what 16 L1 fill
  # buffers carry at ~110 ns) against the probe's 13 (issue 12's 80% of host read): a 4-row block's rows read one
  # after another (FREETOKEN_CPU_ROW_SEQ, one ascending run per 4 KiB page for the L2 streamer) against side by
  # side, and the software look-ahead's hint and distance, A/B in one process; MXFP4 at 6 and 16 threads (the
  # issue's two counts; 16 never run before), NVFP4 at 6; the GPU hidden. Carry .whl, .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  for t in 6 16; do
    CUDA_VISIBLE_DEVICES= step 120 seq-mxfp4-t$t python3 -m bench.cpu_experts --format mxfp4 --experts 512 --threads $t \
      --batches 1,4 --iters 30 --fixed-cost --row-seq 0,1 --prefetch t2:8192,off:0,t0:8192,t2:4096,t2:16384 \
      --name cpu_experts-mxfp4-rowseq-xeon-t$t
  done
  CUDA_VISIBLE_DEVICES= step 90 seq-nvfp4-t6 python3 -m bench.cpu_experts --format nvfp4 --experts 512 --threads 6 \
    --batches 1,4 --iters 30 --row-seq 0,1 --name cpu_experts-nvfp4-rowseq-xeon-t6
  ;;
148) # ~420 s at most: plan 147 left the rows-in-sequence switch off (int8 slower with it) and the look-ahead's
  # 8 KiB within noise of 4 KiB: shorter distances at 6 threads; the int8 decode-once kernel (qdot4xn_fp4_q8) A/B
  # on prompt-sized calls; NVFP4 at 16 threads (issue 12's second count); the 12-layer MXFP4 slice's CPU-only
  # prompt and decode with int8 and exact activations (one process each). GPU hidden. Carry .whl, .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  CUDA_VISIBLE_DEVICES= step 90 pf-mxfp4-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 512 --threads 6 \
    --batches 1,4 --iters 30 --prefetch t2:8192,t2:2048,t2:3072,t2:4096,t2:6144 --name cpu_experts-mxfp4-pf-xeon-t6
  CUDA_VISIBLE_DEVICES= step 90 once8-mxfp4-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 6 \
    --batches 64,512 --iters 6 --decode-once 0,4 --name cpu_experts-mxfp4-int8-decode-once-xeon-t6
  CUDA_VISIBLE_DEVICES= step 60 nvfp4-t16 python3 -m bench.cpu_experts --format nvfp4 --experts 512 --threads 16 \
    --batches 1,4 --iters 30 --fixed-cost --name cpu_experts-nvfp4-xeon-t16
  for act in int8 exact; do
    CUDA_VISIBLE_DEVICES= step 100 lm-$act python3 -m bench.large_models --arch qwen3_5_moe --layers 12 \
      --expert-format mxfp4 --modes cpu-only --threads 6 --tokens 32 --prefill 512 --cpu-act $act \
      --name large_models-qwen3_5_moe-12-mxfp4-$act-prompt-xeon-t6
  done
  ;;
149) # ~300 s at most: the AVX2 decode-once kernels (exact fp4 qdot4xn_fp4_avx2, int8 qdot4xn_fp4_q8_avx2) on an
  # Intel core under an AVX2 cap (what a consumer CPU without AVX-512 runs), A/B on prompt-sized calls; the
  # batch-1/4 rows at 6 threads after the one-tree row sums (half_sums4) with the AVX-512 row scales A/B (a host
  # bound by its instructions at 6 threads may take them); int8 prompts decoded once at 16 threads. GPU hidden.
  # Carry .whl, .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  CUDA_VISIBLE_DEVICES= step 100 avx2-once-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 6 \
    --batches 64,512 --iters 6 --decode-once 0,4 --isa-cap 1 --name cpu_experts-mxfp4-avx2-decode-once-xeon-t6
  CUDA_VISIBLE_DEVICES= step 60 rs-mxfp4-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 512 --threads 6 \
    --batches 1,4 --iters 30 --fixed-cost --row-scales 3,1 --name cpu_experts-mxfp4-sums4-xeon-t6
  CUDA_VISIBLE_DEVICES= step 60 once8-t16 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 16 \
    --batches 512 --iters 6 --decode-once 0,4 --name cpu_experts-mxfp4-int8-decode-once-xeon-t16
  ;;
150) # ~150 s: plan 149's first row alone (the session's device time nearly spent): the AVX2 decode-once kernels
  # on a Xeon under an AVX2 cap, 512-token calls. GPU hidden. Carry .whl, .devcache/commit.
  CUDA_VISIBLE_DEVICES= step 170 avx2-once-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 256 --threads 6 \
    --batches 512 --iters 4 --decode-once 0,4 --isa-cap 1 --name cpu_experts-mxfp4-avx2-decode-once-xeon-t6
  ;;
151) # (ran at 3ace40f, forty-seventh session, as --q8-runs / FREETOKEN_CPU_Q8_RUNS: the int8 kernel alone; the
  # switch is now --row-runs / FREETOKEN_CPU_ROW_RUNS over every fp4 run kernel, plan 152)
  # ~450 s at most: the int8 VBMI kernel's decode calls a run of an expert's rows at a time (qrun_fp4_q8_vbmi,
  # row_runs.h) against a 4-row block at a time, A/B in one process (--row-runs 1,0): issue 12's ratio at 6 and 16
  # threads (on the dev machine, 2 threads, batch 1: 0.695 -> 0.464 ms, 0.80 of its read probe); then the 12-layer
  # MXFP4 slice's pure-CPU decode with int8 activations, runs on and off (one process each). GPU hidden.
  # Carry .whl, .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  for t in 6 16; do
    CUDA_VISIBLE_DEVICES= step 60 runs-mxfp4-t$t python3 -m bench.cpu_experts --format mxfp4 --experts 512 --threads $t \
      --batches 1,4 --iters 30 --fixed-cost --row-runs 1,0 --name cpu_experts-mxfp4-q8runs-xeon-t$t
  done
  CUDA_VISIBLE_DEVICES= step 60 runs-nvfp4-t6 python3 -m bench.cpu_experts --format nvfp4 --experts 512 --threads 6 \
    --batches 1,4 --iters 30 --fixed-cost --row-runs 1,0 --name cpu_experts-nvfp4-q8runs-xeon-t6
  for runs in 1 0; do
    FREETOKEN_CPU_ROW_RUNS=$runs CUDA_VISIBLE_DEVICES= step 90 lm-runs$runs python3 -m bench.large_models --arch qwen3_5_moe \
      --layers 12 --expert-format mxfp4 --modes cpu-only --threads 6 --tokens 64 --cpu-act int8 \
      --name large_models-qwen3_5_moe-12-mxfp4-int8-runs$runs-xeon-t6
  done
  ;;
152) # ~330 s at most: every fp4 run kernel (row_runs.h: int8 on VBMI, bf16 and float activations on AVX-512)
  # against a call per 4-row block, A/B in one process (--row-runs 1,0), MXFP4 and NVFP4 at 6 and 16 threads:
  # issue 12's ratio for the exact kernels too (dev machine, 2 threads, MXFP4 batch 1: float 0.79 -> 0.66-0.71 ms,
  # bf16 0.62 -> 0.45, int8 0.58 -> 0.36). GPU hidden. Carry .whl, .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  for f in mxfp4 nvfp4; do for t in 6 16; do
    CUDA_VISIBLE_DEVICES= step 60 runs-$f-t$t python3 -m bench.cpu_experts --format $f --experts 512 --threads $t \
      --batches 1,4 --iters 30 --fixed-cost --row-runs 1,0 --name cpu_experts-$f-rowruns-xeon-t$t
  done; done
  ;;
153) # ~520 s at most: the GPU expert cache's CPU branch (bf16 activations, one token an expert at batch 1) with
  # the run kernels and without (FREETOKEN_CPU_ROW_RUNS=1, 0, 1; a process each): configuration (b), the 40-layer
  # MXFP4 Qwen3.6 shape at 37.5% of its experts in VRAM, 6 threads, the adaptive split. Carry .whl,
  # .devcache/commit (.devcache/warm-cache.tgz where there is one).
  for runs in 1 0 1; do
    FREETOKEN_CPU_ROW_RUNS=$runs step $([ -f /tmp/.ft-lm-warm ] && echo 150 || echo 240) cache-runs$runs \
      python3 -m bench.large_models --arch qwen3_5_moe --layers 40 --expert-format mxfp4 --modes cache --capacity 0.375 \
      --threads 6 --name large_models-qwen3_5_moe-40-mxfp4-cache-runs$runs-t6-$RANDOM
    touch /tmp/.ft-lm-warm
  done
  ;;
154) # ~420 s at most: plan 153 again on a warm cache (.devcache/warm-cache.tgz from plan 153), alternating
  # FREETOKEN_CPU_ROW_RUNS=0, 1, 0, 1 (a process each): plan 153's first process ran on a host still busy with its
  # own set-up (64.6 tok/s against 86.9 for its third), so its A/B was one process a side. Carry .whl,
  # .devcache/commit, .devcache/warm-cache.tgz.
  for runs in 0 1 0 1; do
    FREETOKEN_CPU_ROW_RUNS=$runs step 150 cache-runs$runs python3 -m bench.large_models --arch qwen3_5_moe --layers 40 \
      --expert-format mxfp4 --modes cache --capacity 0.375 --threads 6 \
      --name large_models-qwen3_5_moe-40-mxfp4-cache-runs$runs-t6-$RANDOM
  done
  ;;
155) # ~420 s at most, GPU hidden: where the pure-CPU decode step goes on the Xeon (the 12-layer MXFP4 slice ran
  # 57-63 ms a step at 6 threads in plan 151, the experts ~4 of it: the dense rows kernel and the 248k-row head,
  # never split by part on an Intel host), at 6 and 16 threads; then the AVX2 run calls under an AVX2 cap (what
  # a consumer CPU without AVX-512 runs: 1.4-1.9x on the dev machine), A/B in one process. Carry .whl,
  # .devcache/commit.
  step 150 build-cpp python3 -c "from freetoken.experts.cpu import extension; extension()"  # a changed moe_cpu.cpp
  CUDA_VISIBLE_DEVICES= step 150 step-parts python3 -m bench.cpu_step_parts --arch qwen3_5_moe --layers 12 \
    --expert-format mxfp4 --threads 6,16 --name cpu_step_parts-qwen3_5_moe-12-mxfp4-xeon
  CUDA_VISIBLE_DEVICES= step 90 runs-avx2-t6 python3 -m bench.cpu_experts --format mxfp4 --experts 512 --threads 6 \
    --batches 1,4 --iters 30 --fixed-cost --row-runs 1,0 --isa-cap 1 --name cpu_experts-mxfp4-rowruns-avx2-xeon-t6
  ;;
*) echo "stage 0 to 155"; exit 2 ;;
esac
# the kernels compiled on this machine, for the next (bench/device_env.sh restores .devcache/warm-cache.tgz):
# Triton's cache and the C++ executor's build. A file comes back only under 16 MiB (plan 83's whole
# cache did not), so a larger cache comes back as what this machine compiled since the restore,
# $OUT/warm-cache-new.tgz: merge it here with `bash bench/merge_warm_cache.sh FILES_AT`.
(cd "$HOME" && {
   tar czf /tmp/warm-cache.tgz --exclude=lock --exclude='*.lock' .triton/cache .cache/freetoken/build 2>/dev/null
   if [ -s /tmp/warm-cache.tgz ] && [ "$(stat -c %s /tmp/warm-cache.tgz)" -lt 16000000 ]; then
     cp /tmp/warm-cache.tgz "$OUT/warm-cache.tgz"
   elif [ -f /tmp/.ft-warm-restored ]; then
     find .triton/cache .cache/freetoken/build -newer /tmp/.ft-warm-restored ! -name '*.lock' ! -name lock \
       -type f 2>/dev/null > /tmp/warm-new.list
     if [ ! -s /tmp/warm-new.list ]; then echo "warm cache: nothing compiled since the restore"
     else
       tar czf "$OUT/warm-cache-new.tgz" -T /tmp/warm-new.list
       echo "warm cache: $(wc -l < /tmp/warm-new.list) files compiled since the restore, $(stat -c %s "$OUT/warm-cache-new.tgz") bytes"
       [ "$(stat -c %s "$OUT/warm-cache-new.tgz")" -lt 16000000 ] || echo "warm cache: its delta is over 16 MiB and will not come back"
     fi
   else echo "warm cache not saved: $(stat -c %s /tmp/warm-cache.tgz 2>/dev/null) bytes, over 16 MiB, and no restore to diff against"; fi
 }) >> "$LOG" 2>&1 || echo "warm cache not saved" >> "$LOG"
# the JSON results in one file (each keeps its own name inside)
(cd "$OUT" && ls ./*.json >/dev/null 2>&1 && tar czf "results-plan$STAGE.tgz" ./*.json && rm -f ./*.json)
grep -E '^===|passed|failed|tok/s|Error' "$LOG" | tail -40
tail -5 "$OUT"/tests-plan*.log 2>/dev/null || true  # plans without tests: not a failure
