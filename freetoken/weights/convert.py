"""`ft convert`: transformers checkpoint directory -> one FTW file.

Streams tensor by tensor (experts row by row), so a checkpoint larger than RAM converts.
Weights keep the checkpoint's dtype and bits. Expert tensors, per-expert or fused, are merged
into banks whose first dimension is the flat id ordinal * E + e.

Quantized checkpoints in the three formats FreeToken reads (FP8 128x128 block, MXFP4, NVFP4;
the layouts are in hf.py's docstring) keep their published bytes, bit for bit:
  - routed experts: a values bank, a scale bank and (NVFP4) a scale_2 bank per projection, in
    the layout quant.py's docstring gives (gate rows then up rows; GPT-OSS's interleaved gate/up
    rows are de-interleaved, a pure row permutation applied alike to values and scales); the
    header's meta["banks"] records the format and the scale entries' names;
  - dense (non-expert) quantized weights: their tensors as published, under their names, listed
    in meta["quant"]["dense"]; the engine keeps FP8 ones as they are on CUDA (--dense-fp8,
    model/linear.py) and dequantizes the others when it loads (quant.py reference).
Expert biases (GPT-OSS: `mlp.experts.gate_up_proj_bias` [E, 2I] interleaved like the gate_up
rows, `down_proj_bias` [E, H]) become two more banks, `experts.gate_up.bias` [N, 2I] (gate then
up, de-interleaved) and `experts.down.bias` [N, H], in the checkpoint's dtype; meta["banks"]
names them ("gate_up_bias", "down_bias").
`ft convert` prints the format it found and the resulting sizes.

Refused with one line, before anything is written: other quantizations (GPTQ/AWQ, bitsandbytes,
compressed-tensors, per-tensor fp8, ...), weights that are not float32/bfloat16/float16 and not
one of the formats above, a tokenizer whose ids do not fit the model's embedding, and tensors
whose shapes are not the ones config.json implies (check_shapes: the error names the tensor,
both shapes and the config.json fields the shape comes from). Missing
folders of the output path are created (and removed again if the conversion fails).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..demo import weight_shapes
from ..errors import FreeTokenError, UnsupportedModelError, notice
from ..model.registry import model_class
from ..tokenizer import Tokenizer
from .ftw import DTYPE_NAMES, Entry, layout, total_size
from .hf import (FORMAT_NAMES, WEIGHT_DTYPES, Checkpoint, QuantScheme, Weight, deepseek_v4_name, layers_past,
                 QWEN3_NEXT_PARTS, quant_scheme, qwen3_next_split,
                 read_config)
from .quant import FP8_BLOCK, MX_BLOCK, NV_BLOCK
from .writer import FTWWriter

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json",
                  "special_tokens_map.json")
BANKS = ("experts.gate_up", "experts.down")
BIAS_BANKS = ("experts.gate_up.bias", "experts.down.bias")
COMPONENT_SUFFIX = {"values": "", "scale": ".scale", "scale_2": ".scale_2"}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ExpertReader:
    """Reads expert (layer, e) of one layer in bank layout, one component at a time (FTW entries
    are written one after another): gate_up rows [2I, ...] (gate then up), down [H, ...].

    Layouts: one tensor per expert (`experts.{e}.{gate,up,down}_proj.weight`, any format, its
    scales beside it), fused per layer in float (`experts.gate_up_proj` [E, 2I, H] or [E, H, 2I],
    `experts.down_proj`), fused MXFP4 as GPT-OSS publishes it (`experts.gate_up_proj_blocks`,
    interleaved gate/up rows) or with gate and up apart (`experts.gate_proj_blocks`,
    `experts.up_proj_blocks`), `experts.down_proj_blocks`.

    GPT-OSS (cfg.arch "gpt_oss") as transformers saves it in float: `experts.gate_up_proj`
    [E, H, 2I] (input first) whose columns interleave gate and up (2j gate j, 2j+1 up j), and
    `experts.down_proj` [E, I, H]; the orientation comes from the architecture, never from the
    shapes (H == 2I or H == I happen in real configs); and its biases (`bias()`)."""

    def __init__(self, ck: Checkpoint, cfg: ModelConfig, layer: int):
        self.ck, self.layer = ck, layer
        p = f"model.layers.{layer}.mlp.experts."
        self.p, self.h, self.i, self.e = p, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.gptoss = cfg.arch == "gpt_oss"
        n = 2 * self.i
        interleave = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])  # row 2j gate j, 2j+1 up j
        self.perm = None  # row permutation of a fused gate_up (GPT-OSS interleave)
        self.fused_gu = self._fused("gate_up_proj")
        self.fused_g = self.fused_u = None
        if self.fused_gu is None:
            g, u = self._fused("gate_proj"), self._fused("up_proj")
            if g is not None and u is not None:
                self.fused_g, self.fused_u = g, u
        elif self.fused_gu.format == "mxfp4" or self.gptoss:
            self.perm = interleave
        self.fused_down = self._fused("down_proj")
        # biases (cfg.expert_bias): GPT-OSS's gate_up bias interleaves as its rows do
        self.bias_names = {"gate_up": p + "gate_up_proj_bias", "down": p + "down_proj_bias"} if cfg.expert_bias else {}
        self.bias_perm = interleave if self.gptoss else None

    def _fused(self, leaf: str) -> Weight | None:
        """Every expert's `leaf` in one tensor, or None. Its shape (and so its orientation, which
        read() goes by) is checked against config.json by check_shapes, before anything is read."""
        w = self.ck.weight(self.p + leaf)
        if w is None:
            return None
        if w.format not in ("dense", "mxfp4"):
            raise FreeTokenError(
                f"{self.ck.path}: {w.values} holds every expert of a layer in {w.format}; FreeToken reads "
                f"{w.format} experts one tensor per expert, as the releases publish them")
        return w

    def _one(self, e: int, proj: str) -> Weight | None:
        return self.ck.weight(f"{self.p}{e}.{proj}.weight")

    def pieces(self, part: str, e: int) -> list[tuple[Weight | None, int | None, str]]:
        """(weight, row of a fused tensor or None, its name) of each piece of a part, in bank row
        order (a missing per-expert weight: None with the name it should have)."""
        if part == "gate_up":
            if self.fused_gu is not None:
                return [(self.fused_gu, e, self.fused_gu.name)]
            if self.fused_g is not None:
                return [(self.fused_g, e, self.fused_g.name), (self.fused_u, e, self.fused_u.name)]
            return [(self._one(e, pr), None, f"{self.p}{e}.{pr}.weight") for pr in ("gate_proj", "up_proj")]
        if self.fused_down is not None:
            return [(self.fused_down, e, self.fused_down.name)]
        return [(self._one(e, "down_proj"), None, f"{self.p}{e}.down_proj.weight")]

    def weights(self, e: int) -> list[tuple[Weight | None, str]]:
        """Every weight this expert needs (for the missing-tensor and format checks)."""
        return [(w, n) for part in ("gate_up", "down") for w, _, n in self.pieces(part, e)]

    def missing_biases(self) -> list[str]:
        return [n for n in self.bias_names.values() if n not in self.ck.tensors]

    def bias(self, part: str, e: int) -> torch.Tensor:
        """Expert e's bias of a part in bank layout: gate_up [2I] (gate then up), down [H]."""
        name = self.bias_names[part]
        want = [self.e, 2 * self.i if part == "gate_up" else self.h]
        s = self.ck.tensors[name]
        if s.shape != want:
            raise FreeTokenError(f"{s.file}: {name} has shape {s.shape}, expected {want}")
        t = self.ck.get(name, e)
        return t[self.bias_perm] if part == "gate_up" and self.bias_perm is not None else t

    def read(self, part: str, e: int, comp: str = "values") -> torch.Tensor:
        """One component ("values", "scale", "scale_2", "bias") of expert e's part, in bank layout."""
        if comp == "bias":
            return self.bias(part, e)
        out = []
        for w, row, _ in self.pieces(part, e):
            t = self.ck.read(w, comp, row)
            if w.format == "dense" and row is not None:
                rows = 2 * self.i if part == "gate_up" else self.h
                if self.gptoss or t.shape[0] != rows:  # [E, H, 2I] layouts transpose
                    t = t.t().contiguous()
            out.append(t)
        t = out[0] if len(out) == 1 else torch.cat(out, dim=0)
        if self.perm is not None and part == "gate_up":
            t = t[self.perm]
        return t


def bank_entries(fmt: str, n: int, i: int, h: int, dtypes: dict) -> list[tuple[str, str, list[int], str, str]]:
    """(entry name, dtype name, shape, part, component) of every expert bank, in file order;
    dtypes: component -> dtype name (the published ones: bf16/f16/f32 values, fp8 scales as
    published; "bias" when the experts have biases)."""
    out = []
    for part, rows, cols, halves in (("gate_up", 2 * i, h, 2), ("down", h, i, 1)):
        name = BANKS[0] if part == "gate_up" else BANKS[1]
        if fmt == "dense":
            out.append((name, dtypes["values"], [n, rows, cols], part, "values"))
        elif fmt == "fp8_block":
            grid = [halves * _cdiv(rows // halves, FP8_BLOCK), _cdiv(cols, FP8_BLOCK)]
            out += [(name, "float8_e4m3fn", [n, rows, cols], part, "values"),
                    (name + ".scale", dtypes["scale"], [n] + grid, part, "scale")]
        elif fmt == "mxfp4":
            out += [(name, "uint8", [n, rows, cols // 2], part, "values"),
                    (name + ".scale", "uint8", [n, rows, cols // MX_BLOCK], part, "scale")]
        elif fmt == "nvfp4":
            out += [(name, "uint8", [n, rows, cols // 2], part, "values"),
                    (name + ".scale", "float8_e4m3fn", [n, rows, cols // NV_BLOCK], part, "scale"),
                    (name + ".scale_2", "float32", [n, halves], part, "scale_2")]
        else:
            raise ValueError(fmt)
    if "bias" in dtypes:
        out += [(BIAS_BANKS[0], dtypes["bias"], [n, 2 * i], "gate_up", "bias"),
                (BIAS_BANKS[1], dtypes["bias"], [n, h], "down", "bias")]
    return out


def banks_meta(fmt: str, bias: bool = False) -> dict:
    """meta["banks"]: the value banks' names (as before), the format, the scale entries and the
    bias banks."""
    m = {"gate_up": BANKS[0], "down": BANKS[1], "format": fmt}
    if bias:
        m["gate_up_bias"], m["down_bias"] = BIAS_BANKS
    for part, name in zip(("gate_up", "down"), BANKS):
        if fmt in ("fp8_block", "mxfp4", "nvfp4"):
            m[part + "_scale"] = name + ".scale"
        if fmt == "nvfp4":
            m[part + "_scale_2"] = name + ".scale_2"
    return m


# ---------------------------------------------------------------- shapes against config.json
# A checkpoint whose tensors disagree with its config.json (a config.json from another size of
# the model, a field edited by hand) used to convert and then fail inside generate or serve with
# a bare shape error. Each tensor the engine loads is compared with the shape the config implies
# (implied_shapes: float shapes, so a quantized weight's unpacked shape, Weight.shape) before
# anything is written, and the error names the config.json fields that shape comes from.

SHAPE_ADVICE = "config.json and the weights disagree: fix config.json or use the checkpoint's own config.json"
ONE_EXPERT = re.compile(r"(\.mlp\.experts\.)\d+\.")  # experts.{e}. -> experts.*. (implied_shapes' key)


def _mlp_shapes(p: str, inter: int, h: int) -> dict[str, tuple]:
    """A SwiGLU MLP under prefix p (dense layer, shared expert)."""
    return {p + "gate_proj.weight": (inter, h), p + "up_proj.weight": (inter, h), p + "down_proj.weight": (h, inter)}


def _base_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Embedding, final norm, lm_head and every layer's two norms: the same in each architecture."""
    h = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    return shapes


def _attention_shapes(cfg: ModelConfig, l: int) -> dict[str, tuple]:
    """Softmax attention (model/attention.py), with what any family adds: q/k norms, biases, sinks."""
    h, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    q, kv = nh * hd, cfg.num_kv_heads * hd
    a = f"model.layers.{l}.self_attn."
    return {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
            a + "o_proj.weight": (h, q), a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
            a + "o_proj.bias": (h,), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,), a + "sinks": (nh,)}


def _qwen3_moe_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Attention, the router (and a gated shared expert) on MoE layers, a dense MLP elsewhere."""
    h, e, si = cfg.hidden_size, cfg.num_experts, cfg.shared_expert_intermediate_size
    shapes = _base_shapes(cfg)
    for l in range(cfg.num_layers):
        m = f"model.layers.{l}.mlp."
        shapes.update(_attention_shapes(cfg, l))
        if l in cfg.moe_layers:
            shapes.update({m + "gate.weight": (e, h), m + "shared_expert_gate.weight": (1, h)})
            shapes.update(_mlp_shapes(m + "shared_expert.", si, h))
        else:
            shapes.update(_mlp_shapes(m, cfg.intermediate_size, h))
    return shapes


def _gpt_oss_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Attention with biases and sinks, a biased router; every layer MoE."""
    shapes = _base_shapes(cfg)
    for l in range(cfg.num_layers):
        m = f"model.layers.{l}.mlp."
        shapes.update(_attention_shapes(cfg, l))
        shapes.update({m + "router.weight": (cfg.num_experts, cfg.hidden_size), m + "router.bias": (cfg.num_experts,)})
    return shapes


def _glm_moe_dsa_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Latent attention and its indexer (model/mla.py), the DeepSeek-style MoE (model/deepseek_moe.py)."""
    h, nh, e, rd = cfg.hidden_size, cfg.num_heads, cfg.num_experts, cfg.qk_rope_head_dim
    ql, kvr, ih, idim = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    shapes = _base_shapes(cfg)
    for l in range(cfg.num_layers):
        a, m = f"model.layers.{l}.self_attn.", f"model.layers.{l}.mlp."
        shapes.update({
            a + "q_a_proj.weight": (ql, h), a + "q_a_proj.bias": (ql,), a + "q_a_layernorm.weight": (ql,),
            a + "q_b_proj.weight": (nh * cfg.head_dim, ql),  # head_dim = nope + rope
            a + "kv_a_proj_with_mqa.weight": (kvr + rd, h), a + "kv_a_proj_with_mqa.bias": (kvr + rd,),
            a + "kv_a_layernorm.weight": (kvr,),
            a + "kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), kvr),
            a + "o_proj.weight": (h, nh * cfg.v_head_dim), a + "o_proj.bias": (h,),
            a + "indexer.wq_b.weight": (ih * idim, ql), a + "indexer.wk.weight": (idim, h),
            a + "indexer.k_norm.weight": (idim,), a + "indexer.k_norm.bias": (idim,),
            a + "indexer.weights_proj.weight": (ih, h)})
        if l in cfg.moe_layers:
            shapes.update({m + "gate.weight": (e, h), m + "gate.e_score_correction_bias": (e,)})
            shapes.update(_mlp_shapes(m + "shared_experts.", cfg.shared_expert_intermediate_size, h))
        else:
            shapes.update(_mlp_shapes(m, cfg.intermediate_size, h))
    return shapes


def _deepseek_v4_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """V4 attention with its compressors (model/csa.py), hyper-connections (model/hyper.py), the
    V4 MoE (model/deepseek_v4.py), under transformers' names (hf.py deepseek_v4_name)."""
    h, nh, hd, hc, e = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult, cfg.num_experts
    ql, g, olr, ih, idim = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    mix = (2 + hc) * hc  # pre, post and comb weights of the hc streams
    shapes = _base_shapes(cfg)
    shapes.update({"model.hc_head.hc_fn": (hc, hc * h), "model.hc_head.hc_base": (hc,), "model.hc_head.hc_scale": (1,)})
    for l, kind in enumerate(cfg.compressed_attention):
        p = f"model.layers.{l}."
        a, c, m = p + "self_attn.", p + "self_attn.compressor.", p + "mlp."
        for s in ("attn", "ffn"):
            shapes.update({f"{p}{s}_hc.fn": (mix, hc * h), f"{p}{s}_hc.base": (mix,), f"{p}{s}_hc.scale": (3,)})
        shapes.update({
            a + "q_a_proj.weight": (ql, h), a + "q_a_norm.weight": (ql,), a + "q_b_proj.weight": (nh * hd, ql),
            a + "kv_proj.weight": (hd, h), a + "kv_norm.weight": (hd,), a + "sinks": (nh,),
            a + "o_a_proj.weight": (g * olr, nh * hd // g), a + "o_b_proj.weight": (h, g * olr)})
        rate = {"csa": cfg.compress_rate_csa, "hca": cfg.compress_rate_hca}.get(kind)
        if rate is not None:  # CSA's windows overlap: two series per token
            shapes.update(_compressor_shapes(c, rate, (2 if kind == "csa" else 1) * hd, hd, h))
        if kind == "csa":
            shapes.update(_compressor_shapes(c + "indexer.", rate, 2 * idim, idim, h))
            shapes.update({c + "indexer.q_b_proj.weight": (ih * idim, ql),
                           c + "indexer.scorer.weights_proj.weight": (ih, h)})
        shapes.update({m + "gate.weight": (e, h), m + "gate.e_score_correction_bias": (e,),
                       m + "gate.tid2eid": (cfg.vocab_size, cfg.top_k)})  # hash layers: token id -> its experts
        shapes.update(_mlp_shapes(m + "shared_experts.", cfg.shared_expert_intermediate_size, h))
    return shapes


def _compressor_shapes(c: str, rate: int, width: int, dim: int, h: int) -> dict[str, tuple]:
    """A V4 window compressor (model/csa.py Compressor): kv and gate rows of `width` per token."""
    return {c + "kv_proj.weight": (width, h), c + "gate_proj.weight": (width, h), c + "position_bias": (rate, width),
            c + "kv_norm.weight": (dim,)}


def _expert_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The routed experts of every MoE layer in each layout ExpertReader reads, output rows first:
    one tensor per expert (`experts.*.`), fused per layer [E, out, in], and their biases."""
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shapes = {}
    for l in cfg.moe_layers:
        p = f"model.layers.{l}.mlp.experts."
        shapes.update({p + "*.gate_proj.weight": (i, h), p + "*.up_proj.weight": (i, h),  # one expert
                       p + "*.down_proj.weight": (h, i),
                       p + "gate_up_proj": (e, 2 * i, h), p + "down_proj": (e, h, i),  # fused per layer
                       p + "gate_proj": (e, i, h), p + "up_proj": (e, i, h),  # fused, gate and up apart
                       p + "gate_up_proj_bias": (e, 2 * i), p + "down_proj_bias": (e, h)})  # GPT-OSS
    return shapes


def _qwen3_5_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """The demo generator's own table, and the attention biases the model loads where
    attention_bias is set (q_proj's output holds the query and its gate: twice the heads' width)."""
    shapes = weight_shapes(cfg, experts=False)
    q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for l, kind in enumerate(cfg.layer_types):
        if kind != "linear_attention":
            a = f"model.layers.{l}.self_attn."
            shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,),
                           a + "o_proj.bias": (cfg.hidden_size,)})
    return shapes


ARCH_SHAPES = {"qwen3_5_moe": _qwen3_5_shapes,
               "qwen3_moe": _qwen3_moe_shapes, "gpt_oss": _gpt_oss_shapes, "glm_moe_dsa": _glm_moe_dsa_shapes,
               "deepseek_v4": _deepseek_v4_shapes}


def implied_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Tensor name -> the float shape cfg implies, for every tensor the engine loads (and a few a
    family does not have: only names the checkpoint provides are looked up). One expert's tensors
    are keyed `experts.*.` (shape_key)."""
    # an architecture without a table here checks its experts only (a new family must not fail to convert)
    return {**ARCH_SHAPES.get(cfg.arch, lambda _: {})(cfg), **_expert_shapes(cfg)}


def shape_key(name: str) -> str:
    """A tensor's key in implied_shapes: one expert's tensors go by `experts.*.`."""
    return ONE_EXPERT.sub(r"\1*.", name)


def accepted_shapes(cfg: ModelConfig, w: Weight, want: tuple) -> list[list[int]]:
    """The shapes w may have where cfg implies `want`, the one error messages show first: fused
    float expert tensors are also published input first, [E, in, out] (GPT-OSS always so; its
    MXFP4 blocks are output first): ExpertReader.read transposes by the same rule."""
    want = list(want)
    if w.name.endswith("conv1d.weight") and len(want) == 3 and want[1] == 1:  # the DeltaNet conv, [C, 1, K]:
        return [want, [want[0], want[2]]]  # re-exports squeeze it to [C, K], which the model reads too
    if w.format != "dense" or len(want) != 3 or ".mlp.experts." not in w.name:
        return [want]
    flipped = [want[0], want[2], want[1]]
    return [flipped] if cfg.arch == "gpt_oss" else [want, flipped]


def _probes(raw: dict):
    """(field, config.json with that integer field changed): doubled, or else one more, or
    else halved, for the first of those that ModelConfig accepts (num_key_value_heads must divide
    num_attention_heads, say)."""
    text = raw.get("text_config")
    levels = [("text_config.", text), ("", raw)] if isinstance(text, dict) else [("", raw)]
    for prefix, d in levels:
        for k, v in d.items():
            if type(v) is not int or v < 0:  # not bools
                continue
            for nv in (n for n in (2 * v, v + 1, v // 2) if n != v):
                changed = {**d, k: nv}
                probe = {**raw, "text_config": changed} if prefix else changed
                try:
                    cfg = ModelConfig.from_hf(probe)
                except Exception:  # a value this config cannot take (or a formula dividing by it)
                    continue
                yield prefix + k, cfg
                break


def config_fields(raw: dict, cfg: ModelConfig, w: Weight, dims: list[int]) -> list[str]:
    """The config.json fields that dims `dims` of w's implied shape come from: each integer field is
    changed in turn and the shapes implied again (so a dim derived through several fields, or
    named differently per family, is still traced to the fields config.json has)."""
    key = shape_key(w.name)
    base = accepted_shapes(cfg, w, implied_shapes(cfg)[key])[0]
    fields = []
    for field, probe in _probes(raw):
        try:
            want = implied_shapes(probe).get(key)
        except Exception:  # noqa: BLE001  a probe's config this family cannot shape: it names nothing
            continue
        if want is not None and any(accepted_shapes(probe, w, want)[0][d] != base[d] for d in dims):
            fields.append(field)
    return fields


def check_shapes(src: str, raw: dict, cfg: ModelConfig, ck: Checkpoint, weights: list[Weight]) -> None:
    """Refuse, before anything is written, a weight whose shape is not the one config.json implies
    (the first of them, with how many there are)."""
    implied = implied_shapes(cfg)
    bad = []
    for w in {w.name: w for w in weights}.values():  # a fused expert tensor comes once per expert
        want = implied.get(shape_key(w.name))
        ok = accepted_shapes(cfg, w, want) if want is not None else [w.shape]
        if w.shape not in ok:
            bad.append((w, ok))
    if bad:
        raise _shape_error(src, raw, cfg, ck, *bad[0], len(bad))


def _shape_error(src: str, raw: dict, cfg: ModelConfig, ck: Checkpoint, w: Weight, ok: list[list[int]],
                 n_bad: int) -> FreeTokenError:
    """One line: the tensor (and how a quantized one is stored), its shape, the shape(s) config.json
    implies, the fields the differing dims come from, and what to do."""
    s = ck.tensors[w.values]
    same_rank = len(w.shape) == len(ok[0])
    dims = [d for d, n in enumerate(ok[0]) if not same_rank or w.shape[d] != n]  # the dims that differ
    fields = ", ".join(config_fields(raw, cfg, w, dims)) or "the architecture, or fields config.json leaves out"
    stored = "" if w.format == "dense" else f" ({w.format}, stored as {w.values} {s.shape})"
    more = f"; {n_bad - 1} more tensor(s) disagree too" if n_bad > 1 else ""
    return FreeTokenError(
        f"{src}: tensor {w.name}{stored} (in {os.path.basename(s.file)}) has shape {w.shape}, but config.json "
        f"implies {' or '.join(map(str, ok))} (from {fields}){more}; {SHAPE_ADVICE}")


class Plan:
    """Everything about a checkpoint, read and checked, before anything is written."""

    def __init__(self, raw, cfg, ck, dense, experts, scheme, dense_w, expert_fmt, expert_dtypes):
        self.raw, self.cfg, self.ck, self.dense, self.experts = raw, cfg, ck, dense, experts
        self.scheme: QuantScheme | None = scheme
        self.dense_w: dict[str, Weight] = dense_w  # every dense weight, resolved
        self.expert_format: str | None = expert_fmt  # None: no routed experts
        self.expert_dtypes: dict = expert_dtypes


# integer tables kept as they are: DeepSeek-V4's hash-routed layers' token -> experts map
INTEGER_TENSORS = ("mlp.gate.tid2eid",)


def _deepseek_v4_notices(src: str, cfg: ModelConfig, ck: Checkpoint) -> None:
    """What FreeToken leaves out of a DeepSeek-V4 checkpoint, said once at convert."""
    mtp = [n for n in ck.skipped if n.startswith(("mtp.", "model.mtp."))]
    if mtp:
        notice(f"{src}: skipping the multi-token-prediction head ({len(mtp)} mtp.* tensors, not used for serving)")


def _check_dense_dtype(src: str, ck: Checkpoint, name: str) -> None:
    s = ck.tensors[name]
    if s.dtype not in WEIGHT_DTYPES:
        raise UnsupportedModelError(
            f"{src}: tensor {name} is {s.st_dtype} (in {os.path.basename(s.file)}); FreeToken converts "
            "F32, BF16 and F16 weights, and FP8 (128x128 blocks), MXFP4 and NVFP4 weights with their "
            "scales; convert the BF16 release of the model")


def plan(src: str) -> Plan:
    """Read and check everything about a checkpoint without writing anything."""
    raw = read_config(src)
    scheme = quant_scheme(src, raw, None)  # a declared quantization FreeToken does not read: refused first
    cfg = ModelConfig.from_hf(raw, os.path.join(src, "config.json"))
    for fn in REQUIRED_FILES:
        if not os.path.exists(os.path.join(src, fn)):
            raise FreeTokenError(f"{src}: {fn} is missing; FTW embeds the tokenizer, copy it from the model's release")
    split = (lambda tensors: qwen3_next_split(tensors, cfg.raw)) if cfg.raw.get("model_type") == "qwen3_next" else None
    ck = Checkpoint(src, deepseek_v4_name if cfg.arch == "deepseek_v4" else None, split)
    if split is not None:
        notice(f"{src}: Qwen3-Next, run as Qwen3.5-MoE's layers: its fused DeltaNet projections (in_proj_qkvz, "
               "in_proj_ba) are read apart per key-head group")
    if cfg.arch == "deepseek_v4":
        _deepseek_v4_notices(src, cfg, ck)
    if scheme is None:
        scheme = quant_scheme(src, raw, ck)  # quantized tensors that no config declares
    past, n_past = layers_past(ck, cfg.num_layers)
    if past:
        notice(f"{src}: skipping layer(s) {', '.join(map(str, past))} past num_hidden_layers={cfg.num_layers} "
               f"({n_past} tensors: multi-token-prediction heads, not used for serving)")
    names = model_class(cfg.arch).expected_tensors(cfg)
    experts = [ExpertReader(ck, cfg, l) for l in cfg.moe_layers]
    dense_w = {n: ck.weight(n) for n in names}
    expert_w = [(w, n) for r in experts for e in range(cfg.num_experts) for w, n in r.weights(e)]
    biases = [ck.weight(n) for r in experts for n in r.bias_names.values()]
    # shapes before the missing tensors: a num_experts above the checkpoint's says so (its router's
    # rows), not that expert 16 is missing
    present = [*dense_w.values(), *(w for w, _ in expert_w), *biases]
    check_shapes(src, raw, cfg, ck, [w for w in present if w is not None])
    missing = [n for n, w in dense_w.items() if w is None] + [n for w, n in expert_w if w is None]
    if missing:
        first = missing[0]
        for fused, parts in QWEN3_NEXT_PARTS.items() if split is not None else ():
            if any(f".linear_attn.{p}." in first for p in parts):
                first += f" (read from Qwen3-Next's {fused}, which this layer lacks)"
        raise FreeTokenError(f"{src}: checkpoint is missing {len(missing)} tensor(s), first {first}")
    quantized = [w for w in dense_w.values() if w.format != "dense"] + [w for w, _ in expert_w if w.format != "dense"]
    if scheme is None and quantized:  # cannot happen: quant_scheme saw these tensors
        raise FreeTokenError(f"{src}: tensor {quantized[0].values} is quantized but no format was recognised")
    expert_names = {w.name for w, _ in expert_w if w is not None}
    if scheme is not None and scheme.expert_format is None and scheme.format == "fp8_block" and expert_w and all(
            w.format == "mxfp4" and w.values == w.name for w, _ in expert_w):
        scheme.expert_format = "mxfp4"  # DeepSeek-V4-Flash's FP4 experts where the config does not say it
    for w in quantized:
        want = scheme.experts if w.name in expert_names else scheme.format
        if w.format != want:
            raise UnsupportedModelError(
                f"{src}: the checkpoint's {'routed experts are' if w.name in expert_names else 'weights are'} "
                f"{want} ({scheme.where}) but {w.name} is stored as {w.format} ({', '.join(w.parts())}); "
                "mixed formats are not supported")
    if scheme is not None and not quantized:
        raise FreeTokenError(f"{src}: the checkpoint's quantization ({scheme.description}) is on none of its "
                             "weights (no scale tensors); is this the right config for these weights?")
    for w in dense_w.values():
        if w.format == "dense" and not w.values.endswith(INTEGER_TENSORS):
            _check_dense_dtype(src, ck, w.values)
    expert_fmt, expert_dtypes = None, {}
    if expert_w:
        fmts = {w.format for w, _ in expert_w}
        if len(fmts) > 1:
            raise UnsupportedModelError(
                f"{src}: the routed experts are stored in more than one format ({', '.join(sorted(fmts))}); "
                "FreeToken's expert banks hold one format")
        expert_fmt = fmts.pop()
        first = expert_w[0][0]
        for comp in first.components():
            if comp == "values" and expert_fmt == "dense":
                for w, _ in expert_w:
                    _check_dense_dtype(src, ck, w.values)
            seen = {ck.tensors[getattr(w, comp)].st_dtype for w, _ in expert_w}
            if len(seen) > 1:
                raise FreeTokenError(f"{src}: the routed experts' {comp} tensors mix dtypes ({', '.join(sorted(seen))})")
            expert_dtypes[comp] = DTYPE_NAMES.get(ck.tensors[getattr(first, comp)].dtype, "uint8")
            if comp == "values" and expert_fmt == "mxfp4":
                expert_dtypes[comp] = "uint8"  # packed e2m1 bytes (V4 publishes them as int8)
            elif comp == "scale" and expert_fmt == "fp8_block" and ck.tensors[first.scale].st_dtype == "F8_E8M0":
                expert_dtypes[comp] = DTYPE_NAMES[torch.float32]  # ue8m0 scales read as f32 (Checkpoint.read)
    if cfg.expert_bias and experts:
        missing = [n for r in experts for n in r.missing_biases()]
        if missing:
            raise FreeTokenError(
                f"{src}: checkpoint is missing {len(missing)} expert bias tensor(s), first {missing[0]}")
        biases = [n for r in experts for n in r.bias_names.values()]
        for n in biases:
            _check_dense_dtype(src, ck, n)
        seen = {ck.tensors[n].st_dtype for n in biases}
        if len(seen) > 1:
            raise FreeTokenError(f"{src}: the routed experts' biases mix dtypes ({', '.join(sorted(seen))})")
        expert_dtypes["bias"] = DTYPE_NAMES[ck.tensors[biases[0]].dtype]
    with open(os.path.join(src, "tokenizer.json"), "rb") as f:
        tk = Tokenizer(f.read(), source=os.path.join(src, "tokenizer.json"))
    tk.check_fits(cfg.vocab_size, src)
    return Plan(raw, cfg, ck, names, experts, scheme, dense_w, expert_fmt, expert_dtypes)


def _make_parent(out: str) -> str | None:
    """Create the output's missing folders; returns the topmost one created (None if none)."""
    parent = os.path.dirname(os.path.abspath(out))
    top = None
    p = parent
    while not os.path.exists(p):
        top, p = p, os.path.dirname(p)
    if top is None:
        if not os.path.isdir(parent):
            raise FreeTokenError(f"{out}: {parent} is not a folder")
        return None
    try:
        os.makedirs(parent)
    except OSError as e:
        raise FreeTokenError(f"{out}: cannot create the folder {parent} ({e.strerror})") from None
    return top


def _remove_created(top: str | None, out: str) -> None:
    """Undo _make_parent after a failure: remove the folders it made, if still empty."""
    if top is None:
        return
    p = os.path.dirname(os.path.abspath(out))
    while True:
        try:
            os.rmdir(p)
        except OSError:
            return
        if p == top:
            return
        p = os.path.dirname(p)


def source_name(src: str) -> str:
    """The checkpoint's name (the served model id by default): its folder's name, or NAME for a
    Hugging Face cache snapshot (.../models--ORG--NAME/snapshots/COMMIT), not the commit hash."""
    path = os.path.abspath(src)
    parent, leaf = os.path.split(path)
    repo, kind = os.path.split(parent)
    base = os.path.basename(repo)
    if kind == "snapshots" and base.startswith("models--"):
        return base.split("--")[-1] or leaf
    return leaf


def check_side_file(src: str, fn: str, blob: bytes) -> None:
    """Refuse, at convert, a side file the engine could not read at load: the JSON configs must be
    JSON objects, the chat template UTF-8 (a bad one used to convert and then fail every load)."""
    where = os.path.join(src, fn)
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FreeTokenError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 and "
                             "convert again") from None
    if fn.endswith(".json"):
        try:
            v = json.loads(text)
        except ValueError as e:
            raise FreeTokenError(f"{where}: invalid JSON ({e}); fix or replace it (from the model's release) and "
                                 "convert again") from None
        if not isinstance(v, dict):
            raise FreeTokenError(f"{where}: expected a JSON object, found {type(v).__name__}; replace it with the "
                                 "model's own file and convert again")


def convert(src: str, out: str, progress: bool = True) -> str:
    # the output is named before the checkpoint is read (a large one takes minutes to check)
    if os.path.isdir(out) or out.endswith(("/", os.sep)):  # a folder, or one meant (not yet made)
        folder = out.rstrip("/" + os.sep) or out
        raise FreeTokenError(f"{out}: is a directory{'' if os.path.isdir(out) else ' name'}; give the output file "
                             f"name, e.g. {os.path.join(folder, 'model.ftw')}")
    pl = plan(src)
    cfg, ck = pl.cfg, pl.ck
    files = [fn for fn in REQUIRED_FILES + OPTIONAL_FILES if os.path.exists(os.path.join(src, fn))]
    blobs = {fn: open(os.path.join(src, fn), "rb").read() for fn in files}
    for fn, b in blobs.items():
        check_side_file(src, fn, b)
    entries = [Entry("file/" + fn, "uint8", [len(b)]) for fn, b in blobs.items()]
    dense_tensors = list(dict.fromkeys(t for n in pl.dense for t in pl.dense_w[n].parts()))
    entries += [Entry(t, _dtype_name(ck, t), ck.tensors[t].shape) for t in dense_tensors]
    banks = []
    if pl.experts:
        banks = bank_entries(pl.expert_format, cfg.num_flat_experts, cfg.moe_intermediate_size,
                             cfg.hidden_size, pl.expert_dtypes)
        entries += [Entry(name, dt, shape) for name, dt, shape, _, _ in banks]
    meta = {"arch": cfg.arch, "model": cfg.to_dict(), "config": pl.raw,
            "banks": banks_meta(pl.expert_format, "bias" in pl.expert_dtypes) if pl.experts else {},
            "source": source_name(src)}
    if pl.scheme is not None:
        qd = {n: {"format": w.format, "values": w.values, "scale": w.scale, "scale_2": w.scale_2,
                  "shape": w.shape} for n, w in pl.dense_w.items() if w.format != "dense"}
        meta["quant"] = {"format": pl.scheme.format, "experts": pl.expert_format or pl.scheme.experts,
                         "declared": pl.scheme.where,
                         "description": pl.scheme.description, "dense": qd}
    created = _make_parent(out)
    layout(entries, meta)  # the offsets FTWWriter assigns: the file's size, header and alignment included
    _check_space(out, total_size(entries), created)
    try:
        _write(src, out, pl, dense_tensors, banks, entries, meta, blobs, progress)
    except OSError as e:
        _remove_created(created, out)
        raise FreeTokenError(f"{out}: cannot write ({e.strerror or e}); nothing was written") from None
    except BaseException:
        _remove_created(created, out)
        raise
    if pl.scheme is not None:
        notice(summary(pl, entries))
    return out


def _check_space(out: str, need: int, created: str | None) -> None:
    """Refuse before writing when the output's filesystem cannot hold the file: a large model
    would otherwise fail minutes in, at the disk's end."""
    folder = os.path.dirname(os.path.abspath(out))
    free = shutil.disk_usage(folder).free
    if free < need:
        _remove_created(created, out)
        raise FreeTokenError(f"{out}: the converted model needs {_size(need)} and {folder} has {_size(free)} free; "
                             f"free some space or write it elsewhere (nothing was written)")


def _dtype_name(ck: Checkpoint, name: str) -> str:
    dt = ck.tensors[name].dtype
    return DTYPE_NAMES.get(dt, "uint8")  # float8_e8m0fnu scales: their bytes, as uint8


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def summary(pl: Plan, entries: list[Entry]) -> str:
    """One line: the format found and the sizes that result."""
    by = {e.name: e.nbytes for e in entries}
    cfg, fmt = pl.cfg, pl.scheme.format
    parts = [f"quantized checkpoint: {fmt} ({FORMAT_NAMES[fmt]}), {pl.scheme.description}"]
    if pl.experts:
        eb = sum(n for name, n in by.items() if name.startswith("experts."))
        n = cfg.num_flat_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
        parts.append(f"routed experts kept as {pl.expert_format}: {_size(eb)} ({eb / n:.2f} bytes per weight; "
                     f"BF16 would take {_size(2 * n)})")
    qd = [w for w in pl.dense_w.values() if w.format != "dense"]
    if qd:
        db = sum(by[t] for w in qd for t in w.parts())
        how = ("read as FP8 by the GEMMs on CUDA, dequantized to the compute dtype on the CPU: --dense-fp8"
               if fmt == "fp8_block" else "dequantized to the compute dtype when loaded")
        parts.append(f"{len(qd)} dense weights kept as {fmt} ({_size(db)}; {how})")
    plain = [n for n, w in pl.dense_w.items() if w.format == "dense"]
    parts.append(f"{len(plain)} unquantized ({_size(sum(by[n] for n in plain))})")
    return "; ".join(parts)


def _write(src, out, pl: Plan, dense_tensors, banks, entries, meta, blobs, progress) -> None:
    cfg, ck = pl.cfg, pl.ck
    by_name = {e.name: e for e in entries}
    total = sum(e.nbytes for e in entries)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    with FTWWriter(out, entries, meta) as w:
        for fn, b in blobs.items():
            w.write("file/" + fn, b)
            bar.update(len(b))
        for n in dense_tensors:
            t = ck.get(n)
            if t.dtype not in DTYPE_NAMES:
                t = t.view(torch.uint8)
            w.write(n, t)
            bar.update(t.numel() * t.element_size())
        for bank, _, _, part, comp in banks:
            want = by_name[bank]
            shape = want.shape[1:]
            for r in pl.experts:
                for e in range(cfg.num_experts):
                    t = r.read(part, e, comp)
                    if DTYPE_NAMES.get(t.dtype) != want.dtype or list(t.shape) != shape:
                        raise FreeTokenError(
                            f"{src}: layer {r.layer} expert {e} {part} {comp} is {t.dtype} {list(t.shape)}, "
                            f"expected {want.dtype} {shape}")
                    w.write(bank, t)
                    bar.update(t.numel() * t.element_size())
    bar.close()
