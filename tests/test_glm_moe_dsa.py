"""GLM-5 (GlmMoeDsaForCausalLM) against transformers on small random configs: logits at prefill
and at each of 32 decode steps within 1e-4 relative (float32) and identical greedy ids, with
prompts longer than the indexer's top-k (so its selection decides what each query attends to),
group-limited sigmoid routing with a random correction bias, dense first layers, shared experts,
"shared" indexer layers and attention biases; through the serving loop (continuous batching,
mixed steps) too; chunked prefill equal to unchunked; the static decode path (whole block table,
as captured in a CUDA graph) equal to the eager one; prefix reuse across an edit equal to a cold
prefill; every expert path on the CPU (C++ executor, torch executor, expert cache); `ft convert`
(MTP layers skipped) then Engine.generate equal to transformers' greedy generate. Beside them:
the router and the config parsing against transformers, and GLM's XML-style tool calls through
the streaming parser, split at every boundary."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from drive import drive
from freetoken.cache.config import CacheConfig
from freetoken.cli import main as ft_main
from freetoken.config import ModelConfig
from freetoken.errors import UnsupportedModelError
from freetoken.experts.banks import ExpertBanks
from freetoken.experts.executor import TorchExpertExecutor
from freetoken.model import mla
from freetoken.model.deepseek_moe import DeepseekMoE
from freetoken.model.registry import model_class
from freetoken.model.state import DecodeState, kv_dims, kv_page_bytes
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert
from freetoken.weights.reader import dense_weights, load_ftw
from test_reference import engine_greedy, prompt_for, rel_err

STEPS = 32
CASES = {
    # name: (seed, config overrides); prompts are 19 tokens, past index_topk
    "groups-dense1": (0, {}),
    "shared-indexer-bias": (1, dict(num_hidden_layers=4, first_k_dense_replace=2, n_group=2, topk_group=1,
                                    num_experts_per_tok=3, norm_topk_prob=False, index_topk=5, attention_bias=True,
                                    indexer_types=["full", "shared", "full", "shared"], n_shared_experts=2)),
    "one-group-k2": (2, dict(n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.0,
                             index_topk=12, index_n_heads=6, num_attention_heads=2, num_key_value_heads=2)),
}


def build(name, d):
    seed, kw = CASES[name]
    model = hf_models.glm_moe_dsa(seed, **kw)
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
    prompt = prompt_for(CASES[name][0])
    assert len(prompt) > model.config.index_topk
    pre, toks, steps = engine_greedy(eng, prompt, STEPS)
    ref = hf_models.reference_logits(model, prompt + toks)
    P = len(prompt)
    assert rel_err(pre, ref[:P]) < 1e-4
    for i in range(STEPS):
        assert rel_err(steps[i], ref[P + i]) < 1e-4, f"decode step {i}"
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()
    # and transformers' cached decode, step by step (its indexer keys cache and its latent cache)
    assert rel_err(steps[:8], hf_models.cached_decode_logits(model, prompt, toks[:8])) < 1e-4


def test_expert_cache_path_matches_transformers(built):
    """The expert-cache executor (host slots without CUDA), half of the misses copied into slots
    and half run by the C++ executor: the same logits."""
    model, ftw = built["shared-indexer-bias"]
    eng = cpu_engine(ftw, moe="cache", expert_cache="0.3", fill_share=0.5)
    assert eng.describe()["expert_backend"] == "gpu-cache"
    prompt = prompt_for(1)
    pre, toks, steps = engine_greedy(eng, prompt, 8)
    ref = hf_models.reference_logits(model, prompt + toks)
    assert rel_err(pre, ref[:len(prompt)]) < 1e-4
    assert rel_err(steps, ref[len(prompt):]) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_expert_paths_match_transformers(built):
    """On the GPU (decode graphs, fp32 so that no router near-tie flips between paths): experts
    resident, through the expert cache and CPU-only, each within 1e-3 of transformers' logits."""
    from drive import check_gpu_paths
    check_gpu_paths(*built["shared-indexer-bias"])


def test_the_selection_and_the_groups_matter(built):
    """The tests above would see a wrong selection or a wrong group limit: transformers itself,
    with every key selected or every group eligible, gives other logits on the same weights."""
    model, _ = built["groups-dense1"]
    prompt = prompt_for(0, n=40)
    ref = hf_models.reference_logits(model, prompt)
    for change in (dict(index_topk=1000), dict(topk_group=4)):
        other = hf_models.glm_moe_dsa(0, **change)
        other.load_state_dict(model.state_dict())
        assert rel_err(hf_models.reference_logits(other, prompt), ref) > 1e-2, change


def test_model_over_the_torch_executor(built):
    """The architecture file alone over a TorchExpertExecutor (the resident path's executor), the
    state with pages of 4 tokens and two slots."""
    model, ftw = built["shared-indexer-bias"]
    meta, w = load_ftw(ftw)
    cfg = ModelConfig.from_hf(meta["config"])
    banks = ExpertBanks.from_ftw(meta, w)
    ex = TorchExpertExecutor(banks.gate_up, banks.down, layer_experts=cfg.num_experts)
    cpu = torch.device("cpu")
    m = model_class(cfg.arch)(cfg, dense_weights(meta, w, cpu, torch.float32), ex, cpu, torch.float32, 256)
    st = DecodeState(cfg, 2, 64, cpu, torch.float32, page_size=4)
    st.reserve(1, 64)
    prompt = prompt_for(5, n=23)
    logits = m.prefill(torch.tensor(prompt), st, 1, 0, all_logits=True)
    toks, outs = [], []
    for i in range(8):
        toks.append(int((outs[-1] if outs else logits[-1]).argmax()))
        pos = torch.tensor([0, len(prompt) + i])
        outs.append(m.decode(torch.tensor([0, toks[-1]]), st, pos, torch.tensor([False, True]))[1])
    ref = hf_models.reference_logits(model, prompt + toks)
    assert rel_err(logits, ref[:len(prompt)]) < 1e-4
    assert rel_err(torch.stack(outs), ref[len(prompt):]) < 1e-4


@pytest.mark.parametrize("n", [3, 21])
def test_static_decode_equals_eager(built, monkeypatch, n):
    """Under CUDA-graph capture the decode reads the whole block table (static shapes: the
    indexer scores every slot of the table, unwritten ones masked, and the top-k rows are
    gathered from the pages); eagerly only the pages in use, with no indexer while they hold
    no more than index_topk positions. Same logits across that switch; an idle row beside them
    stays finite and leaves the others alone."""
    model, ftw = built["groups-dense1"]
    eng = cpu_engine(ftw)
    prompt = prompt_for(9, n=n)
    outs = {}
    for static in (False, True):
        monkeypatch.setattr(mla, "_capturing", lambda x: static)
        st = DecodeState(eng.cfg, 2, 64, torch.device("cpu"), torch.float32, page_size=4)
        st.reserve(0, 64)  # 16 pages of 4: eagerly 2 pages (8 = index_topk positions) at first
        first = eng.prefill(prompt, st, slot=0)
        toks, got = [int(first[-1].argmax())], []
        for i in range(6):
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
    """Chunks shorter than index_topk, and (MAX_SCORES tiny) a chunk's queries taken a few rows
    at a time: the same logits."""
    model, ftw = built["groups-dense1"]
    prompt = prompt_for(7, n=45)
    whole, chunked = cpu_engine(ftw), cpu_engine(ftw, prefill_chunk=5)
    a = whole.prefill(prompt, whole.new_state(64), all_logits=True)
    st = chunked.new_state(64)
    b = chunked.prefill(prompt, st, all_logits=True)
    assert rel_err(b, a) < 1e-5
    monkeypatch.setattr(mla, "MAX_SCORES", 1000)  # 2 query rows per block at 45 keys and 8 heads
    assert rel_err(whole.prefill(prompt, whole.new_state(64), all_logits=True), a) < 1e-5
    monkeypatch.undo()
    assert rel_err(b, hf_models.reference_logits(model, prompt)) < 1e-4
    pos, tok = torch.tensor([len(prompt)]), torch.tensor([int(b[-1].argmax())])
    st2 = whole.new_state(64)
    whole.prefill(prompt, st2)
    assert rel_err(chunked.model.decode(tok, st, pos), whole.model.decode(tok, st2, pos)) < 1e-5


def test_one_forward_with_consecutive_chunks_of_one_sequence(built):
    """prefill_batch may hold several chunks of one sequence (the layer-major prefill pass): each
    chunk's selection reaches the shared layers under its own key, beside another sequence."""
    model, ftw = built["shared-indexer-bias"]
    eng = cpu_engine(ftw)
    a, b = prompt_for(12, n=30), prompt_for(13, n=9)
    st = eng.new_state(64, slots=2)
    segs = [(a[:11], 0, 0, None, True), (b, 1, 0, None, True), (a[11:], 0, 11, None, True)]
    got = eng.prefill_batch(st, segs)  # [3, V]
    ra, rb = hf_models.reference_logits(model, a), hf_models.reference_logits(model, b)
    assert rel_err(got, torch.stack([ra[10], rb[-1], ra[-1]])) < 1e-4


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


@pytest.mark.parametrize("name", ["groups-dense1", "shared-indexer-bias"])
def test_serving_loop_matches_transformers(built, name):
    """Continuous batching: requests joining while others decode, prompt chunks sharing forwards
    with decode rows (the CPU's mixed steps), prompts shorter and longer than index_topk."""
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


def test_prefix_reuse_is_exact(built):
    """The latent rows and the indexer keys live in the paged pool, so the radix cache shares
    them as it shares K/V: a restore across an edit (partial page copied) and an extension equal
    a cold prefill and transformers."""
    model, ftw = built["shared-indexer-bias"]
    eng = cpu_engine(ftw, prefill_chunk=16)
    g = torch.Generator().manual_seed(4)
    first = torch.randint(0, 320, (61,), generator=g).tolist()
    edited = first[:45] + torch.randint(0, 320, (6,), generator=g).tolist() + first[51:]
    extended = first + torch.randint(0, 320, (9,), generator=g).tolist()
    warm = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(page_size=4))
    cold = ServingEngine(eng, max_batch=2, max_queue=8, record_logits=True, start=False,
                         cache=CacheConfig(enabled=False))
    drive(warm, [greedy_req(first, 5)])
    for second in (edited, extended):
        shared = next(i for i, (a, b) in enumerate(zip(first + [-1], second)) if a != b)
        got = drive(warm, [greedy_req(second, 6)])[0]
        ref = drive(cold, [greedy_req(second, 6)])[0]
        assert shared - 4 <= got.cached_tokens <= shared  # all but the partial page, never past the edit
        assert got.output_ids == ref.output_ids
        for a, b in zip(got.logits, ref.logits):
            assert rel_err(a, b) < 1e-4
        check_against_transformers(model, got)


def test_ft_convert_skips_mtp_then_generate_matches_transformers(built, tmp_path, capfd):
    """A release ships its MTP layer as model.layers.{num_hidden_layers}: `ft convert` says it
    skips it; Engine.generate's greedy tokens are transformers' generate()."""
    model, _ = built["groups-dense1"]
    src = tmp_path / "hf"
    hf_models.save(model, str(src))
    fn = str(src / "model.safetensors")
    w = load_file(fn)
    n = model.config.num_hidden_layers
    mtp = {k.replace("layers.2.", f"layers.{n}."): v.clone() for k, v in w.items() if ".layers.2." in k}
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.randn(64, 128)
    save_file({**w, **mtp}, fn, metadata={"format": "pt"})
    capfd.readouterr()
    assert ft_main(["convert", str(src), str(tmp_path / "m.ftw"), "--quiet"]) == 0
    err = capfd.readouterr().err
    assert f"skipping layer(s) {n} past num_hidden_layers={n} ({len(mtp)} tensors" in err
    eng = cpu_engine(str(tmp_path / "m.ftw"))
    prompt = prompt_for(11, n=15)
    gen = eng.generate(prompt, 20, stop_at_eos=False)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert gen.token_ids == ref[0, len(prompt):].tolist()


def test_bfloat16_runs_close_to_float32(built):
    """bf16 compute: finite, and at most positions near the fp32 logits. Not all: the indexer's
    top-k and the router are discrete choices that bf16 rounding flips now and then
    (transformers' own bf16 run differs from its fp32 one by ~30% at a few positions of this
    prompt)."""
    _, ftw = built["groups-dense1"]
    prompt = prompt_for(0)
    e32, e16 = cpu_engine(ftw), Engine(ftw, EngineConfig(device="cpu", dtype="bfloat16"))
    a = e32.prefill(prompt, e32.new_state(32), all_logits=True)
    b = e16.prefill(prompt, e16.new_state(32), all_logits=True)
    assert torch.isfinite(b).all()
    errs = sorted(rel_err(b[i], a[i]) for i in range(len(prompt)))
    assert errs[len(errs) // 2] < 0.05 and errs[-4] < 0.1


# ----------------------------------------------------------------------------- the pieces


def test_router_equals_transformers():
    """Ids (as sets) and weights of the sigmoid group-limited router against GlmMoeDsaTopkRouter,
    with a bias large enough that it, and the group limit, change the choice."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter
    for groups, tg, k, norm in ((4, 2, 4, True), (8, 3, 6, False), (1, 1, 2, True)):
        hc = GlmMoeDsaConfig(hidden_size=32, n_routed_experts=32, num_experts_per_tok=k, n_group=groups,
                             n_shared_experts=0, topk_group=tg, norm_topk_prob=norm, routed_scaling_factor=1.7)
        ref = GlmMoeDsaTopkRouter(hc)
        g = torch.Generator().manual_seed(groups)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(32, 32, generator=g) * 0.3)
            ref.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.3)
        cfg = ModelConfig.from_hf({**hc.to_dict(), "num_hidden_layers": 2, "first_k_dense_replace": 1,
                                   "mlp_layer_types": None, "indexer_types": None})
        p = "model.layers.1.mlp."
        moe = DeepseekMoE(cfg, {p + "gate.weight": ref.weight.detach(),
                                p + "gate.e_score_correction_bias": ref.e_score_correction_bias}, 1, 1, None)
        x = torch.randn(64, 32, generator=g)
        _, rw, ri = ref(x)
        ids, wts = moe.route(x)
        ids = ids - 32  # flat ids of the second MoE ordinal
        order_ref, order = ri.sort(-1), ids.sort(-1)
        assert torch.equal(order.values, order_ref.values)
        assert torch.allclose(wts.gather(1, order.indices), rw.gather(1, order_ref.indices), rtol=1e-6, atol=0)
        scores = torch.sigmoid(x @ ref.weight.T)
        # neither the bias nor (with groups) the group limit is vacuous here
        assert not torch.equal(scores.topk(k).indices.sort(-1).values, order_ref.values)
        if groups > 1:
            biased = scores + ref.e_score_correction_bias
            assert not torch.equal(biased.topk(k).indices.sort(-1).values, order_ref.values)


def release_config():
    """GLM-5's config.json as published (the fields FreeToken reads)."""
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
            "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
            "num_hidden_layers": 78, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
            "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048,
            "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu",
            "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "rope_theta": 1000000, "index_topk": 2048,
            "index_head_dim": 128, "index_n_heads": 32, "first_k_dense_replace": 3, "head_dim": 64,
            "eos_token_id": [154820, 154827, 154829], "tie_word_embeddings": False, "attention_bias": False}


def test_config_of_the_release():
    cfg = ModelConfig.from_hf(release_config())
    assert cfg.arch == "glm_moe_dsa" and cfg.router == "sigmoid_group"
    assert cfg.moe_layers == list(range(3, 78)) and cfg.intermediate_size == 12288
    assert cfg.num_experts == 256 and cfg.top_k == 8 and cfg.routed_scaling_factor == 2.5
    assert cfg.indexer_types == ["full"] * 78 and cfg.index_topk == 2048
    assert cfg.head_dim == 256 and cfg.rope_theta == 1000000 and cfg.shared_expert_intermediate_size == 2048
    assert kv_dims(cfg) == (1, 576, 128)  # the latent row and the indexer key, per token and layer
    assert kv_page_bytes(cfg, 16, torch.bfloat16) == 78 * 16 * (576 + 128) * 2


@pytest.mark.parametrize("extra", [dict(index_topk_freq=2, index_skip_topk_offset=3), dict(index_topk_pattern="FFSFSS"),
                                   dict(first_k_dense_replace=2, index_topk_freq=3)])
def test_indexer_and_mlp_types_as_transformers_derives_them(extra):
    from transformers import GlmMoeDsaConfig
    hc = GlmMoeDsaConfig(num_hidden_layers=6, **extra)
    raw = {k: v for k, v in release_config().items() if k not in ("first_k_dense_replace",)}
    raw.update(num_hidden_layers=6, **extra)
    cfg = ModelConfig.from_hf(raw)
    assert cfg.indexer_types == hc.indexer_types
    assert cfg.moe_layers == [i for i, t in enumerate(hc.mlp_layer_types) if t == "sparse"]


@pytest.mark.parametrize("change, match", [
    (dict(index_topk_pattern="SFFF"), "first layer's indexer"),
    (dict(n_group=3), "n_group=3 must divide"),
    (dict(n_group=8, topk_group=1, num_experts_per_tok=40), "cannot hold"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}), "yarn"),
])
def test_config_refusals(change, match):
    raw = {**release_config(), "num_hidden_layers": 4, **change}
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf(raw)


GLM_CALLS = [
    # GLM-5 / 4.7 write the parts back to back; GLM-4.5 puts newlines between them
    ("<think>Check the file.</think>Reading it.<tool_call>read_file<arg_key>path</arg_key><arg_value>src/a b.js"
     "</arg_value><arg_key>limit</arg_key><arg_value>20</arg_value><arg_key>opts</arg_key><arg_value>"
     "{\"raw\": true}</arg_value></tool_call><tool_call>grep<arg_key>pattern</arg_key><arg_value>x < y</arg_value>"
     "</tool_call>",
     "Check the file.", "Reading it.",
     [("read_file", {"path": "src/a b.js", "limit": 20, "opts": {"raw": True}}), ("grep", {"pattern": "x < y"})]),
    ("\n<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
     "", "\n", [("get_weather", {"location": "Paris"})]),
    ("<tool_call>list_files</tool_call>", "", "<tool_call>list_files</tool_call>", []),  # no arguments: text
]


@pytest.mark.parametrize("i", range(len(GLM_CALLS)))
def test_glm_tool_calls_in_streams_split_everywhere(i):
    """GLM's XML-style calls through the streaming parser, the stream cut at every boundary and
    one character at a time."""
    from freetoken.server.parser import OutputParser, merge
    text, reasoning, content, calls = GLM_CALLS[i]

    def run(pieces):
        p, events = OutputParser(), []
        for piece in pieces:
            events += p.feed(piece)
        r, c, tools = merge(events + p.finish())
        assert (r, c) == (reasoning, content)
        assert [(t.name, json.loads(t.arguments)) for t in tools] == calls
    run([text])
    run(list(text))
    for cut in range(len(text) + 1):
        run([text[:cut], text[cut:]])


def test_prompt_chunks_in_expert_pieces_give_the_same_logits(built, monkeypatch):
    """With the serving loop's hook on the CPU (experts/split_experts.py; MIN_BYTES 0, its experts
    are tiny) the GLM MoE block runs a chunk's routed experts in pieces, the hook called between
    them at split_experts.point(i, n): the logits are the whole blocks' (fp32) and transformers'."""
    from freetoken.experts import split_experts
    monkeypatch.setattr(split_experts, "MIN_BYTES", 0)
    model, ftw = built["shared-indexer-bias"]
    eng = cpu_engine(ftw)
    a = prompt_for(14, n=24)
    seen = []
    got = eng.prefill_batch(eng.new_state(64), [(a, 0, 0, None, True)], between=seen.append, key_points=True)
    plain = eng.prefill_batch(eng.new_state(64), [(a, 0, 0, None, True)])
    pieces = [j for j in seen if split_experts.is_expert_point(j)]
    assert {int(j) for j in pieces} == set(eng.cfg.moe_layers) and len(pieces) == 3 * len(eng.cfg.moe_layers)
    assert rel_err(got, plain) < 1e-5
    assert rel_err(got[0], hf_models.reference_logits(model, a)[-1]) < 1e-4
