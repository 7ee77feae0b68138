"""MoE block: softmax top-k router, routed experts through the executor, shared expert.

Placement is data: this file computes routing and hands flat expert ids (ordinal * E + e)
and gate weights to an ExpertExecutor; it never touches expert weights itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import swiglu_mlp


class MoE:
    def __init__(self, cfg, w: dict, layer: int, ordinal: int, executor):
        p = f"model.layers.{layer}.mlp."
        self.router = w[p + "gate.weight"]  # [E, H]
        self.top_k, self.num_experts = cfg.top_k, cfg.num_experts
        self.norm_topk = cfg.norm_topk_prob
        self.base = ordinal * cfg.num_experts  # first flat id of this layer
        self.executor = executor
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            s = p + "shared_expert."
            self.shared = (w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
            self.shared_gate = w[p + "shared_expert_gate.weight"]  # [1, H]

    def route(self, x: torch.Tensor):
        """x: [T, H] -> flat ids [T, k] int64, weights [T, k] in x's dtype."""
        logits = F.linear(x, self.router)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return idx + self.base, top.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self.executor(x, ids, weights)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * swiglu_mlp(x, *self.shared)
        return out


class DenseMLP:
    def __init__(self, w: dict, layer: int):
        p = f"model.layers.{layer}.mlp."
        self.w = (w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"])

    def __call__(self, x):
        return swiglu_mlp(x, *self.w)
