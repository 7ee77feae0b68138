"""A config.json with a wrong size, count or rope field is refused with one line that names the
field and says to fix config.json: never a Python error from deep inside, and never an engine
built with MoE layers of no experts. Each family's config as transformers writes it (small
sizes), one field broken at a time."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from bench import large_models as lm  # noqa: E402
from freetoken.config import ModelConfig, UnsupportedModelError  # noqa: E402


def family_configs() -> dict[str, dict]:
    """{arch: config.json dict}: transformers' own config classes for Qwen3-MoE and GPT-OSS,
    the benchmark's small configs (transformers' field names) for the others."""
    from transformers import GptOssConfig, Qwen3MoeConfig  # both in every transformers the tests run with
    small = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts_per_tok=4)
    return {"qwen3_5_moe": dict(lm.TINY["qwen3_5_moe"]), "glm_moe_dsa": dict(lm.TINY["glm_moe_dsa"]),
            "deepseek_v4": dict(lm.TINY["deepseek_v4"]),
            "qwen3_moe": Qwen3MoeConfig(**small, intermediate_size=96, moe_intermediate_size=32,
                                        num_experts=16).to_dict(),
            "gpt_oss": GptOssConfig(**small, intermediate_size=32, num_local_experts=16).to_dict()}


CONFIGS = family_configs()
EXPERTS_FIELD = {"qwen3_5_moe": "num_experts", "qwen3_moe": "num_experts", "gpt_oss": "num_local_experts",
                 "glm_moe_dsa": "n_routed_experts", "deepseek_v4": "n_routed_experts"}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_each_family_reads_cleanly(arch):
    mc = ModelConfig.from_hf(CONFIGS[arch])
    assert mc.arch == arch and mc.moe_layers and mc.num_experts > 0


@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - {"qwen3_moe"}))
def test_no_routed_experts_names_the_field(arch):
    """An expert count of 0 in a family whose layers are all MoE: the family's own field is named."""
    for value in (0, None):  # None: `"n_routed_experts": null`
        cfg = dict(CONFIGS[arch], **{EXPERTS_FIELD[arch]: value})
        with pytest.raises(UnsupportedModelError, match=f"{EXPERTS_FIELD[arch]}=(0|None).*fix {EXPERTS_FIELD[arch]}"):
            ModelConfig.from_hf(cfg)


def test_qwen3_moe_without_experts_is_dense():
    """Qwen3-MoE's num_experts=0 is transformers' way of a dense layer everywhere (its sparse
    block needs num_experts > 0): read so, not refused."""
    mc = ModelConfig.from_hf(dict(CONFIGS["qwen3_moe"], num_experts=0))
    assert mc.moe_layers == [] and mc.intermediate_size == 96


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("hidden_size", "64"), ("num_attention_heads", True),
                                         ("vocab_size", -1), ("moe_intermediate_size", -1),
                                         ("num_key_value_heads", 2.0), ("num_experts_per_tok", "4")])
def test_a_bad_size_is_one_line(field, value):
    cfg = dict(CONFIGS["qwen3_5_moe"], **{field: value})
    with pytest.raises(UnsupportedModelError, match=f"{field} must be an integer of at least [01], got {value!r}; "
                                                    "fix config.json"):
        ModelConfig.from_hf(cfg)


@pytest.mark.parametrize("top_k", [0, 17])
def test_top_k_outside_the_experts(top_k):
    cfg = dict(CONFIGS["qwen3_moe"], num_experts_per_tok=top_k)
    with pytest.raises(UnsupportedModelError, match=rf"num_experts_per_tok={top_k} must be in \[1, num_experts=16\]"):
        ModelConfig.from_hf(cfg)


def test_heads_not_a_multiple_of_kv_heads():
    cfg = dict(CONFIGS["qwen3_moe"], num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        ModelConfig.from_hf(cfg)


def test_unknown_rope_type_is_named():
    cfg = dict(CONFIGS["qwen3_moe"], rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="rope type 'longrope' is not supported"):
        ModelConfig.from_hf(cfg)
