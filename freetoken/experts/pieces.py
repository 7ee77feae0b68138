"""Expert pieces: each expert cut into `pieces` equal slices of its intermediate dimension, every
slice an expert of its own to the executors below (the cache's slots, fills, CPU branch, GPU
kernels), so that a layer's misses can be shared between the GPU fills and the CPU at a finer
grain than a whole expert.

Why: the cache splits a layer's m misses q = r m to the fills and m - q to the CPU, and both
sides run at once. With few, large experts (Mixtral-8x7B: top-2 of 8, 352 MB each in bf16) a
layer misses 0, 1 or 2 experts, so one side gets a whole expert and the other nothing: the step
runs at one bandwidth, not at B_P + B_H (issue 10: 70% of the analytic floor on the Mixtral trace).
Cut into 4 pieces, one missed expert is 4 misses of 88 MB, and r splits them.

Exact by construction: with gu = x Wgu^T split by intermediate rows, an expert's output is
    down(act(gate(x)) * up(x)) = sum_j down[:, Ij] act(gate_j(x)) * up_j(x)
because the activation is elementwise per intermediate row and the down projection is linear in
it; so piece j of expert e is the expert (e, j) with flat id e * pieces + j, gate weight the
expert's, and the routed output is the sum over the pieces (only the summation order changes).

Layouts (executor.py's, per expert):
    gate_up [N, 2I, H], rows [gate 0..I | up 0..I]  ->  [N * p, 2I/p, H], piece j: [gate_j | up_j]
    down    [N, H, I]                               ->  [N * p, H, I/p], piece j: columns of I_j
    gate_up_bias [N, 2I] as the rows; down_bias [N, H] on piece 0 only (added once).
`split_banks_` re-lays dense host banks in place (a few hundred MB of scratch at a time: the
banks of a large model are most of the host's memory, a second copy would not fit) and returns
views of the same memory, so pinned or registered banks stay so. Splitting into p, then each
piece into p', equals splitting into p p' at once (piece j's slice jj is slice j p' + jj).
Quantized banks (banks.QuantBank) are cut the same way, tensor by tensor, each piece holding
whole scale blocks: gate_up's values and scales by rows (fp8's scales by 128-row block rows),
down's values and scales by columns, so I/p must be a multiple of the format's block along the
intermediate dimension (fp8_block 128, mxfp4 32, nvfp4 16); nvfp4's per-expert scale_2 is
repeated for each piece (a new small tensor).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..weights.quant import FP8_BLOCK, MX_BLOCK, NV_BLOCK
from .banks import QuantBank
from .executor import NO_EXPERT, ExpertExecutor, Pending

SCRATCH = 256 << 20  # bytes of experts re-laid per copy (the scratch is one such slice)
# values along the intermediate dimension that one scale covers: a piece holds whole blocks
QUANT_BLOCK = {"fp8_block": FP8_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NV_BLOCK}


def check_pieces(inter: int, pieces: int) -> None:
    if pieces < 1 or inter % pieces:
        raise ValueError(f"expert pieces must be a divisor of the experts' intermediate size {inter}, "
                         f"got {pieces}: pick one that divides it (1 turns pieces off)")


def split_banks_(gate_up, down, pieces: int):
    """Re-lay banks gate_up [N, 2I, H] and down [N, H, I] in place into `pieces` pieces per
    expert; returns the banks of N p experts (gate_up [N p, 2I/p, H], down [N p, H, I/p]) over
    the same memory. Dense tensors or QuantBanks (whole scale blocks per piece, see the module
    docstring). The banks given must not be read as whole experts after this."""
    quant = isinstance(gate_up, QuantBank) and isinstance(down, QuantBank) and gate_up.format == down.format
    if not quant and not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        raise ValueError("expert banks must be two tensors or two quantized banks of one format")
    n, i2, h = gate_up.shape
    inter = i2 // 2
    check_pieces(inter, pieces)
    if quant and pieces > 1:
        _check_quant_pieces(gate_up.format, inter, pieces)
    if tuple(down.shape) != (n, h, inter):
        raise ValueError(f"expert banks must be [N, 2I, H] and [N, H, I], got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    rows = gate_up.tensors() if quant else [gate_up]  # each [N, 2X, Y]: gate's X rows, then up's
    cols = [down.values, down.scale] if quant else [down]  # each [N, H', Z]: Z runs along I
    if not all(t.is_contiguous() for t in rows + cols):
        raise ValueError("expert banks must be contiguous to be cut into pieces in place")
    if pieces > 1:
        if quant and gate_up.scale_2 is not None:
            rows = rows[:-1]  # scale_2 [N, halves] is per expert: repeated per piece below
        # one scratch, reused: a fresh buffer per copy pays its page faults every time (most of
        # the cut's time before; bench.pieces_cpu times the cut: cut_gbs)
        per = max(t[0].numel() * t.element_size() for t in rows + cols)  # bytes of the largest expert row
        scratch = torch.empty(min(n, max(1, SCRATCH // per)) * per, dtype=torch.uint8)
        for t in rows:
            _relay_(t, pieces, scratch, by_rows=True)
        for t in cols:
            _relay_(t, pieces, scratch, by_rows=False)
    if not quant:
        return gate_up.view(n * pieces, 2 * inter // pieces, h), down.view(n * pieces, h, inter // pieces)
    return _pieced_quant(gate_up, pieces, by_rows=True), _pieced_quant(down, pieces, by_rows=False)


def _relay_(t: torch.Tensor, pieces: int, scratch: torch.Tensor, by_rows: bool) -> None:
    """One bank tensor re-laid in place, `scratch` (bytes) a copy's worth of experts at a time:
    by_rows [N, 2X, Y] -> [N, p, 2, X/p, Y] (a piece's gate rows then its up rows);
    else [N, R, Z] -> [N, p, R, Z/p] (a piece's columns)."""
    n, r, z = t.shape
    step = max(1, scratch.numel() // (t[0].numel() * t.element_size()))  # experts per copy
    for e0 in range(0, n, step):
        c = min(step, n - e0)
        g = t[e0:e0 + c]  # [c, R, Z]
        src = scratch[:g.numel() * g.element_size()].view(g.dtype).view(g.shape).copy_(g)
        if by_rows:
            x = r // 2 // pieces
            g.view(c, pieces, 2, x, z).copy_(src.view(c, 2, pieces, x, z).transpose(1, 2))  # [c, piece, gate|up, X/p, Y]
        else:
            zp = z // pieces
            g.view(c, pieces, r, zp).copy_(src.view(c, r, pieces, zp).permute(0, 2, 1, 3))  # [c, piece, R, Z/p]


def _check_quant_pieces(fmt: str, inter: int, pieces: int) -> None:
    block = QUANT_BLOCK[fmt]
    if (inter // pieces) % block:
        ok = [p for p in range(2, inter // block + 1) if inter % p == 0 and (inter // p) % block == 0]
        why = (f"{fmt} expert pieces must hold whole {block}-value scale blocks: {inter} intermediate rows in "
               f"{pieces} pieces are {inter // pieces} each")
        if not ok:
            raise ValueError(f"{why}; experts of {inter} rows cannot be cut into whole blocks: leave pieces at 1")
        raise ValueError(f"{why}; pick one that leaves whole blocks, e.g. {', '.join(map(str, ok[:8]))}")


def _pieced_quant(bank: QuantBank, pieces: int, by_rows: bool) -> QuantBank:
    """The QuantBank of N p pieces over a bank re-laid by _relay_ (views of its memory)."""
    n = bank.values.shape[0]

    def view(t):  # [N, R, Z] re-laid -> [N p, R/p, Z] (rows) or [N p, R, Z/p] (columns)
        r, z = t.shape[1:]
        return t.view(n * pieces, r // pieces, z) if by_rows else t.view(n * pieces, r, z // pieces)
    s2 = None if bank.scale_2 is None else bank.scale_2.repeat_interleave(pieces, dim=0)  # [N p, halves]
    return replace(bank, values=view(bank.values), scale=view(bank.scale), scale_2=s2)


def split_biases(gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, pieces: int):
    """The bias banks of pieced experts (new tensors: they are small): gate_up_bias [N, 2I] ->
    [N p, 2I/p] as the rows; down_bias [N, H] -> [N p, H], the bias on piece 0 and zeros on the
    others, so that the pieces' sum adds it once."""
    gub = dnb = None
    if gate_up_bias is not None:
        n, i2 = gate_up_bias.shape
        check_pieces(i2 // 2, pieces)
        ip = i2 // 2 // pieces
        gub = gate_up_bias.view(n, 2, pieces, ip).transpose(1, 2).reshape(n * pieces, 2 * ip)  # [N p, 2Ip]
    if down_bias is not None:
        n, h = down_bias.shape
        dnb = torch.zeros(n, pieces, h, dtype=down_bias.dtype, device=down_bias.device)  # [N, p, H]
        dnb[:, 0] = down_bias
        dnb = dnb.view(n * pieces, h)
    return gub, dnb


def expand_routes(ids: torch.Tensor, weights: torch.Tensor, pieces: int):
    """Routes over experts [T, k] -> routes over their pieces [T, k p]: expert e's pieces
    e p .. e p + p - 1 side by side, each with e's gate weight; NO_EXPERT stays NO_EXPERT.
    Fixed shapes, no sync: capturable in a decode graph."""
    if pieces == 1:
        return ids, weights
    t, k = ids.shape
    j = torch.arange(pieces, dtype=ids.dtype, device=ids.device)  # [p]
    flat = ids[:, :, None] * pieces + j  # [T, k, p]
    flat = torch.where(ids[:, :, None] >= 0, flat, torch.full_like(flat, NO_EXPERT))
    return flat.reshape(t, k * pieces), weights[:, :, None].expand(t, k, pieces).reshape(t, k * pieces)


class PiecedExecutor(ExpertExecutor):
    """An executor built over pieced banks (N p experts), called with routes over whole experts:
    it expands each call's routes (and the lookahead's predicted ones) to the pieces. Everything
    else (the slot pool's sizing in pieces, the adaptive split, graph variants, stats) is the
    inner executor's."""

    # not the inner executor's (through __getattr__): a call in expert pieces (experts/split_experts.py)
    # would skip expanding its routes to these pieces
    launch_pieces = None

    def __init__(self, inner: ExpertExecutor, pieces: int):
        self.__dict__.update(inner=inner, pieces=int(pieces))

    def __getattr__(self, name):  # the inner executor's attributes (pool, tuner, observe_step, ...)
        try:
            inner = self.__dict__["inner"]
        except KeyError:  # not set up yet (copy, pickle): no attribute, as Python expects
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __setattr__(self, name, value):  # the engine sets a few (warm_control, pool): the inner's
        if name in ("inner", "pieces"):
            self.__dict__[name] = value
        else:
            setattr(self.inner, name, value)

    # class attributes of ExpertExecutor that would shadow __getattr__
    name = property(lambda self: self.inner.name)
    backend = property(lambda self: self.inner.backend)
    capturable = property(lambda self: self.inner.capturable)
    needs_pinned_staging = property(lambda self: self.inner.needs_pinned_staging)
    activation = property(lambda self: self.inner.activation)
    gate_up_bias = property(lambda self: self.inner.gate_up_bias)
    down_bias = property(lambda self: self.inner.down_bias)

    def launch(self, x, ids, weights, layer: int = 0, phase: str = "decode", **kw) -> Pending:
        ids, weights = expand_routes(ids, weights, self.pieces)
        if kw.get("ahead") is not None:
            kw["ahead"] = expand_routes(*kw["ahead"], self.pieces)
        return self.inner.launch(x, ids, weights, layer, phase, **kw)

    def finish(self, pending: Pending) -> torch.Tensor:
        return self.inner.finish(pending)

    def run(self, x, ids, weights, phase: str) -> torch.Tensor:
        return self.inner.run(x, *expand_routes(ids, weights, self.pieces), phase)

    def stats(self) -> dict:
        return {**self.inner.stats(), "expert_pieces": self.pieces}
