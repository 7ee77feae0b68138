"""The prefill gather's workspace (kernels/page_gather.py) against the fresh-tensor gather, on
random pages and block tables, as the context grows and shrinks."""
import pytest
import torch

from freetoken.kernels import page_gather
from freetoken.kernels import paged_attention as pa
from freetoken.kernels.page_gather import GatherWorkspace, gather_fresh, gather_pages
from freetoken.kernels.paged_attention import paged_prefill_attention_torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pool(g, num_pages, kvh, p, hd, dtype, device):
    return torch.randn(num_pages, kvh, p, hd, generator=g).to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workspace_gather_equals_fresh_gather(device, dtype):
    g = torch.Generator().manual_seed(3)
    ws = GatherWorkspace()
    k, v = pool(g, 300, 2, 16, 24, dtype, device), pool(g, 300, 2, 16, 24, dtype, device)
    for n in (1, 5, 64, 65, 200, 3, 130, 280):  # grows past the buffer, shrinks, grows again
        ids = torch.randperm(300, generator=g)[:n].to(device, torch.int32)
        length = n * 16 - int(torch.randint(0, 16, (1,), generator=g))  # the last page part full
        a, b = ws.gather(k, ids, length, "k"), ws.gather(v, ids, length, "v")
        assert a.shape == (2, length, 24) and a.stride(-1) == 1
        assert torch.equal(a, gather_pages(k, ids, length)), n
        assert torch.equal(b, gather_pages(v, ids, length)), n  # "v" did not overwrite "k"
        assert a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_gather_by_head_equals_plain_indexing(device, dtype):
    """gather_fresh (what the CPU's prefill attention gathers with) against gather_pages, on
    shuffled pages including the pool's last page, a partly full last page and one page."""
    g = torch.Generator().manual_seed(6)
    k = pool(g, 90, 3, 16, 24, dtype, device)
    for n in (1, 2, 17, 90):
        ids = torch.randperm(90, generator=g)[:n].to(device, torch.int32)
        length = n * 16 - int(torch.randint(0, 16, (1,), generator=g))
        out = gather_fresh(k, ids, length)
        assert out.shape == (3, length, 24) and out.stride(-1) == 1
        assert torch.equal(out, gather_pages(k, ids, length)), n
    assert gather_fresh(k, torch.tensor([4], device=device), 0).shape == (3, 0, 24)


def test_workspace_grows_geometrically_and_a_gather_overwrites_the_last():
    g = torch.Generator().manual_seed(4)
    ws = GatherWorkspace()
    k = pool(g, 2100, 1, 4, 8, torch.float32, "cpu")
    for n in range(1, 2049, 7):  # a 8k-token context prefilled in ~4-page chunks
        ws.gather(k, torch.arange(n), n * 4, "k")
    assert ws.grows <= 20, ws.grows  # O(log S), not one per chunk (293 gathers here)
    assert ws.nbytes() >= 2043 * 4 * 8 * 4
    first = ws.gather(k, torch.tensor([5, 6]), 8, "k")
    kept = first.clone()
    ws.gather(k, torch.tensor([9, 10]), 8, "k")  # the same tag: the same buffer, overwritten
    assert not torch.equal(first, kept) and torch.equal(first, gather_pages(k, torch.tensor([9, 10]), 8))
    ws.clear()
    assert ws.nbytes() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 40])
def test_prefill_attention_same_with_and_without_the_workspace(device, window, monkeypatch):
    """paged_prefill_attention_torch gathers through gather_for_prefill: forced into the
    workspace (on the CPU too), the chunks' outputs are bit for bit those of fresh gathers."""
    g = torch.Generator().manual_seed(5)
    kvh, nh, p, hd = 2, 4, 16, 32
    k, v = pool(g, 64, kvh, p, hd, torch.float32, device), pool(g, 64, kvh, p, hd, torch.float32, device)
    table = torch.randperm(64, generator=g).to(device, torch.int32)
    for start, t in ((0, 37), (37, 100), (137, 3), (140, 400)):
        q = torch.randn(t, nh, hd, generator=g).to(device)
        monkeypatch.setattr(pa, "gather_for_prefill", lambda pg, ids, n, tag, limit=0: gather_pages(pg, ids, n))
        a = paged_prefill_attention_torch(q, k, v, table, start, hd ** -0.5, window)
        monkeypatch.setattr(pa, "gather_for_prefill", page_gather.WORKSPACE.gather)
        b = paged_prefill_attention_torch(q, k, v, table, start, hd ** -0.5, window)
        assert torch.equal(a, b), (start, t)


def test_workspace_allocated_in_inference_mode_serves_outside_it_and_caps_at_the_limit():
    """A buffer first made under inference_mode (as every model entry point runs) takes a later
    gather outside it (a normal tensor, written in place); growth stops at `limit` pages."""
    g = torch.Generator().manual_seed(6)
    ws = GatherWorkspace()
    k = pool(g, 100, 2, 4, 8, torch.float32, "cpu")
    with torch.inference_mode():
        ws.gather(k, torch.arange(10), 40, "k")
    assert ws.bufs[next(iter(ws.bufs))].shape[1] == 64  # ALIGN pages
    ids = torch.randperm(100, generator=g)[:70]
    assert torch.equal(ws.gather(k, ids, 280, "k", limit=75), gather_pages(k, ids, 280))
    assert ws.bufs[next(iter(ws.bufs))].shape[1] == 75  # 128 after growth and rounding, held to 75
    assert ws.grows == 2


def test_workspace_buffers_are_per_thread():
    import threading
    g = torch.Generator().manual_seed(7)
    k = pool(g, 40, 2, 4, 8, torch.float32, "cpu")
    mine = page_gather.WORKSPACE.gather(k, torch.arange(20), 80, "t")
    seen = {}
    th = threading.Thread(target=lambda: seen.update(a=page_gather.WORKSPACE.gather(k, torch.arange(20, 40), 80, "t")))
    th.start()
    th.join()
    assert mine.data_ptr() != seen["a"].data_ptr()
    assert torch.equal(mine, gather_pages(k, torch.arange(20), 80))  # not overwritten by the other thread
    page_gather.WORKSPACE.clear()
