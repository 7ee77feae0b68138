"""The C++ executor's host-call entry (the CPU branch called from a CUDA graph's host node):
called here directly through its address, on pinned-free host buffers, it computes what the
executor's forward computes, and reports a bad id in the descriptor instead of throwing."""
import ctypes

import pytest
import torch

from freetoken.experts.cpu import CpuExpertExecutor, extension
from freetoken.experts.cpu.hostcall import _Desc, bank_fields
from freetoken.experts.executor import Activation

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ executor could not be built")
# the doorbell's kernels run on the GPU where there is one (mapped pinned memory, the real
# protocol), else under the Triton interpreter on plain host memory (conftest sets it)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def call(cpu, x, ids, w):
    t, k = ids.shape
    out = torch.full((t, x.shape[1]), float("nan"))
    xf, il, wf = x.float().contiguous(), ids.long().contiguous(), w.float().contiguous()
    d = _Desc(executor=extension().executor_address(cpu.handle), x=xf.data_ptr(), ids=il.data_ptr(), w=wf.data_ptr(),
              out=out.data_ptr(), T=t, K=k, H=x.shape[1], bf16_act=int(x.dtype == torch.bfloat16), error=0, calls=0,
              busy_ns=0, **bank_fields(cpu), **cpu.host_fn_fields())
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(extension().host_call_address())
    fn(ctypes.addressof(d))
    return out, d


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "swiglu_clamp-biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_call_equals_forward(dtype, gpt_oss):
    assert extension().host_call_size() == ctypes.sizeof(_Desc)
    g = torch.Generator().manual_seed(3)
    n, h, i, t, k = 24, 64, 32, 3, 4
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5 * (3 if gpt_oss else 1)).to(dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    fn = {}
    if gpt_oss:  # GPT-OSS's experts: the clamped SwiGLU (acting at limit 1) with both bias banks
        fn = dict(activation=Activation("swiglu_clamp", 1.702, 1.0), gate_up_bias=torch.randn(n, 2 * i, generator=g).to(dtype),
                  down_bias=torch.randn(n, h, generator=g).to(dtype))
    cpu = CpuExpertExecutor(gu, dn, threads=2, **fn)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.randint(0, n, (t, k), generator=g)
    ids[1, 2] = -1  # a pair that runs elsewhere
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    out, d = call(cpu, x, ids, w)
    assert d.error == 0 and d.calls == 1 and d.busy_ns > 0
    assert torch.equal(out, cpu.kernel(x, ids, w))
    if gpt_oss:  # the descriptor's function is the executor's, not SiLU without biases
        assert not torch.equal(out, CpuExpertExecutor(gu, dn, threads=2).kernel(x, ids, w))
    ids[0, 0] = n  # out of range: flagged, nothing thrown across the caller, no stale result
    out, d = call(cpu, x, ids, w)
    assert d.error == 1 and d.calls == 0 and float(out.abs().max()) == 0.0


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_host_call_runs_quantized_banks(fmt):
    """Quantized banks through the descriptor (its QPair): forward_q's result, so a quantized
    model's CPU branch can run inside a decode graph too."""
    from tests.test_cpu_quantized import random_banks
    n, h, i, t, k = 12, 256, 128, 2, 4
    cpu = CpuExpertExecutor(random_banks(fmt, torch.bfloat16, n, h, i, seed=5), threads=2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, n, (t, k), generator=g)
    ids[0, 1] = -1
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    out, d = call(cpu, x, ids, w)
    assert d.error == 0 and d.calls == 1 and cpu.qbanks_address() == d.qbanks
    assert torch.equal(out, cpu.kernel(x, ids, w))
    assert float(out.abs().max()) > 0


# ---------------------------------------------------------------- the doorbell (CPU side of it)
# The protocol runs here on plain host memory: the ring and wait kernels under the Triton
# interpreter (the CPU's memory is the GPU's there), the C++ bell thread for real.

def _bell_call(bell, cpu, buffers, x, ids, w):
    xb, ib, wb, ob, d = buffers
    out = torch.full((x.shape[0], x.shape[1]), float("nan"), device=DEV)
    bell.ring(x.to(DEV), ids.to(DEV), w.to(DEV), xb, ib, wb, ctypes.addressof(d))
    bell.wait(ob, out)
    return out.cpu()  # a sync on the GPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_doorbell_answers_each_ring_with_the_executors_result(dtype):
    pytest.importorskip("triton")
    from freetoken.experts.cpu.hostcall import Doorbell, call_buffers
    g = torch.Generator().manual_seed(11)
    n, h, i, k = 16, 64, 32, 4
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    cpu = CpuExpertExecutor(gu, dn, threads=2)
    addr = extension().executor_address(cpu.handle)
    bell = Doorbell(DEV)
    try:
        shapes = {t: call_buffers(cpu, addr, t, k, h, dtype == torch.bfloat16, pin=DEV == "cuda") for t in (1, 3)}
        for step in range(6):  # shapes interleaved through one bell, as batch sizes change
            t = (1, 3)[step % 2]
            x = torch.randn(t, h, generator=g).to(dtype)
            ids = torch.randint(0, n, (t, k), generator=g)
            ids[0, step % k] = -1  # a pair that runs on the GPU
            w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
            got = _bell_call(bell, cpu, shapes[t], x, ids, w)
            assert torch.equal(got, cpu.kernel(x, ids, w.float())), f"step {step}"
        assert bell.calls() == 6 and int(bell.counter) == 6 and not bell.gave_up()
        assert sum(s[-1].calls for s in shapes.values()) == 6
        # the diagnosis words a gave-up error would print: every call entered and returned
        assert int(bell.words[bell.k.ENTERED]) == 6 and all(s[-1].stage == 3 for s in shapes.values())
    finally:
        bell.close()


def test_doorbell_answers_a_ring_made_before_its_thread_started():
    """A thread scheduled late (a loaded machine: the H200 run had 16 executor threads and
    several bells in one process) starts after the GPU's first ring. It must still answer it:
    the thread once took the ring count it found at start as already seen and never answered
    call 1 ("rung 1, seq 1, entered 0", idle polls growing)."""
    pytest.importorskip("triton")
    from freetoken.experts.cpu.hostcall import Doorbell, call_buffers
    from freetoken.kernels import doorbell as kd
    g = torch.Generator().manual_seed(12)
    n, h, i, k = 8, 32, 16, 2
    cpu = CpuExpertExecutor(torch.randn(n, 2 * i, h, generator=g), torch.randn(n, h, i, generator=g), threads=1)
    buffers = call_buffers(cpu, extension().executor_address(cpu.handle), 1, k, h, False, pin=DEV == "cuda")
    x, ids, w = torch.randn(1, h, generator=g), torch.tensor([[1, 5]]), torch.tensor([[0.25, 0.75]])
    # the ring and wait kernels compiled first: on a fresh GPU that can take longer than the
    # delay below, and the late thread would then start before the ring
    warm = Doorbell(DEV)
    try:
        _bell_call(warm, cpu, buffers, x, ids, w)
    finally:
        warm.close()
    bell = Doorbell(DEV, start_delay_us=1_000_000)
    try:
        xb, ib, wb, ob, d = buffers
        bell.ring(x.to(DEV), ids.to(DEV), w.to(DEV), xb, ib, wb, ctypes.addressof(d))
        if DEV == "cuda":
            torch.cuda.synchronize()
        assert int(bell.words[kd.SEQ]) == 1 and int(bell.words[kd.ENTERED]) == 0  # rung before the thread ran
        out = torch.zeros(1, h, device=DEV)
        kd.wait(bell.counter, bell.words, ob, out, limit=10_000_000 if DEV == "cuda" else 200_000)
        assert not bell.gave_up(), bell.state()
        assert torch.equal(out.cpu(), cpu.kernel(x, ids, w)) and bell.calls() == 1
    finally:
        bell.close()


def test_doorbell_wait_gives_up_when_nobody_answers():
    """A stopped thread: the wait kernel stops polling after its limit and flags it, instead
    of spinning forever (on a GPU: a hung device)."""
    pytest.importorskip("triton")
    from freetoken.experts.cpu.hostcall import Doorbell, call_buffers
    from freetoken.kernels import doorbell as kd
    n, h, i, k = 4, 32, 16, 2
    cpu = CpuExpertExecutor(torch.randn(n, 2 * i, h), torch.randn(n, h, i), threads=1)
    bell = Doorbell(DEV)
    bell.close()
    xb, ib, wb, ob, d = call_buffers(cpu, extension().executor_address(cpu.handle), 1, k, h, False,
                                     pin=DEV == "cuda")
    x, ids, w = torch.randn(1, h), torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]])
    import time
    time.sleep(0.05)  # the thread has seen `stop`
    bell.ring(x.to(DEV), ids.to(DEV), w.to(DEV), xb, ib, wb, ctypes.addressof(d))
    out = torch.zeros(1, h, device=DEV)
    kd.wait(bell.counter, bell.words, ob, out, limit=50)
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert bell.gave_up() and bell.calls() == 0 and d.calls == 0
    # the state a gave-up error reports: the ring reached the page, the stopped thread did not answer
    # (entered 0: the thread never took the call up, the descriptor's stage says the same)
    state = bell.state()
    assert state.startswith("rung 1, seq 1, entered 0, done 0, answered 0, stop 1, idle polls "), state
    assert d.stage == 0
    assert not bell.recover(timeout=0.05) and bell.gave_up()  # a stopped thread: no recovery
    # a thread that answers late (simulated: the answer lands in the page after the wait gave
    # up, as a starved thread's would): the flag clears and the bell serves the next rings
    bell.words[kd.STOP], bell.words[kd.DONE] = 0, 1
    assert bell.recover(timeout=0.05) and not bell.gave_up()


def test_doorbell_kernels_match_their_references():
    pytest.importorskip("triton")
    from freetoken.kernels import doorbell as kd
    g = torch.Generator().manual_seed(5)
    t, h, k = 3, 40, 4
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.randint(-1, 9, (t, k), generator=g).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    runs = []
    for fn in (kd.ring, kd.ring_reference):
        z = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device=DEV)  # noqa: E731
        bufs = (z(t, h), z(t, k, dtype=torch.int64), z(t, k))
        counter, bell = torch.tensor([7], device=DEV), z(8, dtype=torch.int64)
        fn(x, ids, w, *bufs, counter, bell, 12345)
        runs.append((*bufs, counter, bell))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert int(runs[0][3]) == 8 and int(runs[0][4][kd.SEQ]) == 8 and int(runs[0][4][kd.DESC]) == 12345
    bell = runs[0][4]
    bell[kd.DONE] = 8  # answered: the result comes back
    ob = torch.randn(t, h, generator=g).to(DEV)
    ob.view(-1)[:4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -9])  # ties, below
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the CPU part lands in the activations' dtype
        for fn in (kd.wait, kd.wait_reference):
            out = torch.zeros(t, h, device=DEV, dtype=dtype)
            fn(runs[0][3], bell, ob, out)
            assert torch.equal(out, ob.to(dtype)), (fn.__name__, dtype)  # to nearest even, as .to() rounds


def test_a_failed_cpu_call_is_raised_once():
    """A descriptor's error (an id out of range, an exception in the call) fails the step that
    made it, once: the descriptor serves the next steps instead of failing every later one."""
    from freetoken.errors import FreeTokenError
    from freetoken.experts.cpu.hostcall import HostBranch, _Desc
    branch = HostBranch.__new__(HostBranch)  # the check alone: no CUDA streams needed
    d = _Desc(error=1)
    branch.bell, branch.shapes = None, {(1, 4, False): (None,) * 6 + (d,)}
    with pytest.raises(FreeTokenError, match="an expert id out of range"):
        branch.check()
    branch.check()  # reported: the next step goes on
    assert d.error == 0
