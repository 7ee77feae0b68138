"""Prometheus metrics for /metrics (prometheus_client, one registry per server)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 44, 60, 120, 300, 600)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("freetoken_requests", "HTTP requests by API and status", ["api", "status"], registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "tokens generated", registry=r)
        self.prefill_tokens = Counter("freetoken_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "time to first token", buckets=TTFT_BUCKETS, registry=r)
        self.decode_speed = Histogram("freetoken_decode_tokens_per_second", "per-request decode speed",
                                      buckets=SPEED_BUCKETS, registry=r)
        self.queue = Gauge("freetoken_queue_depth", "requests waiting for a decode slot", registry=r)
        self.running = Gauge("freetoken_running_requests", "requests holding a decode slot", registry=r)
        self.finished_by = Counter("freetoken_finished", "finished requests by reason", ["reason"], registry=r)
        self.reused_tokens = Counter("freetoken_prefix_reused_tokens", "prompt tokens restored from the prefix cache",
                                     registry=r)
        self.cache_stats = {k: Gauge(f"freetoken_{k}", f"prefix cache: {k.replace('_', ' ')}", registry=r)
                            for k in ("kv_pages_cached", "kv_pages_free", "kv_pages_evicted", "checkpoints",
                                      "checkpoint_hits", "checkpoint_evictions")}
        self.serving = None

    # engine thread
    def prefill(self, n: int, seconds: float) -> None:
        self.prefill_tokens.inc(n)

    def decode_step(self, batch: int, seconds: float) -> None:
        pass

    def finished(self, req) -> None:
        self.finished_by.labels(req.finish_reason or "unknown").inc()

    # event loop
    def request_started(self) -> None:
        pass

    def request_finished(self, req, now: float) -> None:
        self.prompt_tokens.inc(len(req.prompt_ids))
        self.reused_tokens.inc(req.cached_tokens)
        self.generation_tokens.inc(len(req.output_ids))
        if req.first_token_at is not None:
            self.ttft.observe(req.first_token_at - req.arrival)
            n = len(req.output_ids)
            end = req.finished_at or now
            if n > 1 and end > req.first_token_at:
                self.decode_speed.observe((n - 1) / (end - req.first_token_at))

    def render(self) -> bytes:
        if self.serving is not None:
            st = self.serving.sched.stats()
            self.queue.set(st["waiting"])
            self.running.set(st["running"])
            cache = getattr(self.serving, "cache", None)
            if cache is not None:
                for k, v in cache.stats().items():
                    self.cache_stats[k].set(v)
        return generate_latest(self.registry)


def now() -> float:
    return time.monotonic()
