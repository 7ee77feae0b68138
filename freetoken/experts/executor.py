"""ExpertExecutor: where routed experts run is the executor's business, not the model's.

The MoE layer hands over activations, flat expert ids (moe_layer * E + e) and gate weights;
the executor returns the gate-weighted sum of the selected experts' outputs. Banks:
    gate_up: [N, 2I, H]  rows [0, I) are the gate projection, [I, 2I) the up projection
    down:    [N, H, I]
with N = moe_layers * E, shared by every executor whatever the physical format.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ExpertExecutor:
    """Interface. __call__(x [T, H], ids [T, k] int, weights [T, k]) -> [T, H] in x's dtype."""

    name = "abstract"

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def reference_experts(x, ids, weights, gate_up, down):
    """Pure-torch reference: loop over the distinct selected experts (as transformers does).

    Data-dependent (host sync per call); used for tests and as the large-batch CPU path.
    Computes in x's dtype; accumulates into a buffer of x's dtype in expert order.
    """
    out = torch.zeros_like(x)
    inter = gate_up.shape[1] // 2
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    pairs = order.split(counts.tolist())
    k = ids.shape[1]
    for e, pair in zip(uniq.tolist(), pairs):
        tok = pair // k
        xs = x[tok]  # [n, H]
        gu = F.linear(xs, gate_up[e].to(x.dtype))  # [n, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = F.linear(h, down[e].to(x.dtype))  # [n, H]
        y = y * weights.reshape(-1)[pair, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


class TorchExpertExecutor(ExpertExecutor):
    """All experts resident on one device (CPU host banks, or the full-VRAM GPU baseline).

    Small batches use a static-shape gather + batched GEMV (no host sync, CUDA-graph safe);
    large batches loop over distinct experts, which reads each expert once.
    """

    name = "torch"

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, static_max_pairs: int = 64):
        self.gate_up, self.down = gate_up, down
        self.static_max_pairs = static_max_pairs
        self.device = gate_up.device

    def __call__(self, x, ids, weights):
        src = x.device
        x, ids, weights = (t.to(self.device) for t in (x, ids, weights))
        if ids.numel() <= self.static_max_pairs:
            out = self._static(x, ids, weights)
        else:
            out = reference_experts(x, ids, weights, self.gate_up, self.down)
        return out.to(src)

    def _static(self, x, ids, weights):
        t, k = ids.shape
        inter = self.gate_up.shape[1] // 2
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
        gu = torch.bmm(self.gate_up[flat].to(x.dtype), xs)[..., 0]  # [T*k, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = torch.bmm(self.down[flat].to(x.dtype), h[:, :, None])[..., 0]  # [T*k, H]
        y = y * weights.reshape(-1, 1).to(x.dtype)
        return y.view(t, k, -1).sum(1)
