"""Reading transformers checkpoint directories as they are published.

Handles sharded safetensors (model.safetensors.index.json) or loose *.safetensors files, the
multimodal wrapper's `model.language_model.` prefix (vision tower and MTP heads skipped), and
routed experts stored one tensor per expert or fused per layer, and DeepSeek-V4's own tensor names
(`deepseek_v4_name`, the MTP head skipped). Tensors are opened lazily
(safetensors mmap) so a checkpoint larger than RAM streams through.

Quantized checkpoints are recognised here, from their config and from their tensors. Three
formats are read as published (`quant_scheme`, `Checkpoint.weight`; quant.py has the formats and
their reference dequantizers); every other quantization is refused by name (`describe_quant`,
`describe_quant_tensors`) instead of having its scales dropped.

The layouts read, and the releases each is modelled on:

fp8_block  Qwen/Qwen3-30B-A3B-FP8 (Qwen3-MoE), Qwen/Qwen3.6-35B-A3B-FP8 (Qwen3.5-MoE, multimodal
           wrapper), DeepSeek-V3: config.json `quantization_config` {quant_method: "fp8", fmt:
           "e4m3", activation_scheme: "dynamic", weight_block_size: [128, 128],
           modules_to_not_convert / ignored_layers: [...]}; each quantized Linear `X.weight`
           F8_E4M3 [R, C] with `X.weight_scale_inv` [ceil(R/128), ceil(C/128)] in F32 (DeepSeek)
           or BF16 / F16 (Qwen); routed experts one tensor per expert
           (`mlp.experts.{e}.{gate,up,down}_proj.weight` + `.weight_scale_inv`). Other block
           sizes, per-tensor or per-channel fp8 are refused.
           DeepSeek-V4: scales named `X.scale` (beside `X.weight`, the same multiplier). -Base:
           FP8 everywhere, F32 128x128 block scales. -Flash: `scale_fmt: "ue8m0"` (F8_E8M0 block
           scales, powers of two) and FP4 routed experts (`expert_dtype: "fp4"` where the config
           says so, else seen in the tensors): `experts.{e}.w{1,2,3}.weight` I8 [R, C/2] (two e2m1
           codes a byte, low nibble first) + `.scale` F8_E8M0 [R, C/32], MXFP4's values and scales
           under V4's names (read as an mxfp4 bank); the FP8 Linears' e8m0 scales are kept as
           bytes and dequantized at load.
mxfp4      openai/gpt-oss-20b/120b (`quant_method: "mxfp4"`, modules_to_not_convert): routed
           experts fused per layer, `mlp.experts.gate_up_proj_blocks` U8 [E, 2I, H/32, 16] +
           `mlp.experts.gate_up_proj_scales` U8 (e8m0) [E, 2I, H/32], whose rows INTERLEAVE gate
           and up (row 2j: gate j, row 2j+1: up j, as GPT-OSS publishes them: transformers'
           GptOssExperts takes gate_up[..., ::2] and [..., 1::2]); `mlp.experts.down_proj_blocks`
           [E, H, I/32, 16] + `_scales` [E, H, I/32]. Also read: gate and up published
           separately in that style, `mlp.experts.gate_proj_blocks` / `up_proj_blocks` [E, I,
           H/32, 16] + `_scales` (not interleaved), and, by the same naming rule (a parameter P
           published as P_blocks + P_scales), one tensor per expert or dense Linear weights as
           `X.weight_blocks` [R, C/32, 16] + `X.weight_scales` [R, C/32]. A fused
           `gate_up_proj_blocks` is always read as GPT-OSS-interleaved. Scales may be U8 or
           F8_E8M0. GPT-OSS's expert biases, `mlp.experts.gate_up_proj_bias` [E, 2I] (interleaved
           as the rows) and `down_proj_bias` [E, H], are BF16 tensors beside them, read by
           convert.py's ExpertReader for that architecture (the BF16 layout too: `gate_up_proj`
           [E, H, 2I] with interleaved columns, `down_proj` [E, I, H]).
nvfp4      nvidia/Qwen3-30B-A3B-FP4 (NVIDIA ModelOpt export): `hf_quant_config.json` {producer:
           {name: "modelopt"}, quantization: {quant_algo: "NVFP4", group_size: 16,
           exclude_modules: [...]}} and/or config.json `quantization_config` {quant_method:
           "modelopt", quant_algo: "NVFP4", group_size: 16, exclude_modules | ignore: [...]};
           each quantized Linear `X.weight` U8 [R, C/2] (e2m1 pairs), `X.weight_scale`
           F8_E4M3 [R, C/16], `X.weight_scale_2` F32 (one value), `X.input_scale` F32
           (activation scale: not used, activations stay in the compute dtype); routed experts
           one tensor per expert. Group sizes other than 16, NVFP4_AWQ, FP8 and mixed ModelOpt
           algorithms, and compressed-tensors' nvfp4-pack-quantized are refused.

Whether a weight is quantized is read from its tensors (a weight with no scale tensor next to it
is taken as published, in BF16/F16/F32): the exclusion lists of the configs are not needed, and
a release that keeps some modules unquantized (routers, DeltaNet a/b projections, lm_head) reads
as it is. The routed experts of a checkpoint must all be in one format.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ..errors import FreeTokenError, UnsupportedModelError
from .quant import FP8_BLOCK, MX_BLOCK, NV_BLOCK

SKIP = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.|model\.vision_tower\.)")
EXPERT_ONE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXPERT_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def canonical(name: str) -> str | None:
    """Checkpoint tensor name -> FreeToken's name (transformers text-model names)."""
    if SKIP.match(name):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):  # older wrappers
        return name[len("language_model."):]
    return name


@dataclass
class Source:
    file: str
    name: str  # name inside the file
    shape: list[int]
    dtype: torch.dtype | None  # None: a safetensors dtype torch has no type for (st_dtype says which)
    st_dtype: str = ""  # the safetensors dtype name, e.g. "BF16", "F8_E4M3"
    rows: list[int] | None = None  # a part of a fused tensor: these rows of `name` (qwen3_next_split)


class Checkpoint:
    """Lazy view of a checkpoint directory's tensors under canonical names."""

    def __init__(self, path: str, rename=None, derive=None):
        """rename: an architecture's names -> FreeToken's, after canonical() (deepseek_v4_name);
        derive(tensors): replaces fused tensors by views of their parts (qwen3_next_split)."""
        self.path = path
        if not os.path.isdir(path):
            raise FreeTokenError(f"{path}: not a checkpoint directory")
        files = self._shard_files()
        self._handles: dict[str, object] = {}
        self.tensors: dict[str, Source] = {}
        self.skipped: list[str] = []  # names canonical() drops (vision tower, MTP heads)
        for fn in files:
            h = self._open(fn)
            for key in h.keys():
                c = canonical(key)
                if c is None:
                    self.skipped.append(key)
                    continue
                if rename is not None:
                    c = rename(c)
                sl = h.get_slice(key)
                st = sl.get_dtype()
                self.tensors[c] = Source(fn, key, list(sl.get_shape()), ST_DTYPES.get(st), st)
        self._fused = None  # ((file, name), tensor): the fused tensor whose parts get() read last
        if derive is not None:
            derive(self.tensors)

    def _shard_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise FreeTokenError(f"{index}: unreadable index ({e})") from None
            files = sorted(set(wm.values()))
            missing = [fn for fn in files if not os.path.exists(os.path.join(self.path, fn))]
            if missing:
                raise FreeTokenError(
                    f"{self.path}: shard {missing[0]} named in model.safetensors.index.json is "
                    f"missing ({len(missing)} of {len(files)} shards absent)")
            return [os.path.join(self.path, fn) for fn in files]
        files = sorted(fn for fn in os.listdir(self.path) if fn.endswith(".safetensors"))
        if not files:
            raise FreeTokenError(f"{self.path}: no *.safetensors weight files found")
        return [os.path.join(self.path, fn) for fn in files]

    def _open(self, fn: str):
        if fn not in self._handles:
            try:
                self._handles[fn] = safe_open(fn, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                with open(fn, "rb") as f:
                    head = f.read(64)
                if head.startswith(b"version https://git-lfs"):  # a clone without `git lfs pull`
                    raise FreeTokenError(f"{fn}: a Git LFS pointer, not the weights; fetch them (`git lfs pull` "
                                         "in the checkpoint's folder, or download with huggingface-cli) and "
                                         "convert again") from None
                raise FreeTokenError(f"{fn}: not a readable safetensors file ({e})") from None
        return self._handles[fn]

    def weight(self, name: str) -> "Weight | None":
        """How the weight `name` is stored (dense, or quantized with its scale tensors beside it),
        checked against its format's shapes and dtypes; None if the checkpoint lacks it."""
        return resolve_weight(self, name)

    def read(self, w: "Weight", part: str, index: int | None = None) -> torch.Tensor:
        """One component of a weight ("values", "scale", "scale_2"), or row `index` of a fused
        one, as FTW keeps it: MXFP4 blocks [.., R, C/32, 16] as [.., R, C/2] (the same bytes),
        e8m0 scales as uint8, NVFP4 scale_2 as float32 [1]."""
        t = self.get(getattr(w, part), index)
        if part == "values" and w.format == "mxfp4":
            # GPT-OSS blocks [.., R, C/32, 16]; DeepSeek-V4's experts already [.., R, C/2] (int8)
            t = (t.flatten(-2) if w.values.endswith("_blocks") else t).view(torch.uint8)
        elif part == "scale" and w.format == "fp8_block" and t.dtype == E8M0:
            t = e8m0_f32(t)  # DeepSeek-V4's ue8m0 block scales, as f32: the same values (powers of two)
        elif part == "scale" and t.dtype not in (torch.uint8, torch.float8_e4m3fn, torch.float32,
                                                  torch.bfloat16, torch.float16):
            t = t.view(torch.uint8)  # float8_e8m0fnu: the e8m0 bytes
        elif part == "scale_2":
            t = t.reshape(1)
        return t

    def get(self, name: str, index: int | None = None) -> torch.Tensor:
        """Whole tensor, or row `index` of its first dimension (reads only that row)."""
        s = self.tensors[name]
        h = self._open(s.file)
        try:
            if s.rows is not None:  # a part of a fused tensor
                if index is not None:
                    return h.get_slice(s.name)[s.rows[index]]
                if self._fused is None or self._fused[0] != (s.file, s.name):
                    # its parts are read one after another: the fused tensor once, not once a part
                    self._fused = ((s.file, s.name), h.get_tensor(s.name))
                return self._fused[1][torch.tensor(s.rows)]
            if index is None:
                return h.get_tensor(s.name)
            return h.get_slice(s.name)[index]
        except Exception as e:
            raise FreeTokenError(f"{s.file}: cannot read tensor {s.name} ({e})") from None


LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Qwen3-Next's fused projection -> {Qwen3.5's projection read from it: the parts it takes}
QWEN3_NEXT_PARTS = {"in_proj_qkvz": {"in_proj_qkv": "qkv", "in_proj_z": "z"},
                    "in_proj_ba": {"in_proj_b": "b", "in_proj_a": "a"}}
QWEN3_NEXT_FUSED = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)(in_proj_qkvz|in_proj_ba)\.(.+)$")


def qwen3_next_split(tensors: dict, t: dict) -> None:
    """Qwen3-Next's fused DeltaNet input projections as Qwen3.5's four: in_proj_qkvz's rows come
    in one group per key head, [q (dk), k (dk), v (r dv), z (r dv)] with r value heads a key head,
    and in_proj_ba's as [b (r), a (r)] per group (transformers' fix_query_key_value_ordering);
    Qwen3.5 reads in_proj_qkv = all q, all k, all v (head order), in_proj_z, in_proj_b, in_proj_a.
    Each part becomes a view of the fused tensor's rows (Source.rows: nothing is copied here),
    every tensor beside it too: per-row scales (NVFP4, MXFP4) take the same rows, 128x128 block
    scales (FP8) the rows of their blocks where every part's rows are whole blocks, one-value
    scales go to every part."""
    nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    if min(nk, nv, dk, dv) < 1:
        raise UnsupportedModelError(f"Qwen3-Next: linear_num_key_heads, linear_num_value_heads and the linear "
                                    f"head dims must be at least 1, got {nk}, {nv}, {dk}, {dv}; fix config.json")
    if nv % nk:
        raise UnsupportedModelError(f"Qwen3-Next: linear_num_value_heads ({nv}) must be a multiple of "
                                    f"linear_num_key_heads ({nk}); fix config.json")
    r = nv // nk
    group = {"in_proj_qkvz": [("q", dk), ("k", dk), ("v", r * dv), ("z", r * dv)],
             "in_proj_ba": [("b", r), ("a", r)]}
    for name in [n for n in tensors if QWEN3_NEXT_FUSED.match(n)]:
        prefix, fused, suffix = QWEN3_NEXT_FUSED.match(name).groups()
        src = tensors.pop(name)
        width = sum(n for _, n in group[fused])
        rows_of, at = {}, 0  # part letter -> its rows, group by group
        for g in range(nk):
            for letter, n in group[fused]:
                rows_of.setdefault(letter, []).append(list(range(g * width + at, g * width + at + n)))
                at = (at + n) % width
        total = nk * width
        for out, letters in QWEN3_NEXT_PARTS[fused].items():
            rows = [i for letter in letters for grp in rows_of[letter] for i in grp]  # q of every group, then k, ...
            first = src.shape[0] if src.shape else 0
            if first == total:
                sub = rows
            elif len(src.shape) <= 1 and (not src.shape or src.shape[0] == 1):
                sub = None  # one value for the whole tensor (NVFP4's weight_scale_2, input_scale)
            elif first == -(-total // FP8_BLOCK):
                if any(len(grp) % FP8_BLOCK or grp[0] % FP8_BLOCK for letter in letters for grp in rows_of[letter]):
                    sizes = " / ".join(str(n) for _, n in group[fused])
                    names = "/".join(letter for letter, _ in group[fused])
                    raise UnsupportedModelError(
                        f"{src.file}: {src.name} is quantized in {FP8_BLOCK}-row blocks that straddle its {names} "
                        f"parts ({sizes} rows a key-head group), which FreeToken reads apart; convert the BF16 "
                        "release of the model")
                sub = rows[::FP8_BLOCK]
                sub = [i // FP8_BLOCK for i in sub]
            else:
                raise UnsupportedModelError(f"{src.file}: {src.name} has {first} rows, expected {total} "
                                            f"({nk} key-head groups of {width}); check config.json's linear_* sizes")
            shape = list(src.shape) if sub is None else [len(sub)] + list(src.shape[1:])
            tensors[f"{prefix}{out}.{suffix}"] = Source(src.file, src.name, shape, src.dtype, src.st_dtype,
                                                          src.rows if sub is None else sub)

# DeepSeek-V4 as published (DeepSeek's own names, with or without a `model.` prefix; transformers'
# save_pretrained writes them back too) -> transformers' names, as its conversion mapping renames
# them; transformers' own names pass unchanged. The MTP heads (`mtp.*`) are skipped by SKIP.
DSV4_TOP = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
            "head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
            **{f"hc_head_{n}": f"model.hc_head.hc_{n}" for n in ("fn", "base", "scale")},
            **{f"hc_head.hc_{n}": f"model.hc_head.hc_{n}" for n in ("fn", "base", "scale")}}
DSV4_LAYER = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."))]
DSV4_LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)(\..*)$")


def deepseek_v4_name(name: str) -> str:
    """One DeepSeek-V4 tensor name -> transformers' (model.layers.N.self_attn..., lm_head...)."""
    top = name[len("model."):] if name.startswith("model.") else name
    if top in DSV4_TOP:
        return DSV4_TOP[top]
    m = DSV4_LAYER_NAME.match(name)
    if m is None:
        return name
    rest = m.group(2)
    for pattern, repl in DSV4_LAYER:
        rest = pattern.sub(repl, rest)
    return f"model.layers.{m.group(1)}{rest}"


def layers_past(ck: "Checkpoint", num_layers: int) -> tuple[list[int], int]:
    """Layers the checkpoint holds past num_hidden_layers, and how many tensors they have: the
    multi-token-prediction layers GLM-5 and DeepSeek-V3 publish as `model.layers.{N}.*` (N =
    num_hidden_layers), which serving does not use."""
    found = [int(m.group(1)) for m in map(LAYER.match, ck.tensors) if m and int(m.group(1)) >= num_layers]
    return sorted(set(found)), len(found)


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):  # MXFP4 scales as DeepSeek-V4 publishes them (GPT-OSS: U8)
    ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what FTW weights may be

# tensors that only quantized checkpoints have: FP8 block scales (weight_scale_inv), per-tensor
# scales (weight_scale, input_scale, k_scale, ...: ModelOpt, compressed-tensors), MXFP4 pairs
# (*_blocks, *_scales), GPTQ/AWQ (qweight, qzeros, scales, g_idx), bitsandbytes (absmax,
# quant_map, quant_state.*), compressed-tensors packing (weight_packed, weight_zero_point)
QUANT_LEAVES = {"qweight", "qzeros", "scales", "g_idx", "absmax", "quant_map", "SCB", "weight_packed",
                "weight_shape"}
QUANT_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_scales", "_blocks", "_zero_point")


# parameters whose names look like quantization scales but are not: DeepSeek-V4's hyper-connection
# head scale (model.hc_head.hc_scale)
NOT_QUANT = ("hc_head.hc_scale",)


def _v4_scale(t: dict, name: str, fp8_only: bool = False) -> bool:
    """DeepSeek-V4's `X.scale` beside an FP8 (or, unless fp8_only, packed-FP4) `X.weight`."""
    w = name[:-len("scale")] + "weight" if name.endswith(".scale") else None
    return w is not None and w in t and (t[w].st_dtype.startswith("F8") or (t[w].st_dtype == "I8" and not fp8_only))


def is_quant_tensor(name: str) -> bool:
    if name.endswith(NOT_QUANT):
        return False
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in QUANT_LEAVES or leaf.endswith(QUANT_SUFFIXES) or ".quant_state." in name
            or leaf.startswith("quant_state"))


def quant_config(path: str, raw: dict) -> tuple[str, dict] | None:
    """(where, settings) of the checkpoint's quantization, if it declares one: config.json's
    `quantization_config` (top level or the wrapper's text_config), or the hf_quant_config.json /
    quant_config.json that NVIDIA ModelOpt writes next to it."""
    for cfg in (raw, raw.get("text_config")):
        qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
        if qc:
            return "config.json", qc if isinstance(qc, dict) else {"quant_method": str(qc)}
    for fn in ("hf_quant_config.json", "quant_config.json"):
        full = os.path.join(path, fn)
        if os.path.exists(full):
            try:
                with open(full) as f:
                    qc = json.load(f)
            except (ValueError, UnicodeDecodeError) as e:  # a damaged copy: the format it declares is unknown
                raise FreeTokenError(f"{full} is not valid JSON ({e}); it says how the checkpoint is quantized: "
                                     "copy it again from the release") from None
            if not isinstance(qc, dict):
                raise FreeTokenError(f"{full} holds a JSON {type(qc).__name__}, not an object; it says how the "
                                     "checkpoint is quantized: copy it again from the release")
            return fn, qc
    return None


def describe_quant(qc: dict) -> str:
    """'fp8' (e4m3, 128x128 block scales) and the like, from a quantization config."""
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    method = (qc.get("quant_method") or qc.get("quant_algo") or inner.get("quant_algo")
              or ("modelopt" if "producer" in qc else "unknown"))
    method = str(method)
    m = method.lower()
    details = []
    if m == "fp8":
        details.append(str(qc.get("fmt") or "e4m3"))
        bs = qc.get("weight_block_size")
        if isinstance(bs, (list, tuple)) and len(bs) == 2:
            details.append(f"{bs[0]}x{bs[1]} block scales" + (" (ue8m0)" if qc.get("scale_fmt") == "ue8m0" else ""))
        else:
            details.append("per-tensor scales")
        if qc.get("expert_dtype") not in (None, "fp8"):
            details.append(f"{qc['expert_dtype']} experts")
    elif m == "mxfp4":
        details.append("4-bit blocks with shared e8m0 scales")
    elif m in ("gptq", "awq", "auto-round", "autoround", "hqq", "eetq", "quanto", "higgs", "vptq", "aqlm"):
        bits = qc.get("bits") or qc.get("w_bit") or qc.get("nbits")
        group = qc.get("group_size") or qc.get("q_group_size")
        if bits:
            details.append(f"{bits}-bit")
        if group:
            details.append(f"group size {group}")
    elif m == "bitsandbytes":
        if qc.get("load_in_4bit"):
            details.append(f"4-bit {qc.get('bnb_4bit_quant_type') or 'nf4'}")
        elif qc.get("load_in_8bit"):
            details.append("8-bit")
    elif m == "compressed-tensors":
        if qc.get("format"):
            details.append(str(qc["format"]))
    else:
        algo = inner.get("quant_algo") or qc.get("quant_algo")
        group = inner.get("group_size") or qc.get("group_size")
        if algo and str(algo) != method:
            details.append(str(algo))
        if group:
            details.append(f"group size {group}")
        if "producer" in qc and isinstance(qc["producer"], dict) and qc["producer"].get("name"):
            details.append(f"made by {qc['producer']['name']}")
    return f"'{method}'" + (f" ({', '.join(details)})" if details else "")


def _block_size(ck: "Checkpoint", inv: list[str]) -> tuple[int, int] | None:
    """The (power-of-two) block shape that maps a weight onto its scale_inv grid, from a weight
    big enough to span several blocks each way; None if none is."""
    for n in inv:
        weight = n[: -len("_scale_inv")] if n.endswith("_scale_inv") else n[: -len("scale")] + "weight"
        w, s = ck.tensors.get(weight), ck.tensors[n]
        if w is None or len(w.shape) != 2 or len(s.shape) != 2 or min(s.shape) < 2:
            continue
        block = []
        for size, count in zip(w.shape, s.shape):
            b = 1 << max(0, (-(-size // count) - 1).bit_length())  # power of two >= size / count
            if -(-size // b) != count:
                break
            block.append(b)
        if len(block) == 2:
            return block[0], block[1]
    return None


def describe_quant_tensors(ck: "Checkpoint") -> str | None:
    """Name the quantized format from the tensors alone (a checkpoint whose config does not say)."""
    names = [n for n in ck.tensors if is_quant_tensor(n) or _v4_scale(ck.tensors, n)]
    f8 = [n for n, s in ck.tensors.items() if s.st_dtype.startswith("F8")]
    if not names and not f8:
        return None
    inv = [n for n in names if n.endswith("weight_scale_inv") or _v4_scale(ck.tensors, n, fp8_only=True)]
    if inv:
        w = ck.tensors.get(inv[0][: -len("_scale_inv")])
        fmt = w.st_dtype.replace("F8_", "").lower() if w is not None else "fp8"
        block = _block_size(ck, inv)
        scales = f"{block[0]}x{block[1]} block scales" if block else "block scales"
        return f"'fp8' ({fmt}, {scales}; tensor {inv[0]})"
    if any(n.endswith("_blocks") for n in names):
        return f"'mxfp4' (4-bit blocks with shared scales; tensor {next(n for n in names if n.endswith('_blocks'))})"
    if any(n.endswith((".qweight", ".qzeros")) for n in names):
        return f"'gptq/awq' (packed integer weights; tensor {next(n for n in names if n.endswith(('.qweight', '.qzeros')))})"
    if f8:
        return f"'fp8' ({ck.tensors[f8[0]].st_dtype.replace('F8_', '').lower()} weights; tensor {f8[0]})"
    return f"quantization tensors (tensor {names[0]})"


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FreeTokenError(f"{path}: not a checkpoint directory")
    fn = os.path.join(path, "config.json")
    if not os.path.exists(fn):
        raise FreeTokenError(f"{path}: config.json is missing; this is not a transformers checkpoint")
    try:
        with open(fn) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise FreeTokenError(f"{fn}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise FreeTokenError(f"{fn}: expected a JSON object, found {type(cfg).__name__}; use the model's own config.json")
    return cfg


# ---------------------------------------------------------------- quantized formats read as published

QUANT_FORMATS = ("fp8_block", "mxfp4", "nvfp4")
FORMAT_NAMES = {"fp8_block": "FP8 e4m3, one scale per 128x128 block", "mxfp4": "e2m1, one e8m0 scale per 32",
                "nvfp4": "e2m1, one e4m3 scale per 16 and an fp32 scale per tensor", "dense": "unquantized"}
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # DeepSeek publishes F32 scales, Qwen BF16 (some F16)


@dataclass
class Weight:
    """One weight of a checkpoint and how it is stored. `name` is the weight as the model names
    it (`X.weight`, or a fused expert tensor such as `mlp.experts.gate_up_proj`); the other names
    are the checkpoint tensors that hold it (canonical names). `shape` is the float matrix's
    shape, leading dims included ([E, R, C] for a fused expert tensor)."""
    name: str
    format: str  # "dense" | "fp8_block" | "mxfp4" | "nvfp4"
    values: str
    shape: list[int]
    scale: str | None = None
    scale_2: str | None = None

    def parts(self) -> list[str]:
        return [n for n in (self.values, self.scale, self.scale_2) if n is not None]

    def components(self) -> list[str]:
        return ["values"] + (["scale"] if self.scale else []) + (["scale_2"] if self.scale_2 else [])


def _bad(ck: Checkpoint, name: str, what: str) -> FreeTokenError:
    s = ck.tensors.get(name)
    where = os.path.basename(s.file) if s is not None else ck.path
    return FreeTokenError(f"{ck.path}: tensor {name} (in {where}) {what}")


E8M0 = getattr(torch, "float8_e8m0fnu", None)


def e8m0_f32(t: torch.Tensor) -> torch.Tensor:
    """e8m0 scales (float8_e8m0fnu or their bytes) -> float32 2^(b - 127), exactly."""
    b = t.view(torch.uint8).to(torch.int32)
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127)


def block_scale_name(t: dict, name: str) -> str | None:
    """The block-scale tensor of weight `name`: `X.weight_scale_inv` (DeepSeek-V3's and Qwen's
    releases) or `X.scale` (DeepSeek-V4's: `w1.weight` beside `w1.scale`), the same multiplier."""
    if name + "_scale_inv" in t:
        return name + "_scale_inv"
    if name.endswith(".weight") and name[:-len("weight")] + "scale" in t:
        return name[:-len("weight")] + "scale"
    return None


def resolve_weight(ck: Checkpoint, name: str) -> Weight | None:
    t = ck.tensors
    if name in t:
        s = t[name]
        scale = block_scale_name(t, name)
        if scale is not None and s.st_dtype in ("I8", "U8"):
            return _fp4_e8m0_weight(ck, name, scale)
        if scale is not None:
            return _fp8_weight(ck, name, scale)
        if name + "_scale" in t and s.st_dtype == "U8":
            return _nvfp4_weight(ck, name)
        if s.st_dtype.startswith("F8") or s.st_dtype == "U8":
            scale = next((name + x for x in ("_scale", "_scale_2", "_scales") if name + x in t), None)
            raise _bad(ck, name, f"is {s.st_dtype} {s.shape}" + (
                f" with {scale} {t[scale].st_dtype} {t[scale].shape}, which is not a quantized layout "
                "FreeToken reads (FP8 128x128 block scales, MXFP4, NVFP4)" if scale else
                ", with no scale tensor beside it (no weight_scale_inv / weight_scale)"))
        return Weight(name, "dense", name, list(s.shape))
    if name + "_blocks" in t:
        return _mxfp4_weight(ck, name)
    return None


def _fp8_weight(ck: Checkpoint, name: str, scale: str) -> Weight:
    v, sc = ck.tensors[name], ck.tensors[scale]
    if v.st_dtype != "F8_E4M3":
        raise _bad(ck, name, f"is {v.st_dtype} with a block scale ({scale}); FP8 block weights are F8_E4M3")
    if len(v.shape) < 2 or len(sc.shape) != len(v.shape):
        raise _bad(ck, scale, f"has shape {sc.shape} for a weight of shape {v.shape}; "
                   "FP8 block scales are one per 128x128 block")
    grid = v.shape[:-2] + [-(-v.shape[-2] // FP8_BLOCK), -(-v.shape[-1] // FP8_BLOCK)]
    if sc.shape != grid:
        raise _bad(ck, scale, f"has shape {sc.shape}; a {v.shape} weight with 128x128 "
                   f"block scales has {grid} (other block sizes are not supported)")
    if sc.st_dtype not in FP8_SCALE_DTYPES:
        raise _bad(ck, scale, f"is {sc.st_dtype}; FP8 block scales are F32, BF16, F16 or F8_E8M0 (ue8m0)")
    return Weight(name, "fp8_block", name, list(v.shape), scale=scale)


def _fp4_e8m0_weight(ck: Checkpoint, name: str, scale: str) -> Weight:
    """DeepSeek-V4-Flash's FP4 experts: `w1.weight` I8 [R, C/2], two e2m1 codes a byte (low
    nibble first), and `w1.scale` F8_E8M0 [R, C/32], one scale per 32 values of a row (also read
    as `weight_scale_inv`): MXFP4's layout under V4's names."""
    v, sc = ck.tensors[name], ck.tensors[scale]
    if len(v.shape) != 2:
        raise _bad(ck, name, f"is {v.st_dtype} {v.shape}; packed FP4 weights are [rows, cols/2]")
    shape = [v.shape[0], v.shape[1] * 2]
    if sc.shape != [shape[0], shape[1] // MX_BLOCK] or shape[1] % MX_BLOCK or sc.st_dtype not in ("F8_E8M0", "U8"):
        raise _bad(ck, scale, f"is {sc.st_dtype} {sc.shape} for packed FP4 values {v.shape}; "
                   f"FP4 experts have one e8m0 scale per {MX_BLOCK} values of a row ({[shape[0], shape[1] // MX_BLOCK]})")
    return Weight(name, "mxfp4", name, shape, scale=scale)


def _nvfp4_weight(ck: Checkpoint, name: str) -> Weight:
    v, sc = ck.tensors[name], ck.tensors[name + "_scale"]
    s2 = ck.tensors.get(name + "_scale_2")
    if s2 is None:
        raise _bad(ck, name, "is U8 with a weight_scale but no weight_scale_2: not NVFP4 as ModelOpt "
                   "writes it (per-tensor weight_scale_2)")
    shape = v.shape[:-1] + [v.shape[-1] * 2] if v.shape else []
    if len(v.shape) != 2 or sc.shape != [shape[0], shape[1] // NV_BLOCK] or shape[1] % NV_BLOCK:
        raise _bad(ck, name + "_scale", f"has shape {sc.shape} for packed NVFP4 values {v.shape}; "
                   f"NVFP4 has one scale per {NV_BLOCK} values of a row")
    if sc.st_dtype != "F8_E4M3":
        raise _bad(ck, name + "_scale", f"is {sc.st_dtype}; NVFP4 block scales are F8_E4M3")
    n2 = 1
    for d in s2.shape:
        n2 *= d
    if s2.st_dtype != "F32" or n2 != 1:
        raise _bad(ck, name + "_scale_2", f"is {s2.st_dtype} {s2.shape}; NVFP4's second scale is one F32 "
                   "value per tensor")
    return Weight(name, "nvfp4", name, shape, scale=name + "_scale", scale_2=name + "_scale_2")


def _mxfp4_weight(ck: Checkpoint, name: str) -> Weight:
    b = ck.tensors[name + "_blocks"]
    sc = ck.tensors.get(name + "_scales")
    if sc is None:
        raise _bad(ck, name + "_blocks", f"has no {name}_scales beside it (MXFP4 needs both)")
    if b.st_dtype != "U8" or len(b.shape) < 3 or b.shape[-1] != MX_BLOCK // 2:
        raise _bad(ck, name + "_blocks", f"is {b.st_dtype} {b.shape}; MXFP4 blocks are U8 [..., rows, "
                   f"cols/{MX_BLOCK}, {MX_BLOCK // 2}]")
    if sc.shape != b.shape[:-1] or sc.st_dtype not in ("U8", "F8_E8M0"):
        raise _bad(ck, name + "_scales", f"is {sc.st_dtype} {sc.shape}; the scales of blocks {b.shape} are "
                   f"U8 (e8m0) {b.shape[:-1]}")
    shape = b.shape[:-2] + [b.shape[-2] * MX_BLOCK]
    return Weight(name, "mxfp4", name + "_blocks", shape, scale=name + "_scales")


@dataclass
class QuantScheme:
    """A quantization FreeToken reads: its format, where it was declared and how to name it."""
    format: str  # one of QUANT_FORMATS
    where: str  # "config.json", "hf_quant_config.json", ... or "tensors" (no config says it)
    description: str
    excluded: list[str]  # modules the config keeps unquantized (informational: tensors decide)
    expert_format: str | None = None  # the routed experts' format where it differs (DeepSeek-V4: mxfp4)

    @property
    def experts(self) -> str:
        return self.expert_format or self.format


def _excluded(qc: dict) -> list[str]:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    for d in (qc, inner):
        for key in ("modules_to_not_convert", "exclude_modules", "ignored_layers", "ignore"):
            v = d.get(key)
            if isinstance(v, list):
                return [str(x) for x in v]
    return []


def accepted_format(qc: dict) -> str | None:
    """The format of a declared quantization config if FreeToken reads it, else None."""
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else {}
    method = str(qc.get("quant_method") or "").lower()
    algo = str(qc.get("quant_algo") or inner.get("quant_algo") or "").upper()
    if method == "fp8":
        fmt = str(qc.get("fmt") or "e4m3").lower()
        bs = qc.get("weight_block_size")
        ok = isinstance(bs, (list, tuple)) and [int(x) for x in bs] == [FP8_BLOCK, FP8_BLOCK]
        return "fp8_block" if ok and fmt in ("e4m3", "float8_e4m3fn") else None
    if method == "mxfp4":
        return "mxfp4"
    if method in ("modelopt", "") and algo == "NVFP4" and (method or "producer" in qc or inner):
        group = inner.get("group_size", qc.get("group_size", NV_BLOCK))
        return "nvfp4" if group in (NV_BLOCK, str(NV_BLOCK)) else None
    return None


def _expert_format(qc: dict):
    """The routed experts' format where a config sets it apart (transformers' FineGrainedFP8Config
    `expert_dtype`: "fp4" for DeepSeek-V4's FP4-packed experts, MXFP4's layout) -> "mxfp4", None
    (the same as the rest), or False (an expert_dtype FreeToken does not read)."""
    dt = qc.get("expert_dtype")
    if dt is None or str(dt).lower() == "fp8":
        return None
    return "mxfp4" if str(dt).lower() == "fp4" else False


def refuse_quantized(src: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{src}: quantization {what} is not supported; FreeToken reads FP8 with 128x128 block scales, "
        "MXFP4 and NVFP4 (ModelOpt) checkpoints as published: convert one of those or the BF16 release")


def quant_scheme(src: str, raw: dict, ck: Checkpoint | None) -> QuantScheme | None:
    """The checkpoint's quantization if it is one FreeToken reads (None: not quantized); raises
    UnsupportedModelError naming any other. With ck=None only the configs are looked at (the
    refusal that needs no tensors comes first)."""
    q = quant_config(src, raw)
    if q is not None:
        where, qc = q
        fmt = accepted_format(qc)
        if fmt is None:
            raise refuse_quantized(src, f"{describe_quant(qc)}, declared in {where},")
        experts = _expert_format(qc)
        if experts is False:
            raise refuse_quantized(src, f"{describe_quant(qc)} with expert_dtype {qc.get('expert_dtype')!r}, "
                                        f"declared in {where},")
        return QuantScheme(fmt, where, f"declared in {where} as {describe_quant(qc)}", _excluded(qc), experts)
    if ck is None:
        return None
    names = [n for n in ck.tensors if is_quant_tensor(n)]
    f8 = [n for n, s in ck.tensors.items() if s.st_dtype.startswith("F8")]
    if not names and not f8:
        return None
    what = describe_quant_tensors(ck)
    inv = [n for n in names if n.endswith("weight_scale_inv")]
    fmt = None
    if inv:
        block = _block_size(ck, inv)
        fmt = "fp8_block" if block in (None, (FP8_BLOCK, FP8_BLOCK)) else None
    elif any(n.endswith("_blocks") for n in names):
        fmt = "mxfp4"
    elif any(n.endswith("weight_scale_2") for n in names) and any(
            ck.tensors[n].st_dtype == "U8" and n + "_scale" in ck.tensors for n in ck.tensors):
        fmt = "nvfp4"
    if fmt is None:
        raise refuse_quantized(src, what)
    return QuantScheme(fmt, "tensors", f"found in the tensors as {what} (no config declares it)", [])
