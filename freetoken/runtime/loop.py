"""EngineLoop: one engine step, schedule -> execute -> update, for the server and `ft generate`.

It owns the memory plan, the decode state (one paged KV pool, per-slot recurrent state), the
prefix cache, the scheduler and the decode runner. A step prefills prompt chunks of one or
more requests as one varlen forward, then decodes one token for every running request in one
batched (graph-replayed) forward, then samples, checkpoints and finishes. KV pages are taken
as tokens arrive; when none is left, the latest-arrived request is preempted (its pages freed,
its tokens recomputed when it runs again). A failure is charged to the request it belongs to.
Subclasses deliver tokens (`emit`); ServingEngine adds the thread and the asyncio side.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

import torch

from ..cache.kv import KVSpace, PagesExhausted
from ..cache.config import CacheConfig
from ..errors import FreeTokenError
from ..experts import split_experts
from ..model.state import DecodeState, checkpoint_state_bytes, ring_layers, window_layers
from .budget import idle_step_tokens, plan_memory
from .decode_runner import DecodeRunner
from .gcwatch import GcWatch
from .grammar import GrammarRunner
from .interleave import GAP_CEILING, MIN_PREFILL, TAIL_CYCLES, CostModel, Interleaver, affine_fit
from .overlap import DecodeOverlap, LayerPacer, eligible as overlap_eligible
from .request import Request, TokenEvent
from . import host_wait
from .deferred_step import DeferredStep, HostMark, mark
from .penalties import LogitAdjuster
from .sampler import SamplingParams, greedy_rows, sample, top_entries
from .scheduler import Scheduler

log = logging.getLogger("freetoken.serving")
EMA = 0.2  # weight of the newest step in the decode step-time average


class EngineLoop:
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, metrics=None,
                 cache: CacheConfig | None = None, record_logits: bool = False, page_size: int = 16,
                 kv_tokens: int | None = None):
        """page_size: tokens per KV page (the prefix cache's, when it is on); kv_tokens: the KV
        pool's size (default: --kv-cache-tokens, else what the memory plan leaves)."""
        ecfg, cfg = engine.ecfg, engine.cfg
        self.engine, self.metrics, self.record_logits = engine, metrics, record_logits
        use_cache = cache is not None and cache.enabled
        page_size = cache.page_size if use_cache else page_size
        ring = ring_layers(cfg, engine.max_len, page_size, ecfg.prefill_chunk, ecfg.sliding_kv)
        per_ckpt = checkpoint_state_bytes(cfg, engine.dtype, ring)
        ckpt = cache.checkpoint_slots(per_ckpt) if use_cache and (cfg.linear_layers or ring) else 0
        if use_cache and ring and (not ckpt or cache.checkpoint_policy == "none"):
            log.warning("sliding-window rows are kept in per-slot rings (--sliding-kv window), which the prefix "
                        "cache restores only at checkpoints, and checkpoints are off: no prefix will be reused; "
                        "raise --checkpoint-budget / set --checkpoint-policy, or pass --sliding-kv full")
        ex = engine.executor
        slots = ex if getattr(ex, "pool", 0) is None else None  # a GPU expert cache still to size
        weights = engine.weight_bytes + getattr(engine, "prefill_graph_bytes", 0)  # the prefill graphs' pool too
        reserve = self._pass_reserve(engine)

        def plan_for(work_chunk: int):
            return plan_memory(cfg, engine.device, engine.dtype, engine.budget, weights, max_batch,
                               engine.max_len, ecfg.prefill_chunk, page_size, ckpt,
                               ecfg.kv_cache_tokens if kv_tokens is None else kv_tokens,
                               slots.slot_bytes if slots else 0, slots.num_experts if slots else 0,
                               ecfg.expert_cache, reserve, ecfg.sliding_kv, work_chunk=work_chunk)
        step_tokens = ecfg.max_step_tokens or (2048 if engine.device.type == "cuda" else 512)
        self.plan, self.idle_tokens = self._idle_plan(engine, plan_for, step_tokens)
        if slots is not None:
            slots.allocate(self.plan.expert_slots)
        self.max_len = min(engine.max_len, self.plan.kv_tokens)
        if self.max_len < engine.max_len:
            log.warning("the KV pool holds %d tokens: the context is limited to that (raise --kv-cache-tokens "
                        "or --vram-budget for more)", self.max_len)
        log.info(self.plan.summary())
        self.state = DecodeState(cfg, max_batch, self.max_len, engine.device, engine.dtype,
                                 kv_pages=self.plan.kv_pages, page_size=page_size, chunk=ecfg.prefill_chunk,
                                 ring=ring)
        self.cache = cache.build(engine, self.state, ckpt) if use_cache else None
        self.kv = KVSpace(self.state, self.cache)
        self.decode = self._decode_runner(engine)
        self.mixed = self.decode.path == "eager"  # decode rows and prompt chunks share a forward
        chunk = ecfg.prefill_chunk
        # ---- issue 11: with the experts streamed per pass (--moe cache), a prompt's chunk is a whole
        # pass, and it runs alone (a mixed forward would run its mixers over the pass at once)
        if engine.prefill_stream is not None:
            chunk = engine.prefill_stream.pass_tokens()
            # a whole pass beside every decode row, and never more prompt tokens than one pass
            # (_prefill_budget): the rows' tokens must not shorten it (a 32k prompt beside 2
            # streams had run a 32,766-token pass and a 2-token one, which streamed every
            # layer's routed experts again for 2 tokens; H200, 264ce62)
            step_tokens = max(step_tokens, chunk + max_batch)
            self.mixed = False
            self.idle_tokens = step_tokens
        # ---- end issue 11
        # an idle budget of its own where one was given or auto differs from the step's (0: the step's rules)
        idle = self.idle_tokens if engine.ecfg.idle_step_tokens or self.idle_tokens != step_tokens else 0
        self.sched = Scheduler(max_batch, max_queue, chunk, step_tokens,
                               idle_tokens=0 if engine.prefill_stream is not None else idle)
        self.slowdown = ecfg.decode_slowdown
        # decode steps between a prefill forward's layers: where decode is its own forward
        # (graphs), on the CPU, or on eager CUDA steps with --decode-between-layers on; eager
        # steps otherwise share one forward (self.mixed). Inside a streamed pass too (issue 11), with the expert
        # cache frozen for the pass (experts/cached.py: no fills, misses on the CPU), since the
        # pass's layer buffers are slots of the same pool (experts/stream.py)
        between = ecfg.decode_between_layers
        # auto on the CPU too: a prompt chunk's forward there has a fixed part of a decode step or
        # more (every expert of a layer read, the DeltaNet chunk machinery), so a mixed step holds
        # the streams for it (Qwen3.6 shape, 4 layers, 2-core: p99 36x their unloaded gap mixed,
        # 2.97x interleaved; the demo at 32k: 3.05-3.6x against 2.0-2.21x); eager CUDA (no graphs)
        # stays mixed: there a decode step alone is launch-bound and costs about a mixed one
        wanted = between == "on" or (between == "auto" and engine.device.type == "cpu")
        if wanted and self.mixed and self.slowdown:
            if getattr(engine.model, "per_forward_state", False):
                if between == "on":
                    log.warning("--decode-between-layers on is off: %s keeps a forward's data in state its "
                                "layers share", type(engine.model).__name__)
            else:
                self.mixed = False  # decode rows in a forward of their own, between the prompt's layers
        self.between = Interleaver(self.slowdown if not self.mixed and between != "off" else 0.0)
        self.streamed = engine.prefill_stream is not None
        if self.streamed and self.between.enabled:
            why = self._capture_frozen(engine)
            if why is not None:  # decode between passes only, as before
                log.warning("no decode steps inside streamed prefill passes: %s", why)
                self.between = Interleaver(0.0)
        self.jump_ins = 0  # short prompts prefilled between a prompt forward's layers (_jump_in)
        # or, with --decode-overlap, decode steps alongside the prompt forward (runtime/overlap.py)
        self.overlap = None
        if ecfg.decode_overlap:
            why = overlap_eligible(engine, self.decode)
            if why is None:
                self.overlap = DecodeOverlap(engine.device)
                self.mixed, self.between = False, Interleaver(0.0)  # decode is its own forward
            else:
                log.warning("--decode-overlap is off: %s", why)
        self._decode_s = None  # decode step time (EMA)
        self._costs: deque[tuple[int, float]] = deque(maxlen=32)  # (tokens, seconds) of recent forwards
        self._mixed = CostModel()  # (prompt tokens, seconds beyond a decode step) of mixed forwards
        self._lock = threading.Lock()  # the scheduler's queues are shared with the submitting thread
        # a decode step on the overlap worker and a short prompt jumping in on the loop's thread
        # exclude each other (both restore, take pages, finish requests): _exclusive
        self._step_lock = threading.Lock()
        self._claim = threading.Event()
        self._prompt_forward = False  # a prompt forward is in flight (its checkpoint captures too)
        # a decode step between the prompt's layers whose tokens the next hook reads
        # (runtime/deferred_step.py): on CUDA, where the device would otherwise drain and idle
        self.defer_steps = engine.device.type == "cuda"
        self._deferred: DeferredStep | None = None
        self.deferred_steps = 0  # telemetry
        # a step before a point whose prompt work launches eagerly waits for its tokens instead.
        # Off: on the H200 (plan 47) 2.86/2.35/1.85x against the default's 2.45/2.14/2.04x in the
        # same processes, the prompt at 2,304 tok/s where it held. Why it was tried: most gaps
        # past 2x were the host reaching the hook after a full-attention layer 12-15 ms after the
        # step before it (ab2's first row: 8 of 12). That turned out to be cuBLAS picking a kernel
        # for the forward's new row count inside the layer's first GEMM (~4.6 ms of host CPU;
        # bench/line_trace.py, plans 55-58), fixed by padding the rows (model/linear.py)
        self.wait_before_eager = False
        # a deferred step's launches (its graph, the copies of its picks) on a stream of their
        # own, ordered against the prompt's by events on the device. Tried because the prompt's
        # first eager GEMM after a step held the host 3.6-7 ms on the H200 (plan 55); off: it
        # changed nothing (plan 56: 2.34/1.91x against 2.26/1.82x in one process), the hold was
        # cuBLAS picking a kernel for each new row count (model/linear.py ROW_GRANULE)
        self.step_stream = False
        self._step_stream = None
        self._step_point: float | None = None  # the point a decode step between layers runs before
        # with deferred steps, learn the prompt's point costs from the device's own clock (the
        # previous step's end to this step's start: exactly the points queued between them)
        # instead of host wall time, which launch stalls inflate (benchmarks/README.md, sixteenth
        # session: the costliest point moved and the chunk sizing swung from run to run). On with
        # deferred steps: in three side-by-side pairs on the H200 (plans 38 and 41, 32k prompt) it
        # held a decoding stream's p99 gap at 1.84/1.91/2.03x its unloaded one against 1.99/2.14/
        # 2.12x on host time, for a prompt 10-20% slower.
        self.device_costs = self.defer_steps
        # start_marks: a forward's first cycle timed from a mark at the forward's start (and a
        # step's after a waited step or a jump-in) instead of on the host's clock, which carries
        # the host's work between forwards (the previous forward's sync and sampling, the
        # scheduling), charged mostly to layer 3, the costliest-known point of that cycle
        # (costliest in 28-31 of 37-40 forwards where the chunks collapsed:
        # interference-full-floor{1,2}-gpu.json, plan 44). Off: not shown to help; with it
        # layer 3 stayed the costliest in 10-27 forwards of the first rows and the p99 gap
        # moved by noise only (plan 45: 2.20x mean of six rows against 2.23x in plan 44)
        self.start_marks = False
        self.tail_cycles = TAIL_CYCLES  # a forward's last points learn at its end (Interleaver.tail)
        self._tail_on_host = False  # the host's clock times the points since the last step (one in this forward, waited)
        self._prev_step_end = None  # the last deferred step's end mark in the prompt forward in flight
        self._pacer = None  # the overlapped prompt forward's LayerPacer (CUDA)
        self._side: DeferredStep | None = None  # the polled overlap's decode step in flight
        self._side_last = None  # when the polled overlap launched its last step (perf_counter)
        self._side_off = False  # the polled overlap's steps stopped for the forward in flight (an error)
        # a model that keeps a forward's data in state its layers share cannot run another
        # forward's Python between a forward's layers (a jump-in, an eager decode step)
        self._shared_state = bool(getattr(engine.model, "per_forward_state", False))
        self._layer_kinds = dict(enumerate(getattr(engine.cfg, "layer_types", None) or []))  # i -> its mixer
        self._gens: dict[int, torch.Generator | None] = {}
        # constrained decoding (structured output); builds nothing until a request needs it
        self.grammar = GrammarRunner(engine.tokenizer, cfg.vocab_size, engine.eos_ids, engine.device)

    @staticmethod
    def _idle_plan(engine, plan_for, step_tokens: int):
        """(memory plan, prompt tokens of a step while nothing decodes): --idle-step-tokens, or auto:
        the step budget where --max-step-tokens is given or prompts stream in passes (a pass has its
        own size); on CUDA with the experts in VRAM budget.idle_step_tokens (8192 or 4096 where the
        KV pool can spare the work buffers and no context is shortened); elsewhere the larger of the
        step budget and --prefill-chunk, whose work buffers the plan holds anyway (the CPU: 512-token steps read every expert of every layer four times as often
        as one 2,048-token chunk; short prompts that arrive meanwhile still jump in between its
        layers). The plan's work buffers are sized for the larger of --prefill-chunk and the step."""
        ecfg = engine.ecfg
        streamed = getattr(engine, "prefill_stream", None) is not None
        if ecfg.idle_step_tokens and streamed:
            log.warning("--idle-step-tokens has no effect with --moe cache: prompts prefill in streamed passes")
        elif ecfg.idle_step_tokens:
            idle = ecfg.idle_step_tokens
            return plan_for(max(ecfg.prefill_chunk, idle)), idle
        base = plan_for(ecfg.prefill_chunk)
        if ecfg.max_step_tokens or streamed:
            return base, step_tokens
        if engine.device.type != "cuda" or engine.experts_on != "gpu":
            return base, max(step_tokens, ecfg.prefill_chunk)
        idle, plan = idle_step_tokens(plan_for, base, ecfg.prefill_chunk, step_tokens, context=engine.max_len)
        return plan, idle

    @staticmethod
    def _pass_reserve(engine) -> int:
        """Bytes the plan keeps for a streamed prefill pass (--moe cache on CUDA): a pass of
        up to MAX_PASS_TOKENS (or the context) streams every expert once for that many tokens,
        its experts computed in sub-chunks of EXPERT_SUB tokens."""
        if getattr(engine, "prefill_stream", None) is None or engine.device.type != "cuda":
            return 0
        from .prefill_stream import pass_reserve_bytes
        pieces = getattr(engine.executor, "pieces", 1)  # experts cut into pieces: k x pieces routed pairs a token
        return pass_reserve_bytes(engine.cfg, engine.dtype, engine.max_len, engine.ecfg.prefill_chunk, pieces)

    def _decode_runner(self, engine) -> DecodeRunner:
        ex = engine.executor
        capturable = engine.device.type == "cuda" and (ex is None or ex.capturable)
        self.eager_reason = None
        if engine.device.type != "cuda":
            self.eager_reason = "no CUDA device"
        elif not engine.ecfg.cuda_graphs:
            self.eager_reason = "--no-cuda-graphs"
        elif not capturable:
            self.eager_reason = f"the {ex.backend} expert backend cannot be captured in a graph yet"
            log.warning("decode runs eagerly: %s", self.eager_reason)
        runner = DecodeRunner(engine.model, self.state, engine.ecfg.cuda_graphs and capturable,
                              getattr(ex, "graph_variant", None), getattr(ex, "drop_lookahead", None))
        try:
            runner.capture()
        except FreeTokenError as e:
            if not engine.ecfg.allow_eager:
                raise
            self.eager_reason = str(e)
            log.warning("%s; decoding eagerly (--allow-eager)", e)
        return runner

    def _capture_frozen(self, engine) -> str | None:
        """Decode steps inside a streamed pass, with the expert cache frozen: their graphs are
        captured here, at start-up with the others, never in the middle of a pass. -> None, or
        why they cannot run there: a model that keeps a forward's data in state its layers share
        (DeepSeek-V4's hash routing, GLM's shared indexer) cannot run a decode forward's Python
        between a pass's layers, so it needs the graphs; a cache on CUDA without the
        stream-ordered CPU branch would sync once per layer in every such step (every miss runs
        on the CPU) and its frozen graph cannot be captured."""
        ex = engine.executor
        shared = getattr(engine.model, "per_forward_state", False)
        if engine.device.type == "cuda" and getattr(ex, "host", None) is None:
            return "the expert cache has no stream-ordered CPU branch here (the C++ executor's host node)"
        if self.decode.path != "cuda-graphs":
            return f"{type(engine.model).__name__} needs decode graphs for it" if shared else None
        with ex.frozen():
            if self.decode.replays(1):  # the variant is one serving already captured
                return None
            try:
                self.decode.capture()
            except Exception as e:  # noqa: BLE001 - the frozen variant only: decode elsewhere keeps its graphs
                return f"its decode graph could not be captured ({type(e).__name__}: {e})"
        return None

    def describe(self) -> dict:
        """Engine.describe() plus the loop's own choices, for the banner, /health, /metrics."""
        return {**self.engine.describe(), "context": self.max_len, "decode_path": self.decode.path,
                "eager_reason": self.eager_reason, "max_batch": self.state.slots,
                "max_step_tokens": self.sched.step_tokens, "idle_step_tokens": self.sched.idle_tokens,
                "prefix_cache": self.cache is not None,
                "decode_between_layers": self.between.enabled, "decode_overlap": self.overlap is not None,
                "memory_plan": self.plan.to_dict(),
                # sliding-window layers: in per-slot rings of ring_pages pages, or in the pool
                "sliding_kv": ("window" if self.state.ring else "full") if window_layers(self.engine.cfg) else "none",
                "ring_layers": len(self.state.ring), "ring_pages": self.state.ring_len}

    def stats(self) -> dict:
        out = {**self.kv.stats(), **(self.cache.stats() if self.cache is not None else {}),
               "decode_steps_between_layers": self.between.steps,
               "decode_steps_deferred": self.deferred_steps,  # of those, read a hook later (CUDA)
               "prompts_between_layers": self.jump_ins,
               "decode_steps_alongside_prompts": self.overlap.steps if self.overlap is not None else 0}
        ex = self.engine.executor
        ps = self.engine.prefill_stream  # issue 11: passes by buffering, experts copied / in place / skipped
        if ps is not None:
            out.update({f"experts_prefill_{k}": v for k, v in ps.stats().items() if isinstance(v, (int, float))})
        # numbers only: /metrics exports each as a gauge (the executor's labels, such as how
        # it transfers, are in describe() and /health)
        ex_stats = ex.stats() if ex is not None else {}
        out.update(GcWatch.shared().stats())  # the collector's pauses (runtime/gcwatch.py)
        return {**out, **{f"experts_{k}": v for k, v in ex_stats.items() if isinstance(v, (int, float))}}

    # ---- hooks ------------------------------------------------------------------------------
    def emit(self, req: Request, ev: TokenEvent) -> None:
        """Deliver a token event (the server streams it; generate() reads the request)."""

    def run_to_completion(self, req: Request) -> Request:
        """Drive steps in this thread until `req` finishes (ft generate)."""
        s = req.sampling
        self._gens[req.id] = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        with self._lock:
            self.sched.add(req)
        while req.finished_at is None:
            self.step()
        return req

    # ---- the step -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step: schedule, execute, update. False if there was nothing to do.

        With graphs, and on the CPU by default, decode is its own forward and prompt chunks a
        varlen forward beside it, decode steps between its layers; eager CUDA (or the CPU with
        --decode-between-layers off) runs both through one forward, so the layers' fixed cost
        (the experts above all) is paid once."""
        with self._lock:
            batch = self.sched.schedule(self._prefill_budget(), short_whole=self.between.enabled)
        if batch.empty():
            return False
        for req in batch.cancelled:
            self._finish(req, req.finish_reason or "cancelled")
        groups = self._prepare_prefill([(r, s, e) for r, s, e in batch.prefill if r.finished_at is None])
        decode = self._prepare_decode([r for r in batch.decode if r.finished_at is None and r.slot is not None])
        groups = [g for g in groups if all(r.restored and r.slot is not None for r, _, _ in g)]  # not preempted since
        if decode and groups and self.mixed and not groups[0][0][0].solo:
            self._run(groups[0], decode)
            groups, decode = groups[1:], []
        for group in groups:
            self._run(group, [])
        if decode and groups and (self.between.steps or self.overlap is not None):  # rows may have decoded
            # (or finished) between the layers or alongside the prompt forward
            decode = self._prepare_decode([r for r in decode if r.finished_at is None and r.slot is not None])
        if decode:
            self._run([], decode)
        return True

    def _prefill_budget(self) -> int | None:
        """While streams decode, prompt tokens that keep a step within `slowdown` times a plain
        decode step; None: no limit beyond the scheduler's budget.

        One forward (mixed): decode rows and prompt tokens share the forward's fixed part
        (weights read once, launches), so a mixed step costs a plain decode step plus a part
        per prompt token, read from the latest mixed steps (it grows with the context:
        attention reads every earlier token). A fit of a fixed part from whole forwards read
        the context's growth as a fixed part and kept 512-token chunks at 32k context (a
        decoding stream's p99 gap 12x its unloaded one on the 2-core CPU).
        A prefill forward of its own after the decode step: a fixed part plus a part per token
        fitted to the recent forwards (a rate alone would read the fixed part of small chunks
        as slowness and shrink the budget to nothing)."""
        if self.streamed:  # a pass streams every expert once whatever its size: one whole pass, its
            return self.sched.chunk  # streams decoding between its layers (a latency budget would make 32-token passes)
        rows = sum(not r.prefilling for r in self.sched.running.values())
        if not rows or self.overlap is not None:  # overlapped: streams decode while the prompt runs
            return None
        if self.between.enabled:  # streams decode between the layers: a chunk one layer of which fits the gap
            points = len(self.engine.model.layers) * (2 if self.between.mid_layer else 1)
            return self.between.budget(self._decode_s, self._costs, points, self._graph_cap())
        if not self.slowdown or self._decode_s is None:
            return None
        if self.mixed:  # the prompt's share of a mixed step: its time less a plain decode step's
            if not self._mixed:
                return None
            return self._mixed.tokens_within((self.slowdown - 1) * self._decode_s,
                                             (max(self.slowdown, GAP_CEILING) - 1) * self._decode_s,
                                             grow=False)  # an eager mixed step: no headroom rule (interleave.HEADROOM)
        if len(self._costs) < 2:
            return None
        fixed, per_token = affine_fit(self._costs)
        room = (self.slowdown - 1) * self._decode_s - fixed
        # never below the chunk that costs as much as the fixed part: the prompt keeps at least
        # half its speed, and decoding streams wait at most about twice a fixed part
        floor = max(MIN_PREFILL, int(fixed / per_token))
        return max(floor, int(room / per_token) if room > 0 else 0)

    def _graph_cap(self) -> int | None:
        """The largest prompt chunk the prefill graphs take (past it a layer runs eagerly, several
        times dearer), or None without them."""
        graphs = getattr(self.engine, "prefill_graphs", None)
        return graphs.buckets[-1] if graphs is not None and graphs.enabled else None

    # ---- before the forward ---------------------------------------------------------------------
    def _prepare_prefill(self, items: list[tuple[Request, int, int]]) -> list[list[tuple[Request, int, int]]]:
        """Restore and give pages; -> forward groups: every chunk in one varlen group, except
        requests that failed inside a shared forward before, which run alone (so a fault is
        charged to its request)."""
        ready = []
        for req, start, end in items:
            with self._setup_guard(req):
                start, end = self._restore(req, start, end)
                if self._room(req, end):
                    ready.append((req, start, end))
        # prompts that finish in this step in a forward of their own first: where a forward's fixed
        # cost is small (CUDA); on the CPU every forward reads most of each layer's experts whatever
        # its tokens, so a second forward for the rest of the step's chunks would cost that again
        first = (self.between.enabled and self.engine.device.type != "cpu") or self.overlap is not None
        return self._groups(ready, first_tokens_first=first)

    @staticmethod
    def _groups(ready: list[tuple[Request, int, int]],
                first_tokens_first: bool = False) -> list[list[tuple[Request, int, int]]]:
        """first_tokens_first: prompts that finish in this step run in a forward of their own
        before the other chunks, so their first token does not wait for a long prompt's chunk
        (with decode steps between a forward's layers, the chunk's forward holds them anyway;
        in one mixed forward the split would add a forward the decode rows wait for)."""
        shared = [it for it in ready if not it[0].solo]
        groups = [shared] if shared else []
        if first_tokens_first and shared:
            done = [it for it in shared if it[2] == it[0].prefill_end]
            rest = [it for it in shared if it[2] != it[0].prefill_end]
            groups = [done, rest] if done and rest else groups
        return groups + [[it] for it in ready if it[0].solo]

    def _restore(self, req: Request, start: int, end: int) -> tuple[int, int]:
        """A request's first chunk: what the prefix cache holds of it is restored (the chunk
        then starts after it, as long); -> the chunk's (start, end)."""
        if req.restored:
            return start, end
        n = end - start
        req.restored = True
        req.computed = self.kv.restore(req)
        if not req.preemptions:
            req.cached_tokens = req.computed
        return req.computed, min(req.prefill_end, req.computed + n)

    @contextlib.contextmanager
    def _setup_guard(self, req: Request):
        """A request whose set-up fails ends with an error; the step goes on without it."""
        try:
            yield
        except FreeTokenError as e:  # the request's own fault (past the context): one line
            log.warning("request %s: %s", req.id, e)
            self._finish(req, "error", error=str(e))
        except Exception as e:  # noqa: BLE001
            log.exception("prefill set-up failed for request %s", req.id)
            self._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def _prepare_decode(self, reqs: list[Request]) -> list[Request]:
        for req in list(reqs):  # a page for each row's next position
            if req.slot is None or not self._room(req, req.computed + 1):
                reqs.remove(req)
        return [r for r in reqs if r.slot is not None and r.finished_at is None]

    # ---- the forward and what follows -------------------------------------------------------------
    def _run(self, group: list[tuple[Request, int, int]], decode: list[Request]) -> None:
        """One forward: prompt chunks (`group`), decode rows, or both. A failure of a forward
        that holds one prompt chunk alone fails that request; of decode rows alone, those rows;
        otherwise every request in it starts over alone (its state may be half updated)."""
        captures = []
        try:
            self._forward(group, decode, captures)
        except Exception as e:  # noqa: BLE001
            for c in captures:
                if c is not None:
                    c.abort()
            reqs = [r for r, _, _ in group] + decode
            if len(group) + bool(decode) == 1 and (decode or len(group) == 1):
                log.exception("engine step failed for request(s) %s", [r.id for r in reqs])
                self._fail(reqs, e)
                return
            log.warning("a shared forward failed (%s: %s); its requests start over, each alone",
                        type(e).__name__, e)
            for r in reqs:
                if r.finished_at is None:
                    self._rewind(r)
                    r.solo = True

    def _forward(self, group, decode, captures) -> None:
        eng, t0 = self.engine, time.perf_counter()
        segs = []
        for req, start, end in group:
            if req.sampling.grammar is not None and req.grammar is None:
                self.grammar.begin(req)  # compiled on the grammar worker while this forward runs
            toks = req.tokens(0, req.prefill_end)
            cuts = self.cache.positions(toks, start, end) if self.cache is not None else []
            # checkpoints inside the chunk are taken by the DeltaNet layers in the same pass
            # inside a prompt forward (a jump-in): no eviction, its capture may hold the slot
            capture = self.cache.capture(toks, cuts, evict=not self._prompt_forward) if cuts else None
            captures.append(capture)
            segs.append((toks[start:end], req.slot, start, capture, end == req.prefill_end))
        rows = (tokens, pos, active) = self._decode_rows(decode) if decode else ([], [], [])
        if decode and group:
            dec_logits, pre_logits = eng.forward_mixed(self.state, *rows, segs)
        elif decode:
            defer = self._defer(decode)  # between a prompt's layers: its tokens at the next hook
            with self._on_step_stream(defer):
                start = mark(eng.device) if defer and self.device_costs else None
                dec_logits, pre_logits = self.decode(tokens, pos, active), None  # [>= n, V] on the device
                if defer:
                    self._deferred = DeferredStep.launch(decode, dec_logits, t0, start, blocking=eng.host_wait_blocks)
                    self.deferred_steps += 1
            if defer:
                return
        else:  # [finishing, V] or None; decode steps (and short prompts) may run between its layers
            nested = self.between.running  # a short prompt prefilling between another forward's layers
            if not nested:
                self.between.tokens = sum(e - s for _, s, e in group)
                self.between.kinds = self._layer_kinds  # for its stall filter (interleave.STALL_FILTER)
                self.between.cap = self._graph_cap()  # which layer costs it is judged at (graphed or eager)
                self.between.first_tokens = all(e == r.prefill_end <= self.sched.step_tokens for r, _, e in group)
            kw = {"between": self._between_layers} if self.between.enabled and not nested else {}
            if kw and not self.streamed:  # between each layer's halves too, if asked (runtime/interleave.py MID_LAYER)
                # and between the key pieces of a long context's attention (interleave.KEY_POINTS; the CPU)
                # while streams decode: a forward with none runs its layers whole (jump-ins and
                # streams that start meanwhile get the layer points), as Engine.generate does
                kw["key_points"] = self.between.key_points and eng.device.type == "cpu" and self._decoding()
                kw["mid_layer"] = self.between.mid_layer or (kw["key_points"] and self._splits_experts())
            self._prompt_forward = True
            if not nested:
                self._prev_step_end, self._tail_on_host = self._work_mark(), False
            try:
                if self.overlap is not None and not nested:
                    dec_logits, pre_logits = None, self._prefill_alongside(segs)
                else:
                    if not nested:  # a short prompt's forward inside this one keeps its points' costs so far
                        self.between.this_forward = {}
                    dec_logits, pre_logits = None, eng.prefill_batch(self.state, segs, **kw)
                    self._complete_deferred()  # a step after the last layer's hook
                    if kw:
                        if self.tail_cycles:
                            self._close_tail()
                        self.between.forward_done()
            finally:
                self._complete_deferred()  # a forward that failed: the step's rows still get their tokens
                self._prompt_forward = nested
        if decode and eng.host_wait_blocks:  # asleep until the step is done, off the CPU branch's cores
            host_wait.wait(eng.device, True)
        # greedy rows are decided on the device: only the others copy their logits over
        # (constrained rows are masked first, on the device)
        picks, norms = self._device_picks(decode, dec_logits, [r.slot for r in decode]) if decode else ({}, None)
        host = dec_logits.cpu() if decode and (self.record_logits or len(picks) < len(decode)) else None
        worker = self.overlap is not None and self.overlap.in_worker
        if worker:
            self.overlap.sync()  # its own stream: a device-wide sync would wait for the prompt too
        elif self.between.running and decode and eng.device.type == "cuda":
            # this stream only: inside a streamed pass the copy stream is loading the next
            # layer's experts, which this step does not wait for
            torch.cuda.current_stream(eng.device).synchronize()
        else:
            eng.sync()
        dt, n_pre = time.perf_counter() - t0, sum(e - s for _, s, e in group)
        if decode:
            # a step between layers waited for them too; one alongside a prompt shared the device
            if not group and not self.between.running and not worker:
                self._decode_s = dt if self._decode_s is None else (1 - EMA) * self._decode_s + EMA * dt
                observe = getattr(eng.executor, "observe_step", None)
                if observe is not None:  # the expert cache's adaptive split learns from real steps
                    observe(len(decode), dt)
                self.between.decoded()
            else:  # a failed CPU branch fails this step's rows here, before their tokens go out
                check = getattr(eng.executor, "check_branch", None)
                if check is not None:
                    check()
            if self.metrics:
                self.metrics.decode_step(len(decode), dt)
        if group:
            if self.metrics:
                self.metrics.prefill(n_pre, dt)
        if group or self.mixed:  # the cost model of forwards that carry prompt tokens
            self._costs.append((n_pre + len(tokens), dt))
        if group and decode and self._decode_s is not None:
            self._mixed.add(n_pre, max(dt - self._decode_s, 0.0))
        for r in decode:
            r.computed += 1
            self._guarded([r], self._accept, r, host[r.slot] if host is not None else None, picks.get(r.id),
                          _norm(norms, r, picks))
        row = 0
        for req, _, end in group:
            req.computed = end
            if end == req.prefill_end:  # the prompt is in: its last logits give the first token
                lg = pre_logits[row:row + 1]  # [1, V]
                row += 1
                pk, nm = self._device_picks([req], lg, [0])
                self._guarded([req], self._accept, req,
                              lg[0].cpu() if self.record_logits or req.id not in pk else None, pk.get(req.id),
                              _norm(nm, req, pk))
        # constrained requests: their next masks are computed on the grammar worker while the
        # engine goes on to the next forward (joined just before that forward's sampling)
        cons = [r for r in decode if r.grammar is not None] + \
            [r for r, _, end in group if r.grammar is not None and end == r.prefill_end]
        if cons:
            self.grammar.prefetch(cons)

    def _jump_in(self, exclusive=None) -> None:
        """Requests that arrived while a prompt forward runs and whose whole prompt fits one
        step's budget prefill right here, between its layers, and get their first token now
        instead of after the whole forward (a 2,048-token chunk at 32k context; on the H200 a
        short request waited 2.2 s, 19x its idle TTFT, behind an interleaved 32k prompt). They
        take pages only where the pool has them free (a preemption could pick the prompt in
        flight): otherwise they go back to the queue's head for a later step. exclusive: a
        context manager held around the work once something was admitted (the overlap
        worker's decode steps pause for it). Not for models that keep a forward's data in
        state their layers share (the long forward would resume on the short one's)."""
        if not self.sched.waiting or self._shared_state:  # read without the lock: a request added
            return  # meanwhile waits a layer
        with self._lock:
            items = self.sched.admit_whole(self.sched.step_tokens)
        if not items:
            return
        with exclusive if exclusive is not None else contextlib.nullcontext():
            self._jump_in_admitted(items)

    def _jump_in_admitted(self, items) -> None:
        ready = []
        for req, start, end in items:
            with self._setup_guard(req):
                try:
                    start, end = self._restore(req, start, end)
                    self.kv.grow(req, end)
                    ready.append((req, start, end))
                except PagesExhausted:
                    self._rewind(req)
                    with self._lock:
                        self.sched.preempt(req)  # its slot back, first in the queue
        if not ready:
            return
        self.between.running = True  # no decode steps, no hook inside it
        try:
            for group in self._groups(ready):
                self._run(group, [])
        finally:
            self.between.running = False
        self.jump_ins += len(ready)
        # its time is not the queued layers' cost: the next cycle measures afresh
        self.between.decoded()
        self._prev_step_end = self._work_mark()  # nor, on the device's clock, the next step's points

    def _splits_experts(self) -> bool:
        """Whether this engine's prompt chunks run their routed experts in pieces (experts/
        split_experts.py); with them a point between each layer's mixer and its MoE block too
        (i + 0.5, as MID_LAYER gives): else a layer's mixer and its first piece are one stretch,
        at the Qwen3.6 shape on the 2-core dev machine 130-290 ms where the learned costs of expert points were 14-15 ms
        (benchmarks/results/interference-2k-fullshape-4l-f32-cpu.json)."""
        fn = getattr(self.engine.executor, "splits", None)
        return split_experts.ENABLED and fn is not None and fn(getattr(self.engine.cfg, "num_experts", 0) or 0)

    def _between_layers(self, i: float) -> None:
        """The prefill forward's hook before layer i (or at i + 0.5, between layer i's mixer and
        its MLP: runtime/interleave.py MID_LAYER; or before a key piece of its attention on the
        CPU, kernels/split_keys.py): short requests that arrived meanwhile
        prefill whole (_jump_in); a decode step for the streams that are decoding, when one is
        due (runtime/interleave.py). Rows that need a KV page the pool cannot give without
        preempting wait for the step's own decode."""
        if self.between.running:
            return
        self._complete_deferred()  # the previous hook's decode step: its tokens out
        if not self.streamed:  # a short prompt inside a streamed pass would be a pass inside a pass
            self._jump_in()
        if self.between.due(self._decode_s, i):
            rows = self._step_rows()
            if rows and self._shared_state and not self.decode.replays(rows[-1].slot + 1):
                rows = []  # an eager decode forward would overwrite the state the prompt's layers share
            if rows:
                self.between.running, self._step_point = True, i
                try:
                    self._run([], rows)
                finally:
                    self.between.running, self._step_point = False, None
                if self._deferred is None:  # a step that waited (not deferrable): timed on the host's clock,
                    self.between.cycle(self._decode_s)
                    self._tail_on_host = True
                    # the next deferred step's span starts here: the host has just waited for the
                    # device, so a mark is exact (with wait_before_eager most steps are such)
                    self._prev_step_end = mark(self.engine.device) if self.device_costs else None
                else:  # its cycle ends when its tokens are read: the points queued so far are its
                    self._deferred.queued, self.between.queued = self.between.queued, []
        self.between.layer_queued(i)

    def _close_tail(self) -> None:
        """The interleaved forward's points after its last decode step learn their costs
        (Interleaver.tail): on the device's clock from that step's end mark (waiting for the
        forward's end, which the loop does next anyway), else on the host's where the last step
        waited inside this forward and each op runs as it is called (the CPU); not where neither
        clock times them (a forward without a step: the host's time since the last decode step
        can hold idle time and earlier forwards)."""
        if not self.between.queued:
            return
        if self._prev_step_end is not None:
            end = mark(self.engine.device)
            end.synchronize()
            self.between.tail(self._prev_step_end.elapsed_time(end) / 1e3)
        elif self._tail_on_host and self.engine.device.type != "cuda":
            self.between.tail()

    def _work_mark(self):
        """Where the next deferred step's span of prompt work starts (device_costs with
        start_marks), else None (that span then falls back to the host's clock)."""
        return mark(self.engine.device) if self.device_costs and self.start_marks else None

    def _defer(self, decode: list[Request]) -> bool:
        """Whether this decode step's tokens can wait for the next hook: one between a prompt
        forward's layers (not inside a streamed pass or on the overlap worker) of rows that need
        nothing from the host before their picks (runtime/deferred_step.py), and with
        wait_before_eager not before a point whose prompt work launches eagerly."""
        if self.wait_before_eager and self._step_point is not None and self._eager_point(self._step_point):
            return False
        return (self.defer_steps and self.between.running and self._prompt_forward and not self.streamed
                and self.overlap is None and DeferredStep.eligible(decode, self.record_logits))

    @contextlib.contextmanager
    def _on_step_stream(self, defer: bool):
        """A deferred step between layers on its own stream (step_stream), in the prompt's
        order all the same: it waits for the layers queued before it and the layers after it
        wait for it, both on the device. Nothing otherwise."""
        if not (defer and self.step_stream and self.engine.device.type == "cuda"):
            yield
            return
        if self._step_stream is None:
            self._step_stream = torch.cuda.Stream(self.engine.device)
        cur = torch.cuda.current_stream(self.engine.device)
        self._step_stream.wait_stream(cur)
        try:
            with torch.cuda.stream(self._step_stream):
                yield
        finally:
            cur.wait_stream(self._step_stream)

    def _eager_point(self, i: float) -> bool:
        """Whether point i's prompt work in the forward in flight launches eagerly: the whole
        forward past the prefill graphs' cap (or without them), else the part of layer i they
        do not take (a full-attention mixer; with MID_LAYER, i + 0.5 is the MLP alone). Key
        pieces' points (kernels/split_keys.py) exist on the CPU only, where nothing is graphed."""
        graphs = getattr(self.engine, "prefill_graphs", None)
        if graphs is None or not graphs.enabled or not self.between.graphed:
            return True
        if i != int(i):
            return "moe" not in graphs.blocks
        mixer = "deltanet" if self._layer_kinds.get(int(i)) == "linear_attention" else "attention"
        # with MID_LAYER the point is the mixer alone (its MLP is point i + 0.5)
        return mixer not in graphs.blocks or ("moe" not in graphs.blocks and not self.between.mid_layer)

    def _complete_deferred(self) -> None:
        """Wait for the deferred decode step's tokens (not for the layers queued after it), emit
        them and close its interleaver cycle. A failure fails its rows, as a decode step's does."""
        d, self._deferred = self._deferred, None
        if d is None:
            return
        if not self._emit_step(d):
            self._prev_step_end, self._tail_on_host = None, False
            self.between.cycle(self._decode_s, d.queued)
            return
        work, until, self._tail_on_host = None, None, False
        if d.start is not None and self._prev_step_end is not None:  # device_costs: the device's clock
            work = self._prev_step_end.elapsed_time(d.start) / 1e3
        elif isinstance(d.start, HostMark):
            # the forward's first step, on a device that runs each op as it is called (the CPU): the
            # host's clock up to the step's start. Up to now (the cycle's default) would also count
            # the layers run since the step, which the next cycle learns again from the step's end
            # mark: one stretch twice (test_tail_cycles_teach_the_points_after_a_forwards_last_step)
            until = d.start.t
        self._prev_step_end = d.event if d.start is not None else None
        self.between.cycle(self._decode_s, d.queued, work, until)

    def _emit_step(self, d: DeferredStep) -> bool:
        """Wait for a deferred decode step's tokens and emit them; False if it failed (its
        rows failed, as a decode step's are)."""
        try:
            picks, host = d.wait()
            check = getattr(self.engine.executor, "check_branch", None)
            if check is not None:
                check()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed for request(s) %s", [r.id for r in d.reqs])
            self._fail(d.reqs, e)
            return False
        if self.metrics:
            self.metrics.decode_step(len(d.reqs), time.perf_counter() - d.t0)
        for r in d.reqs:
            r.computed += 1
            self._guarded([r], self._accept, r, host[r.slot] if host is not None else None, picks.get(r.id), None)
        return True

    def _prefill_alongside(self, segs):
        """The prompt forward with the decoding streams stepping on the worker meanwhile, until
        the prompt's work is done on the device (runtime/overlap.py); requests that finished
        on the worker are finished here, after it."""
        ov = self.overlap
        if ov.polled:
            return self._prefill_polled(segs)
        # on CUDA the hooks must come as the device reaches each layer, not as the host queues it
        self._pacer = LayerPacer(self.engine.device) if self.engine.device.type == "cuda" else None
        try:
            with ov.alongside(self._overlap_step):
                logits = self.engine.prefill_batch(self.state, segs, between=self._alongside_layers)
                if self.engine.device.type == "cuda":
                    torch.cuda.current_stream(self.engine.device).synchronize()  # this stream only
        finally:
            done, ov.deferred = ov.deferred, []
            for args in done:
                self._finish(*args)
        return logits

    def _prefill_polled(self, segs):
        """The prompt forward with the decoding streams stepping on the high-priority stream,
        launched and emitted from this thread (DecodeOverlap.POLLED): at each layer's hook and
        while LayerPacer holds the host two layers ahead of the device, then until the
        forward's work is done. Requests that finished in a step are finished after it."""
        ov, dev = self.overlap, self.engine.device
        cuda = dev.type == "cuda"
        self._pacer = LayerPacer(dev, idle=self._side_poll) if cuda else None
        if ov.stream is not None:
            ov.stream.wait_stream(torch.cuda.current_stream(dev))  # what came before
        self._side_last, self._side_off = None, False
        try:
            logits = self.engine.prefill_batch(self.state, segs, between=self._alongside_layers)
            if cuda:  # the forward's last layers and logits: the streams keep stepping meanwhile
                end = torch.cuda.Event()
                end.record(torch.cuda.current_stream(dev))
                self._pacer.wait(end)
        finally:
            try:
                self._side_drain()
                if ov.stream is not None:
                    torch.cuda.current_stream(dev).wait_stream(ov.stream)  # what comes after
            finally:  # whatever failed above: the requests that finished in a step still finish
                done, ov.deferred = ov.deferred, []
                for args in done:
                    self._finish(*args)
        return logits

    def _side_poll(self) -> None:
        """The polled overlap: emit the step in flight once the device has run it; launch the
        next when the last launched at least --decode-slowdown plain decode steps ago (back
        to back with --decode-slowdown 0). Each step runs as the worker's would (as_worker).
        An unexpected error stops the steps for the rest of the forward (the streams decode
        after it, as after a failed worker) instead of failing the prompt forward it runs in."""
        if self._side_off:
            return
        try:
            self._side_poll_once()
        except Exception:  # noqa: BLE001 - not the prompt's fault: it is not failed for it
            log.exception("a decode step alongside a prompt forward failed; the streams decode after it")
            self.overlap.failures += 1
            self._side_off, self._side = True, None
            self.overlap.sync()  # what it launched, before the next step rewrites its inputs

    def _side_poll_once(self) -> None:
        ov = self.overlap
        d = self._side
        if d is not None:
            if not d.event.query():
                return
            self._side = None
            with ov.as_worker():
                self._emit_step(d)
        now = time.perf_counter()
        gap = self.slowdown * self._decode_s if self.slowdown and self._decode_s is not None else 0.0
        if self._side_last is not None and now - self._side_last < gap:
            return
        with ov.as_worker():  # the rows' new pages and their block-table rows on the step's stream
            rows = self._step_rows(held={id(r) for r, _, _ in ov.deferred})
            if not rows:
                return
            self._side_last = now
            ov.steps += 1
            if not DeferredStep.eligible(rows, self.record_logits):
                self._run([], rows)  # rows the host must see first (grammar masks): it waits for its stream
                return
            try:
                logits = self.decode(*self._decode_rows(rows))  # [>= n, V] on the device
                self._side = DeferredStep.launch(rows, logits, now, blocking=self.engine.host_wait_blocks)
            except Exception as e:  # noqa: BLE001 - the rows fail, as a decode step's do
                log.exception("engine step failed for request(s) %s", [r.id for r in rows])
                ov.sync()  # a step replayed before the failure: done before the next rewrites its inputs
                self._fail(rows, e)

    def _side_drain(self) -> None:
        """The polled overlap's step in flight, emitted (the prompt forward's end or failure)."""
        d, self._side = self._side, None
        if d is not None:
            with self.overlap.as_worker():
                self._emit_step(d)

    def _alongside_layers(self, i: int) -> None:
        """The overlapped prompt forward's hook before layer i: short requests that arrived
        meanwhile prefill whole here (_jump_in; on the H200 a short request waited 7.7 s, 73x
        its idle TTFT, behind an overlapped 32k prompt). The worker's decode steps pause for
        it: the jump-in restores, takes pages and finishes requests, which the worker's steps
        must not do at the same time (_exclusive)."""
        if self._pacer is not None and not self.between.running:
            self._pacer.before_layer()
        if self.overlap.polled and not self.between.running:
            self._side_poll()
        if self.sched.waiting and not self.between.running:  # read without the locks: every layer
            self._jump_in(self._exclusive())

    @contextlib.contextmanager
    def _exclusive(self):
        """The loop's thread, with the overlap worker held between two of its decode steps. The
        worker waits while a claim is pending (threading.Lock is not fair: released and taken
        again in a loop, it could keep the loop's thread out for good); afterwards the worker's
        stream waits for what this thread queued (the checkpoint copies of a new row's state)."""
        self._claim.set()
        try:
            with self._step_lock:
                yield
                if self.overlap is not None and self.overlap.stream is not None:
                    self.overlap.stream.wait_stream(torch.cuda.current_stream(self.engine.device))
        finally:
            self._claim.clear()

    def _overlap_step(self) -> bool:
        """On the worker: one decode step of the streams decoding now (False: none)."""
        while self._claim.is_set():
            time.sleep(0.0002)  # the loop's thread is jumping a short prompt in
        with self._step_lock:
            return self._overlap_step_locked()

    def _overlap_step_locked(self) -> bool:
        rows = self._step_rows(held={id(r) for r, _, _ in self.overlap.deferred})
        if not rows:
            return False
        self._run([], rows)
        return True

    @staticmethod
    def _decodes(r: Request) -> bool:
        """Whether a running request is a stream a decode step takes: past its prompt, live."""
        return not r.prefilling and not r.cancelled and r.finished_at is None and r.slot is not None

    def _decoding(self) -> bool:
        """Whether any running request is a decoding stream."""
        with self._lock:
            return any(self._decodes(r) for r in self.sched.running.values())

    def _step_rows(self, held=()) -> list[Request]:
        """The requests a decode step between or alongside a prompt's layers takes, in slot
        order: those decoding (not `held`: finished on the overlap, awaiting the forward's end)
        whose next position has a page at hand (no preemption mid-forward)."""
        with self._lock:
            rows = [r for r in self.sched.running.values() if self._decodes(r) and id(r) not in held]
        return sorted((r for r in rows if self._grow_now(r)), key=lambda r: r.slot)

    def _grow_now(self, req: Request) -> bool:
        try:
            self.kv.grow(req, req.computed + 1)
            return True
        except PagesExhausted:
            return False

    def _decode_rows(self, reqs: list[Request]):
        n = max(r.slot for r in reqs) + 1  # rows [0, n): the decoding slots and any holes
        tokens, pos, active = [0] * n, [0] * n, [False] * n  # idle or mid-prefill rows keep their state
        for r in reqs:
            tokens[r.slot], pos[r.slot], active[r.slot] = r.output_ids[-1], r.computed, True
        return tokens, pos, active

    def _guarded(self, reqs: list[Request], fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # a bug: fail these requests, keep serving
            log.exception("engine step failed for request(s) %s", [r.id for r in reqs])
            self._fail(reqs, e)

    def _fail(self, reqs: list[Request], e: BaseException) -> None:
        """Finish with the error each of these requests not finished yet."""
        for req in reqs:
            if req.finished_at is None:
                self._finish(req, "error", error=f"{type(e).__name__}: {e}")

    def _device_picks(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]):
        """Greedy rows are decided where the logits are; only the others copy theirs over.
        Constrained rows are masked in place first (their grammar's mask, on the device).
        -> (picks by request id, None or (the masked rows' model log-normalizers [R] on the
        device, their index by request id))."""
        norms = None
        if any(r.grammar is not None for r in reqs):  # unconstrained batches skip all of this
            pairs = self.grammar.rows(reqs, rows)
            if pairs:
                at = {st: k for k, (st, _) in enumerate(pairs)}
                norms = (self.grammar.apply(logits, pairs), {r.id: at[r.grammar] for r in reqs if r.grammar in at})
        greedy = [(r, row) for r, row in zip(reqs, rows) if r.picked_on_device()]
        if not greedy:
            return {}, norms
        top = max(r.sampling.top_logprobs for r, _ in greedy)
        norm, pos = None, None
        if norms is not None:  # masked greedy rows: their model log-normalizers
            lse, at = norms
            pos = [j for j, (r, _) in enumerate(greedy) if r.id in at]
            ks = [at[greedy[j][0].id] for j in pos]
            if pos:
                norm = lse if ks == list(range(len(lse))) else lse[torch.tensor(ks, device=lse.device)]
        picks = greedy_rows(logits, [row for _, row in greedy], top, norm, pos)
        return {r.id: (tok, lp, tops[:r.sampling.top_logprobs])
                for (r, _), (tok, lp, tops) in zip(greedy, picks)}, norms

    # ---- pages and preemption -------------------------------------------------------------------
    def _room(self, req: Request, tokens: int) -> bool:
        """Pages for positions [0, tokens) of `req`. When the pool is out, the latest-arrived
        running request is preempted (req itself, if it is the latest). False if req lost
        its slot (preempted) or failed."""
        while True:
            try:
                self.kv.grow(req, tokens)
                return True
            except PagesExhausted:
                others = [r for r in self.sched.running.values() if r is not req]
                if not others:
                    self._finish(req, "error", error=(
                        f"the request needs {self.state.pages.pages_for(tokens)} KV pages and the pool holds "
                        f"{self.state.pages.num_pages - 1}; raise --kv-cache-tokens or --vram-budget"))
                    return False
                victim = max(others + [req], key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    return False

    def _rewind(self, req: Request) -> None:
        """Drop a request's computed state; it prefills everything it has again."""
        self.kv.release(req, None)
        req.computed, req.restored = 0, False
        req.prefill_end = req.length if req.output_ids else len(req.prompt_ids)

    def _preempt(self, req: Request) -> None:
        log.info("KV pool full: preempting request %s (%d tokens, recomputed when it runs again)",
                 req.id, req.computed)
        self._rewind(req)
        req.preemptions += 1
        with self._lock:
            self.sched.preempt(req)

    # ---- update -------------------------------------------------------------------------------
    def _accept(self, req: Request, logits: torch.Tensor | None, pick: tuple | None = None,
                norm: float | None = None) -> None:
        """Sample the next token of `req` (or take `pick`, chosen on the device), emit it,
        finish the request if it is done. norm: the model's log-normalizer of logits that a
        grammar masked."""
        s = req.sampling
        forced = req.forcing()
        if forced:  # a forced token, with its log-probability under the model
            tok = s.forced[req.forced_next]
            req.forced_next += 1
            lsm = torch.log_softmax(logits.float(), -1)
            pick = tok, float(lsm[tok]), top_entries(lsm, s.top_logprobs)
        elif pick is None:
            adjusted = None
            if s.adjusts_logits(len(req.output_ids)):  # the pick reads the adjusted row, logprobs the model's
                if req.adjuster is None:
                    req.adjuster = LogitAdjuster(s, req.prompt_ids, req.output_ids, self.engine.eos_ids)
                adjusted = req.adjuster.apply(logits)
            pick = sample(logits, SamplingParams(s.temperature, s.top_p, s.top_k, min_p=s.min_p),
                          self._gens.get(req.id), s.top_logprobs, norm, adjusted=adjusted)
        tok, lp, tops = pick
        if req.adjuster is not None:
            req.adjuster.update(tok)
        complete = req.grammar is not None and self.grammar.accept(req, tok)  # raises if tok breaks it
        if tok == s.forced_after:
            req.forced_armed = True
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        if self.record_logits:
            req.logits.append(logits.detach().float().cpu().clone())
        if s.top_logprobs:
            req.top_logprobs.append(tops)
        req.output_ids.append(tok)
        req.logprobs.append(lp)
        if self.cache is not None:  # the state holds tokens [0, computed): checkpoint that boundary?
            seq = _Joined(req.prompt_ids, req.output_ids)  # no per-token copy of the whole context
            c = req.computed
            if self.cache.positions(seq, c - 1, c):  # alongside a prompt forward: no eviction (its
                # capture may be writing the slot evicted)
                self.cache.save(req.tokens(0, c), req.slot,
                                evict=not (self._prompt_forward or (self.overlap and self.overlap.in_worker)))
        reason = None
        # a forced token (a tool call's opening) is the opening's, not a stop the model chose
        if (not s.ignore_eos and tok in self.engine.eos_ids) or (tok in s.stop_token_ids and not forced) or complete:
            reason = "stop"  # complete: the grammar admits nothing more
        elif len(req.output_ids) >= s.max_tokens or req.length >= self.max_len:
            reason = "length"
        self.emit(req, TokenEvent(req.id, [tok], [lp]))
        if reason:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if self.overlap is not None and self.overlap.in_worker:  # pages and prefix cache: after the
            if all(r is not req for r, _, _ in self.overlap.deferred):  # prompt forward, on the loop's thread
                self.overlap.deferred.append((req, reason, error))
            return
        if req.finished_at is not None:  # already finished (a deferred finish met a later failure)
            return
        ok = error is None and reason != "error" and req.slot is not None
        try:
            # the pages hold K/V of tokens [0, computed) unless something failed midway
            self.kv.release(req, req.tokens(0, req.computed) if ok and req.computed else None)
        finally:
            with self._lock:
                self.sched.finish(req)
            req.finish_reason = req.finish_reason or reason
            req.error = req.error or error
            req.finished_at = time.monotonic()
            self.emit(req, TokenEvent(req.id, [], [], finish_reason=req.finish_reason, error=req.error))
            self._gens.pop(req.id, None)
            if req.grammar is not None:
                self.grammar.release(req)
            if self.metrics:
                self.metrics.finished(req)


def _norm(norms, req: Request, picks: dict) -> float | None:
    """The model's log-normalizer of a masked row sampled on the host (None: not masked)."""
    if norms is None or req.id in picks or req.id not in norms[1]:
        return None
    lse, at = norms
    return float(lse[at[req.id]])


class _Joined:
    """Read-only view of prompt + output (indexing and len only)."""

    __slots__ = ("a", "b")

    def __init__(self, a: list[int], b: list[int]):
        self.a, self.b = a, b

    def __len__(self) -> int:
        return len(self.a) + len(self.b)

    def __getitem__(self, i: int) -> int:
        n = len(self.a)
        return self.a[i] if i < n else self.b[i - n]
