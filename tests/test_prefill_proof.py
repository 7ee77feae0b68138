"""kernels/prefill_proof.py: at load on CUDA the prefill kernels run once against their torch
references at the model's shapes; a kernel that fails or computes something else turns them off
for the process (the torch paths run), said once in the log. On the CPU the kernels run under
TRITON_INTERPRET=1 (conftest.py); failures are simulated."""
import logging
from types import SimpleNamespace

import pytest
import torch

from freetoken import kernels
from freetoken.kernels import causal_conv, prefill_proof, router

CFG = SimpleNamespace(conv_dim=96, linear_conv_kernel_dim=4, linear_num_value_heads=2, linear_value_head_dim=32,
                      rms_norm_eps=1e-6, num_experts=16, top_k=4, linear_layers=[0, 1])


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "1")
    kernels.prefill_off(None)
    yield
    kernels.prefill_off(None)


def test_kernels_that_match_stay_on(caplog):
    with caplog.at_level(logging.INFO, logger="freetoken.engine"):
        assert prefill_proof.prove(CFG, "cpu", torch.float32) is None
    assert kernels.prefill_kernels() and "prefill kernels proven" in caplog.text


def test_a_wrong_kernel_turns_them_off(monkeypatch, caplog):
    real = causal_conv.causal_conv_silu_triton
    monkeypatch.setattr(causal_conv, "causal_conv_silu_triton", lambda x, s, w, b=None: real(x, s, w, b) * 1.5)
    with caplog.at_level(logging.WARNING, logger="freetoken.engine"):
        why = prefill_proof.prove(CFG, "cpu", torch.float32)
    assert why.startswith("the DeltaNet conv kernel on this GPU: its output is") and "off the torch reference" in why
    assert not kernels.prefill_kernels()
    assert "prefill kernels off, the torch paths run instead" in caplog.text
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "1")
    assert not kernels.prefill_kernels()  # for the process, whatever the variable says


def test_a_kernel_that_fails_turns_them_off(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("out of resources: shared memory, Required: 147456, Hardware limit: 101376\nmore")
    monkeypatch.setattr(router, "route_triton", boom)
    why = prefill_proof.prove(CFG, "cpu", torch.float32)
    assert why == ("the router kernel on this GPU: it failed: RuntimeError: out of resources: shared memory, "
                   "Required: 147456, Hardware limit: 101376")
    assert not kernels.prefill_kernels()


def test_nothing_runs_when_they_are_off_or_not_used(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("ran")
    for mod, name in ((causal_conv, "causal_conv_silu_triton"), (router, "route_triton")):
        monkeypatch.setattr(mod, name, boom)
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "0")
    assert prefill_proof.prove(CFG, "cpu", torch.float32) is None
    monkeypatch.setenv("FREETOKEN_PREFILL_KERNELS", "1")
    # no DeltaNet layers, top-k not a power of two: none of the kernels is this model's
    dense = SimpleNamespace(**{**vars(CFG), "linear_layers": [], "top_k": 6})
    assert prefill_proof.prove(dense, "cpu", torch.float32) is None and kernels.prefill_kernels()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_proof_passes_at_the_qwen36_shape():
    """On the GPU, in bf16, at the full-size Qwen3.6-35B-A3B shape's DeltaNet and router widths."""
    q36 = SimpleNamespace(conv_dim=8192, linear_conv_kernel_dim=4, linear_num_value_heads=32, linear_value_head_dim=128,
                          rms_norm_eps=1e-6, num_experts=256, top_k=8, linear_layers=[0])
    assert prefill_proof.prove(q36, "cuda", torch.bfloat16) is None and kernels.prefill_kernels()
