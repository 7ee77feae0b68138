"""Host buffers for weight banks (weights/hostmem.py): alignment, owned padding, huge pages."""
import pytest
import torch

from freetoken.weights import hostmem
from freetoken.weights.ftw import ALIGN
from freetoken.weights.reader import _aligned_buffer


@pytest.mark.parametrize("text,mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                                       ("always madvise [never]\n", "never"), ("garbage\n", "unavailable")])
def test_thp_mode_reads_the_bracketed_setting(tmp_path, text, mode):
    p = tmp_path / "enabled"
    p.write_text(text)
    assert hostmem.thp_mode(str(p)) == mode


def test_thp_mode_without_the_file():
    assert hostmem.thp_mode("/nonexistent/enabled") == "unavailable"


@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 3 << 20, (5 << 20) + 123])
@pytest.mark.parametrize("huge", [False, True])
def test_buffers_are_aligned_and_own_their_padding(nbytes, huge):
    b = hostmem.host_buffer(nbytes, huge=huge)
    assert b.dtype == torch.uint8 and b.numel() >= nbytes and b.numel() % ALIGN == 0
    assert b.data_ptr() % ALIGN == 0
    if huge and nbytes >= hostmem.HUGE:
        assert b.data_ptr() % hostmem.HUGE == 0
    # every byte up to the padded end belongs to the buffer: writing it all is safe
    b.fill_(7)
    assert int(b[-1]) == 7 and int(b[0]) == 7


def test_host_tensor_has_the_shape_and_dtype():
    t = hostmem.host_tensor((3, 1024, 700), torch.bfloat16)
    assert t.shape == (3, 1024, 700) and t.dtype == torch.bfloat16 and t.is_contiguous()
    x = torch.randn(3, 1024, 700).bfloat16()
    t.copy_(x)
    assert torch.equal(t, x)


@pytest.mark.skipif(hostmem.thp_mode() not in ("always", "madvise"), reason="the kernel gives no transparent huge pages")
def test_big_buffers_are_advised_onto_huge_pages(monkeypatch):
    """The advice is ours to check; how many huge pages the kernel then gives depends on its
    free memory's fragmentation (late in a full test run, a quarter of a 64 MiB buffer), so
    that is only reported."""
    monkeypatch.delenv("FREETOKEN_HUGEPAGES", raising=False)
    b = hostmem.host_buffer(64 << 20)
    b.fill_(1)  # first touch after the advice
    got = hostmem.advised(b)
    if got is None:
        pytest.skip("/proc/self/smaps is not readable here")
    assert got, "the buffer's mapping lacks the huge-page advice (VmFlags hg)"
    assert hostmem.huge_bytes(b) is not None


def test_the_switch_turns_the_advice_off(monkeypatch):
    """With FREETOKEN_HUGEPAGES=0 no buffer is advised. What is ours to check is that madvise is
    not called: the mapping's own flags can carry "hg" anyway where the allocator hands out part
    of a heap region an earlier (freed) buffer advised (glibc's mmap threshold grows after big
    frees, so an 8 MiB block may come from the heap): a CI run saw exactly that."""
    calls = []
    monkeypatch.setattr(hostmem, "_madvise", lambda *a: calls.append(a) or True)
    monkeypatch.setenv("FREETOKEN_HUGEPAGES", "0")
    assert not hostmem.hugepages_wanted()
    b = hostmem.host_buffer(8 << 20)
    b.fill_(1)
    assert calls == []
    if hostmem.thp_mode() in ("always", "madvise"):
        monkeypatch.setenv("FREETOKEN_HUGEPAGES", "1")
        hostmem.host_buffer(8 << 20)
        assert len(calls) == 1 and calls[0][2] == hostmem.MADV_HUGEPAGE
        assert calls[0][0] % hostmem.HUGE == 0 and calls[0][1] >= 8 << 20


def test_the_ftw_reader_buffers_come_from_here():
    b = _aligned_buffer(5 << 20)
    assert b.data_ptr() % ALIGN == 0 and b.numel() == 5 << 20


def test_a_bad_switch_value_is_named(monkeypatch):
    from freetoken.errors import FreeTokenError
    monkeypatch.setenv("FREETOKEN_HUGEPAGES", "yes")
    with pytest.raises(FreeTokenError, match="FREETOKEN_HUGEPAGES must be 0 or 1"):
        hostmem.host_buffer(4 << 20)
