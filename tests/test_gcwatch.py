"""The garbage collector's pauses (runtime/gcwatch.py): timed per generation without a lock a
collection could deadlock on, the start-up objects frozen out of a serving engine's collections
and given back when the last engine holding the freeze shuts down."""
import gc
import threading
import time

from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.gcwatch import GcWatch
from freetoken.runtime.serving import ServingEngine


def test_watch_times_each_collection_by_generation():
    w = GcWatch.shared()
    before = w.stats()
    t0 = time.perf_counter()
    gc.collect(0)
    gc.collect(2)
    after = w.stats()
    assert after["gc_collections_gen0"] >= before["gc_collections_gen0"] + 1
    assert after["gc_collections_gen2"] >= before["gc_collections_gen2"] + 1
    assert after["gc_seconds_gen2"] > before["gc_seconds_gen2"]
    gens = [g for _, g, _ in w.pauses(t0)]
    assert 0 in gens and 2 in gens[gens.index(0):]  # the two, in order (other threads may add more)
    full = [dt for _, g, dt in w.pauses(t0) if g == 2]
    assert all(dt > 0 for dt in full) and after["gc_longest_ms_gen2"] >= max(full) * 1e3 - 1e-3
    assert w.pauses(t0, t0) == [] or all(p[0] == t0 for p in w.pauses(t0, t0))
    assert GcWatch.shared() is w and gc.callbacks.count(w._callback) == 1  # one callback per process


def test_readers_do_not_deadlock_on_a_collection_they_trigger():
    """A collection runs its callbacks in the thread whose allocation triggered it: a reader of
    the watch (the /metrics scrape) allocating mid-read must not wait on itself."""
    w = GcWatch.shared()
    old = gc.get_threshold()
    gc.set_threshold(1, 10**6, 10**6)  # a young collection at nearly every allocation (no full ones)
    try:
        def read():
            for _ in range(300):
                w.stats()
                w.pauses()
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "a reader of the GC watch hung"
    finally:
        gc.set_threshold(*old)


def test_serving_engines_hold_the_freeze_until_the_last_one_shuts_down():
    base = gc.get_freeze_count()
    eng = Engine(demo_path(), EngineConfig(max_seq_len=256))
    a = ServingEngine(eng, max_batch=2, start=True)
    b = None
    try:
        assert a.gc_frozen > 50_000 and gc.get_freeze_count() > 50_000
        # a full collection now walks only what was made since: far fewer than the frozen heap
        assert len(gc.get_objects()) < a.gc_frozen // 4
        assert abs(a.stats()["gc_frozen"] - gc.get_freeze_count()) < 1000  # (threads free frozen objects)
        b = ServingEngine(eng, max_batch=2, start=True)
        assert b.gc_frozen > 50_000
        b.shutdown()
        assert gc.get_freeze_count() > 50_000  # a still holds it
        again = a.freeze_gc()  # later start-up work (the listening server) frozen too, no new hold
        assert again >= 50_000
    finally:
        if b is not None:
            b.shutdown()
        a.shutdown()
    assert a.gc_frozen == 0 and gc.get_freeze_count() <= base


def test_gc_freeze_can_be_turned_off():
    base = gc.get_freeze_count()
    eng = Engine(demo_path(), EngineConfig(max_seq_len=256))
    srv = ServingEngine(eng, max_batch=2, start=True, gc_freeze=False)
    try:
        assert srv.gc_frozen == 0 and gc.get_freeze_count() == base
    finally:
        srv.shutdown()
