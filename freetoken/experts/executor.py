"""ExpertExecutor: where routed experts run is the executor's business, not the model's.

The MoE layer hands over activations, flat expert ids (moe_layer * E + e) and gate weights;
the executor returns the gate-weighted sum of the selected experts' outputs. Banks:
    gate_up: [N, 2I, H]  rows [0, I) are the gate projection, [I, 2I) the up projection
    down:    [N, H, I]
with N = moe_layers * E, shared by every executor whatever the physical format. What an expert
computes between the two projections is data too: an `Activation` (SiLU-gated for Qwen, the
clamped SwiGLU for GPT-OSS), and optional bias banks gate_up_bias [N, 2I] (gate then up, as the
rows) and down_bias [N, H], given to the executor when it is built; the MoE layer checks that its
executor computes the model's function (model/moe.py). A bank is a
float tensor of that shape (bf16/f16/f32), or a banks.QuantBank (fp8_block, mxfp4, nvfp4: the
published bytes and their scales) whose `shape` is that shape: the torch paths below dequantize
just the selected experts with quant.py's reference (banks.take); on CUDA the Triton kernels of
kernels/moe_quant.py read the quantized bytes in place.

The call is split in two phases so that the MoE layer can compute its shared expert while the
routed experts run elsewhere (the CPU pool, later a PCIe fill): `launch` starts the work and
returns a handle, `finish` waits for it and returns the sum. Rows that are not running (idle
or mid-prefill batch slots) carry the id NO_EXPERT: every kernel and the C++ executor skip
those pairs, so they neither cost expert reads nor touch any cache state, and their output
rows are zero. Partial results are merged in one fixed order (the executor's output, then the
shared expert) whatever the placement.
"""
from __future__ import annotations

import threading

from concurrent.futures import Future
from typing import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import HAS_TRITON, use_triton
from .banks import take

NO_EXPERT = -1  # routed id of a pair that runs nowhere (a batch row that is not running)
# Held while a CUDA graph is captured (runtime/decode_runner.py). Capture is global-mode: a
# device sync from any other thread invalidates it, so code that reads device state from
# another thread (an executor's stats() for /metrics) takes this lock first
GRAPH_CAPTURE = threading.RLock()
ACTIVATIONS = ("silu", "swiglu_clamp", "silu_clamp")


@dataclass(frozen=True)
class Activation:
    """What a routed expert computes from gu = x Wgu^T (+ gate_up bias) [.., 2I], gate half g then
    up half u, before the down projection:
        silu          silu(g) * u                                             (Qwen, DeepSeek, ...)
        swiglu_clamp  g' = min(g, limit), u' = clamp(u, -limit, limit):
                      (u' + 1) * g' * sigmoid(alpha * g')                     (GPT-OSS)
        silu_clamp    silu(g') * u', g' and u' as above                       (DeepSeek-V4)
    alpha only means something for swiglu_clamp, limit for both clamped kinds."""
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.kind!r}; known: {', '.join(ACTIVATIONS)}")

    @classmethod
    def of(cls, cfg) -> "Activation":
        """The activation a ModelConfig's experts use."""
        if cfg.expert_activation == "silu":
            return SILU
        return cls(cfg.expert_activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))

    @property
    def code(self) -> int:
        """The kernels' constexpr for it."""
        return ACTIVATIONS.index(self.kind)

    def __call__(self, gu: torch.Tensor) -> torch.Tensor:
        """The torch reference: gu [..., 2I] -> [..., I] in gu's dtype, op by op as transformers
        computes it (each op rounded to the dtype)."""
        inter = gu.shape[-1] // 2
        g, u = gu[..., :inter], gu[..., inter:]
        if self.kind == "silu":
            return F.silu(g) * u
        if self.kind == "silu_clamp":  # as transformers' DeepseekV4Experts: clamp, then act(g) * u
            return F.silu(g.clamp(max=self.limit)) * u.clamp(min=-self.limit, max=self.limit)
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


SILU = Activation()


def expert_bias_banks(meta: dict, tensors: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(gate_up_bias [N, 2I], down_bias [N, H]) of an FTW file (meta["banks"] names them), or
    (None, None) for experts without biases."""
    b = meta.get("banks") or {}
    return tensors.get(b.get("gate_up_bias") or ""), tensors.get(b.get("down_bias") or "")


@dataclass
class Pending:
    """An expert call in flight: the result tensor, a future that yields it, or `join`, a
    function that waits for the parts still running and merges them (the GPU expert cache:
    the CPU branch's wait and the merge are enqueued by finish, after the shared expert)."""
    out: torch.Tensor | None = None
    future: Future | None = None
    join: Callable[[], torch.Tensor] | None = None


class ExpertExecutor:
    """Interface. launch(x [T, H], ids [T, k] int, weights [T, k], layer, phase) -> Pending;
    finish(Pending) -> [T, H] in x's dtype and device."""

    name = "abstract"
    backend = "abstract"  # what computes the experts, as reported in /health and /metrics
    capturable = False  # launch + finish may be recorded into a CUDA graph
    needs_pinned_staging = False  # inputs and outputs cross the PCIe link each call
    # the expert function this executor computes; executors that take another one (the torch
    # paths, the C++ executor, the GPU expert cache) set these when built
    activation: Activation = SILU
    gate_up_bias: torch.Tensor | None = None  # [N, 2I]
    down_bias: torch.Tensor | None = None  # [N, H]

    def launch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int = 0,
               phase: str = "decode") -> Pending:
        """phase: "decode" (one token per running row) or "prefill" (a chunk of prompt tokens)."""
        return Pending(out=self.run(x, ids, weights, phase))

    def finish(self, pending: Pending) -> torch.Tensor:
        if pending.join is not None:
            return pending.join()
        return pending.out if pending.future is None else pending.future.result()

    def run(self, x, ids, weights, phase: str) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, phase: str = "decode"):
        return self.finish(self.launch(x, ids, weights, phase=phase))

    def stats(self) -> dict:
        """Counters for /metrics (calls, routed pairs, skipped pairs)."""
        return {}


def reference_experts(x, ids, weights, gate_up, down, activation: Activation = SILU, gate_up_bias=None,
                      down_bias=None, out=None, lo: int = 0, hi: int | None = None):
    """Pure-torch reference: loop over the distinct selected experts (as transformers does).

    Data-dependent (host sync per call); used for tests and as the large-batch CPU path.
    Computes in x's dtype; accumulates into a buffer of x's dtype in expert order. Pairs with
    the id NO_EXPERT are skipped. Quantized banks (QuantBank): each selected expert is
    dequantized to x's dtype once per call. Biases are added after each projection's product
    (rounded in between, as `x @ W + b` is).
    out, lo, hi: only the experts lo <= e < hi, added into out (calls over consecutive ranges
    into one out add in the order one whole call does: experts/split_experts.py).
    """
    quantized = not isinstance(gate_up, torch.Tensor)
    out = torch.zeros_like(x) if out is None else out
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    uniq, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    pairs = order.split(counts.tolist())
    k = ids.shape[1]
    for e, pair in zip(uniq.tolist(), pairs):
        if e < lo or (hi is not None and e >= hi):  # NO_EXPERT (-1) is below any lo
            continue
        tok = pair // k
        xs = x[tok]  # [n, H]
        if quantized:
            w_gu, w_dn = gate_up.dequant(e, x.dtype), down.dequant(e, x.dtype)
        else:
            w_gu, w_dn = gate_up[e].to(x.dtype), down[e].to(x.dtype)
        gu = F.linear(xs, w_gu)  # [n, 2I]
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].to(x.dtype)
        h = activation(gu)  # [n, I]
        y = F.linear(h, w_dn)  # [n, H]
        if down_bias is not None:
            y = y + down_bias[e].to(x.dtype)
        y = y * weights.reshape(-1)[pair, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


class TorchExpertExecutor(ExpertExecutor):
    """All experts resident on one device (CPU host banks, or the full-VRAM GPU baseline).

    Decode takes a static-shape path with no host sync, CUDA-graph safe: on CUDA the fused
    Triton GEMV that reads experts in place (kernels/moe_decode.py), else a gather + batched
    GEMV; a large decode batch goes to the grouped kernel, which is static-shape too. Prefill
    chunks group tokens by expert: on CUDA the grouped Triton GEMM, on the CPU a loop over the
    experts present. Synchronous: launch computes, finish returns it.

    Quantized banks (QuantBank): on CUDA the kernels of kernels/moe_quant.py (decode GEMV and
    grouped GEMM, dequantizing in registers), captured like the bf16 ones; elsewhere the same
    static decode / reference paths with the selected experts dequantized in place of the gather,
    not capturable (quant.py's fp4 unpacking builds its lookup table on the device each call, a
    host copy a capture refuses).

    Every path takes the expert function as data: `activation` (an Activation) and the optional
    bias banks gate_up_bias [N, 2I] and down_bias [N, H] (moved to the banks' device).
    """

    name = "torch"
    capturable = True

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, static_max_pairs: int = 64,
                 layer_experts: int | None = None, activation: Activation = SILU,
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None):
        self.gate_up, self.down = gate_up, down
        self.static_max_pairs = static_max_pairs
        self.layer_experts = layer_experts  # experts one call can route to (bounds the tile grid)
        self.device = gate_up.device
        self.activation = activation
        self.gate_up_bias = gate_up_bias.to(self.device) if gate_up_bias is not None else None
        self.down_bias = down_bias.to(self.device) if down_bias is not None else None
        self.quantized = not isinstance(gate_up, torch.Tensor)  # banks.QuantBank
        if self.quantized and not (HAS_TRITON and self.device.type == "cuda"):
            self.capturable = False  # the torch dequantization path (see above)

    @property
    def backend(self) -> str:
        return "gpu-resident" if self.device.type == "cuda" else "torch"

    def run(self, x, ids, weights, phase):
        """ids: int64 or int32, widened here for every path. The decode kernels could read int32,
        but Triton's autotuner keys on argument dtypes and tuned int32 routes apart from int64
        ones: another tiling, another summation order, results no longer bit-equal (H100, plan
        105). Torch's scatter and index ops need int64 anyway."""
        src = x.device
        x, ids, weights = (t.to(self.device) for t in (x, ids, weights))
        ids = ids.long()  # no copy when already int64
        fn = dict(activation=self.activation, gate_up_bias=self.gate_up_bias, down_bias=self.down_bias)
        static = phase == "decode" and ids.numel() <= self.static_max_pairs
        if use_triton(x) and static:
            if self.quantized:  # QuantBanks: the kernels that dequantize in registers
                from ..kernels.moe_quant import moe_quant_decode_triton as decode
            else:
                from ..kernels.moe_decode import moe_decode_triton as decode
            return decode(x, ids, weights, self.gate_up, self.down, **fn).to(src)
        if use_triton(x):
            if self.quantized:
                from ..kernels.moe_quant import moe_quant_grouped_triton as grouped
            else:
                from ..kernels.moe_grouped import moe_grouped_triton as grouped
            out = grouped(x, ids, weights, self.gate_up, self.down, self.layer_experts, **fn)
        elif static:
            out = self._static(x, ids, weights)
        elif x.is_cuda:
            out = self._grouped(x, ids, weights)
        else:
            out = reference_experts(x, ids, weights, self.gate_up, self.down, **fn)
        return out.to(src)

    def _grouped(self, x, ids, weights):
        """Tokens grouped by expert, padded to the largest group: one bmm per projection and
        one host sync per call, instead of a kernel chain per expert."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        experts, slot_of, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        order = torch.argsort(slot_of, stable=True)
        width = int(counts.max())  # the one host sync
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(flat.numel(), device=x.device) - starts[slot_of[order]]
        xs = torch.zeros(experts.numel(), width, x.shape[1], dtype=x.dtype, device=x.device)
        xs[slot_of[order], rank] = x[order // k]  # [G, W, H]
        sel = experts.clamp(min=0)
        gu = torch.bmm(xs, take(self.gate_up, sel, x.dtype).transpose(1, 2))  # [G, W, 2I]
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[sel, None].to(x.dtype)
        h = self.activation(gu)  # [G, W, I]
        y = torch.bmm(h, take(self.down, sel, x.dtype).transpose(1, 2))  # [G, W, H]
        if self.down_bias is not None:
            y = y + self.down_bias[sel, None].to(x.dtype)
        keep = (flat[order] >= 0).to(x.dtype)[:, None]  # NO_EXPERT pairs add nothing
        y = y[slot_of[order], rank] * weights.reshape(-1)[order, None].to(x.dtype) * keep  # [P, H]
        # back to pair order and a sum over each token's k pairs: a fixed order (index_add_ on CUDA
        # adds with atomics, so two equal calls differed in the last bits on an H100, plan 106)
        pairs = torch.empty_like(y)
        pairs[order] = y  # [T*k, H]
        return pairs.view(t, k, -1).sum(1)

    def _static(self, x, ids, weights):
        t, k = ids.shape
        flat = ids.reshape(-1)
        keep = (flat >= 0).to(x.dtype)[:, None]  # [T*k, 1]: NO_EXPERT pairs add nothing
        flat = flat.clamp(min=0)
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [T*k, H, 1]
        gu = torch.bmm(take(self.gate_up, flat, x.dtype), xs)[..., 0]  # [T*k, 2I]
        if self.gate_up_bias is not None:
            gu = gu + self.gate_up_bias[flat].to(x.dtype)
        h = self.activation(gu)  # [T*k, I]
        y = torch.bmm(take(self.down, flat, x.dtype), h[:, :, None])[..., 0]  # [T*k, H]
        if self.down_bias is not None:
            y = y + self.down_bias[flat].to(x.dtype)
        y = y * weights.reshape(-1, 1).to(x.dtype) * keep
        return y.view(t, k, -1).sum(1)


class QuantizedHostExecutor(TorchExpertExecutor):
    """`--experts cpu` when the C++ executor cannot be built (quantized banks or any expert
    function): the torch path over the host banks, as the CPU executor's own fallback runs it (reference_experts for every call: each distinct expert
    dequantized once), reported as "torch-fallback". On CUDA the activations cross to the host
    and back, as with the C++ executor."""

    name = "cpu"
    backend = "torch-fallback"
    capturable = False
    needs_pinned_staging = True

    def __init__(self, gate_up, down, layer_experts: int | None = None, activation: Activation = SILU,
                 gate_up_bias=None, down_bias=None):
        super().__init__(gate_up, down, static_max_pairs=0, layer_experts=layer_experts, activation=activation,
                         gate_up_bias=gate_up_bias, down_bias=down_bias)
        self.threads = torch.get_num_threads()
        self.isa = "torch"
        self.calls = self.pairs = 0

    def run(self, x, ids, weights, phase):
        self.calls += 1
        self.pairs += ids.numel()
        src = x.device
        out = reference_experts(x.to(self.device), ids.to(self.device), weights.to(self.device),
                                self.gate_up, self.down, self.activation, self.gate_up_bias, self.down_bias)
        return out.to(src)

    def stats(self) -> dict:
        return {"calls": self.calls, "pairs": self.pairs}
