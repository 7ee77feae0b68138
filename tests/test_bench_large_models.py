"""bench/large_models.py (issue 14's benchmark): its literal full-size shapes are transformers'
defaults; the weights it makes are the ones `ft convert` writes (names, shapes, the loader's
dtypes), and a full-size slice of each decodes on the meta device (no memory) through the static
path a CUDA graph captures; the estimate refuses a slice the host RAM cannot hold; the --tiny run
on the CPU (resident, CPU-only and cache rows) writes a JSON with sane rows."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench/
from bench import large_models as lm  # noqa: E402
from freetoken.config import ModelConfig  # noqa: E402
from freetoken.model.registry import model_class  # noqa: E402

transformers = pytest.importorskip("transformers")
ARCHS = ["deepseek_v4", "glm_moe_dsa"]


@pytest.mark.parametrize("arch", ARCHS)
def test_literal_shapes_are_the_transformers_defaults(arch):
    config_cls = getattr(transformers, lm.HF_CLASSES[arch][0])
    defaults = {**config_cls().to_dict(), "architectures": lm.SHAPES[arch]["architectures"]}
    assert ModelConfig.from_hf(lm.SHAPES[arch]).to_dict() == ModelConfig.from_hf(defaults).to_dict()
    mc = ModelConfig.from_hf(lm.slice_config(lm.SHAPES[arch], 12))
    assert mc.num_layers == 12 and mc.num_experts == 256 and mc.moe_intermediate_size == 2048
    if arch == "deepseek_v4":
        assert (mc.hidden_size, mc.top_k, mc.hash_layers, mc.hc_mult) == (4096, 6, [0, 1, 2], 4)
        assert set(mc.compressed_attention) == {"csa", "hca"} and mc.moe_layers == list(range(12))
    else:
        assert (mc.hidden_size, mc.top_k, mc.moe_layers) == (6144, 8, list(range(3, 12)))
        assert mc.indexer_types == ["full"] * 12
    tiny = ModelConfig.from_hf(lm.TINY[arch])  # the same structure
    assert (tiny.hash_layers, tiny.moe_layers[0], set(tiny.compressed_attention)) == \
        (mc.hash_layers, mc.moe_layers[0], set(mc.compressed_attention))


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_what_convert_writes(arch):
    cfg = lm.slice_config(lm.SHAPES[arch], 5)
    mc = ModelConfig.from_hf(cfg)
    plan = lm.weight_plan(cfg)
    assert set(plan) == set(model_class(mc.arch).expected_tensors(mc))
    for name, (shape, dt) in plan.items():
        if name.endswith("tid2eid"):
            assert dt == torch.int64 and shape == (mc.vocab_size, mc.top_k)
        elif name.endswith("e_score_correction_bias") or (arch == "deepseek_v4" and name.endswith(
                ("attn_hc.fn", "model.norm.weight"))):  # the router bias; V4's KEEP_FP32 modules
            assert dt == torch.float32, name
        elif name.endswith(("q_b_proj.weight", "o_proj.weight", "embed_tokens.weight")):
            assert dt == torch.bfloat16, name
    small = lm.weight_plan(lm.TINY[arch])
    w = lm.random_dense(small, ModelConfig.from_hf(lm.TINY[arch]), torch.device("cpu"))
    for name, t in w.items():
        assert torch.isfinite(t.float()).all() and t.dtype == small[name][1]
        if name.endswith("tid2eid"):  # valid: k distinct experts a token
            assert t.min() >= 0 and t.max() < 16 and all(len(set(r)) == t.shape[1] for r in t[:50].tolist())


@pytest.mark.parametrize("arch", ARCHS)
def test_full_size_slice_decodes_on_meta(arch, monkeypatch):
    """Four full-size layers (V4: hash-routed, HCA and CSA; GLM: three dense and one MoE) built
    from the plan on the meta device and one static decode step (the path a graph captures):
    every shape fits the engine's model class."""
    from freetoken.experts.executor import Activation, TorchExpertExecutor
    from freetoken.model import csa, mla
    from freetoken.model.state import DecodeState
    monkeypatch.setattr(csa, "_capturing", lambda x: True)
    monkeypatch.setattr(mla, "_capturing", lambda x: True)
    cfg = lm.slice_config(lm.SHAPES[arch], 4)
    mc = ModelConfig.from_hf(cfg)
    meta = torch.device("meta")
    w = {n: torch.empty(s, dtype=dt, device=meta) for n, (s, dt) in lm.weight_plan(cfg).items()}
    n, i, h = mc.num_flat_experts, mc.moe_intermediate_size, mc.hidden_size
    ex = TorchExpertExecutor(torch.empty(n, 2 * i, h, device=meta), torch.empty(n, h, i, device=meta),
                             activation=Activation.of(mc))
    model = model_class(mc.arch)(mc, w, ex, meta, torch.bfloat16, 1024)
    st = DecodeState(mc, 1, 512, meta, torch.bfloat16)
    st.reserve(0, 512)
    out = model.decode(torch.zeros(1, dtype=torch.long, device=meta), st, torch.zeros(1, dtype=torch.long, device=meta))
    assert out.shape == (1, mc.vocab_size)


def test_estimate_sizes_and_refuses(capsys):
    assert lm.expert_bytes("bf16", 4096, 2048) == 3 * 4096 * 2048 * 2
    assert lm.expert_bytes("mxfp4", 4096, 2048) == 3 * 4096 * 2048 * 17 // 32  # e2m1 pairs + an e8m0 per 32
    assert lm.main(["--arch", "deepseek_v4", "--layers", "12", "--modes", "cpu-only", "--estimate-only",
                    "--host-gb", "125"]) is None
    out = capsys.readouterr().out
    assert "mxfp4 3.42 GB" in out and "expert pool 41.1 GB" in out
    with pytest.raises(SystemExit, match="does not fit.*at most 21 MoE layers fit in nvfp4"):
        lm.main(["--arch", "glm_moe_dsa", "--layers", "40", "--estimate-only", "--host-gb", "125"])


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_run_on_the_cpu(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run (on CUDA the modes run on the GPU)")
    modes = ["resident", "cpu-only", "cache"]
    # one executor thread: pinned threads that spin would crawl on a 2-core machine another job loads
    path = lm.main(["--arch", arch, "--tiny", "--modes", ",".join(modes), "--threads", "1",
                    "--prompt", "40", "--tokens", "3", "--warmup", "1", "--cache-warmup", "1"])
    with open(path) as f:
        doc = json.load(f)
    res = doc["results"]
    assert doc["benchmark"] == f"large_models-{arch}-tiny" and res["tiny"] and res["device"] == "cpu"
    assert res["expert_format"] == lm.PUBLISHED_FORMAT[arch] and res["pool_gb"] > 0 and res["expert_mb"] > 0
    assert res["config"]["num_hidden_layers"] == 5 and res["bh_1_gbs"] > 0
    assert [r["mode"] for r in res["runs"]] == modes
    for r in res["runs"]:
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["graph"] is False and r["batch"] == 1
    cpu = res["runs"][1]
    assert cpu["expert_backend"] in ("cpp", "torch-fallback") and cpu["floor_ms"] > 0 and cpu["threads"] == 1
    cache = res["runs"][2]  # without CUDA the cache stays fill-only (no CPU branch in stream order)
    assert 0 < cache["miss_rate"] <= 1 and cache["fill_share_chosen"] == 1.0 and cache["adaptive_split"] is False
    assert cache["slots"] == int(0.33 * 16 * res["moe_layers"]) and cache["floor_ms"] > 0
