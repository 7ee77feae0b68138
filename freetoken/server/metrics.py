"""Prometheus metrics for /metrics (prometheus_client, one registry per server).

The engine thread reports prefill chunks and decode steps; the event loop reports requests
as they end; gauges that mirror the scheduler and the prefix cache are read at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 44, 60, 120, 300, 600)
SPEED_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500)
# a decode step is ~4 ms for a big model on a GPU, tens of ms with experts on the host
STEP_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1, 2, 5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("freetoken_requests", "HTTP requests by API, endpoint and status "
                                "(499: the client closed the connection first)",
                                ["api", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "tokens generated", registry=r)
        self.prefill_tokens = Counter("freetoken_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.prefill_seconds = Counter("freetoken_prefill_seconds", "engine time spent prefilling "
                                       "(prefill_tokens / prefill_seconds: prefill speed)", registry=r)
        self.decode_steps = Histogram("freetoken_decode_step_seconds", "time of one batched decode step, "
                                     "by the number of requests in it", ["batch"], buckets=STEP_BUCKETS, registry=r)
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
        self.engine = Info("freetoken_engine", "what runs where: device, dtype, expert backend, ISA and "
                           "threads, decode path", registry=r)
        self.memory = Gauge("freetoken_memory_plan_bytes", "the memory plan, by part (budget, weights, work, "
                            "state, checkpoints, kv, left)", ["part"], registry=r)
        self.kv = {k: Gauge(f"freetoken_{k}", f"KV pool: {k.replace('_', ' ')}", registry=r)
                   for k in ("kv_pages_total", "kv_pages_used", "kv_pages_high_water")}
        self.experts = Gauge("freetoken_expert_executor", "expert executor counters (calls, routed pairs)",
                             ["counter"], registry=r)
        # the cyclic garbage collector's pauses (runtime/gcwatch.py): a full collection of an
        # unfrozen heap stalls every stream for tens of ms
        self.gc_collections = Gauge("freetoken_gc_collections", "garbage collections by generation",
                                    ["generation"], registry=r)
        self.gc_seconds = Gauge("freetoken_gc_pause_seconds", "seconds spent in garbage collections, by generation",
                                ["generation"], registry=r)
        self.gc_longest = Gauge("freetoken_gc_longest_pause_seconds", "the longest garbage collection pause, "
                                "by generation", ["generation"], registry=r)
        self.gc_frozen = Gauge("freetoken_gc_frozen_objects", "objects frozen out of the collector's walks "
                               "at start-up", registry=r)
        self.serving = None

    def attach(self, serving, describe: dict) -> None:
        """The serving engine whose scheduler and cache the gauges mirror, and what it runs on."""
        self.serving = serving
        plan = describe.get("memory_plan") or {}
        for part in ("budget", "weights", "work", "state", "checkpoints", "kv", "left"):
            if part in plan:
                self.memory.labels(part).set(plan[part])
        self.engine.info({k: "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                          for k, v in describe.items() if not isinstance(v, dict)})

    # engine thread
    def prefill(self, n: int, seconds: float) -> None:
        self.prefill_tokens.inc(n)
        self.prefill_seconds.inc(seconds)

    def decode_step(self, batch: int, seconds: float) -> None:
        self.decode_steps.labels(str(batch)).observe(seconds)

    def finished(self, req) -> None:
        self.finished_by.labels(req.finish_reason or "unknown").inc()

    # event loop
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
            stats = self.serving.stats() if hasattr(self.serving, "stats") else {}
            for k, v in stats.items():
                if k in self.cache_stats:
                    self.cache_stats[k].set(v)
                elif k in self.kv:
                    self.kv[k].set(v)
                elif k.startswith("experts_"):
                    self.experts.labels(k[len("experts_"):]).set(v)
                elif k.startswith("gc_collections_gen"):
                    self.gc_collections.labels(k[-1]).set(v)
                elif k.startswith("gc_seconds_gen"):
                    self.gc_seconds.labels(k[-1]).set(v)
                elif k.startswith("gc_longest_ms_gen"):
                    self.gc_longest.labels(k[-1]).set(v / 1e3)
                elif k == "gc_frozen":
                    self.gc_frozen.set(v)
        return generate_latest(self.registry)
