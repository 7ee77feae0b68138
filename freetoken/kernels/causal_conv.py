"""The gated DeltaNet's causal depthwise conv1d and SiLU over a prefill chunk, in one kernel.

The torch path (causal_conv_silu_torch, model/deltanet.py's reference and its CPU path) builds
the conv's input sequence by concatenating the carried conv state and the chunk's transposed
inputs ([C, K-1+N]), runs F.conv1d over it and applies SiLU: on an H100 a 32k-token pass of the
12-layer slice spent 46.7 ms of its 391 ms of GPU time there (the copy into the sequence 21.2,
the depthwise conv kernel 25.5: results/prefill_stream-profile-h100-gpu.json), for a
memory-bound operation that reads the chunk once. Here each program takes a block of tokens and
channels, reads each input tap straight from the chunk (or, for the first K-1 tokens, from the
conv state), accumulates the K products in fp32, rounds the sum to the activation dtype (where
torch's conv rounds its output) and applies SiLU to that (as torch's SiLU of it does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAS_TRITON, tl_dtype

if HAS_TRITON:  # the references below serve CPU-only installs without it
    import triton
    import triton.language as tl


def causal_conv_silu_torch(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, C] a chunk's conv inputs (token-major), state [C, K-1] the K-1 inputs before it,
    weight [C, K], bias [C] or None -> silu(conv) [N, C] in x's dtype. The reference."""
    seq = conv_sequence(x, state)  # [C, K-1+N]
    conv = F.conv1d(seq[None], weight[:, None, :], bias, groups=seq.shape[0])
    return F.silu(conv[0]).t().to(x.dtype)


def conv_sequence(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The conv's input sequence [C, K-1+N]: the state's K-1 columns, then the chunk's inputs
    (column j + K-1 is token j), in the state's dtype."""
    return torch.cat([state, x.t().to(state.dtype)], dim=-1)


def conv_state_after(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The K-1 inputs before the token after the chunk [C, K-1]: the chunk's last K-1 rows,
    preceded by the state's last columns when the chunk is shorter."""
    w, n = state.shape[1], x.shape[0]
    if n >= w:
        return x[n - w:].t().to(state.dtype)
    return conv_sequence(x, state)[:, n:]


if HAS_TRITON:
    @triton.jit
    def _causal_conv_kernel(x_ptr, state_ptr, w_ptr, b_ptr, out_ptr, N, C, stride_x, stride_o, stride_sc,
                            K: tl.constexpr, BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                            DTYPE: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT] tokens
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC] channels
        cm = cols < C
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(K):
            src = rows + (j - (K - 1))  # the input this tap reads: a chunk row, or (< 0) a state column
            in_x = (src >= 0) & (src < N)
            in_s = (src < 0) & (rows < N)
            xv = tl.load(x_ptr + tl.where(in_x, src, 0)[:, None].to(tl.int64) * stride_x + cols[None, :],
                         mask=in_x[:, None] & cm[None, :], other=0.0)
            sv = tl.load(state_ptr + cols[None, :] * stride_sc + tl.where(in_s, src + (K - 1), 0)[:, None],
                         mask=in_s[:, None] & cm[None, :], other=0.0)
            v = tl.where(in_x[:, None], xv, sv).to(tl.float32)  # both in the activation dtype
            acc += v * tl.load(w_ptr + cols * K + j, mask=cm, other=0.0).to(tl.float32)[None, :]
        y = acc.to(DTYPE).to(tl.float32)  # torch's conv output, in the activation dtype
        om = (rows < N)[:, None] & cm[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], (y / (1.0 + tl.exp(-y))).to(DTYPE),
                 mask=om)


    def causal_conv_silu_triton(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
        """causal_conv_silu_torch in one kernel. x [N, C] (rows may be a strided view of a fused
        GEMM's output, columns contiguous), state [C, K-1], weight [C, K] contiguous, bias [C] or
        None -> [N, C] in x's dtype (the conv sums in fp32, as torch's kernels accumulate)."""
        n, c = x.shape
        k = weight.shape[1]
        assert x.stride(1) == 1 and state.stride(1) == 1 and state.shape == (c, k - 1) and weight.is_contiguous()
        out = torch.empty(n, c, dtype=x.dtype, device=x.device)
        if n == 0:
            return out
        # the engine keeps the state in the activation dtype (model/state.py); with another dtype the
        # torch path would convert x to the state's instead, which this kernel does not do
        assert state.dtype == x.dtype, "the conv state must be in the activations' dtype"
        block_t, block_c = 32, 128
        _causal_conv_kernel[(triton.cdiv(n, block_t), triton.cdiv(c, block_c))](
            x, state, weight, bias if bias is not None else weight, out, n, c, x.stride(0), out.stride(0), state.stride(0),
            K=k, BIAS=bias is not None, BLOCK_T=block_t, BLOCK_C=block_c, DTYPE=tl_dtype(x.dtype))
        return out
