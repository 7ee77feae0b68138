"""The prefill attention in key pieces (kernels/split_keys.py) against the whole-context paged
attention and the fp32 reference, on random pages, and its hook's points."""
import pytest
import torch

from freetoken.kernels import split_keys
from freetoken.kernels.paged_attention import paged_prefill_attention_torch
from freetoken.kernels.split_keys import attention_lse, attention_lse_torch, key_points, merge


def pool(g, pages, kvh, p, hd, dtype):
    return torch.randn(pages, kvh, p, hd, generator=g).to(dtype)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(split_keys, "KEY_PIECE", 64)  # 4 pages of 16 a piece: several pieces at small sizes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_lse_equals_the_reference(causal, dtype):
    g = torch.Generator().manual_seed(11)
    nh, kvh, hd, t = 6, 2, 32, 19
    s = t if causal else 200
    q = torch.randn(nh, t, hd, generator=g).to(dtype)
    k, v = torch.randn(kvh, s, hd, generator=g).to(dtype), torch.randn(kvh, s, hd, generator=g).to(dtype)
    o, lse = attention_lse(q, k, v, 0.17, causal)
    ro, rlse = attention_lse_torch(q, k, v, 0.17, causal)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert o.shape == (nh, t, hd) and lse.shape == (nh, t) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, rlse, atol=tol, rtol=tol)
    torch.testing.assert_close(o.float(), ro.float(), atol=tol, rtol=tol)


def test_merge_of_pieces_is_attention_over_their_union():
    g = torch.Generator().manual_seed(12)
    q = torch.randn(4, 7, 16, generator=g)
    k, v = torch.randn(2, 90, 16, generator=g), torch.randn(2, 90, 16, generator=g)
    whole = attention_lse_torch(q, k, v, 0.25, False)[0]
    parts = [attention_lse_torch(q, k[:, a:b], v[:, a:b], 0.25, False) for a, b in ((0, 13), (13, 60), (60, 90))]
    torch.testing.assert_close(merge(parts, q.dtype), whole, atol=1e-6, rtol=1e-5)


def whole_context(q, k, v, table, start, scale, monkeypatch):
    """The whole-context path (gather + SDPA with the bottom-right causal bias), pieces off."""
    with monkeypatch.context() as m:
        m.setattr(split_keys, "wanted", lambda *a: False)
        return paged_prefill_attention_torch(q, k, v, table, start, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,t", [(65, 1), (200, 37), (256, 64), (517, 5)])
def test_split_equals_whole_context_attention_and_hooks_between_pieces(small_pieces, dtype, start, t, monkeypatch):
    g = torch.Generator().manual_seed(13)
    kvh, nh, p, hd = 2, 8, 16, 32
    pages = -(-(start + t) // p) + 6
    k, v = pool(g, pages, kvh, p, hd, dtype), pool(g, pages, kvh, p, hd, dtype)
    table = torch.randperm(pages, generator=g).to(torch.int32)
    q = torch.randn(t, nh, hd, generator=g).to(dtype)
    whole = whole_context(q, k, v, table, start, hd ** -0.5, monkeypatch)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    if dtype == torch.float32:  # fp32 runs in pieces without a hook too (faster, no added rounding)
        assert split_keys.wanted(q, start, None, None)
        torch.testing.assert_close(paged_prefill_attention_torch(q, k, v, table, start, hd ** -0.5), whole,
                                   atol=tol, rtol=tol)
    seen = []
    with key_points(seen.append):
        split = paged_prefill_attention_torch(q, k, v, table, start, hd ** -0.5)
    assert seen == list(range(1, len(split_keys.splits(start, p))))  # before every piece but the first
    assert len(seen) >= 1
    torch.testing.assert_close(split.float(), whole.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("start,t", [(1, 1), (16, 20), (40, 3)])
def test_fp32_chunks_after_a_short_context_run_in_one_piece_and_equal_the_whole(small_pieces, start, t,
                                                                               monkeypatch):
    """fp32 without a hook: one piece of context (start <= KEY_PIECE, here as little as one key)
    and the chunk's own keys, merged; equal to the whole-context path."""
    g = torch.Generator().manual_seed(16)
    kvh, nh, p, hd = 2, 4, 16, 16
    k, v = pool(g, 10, kvh, p, hd, torch.float32), pool(g, 10, kvh, p, hd, torch.float32)
    table = torch.randperm(10, generator=g).to(torch.int32)
    q = torch.randn(t, nh, hd, generator=g)
    assert split_keys.wanted(q, start, None, None) and not split_keys.wanted(q, 0, None, None)
    torch.testing.assert_close(paged_prefill_attention_torch(q, k, v, table, start, 0.25),
                               whole_context(q, k, v, table, start, 0.25, monkeypatch), atol=1e-5, rtol=1e-5)


def test_when_the_attention_runs_in_pieces(small_pieces):
    g = torch.Generator().manual_seed(14)
    q = torch.randn(3, 4, 16, generator=g).bfloat16()
    assert not split_keys.wanted(q, 500, None, None)  # bf16 without a hook: whole (one rounding fewer)
    assert split_keys.wanted(q.float(), 500, None, None)  # fp32: in pieces, hook or not
    with key_points(lambda k: None):
        assert split_keys.wanted(q, 500, None, None)
        assert not split_keys.wanted(q, 500, 128, None)  # a sliding window reads its window only
        assert not split_keys.wanted(q, 500, None, torch.zeros(4))  # sinks: the sinks' own path
        assert not split_keys.wanted(q, 64, None, None)  # bf16, one piece of context: nothing to split
        assert not split_keys.wanted(q[:0], 500, None, None)  # an empty chunk (the CPU kernel dies on one)
        assert not split_keys.wanted(q.float(), 0, None, None)  # a prompt's first chunk: causal alone
        with key_points(None):  # what a forward inside the hook sees
            assert not split_keys.wanted(q, 500, None, None)


def test_a_forward_inside_the_hook_does_not_split(small_pieces):
    """The hook runs with no hook in effect: a short prompt prefilled inside it (the loop's
    jump-in) calls no hook (and in bf16 attends whole)."""
    g = torch.Generator().manual_seed(15)
    kvh, nh, p, hd = 1, 2, 16, 16
    k, v = pool(g, 40, kvh, p, hd, torch.float32), pool(g, 40, kvh, p, hd, torch.float32)
    table = torch.arange(40, dtype=torch.int32)
    q = torch.randn(4, nh, hd, generator=g)
    calls, inner = [], []

    def hook(n):
        calls.append(n)
        inner.append(split_keys.HOOK.fn is not None or split_keys.wanted(q.bfloat16(), 300, None, None))
    with key_points(hook):
        paged_prefill_attention_torch(q, k, v, table, 300, 0.25)
    assert calls and not any(inner)
