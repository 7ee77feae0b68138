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
