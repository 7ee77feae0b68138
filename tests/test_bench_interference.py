"""bench.interference's accounting of the loaded gaps: what lies inside each (a collector pause,
a prompt forward's start or end, layers only) and the collector's pauses per generation."""
import torch

from bench.interference import gap_kinds, gc_summary, once_per_step


def test_gap_kinds_sorts_each_gap_by_what_lies_inside_it():
    events = [(0.5, "prompt300"), (1.0, "L0"), (1.5, "decode2-nested"), (2.0, "L1"), (2.2, "gc2:80.0ms"),
              (2.6, "prompt20-nested"), (3.0, "end-prompt300"), (3.2, "decode2")]
    gaps = [(0.0, 1.6), (1.6, 2.1), (2.1, 2.5), (2.5, 2.9), (2.9, 3.3)]
    k = gap_kinds(events, gaps, over=0.45)
    assert k["start"]["count"] == 1 and k["start"]["over_2x"] == 1  # the forward's set-up inside
    assert k["gc"]["count"] == 1 and k["gc"]["max_ms"] == 400.0  # a pause outranks the rest
    assert k["end"]["count"] == 1 and k["end"]["p50_ms"] == 400.0
    # a nested short prompt is not a forward boundary: layers only
    assert k["layers"]["count"] == 2 and k["layers"]["over_2x"] == 1 and k["layers"]["max_ms"] == 500.0
    assert sum(v["count"] for v in k.values()) == len(gaps)


def test_gc_summary_by_generation():
    s = gc_summary([(0.0, 0, 0.0002), (1.0, 2, 0.08), (2.0, 2, 0.12), (3.0, 1, 0.004)])
    assert s["gen0"] == {"count": 1, "longest_ms": 0.2, "total_ms": 0.2}
    assert s["gen1"]["count"] == 1 and s["gen2"] == {"count": 2, "longest_ms": 120.0, "total_ms": 200.0}
    assert gc_summary([])["gen2"] == {"count": 0, "longest_ms": 0.0, "total_ms": 0.0}


def test_layer_timeline_splits_prompt_work_from_the_hooks():
    """Each point's stretch runs from its hook's return to the next hook's start: time spent
    inside a hook (a decode step) is no layer's; the set-up and the tail are their own."""
    import time

    from bench.layer_timeline import LayerTimeline
    tl = LayerTimeline(torch.device("cpu"))
    for tokens in (64, 512):
        tl.begin(tokens)
        time.sleep(0.002)  # set-up
        for i in range(3):
            tl.enter(i)
            time.sleep(0.02 if i == 1 else 0.0)  # a decode step inside the hook before layer 1
            tl.leave(i, stepped=i == 1)
            time.sleep(0.01 if i == 2 else 0.001)  # layer 2 is the costly one
        tl.end()
    s = tl.summary(cap=128)
    assert s["graphed"]["forwards"] == 1 and s["eager"]["forwards"] == 1
    for kind in ("graphed", "eager"):
        ms = s[kind]["all_host_dev_ms"]
        assert set(ms) == {"setup", "0", "1", "tail"}  # the last point's work is the tail
        assert ms["tail"][0] >= 9 and ms["1"][0] < 9  # the decode step is not layer 0's or 1's
        assert ms["setup"][0] >= 1.5 and ms["tail"][1] is None  # no device times off CUDA
        assert next(iter(s[kind]["costliest_host_dev_ms"])) == "tail"
        assert s[kind]["after_step"]["1"][0] == 1 and s[kind]["after_step"]["0"][0] == 0
        assert s[kind]["after_step"]["0"][1] is None and s[kind]["after_step"]["0"][2] >= 0.5


def _seconds(ms: float) -> float:
    return ms / 1e3


def _blocking_layer(ms: float) -> None:
    import time
    time.sleep(_seconds(ms))  # the line that holds the host, after _seconds returns


def test_line_trace_names_the_line_that_held_the_host():
    """With a LineTrace, the stretch whose work sleeps 8 ms names the sleeping line (the time
    after _seconds returned: the caller's line, by the caller's site), under its point, with its
    source; lines faster than min_ms are not kept, and the thread's tracer is put back at end()."""
    import sys

    from bench.layer_timeline import LayerTimeline
    from bench.line_trace import LineTrace
    before, frame_before = sys.gettrace(), sys._getframe().f_trace
    lines = LineTrace(min_ms=4.0)
    tl = LayerTimeline(torch.device("cpu"), lines=lines)
    for _ in range(2):
        tl.begin(64)
        for i in range(3):
            tl.enter(i)
            tl.leave(i)
            _blocking_layer(8.0 if i == 1 else 0.5)
        tl.end()
    assert sys.gettrace() is before and sys._getframe().f_trace is frame_before
    # the layers' stretches (a loaded machine may also hold begin()'s own setup past min_ms)
    rows = [r for r in lines.summary() if r["stretch"] != "setup"]
    assert len(rows) == 1, rows
    r = rows[0]
    assert r["stretch"] == "1" and r["count"] == 2 and r["after"] == "return"
    assert r["site"].startswith("tests/test_bench_interference.py:") and "time.sleep" in r["code"]
    assert 7.0 <= r["p50_ms"] <= r["max_ms"]
    assert r["cpu_p50_ms"] < 2.0  # asleep: off the CPU


def test_once_per_step_keeps_one_gap_of_the_streams_of_a_step():
    """Two streams of one decode step emit their tokens microseconds apart: their gaps count once;
    a gap of the next step (ending 2 ms later) is kept."""
    gaps = [(0.0100, 0.0250), (0.01002, 0.02504), (0.0250, 0.0270), (0.02504, 0.02703)]
    assert once_per_step(gaps) == [(0.0100, 0.0250), (0.0250, 0.0270)]
    assert once_per_step([]) == []
