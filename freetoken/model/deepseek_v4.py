"""DeepSeek-V4 (transformers DeepseekV4ForCausalLM, model_type deepseek_v4; DeepSeek-V4-Flash and
-Pro): every layer V4 attention (model/csa.py: sliding window, plus CSA or HCA compressed
entries per cfg.compressed_attention) and routed experts with one shared expert (sqrt-softplus
or sigmoid scores, correction bias, routed scaling; the first hash layers pick their experts by
token id); the residual stream is hc_mult hyper-connection streams (model/hyper.py).

The streams are why this file overrides the stack: the shared one carries one residual [N, H]
and fuses each add with the next norm, while here each sub-layer's input is a learned per-token
collapse of [N, hc, H] and its output is spread back and mixed with the old streams. The rest
(embedding, varlen prefill, mixed steps, decode, lm_head) is the shared DecoderModel's.
The token ids reach the hash-routed layers through `self.ids`, set by each entry point.
The MTP layers a release ships are not used (weights/convert.py skips them and says so).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .base import DecoderModel
from .csa import CompressedAttention, rms_weighted, rope_tables
from .deepseek_moe import DeepseekMoE
from .hyper import hc_head, hc_post, hc_pre
from .layers import FusedLinear
from .linear import linear
from .moe import check_executor


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


class DeepseekV4MoE(DeepseekMoE):
    """DeepseekMoE's call (executor launch, shared expert, one merge order) with V4's router:
    scores = score_fn(x W^T) in fp32; the experts by top-k of scores + correction bias, or for a
    hash layer gate.tid2eid[token]; weights the chosen scores over their sum (+1e-20) times
    routed_scaling_factor. No groups. The shared expert clamps its gate and up at swiglu_limit."""

    def __init__(self, cfg, w: dict, layer: int, ordinal: int, executor, ids: dict):
        p = f"model.layers.{layer}.mlp."
        self.top_k, self.num_experts, self.scale = cfg.top_k, cfg.num_experts, cfg.routed_scaling_factor
        self.base, self.executor, self.ids = ordinal * cfg.num_experts, executor, ids
        if ordinal == 0:
            check_executor(cfg, executor)
        self.score = sqrt_softplus if cfg.scoring_func == "sqrtsoftplus" else torch.sigmoid
        self.router = w[p + "gate.weight"].float()  # [E, H]
        self.hashed = layer in cfg.hash_layers
        if self.hashed:
            self.tid2eid = w[p + "gate.tid2eid"].long()  # [V, k]
        else:
            self.bias = w[p + "gate.e_score_correction_bias"].float()  # [E]
        s = p + "shared_experts."
        self.shared = FusedLinear([w[s + "gate_proj.weight"], w[s + "up_proj.weight"]])
        self.shared_down = w[s + "down_proj.weight"]
        self.shared_limit = cfg.swiglu_limit

    def route(self, x: torch.Tensor):
        """x [T, H] -> flat ids [T, k] int64, weights [T, k] in x's dtype. Static shapes."""
        scores = self.score(linear(x.float(), self.router))  # [T, E] (CUDA: rows padded, model/linear.py)
        if self.hashed:
            idx = self.tid2eid[self.ids["tokens"]]  # [T, k]
        else:
            idx = (scores + self.bias).topk(self.top_k, dim=-1).indices  # [T, k]
        wts = scores.gather(1, idx)
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return idx + self.base, (wts * self.scale).to(x.dtype)


class DeepseekV4Model(DecoderModel):
    per_forward_state = True  # self.ids: the running forward's tokens (runtime/overlap.py)
    # o_a_proj is the grouped output projection, an einsum over o_groups blocks (csa.py): dequantized
    # at load
    DENSE_DEQUANT = DecoderModel.DENSE_DEQUANT + ("o_a_proj",)
    DENSE_WIDEN = ("o_a_proj",)  # the same einsum under --dense-bf16
    # transformers' _keep_in_fp32_modules_strict of DeepseekV4: loaded in fp32 whatever the compute
    # dtype (weights/reader.py dense_weights); the code here reads each of them with .float()
    KEEP_FP32 = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "e_score_correction_bias", "q_a_norm",
                 "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")

    def __init__(self, cfg: ModelConfig, w: dict, executor, device, dtype, max_pos: int):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        rd = cfg.qk_rope_head_dim
        ropes = {"main": rope_tables(rd, cfg.rope_theta, None, max_pos, device, dtype),
                 "compress": rope_tables(rd, cfg.compress_rope_theta, cfg.rope_scaling, max_pos, device, dtype)}
        self.ids: dict = {}  # {"tokens": [N]} of the running forward, for the hash-routed layers
        self.layers, self.hc = [], []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append((CompressedAttention(cfg, w, i, ropes), DeepseekV4MoE(cfg, w, i, i, executor, self.ids),
                                w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]))
            self.hc.append(tuple(tuple(w[f"{p}{s}_hc.{n}"] for n in ("fn", "base", "scale")) for s in ("attn", "ffn")))
        self.head = tuple(w[f"model.hc_head.hc_{n}"] for n in ("fn", "base", "scale"))

    # the entry points only record the token ids (hash routing), then run the shared ones
    def prefill(self, tokens, *args, **kw):
        self.ids["tokens"] = tokens
        return super().prefill(tokens, *args, **kw)

    def prefill_batch(self, tokens, *args, **kw):
        self.ids["tokens"] = tokens
        return super().prefill_batch(tokens, *args, **kw)

    def forward_mixed(self, dec_tokens, st, pos, active, pre_tokens, segs):
        self.ids["tokens"] = torch.cat([dec_tokens, pre_tokens])
        return super().forward_mixed(dec_tokens, st, pos, active, pre_tokens, segs)

    def decode(self, tokens, *args, **kw):
        self.ids["tokens"] = tokens
        return super().decode(tokens, *args, **kw)

    def _stack(self, x: torch.Tensor, mix, phase: str, active=None, hook=None, mid_layer: bool = False,
               key_points: bool = False) -> torch.Tensor:
        """Embeddings [N, H] -> the hc_mult streams [N, hc, H] through every layer -> collapsed by
        the head and final-normed [N, H]. hook(i), if given, runs before layer i (and with
        mid_layer at i + 0.5, between its attention and its MLP). key_points: no effect (its
        attention does not run in key pieces, kernels/split_keys.py)."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        h = x[:, None, :].expand(-1, c.hc_mult, -1).contiguous()  # [N, hc, H]
        for i, ((mixer, mlp, ln1, ln2), (attn_hc, ffn_hc)) in enumerate(zip(self.layers, self.hc)):
            if hook is not None:
                hook(i)
            post, comb, inp = hc_pre(h, *attn_hc, c.hc_sinkhorn_iters, c.hc_eps, eps)
            h = hc_post(h, mix(mixer, rms_weighted(inp, ln1, eps)), post, comb)
            if hook is not None and mid_layer:
                hook(i + 0.5)
            post, comb, inp = hc_pre(h, *ffn_hc, c.hc_sinkhorn_iters, c.hc_eps, eps)
            h = hc_post(h, mlp(rms_weighted(inp, ln2, eps), phase, active), post, comb)
        return rms_weighted(hc_head(h, *self.head, c.hc_eps, eps), self.norm, eps)

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> list[str]:
        """Non-expert tensors (the routed experts: weights/convert.py ExpertReader)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"] + [f"model.hc_head.hc_{n}" for n in ("fn", "base", "scale")]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", a + "sinks"]
            names += [f"{p}{s}_hc.{n}" for s in ("attn", "ffn") for n in ("fn", "base", "scale")]
            names += [a + n + ".weight" for n in ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm",
                                                  "o_a_proj", "o_b_proj")]
            kind = cfg.compressed_attention[i]
            if kind != "none":
                names += [a + "compressor." + n for n in ("kv_proj.weight", "gate_proj.weight", "position_bias",
                                                          "kv_norm.weight")]
            if kind == "csa":
                names += [a + "compressor.indexer." + n for n in (
                    "kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight", "q_b_proj.weight",
                    "scorer.weights_proj.weight")]
            m = p + "mlp."
            names += [m + "gate.weight", m + ("gate.tid2eid" if i in cfg.hash_layers else "gate.e_score_correction_bias")]
            names += [m + "shared_experts." + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
        return names
