"""bench/step_timeline.py: the device timeline's sums (busy union over streams, gaps attributed to
the activity that ends them), on a hand-built chrome trace and on a real profile of CPU ops."""
import random

from bench.step_timeline import device_events, summarize


def _trace(evs):
    return {"traceEvents": [{"ph": "X", "cat": c, "name": n, "ts": s, "dur": d} for c, n, s, d in evs]
            + [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1000}]}


def test_union_and_gaps_over_streams():
    # two steps: a (0-10), b on another stream overlapping (5-20), gap 20-50, c (50-60); again +100
    evs = []
    for base in (0, 100):
        evs += [("kernel", "a", base, 10), ("gpu_memcpy", "b", base + 5, 15), ("kernel", "c", base + 50, 10)]
    got = summarize(device_events(_trace(evs)), steps=2)
    assert got["wall_us_per_step"] == 80.0  # 0 .. 160 over two steps
    assert got["busy_us_per_step"] == 30.0  # 0-20 and 50-60 each step
    assert got["idle_us_per_step"] == 50.0
    gaps = {g["before"]: g for g in got["gaps"]}
    assert gaps["c"]["us_per_step"] == 30.0 and gaps["c"]["per_step"] == 1.0
    assert gaps["a"]["us_per_step"] == 20.0 and gaps["a"]["per_step"] == 0.5  # 60 -> 100 once in two steps
    names = {r["name"]: r["us_per_step"] for r in got["by_name"]}
    assert names == {"a": 10.0, "b": 15.0, "c": 10.0}


def test_busy_matches_a_brute_force_union():
    rng = random.Random(7)
    evs = [("kernel", f"k{rng.randrange(5)}", rng.uniform(0, 1000), rng.uniform(0.5, 40)) for _ in range(300)]
    got = summarize(device_events(_trace(evs)), steps=1, min_gap_us=0.0)
    covered = set()
    for _, _, s, d in evs:  # 0.01 us grid
        covered.update(range(round(s * 100), round((s + d) * 100)))
    assert abs(got["busy_us_per_step"] - len(covered) / 100) < 1.0
    total_gaps = sum(g["us_per_step"] for g in summarize(device_events(_trace(evs)), 1, top=99, min_gap_us=0.0)["gaps"])
    assert abs(total_gaps - got["idle_us_per_step"]) < 0.5


def test_no_device_activity_says_so():
    assert "error" in summarize(device_events(_trace([])), steps=3)
