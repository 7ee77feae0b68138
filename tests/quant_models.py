"""Quantized checkpoints in the layouts the releases publish, from small random transformers
models (tests/hf_models.py): the exact tensor names, dtypes and shapes, and the config /
hf_quant_config.json, of

  fp8_block  Qwen/Qwen3-30B-A3B-FP8, Qwen/Qwen3.6-35B-A3B-FP8 (BF16 scales), DeepSeek-V3 (F32
             scales): `X.weight` F8_E4M3 + `X.weight_scale_inv` per 128x128 block, per-expert
             tensors, config.json quantization_config {quant_method: "fp8", fmt: "e4m3",
             activation_scheme: "dynamic", weight_block_size: [128, 128], modules_to_not_convert}
  mxfp4      openai/gpt-oss: `mlp.experts.gate_up_proj_blocks` U8 [E, 2I, H/32, 16] with gate and
             up rows interleaved + `_scales` U8 e8m0 [E, 2I, H/32], `down_proj_blocks` /
             `_scales`; or gate and up apart (`gate_proj_blocks`, `up_proj_blocks`); dense
             weights by the same naming rule (`X.weight_blocks`, `X.weight_scales`); config
             {quant_method: "mxfp4", modules_to_not_convert}
  nvfp4      nvidia/Qwen3-30B-A3B-FP4 (ModelOpt): `X.weight` U8 [R, C/2], `X.weight_scale`
             F8_E4M3 [R, C/16], `X.weight_scale_2` F32 [], `X.input_scale` F32 [], per-expert
             tensors; hf_quant_config.json {producer: modelopt, quantization: {quant_algo: "NVFP4",
             group_size: 16, exclude_modules}} and optionally config.json's quantization_config
             {quant_method: "modelopt", quant_algo: "NVFP4", ...}

The float weights are quantized with the formats' reference quantizers (scales from the block
maximum, e2m1 rounded to nearest-even with saturation at 6, e4m3 by torch's round-to-nearest);
unquantized tensors are written in BF16, as the releases do. `write()` also returns the float
weights the checkpoint stands for (quantized ones dequantized with freetoken's quant.py, the rest
the BF16 values), to load into the transformers model for the reference logits.
"""
from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import load_file, save_file

import hf_models
from freetoken.weights.quant import dequant_fp8_block, dequant_mxfp4, dequant_nvfp4, pack_fp4, quant_fp8_block  # noqa: F401
from freetoken.weights.quant import SMALL_PROJECTIONS, is_projection

FP8_MAX = 448.0
E2M1_MAX = 6.0
E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


# ----------------------------------------------------------------- reference quantizers

def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float -> e2m1 codes (uint8 0..15): nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even
    code (OCP MX v1.0 rounding), magnitudes above 6 saturate to 6; sign in bit 3."""
    a = x.abs().float().clamp(max=E2M1_MAX)
    lo = torch.bucketize(a, E2M1_MIDPOINTS, right=False)  # ties go down
    hi = torch.bucketize(a, E2M1_MIDPOINTS, right=True)  # ties go up
    code = torch.where(hi % 2 == 0, hi, lo)  # a tie takes the even code; otherwise lo == hi
    return (code | ((x < 0).to(torch.long) << 3)).to(torch.uint8)


def quant_mxfp4(w: torch.Tensor):
    """[R, C] -> (blocks uint8 [R, C/32, 16], scales uint8 e8m0 [R, C/32]): OCP MX shared scale
    2^(floor(log2(amax)) - 2) per 32 elements (2 = emax of e2m1), elements e2m1."""
    r, c = w.shape
    g = w.float().view(r, c // 32, 32)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    codes = e2m1_codes(g / torch.ldexp(torch.ones_like(exp), exp.int())[..., None])  # [R, C/32, 32]
    return pack_fp4(codes), (exp + 127).to(torch.uint8)


def quant_nvfp4(w: torch.Tensor, amax: float | None = None):
    """[R, C] -> (packed uint8 [R, C/2], scale e4m3 [R, C/16], scale_2 fp32 []): ModelOpt's NVFP4:
    scale_2 = amax / (6 * 448) per tensor, block scale = block amax / 6 / scale_2 in e4m3,
    elements e2m1 of w / (scale * scale_2). `amax`: the tensor amax to use (ModelOpt gives the
    gate and up projections of an expert one shared amax)."""
    r, c = w.shape
    amax = float(w.abs().max()) if amax is None else amax
    s2 = torch.tensor(amax / (E2M1_MAX * FP8_MAX) if amax > 0 else 1.0, dtype=torch.float32)
    g = w.float().view(r, c // 16, 16)
    bs = (g.abs().amax(-1) / E2M1_MAX / s2).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = bs.float()[..., None] * s2
    codes = e2m1_codes(torch.where(denom > 0, g / denom, torch.zeros_like(g)))
    return pack_fp4(codes).view(r, c // 2), bs, s2


# ----------------------------------------------------------------- which tensors are quantized

def quantizable(name: str, t: torch.Tensor, scope: str) -> bool:
    """Weights the releases quantize: routed experts; with scope "all" also the Linear weights of
    attention, DeltaNet's qkv/z/out projections, shared and dense MLPs. Kept unquantized as the
    releases keep them: embeddings, lm_head, norms, routers (`mlp.gate`), shared_expert_gate,
    DeltaNet's in_proj_a / in_proj_b (in_proj_ba) / conv1d / A_log / dt_bias."""
    if t.dim() != 2 or not is_projection(name):
        return False
    if ".mlp.experts." in name:
        return True
    if scope != "all":
        return False
    return not name.endswith(SMALL_PROJECTIONS)


def excluded_modules(names, scope: str) -> list[str]:
    """modules_to_not_convert / exclude_modules as the releases list them (module names)."""
    mods = {"lm_head"}
    for n in names:
        if n.endswith(".mlp.gate.weight") or n.endswith("shared_expert_gate.weight"):
            mods.add(n[: -len(".weight")])
        elif scope != "all" and is_projection(n) and ".mlp.experts." not in n:
            mods.add(n[: -len(".weight")])
        elif n.endswith(SMALL_PROJECTIONS):
            mods.add(n[: -len(".weight")])
    return sorted(mods)


# ----------------------------------------------------------------- the checkpoint writer

def _dequant(fmt: str, parts: dict) -> torch.Tensor:
    if fmt == "fp8_block":
        return dequant_fp8_block(parts["values"], parts["scale"])
    if fmt == "mxfp4":
        return dequant_mxfp4(parts["values"].flatten(-2), parts["scale"])
    return dequant_nvfp4(parts["values"], parts["scale"], parts["scale_2"])


def _quantize(fmt: str, w: torch.Tensor, scale_dtype, amax=None) -> dict:
    if fmt == "fp8_block":
        q, s = quant_fp8_block(w, scale_dtype)
        return {"values": q, "scale": s}
    if fmt == "mxfp4":
        b, s = quant_mxfp4(w)
        return {"values": b, "scale": s}
    q, s, s2 = quant_nvfp4(w, amax)
    return {"values": q, "scale": s, "scale_2": s2}


def _published(fmt: str, name: str, parts: dict) -> dict:
    """The tensors of one quantized weight `name` (X.weight) under the release's names."""
    if fmt == "fp8_block":
        return {name: parts["values"], name + "_scale_inv": parts["scale"]}
    if fmt == "mxfp4":
        return {name + "_blocks": parts["values"], name + "_scales": parts["scale"]}
    base = name[: -len("weight")]
    return {name: parts["values"], base + "weight_scale": parts["scale"], base + "weight_scale_2": parts["scale_2"],
            base + "input_scale": torch.tensor(0.0123, dtype=torch.float32)}


def write(model, d: str, fmt: str, scope: str = "experts", *, scale_dtype=torch.float32,
          mx_gate_up: str = "fused", nv_shared_amax: bool = True, nv_config_json: bool = False,
          layout: str = "plain"):
    """Write `model` as a quantized checkpoint in folder d. fmt: fp8_block | mxfp4 | nvfp4;
    scope: "experts" (routed experts only) or "all" (also the dense Linear weights);
    scale_dtype: fp8 scale_inv dtype (float32 as DeepSeek, bfloat16 as Qwen); mx_gate_up:
    "fused" (GPT-OSS interleaved gate_up_proj_blocks) or "separate" (gate_proj_blocks,
    up_proj_blocks); nv_shared_amax: gate and up of an expert share scale_2 (ModelOpt);
    nv_config_json: also write config.json's quantization_config (newer ModelOpt);
    layout: "plain" (one file), "sharded" (index + shards), "wrapper" (multimodal names).

    Returns (d, published tensors {name: tensor}, float weights for the transformers model
    {state-dict name: float32 tensor})."""
    os.makedirs(d, exist_ok=True)
    model.save_pretrained(d)
    hf_models.write_tokenizer(d, model.config.vocab_size)
    fn = os.path.join(d, "model.safetensors")
    src = load_file(fn)  # the published float layout: experts one tensor per expert
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(d, f))
    cfg = model.config
    L, E = cfg.num_hidden_layers, cfg.num_experts
    out, ref = {}, {}
    quantized = {n for n, t in src.items() if quantizable(n, t, scope)}
    for n, t in src.items():
        if n not in quantized:
            out[n] = t.to(torch.bfloat16)
            ref[n] = out[n].float()
    amax = {}
    if fmt == "nvfp4" and nv_shared_amax:  # one amax for an expert's gate and up (ModelOpt's fusion)
        for n in quantized:
            if n.endswith("gate_proj.weight"):
                u = n.replace("gate_proj", "up_proj")
                a = max(float(src[n].abs().max()), float(src[u].abs().max()))
                amax[n] = amax[u] = a
    parts = {n: _quantize(fmt, src[n].float(), scale_dtype, amax.get(n)) for n in sorted(quantized)}
    for n, p in parts.items():
        ref[n] = _dequant(fmt, p)
    mx_fused = fmt == "mxfp4"
    for n, p in parts.items():
        if mx_fused and ".mlp.experts." in n:
            continue  # below: fused per layer as GPT-OSS publishes them
        out.update(_published(fmt, n, p))
    if mx_fused:
        for l in range(L):
            pre = f"model.layers.{l}.mlp.experts."
            if pre + "0.gate_proj.weight" not in parts:
                continue
            g = [parts[f"{pre}{e}.gate_proj.weight"] for e in range(E)]
            u = [parts[f"{pre}{e}.up_proj.weight"] for e in range(E)]
            dn = [parts[f"{pre}{e}.down_proj.weight"] for e in range(E)]
            if mx_gate_up == "fused":  # GPT-OSS: row 2j gate j, row 2j+1 up j
                for k in ("values", "scale"):
                    gu = torch.stack([torch.stack([a[k], b[k]], 1).flatten(0, 1) for a, b in zip(g, u)])
                    out[pre + ("gate_up_proj_blocks" if k == "values" else "gate_up_proj_scales")] = gu
            else:
                for proj, ps in (("gate_proj", g), ("up_proj", u)):
                    out[pre + proj + "_blocks"] = torch.stack([p["values"] for p in ps])
                    out[pre + proj + "_scales"] = torch.stack([p["scale"] for p in ps])
            out[pre + "down_proj_blocks"] = torch.stack([p["values"] for p in dn])
            out[pre + "down_proj_scales"] = torch.stack([p["scale"] for p in dn])
    excluded = excluded_modules(src, scope)
    qc = _quant_config(fmt, excluded)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cj = json.load(f)
    if fmt == "nvfp4":
        with open(os.path.join(d, "hf_quant_config.json"), "w") as f:
            json.dump(qc, f, indent=2)
        if nv_config_json:
            cj["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                         "ignore": excluded, "producer": qc["producer"],
                                         "kv_cache_quant_algo": None}
    else:
        cj["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cj, f, indent=2)
    if layout == "wrapper":
        out = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in out.items()}
        out["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).to(torch.bfloat16)
        qc_top = cj.get("quantization_config")
        hf_models._wrap_config(d)
        if qc_top is not None:  # Qwen3.6-FP8: quantization_config at the top of the wrapper's config
            with open(cfg_path) as f:
                w = json.load(f)
            w["text_config"].pop("quantization_config", None)
            w["quantization_config"] = qc_top
            with open(cfg_path, "w") as f:
                json.dump(w, f, indent=2)
    if layout == "sharded":
        _save_sharded(out, d)
    else:
        save_file(out, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    ref = hf_models.fuse_experts(ref, L, E)  # the in-memory names (fused experts)
    return d, out, ref


def _quant_config(fmt: str, excluded: list[str]) -> dict:
    if fmt == "fp8_block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128], "modules_to_not_convert": excluded}
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": excluded}
    return {"producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": excluded}}


def _save_sharded(tensors: dict, d: str, shards: int = 3) -> None:
    names = sorted(tensors)
    wm = {}
    for i in range(shards):
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, os.path.join(d, fn), metadata={"format": "pt"})
        wm.update({n: fn for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def reference_model(model, ref: dict):
    """A copy of the transformers model holding the weights the checkpoint stands for."""
    m = copy.deepcopy(model)
    missing, unexpected = m.load_state_dict(ref, strict=False)
    assert not unexpected, unexpected
    assert all("rotary" in k or "inv_freq" in k for k in missing), missing
    return m.eval()


# ----------------------------------------------------------------- DeepSeek-V4 as published

# the Linear weights DeepSeek-V4 ships in FP8 (DeepSeek's names; transformers keeps the attention
# compressor and indexer projections BF16, `_keep_in_fp32_modules` of DeepseekV4ForCausalLM);
# wo_a, a block-diagonal grouped Linear, is left in BF16 here
DSV4_FP8 = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_b.weight",
            ".ffn.shared_experts.w1.weight", ".ffn.shared_experts.w2.weight", ".ffn.shared_experts.w3.weight")


def quant_fp8_ue8m0(w: torch.Tensor, block: int = 128):
    """[R, C] -> (e4m3 [R, C], F8_E8M0 [ceil(R/b), ceil(C/b)]): one power-of-two scale per block,
    the smallest 2^k >= amax / 448 (scale_fmt "ue8m0"), w = q * scale."""
    r, c = w.shape
    gr, gc = -(-r // block), -(-c // block)
    pad = torch.zeros(gr * block, gc * block)
    pad[:r, :c] = w.float()
    amax = pad.view(gr, block, gc, block).abs().amax(dim=(1, 3))
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / FP8_MAX)), torch.zeros_like(amax)).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(exp), exp.int())
    s = scale.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp4_e8m0(w: torch.Tensor):
    """[R, C] -> (I8 [R, C/2]: e2m1 codes two a byte, low nibble first; F8_E8M0 [R, C/32]): the
    routed experts of DeepSeek-V4 (expert_dtype "fp4"), MXFP4's values and scales."""
    r, c = w.shape
    blocks, scales = quant_mxfp4(w)  # [R, C/32, 16], [R, C/32]
    return blocks.reshape(r, c // 2).view(torch.int8), scales.view(torch.float8_e8m0fnu)


def write_deepseek_v4(model, d: str, variant: str = "flash", scale_name: str = "scale",
                      declare_experts: bool = True) -> tuple[str, str]:
    """`model` (DeepseekV4ForCausalLM) as DeepSeek publishes V4, DeepSeek's tensor names, the
    attention and shared-expert Linears FP8 e4m3 with 128x128 block scales beside each weight as
    `X.scale` (scale_name "weight_scale_inv": the V3 naming):
      flash  DeepSeek-V4-Flash: ue8m0 block scales (F8_E8M0, powers of two), the routed experts
             FP4 (`experts.E.w{1,2,3}.weight` I8 [R, C/2] + `.scale` F8_E8M0 [R, C/32]);
             quantization_config {quant_method: "fp8", fmt: "e4m3", weight_block_size: [128,
             128], scale_fmt: "ue8m0"} and, with declare_experts, expert_dtype: "fp4"
      base   DeepSeek-V4-Flash-Base: FP8 everywhere, experts too, F32 block scales
    In d/ref the same checkpoint with the weights it stands for (dequantized, float32), for
    transformers. Returns (checkpoint folder, reference folder)."""
    from freetoken.weights.hf import e8m0_f32
    q, ref = os.path.join(d, variant), os.path.join(d, "ref")
    hf_models.save(model, q)
    hf_models.save(model, ref)
    fn = os.path.join(q, "model.safetensors")
    src = load_file(fn)
    out, deq = {}, {}
    def scale_of(n):
        return n + "_scale_inv" if scale_name == "weight_scale_inv" else n[:-len("weight")] + "scale"
    for n, t in src.items():
        expert = t.dim() == 2 and ".ffn.experts." in n and n.endswith(".weight")
        if expert and variant == "flash":
            v, s = quant_fp4_e8m0(t.float())
            out[n], out[scale_of(n)] = v, s
            deq[n] = dequant_mxfp4(v.view(torch.uint8), s.view(torch.uint8))
        elif expert or (t.dim() == 2 and n.endswith(DSV4_FP8)):
            if variant == "flash":
                v, s = quant_fp8_ue8m0(t.float())
                deq[n] = dequant_fp8_block(v, e8m0_f32(s))
            else:
                v, s = quant_fp8_block(t.float(), torch.float32)
                deq[n] = dequant_fp8_block(v, s)
            out[n], out[scale_of(n)] = v, s
        else:
            out[n] = t
            deq[n] = t.float()
    save_file(out, fn, metadata={"format": "pt"})
    save_file(deq, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(q, "config.json")
    with open(cfg_path) as f:
        cj = json.load(f)
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    if variant == "flash":
        qc["scale_fmt"] = "ue8m0"
        if declare_experts:
            qc["expert_dtype"] = "fp4"
    cj["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cj, f, indent=2)
    return q, ref
