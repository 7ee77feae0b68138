"""The garbage collector's pauses (runtime/gcwatch.py): timed per generation, the start-up objects
frozen out of a serving engine's collections and given back at its shutdown."""
import gc
import time

from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.gcwatch import GcWatch
from freetoken.runtime.serving import ServingEngine


def make_cycles(n: int) -> None:
    for _ in range(n):
        a, b = [], []
        a.append(b)
        b.append(a)


def test_watch_times_each_collection_by_generation():
    w = GcWatch.shared()
    before = w.stats()
    t0 = time.perf_counter()
    gc.collect(0)
    gc.collect(2)
    after = w.stats()
    assert after["gc_collections_gen0"] == before["gc_collections_gen0"] + 1
    assert after["gc_collections_gen2"] == before["gc_collections_gen2"] + 1
    assert after["gc_seconds_gen2"] > before["gc_seconds_gen2"]
    pauses = w.pauses(t0)
    assert [g for _, g, _ in pauses] == [0, 2] and all(dt > 0 for _, _, dt in pauses)
    assert after["gc_longest_ms_gen2"] >= pauses[1][2] * 1e3 - 1e-3
    assert GcWatch.shared() is w and gc.callbacks.count(w._callback) == 1  # one callback per process


def test_serving_engine_freezes_startup_objects_and_thaws_them_at_shutdown():
    gc.unfreeze()
    eng = Engine(demo_path(), EngineConfig(max_seq_len=256))
    srv = ServingEngine(eng, max_batch=2, start=True)
    try:
        # (frozen objects freed by their reference count since leave the frozen set)
        assert srv.gc_frozen > 50_000 and srv.gc_frozen - 1000 < gc.get_freeze_count() <= srv.gc_frozen
        # a full collection now walks what was made since, not the frozen heap
        make_cycles(1000)
        t = time.perf_counter()
        gc.collect()
        frozen_s = time.perf_counter() - t
        assert srv.stats()["gc_frozen"] == gc.get_freeze_count()
    finally:
        srv.shutdown()
    assert srv.gc_frozen == 0 and gc.get_freeze_count() == 0
    t = time.perf_counter()
    gc.collect()
    thawed_s = time.perf_counter() - t
    assert frozen_s < thawed_s  # the whole heap walked again


def test_gc_freeze_can_be_turned_off():
    eng = Engine(demo_path(), EngineConfig(max_seq_len=256))
    srv = ServingEngine(eng, max_batch=2, start=True, gc_freeze=False)
    try:
        assert srv.gc_frozen == 0 and gc.get_freeze_count() == 0
    finally:
        srv.shutdown()
