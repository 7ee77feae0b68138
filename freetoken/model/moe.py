"""MoE block: router, routed experts through the executor, shared expert.

Placement is data: this file computes routing and hands flat expert ids (ordinal * E + e)
and gate weights to an ExpertExecutor; it never touches expert weights itself. What an expert
computes (its activation, its biases) is the executor's data too; the layer only checks, once,
that its executor computes the model's function.

Routers (cfg.router): "softmax_topk" (Qwen: softmax over every expert, top-k, optionally
renormalised) and "topk_softmax" (GPT-OSS: top-k of the logits, softmax over those k; a biased
linear). The two pick the same experts and, renormalised, the same weights up to rounding, so
on CUDA both go through the fused softmax-top-k kernel (kernels/router.py).
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from ..experts import split_experts
from ..experts.executor import NO_EXPERT, Activation
from ..kernels import prefill_kernels, use_triton
from .layers import FusedLinear, gated_add, silu_mul, swiglu_mlp
from .linear import linear


def check_executor(cfg, executor) -> None:
    """Refuse an executor that does not compute the model's experts (a clear error at load, not
    wrong logits): its activation and whether it has the bias banks."""
    if executor is None:
        return
    want = Activation.of(cfg)
    has_bias = executor.gate_up_bias is not None and executor.down_bias is not None
    if executor.activation != want or has_bias != cfg.expert_bias:
        got = executor.activation.kind + (" with biases" if has_bias else "")
        need = want.kind + (" with biases" if cfg.expert_bias else "")
        raise UnsupportedModelError(
            f"the {executor.backend} expert executor computes {got} experts; this model's experts are {need} "
            "(an executor is built with the model's expert function: its activation and, where the model "
            "has them, the expert biases)")


class MoE:
    """router: the checkpoint's name of the router linear ("gate" for Qwen, "router" for GPT-OSS);
    its bias is read when cfg.router_bias."""

    def __init__(self, cfg, w: dict, layer: int, ordinal: int, executor, router: str = "gate"):
        p = f"model.layers.{layer}.mlp."
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.norm_topk = cfg.norm_topk_prob
        self.topk_first = cfg.router == "topk_softmax"
        self.base = ordinal * cfg.num_experts  # first flat id of this layer
        self.executor = executor
        if ordinal == 0:
            check_executor(cfg, executor)
        self.shared = cfg.shared_expert_intermediate_size > 0
        # router, shared expert gate/up and its sigmoid gate all read x: one GEMM
        names = [router + ".weight"]
        if self.shared:
            names += ["shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert_gate.weight"]
            self.shared_down = w[p + "shared_expert.down_proj.weight"]
        bias = [w[p + router + ".bias"] if cfg.router_bias else None] + [None] * (len(names) - 1)
        self.in_proj = FusedLinear([w[p + n] for n in names], bias)
        # the lookahead (experts/cached.py): the next MoE layer's router on this layer's input
        # predicts what that layer will route to, so its misses can be copied in early. A GEMM of
        # its own: joined to in_proj it could change that GEMM's kernel, and so its rounding
        # (link_lookahead points ahead_w at that layer's router rows once every layer is built)
        nxt = next((l for l in cfg.moe_layers if l > layer), None)
        self.ahead = bool(getattr(executor, "prefetch", 0)) and nxt is not None
        self.ahead_w = self.ahead_b = None
        self.prefill_graphs = None  # runtime.prefill_graphs.PrefillGraphs, where captured

    def route(self, logits: torch.Tensor, dtype):
        """router logits [T, E] -> flat ids [T, k] int64, weights [T, k] in the activation dtype.
        On CUDA the fused kernel takes decode batches, and prompt chunks too unless
        FREETOKEN_PREFILL_KERNELS=0 (torch's softmax and top-k over a 32k-token pass: ~6 ms of
        plan 120's 12-layer profile); else the torch form (the reference)."""
        if (use_triton(logits) and (logits.shape[0] <= 64 or prefill_kernels())
                and self.top_k & (self.top_k - 1) == 0):
            from ..kernels.router import route_triton
            return route_triton(logits, self.top_k, self.norm_topk or self.topk_first, self.base, dtype)
        return self.route_torch(logits, dtype)

    def route_torch(self, logits: torch.Tensor, dtype):
        if getattr(self, "topk_first", False):  # GPT-OSS: top-k logits, softmax over them
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return idx + self.base, torch.softmax(top.float(), dim=-1).to(dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx + self.base, top.to(dtype)

    def __call__(self, x: torch.Tensor, phase: str = "prefill", active: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]. phase: "prefill" | "decode"; active [T] bool marks the decode
        rows that are running (the others route to no expert). A prompt chunk short enough
        replays a captured graph of this block where there is one (runtime/prefill_graphs.py)."""
        if self.prefill_graphs is not None and phase == "prefill" and active is None:
            y = self.prefill_graphs.run(self, x)
            if y is not None:
                return y
        return self.forward(x, phase, active)

    def forward(self, x: torch.Tensor, phase: str = "prefill", active: torch.Tensor | None = None) -> torch.Tensor:
        """The block, eagerly (or as a graph records it): as __call__."""
        parts = self.in_proj(x)  # router logits [T, E] (+ shared gate [T, Is], up [T, Is], gate [T, 1])
        ids, weights = self.route(parts[0], x.dtype)  # [T, k]
        if active is not None:
            ids = ids.masked_fill(~active[:, None], NO_EXPERT)
        kw = {}
        if self.ahead and self.ahead_w is not None and phase == "decode":  # the next MoE layer's predicted routes
            nxt_ids, nxt_w = self.route(linear(x, self.ahead_w, self.ahead_b), x.dtype)  # [T, k]
            nxt_ids = nxt_ids + self.num_experts
            if active is not None:
                nxt_ids = nxt_ids.masked_fill(~active[:, None], NO_EXPERT)
            kw["ahead"] = (nxt_ids, nxt_w)
        # a prompt chunk on the CPU with the serving loop's hook: its experts in pieces, decode
        # steps allowed between them (experts/split_experts.py)
        pending = split_experts.launch(self.executor, x, ids, weights, self.base, self.num_experts, phase, **kw)
        y = None
        if self.shared:  # computed while the routed experts run (on the CPU pool, say)
            _, g, u, sg = parts
            y = linear(silu_mul(g, u), self.shared_down)  # [T, H]
        out = self.executor.finish(pending)
        return out if y is None else gated_add(out, sg, y)  # routed + sigmoid(sg) * y: one fixed merge order


def link_lookahead(mlps) -> None:
    """Give each MoE layer that predicts (`ahead`) the next MoE layer's router: a view of the
    router rows of that layer's in_proj (and bias), no second copy on the device."""
    moes = [m for m in mlps if isinstance(m, MoE)]
    for a, b in zip(moes, moes[1:]):
        if a.ahead:
            a.ahead_w, a.ahead_b = b.in_proj.part(0)  # [E, H], [E] or None


class DenseMLP:
    def __init__(self, w: dict, layer: int):
        p = f"model.layers.{layer}.mlp."
        self.w = (w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])

    def __call__(self, x, phase: str = "prefill", active=None):
        return swiglu_mlp(x, *self.w)
