"""`ft convert` compares every tensor the engine loads with the shape config.json implies: a
config.json that disagrees with its weights (another size's config, a field edited by hand) is
refused with one line naming the tensor, both shapes and the config.json fields the shape comes
from, and nothing is written; before, it converted and failed later inside generate or serve.
Unmodified checkpoints of every architecture, in each expert layout, still convert.
"""
import json
import os
import shutil

import pytest

import hf_models
import quant_models
from test_bad_input import assert_one_line_error, ft_in
from freetoken.config import ModelConfig
from freetoken.model.registry import model_class
from freetoken.weights.convert import convert, implied_shapes, shape_key

BUILDERS = {
    # name: (make the checkpoint in folder d) ; small: each builds in well under a second
    "qwen3_5": lambda d: hf_models.save(hf_models.qwen3_5(0), d),  # one tensor per expert
    "qwen3_5-bias": lambda d: hf_models.save(hf_models.qwen3_5(0, attention_bias=True), d),  # q/k/v/o biases
    "qwen3_moe-bias": lambda d: hf_models.save(hf_models.qwen3_moe(0, attention_bias=True), d),
    "qwen3_5-wrapper": lambda d: hf_models.save(hf_models.qwen3_5(0), d, layout="wrapper"),  # fused, text_config
    "qwen3_moe": lambda d: hf_models.save(hf_models.qwen3_moe(0, mlp_only_layers=[1]), d),  # a dense layer
    "gpt_oss": lambda d: hf_models.save(hf_models.gpt_oss(0), d),  # fused [E, in, out], expert biases
    "glm_moe_dsa": lambda d: hf_models.save(hf_models.glm_moe_dsa(0), d),
    "deepseek_v4": lambda d: hf_models.save(hf_models.deepseek_v4(0), d),
    "qwen3_5-mxfp4": lambda d: quant_models.write(hf_models.qwen3_5(0), d, "mxfp4"),  # packed fused experts
    "qwen3_5-nvfp4": lambda d: quant_models.write(hf_models.qwen3_5(0), d, "nvfp4", "all"),  # packed, per expert
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> the checkpoint's folder, built on first use."""
    root, made = tmp_path_factory.mktemp("shapes"), {}

    def get(name):
        if name not in made:
            made[name] = str(root / name)
            BUILDERS[name](made[name])
        return made[name]
    return get


def edited(src: str, tmp_path, field: str, value) -> str:
    """A copy of checkpoint src whose config.json sets `field` (a.b: inside a) to value."""
    d = str(tmp_path / "edited")
    shutil.copytree(src, d)
    fn = os.path.join(d, "config.json")
    with open(fn) as f:
        cfg = json.load(f)
    *outer, key = field.split(".")
    node = cfg
    for k in outer:
        node = node[k]
    assert key in node, key  # the edit disagrees with a field the checkpoint has
    node[key] = value
    with open(fn, "w") as f:
        json.dump(cfg, f)
    return d


@pytest.mark.parametrize("name", list(BUILDERS))
def test_unmodified_checkpoints_convert(checkpoints, tmp_path, name):
    """Every tensor the engine loads has an implied shape, and the checkpoint's own config.json
    implies exactly the shapes it has (float shapes for the packed formats)."""
    d = checkpoints(name)
    with open(os.path.join(d, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    implied = implied_shapes(cfg)
    assert set(model_class(cfg.arch).expected_tensors(cfg)) <= set(implied)
    assert shape_key(f"model.layers.{cfg.moe_layers[0]}.mlp.experts.3.down_proj.weight") in implied
    convert(d, str(tmp_path / "m.ftw"), progress=False)
    assert os.path.exists(tmp_path / "m.ftw")


CASES = {
    # name: (checkpoint, config.json field, value, words the error line must hold: the tensor, the shape
    # found, the shape implied)
    "qwen3_5-kv-heads": ("qwen3_5", "num_key_value_heads", 4,
                         ["model.layers.3.self_attn.k_proj.weight", "has shape [32, 64]", "implies [64, 64]"]),
    "qwen3_5-vocab": ("qwen3_5", "vocab_size", 384,
                      ["model.embed_tokens.weight", "has shape [320, 64]", "implies [384, 64]"]),
    "qwen3_5-hidden": ("qwen3_5", "hidden_size", 128,
                       ["model.embed_tokens.weight", "has shape [320, 64]", "implies [320, 128]"]),
    "qwen3_5-expert-size": ("qwen3_5", "moe_intermediate_size", 64,
                            ["model.layers.0.mlp.experts.0.gate_proj.weight", "has shape [32, 64]",
                             "implies [64, 64]"]),
    "qwen3_5-experts": ("qwen3_5", "num_experts", 32,
                        ["model.layers.0.mlp.gate.weight", "has shape [16, 64]", "implies [32, 64]"]),
    "qwen3_5-fused-expert-size": ("qwen3_5-wrapper", "text_config.moe_intermediate_size", 16,
                                  ["model.layers.0.mlp.experts.gate_up_proj", "has shape [16, 64, 64]",
                                   "implies [16, 32, 64] or [16, 64, 32]"]),
    "qwen3_5-mxfp4-expert-size": ("qwen3_5-mxfp4", "moe_intermediate_size", 64,
                                  ["model.layers.0.mlp.experts.gate_up_proj (mxfp4, stored as "
                                   "model.layers.0.mlp.experts.gate_up_proj_blocks [16, 64, 2, 16])",
                                   "has shape [16, 64, 64]", "implies [16, 128, 64]"]),
    "qwen3_5-nvfp4-heads": ("qwen3_5-nvfp4", "num_attention_heads", 8,
                             ["model.layers.3.self_attn.q_proj.weight (nvfp4, stored as "
                              "model.layers.3.self_attn.q_proj.weight [128, 32])", "has shape [128, 64]",
                              "implies [256, 64]"]),
    "gpt_oss-kv-heads": ("gpt_oss", "num_key_value_heads", 4,
                         ["model.layers.0.self_attn.k_proj.weight", "has shape [32, 64]", "implies [64, 64]"]),
    "gpt_oss-vocab": ("gpt_oss", "vocab_size", 256, ["model.embed_tokens.weight", "implies [256, 64]"]),
    "gpt_oss-hidden": ("gpt_oss", "hidden_size", 128, ["model.embed_tokens.weight", "implies [320, 128]"]),
    "gpt_oss-expert-size": ("gpt_oss", "intermediate_size", 64,  # published input first: [E, H, 2I]
                            ["model.layers.0.mlp.experts.gate_up_proj", "has shape [16, 64, 64]",
                             "implies [16, 64, 128]"]),
    "gpt_oss-experts": ("gpt_oss", "num_local_experts", 8,
                        ["model.layers.0.mlp.router.weight", "has shape [16, 64]", "implies [8, 64]"]),
}
# the fields each case's message must name (beside the one edited: a dim from several fields)
ALSO = {"qwen3_5-kv-heads": ["head_dim"], "gpt_oss-kv-heads": ["head_dim"], "qwen3_5-nvfp4-heads": ["head_dim"]}


@pytest.mark.parametrize("case", list(CASES))
def test_config_that_disagrees_with_the_weights_is_refused(checkpoints, tmp_path, case):
    name, field, value, words = CASES[case]
    d = edited(checkpoints(name), tmp_path, field, value)
    out = tmp_path / "out" / "m.ftw"
    code, _, err = ft_in("convert", d, str(out))
    fields = [field] + ALSO.get(case, [])
    assert_one_line_error(code, err, d, *words, "fix config.json or use the checkpoint's own config.json")
    named = err[err.index("(from ") + len("(from "):].split(")")[0].split(", ")
    assert sorted(named) == sorted(fields), named
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


def test_too_many_experts_in_config_is_not_a_missing_tensor(checkpoints, tmp_path):
    """num_experts above the checkpoint's: the router's rows say so (not `missing expert 16`)."""
    d = edited(checkpoints("qwen3_moe"), tmp_path, "num_local_experts", 32)
    code, _, err = ft_in("convert", d, str(tmp_path / "m.ftw"))
    assert_one_line_error(code, err, "model.layers.0.mlp.gate.weight", "(from num_local_experts)")
    assert "missing" not in err
    assert not [f for f in os.listdir(tmp_path) if f.startswith("m.ftw")]  # no output, no m.ftw.<pid>.partial


def test_generate_checks_prompt_ids_against_the_embedding(checkpoints, tmp_path, monkeypatch, capsys):
    """An FTW converted before the shape checks, whose vocab_size exceeds its embedding's rows:
    `ft generate --prompt-ids` refuses an id past the rows (it used to index past the embedding)."""
    import freetoken.weights.convert as conv
    from freetoken.cli import main
    d = edited(checkpoints("qwen3_moe"), tmp_path, "vocab_size", 384)
    out = str(tmp_path / "old.ftw")
    with monkeypatch.context() as m:
        m.setattr(conv, "check_shapes", lambda *a: None)
        convert(d, out, progress=False)
    capsys.readouterr()
    code = main(["generate", out, "--prompt-ids", "1,350", "--max-tokens", "2", "--device", "cpu"])
    assert_one_line_error(code, capsys.readouterr().err, "token id 350", "outside the vocabulary [0, 320)")


def test_squeezed_deltanet_conv_still_converts(checkpoints, tmp_path):
    """The DeltaNet conv weight published as [C, 1, K] and re-exported squeezed to [C, K]: the model
    reads both (deltanet.py reshapes it), so both convert."""
    from safetensors.torch import load_file, save_file
    d = str(tmp_path / "squeezed")
    shutil.copytree(checkpoints("qwen3_5"), d)
    fn = os.path.join(d, "model.safetensors")
    w = load_file(fn)
    convs = [n for n in w if n.endswith("conv1d.weight")]
    assert convs and all(w[n].dim() == 3 and w[n].shape[1] == 1 for n in convs)
    save_file({n: (t.squeeze(1).contiguous() if n in convs else t) for n, t in w.items()}, fn, metadata={"format": "pt"})
    convert(d, str(tmp_path / "m.ftw"), progress=False)
    assert os.path.exists(tmp_path / "m.ftw")
