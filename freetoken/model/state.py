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

Sliding-window softmax layers (GPT-OSS's, Qwen3's with use_sliding_window) keep only what a
window can see: each slot owns a ring of R pages per such layer, outside the page pool, and
their block table (`ring_table`) maps logical page b of slot s to ring page b % R, statically
(one table for the life of the state: decode graphs read it as they read block_table). The
attention kernels never read a key before the window, so once R pages cover every key one
prefill piece can see (its own tokens and the window before them), writing position j into
page (j // P) % R only ever overwrites keys no query will look at again: the same kernels
serve both layouts. Pieces longer than that are split by the attention layer (`ring_chunk`).
A ring costs R pages a slot, however long the context (GPT-OSS at 128 keys and 2048-token
chunks: 137 pages of 16 against 8192 for a 131k context). The prefix cache cannot share a ring
in place: it checkpoints a window's keys at anchors, as it checkpoints DeltaNet states
(read_window / write_window).
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


SLIDING_KV = ("window", "full")  # --sliding-kv: a ring of the window's pages, or every page in the pool
RING_CHUNK = 512  # tokens a prefill piece may write into a ring when the caller gives no chunk size


def window_layers(cfg: ModelConfig) -> list[int]:
    """Sliding-window layers whose K/V can live in per-slot rings: model/attention.py's softmax
    layers (DeepSeek-V4's rows and latent attention read their pages their own way)."""
    if cfg.compressed_attention or cfg.kv_lora_rank:
        return []
    return [i for i in cfg.attention_layers if cfg.window(i)]


def ring_pages(cfg: ModelConfig, page_size: int, chunk: int) -> int:
    """Pages of one slot's ring: every key a piece of `chunk` tokens can see (the window's
    before it and its own) on distinct pages, wherever the piece starts."""
    return -(-(chunk + cfg.sliding_window - 1) // page_size) + 1


def ring_layers(cfg: ModelConfig, max_len: int, page_size: int, chunk: int, sliding: str = "window") -> list[int]:
    """The layers a DecodeState keeps in rings: none with sliding "full", or when a ring would
    not be smaller than a whole context's pages."""
    if sliding not in SLIDING_KV:
        raise ValueError(f"sliding must be one of {SLIDING_KV}, got {sliding!r}")
    layers = window_layers(cfg)
    if sliding == "full" or not layers or ring_pages(cfg, page_size, chunk) >= -(-max_len // page_size):
        return []
    return layers


def _token_bytes(cfg: ModelConfig, layers, el: int) -> int:
    return sum(h * (kd + vd) * el for h, kd, vd in (layer_kv_dims(cfg, i) for i in layers))


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype, ring: list[int] | tuple = ()) -> int:
    """Bytes of one page of the pool across every attention layer (K and V) but the `ring` ones."""
    el = torch.empty((), dtype=dtype).element_size()
    return page_size * _token_bytes(cfg, [i for i in cfg.attention_layers if i not in ring], el)


def slot_state_bytes(cfg: ModelConfig, dtype, ring: list[int] | tuple = (), page_size: int = 16,
                     chunk: int = RING_CHUNK) -> int:
    """State one slot owns outside the page pool: every linear-attention layer's conv window and
    fp32 matrix, and the rings of the `ring` layers."""
    el = torch.empty((), dtype=dtype).element_size()
    conv = cfg.conv_dim * max(cfg.linear_conv_kernel_dim - 1, 0) * el
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    rings = ring_pages(cfg, page_size, chunk) * page_size * _token_bytes(cfg, ring, el) if ring else 0
    return len(cfg.linear_layers) * (conv + rec) + rings


def checkpoint_state_bytes(cfg: ModelConfig, dtype, ring: list[int] | tuple = ()) -> int:
    """One prefix-cache checkpoint: the recurrent state of every linear-attention layer and the
    last window's keys and values of every ring layer (window - 1 positions)."""
    el = torch.empty((), dtype=dtype).element_size()
    window = (cfg.sliding_window - 1) * _token_bytes(cfg, ring, el) if ring else 0
    return slot_state_bytes(cfg, dtype) + window


def state_bytes(cfg: ModelConfig, slots: int, max_len: int, dtype, page_size: int = 16,
                chunk: int = RING_CHUNK, sliding: str = "window") -> int:
    """What a DecodeState with every slot's full context in its own pages allocates."""
    ring = ring_layers(cfg, max_len, page_size, chunk, sliding)
    pages = slots * -(-max_len // page_size) + 1
    scratch = page_size * _token_bytes(cfg, ring, torch.empty((), dtype=dtype).element_size())  # the rings' page 0
    return pages * kv_page_bytes(cfg, page_size, dtype, ring) + scratch + \
        slots * slot_state_bytes(cfg, dtype, ring, page_size, chunk)


class DecodeState:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype,
                 kv_pages: int | None = None, page_size: int = 16, chunk: int = RING_CHUNK,
                 sliding: str = "window", ring: list[int] | None = None):
        """chunk: the longest prefill piece callers usually write (the rings are sized for it;
        longer pieces are split); sliding: "window" keeps sliding-window layers in rings where
        that is smaller, "full" every layer in the pool (ring_layers); ring: the ring layers as
        a memory plan chose them (overrides sliding)."""
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.width = -(-max_len // page_size)  # block-table entries per slot
        kv_pages = kv_pages or slots * self.width + 1
        self.pages = PageAllocator(kv_pages, page_size)
        self.ring = list(ring) if ring is not None else ring_layers(cfg, max_len, page_size, chunk, sliding)
        self.window = cfg.sliding_window if self.ring else None
        r = self.ring_len = ring_pages(cfg, page_size, chunk) if self.ring else 0
        # the longest piece a ring takes at once: its keys and the window before them on r pages
        self.ring_chunk = (r - 1) * page_size - self.window + 1 if self.ring else None
        dims = {i: layer_kv_dims(cfg, i) for i in cfg.attention_layers}  # (heads, K width, V width)
        # empty, not zeros: host memory is committed only as pages are written, and no page is
        # read before it is written (lengths mask the rest). Rings are small and zeroed: the
        # torch references gather keys outside the window (masked), never NaN then
        n = {i: 1 + slots * r if i in self.ring else kv_pages for i in dims}
        make = {i: torch.zeros if i in self.ring else torch.empty for i in dims}
        self.k = {i: make[i]((n[i], h, page_size, kd), device=device, dtype=dtype) for i, (h, kd, _) in dims.items()}
        self.v = {i: make[i]((n[i], h, page_size, vd), device=device, dtype=dtype) for i, (h, _, vd) in dims.items()}
        for t in (*self.k.values(), *self.v.values()):
            t[SCRATCH].zero_()
        self.block_table = torch.full((slots, self.width), SCRATCH, dtype=torch.int32, device=device)
        # slot s's logical page b -> its ring page 1 + s*r + b % r (page 0: idle rows' scratch)
        b = torch.arange(self.width)
        self.ring_table = (1 + torch.arange(slots)[:, None] * max(r, 1) + b[None] % max(r, 1)).to(
            device, torch.int32) if self.ring else None  # [slots, width]
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

    def table(self, layer: int) -> torch.Tensor:
        """The block table attention layer `layer` reads through: [slots, width]."""
        return self.ring_table if layer in self.ring else self.block_table

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared page before a sequence writes into it (pool layers only)."""
        for i in self.k:
            if i not in self.ring:
                self.k[i][dst].copy_(self.k[i][src])
                self.v[i][dst].copy_(self.v[i][src])

    def _window_at(self, slot: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring pages and offsets of positions p-window+1 .. p-1 of `slot` (clamped at 0: the
        duplicates of position 0 carry its key)."""
        pos = torch.arange(p - self.window + 1, p, device=self.ring_table.device).clamp(min=0)  # [window - 1]
        return self.ring_table[slot, pos // self.page_size].long(), pos % self.page_size

    def read_window(self, layer: int, slot: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A ring layer's keys and values that a query at position p can see before its own:
        K, V [window - 1, heads, dim] (a prefix-cache checkpoint of the state after p tokens)."""
        page, off = self._window_at(slot, p)
        return self.k[layer][page, :, off], self.v[layer][page, :, off]

    def write_window(self, layer: int, slot: int, p: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put back what read_window(layer, ., p) gave into `slot`'s ring."""
        page, off = self._window_at(slot, p)
        self.k[layer][page, :, off] = k
        self.v[layer][page, :, off] = v

    def reserve(self, slot: int, tokens: int) -> list[int]:
        """Give `slot` fresh pages for `tokens` positions (single-sequence use: tests, bench,
        one-off generation); the serving loop grows block tables itself as tokens arrive."""
        pages = self.pages.alloc(self.pages.pages_for(tokens))
        self.set_pages(slot, pages)
        return pages

    def nbytes(self) -> int:
        ts = [*self.k.values(), *self.v.values(), *self.conv.values(), *self.rec.values()]
        return sum(t.numel() * t.element_size() for t in ts)
