"""`ft convert`: transformers checkpoint directory -> one FTW file.

Streams tensor by tensor (experts row by row), so a checkpoint larger than RAM converts.
Weights keep the checkpoint's dtype and bits. Expert tensors, per-expert or fused, are merged
into two banks whose first dimension is the flat id ordinal * E + e.

Refused with one line, before anything is written: quantized checkpoints (their scales would be
dropped: FP8, MXFP4, GPTQ/AWQ, ...), weights that are not float32/bfloat16/float16, and a
tokenizer whose ids do not fit the model's embedding. Missing folders of the output path are
created (and removed again if the conversion fails).
"""
from __future__ import annotations

import os

import torch
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import FreeTokenError, UnsupportedModelError
from ..model.registry import model_class
from ..tokenizer import Tokenizer
from .ftw import DTYPE_NAMES, Entry
from .hf import WEIGHT_DTYPES, Checkpoint, describe_quant, describe_quant_tensors, quant_config, read_config
from .writer import FTWWriter

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json",
                  "special_tokens_map.json")
BANKS = ("experts.gate_up", "experts.down")


class ExpertReader:
    """Reads expert (layer, e) of one layer in bank layout: gate_up [2I, H], down [H, I]."""

    def __init__(self, ck: Checkpoint, cfg: ModelConfig, layer: int):
        self.ck, self.layer = ck, layer
        p = f"model.layers.{layer}.mlp.experts."
        self.fused_gu = p + "gate_up_proj" if p + "gate_up_proj" in ck.tensors else None
        self.fused_down = p + "down_proj" if p + "down_proj" in ck.tensors else None
        self.p, self.h, self.i = p, cfg.hidden_size, cfg.moe_intermediate_size
        e = cfg.num_experts
        want = {self.fused_gu: [e, 2 * self.i, self.h], self.fused_down: [e, self.h, self.i]}
        for name, shape in want.items():
            if name is None:
                continue
            got = ck.tensors[name].shape
            if got != shape and got != [shape[0], shape[2], shape[1]]:
                raise FreeTokenError(f"{ck.tensors[name].file}: {name} has shape {got}, expected {shape}")

    def names(self, e: int) -> list[str]:
        """Checkpoint tensors this expert needs (for the missing-tensor check)."""
        gu = [self.fused_gu] if self.fused_gu else [f"{self.p}{e}.gate_proj.weight", f"{self.p}{e}.up_proj.weight"]
        dn = [self.fused_down] if self.fused_down else [f"{self.p}{e}.down_proj.weight"]
        return gu + dn

    def _fused_row(self, name: str, e: int, rows: int) -> torch.Tensor:
        t = self.ck.get(name, e)
        return t if t.shape[0] == rows else t.t().contiguous()  # [E, H, 2I] layouts transpose

    def gate_up(self, e: int) -> torch.Tensor:
        if self.fused_gu:
            return self._fused_row(self.fused_gu, e, 2 * self.i)
        return torch.cat([self.ck.get(f"{self.p}{e}.gate_proj.weight"),
                          self.ck.get(f"{self.p}{e}.up_proj.weight")], dim=0)

    def down(self, e: int) -> torch.Tensor:
        if self.fused_down:
            return self._fused_row(self.fused_down, e, self.h)
        return self.ck.get(f"{self.p}{e}.down_proj.weight")


def _refuse_quantized(src: str, what: str) -> None:
    raise UnsupportedModelError(f"{src}: quantization {what} is not supported yet; "
                                "convert the BF16 release of the model")


def plan(src: str):
    """Read and check everything about a checkpoint without writing anything."""
    raw = read_config(src)
    q = quant_config(src, raw)
    if q is not None:
        _refuse_quantized(src, f"{describe_quant(q[1])}, declared in {q[0]},")
    cfg = ModelConfig.from_hf(raw, os.path.join(src, "config.json"))
    for fn in REQUIRED_FILES:
        if not os.path.exists(os.path.join(src, fn)):
            raise FreeTokenError(f"{src}: {fn} is missing; FTW embeds the tokenizer, copy it from the model's release")
    ck = Checkpoint(src)
    qt = describe_quant_tensors(ck)
    if qt is not None:
        _refuse_quantized(src, qt)
    dense = model_class(cfg.arch).expected_tensors(cfg)
    experts = [ExpertReader(ck, cfg, l) for l in cfg.moe_layers]
    needed = list(dict.fromkeys(dense + [n for r in experts for e in range(cfg.num_experts) for n in r.names(e)]))
    missing = [n for n in needed if n not in ck.tensors]
    if missing:
        raise FreeTokenError(f"{src}: checkpoint is missing {len(missing)} tensor(s), first {missing[0]}")
    for n in needed:
        s = ck.tensors[n]
        if s.dtype not in WEIGHT_DTYPES:
            raise UnsupportedModelError(
                f"{src}: tensor {n} is {s.st_dtype} (in {os.path.basename(s.file)}); FreeToken converts "
                "F32, BF16 and F16 weights only (quantized formats are not supported yet); "
                "convert the BF16 release of the model")
    with open(os.path.join(src, "tokenizer.json"), "rb") as f:
        tk = Tokenizer(f.read(), source=os.path.join(src, "tokenizer.json"))
    tk.check_fits(cfg.vocab_size, src)
    return raw, cfg, ck, dense, experts


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


def convert(src: str, out: str, progress: bool = True) -> str:
    raw, cfg, ck, dense, experts = plan(src)
    files = [fn for fn in REQUIRED_FILES + OPTIONAL_FILES if os.path.exists(os.path.join(src, fn))]
    blobs = {fn: open(os.path.join(src, fn), "rb").read() for fn in files}
    entries = [Entry("file/" + fn, "uint8", [len(b)]) for fn, b in blobs.items()]
    entries += [Entry(n, DTYPE_NAMES[ck.tensors[n].dtype], ck.tensors[n].shape) for n in dense]
    if experts:
        n_flat, i, h = cfg.num_flat_experts, cfg.moe_intermediate_size, cfg.hidden_size
        dt = ck.tensors[experts[0].names(0)[0]].dtype
        entries += [Entry(BANKS[0], DTYPE_NAMES[dt], [n_flat, 2 * i, h]),
                    Entry(BANKS[1], DTYPE_NAMES[dt], [n_flat, h, i])]
    meta = {"arch": cfg.arch, "model": cfg.to_dict(), "config": raw,
            "banks": {"gate_up": BANKS[0], "down": BANKS[1]} if experts else {},
            "source": os.path.basename(os.path.abspath(src))}
    if os.path.isdir(out):
        raise FreeTokenError(f"{out}: is a directory; give the output file name, e.g. {out}/model.ftw")
    created = _make_parent(out)
    try:
        _write(src, out, cfg, ck, dense, experts, entries, meta, blobs, progress)
    except OSError as e:
        _remove_created(created, out)
        raise FreeTokenError(f"{out}: cannot write ({e.strerror or e}); nothing was written") from None
    except BaseException:
        _remove_created(created, out)
        raise
    return out


def _write(src, out, cfg, ck, dense, experts, entries, meta, blobs, progress) -> None:
    i, h = cfg.moe_intermediate_size, cfg.hidden_size
    dt = ck.tensors[experts[0].names(0)[0]].dtype if experts else None
    banks = ((BANKS[0], "gate_up", [2 * i, h]), (BANKS[1], "down", [h, i])) if experts else ()
    total = sum(e.nbytes for e in entries)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="convert", disable=not progress)
    with FTWWriter(out, entries, meta) as w:
        for fn, b in blobs.items():
            w.write("file/" + fn, b)
            bar.update(len(b))
        for n in dense:
            t = ck.get(n)
            w.write(n, t)
            bar.update(t.numel() * t.element_size())
        for bank, part, shape in banks:
            for r in experts:
                for e in range(cfg.num_experts):
                    t = getattr(r, part)(e)
                    if t.dtype != dt or list(t.shape) != shape:
                        raise FreeTokenError(
                            f"{src}: layer {r.layer} expert {e} {part} is {t.dtype} {list(t.shape)}, "
                            f"expected {dt} {shape}")
                    w.write(bank, t)
                    bar.update(t.numel() * t.element_size())
    bar.close()
