"""Qwen3-Next's fused DeltaNet projections read as Qwen3.5's four (weights/hf.py
qwen3_next_split), against the grouping written out with views (as transformers'
fix_query_key_value_ordering splits them), for the weights and the scales beside them. The
whole-model check against Qwen3NextForCausalLM is in test_reference.py (qnext cases)."""
import pytest
import torch
from safetensors.torch import save_file

from freetoken.errors import UnsupportedModelError
from freetoken.weights.hf import Checkpoint, qwen3_next_split

P = "model.layers.0.linear_attn."


def parts(w: torch.Tensor, nk: int, sizes: list[int]) -> list[torch.Tensor]:
    """w [nk * sum(sizes), ...] grouped per key head -> each part over all groups, in head order."""
    g = w.reshape(nk, sum(sizes), *w.shape[1:])
    return [p.reshape(-1, *w.shape[1:]) for p in torch.split(g, sizes, dim=1)]


def checkpoint(tmp_path, tensors: dict, cfg: dict) -> Checkpoint:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return Checkpoint(str(tmp_path), derive=lambda t: qwen3_next_split(t, cfg))


def test_parts_and_their_scales(tmp_path):
    """2 key heads of 128, 4 value heads of 64 (2 a key head): q, k, v and z are 128 rows a group,
    whole 128x128 FP8 blocks; the block scales follow their blocks, per-row scales their rows,
    a one-value scale goes to every part."""
    nk, nv, dk, dv, c = 2, 4, 128, 64, 256
    cfg = dict(linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk, linear_value_head_dim=dv)
    r, g = nv // nk, torch.Generator().manual_seed(0)
    sizes = [dk, dk, r * dv, r * dv]
    qkvz = torch.randn(nk * sum(sizes), c, generator=g)
    inv = torch.randn(nk * sum(sizes) // 128, c // 128, generator=g)  # FP8 block scales
    row_scale = torch.randn(nk * sum(sizes), c // 16, generator=g)  # NVFP4-style, one row each
    ba = torch.randn(nk * 2 * r, c, generator=g)
    ck = checkpoint(tmp_path, {P + "in_proj_qkvz.weight": qkvz, P + "in_proj_qkvz.weight_scale_inv": inv,
                               P + "in_proj_qkvz.weight_scale": row_scale, P + "in_proj_qkvz.weight_scale_2": torch.ones(1) * 3,
                               P + "in_proj_ba.weight": ba}, cfg)
    q, k, v, z = parts(qkvz, nk, sizes)
    assert torch.equal(ck.get(P + "in_proj_qkv.weight"), torch.cat([q, k, v]))
    assert torch.equal(ck.get(P + "in_proj_z.weight"), z)
    b, a = parts(ba, nk, [r, r])
    assert torch.equal(ck.get(P + "in_proj_b.weight"), b) and torch.equal(ck.get(P + "in_proj_a.weight"), a)
    bq, bk, bv, bz = parts(inv, nk, [s // 128 for s in sizes])
    assert torch.equal(ck.get(P + "in_proj_qkv.weight_scale_inv"), torch.cat([bq, bk, bv]))
    assert torch.equal(ck.get(P + "in_proj_z.weight_scale_inv"), bz)
    rq, rk, rv, rz = parts(row_scale, nk, sizes)
    assert torch.equal(ck.get(P + "in_proj_qkv.weight_scale"), torch.cat([rq, rk, rv]))
    assert float(ck.get(P + "in_proj_z.weight_scale_2")) == 3.0
    assert ck.tensors[P + "in_proj_qkv.weight"].shape == [nk * (2 * dk + r * dv), c]
    assert not any("in_proj_qkvz" in n or "in_proj_ba" in n for n in ck.tensors)  # the fused names are gone
    for i in (0, 130, 700):  # one row at a time (as expert rows are read): the same rows
        assert torch.equal(ck.get(P + "in_proj_qkv.weight", i), torch.cat([q, k, v])[i])


def test_blocks_across_parts_are_refused(tmp_path):
    """16-row q and k parts inside one 128-row FP8 block: no block scale belongs to one part."""
    cfg = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    rows = 2 * (16 + 16 + 32 + 32)
    with pytest.raises(UnsupportedModelError, match="straddle"):
        checkpoint(tmp_path, {P + "in_proj_qkvz.weight": torch.randn(rows, 128),
                              P + "in_proj_qkvz.weight_scale_inv": torch.randn(2, 1)}, cfg)


def test_wrong_sizes_are_named(tmp_path):
    cfg = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    with pytest.raises(UnsupportedModelError, match="expected 192"):
        checkpoint(tmp_path, {P + "in_proj_qkvz.weight": torch.randn(100, 64)}, cfg)
    cfg["linear_num_value_heads"] = 3
    with pytest.raises(UnsupportedModelError, match="multiple"):
        checkpoint(tmp_path, {P + "in_proj_qkvz.weight": torch.randn(100, 64)}, cfg)
    cfg["linear_num_key_heads"] = 0
    with pytest.raises(UnsupportedModelError, match="at least 1"):
        checkpoint(tmp_path, {P + "in_proj_qkvz.weight": torch.randn(100, 64)}, cfg)


def test_config_reading():
    """Qwen3-Next's config.json as Qwen3.5-MoE's layers: its norm_topk_prob and dense layers read
    (Qwen3.5 always renormalises), a dense layer without intermediate_size named."""
    from freetoken.config import ModelConfig
    base = dict(architectures=["Qwen3NextForCausalLM"], vocab_size=320, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, norm_topk_prob=False)
    c = ModelConfig.from_hf(base)
    assert c.arch == "qwen3_5_moe" and c.moe_layers == [0, 1, 2, 3] and not c.norm_topk_prob
    with pytest.raises(UnsupportedModelError, match="intermediate_size"):
        ModelConfig.from_hf({**base, "mlp_only_layers": [2]})
    c = ModelConfig.from_hf({**base, "mlp_only_layers": [2], "intermediate_size": 96})
    assert c.moe_layers == [0, 1, 3] and c.intermediate_size == 96
    q35 = {**base, "architectures": ["Qwen3_5MoeForCausalLM"], "mlp_only_layers": [2]}
    c = ModelConfig.from_hf(q35)
    assert c.norm_topk_prob and c.moe_layers == [0, 1, 2, 3]
    with pytest.raises(UnsupportedModelError, match="linear_num_key_heads must be an integer"):
        ModelConfig.from_hf({**base, "linear_num_key_heads": 2.5})


def test_conversion_says_what_it_read_and_names_a_missing_fused_tensor(tmp_path, capsys):
    import hf_models
    from safetensors.torch import load_file

    from freetoken.errors import FreeTokenError
    from freetoken.weights.convert import convert
    d = str(tmp_path / "hf")
    hf_models.save(hf_models.qwen3_next(12, num_hidden_layers=2), d)
    convert(d, str(tmp_path / "ok.ftw"), progress=False)
    assert "Qwen3-Next, run as Qwen3.5-MoE's layers" in capsys.readouterr().err
    w = load_file(d + "/model.safetensors")
    del w["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    save_file(w, d + "/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FreeTokenError, match="in_proj_qkv.weight .read from Qwen3-Next's in_proj_qkvz"):
        convert(d, str(tmp_path / "bad.ftw"), progress=False)
    assert not (tmp_path / "bad.ftw").exists()
