"""GPT-OSS (GptOssForCausalLM) against transformers on small random configs: logits at prefill
and at each of 32 decode steps within 1e-4 relative (float32) and identical greedy ids, with
prompts past the sliding window, GQA and not, YaRN on and off, top-k 2-4, the clamp of the
SwiGLU active; through the serving loop (continuous batching, mixed steps) too; chunked prefill
equal to unchunked; prefix reuse across an edit past the window equal to a cold prefill; MXFP4
experts as openai publishes them, against the dequantized weights and against transformers' own
MXFP4 dequantization. Beside them, each piece against its reference: attention sinks in the paged
attention references and Triton kernels, the clamped SwiGLU with biases in every expert path
and the Triton expert kernels, the top-k-then-softmax router, the YaRN tables, config parsing."""
import json
import os
import statistics

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
import quant_models
from drive import cpu_experts_in_passes, drive
from freetoken.cache.config import CacheConfig
from freetoken.config import ModelConfig
from freetoken.errors import UnsupportedModelError
from freetoken.experts.banks import ExpertBanks
from freetoken.experts.cpu import extension
from freetoken.experts.executor import (SILU, Activation, ExpertExecutor, TorchExpertExecutor, expert_bias_banks,
                                        reference_experts)
from freetoken.model.moe import check_executor
from freetoken.model.registry import model_class
from freetoken.model.state import DecodeState
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert
from freetoken.weights.quant import dequant_mxfp4
from freetoken.weights.reader import dense_weights, load_ftw
from test_reference import engine_greedy, prompt_for, rel_err

STEPS = 32
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' tests: the interpreter on a CPU machine
NO_YARN = dict(rope_type="default", rope_theta=10000.0)
CASES = {
    # name: (seed, config overrides); every prompt (19 tokens) and decode run past the window
    "yarn-gqa-k4": (0, {}),
    "default-rope-mha-k2": (1, dict(num_key_value_heads=4, num_experts_per_tok=2, sliding_window=5,
                                    num_hidden_layers=3, rope_parameters=NO_YARN)),
    "yarn-clamped-group4-k3": (2, dict(num_key_value_heads=1, num_experts_per_tok=3, num_local_experts=12,
                                       sliding_window=12, swiglu_limit=0.6, swiglu_alpha=1.3,
                                       layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                       num_hidden_layers=3)),
}


def build(name, d):
    seed, kw = CASES[name]
    model = hf_models.gpt_oss(seed, **kw)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return model, str(d / "m.ftw")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return {name: build(name, tmp_path_factory.mktemp(name)) for name in CASES}


def cpu_engine(ftw, **kw):
    return Engine(ftw, EngineConfig(device="cpu", dtype="float32", **kw))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(built, name):
    model, ftw = built[name]
    eng = cpu_engine(ftw)
    if extension() is not None:  # the C++ executor computes the clamped SwiGLU with biases
        assert eng.describe()["expert_backend"] == "cpp"
        assert eng.executor.activation.kind == "swiglu_clamp" and eng.executor.down_bias is not None
    prompt = prompt_for(CASES[name][0])
    assert len(prompt) > model.config.sliding_window
    pre, toks, steps = engine_greedy(eng, prompt, STEPS)
    ref = hf_models.reference_logits(model, prompt + toks)
    P = len(prompt)
    assert rel_err(pre, ref[:P]) < 1e-4
    for i in range(STEPS):
        assert rel_err(steps[i], ref[P + i]) < 1e-4, f"decode step {i}"
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()


def test_model_over_a_hand_built_executor(built):
    """The architecture file alone: the model over a TorchExpertExecutor given the activation and
    the bias banks of the FTW file, decoding on its static path (not the reference loop)."""
    model, ftw = built["yarn-clamped-group4-k3"]
    meta, w = load_ftw(ftw)
    cfg = ModelConfig.from_hf(meta["config"])
    banks = ExpertBanks.from_ftw(meta, w)
    gub, db = expert_bias_banks(meta, w)
    ex = TorchExpertExecutor(banks.gate_up, banks.down, layer_experts=cfg.num_experts, activation=Activation.of(cfg),
                             gate_up_bias=gub, down_bias=db)
    m = model_class(cfg.arch)(cfg, dense_weights(meta, w, torch.device("cpu"), torch.float32), ex,
                              torch.device("cpu"), torch.float32, 256)
    st = DecodeState(cfg, 1, 128, torch.device("cpu"), torch.float32)
    st.reserve(0, 128)
    prompt = prompt_for(5, n=23)
    logits = m.prefill(torch.tensor(prompt), st, 0, 0, all_logits=True)
    toks, outs = [], []
    for i in range(8):
        toks.append(int((outs[-1] if outs else logits[-1]).argmax()))
        outs.append(m.decode(torch.tensor([toks[-1]]), st, torch.tensor([len(prompt) + i]))[0])
    ref = hf_models.reference_logits(model, prompt + toks)
    assert rel_err(logits, ref[:len(prompt)]) < 1e-4
    assert rel_err(torch.stack(outs), ref[len(prompt):]) < 1e-4


def test_chunked_prefill_equals_unchunked(built):
    model, ftw = built["yarn-gqa-k4"]
    prompt = prompt_for(7, n=45)
    whole, chunked = cpu_engine(ftw), cpu_engine(ftw, prefill_chunk=5)  # chunks shorter than the window
    a = whole.prefill(prompt, whole.new_state(64), all_logits=True)
    st = chunked.new_state(64)
    b = chunked.prefill(prompt, st, all_logits=True)
    assert rel_err(b, a) < 1e-5
    assert rel_err(b, hf_models.reference_logits(model, prompt)) < 1e-4
    pos, tok = torch.tensor([len(prompt)]), torch.tensor([int(b[-1].argmax())])
    st2 = whole.new_state(64)
    whole.prefill(prompt, st2)
    assert rel_err(chunked.model.decode(tok, st, pos), whole.model.decode(tok, st2, pos)) < 1e-5


def greedy_req(p, n):
    return Request(list(p), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))


def check_against_transformers(model, req):
    """The request's tokens are the reference's greedy ones, each step's logits within 1e-4."""
    P = len(req.prompt_ids)
    ref = hf_models.reference_logits(model, req.prompt_ids + req.output_ids[:-1])[P - 1:]
    assert req.output_ids == ref.argmax(-1).tolist()
    assert len(req.logits) == len(req.output_ids)
    for a, b in zip(req.logits, ref):
        assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize("name", ["yarn-gqa-k4", "default-rope-mha-k2"])
def test_serving_loop_matches_transformers(built, name):
    """Continuous batching: requests joining while others decode, prompt chunks sharing forwards
    with decode rows (the CPU's mixed steps), chunks split across the sliding window."""
    model, ftw = built[name]
    eng = cpu_engine(ftw, prefill_chunk=7, max_step_tokens=16, decode_slowdown=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (30, 4, 17, 9)]
    srv = ServingEngine(eng, max_batch=3, max_queue=8, record_logits=True, start=False)
    reqs = drive(srv, [greedy_req(p, n) for p, n in zip(prompts, (12, 20, 9, 14))], arrive=[0, 1, 2, 6])
    for r in reqs:
        assert r.finish_reason == "length"
        check_against_transformers(model, r)
    # the production path (greedy picked on the device, no logits recorded) gives the same tokens
    srv = ServingEngine(eng, max_batch=3, max_queue=8, start=False)
    again = drive(srv, [greedy_req(p, n) for p, n in zip(prompts, (12, 20, 9, 14))], arrive=[0, 1, 2, 6])
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]


@pytest.mark.parametrize("pieces", [1, 2])
def test_served_through_the_expert_cache_matches_transformers(built, pieces):
    """GPT-OSS's experts (clamped SwiGLU, biases) through the expert cache: slots that hold the
    bias rows beside the weights, half the misses on the C++ executor, the lookahead predicting
    the next layer with its biased router; a pool of 12 of the 48 experts, so fills evict. Cut
    into 2 pieces (--expert-pieces): the gate/up biases cut with their rows, the down bias once."""
    model, ftw = built["yarn-clamped-group4-k3"]
    eng = cpu_engine(ftw, moe="cache", fill_share="0.5", expert_prefetch=2, prefill_chunk=16, expert_pieces=pieces)
    assert eng.experts_on == "cache" and eng.describe()["expert_backend"] == "gpu-cache"
    assert eng.executor.activation.kind == "swiglu_clamp" and eng.executor.down_bias is not None
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                        cache=CacheConfig(enabled=False))
    ex = eng.executor
    ex.pool = None
    ex.allocate(12 * pieces)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 8)]
    for r in drive(srv, [greedy_req(p, 10) for p in prompts], arrive=[0, 2]):
        check_against_transformers(model, r)
    st = ex.stats()
    assert st["fills"] > 12 and st["cpu_experts"] > 0 and st["prefetched"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_expert_cache_serves_gpt_oss(built):
    """On the GPU: GPT-OSS's dense experts in VRAM slots (the bias rows beside them), half the
    misses on the C++ executor in the step's graph, with and without the lookahead, and
    fill-only. In fp32 each equals every expert resident within 1e-4 (side by side, they say
    which part is off when one is); in bf16 (with the lookahead) the same greedy tokens and
    logits as close to transformers' fp32 as all-resident's, step for step in the median (a
    router near-tie that bf16 flips at one step moves any path that sums in another order)."""
    model, ftw = built["yarn-clamped-group4-k3"]

    def run(dtype, **kw):
        eng = Engine(ftw, EngineConfig(device="cuda", dtype=dtype, prefill_chunk=16, **kw))
        srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False,
                            cache=CacheConfig(enabled=False))
        eng.in_passes = cpu_experts_in_passes(eng.executor) if kw.get("moe") == "cache" else None
        g = torch.Generator().manual_seed(6)
        prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (23, 8)]
        reqs = drive(srv, [greedy_req(p, 10) for p in prompts], arrive=[0, 2])
        if kw.get("moe") == "cache":
            assert eng.executor.pool.slots == 12 and srv.decode.path == "cuda-graphs"
        return eng, reqs
    slot = Engine(ftw, EngineConfig(device="cuda", dtype="float32", moe="cache")).executor.slot_bytes
    variants = {"split+lookahead": dict(fill_share="0.5", expert_prefetch=2), "split": dict(fill_share="0.5"),
                "fill-only": dict(fill_share="1")}
    _, want = run("float32", moe="resident")
    for name, kw in variants.items():
        eng, got = run("float32", moe="cache", expert_cache=str(12 * slot), **kw)
        st = eng.executor.stats()
        # fill-only runs experts on the CPU only in the decode steps inside the second prompt's
        # streamed pass (the cache frozen there)
        assert (st["cpu_experts"] - sum(eng.in_passes) > 0) == (name != "fill-only")
        assert (st.get("prefetched", 0) > 0) == (name == "split+lookahead")
        for a, b in zip(got, want):
            assert a.output_ids == b.output_ids, name
            errs = [round(rel_err(x, y), 6) for x, y in zip(a.logits, b.logits)]
            assert max(errs) < 1e-4, (name, errs)
    slot = Engine(ftw, EngineConfig(device="cuda", dtype="bfloat16", moe="cache")).executor.slot_bytes
    _, want = run("bfloat16", moe="resident")
    _, got = run("bfloat16", moe="cache", expert_cache=str(12 * slot), **variants["split+lookahead"])
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids
        truth = hf_models.reference_logits(model, a.prompt_ids + a.output_ids[:-1])[len(a.prompt_ids) - 1:]
        e_cache = [rel_err(x, y) for x, y in zip(a.logits, truth)]
        e_res = [rel_err(x, y) for x, y in zip(b.logits, truth)]
        med = statistics.median
        assert med(e_cache) <= max(2 * med(e_res), 2e-2), ([round(e, 3) for e in e_cache], [round(e, 3) for e in e_res])


@pytest.mark.parametrize("sliding", ["window", "full"])
def test_prefix_reuse_past_the_window_is_exact(built, sliding):
    """A restore past the window and across an edit equals a cold prefill. "window": the sliding
    layers keep a ring of their window's pages per slot, so the prefix cache restores at its
    checkpoints (every 3 tokens here: partial pages copied) with the window's keys copied back into the ring; "full":
    every page in the pool, restored at any page."""
    model, ftw = built["yarn-gqa-k4"]
    eng = cpu_engine(ftw, prefill_chunk=16, sliding_kv=sliding)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, 320, (61,), generator=g).tolist()
    edited = first[:45] + torch.randint(0, 320, (6,), generator=g).tolist() + first[51:]
    extended = first + torch.randint(0, 320, (9,), generator=g).tolist()
    warm = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(page_size=4, checkpoint_policy="interval:3"))
    cold = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(enabled=False))
    st, w = warm.state, model.config.sliding_window
    sliding_layers = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert st.ring == (sliding_layers if sliding == "window" else [])
    assert warm.describe()["sliding_kv"] == sliding and warm.describe()["ring_layers"] == len(st.ring)
    if sliding == "window":  # the rings: the window and a 16-token chunk on pages of 4, per slot
        assert st.ring_len == -(-(16 + w - 1) // 4) + 1 and st.k[sliding_layers[0]].shape[0] == 1 + 2 * st.ring_len
        assert st.k[sliding_layers[0]].shape[0] < st.k[1].shape[0] // 8
    drive(warm, [greedy_req(first, 5)])
    for second in (edited, extended):
        shared = next(i for i, (a, b) in enumerate(zip(first + [-1], second)) if a != b)
        got = drive(warm, [greedy_req(second, 6)])[0]
        ref = drive(cold, [greedy_req(second, 6)])[0]
        assert shared - 4 <= got.cached_tokens <= shared  # all but a page (a checkpoint), never past the edit
        assert got.cached_tokens > 4 * w
        assert got.output_ids == ref.output_ids
        for a, b in zip(got.logits, ref.logits):
            assert rel_err(a, b) < 1e-4
        check_against_transformers(model, got)


def test_cpp_executor_refuses_other_activations(built):
    """An executor computing SiLU experts without biases (the C++ executor, the GPU expert cache)
    is refused when the model loads, with a message that says why."""
    _, ftw = built["yarn-gqa-k4"]
    meta, _ = load_ftw(ftw, names=[])
    cfg = ModelConfig.from_hf(meta["config"])
    ex = ExpertExecutor()
    ex.backend = "cpp"
    with pytest.raises(UnsupportedModelError, match="swiglu_clamp with biases"):
        check_executor(cfg, ex)
    qwen = ModelConfig(arch="qwen3_moe", vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=8, layer_types=["full_attention"])
    check_executor(qwen, ex)  # SiLU experts without biases: accepted


# ----------------------------------------------------------------------------- MXFP4 experts


def write_mxfp4(model, d: str) -> dict:
    """GPT-OSS as openai publishes it: routed experts in MXFP4, `gate_up_proj_blocks` [E, 2I,
    H/32, 16] with gate and up rows interleaved and `_scales` [E, 2I, H/32] (e8m0), the same for
    `down_proj` [E, H, I/32, 16]; everything else BF16, the expert biases included; config.json
    quantization_config {quant_method: mxfp4, modules_to_not_convert}. Returns the float weights
    it stands for (transformers' names and layouts)."""
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d)
    hf_models.write_tokenizer(d, model.config.vocab_size)
    fn = os.path.join(d, "model.safetensors")
    src = load_file(fn)
    out, ref = {}, {}
    for n, t in src.items():
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).float()  # [E, out, in]: gate_up's rows interleave gate and up
            q = [quant_models.quant_mxfp4(r) for r in rows]
            out[n + "_blocks"] = torch.stack([b for b, _ in q])
            out[n + "_scales"] = torch.stack([s for _, s in q])
            ref[n] = torch.stack([dequant_mxfp4(b.flatten(-2), s) for b, s in q]).transpose(1, 2).contiguous()
        else:
            out[n] = t.to(torch.bfloat16)
            ref[n] = out[n].float()
    save_file(out, fn, metadata={"format": "pt"})
    with open(os.path.join(d, "config.json")) as f:
        cj = json.load(f)
    cj["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cj, f, indent=2)
    return ref


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptoss-mxfp4")
    model = hf_models.gpt_oss(9)
    ref = write_mxfp4(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return quant_models.reference_model(model, ref), str(d / "hf"), str(d / "m.ftw")


def test_mxfp4_experts_match_dequantized_reference(mxfp4):
    ref_model, _, ftw = mxfp4
    eng = cpu_engine(ftw)
    assert eng.expert_format == "mxfp4"
    if extension() is not None:  # the MXFP4 banks read in place by the C++ kernels
        assert eng.describe()["expert_backend"] == "cpp" and eng.executor.quantized
    prompt = prompt_for(10)
    pre, toks, steps = engine_greedy(eng, prompt, STEPS)
    ref = hf_models.reference_logits(ref_model, prompt + toks)
    P = len(prompt)
    assert rel_err(pre, ref[:P]) < 1e-4
    assert rel_err(steps, ref[P:]) < 1e-4
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()


def test_mxfp4_matches_transformers_own_dequantization(mxfp4):
    """transformers reads the same checkpoint, dequantizing the MXFP4 experts itself (on the CPU)."""
    from transformers import GptOssForCausalLM, Mxfp4Config
    ref_model, hf_dir, ftw = mxfp4
    try:  # what transformers does on a CPU without the MXFP4 kernels (and without accelerate)
        theirs = GptOssForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                   quantization_config=Mxfp4Config(dequantize=True)).eval()
    except (ImportError, RuntimeError, ValueError) as e:  # an install that cannot load mxfp4 at all
        pytest.skip(f"transformers cannot load the MXFP4 checkpoint here: {e}")
    hf_models.gpt_oss_expert_fn(theirs, theirs.config)  # the function the config names, on any version
    theirs = theirs.float()  # transformers 5.17 dequantizes to bf16 whatever dtype says (exact: e2m1 x e8m0 fits bf16)
    for l in range(theirs.config.num_hidden_layers):  # their dequantization = quant.py's, bit for bit
        a = theirs.model.layers[l].mlp.experts
        b = ref_model.model.layers[l].mlp.experts
        assert torch.equal(a.gate_up_proj.float(), b.gate_up_proj) and torch.equal(a.down_proj.float(), b.down_proj)
    prompt = prompt_for(12)
    pre, toks, steps = engine_greedy(cpu_engine(ftw), prompt, 12)
    ref = hf_models.reference_logits(theirs, prompt + toks)
    P = len(prompt)
    assert rel_err(pre, ref[:P]) < 1e-4 and rel_err(steps, ref[P:]) < 1e-4
    assert toks == ref[P - 1:-1].argmax(-1).tolist()


# ----------------------------------------------------------------------------- the pieces


def test_config_of_the_release():
    """openai/gpt-oss-20b's config.json as published (rope_scaling, not rope_parameters)."""
    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.arch == "gpt_oss" and cfg.num_experts == 32 and cfg.top_k == 4 and cfg.moe_intermediate_size == 2880
    assert [cfg.window(i) for i in range(3)] == [128, None, 128] and len(cfg.attention_layers) == 24
    assert cfg.rope_theta == 150000 and cfg.rope_scaling["factor"] == 32.0 and cfg.rope_scaling["truncate"] is False
    assert Activation.of(cfg) == Activation("swiglu_clamp", 1.702, 7.0)
    assert cfg.attention_sinks and cfg.router == "topk_softmax" and cfg.expert_bias and cfg.eos_token_ids == [200002]
    # Qwen3's model cards turn YaRN on in rope_scaling for long contexts: read for every family
    # (tests/test_reference.py checks the logits), and refused without its original context
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 1, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 32768}}
    yarn = ModelConfig.from_hf(qwen)
    assert yarn.rope_scaling["factor"] == 4.0 and yarn.max_position_embeddings == 4 * 32768  # the stretched context
    del qwen["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings"):
        ModelConfig.from_hf(qwen)


@pytest.mark.parametrize("params", [
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096, rope_theta=150000.0),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128, rope_theta=10000.0, mscale=1.0,
         mscale_all_dim=0.5)])
def test_yarn_tables_equal_transformers(params):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    from freetoken.model.layers import Rope
    cfg = GptOssConfig(head_dim=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024,
                       rope_parameters=dict(params))
    pos = torch.arange(300)[None]
    cos, sin = GptOssRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)  # [1, P, hd/2]
    ours = Rope(16, params["rope_theta"], 300, "cpu", torch.float32,
                ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["GptOssForCausalLM"]}).rope_scaling)
    assert torch.equal(ours.cos[:, :8], cos[0]) and torch.equal(ours.sin[:, :8], sin[0])


def test_router_topk_then_softmax():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from freetoken.model.moe import MoE
    cfg = GptOssConfig(hidden_size=32, num_local_experts=10, num_experts_per_tok=3)
    torch.manual_seed(0)
    router = GptOssTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.bias)
    x = torch.randn(9, 32)
    logits, scores, idx = router(x)
    moe = MoE.__new__(MoE)
    moe.top_k, moe.topk_first, moe.base = 3, True, 20
    ids, w = moe.route_torch(logits, torch.float32)
    assert torch.equal(ids, idx + 20) and torch.allclose(w, scores, atol=1e-7)


def test_fused_router_kernel_equals_topk_then_softmax():
    """On CUDA the GPT-OSS router runs the fused softmax-top-k kernel with renormalisation: the
    same experts and weights as top-k of the logits then softmax over them."""
    pytest.importorskip("triton")
    from freetoken.kernels.router import route_triton
    from freetoken.model.moe import MoE
    logits = (torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * 3).to(DEV)
    moe = MoE.__new__(MoE)
    moe.top_k, moe.topk_first, moe.base = 4, True, 64
    ids, w = moe.route_torch(logits, torch.float32)
    got_ids, got_w = route_triton(logits, 4, True, 64, torch.float32)
    assert torch.equal(got_ids, ids) and torch.allclose(got_w, w, atol=1e-6)


def test_expert_function_equals_transformers_experts():
    """GptOssExperts (interleaved gate/up columns, [E, in, out] weights) against every torch
    path of the executor over the banks convert writes (de-interleaved rows, [N, out, in])."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    cfg = GptOssConfig(hidden_size=48, intermediate_size=24, num_local_experts=6, swiglu_limit=1.5)
    torch.manual_seed(1)
    hf = hf_models.gpt_oss_expert_fn(GptOssExperts(cfg), cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.6)
    t, k, n = 11, 3, 6
    x = torch.randn(t, 48)
    idx = torch.stack([torch.randperm(n)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k), -1)
    with torch.no_grad():
        want = hf(x, idx, w)
    perm = torch.cat([torch.arange(0, 48, 2), torch.arange(1, 48, 2)])
    gu = hf.gate_up_proj.detach().transpose(1, 2)[:, perm].contiguous()  # [E, 2I, H], gate rows then up
    dn = hf.down_proj.detach().transpose(1, 2).contiguous()  # [E, H, I]
    fn = dict(activation=Activation("swiglu_clamp", 1.702, 1.5), gate_up_bias=hf.gate_up_proj_bias.detach()[:, perm],
              down_bias=hf.down_proj_bias.detach())
    assert fn["gate_up_bias"].shape == (6, 48)
    ex = TorchExpertExecutor(gu, dn, **fn)
    for got in (reference_experts(x, idx, w, gu, dn, **fn), ex._static(x, idx, w), ex._grouped(x, idx, w)):
        assert rel_err(got, want) < 1e-5
    # the clamp is in play: some gate values above the limit, some up values past +-limit
    pre = torch.einsum("th,ehi->tei", x, hf.gate_up_proj.detach())
    assert (pre[..., ::2] > 1.5).any() and (pre[..., 1::2].abs() > 1.5).any()


# Triton kernels under the CPU interpreter (conftest.py), against the torch references

def _expert_inputs(t, k, h, i, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(n, 2 * i, h, generator=g) * 2 * h ** -0.5).to(dtype)  # gate/up values past the limit
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    fn = dict(activation=Activation("swiglu_clamp", 1.702, 1.0),
              gate_up_bias=(torch.randn(n, 2 * i, generator=g) * 0.5).to(DEV, dtype),
              down_bias=(torch.randn(n, h, generator=g) * 0.5).to(DEV, dtype))
    return x.to(DEV), ids.to(DEV), w.to(DEV), gu.to(DEV), dn.to(DEV), fn


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_decode_kernel_swiglu_clamp_biases(dtype, tol):
    pytest.importorskip("triton")
    from freetoken.kernels.moe_decode import moe_decode_triton
    x, ids, w, gu, dn, fn = _expert_inputs(3, 4, 96, 40, 10, dtype, 5)
    ids[1, 2] = -1  # NO_EXPERT: adds nothing, biases included
    ref = TorchExpertExecutor(gu, dn, **fn)._static(x, ids, w)
    assert rel_err(moe_decode_triton(x, ids, w, gu, dn, **fn), ref) < tol
    # only a bias on one side, and SiLU with biases: each switch on its own
    for other in (dict(fn, gate_up_bias=None), dict(fn, activation=SILU)):
        ref = TorchExpertExecutor(gu, dn, **other)._static(x, ids, w)
        assert rel_err(moe_decode_triton(x, ids, w, gu, dn, **other), ref) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_moe_grouped_kernel_swiglu_clamp_biases(dtype, tol):
    pytest.importorskip("triton")
    from freetoken.kernels.moe_grouped import moe_grouped_triton
    x, ids, w, gu, dn, fn = _expert_inputs(37, 3, 64, 32, 12, dtype, 6)
    ids[4] = -1
    f32 = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in fn.items()}
    ref = reference_experts(x.float(), ids, w.float(), gu.float(), dn.float(), **f32)
    assert rel_err(moe_grouped_triton(x, ids, w, gu, dn, **fn).float(), ref) < tol


def _sinks_pool(lens, kvh, nh, hd, window, seed, dtype=torch.float32):
    import test_paged_attention as tpa
    g = torch.Generator().manual_seed(seed)
    kp, vp, bt, lens_t = tpa.make_pool(lens, kvh, hd, 8, dtype, g, window)
    q = torch.randn(len(lens), nh, hd, generator=g).to(kp.device, dtype)
    sinks = (torch.randn(nh, generator=g) * 2).to(kp.device, dtype)
    return q, kp, vp, bt, lens_t, sinks


def _dense_sinks(q, kp, vp, row, positions, n_keys, scale, window, sinks):
    """float64 ground truth: each query against its visible keys, copied out one by one, plus the sink."""
    import test_paged_attention as tpa
    k = tpa.contiguous_keys(kp, row, n_keys).double()
    v = tpa.contiguous_keys(vp, row, n_keys).double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = []
    for qi, pos in zip(q, positions):
        j = torch.arange(n_keys, device=k.device)
        vis = (j <= pos) & ((j > pos - window) if window else True)
        s = torch.einsum("hd,shd->hs", qi.double(), k[vis]) * scale
        p = torch.softmax(torch.cat([s, sinks.double()[:, None]], 1), 1)[:, :-1]
        out.append(torch.einsum("hs,shd->hd", p, v[vis]))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 20])
def test_paged_decode_with_sinks(window):
    pytest.importorskip("triton")
    from freetoken.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton
    lens = [45, 100, 3, 0]
    q, kp, vp, bt, lens_t, sinks = _sinks_pool(lens, 2, 8, 32, window, 7)
    scale = 32 ** -0.5
    ref = paged_decode_attention_torch(q, kp, vp, bt, lens_t, scale, window, sinks)
    for r, n in enumerate(lens):
        if n == 0:  # an idle row: all its weight on the sink, whose value is zero
            assert not ref[r].any()
            continue
        want = _dense_sinks(q[r:r + 1], kp, vp, bt[r], [n - 1], n, scale, window, sinks)[0]
        assert rel_err(ref[r], want) < 1e-5
    assert rel_err(ref, paged_decode_attention_torch(q, kp, vp, bt, lens_t, scale, window)) > 1e-3  # sinks matter
    for splits in (1, 3):  # the sink folded in the split kernel, and in the reduce
        got = paged_decode_attention_triton(q, kp, vp, bt, lens_t, scale, window, splits, block_n=16,
                                            min_split_keys=16, sinks=sinks)
        assert rel_err(got, ref) < 1e-5, splits


@pytest.mark.parametrize("window", [None, 16])
def test_paged_prefill_with_sinks(window):
    pytest.importorskip("triton")
    from freetoken.kernels.paged_attention import paged_prefill_attention_torch, paged_prefill_attention_triton
    start, t, nh, kvh, hd = 40, 24, 8, 2, 32
    n = start + t
    dead = window + t - 1 if window else None  # keys no query of the chunk sees are NaN
    q, kp, vp, bt, _, sinks = _sinks_pool([n], kvh, nh, hd, dead, 8)
    q = torch.randn(t, nh, hd, generator=torch.Generator().manual_seed(9)).to(kp.device)
    scale = hd ** -0.5
    # the reference multiplies the dead (NaN) keys it gathers by zero weights: give it finite ones
    want = _dense_sinks(q, kp.nan_to_num(0.0), vp.nan_to_num(0.0), bt[0], range(start, n), n, scale, window, sinks)
    ref = paged_prefill_attention_torch(q, kp.nan_to_num(0.0), vp.nan_to_num(0.0), bt[0], start, scale, window, sinks)
    assert rel_err(ref, want) < 1e-5
    got = paged_prefill_attention_triton(q, kp, vp, bt[0], start, scale, window, block_m=32, block_n=16, sinks=sinks)
    assert bool(torch.isfinite(got).all())  # the dead keys were never read
    assert rel_err(got, want) < 1e-5
