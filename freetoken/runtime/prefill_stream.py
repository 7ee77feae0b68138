"""Layer-major prefill passes with the routed experts streamed per layer (issue 11, mechanism 1).

With the experts offloaded (--moe cache), a prompt prefilled the usual way (chunks of
--prefill-chunk tokens, the model looping over layers inside each chunk) needs every expert of
every layer on the device once per chunk: a long prompt streams the whole pool over PCIe once
per chunk. A pass here takes as many tokens as the memory budget allows (`pass_tokens`) and runs
embed -> layer 0..L-1 -> head over all of them, so the pool crosses once per pass, each layer's
experts loaded by the expert loader (experts/stream.py) from the hook before that layer.

Inside a layer the token mixers' work stays in pieces: of MIXER_SUB tokens where the budget has
room for their work buffers (the memory plan reserves it last), else of --prefill-chunk tokens,
the size the plan's work buffers are made for. They run piece by piece in order, exactly the
calls chunked prefill makes (attention writes each piece's K/V before the next reads them,
DeltaNet carries its state from piece to piece), so KV, recurrent state and prefix-cache
checkpoints are written as today. Checkpoints never force a boundary: the DeltaNet layers take
them inside whichever piece crosses an anchor (cache/prefix.py StateCapture), whatever the
chunking. The experts see the whole pass's routing at once (the loader's routed set of the
layer) and compute it in sub-chunks of EXPERT_SUB tokens where the budget has room (more rows
for each expert's GEMM), else of the mixers' size. Only the residual stream lives for the whole
pass: a few [P, H] tensors (PASS_ACTS), which is what bounds the pass (the memory plan keeps
room for both: pass_reserve_bytes).

The model runs the pass through its own varlen prefill (DecoderModel.prefill_batch with one
segment per piece and a per-layer hook); its MoE layers are pointed at the loader for the
pass and back at the cache's executor after it.

Serving: streams that are decoding keep decoding during a pass. The serving loop's hook runs
decode steps between the pass's layers (runtime/interleave.py decides when), with the expert
cache frozen for the pass (experts/cached.py): a decode step reads the experts the cache kept
where they lie and runs its misses on the CPU, never touching the slots the pass loads into.
A 32k pass of the full-size model takes seconds; between passes only, a decoding stream would
wait that long for each token.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext

import torch

from ..experts.stream import DENSE_SHARE, LayerStreamer
from .budget import work_bytes

log = logging.getLogger("freetoken.engine")
MAX_PASS_TOKENS = 32768  # past this a pass is compute-bound on the GPU machine: longer ones gain nothing
PASS_ACTS = 6  # [P, H] tensors alive at once: residual, its norm, the mixer's output, the next two, the embedding
# tokens per expert computation inside a pass, where the budget has room: on the H100 a 12-layer
# pass with every expert resident took 0.407 s at 32k tokens with the experts in sub-chunks of
# 8,192 against 0.506 s in the mixers' 2,048 (0.185 against 0.234 s at 16k): each expert's GEMM
# gets 4x the rows (benchmarks/results/prefill_stream-compute-h100-gpu.json, resident-pass rows).
# Not 32,768: on another H100 that saved 10% of a 32k pass (0.464 against 0.512 s, prefill_stream-gpu.json),
# while the memory plan's reserve for it (pass_reserve_bytes) comes out of the decode cache's slots
EXPERT_SUB = 8192
# tokens per token-mixer piece inside a pass, where the budget has room after the pass's length and
# its experts' sub-chunk: a 32k pass is paced by the host's launches, and pieces of 8,192 instead of
# --prefill-chunk's 2,048 took the 40-layer Qwen3.6 shape's 32k pass on an H100 from 1.37-1.56 s to
# 1.33 s, 1.07x its transfer floor (results/prefill_stream-msub-40l-h100-gpu.json, plans 137-138).
# Their work buffers cost ~2.2 GB more on that shape: the memory plan reserves them last
# (pass_reserve_bytes), within its cap of a tenth of what the fixed parts leave.
MIXER_SUB = 8192


def pass_bytes_per_token(cfg, dtype, pieces: int = 1) -> int:
    """Device bytes a pass holds per token beyond one sub-chunk's work: PASS_ACTS [P, H]
    tensors, the MoE's router logits and shared-expert rows over the whole pass ([P, E + 3 Is
    + 1]), the routed ids and weights and the loader's per-pair indices ([P, k x pieces])."""
    el = torch.empty((), dtype=dtype).element_size()
    moe = cfg.num_experts + 3 * cfg.shared_expert_intermediate_size + 1
    return (PASS_ACTS * cfg.hidden_size + moe) * el + cfg.top_k * pieces * (8 + el + 8 + 1 + 8)


def expert_bytes_per_token(cfg, dtype, pieces: int = 1) -> int:
    """Device bytes one more token of an expert sub-chunk holds in the grouped expert kernels
    (kernels/moe_grouped.py, moe_quant.py): its pairs' activations ([k, I]: gate and up stay in
    registers), their down-projected rows before the weighted sum ([k x pieces, H]: experts cut
    in pieces have k x pieces pairs of I / pieces columns), the pairs' index temporaries
    (~100 bytes a pair) and the summed row ([H])."""
    el = torch.empty((), dtype=dtype).element_size()
    k, inter = cfg.top_k, max(cfg.moe_intermediate_size, 1)
    return k * inter * el + k * pieces * (cfg.hidden_size * el + 100) + cfg.hidden_size * el


def mixer_extra_bytes(cfg, dtype, sub: int, msub: int) -> int:
    """Device bytes token-mixer pieces of msub tokens need beyond the work buffers for sub."""
    return max(work_bytes(cfg, msub, 1, dtype) - work_bytes(cfg, sub, 1, dtype), 0)


def pass_reserve_bytes(cfg, dtype, max_len: int, sub: int, pieces: int = 1) -> int:
    """What the memory plan keeps for streamed passes (runtime/loop.py): a pass of up to
    MAX_PASS_TOKENS (or the context), the experts' sub-chunks of EXPERT_SUB tokens beyond
    the sub-chunk the work buffers are sized for, then token-mixer pieces of MIXER_SUB tokens
    (PrefillStream.sizes grants them in that order from what the budget has left)."""
    tokens = min(MAX_PASS_TOKENS, max_len)
    esub = max(min(EXPERT_SUB, tokens) - sub, 0)
    msub = min(MIXER_SUB, tokens)
    return (tokens * pass_bytes_per_token(cfg, dtype, pieces) + esub * expert_bytes_per_token(cfg, dtype, pieces)
            + (mixer_extra_bytes(cfg, dtype, sub, msub) if msub > sub else 0))


class PrefillStream:
    def __init__(self, model, cfg, cache_executor, sub_tokens: int, max_pass_tokens: int = MAX_PASS_TOKENS,
                 buffering: str = "auto", budget: int | None = None, dense_share: float = DENSE_SHARE,
                 expert_sub: int = EXPERT_SUB):
        """model: the DecoderModel whose MoE layers call `cache_executor` (a
        CachedExpertExecutor); sub_tokens: tokens per mixer call; expert_sub: tokens per expert
        computation where the budget has room for it (else sub_tokens); budget: bytes the engine
        may hold on a CUDA device (the pass takes what is left of it)."""
        self.model, self.cfg, self.sub = model, cfg, max(1, sub_tokens)
        self.expert_sub = max(self.sub, expert_sub)
        self.max_pass_tokens, self.budget = max_pass_tokens, budget
        # experts cut into pieces (experts/pieces.py): the loader works over the pieces (the cache
        # inside the wrapper), the MoE layers' routes expanded to them on the way in
        p = getattr(cache_executor, "pieces", 1)
        inner = cache_executor.inner if p > 1 else cache_executor
        self.loader = LayerStreamer(inner, len(cfg.moe_layers), cfg.num_experts * p, cfg.top_k * p, buffering,
                                    dense_share, self.sub)
        self._pass_executor = self.loader
        if p > 1:
            from ..experts.pieces import PiecedExecutor
            self._pass_executor = PiecedExecutor(self.loader, p)
        self.ordinal = {layer: j for j, layer in enumerate(cfg.moe_layers)}
        self._limited = None  # the budget-limited pass size last logged
        self.mixer_sub = MIXER_SUB  # the largest token-mixer piece a pass may take (sizes())
        self._msub = self.sub  # the token mixers' piece of the latest pass

    @classmethod
    def for_engine(cls, engine, **kw) -> "PrefillStream":
        return cls(engine.model, engine.cfg, engine.executor, engine.ecfg.prefill_chunk, budget=engine.budget, **kw)

    def pass_tokens(self) -> int:
        """Tokens one pass may take now (sizes())."""
        return self.sizes()[0]

    def sizes(self) -> tuple[int, int, int]:
        """(tokens one pass may take, its experts' sub-chunk, its token mixers' piece) now.
        Tokens: max_pass_tokens, less on CUDA when the budget's free part
        cannot hold the pass beside one sub-chunk's work; a multiple of the sub-chunk (pieces
        then fall where chunked prefill puts its chunks), at least one. The memory plan reserves
        room for a pass (pass_reserve_bytes, at most a tenth of what the fixed parts leave);
        what the pass may take is measured here, and a limit is said once in the log.
        The pass's length comes first (a shorter pass streams the pool more often, which costs
        more than the GEMMs' shape gains); what it leaves buys expert sub-chunks of up to
        expert_sub tokens, then token-mixer pieces of mixer_sub (fewer host launches) where their
        work buffers fit; else the mixers keep sub_tokens, and so does every pass off CUDA or
        without a budget. Changes nothing but the log: the entry points set the loader's
        sub-chunk on the serving loop's thread, never /metrics (stats()) mid-pass."""
        cap, esub = self.max_pass_tokens, self.expert_sub
        dev = self.model.device
        if self.budget is None or torch.device(dev).type != "cuda":
            return max(self.sub, cap // self.sub * self.sub), esub, self.sub
        dt = self.model.dtype
        room = max(self.budget - torch.cuda.memory_allocated(dev) - work_bytes(self.cfg, self.sub, 1, dt), 0)
        pieces = self.loader.top_k // max(1, self.cfg.top_k)
        per = pass_bytes_per_token(self.cfg, dt, pieces)
        cap = min(cap, room // per)
        n = max(self.sub, cap // self.sub * self.sub)  # pieces fall where chunked prefill puts its chunks
        left = max(room - n * per, 0)  # what the pass leaves: the experts' larger sub-chunk's
        ebpt = expert_bytes_per_token(self.cfg, dt, pieces)
        esub = min(esub, self.sub + left // ebpt)
        esub = max(self.sub, esub // self.sub * self.sub)
        left -= (esub - self.sub) * ebpt
        msub = self.sub
        for m in (self.mixer_sub, self.mixer_sub // 2):  # the larger piece, else half of it
            if self.sub < m <= n and m % self.sub == 0 and mixer_extra_bytes(self.cfg, dt, self.sub, m) <= left:
                msub = m
                break
        esub = max(esub, msub)  # the mixers' work buffers hold that many tokens' expert pairs too
        if cap < self.max_pass_tokens and n != self._limited:
            self._limited = n
            log.warning("prefill passes are limited to %d tokens by the memory budget (%.2f GB of it free); "
                        "each pass streams every expert once: leave room (a smaller KV pool or expert cache) "
                        "for longer passes", n, room / 1e9)
        return n, esub, msub

    # ---- entry points (Engine.prefill / prefill_batch) -----------------------------------------
    def prefill(self, ids: list[int], st, slot: int = 0, start: int = 0, logits: bool = True,
                capture=None) -> torch.Tensor | None:
        """One sequence's tokens at positions start.. in passes -> last logits [1, V] or None."""
        (n, self.loader.sub, self._msub), out = self.sizes(), None
        for s in range(0, len(ids), n):
            last = s + n >= len(ids)
            out = self._pass(st, [(ids[s:s + n], slot, start + s, capture, logits and last)])
        return out

    def prefill_batch(self, st, segs: list, between=None) -> torch.Tensor | None:
        """segs [(tokens, slot, start, capture, logits)] as Engine.prefill_batch, in passes of
        at most pass_tokens() tokens (a segment crossing a pass's end is split there) ->
        logits [S, V] of the segments asking for them, or None. between(i): the serving loop's
        hook before layer i of each pass (decode steps of the streams that are decoding), run
        with the expert cache frozen (_pass)."""
        (cap, self.loader.sub, self._msub), rows, batch, used = self.sizes(), [], [], 0

        def flush():
            lg = self._pass(st, batch, between)
            if lg is not None:
                rows.append(lg)
        for toks, slot, start, capture, want in segs:
            a = 0
            while a < len(toks):
                n = min(len(toks) - a, cap - used)
                batch.append((toks[a:a + n], slot, start + a, capture, want and a + n == len(toks)))
                used, a = used + n, a + n
                if used == cap:
                    flush()
                    batch, used = [], 0
        if batch:
            flush()
        return torch.cat(rows) if rows else None

    # ---- one pass ----------------------------------------------------------------------------
    def _pass(self, st, segs: list, between=None) -> torch.Tensor | None:
        """One layer-major pass over segments -> logits of those asking, or None. between(i),
        if given, runs before layer i after the loader's hook (so the next layer's copies are
        queued first and run under whatever between queues), the cache frozen meanwhile."""
        pieces, flat, m = [], [], self._msub
        for toks, slot, start, capture, want in segs:
            for a in range(0, len(toks), m):
                b = min(a + m, len(toks))
                pieces.append((slot, start + a, b - a, capture, want and b == len(toks)))
            flat += list(toks)
        tokens = torch.tensor(flat, dtype=torch.long, device=self.model.device)  # [P]
        mode = self.loader.begin(len(flat))
        def hook(i):  # the loader's copies for layer i queued first, then what `between` runs
            self._before_layer(i)
            if between is not None:
                between(i)
        try:
            with self._experts_streamed(), (self.loader.cache.frozen() if between is not None else nullcontext()):
                out = self.model.prefill_batch(tokens, st, pieces, hook=hook)
        finally:
            done = self.loader.end()
        log.info("prefill pass: %d tokens, %s buffering, %d layers loaded whole, %d from their routed experts, "
                 "%.3f s", len(flat), mode, done["layers_full"], done["layers_routed"], done["seconds"])
        return out

    def _before_layer(self, i: int) -> None:
        j = self.ordinal.get(i)
        if j is not None:
            self.loader.before_layer(j)

    @contextmanager
    def _experts_streamed(self):
        """The model's MoE layers call the loader for the pass, their executor again after it."""
        moes = [mlp for _, mlp, _, _ in self.model.layers if hasattr(mlp, "executor")]
        saved = [m.executor for m in moes]
        for m in moes:
            m.executor = self._pass_executor
        try:
            yield
        finally:
            for m, ex in zip(moes, saved):
                m.executor = ex

    def stats(self) -> dict:
        """The loader's counters (passes by buffering, layers loaded whole or routed, experts
        copied / used in place / skipped, bytes copied) and the last pass; `pass_tokens`: what a
        pass would take now; `expert_sub`: the experts' sub-chunk of the latest pass."""
        return {**self.loader.stats(), "pass_tokens": self.pass_tokens(), "expert_sub": self.loader.sub,
                "mixer_sub": self._msub}
