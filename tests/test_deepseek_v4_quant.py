"""DeepSeek-V4 as DeepSeek publishes it (tests/quant_models.py write_deepseek_v4): -Flash with
FP8 attention and shared-expert Linears (ue8m0 block scales) and FP4 routed experts (int8-packed
e2m1, one e8m0 scale per 32), the scales beside each weight as `X.scale`; -Base with FP8
everywhere. `ft convert` keeps the published bytes (the FP4 experts as an MXFP4 bank, the FP8
weights with their scale bytes, dequantized at load) and the engine's logits equal transformers'
on the weights the checkpoint stands for (1e-4, greedy ids), through the torch path, the C++
executor and the expert cache; also with the V3 naming (`weight_scale_inv`) and with a config
that does not declare the experts' FP4."""
import json
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV4ForCausalLM

import hf_models
import quant_models
from freetoken.errors import UnsupportedModelError
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.weights.convert import convert, plan
from freetoken.weights.ftw import read_header
from test_reference import engine_greedy, prompt_for, rel_err

P = 37  # past the sliding window, the compress windows and the indexer's top-k of hf_models.deepseek_v4
VARIANTS = {  # name: (variant, scale_name, declare_experts)
    "flash": ("flash", "scale", True),
    "flash-undeclared": ("flash", "scale", False),
    "flash-scale_inv": ("flash", "weight_scale_inv", True),
    "base": ("base", "scale", True),
}


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    model = hf_models.deepseek_v4(0)
    out = {}
    for name, (variant, scale_name, declare) in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        q, ref_dir = quant_models.write_deepseek_v4(model, str(d), variant, scale_name, declare)
        convert(q, str(d / "m.ftw"), progress=False)
        out[name] = (q, str(d / "m.ftw"), DeepseekV4ForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval())
    return out


def test_flash_layout_is_the_published_one(published):
    q, ftw, _ = published["flash"]
    with safe_open(f"{q}/model.safetensors", "pt") as h:
        w1 = "model.layers.1.ffn.experts.3.w1"
        assert h.get_slice(w1 + ".weight").get_dtype() == "I8" and h.get_slice(w1 + ".scale").get_dtype() == "F8_E8M0"
        assert h.get_slice(w1 + ".scale").get_shape() == [32, 64 // 32]  # per row, 32 values a scale
        assert h.get_slice("model.layers.1.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert h.get_slice("model.layers.1.attn.wq_a.scale").get_dtype() == "F8_E8M0"
    pl = plan(q)
    assert (pl.scheme.format, pl.scheme.experts, pl.expert_format) == ("fp8_block", "mxfp4", "mxfp4")
    assert "ue8m0" in pl.scheme.description and "fp4 experts" in pl.scheme.description
    meta, entries = read_header(ftw)
    assert meta["quant"]["experts"] == "mxfp4" and meta["banks"]["format"] == "mxfp4"
    dense = meta["quant"]["dense"]["model.layers.1.self_attn.q_a_proj.weight"]
    assert dense["format"] == "fp8_block" and entries[dense["scale"]].dtype == "uint8"  # e8m0 bytes as published


@pytest.mark.parametrize("path", ["torch", "cpp", "cache"])
def test_flash_logits_match_transformers_on_the_dequantized_weights(published, path):
    _, ftw, ref = published["flash"]
    if path == "torch":  # the host executor's torch path (dequantizes the selected experts)
        with mock.patch("freetoken.experts.cpu.extension", lambda: None):
            eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32"))
    elif path == "cpp":  # the C++ kernels reading the FP4 bank in place
        eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", experts="cpu"))
    else:  # host slots without CUDA, half the misses filled, half on the C++ executor
        eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", moe="cache", expert_cache="0.3", fill_share=0.5))
    check(eng, ref, "mxfp4")


@pytest.mark.parametrize("name, fmt", [("flash-undeclared", "mxfp4"), ("flash-scale_inv", "mxfp4"), ("base", "fp8_block")])
def test_other_layouts(published, name, fmt):
    """No expert_dtype in the config (the FP4 experts seen in the tensors), the V3 scale naming,
    and -Base's FP8 experts with F32 scales: the C++ executor's logits."""
    _, ftw, ref = published[name]
    check(Engine(ftw, EngineConfig(device="cpu", dtype="float32", experts="cpu")), ref, fmt)


def check(eng, ref, fmt):
    assert eng.describe()["expert_format"] == fmt
    prompt = prompt_for(5, n=P)
    pre, toks, steps = engine_greedy(eng, prompt, 8)
    want = hf_models.reference_logits(ref, prompt + toks)
    assert rel_err(pre, want[:P]) < 1e-4
    assert rel_err(steps, want[P:]) < 1e-4
    assert toks == want[P - 1:P + 7].argmax(-1).tolist()


def test_unknown_expert_dtype_is_refused(published, tmp_path):
    import shutil
    q, _, _ = published["flash"]
    bad = tmp_path / "bad"
    shutil.copytree(q, bad)
    cj = json.loads((bad / "config.json").read_text())
    cj["quantization_config"]["expert_dtype"] = "int2"
    (bad / "config.json").write_text(json.dumps(cj))
    with pytest.raises(UnsupportedModelError, match="expert_dtype 'int2'"):
        plan(str(bad))
