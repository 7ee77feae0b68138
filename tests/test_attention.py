"""Attention paths against a plain masked-softmax reference in float32, on fresh random
inputs: prefill chunks after cached keys (GQA, causal aligned to the chunk's end, sliding
window) and batched decode over strided cache views. On CUDA they run in bfloat16 too, which
takes the flash kernel for the chunk."""
import pytest
import torch

from freetoken.model.attention import decode_attention, prefill_attention

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(q, k, v, mask, scale):
    """q: [nh, T, hd]; k, v: [kvh, S, hd]; mask: [T, S] bool -> [nh, T, hd] in float32."""
    g = q.shape[0] // k.shape[0]
    k, v = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = (q.float() @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v


def causal(t, s, window=0):
    qp = torch.arange(s - t, s)[:, None]
    j = torch.arange(s)[None]
    m = j <= qp
    return m & (j > qp - window) if window else m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,s,window", [(7, 7, 0), (5, 40, 0), (33, 100, 0), (16, 50, 8)])
def test_prefill_attention(device, dtype, t, s, window):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bfloat16 is the GPU path")
    gen = torch.Generator().manual_seed(t * s + window)
    q, k, v = (torch.randn(n, l, 64, generator=gen).to(device, dtype) for n, l in ((8, t), (2, s), (2, s)))
    mask = causal(t, s, window).to(device)
    out = prefill_attention(q, k, v, mask if window else None, 0.125)
    ref = reference(q, k, v, mask, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.float() - ref).abs().max()) < tol * float(ref.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(device, dtype):
    gen = torch.Generator().manual_seed(3)
    b, nh, kvh, hd, cap, length = 3, 8, 2, 64, 64, 37
    cache_k = torch.randn(b + 1, kvh, cap, hd, generator=gen).to(device, dtype)  # a strided slot view
    cache_v = torch.randn(b + 1, kvh, cap, hd, generator=gen).to(device, dtype)
    q = torch.randn(b, nh, hd, generator=gen).to(device, dtype)
    pos = torch.tensor([36, 3, 20], device=device)
    mask = torch.arange(length, device=device)[None] <= pos[:, None]  # [B, L]
    out = decode_attention(q, cache_k[:b, :, :length], cache_v[:b, :, :length], mask, hd ** -0.5)
    for i in range(b):
        ref = reference(q[i][:, None], cache_k[i, :, :length], cache_v[i, :, :length], mask[i][None], hd ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((out[i].float() - ref[:, 0]).abs().max()) < tol * float(ref.abs().max())
