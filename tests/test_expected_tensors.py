"""Every parameter and buffer a transformers model has (its routed experts aside, which the
expert readers take) is a tensor the engine loads, and the engine expects nothing transformers
lacks, per family and per config switch that adds tensors. `ft convert` writes only the
expected tensors: one missing from the list is dropped silently (Qwen3/Qwen3.5's o_proj bias
with attention_bias was, and the logits were 0.56 off transformers)."""
import pytest

import hf_models
from freetoken.config import ModelConfig
from freetoken.model.registry import model_class

VARIANTS = {
    "qwen3_5": lambda: hf_models.qwen3_5(0),
    "qwen3_5-bias-tied": lambda: hf_models.qwen3_5(0, attention_bias=True, tie_word_embeddings=True),
    "qwen3_moe-dense-layer": lambda: hf_models.qwen3_moe(0, mlp_only_layers=[1]),
    "qwen3_moe-bias": lambda: hf_models.qwen3_moe(0, attention_bias=True, mlp_only_layers=[1]),
    "gpt_oss": lambda: hf_models.gpt_oss(0),
    "gpt_oss-no-bias": lambda: hf_models.gpt_oss(0, attention_bias=False),
    "glm_moe_dsa": lambda: hf_models.glm_moe_dsa(0),
    "glm_moe_dsa-bias": lambda: hf_models.glm_moe_dsa(0, attention_bias=True),
    "deepseek_v4": lambda: hf_models.deepseek_v4(0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_loads_every_tensor_transformers_has(name):
    m = VARIANTS[name]()
    cfg = ModelConfig.from_hf(m.config.to_dict())
    expected = set(model_class(cfg.arch).expected_tensors(cfg))
    hf = {k for k, _ in m.named_parameters()} | {k for k, _ in m.named_buffers()}
    hf = {k for k in hf if ".mlp.experts." not in k and "rotary" not in k}  # experts: the expert readers
    assert sorted(hf - expected) == [], "transformers has tensors the engine does not load"
    assert sorted(expected - hf) == [], "the engine expects tensors transformers does not have"
