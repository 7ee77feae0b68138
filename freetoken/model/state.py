"""The engine's sequence state: one paged KV pool shared by every sequence, plus per-slot
recurrent state, preallocated so that decode has static shapes.

Full-attention K/V live in pages of `page_size` tokens ([pages, kv_heads, page_size, head_dim]
per attention layer); a sequence's block table (one row per batch slot, on the device) lists
its pages in order, so key j of slot s sits in page block_table[s, j // P] at offset j % P.
Pages are handed out as tokens arrive (cache/pages.py) and a cached prefix is shared in place
by every sequence that reuses it. Latent-attention layers (model/mla.py) keep their compressed
KV and indexer keys in the same pages (kv_dims), so prefix reuse shares them alike; DeepSeek-V4
layers (model/csa.py) their sliding keys, compressor projections and compressed entries, a row
width per layer (dsv4_row). Gated DeltaNet layers keep their causal-conv window and recurrent
matrix per slot. Nothing here grows
during decode: a CUDA graph can capture a step over these buffers, and one graph serves every
length (lengths are device data).
"""
from __future__ import annotations

import torch

from ..cache.pages import SCRATCH, PageAllocator
from ..config import ModelConfig


def kv_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(heads, K width, V width) of one token in one layer's pages. Softmax attention: its K and V
    heads. Latent attention (model/mla.py): one row, the K pages holding the compressed KV
    [latent | rotated key] and the V pages the DSA indexer's key."""
    if cfg.kv_lora_rank:
        return 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.index_head_dim
    return cfg.num_kv_heads, cfg.head_dim, cfg.head_dim


def dsv4_row(cfg: ModelConfig, layer: int) -> dict[str, slice]:
    """DeepSeek-V4 (model/csa.py): the parts of one token's row in a layer's K pages. kv: the
    sliding window's key (= value). A compressed layer adds the compressor's per-token projections
    (ckv, and cgate with its position bias; two series for CSA's overlapping windows) and centry,
    the compressed entry of the window this token closes (read only where it closes one); a CSA
    layer the same for its indexer (ikv, igate, ientry). Memory heavy (the projections stay for
    the whole context) but every cache in pages: prefix reuse shares them as they are."""
    hd, idx, kind = cfg.head_dim, cfg.index_head_dim, cfg.compressed_attention[layer]
    parts = [("kv", hd)]
    if kind != "none":
        o = 2 if kind == "csa" else 1  # CSA's windows overlap: two series per token
        parts += [("ckv", o * hd), ("cgate", o * hd), ("centry", hd)]
    if kind == "csa":
        parts += [("ikv", 2 * idx), ("igate", 2 * idx), ("ientry", idx)]
    out, at = {}, 0
    for name, width in parts:
        out[name] = slice(at, at + width)
        at += width
    return out


def layer_kv_dims(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """kv_dims of one layer: DeepSeek-V4's rows differ per layer (dsv4_row, no V pages)."""
    if cfg.compressed_attention:
        return 1, max(part.stop for part in dsv4_row(cfg, layer).values()), 0
    return kv_dims(cfg)


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one KV page across every attention layer (K and V)."""
    el = torch.empty((), dtype=dtype).element_size()
    dims = [layer_kv_dims(cfg, i) for i in cfg.attention_layers]
    return sum(h * page_size * (kd + vd) * el for h, kd, vd in dims)


def slot_state_bytes(cfg: ModelConfig, dtype) -> int:
    """Recurrent state of one slot (every linear-attention layer: conv window + fp32 matrix)."""
    el = torch.empty((), dtype=dtype).element_size()
    conv = cfg.conv_dim * max(cfg.linear_conv_kernel_dim - 1, 0) * el
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.linear_layers) * (conv + rec)


def state_bytes(cfg: ModelConfig, slots: int, max_len: int, dtype, page_size: int = 16) -> int:
    """What a DecodeState with every slot's full context in its own pages allocates."""
    pages = slots * -(-max_len // page_size) + 1
    return pages * kv_page_bytes(cfg, page_size, dtype) + slots * slot_state_bytes(cfg, dtype)


class DecodeState:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype,
                 kv_pages: int | None = None, page_size: int = 16):
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.width = -(-max_len // page_size)  # block-table entries per slot
        kv_pages = kv_pages or slots * self.width + 1
        self.pages = PageAllocator(kv_pages, page_size)
        dims = {i: layer_kv_dims(cfg, i) for i in cfg.attention_layers}  # (heads, K width, V width)
        # empty, not zeros: host memory is committed only as pages are written, and no page is
        # read before it is written (lengths mask the rest)
        self.k = {i: torch.empty((kv_pages, h, page_size, kd), device=device, dtype=dtype)
                  for i, (h, kd, _) in dims.items()}
        self.v = {i: torch.empty((kv_pages, h, page_size, vd), device=device, dtype=dtype)
                  for i, (h, _, vd) in dims.items()}
        for t in (*self.k.values(), *self.v.values()):
            t[SCRATCH].zero_()
        self.block_table = torch.full((slots, self.width), SCRATCH, dtype=torch.int32, device=device)
        conv_shape = (slots, cfg.conv_dim, max(cfg.linear_conv_kernel_dim - 1, 0))
        rec_shape = (slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        self.conv = {i: torch.zeros(conv_shape, device=device, dtype=dtype) for i in cfg.linear_layers}
        # the delta-rule state accumulates over the whole context: keep it in fp32
        self.rec = {i: torch.zeros(rec_shape, device=device, dtype=torch.float32)
                    for i in cfg.linear_layers}

    def reset(self, slot: int) -> None:
        """Forget a sequence's recurrent state (its K/V need no clearing: lengths mask them)."""
        for t in list(self.conv.values()) + list(self.rec.values()):
            t[slot].zero_()

    def set_pages(self, slot: int, pages: list[int], start: int = 0) -> None:
        """Block-table row of `slot` from entry `start` on (entries past the pages: scratch)."""
        row = torch.full((self.width - start,), SCRATCH, dtype=torch.int32)
        row[:len(pages) - start] = torch.tensor(pages[start:], dtype=torch.int32)
        self.block_table[slot, start:].copy_(row, non_blocking=True)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared page before a sequence writes into it."""
        for t in (*self.k.values(), *self.v.values()):
            t[dst].copy_(t[src])

    def reserve(self, slot: int, tokens: int) -> list[int]:
        """Give `slot` fresh pages for `tokens` positions (single-sequence use: tests, bench,
        one-off generation); the serving loop grows block tables itself as tokens arrive."""
        pages = self.pages.alloc(self.pages.pages_for(tokens))
        self.set_pages(slot, pages)
        return pages

    def nbytes(self) -> int:
        ts = [*self.k.values(), *self.v.values(), *self.conv.values(), *self.rec.values()]
        return sum(t.numel() * t.element_size() for t in ts)
