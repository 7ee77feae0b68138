"""--dense-bf16 (runtime/engine.py, weights/reader.py dense_weights, model/linear.py): a bf16
checkpoint served in float32 on the CPU keeps its 2-D dense weights bf16, and every product
widens them exactly where it reads them. The served logits must then be the ones of float32
copies (--dense-bf16 widen) on every architecture, prompts past the C++ rows kernel's row counts
(torch's GEMM on the widened weight) and decode steps inside them (the rows kernel reading bf16
with float32 activations), with the big weights actually left bf16."""
import pytest
import torch

import hf_models
from drive import drive
from freetoken.model.linear import WIDEN_ELEMENTS, linear, widened_linear
from freetoken.model.layers import lm_head
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert

ARCHS = {
    "qwen3_5": lambda: hf_models.qwen3_5(61, num_hidden_layers=4),
    "qwen3_moe": lambda: hf_models.qwen3_moe(62),
    "gpt_oss": lambda: hf_models.gpt_oss(63),
    "glm_moe_dsa": lambda: hf_models.glm_moe_dsa(64),
    "deepseek_v4": lambda: hf_models.deepseek_v4(65),
}


def served(eng, prompts, n=6):
    srv = ServingEngine(eng, max_batch=len(prompts), max_queue=len(prompts) + 1, record_logits=True, start=False)
    reqs = [Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts]
    return drive(srv, reqs)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_kept_bf16_serves_the_logits_of_widened_weights(arch, tmp_path):
    model = ARCHS[arch]().to(torch.bfloat16)
    hf_models.save(model, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    engines = {mode: Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=32,
                                                                    dense_bf16=mode))
               for mode in ("keep", "widen")}
    keep, widen = engines["keep"], engines["widen"]
    assert keep.keep_bf16 and not widen.keep_bf16
    assert keep.model.lm_head.dtype == torch.bfloat16 and widen.model.lm_head.dtype == torch.float32
    assert keep.model.embed.dtype == torch.bfloat16
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, keep.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 40)]
    a, b = served(keep, prompts), served(widen, prompts)
    for ra, rb in zip(a, b):
        assert ra.output_ids == rb.output_ids
        for la, lb in zip(ra.logits, rb.logits):
            err = float((la - lb).abs().max() / lb.abs().max())
            assert err < 1e-5, err  # products of the same values: what differs is at most a sum's order


def test_widened_linear_in_blocks_equals_one_widened_gemm(monkeypatch):
    """Past WIDEN_ELEMENTS the weight is widened block by block of its rows, never whole."""
    import freetoken.model.linear as lin
    monkeypatch.setattr(lin, "WIDEN_ELEMENTS", 64 * 8)  # 8 rows of K = 64 a block: 5 blocks of 37 rows
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 64, generator=g).bfloat16()
    b = torch.randn(37, generator=g)
    x = torch.randn(20, 64, generator=g)  # more rows than the rows kernel takes
    want = torch.nn.functional.linear(x, w.float(), b)
    got = lin.widened_linear(x, w, b)
    assert got.shape == (20, 37) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert WIDEN_ELEMENTS == 1 << 20


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 64, 65])
def test_linear_and_lm_head_with_a_kept_bf16_weight(rows):
    """fp32 x with a bf16 weight: the rows kernel (up to MIXED_HOST_ROWS) or torch's GEMM on the
    widened weight, both against F.linear on float32 copies of the same values."""
    from freetoken.model.linear import MIXED_HOST_ROWS, host_gemv
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g).bfloat16()
    b = torch.randn(300, generator=g)
    x = torch.randn(rows, 96, generator=g)
    want = torch.nn.functional.linear(x, w.float(), b)
    for got in (linear(x, w, b), widened_linear(x, w, b)):
        assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(lm_head(x, w), torch.nn.functional.linear(x, w.float()), rtol=1e-5, atol=1e-5)
    assert (host_gemv(x, w, b) is not None) == (rows <= MIXED_HOST_ROWS)  # the kernel's share
