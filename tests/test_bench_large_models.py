"""bench/large_models.py (issues 14 and 12's benchmark): its literal full-size shapes are
transformers' defaults (Qwen3.6's: but for the release's rope theta and context); the weights it
makes are the ones `ft convert` writes (names, shapes, the loader's dtypes), and a full-size slice
of each decodes on the meta device (no memory) through the static path a CUDA graph captures; the
estimate refuses a slice the host RAM cannot hold and sizes every format of a list; the --tiny run
on the CPU (resident, CPU-only and cache rows; Qwen3.6 with two expert formats in one call) writes
a JSON with sane rows."""
import json
import os
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench/
from bench import large_models as lm  # noqa: E402
from freetoken.config import ModelConfig  # noqa: E402
from freetoken.model.registry import model_class  # noqa: E402

transformers = pytest.importorskip("transformers")
ARCHS = ["deepseek_v4", "glm_moe_dsa", "qwen3_5_moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_literal_shapes_are_the_transformers_defaults(arch):
    config_cls = getattr(transformers, lm.HF_CLASSES[arch][0])
    defaults = {**config_cls().to_dict(), "architectures": lm.SHAPES[arch]["architectures"]}
    if arch == "qwen3_5_moe":  # the release's rope theta and context, not transformers' defaults
        defaults.update({k: lm.QWEN36[k] for k in ("rope_parameters", "max_position_embeddings")})
    assert ModelConfig.from_hf(lm.SHAPES[arch]).to_dict() == ModelConfig.from_hf(defaults).to_dict()
    mc = ModelConfig.from_hf(lm.slice_config(lm.SHAPES[arch], 12))
    assert mc.num_layers == 12 and mc.num_experts == 256
    assert mc.moe_intermediate_size == (512 if arch == "qwen3_5_moe" else 2048)
    if arch == "qwen3_5_moe":
        assert (mc.hidden_size, mc.top_k, mc.shared_expert_intermediate_size) == (2048, 8, 512)
        assert mc.attention_layers == [3, 7, 11] and mc.moe_layers == list(range(12))
        full = ModelConfig.from_hf(lm.QWEN36)
        assert full.num_layers == 40 and len(full.linear_layers) == 30 and full.rope_theta == 1e7
    elif arch == "deepseek_v4":
        assert (mc.hidden_size, mc.top_k, mc.hash_layers, mc.hc_mult) == (4096, 6, [0, 1, 2], 4)
        assert set(mc.compressed_attention) == {"csa", "hca"} and mc.moe_layers == list(range(12))
    else:
        assert (mc.hidden_size, mc.top_k, mc.moe_layers) == (6144, 8, list(range(3, 12)))
        assert mc.indexer_types == ["full"] * 12
    tiny = ModelConfig.from_hf(lm.TINY[arch])  # the same structure
    assert (tiny.hash_layers, tiny.moe_layers[0], set(tiny.compressed_attention), set(tiny.layer_types)) == \
        (mc.hash_layers, mc.moe_layers[0], set(mc.compressed_attention), set(mc.layer_types))
    assert tiny.layer_types == mc.layer_types[:tiny.num_layers]


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
    """Four full-size layers (V4: hash-routed, HCA and CSA; GLM: three dense and one MoE; Qwen:
    three DeltaNet and one full attention, all MoE) built from the plan on the meta device and one
    static decode step (the path a graph captures): every shape fits the engine's model class."""
    from freetoken.experts.executor import Activation, TorchExpertExecutor
    from freetoken.model import csa, mla
    from freetoken.model.state import DecodeState
    monkeypatch.setattr(csa, "_capturing", lambda x: True)
    monkeypatch.setattr(mla, "_capturing", lambda x: True)
    from freetoken.kernels import paged_attention as pa

    def attend(q, k_pages, v_pages, table, lens, scale, window=None, splits=None, sinks=None):
        assert q.shape[1] % k_pages.shape[1] == 0 and q.shape[2] == k_pages.shape[3] == v_pages.shape[3]
        return torch.empty_like(q)  # the GQA kernel reads the lengths back off the GPU: shapes only here
    monkeypatch.setattr(pa, "paged_decode_attention", attend)
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
    # Qwen3.6 (issue 12): all 40 layers by default, each format of the list sized alone
    assert lm.expert_bytes("bf16", 2048, 512) == 3 * 2048 * 512 * 2
    assert lm.main(["--arch", "qwen3_5_moe", "--expert-format", "bf16,fp8_block,mxfp4,nvfp4", "--modes",
                    "resident,cpu-only", "--estimate-only", "--host-gb", "128"]) is None
    out = capsys.readouterr().out
    assert "40 layers: 40 MoE layers" in out and "bf16 1.61 GB | fp8_block 0.81 GB" in out
    for fmt, pool in (("bf16", 64.4), ("fp8_block", 32.2), ("mxfp4", 17.1), ("nvfp4", 18.1)):
        assert f"{fmt} (" in out and f"expert pool {pool} GB" in out
    with pytest.raises(SystemExit, match="does not fit.*at most 34 MoE layers fit in bf16"):
        lm.main(["--arch", "qwen3_5_moe", "--expert-format", "mxfp4,bf16", "--estimate-only", "--host-gb", "64"])
    with pytest.raises(SystemExit):  # an unknown format
        lm.main(["--arch", "qwen3_5_moe", "--expert-format", "bf16,int4", "--estimate-only"])


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_run_on_the_cpu(arch, tmp_path, monkeypatch):
    """Each arch's published format; Qwen3.6 two formats in one call (a row each, the first
    format's banks freed before the second's are made)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run (on CUDA the modes run on the GPU)")
    modes = ["resident", "cpu-only", "cache"]
    fmts = ["bf16", "mxfp4"] if arch == "qwen3_5_moe" else [lm.PUBLISHED_FORMAT[arch]]
    made, make_banks = [], lm.make_banks

    def tracked(fmt, *args, **kw):  # no bank of an earlier format is alive when the next is made
        import gc
        gc.collect()
        assert all(r() is None for r in made), "the previous format's banks are still alive"
        banks, pinned = make_banks(fmt, *args, **kw)
        made.extend(weakref.ref(t) for t in banks.tensors())
        return banks, pinned
    monkeypatch.setattr(lm, "make_banks", tracked)
    # one executor thread: pinned threads that spin would crawl on a 2-core machine another job loads
    path = lm.main(["--arch", arch, "--tiny", "--modes", ",".join(modes), "--threads", "1",
                    "--expert-format", ",".join(fmts),
                    "--prompt", "40", "--tokens", "3", "--warmup", "1", "--cache-warmup", "1", "--prefill", "20"])
    with open(path) as f:
        doc = json.load(f)
    res = doc["results"]
    assert doc["benchmark"] == f"large_models-{arch}-tiny" and res["tiny"] and res["device"] == "cpu"
    assert res["expert_format"] == ",".join(fmts) and res["expert_formats"] == fmts
    assert res["config"]["num_hidden_layers"] == lm.TINY[arch]["num_hidden_layers"]
    assert [(r["expert_format"], r["mode"]) for r in res["runs"]] == [(f, m) for f in fmts for m in modes]
    assert list(res["formats"]) == fmts
    per = {f: res["formats"][f] for f in fmts}
    if len(fmts) == 1:  # one format: its fields at the top too, as before
        assert all(res[k] == v for k, v in per[fmts[0]].items())
    else:  # the formats' own sizes
        assert per["bf16"]["expert_mb"] > 3 * per["mxfp4"]["expert_mb"]
    for f in fmts:
        assert per[f]["pool_gb"] > 0 and per[f]["expert_mb"] > 0 and per[f]["bh_1_gbs"] > 0
    for r in res["runs"]:
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["graph"] is False and r["batch"] == 1
    for n, f in enumerate(fmts):
        cpu = res["runs"][3 * n + 1]
        assert cpu["expert_backend"] in ("cpp", "torch-fallback") and cpu["floor_ms"] > 0 and cpu["threads"] == 1
        # --prefill: the cpu-only rows time a prompt too (llama.cpp's figure only with --llamacpp)
        assert cpu["prefill_tokens"] == 20 and cpu["prefill_tok_s"] > 0 and cpu["llamacpp_prefill_tok_s"] is None
        assert "prefill_tok_s" not in res["runs"][3 * n] and "prefill_tok_s" not in res["runs"][3 * n + 2]
        cache = res["runs"][3 * n + 2]  # without CUDA the cache stays fill-only (no CPU branch in stream order)
        assert 0 < cache["miss_rate"] <= 1 and cache["fill_share_chosen"] == 1.0 and cache["adaptive_split"] is False
        experts = lm.TINY[arch].get("n_routed_experts") or lm.TINY[arch]["num_experts"]
        assert cache["slots"] == int(0.33 * experts * res["moe_layers"]) and cache["floor_ms"] > 0


def test_fp8_projections_as_a_release_quantizes_them(tmp_path, monkeypatch):
    """--dense-format: the projections an FP8 release publishes in FP8 become Fp8BlockWeight (kept)
    or their dequantized values in the compute dtype; DeltaNet's in_proj_a / in_proj_b, routers,
    lm_head and embeddings stay as they were."""
    from freetoken.config import ModelConfig
    from freetoken.weights.dense_fp8 import Fp8BlockWeight
    cfg = lm.slice_config(lm.TINY["qwen3_5_moe"], 4)
    plan = lm.weight_plan(cfg, torch.float32)
    w0 = lm.random_dense(plan, ModelConfig.from_hf(cfg), torch.device("cpu"))
    kept, deq = dict(w0), dict(w0)
    lm.fp8_projections(kept, keep=True, dtype=torch.float32)
    lm.fp8_projections(deq, keep=False, dtype=torch.float32)
    fp8 = {n for n, t in kept.items() if isinstance(t, Fp8BlockWeight)}
    assert any(n.endswith("linear_attn.in_proj_qkv.weight") for n in fp8)
    assert any(n.endswith("self_attn.q_proj.weight") for n in fp8)
    assert any(n.endswith("shared_expert.down_proj.weight") for n in fp8)
    assert not any(n.endswith(("in_proj_a.weight", "in_proj_b.weight", "mlp.gate.weight", "lm_head.weight",
                               "embed_tokens.weight")) for n in fp8)
    for n in fp8:
        assert deq[n].dtype == torch.float32 and torch.equal(deq[n], kept[n].dequantize(torch.float32))
        # the block quantizer's error: within half an e4m3 step of each block's scale
        assert (deq[n] - w0[n].float()).abs().max() <= w0[n].float().abs().max() / 448 * 16
    # a float32 plan keeps the 2-D weights bf16 (a CPU engine's --dense-bf16 auto), the norms fp32
    assert w0["lm_head.weight"].dtype == torch.bfloat16
    assert all(t.dtype == torch.float32 for n, t in w0.items() if n.endswith("norm.weight"))
    # a cpu-only row through the real model with them kept, in a CPU engine's float32
    monkeypatch.setenv("OUT", str(tmp_path))
    path = lm.main(["--arch", "qwen3_5_moe", "--tiny", "--modes", "cpu-only", "--threads", "1", "--expert-format",
                    "fp8_block", "--dense-format", "fp8_block", "--compute-dtype", "float32", "--prompt", "40",
                    "--tokens", "3", "--warmup", "1"])
    with open(path) as f:
        res = json.load(f)["results"]
    assert res["dense_format"] == "fp8_block" and res["compute_dtype"] == "float32"
    assert res["dense_kept_gb"] < res["dense_gb"]  # the plan's bf16 projections, kept in FP8
    assert "error" not in res["runs"][0] and res["runs"][0]["tok_s"] > 0
    with pytest.raises(SystemExit):  # the GPU modes run a bf16 model
        lm.main(["--arch", "qwen3_5_moe", "--tiny", "--modes", "cpu-only,resident", "--compute-dtype", "float32"])


def test_fixed_split_and_fill_only_rows(tmp_path, monkeypatch):
    """--modes split,fill-only: the pool with a fixed fill share per --fill-shares value (the
    misses beyond it run on the CPU) and with every miss filled, beside the adaptive cache."""
    monkeypatch.setenv("OUT", str(tmp_path))
    path = lm.main(["--arch", "qwen3_5_moe", "--tiny", "--modes", "resident,split,fill-only", "--fill-shares", "0.25,0.75",
                    "--threads", "1", "--expert-format", "bf16", "--prompt", "40", "--tokens", "3", "--warmup", "1"])
    with open(path) as f:
        runs = json.load(f)["results"]["runs"]
    assert [(r["mode"], r.get("fill_share")) for r in runs] == [
        ("resident", None), ("split", 0.25), ("split", 0.75), ("fill-only", None)]
    for r in runs[1:]:
        assert "error" not in r, r
        assert r["tok_s"] > 0 and r["slots"] > 0
    assert runs[1]["floor_ms"] > 0 and runs[2]["floor_ms"] > 0  # no B_P without CUDA: no fill-only floor
    low, high, every = runs[1:]
    # a fixed r: about that share of each layer's misses filled, the rest on the CPU
    assert low["cpu_experts_per_step"] > high["cpu_experts_per_step"] > every.get("cpu_experts_per_step", 0) == 0
    assert low["fills_per_step"] < high["fills_per_step"]
    with pytest.raises(SystemExit):
        lm.main(["--arch", "qwen3_5_moe", "--tiny", "--modes", "split", "--fill-shares", "1.5"])


def test_drift_run_reports_the_splits_reaction():
    """bench.expert_cache.drift_run (--drift-hog): a real hog process runs beside the steps; a
    split decided on a fast host, whose CPU share then costs 6x (simulated step times fed to the
    real tuner), is reported with the steps it took to react and the r it settled on."""
    from bench.expert_cache import drift_run
    from freetoken.experts.share import ShareTuner
    fast = {1.0: 10.0, 0.9: 9.4, 0.8: 8.8, 0.7: 8.2, 0.6: 8.6, 0.5: 9.2, 0.4: 9.8, 0.3: 10.4, 0.2: 11.0, 0.1: 11.6}
    t = ShareTuner(probe=10, settle=2, hold=1_000_000)
    while t.climbing:
        t.observe(1, fast[t.share] / 1e3)
    assert t.share == 0.7
    for _ in range(40):  # the row's timed steps: the hold's watch takes its reference from them
        t.observe(1, fast[t.share] / 1e3)
    got = drift_run(lambda k: t.observe(1, (10.0 + (1.0 - t.share) * 60.0) / 1e3), t, 0,
                    {"threads": 1, "cpus": None, "steps": 300, "mb": 16})
    assert got["r_before"] == 0.7 and got["r_after"] == 1.0 and got["decided_after"]
    assert got["drifts"] == 1 and got["decisions"] == 1 and 0 < got["steps_to_react"] <= 30
    assert got["hog_gbs"] > 0 and len(got["r_per_step"]) == 300 and got["r_per_step"][0] == 0.7


def test_control_variant_changes_only_decode_calls(monkeypatch):
    """--control-variant WARPS,BLOCK: decode-sized control calls (pair buckets up to 64) take the
    given warps and scan chunk, larger buckets keep theirs; malformed values are refused."""
    from freetoken.experts import control
    monkeypatch.setattr(control, "control_warps", control.control_warps)  # restored after the test
    monkeypatch.setattr(control, "scan_block", control.scan_block)
    before = {p: (control.control_warps(p), control.scan_block(p)) for p in (8, 64, 128, 4096)}
    lm.use_control_variant(4, 1024)
    assert control.control_warps(8) == control.control_warps(64) == 4 and control.scan_block(8) == 1024
    assert all((control.control_warps(p), control.scan_block(p)) == before[p] for p in (128, 4096))
    assert lm.parse(["--arch", "qwen3_5_moe", "--control-variant", "4,1024"]).control_variant == (4, 1024)
    for bad in ("4", "3,1024", "4,1000", "x,y", "4,1024,2"):
        with pytest.raises(SystemExit):
            lm.parse(["--arch", "qwen3_5_moe", "--control-variant", bad])


def test_qwen3_next_shape_is_the_release_run_as_qwen3_5():
    """The Qwen3-Next-80B-A3B shape, written as the Qwen3.5-MoE config FreeToken runs it as, reads
    as transformers' Qwen3NextConfig() defaults with the release's context and rope theta; it sizes
    like the release (48 layers of 512 experts, top-10: 77.3 GB of FP8 experts) and refuses BF16's
    155 GB on a 125 GB host."""
    defaults = {**transformers.Qwen3NextConfig().to_dict(), "architectures": ["Qwen3NextForCausalLM"],
                "max_position_embeddings": 262144, "rope_parameters": lm.QWEN3_NEXT["rope_parameters"]}
    got, want = ModelConfig.from_hf(lm.QWEN3_NEXT).to_dict(), ModelConfig.from_hf(defaults).to_dict()
    assert got == want
    assert (want["num_layers"], want["num_experts"], want["top_k"], len(want["moe_layers"])) == (48, 512, 10, 48)
    assert lm.main(["--arch", "qwen3_next", "--modes", "cpu-only,cache", "--estimate-only", "--host-gb", "125"]) is None
    with pytest.raises(SystemExit, match="at most 36 MoE layers fit in bf16"):
        lm.main(["--arch", "qwen3_next", "--expert-format", "bf16", "--estimate-only", "--host-gb", "125"])
