"""The C++ executor's host-call entry (the CPU branch called from a CUDA graph's host node):
called here directly through its address, on pinned-free host buffers, it computes what the
executor's forward computes, and reports a bad id in the descriptor instead of throwing."""
import ctypes

import pytest
import torch

from freetoken.experts.cpu import CpuExpertExecutor, extension
from freetoken.experts.cpu.hostcall import _Desc
from freetoken.experts.executor import Activation

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ executor could not be built")


def call(cpu, x, ids, w):
    t, k = ids.shape
    out = torch.full((t, x.shape[1]), float("nan"))
    xf, il, wf = x.float().contiguous(), ids.long().contiguous(), w.float().contiguous()
    d = _Desc(executor=extension().executor_address(cpu.handle), x=xf.data_ptr(), ids=il.data_ptr(), w=wf.data_ptr(), out=out.data_ptr(),
              gate_up=cpu.gate_up.data_ptr(), down=cpu.down.data_ptr(), n=cpu.gate_up.shape[0], T=t, K=k,
              H=x.shape[1], I=cpu.down.shape[2], bank_bf16=int(cpu.gate_up.dtype == torch.bfloat16),
              bf16_act=int(x.dtype == torch.bfloat16), error=0, calls=0, busy_ns=0, **cpu.host_fn_fields())
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
