"""bench/hog.py: the concurrent host-memory hog starts streaming before the measured work and
reports what it moved once stopped; bench.expert_cache's adaptive-vs-fixed summary."""
import time

from bench.hog import MemoryHog


def test_hog_streams_and_reports():
    with MemoryHog(threads=1, mb=64) as h:
        assert h.proc.poll() is None  # running while the caller measures
        time.sleep(0.5)
    assert h.proc.returncode is not None and h.gbs is not None and h.gbs > 0.1


def test_adaptive_split_is_compared_with_the_best_fixed_one_of_its_run():
    from bench.expert_cache import adaptive_vs_fixed
    runs = [dict(mode="fill-only", threads=6, batch=1, tok_s=100.0, fill_share=None),
            dict(mode="split", threads=6, batch=1, tok_s=150.0, fill_share=0.5),
            dict(mode="split", threads=14, batch=1, tok_s=170.0, fill_share=0.3),  # other threads: not a rival
            dict(mode="split", threads=6, batch=1, tok_s=190.0, fill_share=0.5, prefetch=2),  # lookahead: its own rows
            dict(mode="cache", threads=6, batch=1, tok_s=145.0),
            dict(mode="cache", threads=6, batch=1, tok_s=180.0, prefetch=2),
            dict(mode="split", threads=6, batch=1, tok_s=200.0, fill_share=0.4, pieces=4),  # pieces: their own rows
            dict(mode="cache", threads=6, batch=1, tok_s=210.0, pieces=4),
            dict(mode="cache", threads=6, batch=4, error="x")]  # a failed row: no entry
    assert adaptive_vs_fixed(runs) == [
        dict(batch=1, threads=6, prefetch=0, pieces=1, cache_tok_s=145.0, best_fixed="split r=0.5",
             best_fixed_tok_s=150.0, ratio=0.967),
        dict(batch=1, threads=6, prefetch=2, pieces=1, cache_tok_s=180.0, best_fixed="split r=0.5",
             best_fixed_tok_s=190.0, ratio=0.947),
        dict(batch=1, threads=6, prefetch=0, pieces=4, cache_tok_s=210.0, best_fixed="split r=0.4",
             best_fixed_tok_s=200.0, ratio=1.05)]
