"""The DeepSeek-V3-style MoE block that GLM-5 uses (transformers GlmMoeDsaMoE): a sigmoid router
whose correction bias steers which experts are chosen but not their weights, group limits, a
routed scaling factor, and shared experts (a plain SwiGLU, no gate) added to the routed sum.

As in model/moe.py, placement is data: this computes the routing and hands flat expert ids
(ordinal * E + e) and weights to the ExpertExecutor.

Routing (cfg.router "sigmoid_group"), per token, in fp32 as the reference does:
  s = sigmoid(x W^T); c = s + bias;
  the E experts form n_group groups, a group's score is the sum of its two best c; only the
  topk_group best groups stay eligible; the top_k eligible experts by c are chosen;
  weights = s of the chosen (divided by their sum + 1e-20 if norm_topk_prob) * routed_scaling_factor.
"""
from __future__ import annotations

import torch

from ..experts import split_experts
from ..experts.executor import NO_EXPERT
from .layers import FusedLinear, silu_mul
from .linear import linear
from .moe import check_executor


class DeepseekMoE:
    shared_limit = None  # DeepSeek-V4 (model/deepseek_v4.py) clamps its shared expert's gate and up

    def __init__(self, cfg, w: dict, layer: int, ordinal: int, executor):
        p = f"model.layers.{layer}.mlp."
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.groups, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.base = ordinal * cfg.num_experts  # first flat id of this layer
        self.executor = executor
        if ordinal == 0:
            check_executor(cfg, executor)
        # the reference keeps the router and its bias in fp32 whatever the compute dtype
        self.router = w[p + "gate.weight"].float()  # [E, H]
        self.bias = w[p + "gate.e_score_correction_bias"].float()  # [E]
        self.shared = None
        if cfg.n_shared_experts:
            s = p + "shared_experts."
            self.shared = FusedLinear([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]])
            self.shared_down = w[s + "down_proj.weight"]

    def route(self, x: torch.Tensor):
        """x [T, H] -> flat ids [T, k] int64, weights [T, k] in x's dtype. Static shapes."""
        scores = torch.sigmoid(linear(x.float(), self.router))  # [T, E] (CUDA: rows padded, model/linear.py)
        choice = scores + self.bias
        t = choice.shape[0]
        if self.groups > 1:  # groups outside the best topk_group are not eligible
            per = self.num_experts // self.groups
            gs = choice.view(t, self.groups, per).topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        wts = scores.gather(1, idx)  # [T, k]
        if self.norm_topk:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return idx + self.base, (wts * self.scale).to(x.dtype)

    def __call__(self, x: torch.Tensor, phase: str = "prefill", active: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H] -> [T, H]. phase: "prefill" | "decode"; active [T] bool marks the decode
        rows that are running (the others route to no expert)."""
        ids, weights = self.route(x)  # [T, k]
        if active is not None:
            ids = ids.masked_fill(~active[:, None], NO_EXPERT)
        pending = split_experts.launch(self.executor, x, ids, weights, self.base, self.num_experts, phase)
        shared = None
        if self.shared is not None:  # computed while the routed experts run (on the CPU pool, say)
            g, u = self.shared(x)
            if self.shared_limit is not None:
                g, u = g.clamp(max=self.shared_limit), u.clamp(-self.shared_limit, self.shared_limit)
            shared = linear(silu_mul(g, u), self.shared_down)
        out = self.executor.finish(pending)
        return out if shared is None else out + shared  # one fixed merge order
