"""The engine's sequence state: one paged KV pool shared by every sequence, plus per-slot
recurrent state, preallocated so that decode has static shapes.

Full-attention K/V live in pages of `page_size` tokens ([pages, kv_heads, page_size, head_dim]
per attention layer); a sequence's block table (one row per batch slot, on the device) lists
its pages in order, so key j of slot s sits in page block_table[s, j // P] at offset j % P.
Pages are handed out as tokens arrive (cache/pages.py) and a cached prefix is shared in place
by every sequence that reuses it. Latent-attention layers (model/mla.py) keep their compressed
KV and indexer keys in the same pages (kv_dims), so prefix reuse shares them alike. Gated
DeltaNet layers keep their causal-conv window and recurrent matrix per slot. Nothing here grows
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


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype) -> int:
    """Bytes of one KV page across every attention layer (K and V)."""
    el = torch.empty((), dtype=dtype).element_size()
    heads, kd, vd = kv_dims(cfg)
    return len(cfg.attention_layers) * heads * page_size * (kd + vd) * el


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
        heads, kd, vd = kv_dims(cfg)
        # empty, not zeros: host memory is committed only as pages are written, and no page is
        # read before it is written (lengths mask the rest)
        self.k = {i: torch.empty((kv_pages, heads, page_size, kd), device=device, dtype=dtype)
                  for i in cfg.attention_layers}
        self.v = {i: torch.empty((kv_pages, heads, page_size, vd), device=device, dtype=dtype)
                  for i in cfg.attention_layers}
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
