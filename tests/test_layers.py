"""Small layer helpers against their plain torch forms, on fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

from freetoken.model.layers import lm_head


@pytest.mark.parametrize("n", [1, 2, 5, 33, 40])
def test_lm_head_matches_linear(n):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(5000, 96, generator=g)
    h = torch.randn(n, 96, generator=g)
    got = lm_head(h, w)
    ref = F.linear(h, w)
    assert got.shape == ref.shape == (n, 5000)
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: the padding is for cuBLAS's aligned kernels"))])
def test_fused_linear_pads_unaligned_rows_on_cuda(dev, monkeypatch):
    """A fused projection whose rows are not whole 16 bytes (the MoE block's router, shared
    expert and one-row gate: 1,281 rows for Qwen3.6) gets zero rows on CUDA with
    FREETOKEN_PREFILL_KERNELS=1, never on the CPU nor without it; each output is the plain
    product, the padding never returned, part() still views each weight."""
    from freetoken.model.layers import FusedLinear
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "0")
    assert FusedLinear([torch.zeros(13, 64, device=dev)]).groups[0][3] == 0
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "1")
    g = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    ws = [torch.randn(r, 64, generator=g).to(dev, dtype) for r in (24, 13, 1)]
    bs = [torch.randn(r, generator=g).to(dev, dtype) for r in (24, 13, 1)]
    x = torch.randn(9, 64, generator=g).to(dev, dtype)
    fl = FusedLinear(ws, bs)
    pad = fl.groups[0][3]
    assert pad == (2 if dev == "cuda" else 0)  # 38 rows -> 40 (8 bf16 values a 16-byte row)
    outs = fl(x)
    assert len(outs) == 3
    for y, w, b in zip(outs, ws, bs):
        ref = F.linear(x.float(), w.float(), b.float())
        assert y.shape == ref.shape
        assert float((y.float() - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    for i, (w, b) in enumerate(zip(ws, bs)):
        wi, bi = fl.part(i)
        assert torch.equal(wi, w) and torch.equal(bi, b)


def test_a_bad_prefill_kernels_value_is_named(monkeypatch):
    """FREETOKEN_PREFILL_KERNELS takes 0 or 1; anything else is one clear error (the engine
    checks it at load, on any device), never a silent choice."""
    from freetoken.errors import FreeTokenError
    from freetoken.kernels import prefill_kernels
    for raw, on in (("0", False), ("1", True)):
        monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", raw)
        assert prefill_kernels() is on
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "yes")
    with pytest.raises(FreeTokenError, match="FREETOKEN_PREFILL_KERNELS must be 0 or 1, got 'yes'"):
        prefill_kernels()
