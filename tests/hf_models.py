"""Small random transformers models saved as checkpoint directories in published layouts."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def write_tokenizer(d: str, vocab: int) -> None:
    """A small byte-level BPE tokenizer.json with Qwen's chat special tokens, ids < vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from freetoken.tokenizer import bytes_to_unicode
    b2u = bytes_to_unicode()
    toks = {b2u[b]: b for b in range(256)}
    merges = []
    for a, b in [("t", "h"), ("th", "e"), ("i", "n"), ("e", "r"), ("Ġ", "t")]:
        toks[a + b] = len(toks)
        merges.append((a, b))
    tk = Tokenizer(models.BPE(vocab=toks, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                     "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    assert tk.get_vocab_size() <= vocab
    tk.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)


def _random(model_cls, config_cls, args: dict, seed: int):
    """A transformers model of that config, seeded, in eval mode, its weights perturbed (_perturb)."""
    torch.manual_seed(seed)
    m = model_cls(config_cls(**args)).eval()
    _perturb(m, seed)
    return m


def qwen3_5(seed: int, **kw):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    args = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts=16, num_experts_per_tok=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, max_position_embeddings=512)
    return _random(Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, {**args, **kw}, seed)


def qwen3_next(seed: int, **kw):
    """Qwen3NextForCausalLM (Qwen3-Next-80B-A3B's architecture, Qwen3.5's predecessor): the same
    layers, its DeltaNet input projections fused and grouped per key head (in_proj_qkvz,
    in_proj_ba); 3 value heads per key head here, as the release's 2 are, to catch a grouping bug."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    args = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, intermediate_size=96,
                shared_expert_intermediate_size=48, num_experts=16, num_experts_per_tok=4,
                linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
                linear_num_value_heads=6, max_position_embeddings=512)
    return _random(Qwen3NextForCausalLM, Qwen3NextConfig, {**args, **kw}, seed)


def qwen3_moe(seed: int, **kw):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    args = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
                num_experts=16, num_experts_per_tok=4, max_position_embeddings=512)
    return _random(Qwen3MoeForCausalLM, Qwen3MoeConfig, {**args, **kw}, seed)


def gpt_oss(seed: int, **kw):
    """GptOssForCausalLM: sliding (window 8, so short prompts pass it) and full attention in
    turn, GQA, YaRN stretching a 64-token original context 4x (rope_parameters={"rope_type":
    "default", ...} turns it off)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    args = dict(vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=16, num_experts_per_tok=4, sliding_window=8,
                max_position_embeddings=256,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                     original_max_position_embeddings=64, truncate=False))
    args.update(kw)
    torch.manual_seed(seed)
    m = GptOssForCausalLM(GptOssConfig(**args)).eval()
    _perturb(m, seed)
    return gpt_oss_expert_fn(m, m.config)


def gpt_oss_expert_fn(module, cfg):
    """Make every GptOssExperts in `module` compute the function `cfg` names: transformers
    before 5.2x hard-codes the published alpha 1.702 and limit 7.0 there (5.17 does, the GPU
    machine's version), later versions read config.swiglu_alpha and swiglu_limit, as the engine
    does. The tests' small limits keep the clamp in play on every version."""
    for mod in module.modules():
        if hasattr(mod, "gate_up_proj") and hasattr(mod, "limit") and hasattr(mod, "alpha"):
            mod.limit, mod.alpha = getattr(cfg, "swiglu_limit", 7.0), getattr(cfg, "swiglu_alpha", 1.702)
    return module


def glm_moe_dsa(seed: int, **kw):
    """GlmMoeDsaForCausalLM (GLM-5): latent attention with the DSA indexer keeping 8 keys per
    query (prompts pass it), 8 indexer heads (so that a key the relu zeroes in every head, a
    tie at 0, is rare), a dense first layer, 16 experts in 4 groups of which 2 are eligible,
    top-4, a shared expert, routed scaling 2.5. The correction bias is made random (HF inits it
    to 0) and large enough to change which experts are chosen."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM
    args = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                index_topk=8, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1,
                max_position_embeddings=512, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    args.update(kw)
    torch.manual_seed(seed)
    m = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**args)).eval()
    _perturb(m, seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return m


def _perturb(m, seed: int) -> None:
    """Fresh random values everywhere (HF init leaves norms at 0/1 and biases at 0), so that
    every parameter influences the output and none sits at a special value."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 2.5, generator=g).log())
            elif "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("dt_bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * fan_in ** -0.5)


def save(model, d: str, layout: str = "plain") -> str:
    """layouts: plain (per-expert tensors, one file), sharded (index + shards), fused
    (experts.gate_up_proj / down_proj per layer), wrapper (Qwen3_5MoeForConditionalGeneration)."""
    os.makedirs(d, exist_ok=True)
    if layout == "sharded":
        model.save_pretrained(d, max_shard_size="150KB")
        assert os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    else:
        model.save_pretrained(d)
    write_tokenizer(d, model.config.vocab_size)
    if layout in ("fused", "wrapper"):
        fn = os.path.join(d, "model.safetensors")
        w = load_file(fn)
        w = fuse_experts(w, model.config.num_hidden_layers, model.config.num_experts)
        if layout == "wrapper":
            w = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in w.items()}
            w["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2)
            w["mtp.fc.weight"] = torch.randn(4, 4)
            _wrap_config(d)
        save_file(w, fn, metadata={"format": "pt"})
    return d


def fuse_experts(w: dict, layers: int, experts: int) -> dict:
    out = dict(w)
    for l in range(layers):
        p = f"model.layers.{l}.mlp.experts."
        if p + "0.gate_proj.weight" not in w:
            continue
        gu = [torch.cat([out.pop(f"{p}{e}.gate_proj.weight"), out.pop(f"{p}{e}.up_proj.weight")]) for e in range(experts)]
        dn = [out.pop(f"{p}{e}.down_proj.weight") for e in range(experts)]
        out[p + "gate_up_proj"] = torch.stack(gu)  # [E, 2I, H]
        out[p + "down_proj"] = torch.stack(dn)  # [E, H, I]
    return out


def _wrap_config(d: str) -> None:
    fn = os.path.join(d, "config.json")
    with open(fn) as f:
        text = json.load(f)
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_moe_text"
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "vision_config": {"depth": 1, "hidden_size": 8},
           "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    with open(fn, "w") as f:
        json.dump(cfg, f)


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] next-token logits of the full sequence, one forward, float32."""
    return model(torch.tensor([ids])).logits[0].float()


def assert_served_like(model, prompts, reqs, tol: float = 1e-4) -> None:
    """Greedy requests served by the engine (record_logits) against transformers: the same tokens,
    and each step's logits within `tol` (max abs error over the max abs logit) of one forward."""
    for p, r in zip(prompts, reqs):
        ref = reference_logits(model, p + r.output_ids)
        assert r.output_ids == ref[len(p) - 1:-1].argmax(-1).tolist()
        for j, lg in enumerate(r.logits):
            err = float((lg - ref[len(p) - 1 + j]).abs().max() / ref[len(p) - 1 + j].abs().max())
            assert err < tol, (j, err)


@torch.no_grad()
def cached_decode_logits(model, prompt: list[int], toks: list[int]) -> torch.Tensor:
    """transformers' own incremental path: prefill the prompt, then one token at a time through
    its cache -> [len(toks), V] (the logits after each of toks). The cache argument is
    `past_key_values` up to transformers 5.2x and `cache` after (an unknown keyword would be
    swallowed by **kwargs and every step would run without its context)."""
    import inspect
    params = inspect.signature(model.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    assert key in params, f"{type(model).__name__}.forward takes neither cache nor past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    cache, got = out.past_key_values, []
    for t in toks:
        out = model(torch.tensor([[t]]), use_cache=True, **{key: cache})
        got.append(out.logits[0, -1].float())
    return torch.stack(got)


def deepseek_v4(seed: int, **kw):
    """DeepseekV4ForCausalLM: a sliding-only layer, CSA (windows of 4, overlapping; the indexer
    keeps 3 entries, 8 heads so that an all-zero relu tie is rare) and HCA (windows of 8) layers,
    a window of 8 keys, 4 hyper-connection streams, sqrt-softplus scores, the first layer hash
    routed (a random token -> experts table, HF inits it to 0) and a random correction bias
    large enough to change which experts are chosen; 8 experts, top-2, one shared expert."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    args = dict(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                head_dim=32, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, o_groups=2, o_lora_rank=16,
                index_n_heads=8, index_head_dim=16, index_topk=3, sliding_window=8, partial_rotary_factor=0.25,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                             "compressed_sparse_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"], max_position_embeddings=512)
    args.update(kw)
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(DeepseekV4Config(**args)).eval()
    _perturb(m, seed)
    g = torch.Generator().manual_seed(seed + 2000)
    e, k = m.config.n_routed_experts, m.config.num_experts_per_tok
    with torch.no_grad():
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.2)
            elif name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b.shape[0])]))
    return m
