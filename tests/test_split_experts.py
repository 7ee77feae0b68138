"""A prompt chunk's routed experts in pieces with a hook between them (experts/split_experts.py):
the same output as the whole call (bit-identical on the torch path, fp32 rounding on the C++
path), the hook before every piece but the first, and no pieces for a layer of few bytes."""
import pytest
import torch

from freetoken.experts import split_experts
from freetoken.experts.cpu import CpuExpertExecutor
from freetoken.experts.executor import NO_EXPERT, reference_experts


def banks(n, h, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(dtype),
            (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype))


def routes(t, h, k, base, e, seed, dtype):
    """x [T, H], ids [T, k] of one layer (flat ids base..base+e-1, a few rows NO_EXPERT), weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) + base
    ids[::7] = NO_EXPERT  # rows that route nowhere (inactive decode rows in a mixed batch)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    return x, ids, w


def test_bounds_cover_the_layer_in_consecutive_ranges():
    assert split_experts.bounds(256, 256) == [(256, 320), (320, 384), (384, 448), (448, 512)]
    assert split_experts.bounds(0, 10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert split_experts.bounds(32, 2, 4) == [(32, 33), (33, 34)]


def test_point_labels_sit_above_the_mid_layer_point_and_key_points():
    from freetoken.kernels import split_keys
    assert split_experts.point(3, 1) == 3.501 and split_experts.point(3, 3) == 3.503
    for j in (3.501, 3.503):
        assert split_experts.is_expert_point(j) and not split_keys.is_key_point(j)
    for j in (3, 3.5, split_keys.point(3, 7)):
        assert not split_experts.is_expert_point(j)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [5, 40])  # the C++ kernel's batch sizes, and past its threshold (set to 16)
def test_pieces_give_the_whole_calls_output_and_hook_between_them(dtype, t, monkeypatch):
    monkeypatch.setattr(split_experts, "MIN_BYTES", 0)
    e, h, i, k = 24, 64, 32, 4
    gu, dn = banks(3 * e, h, i, dtype, seed=t)  # three layers: the middle one runs
    ex = CpuExpertExecutor(gu, dn, torch_batch_threshold=16)
    x, ids, w = routes(t, h, k, e, e, seed=t + 1, dtype=dtype)
    whole = ex.launch(x, ids, w, layer=1, phase="prefill").out
    seen = []
    pieced = ex.launch_pieces(x, ids, w, e, e, seen.append).out
    assert seen == [1, 2, 3] and pieced.dtype == dtype and pieced.shape == x.shape
    if t > 16:  # the torch path adds expert by expert into one output either way
        assert torch.equal(pieced, whole)
    else:  # the kernel's fp32 partial sums added in fp32, rounded once
        torch.testing.assert_close(pieced.float(), whole.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-2)
    ref = reference_experts(x.float(), ids, w.float(), gu.float(), dn.float())
    torch.testing.assert_close(pieced.float(), ref, rtol=2e-2, atol=2e-2)


def test_reference_ranges_into_one_output_equal_one_call():
    e, h, i, k = 12, 32, 16, 3
    gu, dn = banks(e, h, i, torch.float32, seed=5)
    x, ids, w = routes(9, h, k, 0, e, seed=6, dtype=torch.float32)
    out = torch.zeros_like(x)
    for lo, hi in split_experts.bounds(0, e, 5):
        reference_experts(x, ids, w, gu, dn, out=out, lo=lo, hi=hi)
    assert torch.equal(out, reference_experts(x, ids, w, gu, dn))


def test_a_layer_of_few_bytes_runs_whole_without_the_hook():
    gu, dn = banks(16, 64, 32, torch.float32, seed=7)  # 16 experts of 24 KB: far under MIN_BYTES
    ex = CpuExpertExecutor(gu, dn)
    x, ids, w = routes(6, 64, 4, 0, 16, seed=8, dtype=torch.float32)
    seen = []
    assert torch.equal(ex.launch_pieces(x, ids, w, 0, 16, seen.append).out, ex.launch(x, ids, w, phase="prefill").out)
    assert seen == []


def test_the_hooks_own_work_sees_no_expert_hook():
    """A forward inside the hook (a short prompt's, runtime/loop.py _jump_in) runs its experts whole."""
    inside = []
    with split_experts.expert_points(lambda n: None):
        split_experts.run(lambda lo, hi: None, 0, 8, lambda n: inside.append(split_experts.HOOK.fn))
        assert split_experts.HOOK.fn is not None
    assert inside == [None, None, None] and split_experts.HOOK.fn is None


def test_a_wrapper_that_expands_routes_is_not_split_through_its_inner_executor():
    """PiecedExecutor (experts/pieces.py) hands unknown attributes to its inner executor; a call in
    expert pieces through it would skip its route expansion, so it says it has none."""
    from freetoken.experts.pieces import PiecedExecutor
    gu, dn = banks(8, 32, 16, torch.float32, seed=9)
    wrapped = PiecedExecutor(CpuExpertExecutor(gu, dn), 2)
    assert getattr(wrapped, "launch_pieces", None) is None


def test_split_calls_are_counted(monkeypatch):
    monkeypatch.setattr(split_experts, "MIN_BYTES", 0)
    gu, dn = banks(16, 32, 16, torch.float32, seed=10)
    ex = CpuExpertExecutor(gu, dn)
    x, ids, w = routes(6, 32, 2, 0, 16, seed=11, dtype=torch.float32)
    before = split_experts.SPLITS
    ex.launch_pieces(x, ids, w, 0, 16, lambda n: None)
    assert split_experts.SPLITS == before + 1
