"""experts/cpu/denormals: flush-to-zero on the caller and torch's OpenMP team while the gated
DeltaNet chunk rule runs on the CPU (its decays' products are fp32 denormals, ~10x slower on x86)."""
import pytest
import torch

from freetoken.experts.cpu import extension
from freetoken.experts.cpu.denormals import flushed
from freetoken.model.deltanet import chunk_gated_delta_rule

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ executor could not be built")
CPU = torch.device("cpu")
TINY = 1e-20  # TINY * TINY = 1e-40: an fp32 denormal


def denormal_share(x: torch.Tensor) -> float:
    return float(((x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)).float().mean())


def products() -> torch.Tensor:
    """1e-40 in every element of a tensor large enough for torch to split it over its threads."""
    a = torch.full((1 << 21,), TINY)
    return a * a


def test_every_thread_flushes_inside_and_none_after():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a worker thread computes part of the product even on one core
    try:
        assert denormal_share(products()) == 1.0  # IEEE outside: every element a denormal
        torch.set_flush_denormal(True)  # torch's own switch: the caller's thread only
        try:
            part = denormal_share(products())
        finally:
            torch.set_flush_denormal(False)
        assert 0 < part < 1, part  # so a worker thread computed part of the product, unflushed
        with flushed(CPU):
            inside = products()
        assert float(inside.abs().max()) == 0.0  # the workers' halves flushed too, not only the caller's
        assert denormal_share(products()) == 1.0  # cleared on the way out, on the workers as well
    finally:
        torch.set_num_threads(threads)


def test_a_caller_that_flushes_keeps_it_and_the_team_is_cleared():
    """torch.set_flush_denormal(True) before (the caller only): the caller keeps it after, and the
    team's other threads, which torch cannot set, are cleared again."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.set_flush_denormal(True)
    try:
        with flushed(CPU):
            pass
        assert float((torch.tensor([TINY]) * TINY).abs().max()) == 0.0  # one element: the caller's
    finally:
        torch.set_flush_denormal(False)
    try:
        assert denormal_share(products()) == 1.0  # no thread left flushing
    finally:
        torch.set_num_threads(threads)


def test_nested_uses_leave_it_to_the_outermost():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with flushed(CPU):
            with flushed(CPU):
                pass
            assert float(products().abs().max()) == 0.0  # still on after the inner one ended
        assert denormal_share(products()) == 1.0
    finally:
        torch.set_num_threads(threads)


def test_off_switch_and_other_devices(monkeypatch):
    monkeypatch.setattr("freetoken.experts.cpu.denormals.FLUSH", False)
    with flushed(CPU):
        assert denormal_share(products()) == 1.0
    monkeypatch.setattr("freetoken.experts.cpu.denormals.FLUSH", True)
    with flushed(torch.device("meta")):  # not the CPU: nothing set
        assert denormal_share(products()) == 1.0


def test_chunk_rule_same_inside_on_fast_decays():
    """Gates that decay past e^-87 within a chunk (the case that made denormals): the same output
    and state, bit for bit here, with and without the flush."""
    g = torch.Generator().manual_seed(11)
    t, h, d = 200, 4, 32
    q = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(t, h, d, generator=g), dim=-1)
    v = torch.randn(t, h, d, generator=g)
    decay = -torch.rand(t, h, generator=g) * 3.3  # cumulative log-decay ~-100 over 64 tokens
    beta = torch.rand(t, h, generator=g)
    state = torch.randn(h, d, d, generator=g)
    out, new, _ = chunk_gated_delta_rule(q, k, v, decay, beta, state.clone())
    with flushed(CPU):
        out_f, new_f, _ = chunk_gated_delta_rule(q, k, v, decay, beta, state.clone())
    assert float(out.abs().max()) > 0.01
    assert torch.allclose(out_f, out, rtol=0, atol=1e-30) and torch.allclose(new_f, new, rtol=0, atol=1e-30)
