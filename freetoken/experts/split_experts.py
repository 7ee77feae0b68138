"""A prompt chunk's routed experts in pieces of experts, with a hook between them (the CPU).

On a CPU-only engine a prompt chunk's MoE block reads nearly every expert of its layer whatever
the chunk's size: a 64-token chunk of the Qwen3.6-35B-A3B shape routes 512 pairs over 256
experts, ~1.3 GB of its 1.6 GB of bf16 banks, while a decode step reads k experts per token per
layer. The serving loop runs decode steps between a prompt forward's points (runtime/
interleave.py: before each layer, between key pieces of a long attention, kernels/split_keys.py);
a whole MoE block is then the costliest stretch between two points, which bounds both the
streams' gap and how large a chunk the interleaver lets through (each chunk pays the block's
reads again). Here the block's routed experts run in PIECES groups of consecutive expert ids,
the hook in effect called before group n >= 1, so a decode step can come between them.

The sums are the unsplit call's: the torch path (reference_experts, past the C++ kernel's batch
threshold) adds each expert's products into one output in expert order, pieces or not, so its
result is bit-identical; the C++ path's partial outputs (fp32) are added in fp32 and rounded
once, the same products with each token's sum grouped by piece (fp32 rounding; the whole call's
result does not depend on its thread count, the pieced one differs from it in the last bits).

Where: every MoE block that launches through launch() below (model/moe.py: Qwen3.5/3.6,
Qwen3-MoE, GPT-OSS; model/deepseek_moe.py: GLM-5; DeepSeek-V4's layer loop sets no hook) on the
CPU executor (CpuExpertExecutor.launch_pieces).
"""
from __future__ import annotations

from ..kernels.split_keys import PointHook

PIECES = 4  # groups of a layer's experts: 64 of the Qwen3.6 shape's 256 (~0.4 GB of bf16 banks) each
# a layer's experts under this many bytes run whole: reading them is cheap whatever the chunk (the
# demo's 32 are 12.6 MB in all); the Qwen3.6 shape's are 1.6 GB in bf16, 0.43 GB in MXFP4
MIN_BYTES = 64 << 20
ENABLED = True  # the A/B switch (bench.interference's interleave-noexperts setting)
# the interleaver's point before piece n >= 1 of layer i's MoE block: i + 0.5 + n * POINT_STEP,
# after the MID_LAYER point i + 0.5 and above any key piece's point (kernels/split_keys.py)
POINT_STEP = 0.001

HOOK = PointHook()


MAX_POINTS = 490  # labels stay below i + 1 whatever PIECES is (the last shared past it)
SPLITS = 0  # calls that ran in pieces (telemetry: bench.interference's rows)


def point(i: int, n: int) -> float:
    """The interleaver's label of the point before expert piece n of layer i."""
    return round(i + 0.5 + min(n, MAX_POINTS) * POINT_STEP, 3)


def is_expert_point(j: float) -> bool:
    """Whether label j is an expert piece's point (not a layer's, a MID_LAYER one or a key piece's)."""
    return j - int(j) > 0.5


def expert_points(fn):
    """Within it, a MoE block's prompt chunk on this thread runs its experts in pieces, calling
    fn(n) before piece n (n >= 1); None: whole."""
    return HOOK.use(fn)


def wanted(phase: str) -> bool:
    """Whether a MoE block's call is offered in pieces: a prompt chunk with a hook set (the
    executor's launch_pieces then runs a layer's experts whole under MIN_BYTES)."""
    return ENABLED and HOOK.fn is not None and phase == "prefill"


def worth_it(layer_bytes: int) -> bool:
    """Whether a layer whose experts hold layer_bytes runs them in pieces."""
    return layer_bytes >= MIN_BYTES


def bounds(base: int, num_experts: int, pieces: int = PIECES) -> list[tuple[int, int]]:
    """The flat-id ranges [lo, hi) of a layer's pieces (its experts base..base+num_experts-1)."""
    step = -(-num_experts // pieces)
    return [(base + a, base + min(a + step, num_experts)) for a in range(0, num_experts, step)]


def run(part, base: int, num_experts: int, hook) -> None:
    """part(lo, hi) for each piece, hook(n) before piece n >= 1 (with no expert hook in effect
    meanwhile: a short prompt's forward inside it runs its experts whole)."""
    global SPLITS
    SPLITS += 1
    for n, (lo, hi) in enumerate(bounds(base, num_experts)):
        if n:
            with expert_points(None):
                hook(n)
        part(lo, hi)


def launch(executor, x, ids, weights, base: int, num_experts: int, phase: str, **kw):
    """A MoE block's expert call: executor.launch, or for a prompt chunk with the hook set its
    launch_pieces where it has one (a wrapper that rewrites routes says it has none)."""
    if wanted(phase) and getattr(executor, "launch_pieces", None) is not None:
        return executor.launch_pieces(x, ids, weights, base, num_experts, HOOK.fn)
    return executor.launch(x, ids, weights, layer=base // num_experts, phase=phase, **kw)
