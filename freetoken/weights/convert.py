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
one of the formats above, and a tokenizer whose ids do not fit the model's embedding. Missing
folders of the output path are created (and removed again if the conversion fails).
"""
from __future__ import annotations

import json
import os

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import FreeTokenError, UnsupportedModelError, notice
from ..model.registry import model_class
from ..tokenizer import Tokenizer
from .ftw import DTYPE_NAMES, Entry
from .hf import (FORMAT_NAMES, WEIGHT_DTYPES, Checkpoint, QuantScheme, Weight, deepseek_v4_name, layers_past,
                 quant_scheme, read_config)
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
        self.fused_gu = self._fused("gate_up_proj", [self.e, 2 * self.i, self.h])
        self.fused_g = self.fused_u = None
        if self.fused_gu is None:
            g = self._fused("gate_proj", [self.e, self.i, self.h])
            u = self._fused("up_proj", [self.e, self.i, self.h])
            if g is not None and u is not None:
                self.fused_g, self.fused_u = g, u
        elif self.fused_gu.format == "mxfp4" or self.gptoss:
            self.perm = interleave
        self.fused_down = self._fused("down_proj", [self.e, self.h, self.i])
        # biases (cfg.expert_bias): GPT-OSS's gate_up bias interleaves as its rows do
        self.bias_names = {"gate_up": p + "gate_up_proj_bias", "down": p + "down_proj_bias"} if cfg.expert_bias else {}
        self.bias_perm = interleave if self.gptoss else None

    def _fused(self, leaf: str, shape: list[int]) -> Weight | None:
        w = self.ck.weight(self.p + leaf)
        if w is None:
            return None
        if w.format not in ("dense", "mxfp4"):
            raise FreeTokenError(
                f"{self.ck.path}: {w.values} holds every expert of a layer in {w.format}; FreeToken reads "
                f"{w.format} experts one tensor per expert, as the releases publish them")
        got = w.shape
        transposed = [shape[0], shape[2], shape[1]]
        if self.gptoss and w.format == "dense":
            ok, want = got == transposed, transposed  # [E, in, out], whatever the sizes
        else:
            ok, want = got == shape or (w.format == "dense" and got == transposed), shape
        if not ok:
            s = self.ck.tensors[w.values]
            raise FreeTokenError(f"{s.file}: {w.values} has shape {s.shape}, expected "
                                 f"{want if w.format == 'dense' else shape[:2] + [shape[2] // MX_BLOCK, MX_BLOCK // 2]}")
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
    ck = Checkpoint(src, deepseek_v4_name if cfg.arch == "deepseek_v4" else None)
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
    missing = [n for n, w in dense_w.items() if w is None] + [n for w, n in expert_w if w is None]
    if missing:
        raise FreeTokenError(f"{src}: checkpoint is missing {len(missing)} tensor(s), first {missing[0]}")
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
    if os.path.isdir(out):
        raise FreeTokenError(f"{out}: is a directory; give the output file name, e.g. {out}/model.ftw")
    created = _make_parent(out)
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
