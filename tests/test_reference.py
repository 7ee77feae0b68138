"""FreeToken against the transformers reference classes: logits at prefill and at each of 32
decode steps within 1e-4 relative error (float32), identical greedy tokens, for several
random configs and every published checkpoint layout."""
import json
import subprocess
import sys

import pytest
import torch

import hf_models
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.weights.convert import convert

STEPS = 32
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CASES = {
    # name: (builder, seed, config overrides, layout)
    "q35-plain": (hf_models.qwen3_5, 0, {}, "plain"),
    "q35-sharded-5layers": (hf_models.qwen3_5, 1, dict(
        num_hidden_layers=5, num_experts=24, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]),
        "sharded"),
    "q35-fused-nogqa": (hf_models.qwen3_5, 2, dict(
        num_key_value_heads=4, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=24, num_experts=20, num_experts_per_tok=3), "fused"),
    "q35-wrapper-tied": (hf_models.qwen3_5, 3, dict(tie_word_embeddings=True), "wrapper"),
    "q3moe-plain": (hf_models.qwen3_moe, 4, dict(norm_topk_prob=False), "plain"),
    "q3moe-sharded-dense-layer": (hf_models.qwen3_moe, 5, dict(
        norm_topk_prob=True, mlp_only_layers=[1], num_experts=24, num_experts_per_tok=2), "sharded"),
    # YaRN as Qwen3's model cards set it for long contexts, stretching a 16-token original context
    # 4x so the 51 positions here pass it (partial rotary on Qwen3.5: the stretch of its 4 dims)
    "q3moe-yarn": (hf_models.qwen3_moe, 6, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16)), "plain"),
    # attention_bias: q/k/v and o_proj biases (transformers gives the output projection one too)
    "q35-attn-bias": (hf_models.qwen3_5, 8, dict(attention_bias=True), "plain"),
    "q3moe-attn-bias": (hf_models.qwen3_moe, 9, dict(attention_bias=True), "plain"),
    # Qwen3-Next: Qwen3.5's layers from fused, head-grouped DeltaNet projections (3 value heads a
    # key head), per-expert tensors; and with a dense-MLP layer (mlp_only_layers), sharded
    "qnext-plain": (hf_models.qwen3_next, 10, {}, "plain"),
    "qnext-sharded-dense-layer": (hf_models.qwen3_next, 11, dict(
        mlp_only_layers=[1], num_experts=24, num_experts_per_tok=2, linear_num_value_heads=2), "sharded"),
    "q35-yarn": (hf_models.qwen3_5, 7, dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
        partial_rotary_factor=0.25)), "plain"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each case's HF model and its converted FTW file, built once."""
    out = {}
    for name, (build, seed, kw, layout) in CASES.items():
        d = tmp_path_factory.mktemp(name)
        model = build(seed, **kw)
        hf_models.save(model, str(d / "hf"), layout)
        ftw = str(d / "model.ftw")
        convert(str(d / "hf"), ftw, progress=False)
        out[name] = (model, ftw)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def engine_greedy(eng: Engine, prompt: list[int], steps: int):
    """Prefill (all positions' logits) then `steps` greedy decode steps, logits of each."""
    st = eng.new_state(len(prompt) + steps)
    pre = eng.prefill(prompt, st, all_logits=True)  # [P, V]
    toks, step_logits = [], []
    logits = pre[-1]
    for i in range(steps):
        tok = int(torch.argmax(logits))
        toks.append(tok)
        pos = len(prompt) + i
        logits = eng.model.decode(torch.tensor([tok], device=eng.device), st,
                                  torch.tensor([pos], device=eng.device))[0]
        step_logits.append(logits)
    return pre, toks, torch.stack(step_logits)


def prompt_for(seed: int, n: int = 19, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_match_transformers(built, name, device):
    model, ftw = built[name]
    eng = Engine(ftw, EngineConfig(device=device, dtype="float32", experts="gpu" if device == "cuda" else "cpu"))
    prompt = prompt_for(CASES[name][1])
    pre, toks, steps = engine_greedy(eng, prompt, STEPS)
    ref = hf_models.reference_logits(model, prompt + toks)  # [P + 32, V]
    P = len(prompt)
    assert rel_err(pre, ref[:P]) < 1e-4
    for i in range(STEPS):
        assert rel_err(steps[i], ref[P + i]) < 1e-4, f"decode step {i}"
    # greedy ids: the reference's argmax after each prefix is the token we chose
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()


@pytest.mark.parametrize("name", ["q35-plain", "q35-sharded-5layers", "q3moe-plain"])
def test_chunked_prefill_equals_unchunked(built, name, monkeypatch):
    # the chunking is the subject: both engines on torch's GEMMs (7-token chunks would take the CPU's
    # C++ rows kernel, the whole prompt torch's; that kernel has its own tests)
    from freetoken.experts import cpu
    monkeypatch.setattr(cpu, "DECODE_KERNELS", False)
    model, ftw = built[name]
    prompt = prompt_for(7, n=45)
    whole = Engine(ftw, EngineConfig(device="cpu", dtype="float32"))
    chunked = Engine(ftw, EngineConfig(device="cpu", dtype="float32", prefill_chunk=7))
    a = whole.prefill(prompt, whole.new_state(64), all_logits=True)
    st = chunked.new_state(64)
    b = chunked.prefill(prompt, st, all_logits=True)
    assert rel_err(b, a) < 1e-5
    assert rel_err(b, hf_models.reference_logits(model, prompt)) < 1e-4
    # decoding continues identically from the chunk-built state
    pos = torch.tensor([len(prompt)])
    tok = torch.tensor([int(b[-1].argmax())])
    st2 = whole.new_state(64)
    whole.prefill(prompt, st2)
    assert rel_err(chunked.model.decode(tok, st, pos), whole.model.decode(tok, st2, pos)) < 1e-5


def test_cli_generate_json_matches_transformers(built):
    model, ftw = built["q35-plain"]
    prompt = prompt_for(11)
    out = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", "generate", ftw, "--prompt-ids", ",".join(map(str, prompt)),
         "--max-tokens", str(STEPS), "--dtype", "float32", "--device", "cpu", "--ignore-eos", "--json"],
        capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    toks = res["token_ids"]
    assert len(toks) == STEPS == len(res["logprobs"])
    ref = hf_models.reference_logits(model, prompt + toks)
    P = len(prompt)
    assert toks == ref[P - 1:P + STEPS - 1].argmax(-1).tolist()
    ref_lp = torch.log_softmax(ref[P - 1:P + STEPS - 1], -1).gather(1, torch.tensor(toks)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res["logprobs"]), ref_lp, atol=1e-4, rtol=1e-4)
    assert isinstance(res["text"], str)


def test_bfloat16_runs_close_to_reference(built):
    model, ftw = built["q35-plain"]
    prompt = prompt_for(13)
    eng = Engine(ftw, EngineConfig(device="cpu", dtype="bfloat16"))
    got = eng.prefill(prompt, eng.new_state(32), all_logits=True)
    ref = hf_models.reference_logits(model, prompt)
    import copy
    ref_bf16 = hf_models.reference_logits(copy.deepcopy(model).to(torch.bfloat16), prompt)
    # bf16 rounding is the reference's too: be no further from fp32 than transformers in bf16
    assert rel_err(got, ref) <= 1.5 * rel_err(ref_bf16, ref) + 1e-2
