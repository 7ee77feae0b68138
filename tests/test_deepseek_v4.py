"""DeepSeek-V4 (DeepseekV4ForCausalLM) against transformers on small random configs: logits at
prefill and at each of 32 decode steps within 1e-4 relative (float32) and identical greedy ids,
with prompts longer than the sliding window, than the compress windows and than the indexer's
top-k (so its selection decides which entries each query sees); sliding-only, CSA and HCA
layers, hyper-connections (4, 2 and 1 streams), sqrt-softplus and sigmoid scores, hash-routed
layers, YaRN on the compressed layers' RoPE; through the serving loop (continuous batching,
mixed steps) too; chunked prefill equal to unchunked; the static decode path (whole block
table, as captured in a CUDA graph) equal to the eager one; prefix reuse across an edit equal to
a cold prefill; `ft convert` from DeepSeek's tensor names (MTP head skipped, said so) then
Engine.generate equal to transformers' greedy generate. Beside them: the config as transformers
derives it from its legacy keys, the refusals, and the name mapping."""
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from drive import drive
from freetoken.cache.config import CacheConfig
from freetoken.cli import main as ft_main
from freetoken.config import ModelConfig
from freetoken.errors import UnsupportedModelError
from freetoken.model import csa
from freetoken.model.state import DecodeState
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert
from freetoken.weights.hf import deepseek_v4_name
from test_reference import engine_greedy, prompt_for, rel_err

STEPS = 32
P = 37  # prompt length: past the window (8), the compress windows (4, 8) and 3 entries of top-k
CASES = {
    # name: (seed, config overrides)
    "flash-like": (0, {}),
    "yarn-sigmoid-hc2": (1, dict(hc_mult=2, scoring_func="sigmoid", sliding_window=5, index_topk=2,
                                 layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                                              "sliding_attention"], num_hidden_layers=3,
                                 mlp_layer_types=["moe", "hash_moe", "moe"], num_experts_per_tok=3,
                                 compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                                 rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                                      beta_fast=32.0, beta_slow=1.0))),
    "hc1-no-hash": (2, dict(hc_mult=1, mlp_layer_types=["moe"] * 4, index_topk=5, routed_scaling_factor=1.0)),
    # a swiglu_limit the tiny model's gate and up values pass: the routed experts' clamp matters
    "clamped": (4, dict(swiglu_limit=0.05)),
}


def build(name, d):
    seed, kw = CASES[name]
    model = hf_models.deepseek_v4(seed, **kw)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return model, str(d / "m.ftw")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return {name: build(name, tmp_path_factory.mktemp(name)) for name in CASES}


def cpu_engine(ftw, **kw):
    """The routed experts on the host executor's torch path (reference_experts, as without the C++
    library): the model is what most tests here check; test_other_expert_paths runs the C++
    executor and the expert cache."""
    with mock.patch("freetoken.experts.cpu.extension", lambda: None):
        return Engine(ftw, EngineConfig(device="cpu", dtype="float32", **kw))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(built, name):
    model, ftw = built[name]
    eng = cpu_engine(ftw)
    prompt = prompt_for(CASES[name][0], n=P)
    pre, toks, steps = engine_greedy(eng, prompt, STEPS)
    ref = hf_models.reference_logits(model, prompt + toks)
    assert rel_err(pre, ref[:P]) < 1e-4
    for i in range(STEPS):
        assert rel_err(steps[i], ref[P + i]) < 1e-4, f"decode step {i}"
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()
    assert rel_err(steps[:8], hf_models.cached_decode_logits(model, prompt, toks[:8])) < 1e-4


@pytest.mark.parametrize("path", [dict(experts="cpu"), dict(moe="cache", expert_cache="0.3", fill_share=0.5)])
def test_other_expert_paths_match_transformers(built, path):
    """The C++ executor (CPU-only), and the expert cache (host slots without CUDA, half of the
    misses copied into slots and half run by the C++ executor): the same logits."""
    model, ftw = built["flash-like"]
    eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", **path))
    prompt = prompt_for(1, n=P)
    pre, toks, steps = engine_greedy(eng, prompt, 8)
    ref = hf_models.reference_logits(model, prompt + toks)
    assert rel_err(pre, ref[:P]) < 1e-4
    assert rel_err(steps, ref[P:]) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_expert_paths_match_transformers(built):
    """On the GPU (decode graphs, fp32 so that no router near-tie flips between paths): experts
    resident, through the expert cache and CPU-only, each within 1e-3 of transformers' logits."""
    from drive import check_gpu_paths
    check_gpu_paths(*built["flash-like"])


def test_the_branches_matter(built):
    """The tests above would see a wrong selection, window or stream count: transformers itself,
    with every entry selected or a wider window, gives other logits on the same weights."""
    model, _ = built["flash-like"]
    prompt = prompt_for(0, n=P)
    ref = hf_models.reference_logits(model, prompt)
    for change in (dict(index_topk=1000), dict(sliding_window=64)):
        other = hf_models.deepseek_v4(0, **change)
        other.load_state_dict(model.state_dict())
        assert rel_err(hf_models.reference_logits(other, prompt), ref) > 1e-2, change


@pytest.mark.parametrize("n", [3, 29])
def test_static_decode_equals_eager(built, monkeypatch, n):
    """Under CUDA-graph capture the decode reads every closing position the block table holds
    (the indexer scores them all, unwritten ones masked, and gathers its top-k); eagerly only
    those the longest row has closed. Same logits across that switch; an idle row beside them
    stays finite and leaves the others alone."""
    model, ftw = built["flash-like"]
    eng = cpu_engine(ftw)
    prompt = prompt_for(9, n=n)
    outs = {}
    for static in (False, True):
        monkeypatch.setattr(csa, "_capturing", lambda x: static)
        st = DecodeState(eng.cfg, 2, 64, torch.device("cpu"), torch.float32, page_size=4)
        st.reserve(0, 64)
        first = eng.prefill(prompt, st, slot=0)
        toks, got = [int(first[-1].argmax())], []
        for i in range(10):
            out = eng.model.decode(torch.tensor([toks[-1], 3]), st, torch.tensor([n + i, 0]),
                                   torch.tensor([True, False]))
            assert torch.isfinite(out).all()
            got.append(out[0])
            toks.append(int(out[0].argmax()))
        outs[static] = (torch.stack(got), toks)
    assert outs[True][1] == outs[False][1]
    assert rel_err(outs[True][0], outs[False][0]) < 1e-5
    ref = hf_models.reference_logits(model, prompt + outs[True][1][:-1])
    assert rel_err(outs[True][0], ref[n:]) < 1e-4


def test_chunked_prefill_equals_unchunked(built, monkeypatch):
    """Chunks that split windows (5 tokens against windows of 4 and 8), and (MAX_SCORES tiny) a
    chunk's queries taken a few rows at a time: the same logits, and the same next decode."""
    model, ftw = built["flash-like"]
    prompt = prompt_for(7, n=45)
    whole, chunked = cpu_engine(ftw), cpu_engine(ftw, prefill_chunk=5)
    a = whole.prefill(prompt, whole.new_state(64), all_logits=True)
    st = chunked.new_state(64)
    b = chunked.prefill(prompt, st, all_logits=True)
    assert rel_err(b, a) < 1e-5
    monkeypatch.setattr(csa, "MAX_SCORES", 500)
    assert rel_err(whole.prefill(prompt, whole.new_state(64), all_logits=True), a) < 1e-5
    monkeypatch.undo()
    assert rel_err(b, hf_models.reference_logits(model, prompt)) < 1e-4
    pos, tok = torch.tensor([len(prompt)]), torch.tensor([int(b[-1].argmax())])
    st2 = whole.new_state(64)
    whole.prefill(prompt, st2)
    assert rel_err(chunked.model.decode(tok, st, pos), whole.model.decode(tok, st2, pos)) < 1e-5


def greedy_req(p, n):
    return Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))


def check_against_transformers(model, req):
    """The request's tokens are the reference's greedy ones, each step's logits within 1e-4."""
    n = len(req.prompt_ids)
    ref = hf_models.reference_logits(model, req.prompt_ids + req.output_ids[:-1])[n - 1:]
    assert req.output_ids == ref.argmax(-1).tolist()
    assert len(req.logits) == len(req.output_ids)
    for a, b in zip(req.logits, ref):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("name", ["flash-like", "yarn-sigmoid-hc2", "clamped"])
def test_serving_loop_matches_transformers(built, name):
    """Continuous batching: requests joining while others decode, prompt chunks sharing forwards
    with decode rows (the token ids reach the hash-routed layers in every kind of forward)."""
    model, ftw = built[name]
    eng = cpu_engine(ftw, prefill_chunk=7, max_step_tokens=16, decode_slowdown=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (30, 4, 17, 9)]
    srv = ServingEngine(eng, max_batch=3, max_queue=8, record_logits=True, start=False)
    reqs = drive(srv, [greedy_req(p, n) for p, n in zip(prompts, (12, 20, 9, 14))], arrive=[0, 1, 2, 6])
    for r in reqs:
        assert r.finish_reason == "length"
        check_against_transformers(model, r)


@pytest.mark.parametrize("sliding", ["window", "full"])
def test_prefix_reuse_is_exact(built, sliding):
    """A restore across an edit (partial page copied) and an extension equal a cold prefill and
    transformers. "full": the sliding keys, compressor projections and entries all live in the
    paged pool, shared as K/V pages are, restored at any page; "window": the keys and projections
    in a ring per slot, the entries in the pool, restored at checkpoints (every 3 tokens here: partial pages copied)
    with the ring rows copied back."""
    model, ftw = built["flash-like"]
    eng = cpu_engine(ftw, prefill_chunk=16, sliding_kv=sliding)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, 320, (61,), generator=g).tolist()
    edited = first[:45] + torch.randint(0, 320, (6,), generator=g).tolist() + first[51:]
    extended = first + torch.randint(0, 320, (9,), generator=g).tolist()
    warm = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(page_size=4, checkpoint_policy="interval:3"))
    assert bool(warm.state.kr) == (sliding == "window") and warm.describe()["sliding_kv"] == sliding
    cold = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(enabled=False))
    drive(warm, [greedy_req(first, 5)])
    for second in (edited, extended):
        shared = next(i for i, (a, b) in enumerate(zip(first + [-1], second)) if a != b)
        got = drive(warm, [greedy_req(second, 6)])[0]
        ref = drive(cold, [greedy_req(second, 6)])[0]
        assert shared - 4 <= got.cached_tokens <= shared
        assert got.output_ids == ref.output_ids
        for a, b in zip(got.logits, ref.logits):
            assert rel_err(a, b) < 1e-4
        check_against_transformers(model, got)


def test_ft_convert_skips_mtp_then_generate_matches_transformers(built, tmp_path, capfd):
    """transformers saves DeepSeek's own names (layers.N.attn.wq_a, ffn.experts.E.w1, ...): `ft
    convert` maps them and says it skips the MTP head; Engine.generate's greedy tokens are
    transformers' generate()."""
    model, _ = built["flash-like"]
    src = tmp_path / "hf"
    hf_models.save(model, str(src))
    fn = str(src / "model.safetensors")
    w = load_file(fn)
    assert "model.layers.0.attn.wq_a.weight" in w  # the published naming
    mtp = {"mtp.0.e_proj.weight": torch.randn(64, 64), "mtp.0.attn.wq_a.weight": torch.randn(48, 64)}
    save_file({**w, **mtp}, fn, metadata={"format": "pt"})
    capfd.readouterr()
    assert ft_main(["convert", str(src), str(tmp_path / "m.ftw"), "--quiet"]) == 0
    err = capfd.readouterr().err
    assert "skipping the multi-token-prediction head (2 mtp.* tensors" in err
    eng = cpu_engine(str(tmp_path / "m.ftw"))
    prompt = prompt_for(11, n=15)
    gen = eng.generate(prompt, 20, stop_at_eos=False)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert gen.token_ids == ref[0, len(prompt):].tolist()


# ----------------------------------------------------------------------------- the pieces


def published_config():
    """The shape of DeepSeek-V4-Flash's config.json in its legacy keys (compress_ratios,
    num_hash_layers, qk_rope_head_dim, a flat YaRN rope_scaling), 6 layers of it."""
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
            "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 64,
            "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
            "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256, "n_shared_experts": 1,
            "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
            "norm_topk_prob": True, "swiglu_limit": 10.0, "sliding_window": 128, "num_hash_layers": 3,
            "compress_ratios": [0, 0, 4, 128, 4, 128], "compress_rope_theta": 160000, "rope_theta": 10000,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "eos_token_id": 1,
            "num_nextn_predict_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False}


def test_config_as_transformers_derives_it():
    from transformers import DeepseekV4Config
    raw = published_config()
    hc = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg = ModelConfig.from_hf(raw)
    kinds = {"sliding_attention": "none", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
    assert cfg.compressed_attention == [kinds[t] for t in hc.layer_types] == ["none", "none", "csa", "hca", "csa", "hca"]
    assert cfg.hash_layers == [i for i, t in enumerate(hc.mlp_layer_types) if t == "hash_moe"] == [0, 1, 2]
    assert cfg.qk_rope_head_dim == hc.qk_rope_head_dim == 64
    comp = hc.rope_parameters["compress"]
    assert cfg.compress_rope_theta == comp["rope_theta"] and cfg.rope_theta == hc.rope_parameters["main"]["rope_theta"]
    assert cfg.rope_scaling["factor"] == comp["factor"] and cfg.rope_scaling["attention_factor"] == 1.0
    assert (cfg.compress_rate_csa, cfg.compress_rate_hca) == (4, 128) and cfg.moe_layers == list(range(6))
    # and from the nested form transformers writes back
    again = ModelConfig.from_hf({**hc.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    assert again.to_dict() == {**cfg.to_dict()}


@pytest.mark.parametrize("change, match", [
    (dict(scoring_func="softmax"), "scoring_func"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(compress_ratios=[0, 0, 4, 64, 4, 128]), "compress_ratios"),
    (dict(o_groups=3), "o_groups"),
    (dict(rope_scaling={"type": "longrope", "factor": 4}), "longrope"),
])
def test_config_refusals(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf({**published_config(), **change})


def test_published_names():
    for src, want in [("embed.weight", "model.embed_tokens.weight"), ("head.weight", "lm_head.weight"),
                      ("norm.weight", "model.norm.weight"), ("hc_head_fn", "model.hc_head.hc_fn"),
                      ("layers.2.attn.wq_b.weight", "model.layers.2.self_attn.q_b_proj.weight"),
                      ("layers.2.attn.norm.weight", "model.layers.2.self_attn.kv_norm.weight"),
                      ("layers.2.attn.indexer.wq_b.weight", "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"),
                      ("layers.2.attn.indexer.compressor.wgate.weight",
                       "model.layers.2.self_attn.compressor.indexer.gate_proj.weight"),
                      ("layers.2.attn.compressor.ape", "model.layers.2.self_attn.compressor.position_bias"),
                      ("layers.2.ffn.gate.bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
                      ("layers.2.ffn.experts.7.w3.weight", "model.layers.2.mlp.experts.7.up_proj.weight"),
                      ("layers.2.ffn.shared_experts.w2.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"),
                      ("layers.2.hc_ffn_scale", "model.layers.2.ffn_hc.scale"),
                      ("layers.2.attn_norm.weight", "model.layers.2.input_layernorm.weight"),
                      ("layers.2.attn.attn_sink", "model.layers.2.self_attn.sinks")]:
        assert deepseek_v4_name(src) == want
        assert deepseek_v4_name(want) == want  # transformers' names pass unchanged


def test_bfloat16_runs_close_to_float32(built):
    """bf16 compute: finite, and most positions near the fp32 logits. Not all: the indexer's top-k
    and the router are discrete choices that bf16 rounding flips now and then (transformers' own
    bf16 run of this model and prompt is 2% off its fp32 one at the median position, 15% at the
    fourth worst, 87% at the worst)."""
    _, ftw = built["flash-like"]
    prompt = prompt_for(0, n=P)
    e32 = cpu_engine(ftw)
    with mock.patch("freetoken.experts.cpu.extension", lambda: None):
        e16 = Engine(ftw, EngineConfig(device="cpu", dtype="bfloat16"))
    a = e32.prefill(prompt, e32.new_state(64), all_logits=True)
    b = e16.prefill(prompt, e16.new_state(64), all_logits=True)
    assert torch.isfinite(b).all()
    errs = sorted(rel_err(b[i], a[i]) for i in range(len(prompt)))
    assert errs[len(errs) // 2] < 0.05 and errs[-4] < 0.25


def test_bfloat16_keeps_the_fp32_modules_of_transformers(built, monkeypatch):
    """bf16 compute loads what transformers keeps in fp32 (DeepseekV4's
    _keep_in_fp32_modules_strict: hyper-connections, sinks, position biases, norms, the
    correction bias) in fp32, everything else in bf16; its logits are then closer to
    transformers' own bf16 model (from_pretrained in bf16, those modules fp32) than with every
    tensor rounded to bf16."""
    import os

    from transformers import DeepseekV4ForCausalLM
    from freetoken.model.deepseek_v4 import DeepseekV4Model
    from freetoken.weights.reader import dense_weights, load_ftw
    assert set(DeepseekV4Model.KEEP_FP32) == set(DeepseekV4ForCausalLM._keep_in_fp32_modules_strict)
    _, ftw = built["flash-like"]
    meta, w = load_ftw(ftw)
    dense = dense_weights(meta, w, torch.device("cpu"), torch.bfloat16, DeepseekV4Model.KEEP_FP32)
    kept = {k for k, v in dense.items() if v.dtype == torch.float32}
    assert "model.layers.1.attn_hc.fn" in kept and "model.norm.weight" in kept
    assert "model.layers.1.self_attn.compressor.position_bias" in kept and "model.hc_head.hc_scale" in kept
    assert "model.layers.1.self_attn.q_b_proj.weight" not in kept and "model.embed_tokens.weight" not in kept
    prompt = prompt_for(2, n=P)
    hf = DeepseekV4ForCausalLM.from_pretrained(os.path.join(os.path.dirname(ftw), "hf"), dtype=torch.bfloat16).eval()
    assert hf.model.layers[1].attn_hc.fn.dtype == torch.float32  # transformers keeps it so
    with torch.no_grad():
        try:
            ref = hf(torch.tensor([prompt])).logits[0].float()
        except RuntimeError as e:  # transformers 5.17: fp32 hyper-connection output into a bf16 q_a_proj
            if "same dtype" not in str(e):
                raise
            pytest.skip(f"this transformers' bf16 DeepseekV4 cannot run its own forward: {e}")
    errs = {}
    for keep in (True, False):
        if not keep:
            monkeypatch.setattr(DeepseekV4Model, "KEEP_FP32", ())
        with mock.patch("freetoken.experts.cpu.extension", lambda: None):
            eng = Engine(ftw, EngineConfig(device="cpu", dtype="bfloat16"))
        got = eng.prefill(prompt, eng.new_state(64), all_logits=True)
        errs[keep] = sorted(rel_err(got[i], ref[i]) for i in range(len(prompt)))
    print({k: [round(e, 4) for e in v[len(v) // 2:len(v) // 2 + 1]] for k, v in errs.items()})
    assert sum(errs[True]) < sum(errs[False])


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_router_equals_transformers(scoring):
    """Ids (as sets) and weights of the top-k router with its correction bias, and of the hash
    router, against DeepseekV4TopKRouter / DeepseekV4HashRouter."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
    from freetoken.model.deepseek_v4 import DeepseekV4MoE
    hc = DeepseekV4Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, scoring_func=scoring,
                          routed_scaling_factor=1.7, vocab_size=50, num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"])
    g = torch.Generator().manual_seed(0)
    topk, hashr = DeepseekV4TopKRouter(hc), DeepseekV4HashRouter(hc)
    with torch.no_grad():
        for r in (topk, hashr):
            r.weight.copy_(torch.randn(16, 32, generator=g) * 0.3)
        topk.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
        hashr.tid2eid.copy_(torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(50)]))
    cfg = ModelConfig.from_hf({**hc.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    shared = {f"model.layers.{i}.mlp.shared_experts.{n}.weight": torch.zeros(8, 32) for i in (0, 1)
              for n in ("gate_proj", "up_proj", "down_proj")}
    ids = {"tokens": torch.randint(0, 50, (64,), generator=g)}
    x = torch.randn(64, 32, generator=g)
    for layer, ref, extra in ((0, hashr, "gate.tid2eid"), (1, topk, "gate.e_score_correction_bias")):
        p = f"model.layers.{layer}.mlp."
        w = {**shared, p + "gate.weight": ref.weight.detach(), p + extra: getattr(ref, extra.split(".")[1])}
        moe = DeepseekV4MoE(cfg, w, layer, layer, None, ids)
        _, rw, ri = ref(x, ids["tokens"]) if layer == 0 else ref(x)
        got, wts = moe.route(x)
        got = got - 16 * layer  # flat ids of this ordinal
        order_ref, order = ri.sort(-1), got.sort(-1)
        assert torch.equal(order.values, order_ref.values)
        assert torch.allclose(wts.gather(1, order.indices), rw.gather(1, order_ref.indices), rtol=1e-6, atol=0)


# Triton reads CPU tensors only under the interpreter (the CPU machines); on a GPU it runs on CUDA
@pytest.mark.parametrize("device", ["cuda"] if torch.cuda.is_available() else ["cpu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
def test_routed_expert_clamp_in_the_kernels(dtype, tol, device):
    """DeepSeek-V4's routed experts: silu(min(g, L)) * clamp(u, -L, L), as transformers' experts
    compute it; the Triton decode and grouped kernels against the torch reference, with values
    well past the limit (a limit the inputs never reach would prove nothing)."""
    pytest.importorskip("triton")
    from freetoken.experts.executor import Activation, TorchExpertExecutor, reference_experts
    from freetoken.kernels.moe_decode import moe_decode_triton
    from freetoken.kernels.moe_grouped import moe_grouped_triton
    g = torch.Generator().manual_seed(8)
    n, h, i = 10, 64, 32
    gu = (torch.randn(n, 2 * i, h, generator=g) * 2 * h ** -0.5).to(dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    act = Activation("silu_clamp", limit=0.5)
    plain = Activation("silu_clamp", limit=1e9)
    for t, k, kernel in ((3, 4, "decode"), (29, 3, "grouped")):
        x = torch.randn(t, h, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
        ids[1, 0] = -1
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
        ref = reference_experts(x.float(), ids, w.float(), gu.float(), dn.float(), activation=act)
        unclamped = reference_experts(x.float(), ids, w.float(), gu.float(), dn.float(), activation=plain)
        assert rel_err(unclamped, ref) > 0.1  # the clamp matters on these inputs
        on = [v.to(device) for v in (x, ids, w, gu, dn)]
        if kernel == "decode":
            got = moe_decode_triton(*on, activation=act)
            want = TorchExpertExecutor(*on[3:], activation=act)._static(*on[:3]).float()
            assert rel_err(got.float(), want) < tol
        else:
            got = moe_grouped_triton(*on, activation=act)
        assert rel_err(got.float().cpu(), ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_routed_expert_clamp_on_the_cpu_executor(dtype, tol):
    """The C++ executor computes the clamped SiLU (activation code 2) as the torch reference does."""
    from freetoken.experts.cpu import CpuExpertExecutor, extension
    from freetoken.experts.executor import Activation, reference_experts
    if extension() is None:
        pytest.skip("the C++ executor could not be built")
    g = torch.Generator().manual_seed(9)
    n, h, i, t, k = 12, 64, 32, 5, 4
    gu = (torch.randn(n, 2 * i, h, generator=g) * 2 * h ** -0.5).to(dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    act = Activation("silu_clamp", limit=0.5)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    ids[2, 1] = -1
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    ref = reference_experts(x.float(), ids, w, gu.float(), dn.float(), activation=act)
    got = CpuExpertExecutor(gu, dn, threads=2, activation=act).kernel(x, ids, w)
    assert rel_err(got, ref) < tol
    assert rel_err(reference_experts(x.float(), ids, w, gu.float(), dn.float()), ref) > 0.1  # the clamp matters
