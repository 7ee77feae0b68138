"""bench/copy_timeline.py analyze(): a streamed pass's copy engine against its compute, read from
Chrome-trace events. Synthetic traces with known answers (the profiler itself needs a GPU)."""
import random

import pytest

from bench.copy_timeline import analyze


def copy(ts, dur, nbytes, stream=20):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"stream": stream, "bytes": nbytes}}


def kernel(ts, dur, stream=7, name="k"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_copies_alone_and_under_compute():
    # two copies of 1 GB: the first alone at 50 GB/s (20 ms), the second under a kernel at 40 GB/s (25 ms);
    # a 5 ms compute gap after the second copy with no copy running
    ev = [copy(0, 20_000, 10**9), copy(20_000, 25_000, 10**9), kernel(20_000, 25_000), kernel(50_000, 10_000)]
    t = analyze(ev)
    assert t["wall_ms"] == 60.0
    assert t["copy"]["n"] == 2 and t["copy"]["gb"] == 2.0
    assert t["copy"]["gbs_alone"] == 50.0 and t["copy"]["gbs_overlapped"] == 40.0
    assert t["copy"]["busy_ms"] == 45.0 and t["copy"]["gaps"] == 0
    assert t["both_ms"] == 25.0
    c = t["compute"]
    assert c["busy_ms"] == 35.0
    # idle: 0-20 ms (the first copy running through it) and 45-50 ms (none)
    assert c["gaps"] == 2 and c["gaps_ms"] == 25.0 and c["gaps_copy_running_ms"] == 20.0
    assert c["top_gaps"][0] == {"at_ms": 0.0, "ms": 20.0, "copy_running": 1.0, "host_ms": None}
    assert c["tail_ms"] == 15.0
    assert [r["under_compute"] for r in t["copy"]["rows"]] == [0.0, 1.0]


def test_copy_stream_gaps_and_overlapping_kernels():
    # kernels on two compute streams overlapping each other count once; a 3 ms hole on the copy engine;
    # a slot table's small upload on the compute stream is not one of the streamed copies
    ev = [copy(0, 10_000, 5 * 10**8), copy(13_000, 10_000, 5 * 10**8), kernel(0, 8_000), kernel(4_000, 8_000, stream=9),
          kernel(12_000, 11_000), copy(11_000, 5, 2048, stream=7)]
    t = analyze(ev)
    assert t["copy"]["n"] == 2 and t["copy"]["gb"] == 1.0
    assert t["copy"]["gaps"] == 1 and t["copy"]["gaps_ms"] == 3.0 and t["copy"]["top_gaps"][0]["at_ms"] == 10.0
    assert t["compute"]["kernels"] == 3
    assert t["compute"]["busy_ms"] == 23.0
    assert t["both_ms"] == pytest.approx(10.0 + 10.0)


def runtime(ts, corr, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 5, "args": {"correlation": corr}}


def with_corr(e, corr):
    e["args"]["correlation"] = corr
    return e


def test_host_launch_lateness():
    # compute idles 10-20 ms: the kernel ending the gap was launched by the host at 16 ms (6 ms of the gap
    # is the host's), the other gap 30-34 ms ends with a kernel queued long before (the device waited on a copy)
    ev = [with_corr(kernel(0, 10_000), 1), runtime(0, 1),
          with_corr(kernel(20_000, 10_000), 2), runtime(16_000, 2),
          with_corr(kernel(34_000, 1_000), 3), runtime(21_000, 3),
          with_corr(copy(25_000, 9_000, 10**8), 4), runtime(1_000, 4, "cudaMemcpyAsync")]
    t = analyze(ev)
    gaps = sorted(t["compute"]["top_gaps"], key=lambda g: g["at_ms"])
    assert [(g["at_ms"], g["ms"], g["host_ms"]) for g in gaps] == [(10.0, 10.0, 6.0), (30.0, 4.0, 0.0)]
    assert t["compute"]["gaps_host_ms"] == 6.0
    assert t["copy"]["rows"][0]["after_issue_ms"] == 24.0


def test_short_jitter_is_not_a_gap_and_random_traces_add_up():
    ev = [kernel(0, 1_000), kernel(1_020, 1_000)]  # a 20 us launch gap
    assert analyze(ev)["compute"]["gaps"] == 0
    assert analyze([]) == {"events": 0}
    rng = random.Random(5)
    for _ in range(20):
        ev, t = [], 0.0
        for _ in range(rng.randint(1, 30)):
            t += rng.uniform(0, 3_000)
            d = rng.uniform(10, 5_000)
            ev.append(copy(t, d, rng.randint(1, 10**8)) if rng.random() < 0.4 else kernel(t, d, stream=rng.choice([7, 9])))
        r = analyze(ev)
        # busy plus idle is the wall for the compute; both never exceeds either side's busy time
        if r["compute"]["kernels"]:
            c = r["compute"]
            assert c["busy_ms"] <= r["wall_ms"] + 1e-3
            assert c["gaps_ms"] <= r["wall_ms"] - c["busy_ms"] + 1e-3
        assert r["both_ms"] <= min(r["copy"]["busy_ms"] if r.get("copy") else 0, r["compute"]["busy_ms"]) + 1e-3
