"""The engine's sequence state: one paged KV pool shared by every sequence, plus per-slot
recurrent state, preallocated so that decode has static shapes.

Full-attention K/V live in pages of `page_size` tokens ([pages, kv_heads, page_size, head_dim]
per attention layer); a sequence's block table (one row per batch slot, on the device) lists
its pages in order, so key j of slot s sits in page block_table[s, j // P] at offset j % P.
Pages are handed out as tokens arrive (cache/pages.py) and a cached prefix is shared in place
by every sequence that reuses it. Latent-attention layers (model/mla.py) keep their compressed
KV and indexer keys in the same pages (kv_dims), so prefix reuse shares them alike; DeepSeek-V4
layers (model/csa.py) their compressed entries (and, with --sliding-kv full, their sliding keys
and compressor projections too), a row width per layer (dsv4_row, dsv4_split). Gated DeltaNet
layers keep their causal-conv window and recurrent matrix per slot. Nothing here grows during
decode: a CUDA graph can capture a step over these buffers, and one graph serves every length
(lengths are device data).

Rows read only near their own position (window_layers: the K/V of sliding-window softmax
layers, GPT-OSS's and Qwen3's with use_sliding_window; DeepSeek-V4's sliding keys and
compressor projections) live in rings: each slot owns a ring of R pages per such layer, outside
the page pool, and their block table (`ring_table`) maps logical page b of slot s to ring page
b % R, statically (one table for the life of the state: decode graphs read it as they read
block_table). Nothing reads a row more than ring_reach positions back, so once R pages cover
every row one prefill piece can read (its own and the reach before them), writing position j
into page (j // P) % R only ever overwrites rows no one will look at again: the same kernels
serve both layouts. Pieces longer than that are split by the layer (`ring_chunk`). A ring costs
R pages a slot, however long the context (GPT-OSS at 128 keys and 2048-token chunks: 137 pages
of 16 against 8192 for a 131k context). The prefix cache cannot share a ring in place: it
checkpoints the last reach of its rows at anchors, as it checkpoints DeltaNet states
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
    layer the same for its indexer (ikv, igate, ientry). With --sliding-kv full every part stays
    in the pool for the whole context; with rings (dsv4_split) only the entries do."""
    hd, idx, kind = cfg.head_dim, cfg.index_head_dim, cfg.compressed_attention[layer]
    parts = [("kv", hd)]
    if kind != "none":
        o = 2 if kind == "csa" else 1  # CSA's windows overlap: two series per token
        parts += [("ckv", o * hd), ("cgate", o * hd), ("centry", hd)]
    if kind == "csa":
        parts += [("ikv", 2 * idx), ("igate", 2 * idx), ("ientry", idx)]
    return _packed(parts)


def _packed(parts) -> dict[str, slice]:
    out, at = {}, 0
    for name, width in parts:
        out[name] = slice(at, at + width)
        at += width
    return out


RING_PARTS = ("kv", "ckv", "cgate", "ikv", "igate")  # V4's per-token parts read only near their position


def dsv4_split(cfg: ModelConfig, layer: int) -> tuple[dict[str, slice], dict[str, slice]]:
    """A V4 layer kept in a ring: (its ring row, its pool row). The sliding key and the compressor
    projections are read only within ring_reach of their position (by the window's queries and by
    the entry their window closes into): the ring. The entries are read at every closing
    position of the context: the pool, shared by the prefix cache as K/V pages are."""
    full = dsv4_row(cfg, layer)
    widths = {name: sl.stop - sl.start for name, sl in full.items()}
    return (_packed([(n, w) for n, w in widths.items() if n in RING_PARTS]),
            _packed([(n, w) for n, w in widths.items() if n not in RING_PARTS]))


def _width(row: dict[str, slice]) -> int:
    return max((sl.stop for sl in row.values()), default=0)


def layer_kv_dims(cfg: ModelConfig, layer: int, ring=()) -> tuple[int, int, int] | None:
    """(heads, K width, V width) of one token of one layer in the pool's pages: kv_dims, or
    DeepSeek-V4's row (no V pages); for a layer in `ring` what stays in the pool (V4: its entries;
    softmax attention: nothing, None)."""
    if cfg.compressed_attention:
        return 1, _width(dsv4_split(cfg, layer)[1] if layer in ring else dsv4_row(cfg, layer)), 0
    return None if layer in ring else kv_dims(cfg)


def entry_stride(cfg: ModelConfig, layer: int, page_size: int, ring=()) -> int:
    """Positions per pool row of a layer: 1 (a row per token), or for a V4 ring layer whose pool
    holds only entries, its compress rate m when windows and pages nest (P % m == 0 or m % P ==
    0): a page then keeps one row per window that can close in it (ceil(P / m) rows; HCA's 128
    at pages of 16: 1 row a page; CSA's 4: 4 rows), entry w at row ((w m + m - 1) % P) // m of
    the page of its closing position, so the pages the prefix cache shares carry it as before."""
    if not (cfg.compressed_attention and layer in ring):
        return 1
    m = {"csa": cfg.compress_rate_csa, "hca": cfg.compress_rate_hca}.get(cfg.compressed_attention[layer], 0)
    return m if m and (page_size % m == 0 or m % page_size == 0) else 1


def pool_rows(cfg: ModelConfig, layer: int, page_size: int, ring=()) -> int:
    """Rows one page of the pool holds for a layer (page_size, or fewer: entry_stride)."""
    return -(-page_size // entry_stride(cfg, layer, page_size, ring))


def ring_dims(cfg: ModelConfig, layer: int) -> tuple[int, int, int]:
    """(heads, K width, V width) of one token of a ring layer in its ring: the K/V of softmax
    attention, V4's ring row (no V)."""
    if cfg.compressed_attention:
        return 1, _width(dsv4_split(cfg, layer)[0]), 0
    return cfg.num_kv_heads, cfg.head_dim, cfg.head_dim


SLIDING_KV = ("window", "full")  # --sliding-kv: a ring of the window's pages, or every page in the pool
RING_CHUNK = 512  # tokens a prefill piece may write into a ring when the caller gives no chunk size


def window_layers(cfg: ModelConfig) -> list[int]:
    """Layers whose per-token K/V is read only near its position, so a per-slot ring can hold it:
    sliding-window softmax attention (model/attention.py) and every DeepSeek-V4 layer (model/csa.py:
    its sliding keys and compressor projections; its entries stay in the pool). Not latent
    attention (its keys are read over the whole context)."""
    if cfg.kv_lora_rank:
        return []
    if cfg.compressed_attention:
        return list(cfg.attention_layers)
    return [i for i in cfg.attention_layers if cfg.window(i)]


def ring_reach(cfg: ModelConfig) -> int:
    """Positions a token reads of ring rows, its own included: the sliding window, and on V4 the
    tokens an entry averages (2m for CSA's overlapping windows, m for HCA's)."""
    reach = cfg.sliding_window or 1
    for kind in set(cfg.compressed_attention):
        reach = max(reach, {"csa": 2 * cfg.compress_rate_csa, "hca": cfg.compress_rate_hca}.get(kind, 1))
    return reach


def ring_pages(cfg: ModelConfig, page_size: int, chunk: int) -> int:
    """Pages of one slot's ring: every row a piece of `chunk` tokens can read (the reach before
    it and its own) on distinct pages, wherever the piece starts."""
    return -(-(chunk + ring_reach(cfg) - 1) // page_size) + 1


def ring_layers(cfg: ModelConfig, max_len: int, page_size: int, chunk: int, sliding: str = "window") -> list[int]:
    """The layers a DecodeState keeps in rings: none with sliding "full", or when a ring would
    not be smaller than a whole context's pages."""
    if sliding not in SLIDING_KV:
        raise ValueError(f"sliding must be one of {SLIDING_KV}, got {sliding!r}")
    layers = window_layers(cfg)
    if sliding == "full" or not layers or ring_pages(cfg, page_size, chunk) >= -(-max_len // page_size):
        return []
    return layers


def _el(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes(dims, el: int) -> int:
    return sum(h * (kd + vd) * el for h, kd, vd in dims if h)


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype, ring=()) -> int:
    """Bytes of one page of the pool across every attention layer (K and V); the layers in
    `ring` count what they keep in the pool (V4's entries, pool_rows of them a page; nothing
    for softmax attention)."""
    el, total = _el(dtype), 0
    for i in cfg.attention_layers:
        dims = layer_kv_dims(cfg, i, ring)
        if dims is not None:
            total += pool_rows(cfg, i, page_size, ring) * _bytes([dims], el)
    return total


def _ring_token_bytes(cfg: ModelConfig, ring, dtype) -> int:
    return _bytes([ring_dims(cfg, i) for i in ring], _el(dtype))


def slot_state_bytes(cfg: ModelConfig, dtype, ring=(), page_size: int = 16, chunk: int = RING_CHUNK) -> int:
    """State one slot owns outside the page pool: every linear-attention layer's conv window and
    fp32 matrix, and the rings of the `ring` layers."""
    el = _el(dtype)
    conv = cfg.conv_dim * max(cfg.linear_conv_kernel_dim - 1, 0) * el
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    rings = ring_pages(cfg, page_size, chunk) * page_size * _ring_token_bytes(cfg, ring, dtype) if ring else 0
    return len(cfg.linear_layers) * (conv + rec) + rings


def window_parts(cfg: ModelConfig, layer: int) -> list[tuple[str, slice | None, int, int, int]]:
    """What a checkpoint keeps of a ring layer, part by part: (the part: "k"/"v" for softmax
    attention, a V4 ring-row part; its columns in the ring row or None; the positions before a
    continuation that it reads; heads; width). Each part keeps only its own reach: V4's sliding
    key the window, its compressor projections the tokens one entry averages (CSA's 2m = 8
    against the window's 128), so a V4-Flash checkpoint is about half what the longest reach
    for every part would cost."""
    if cfg.compressed_attention:
        kind, csa = cfg.compressed_attention[layer], 2 * cfg.compress_rate_csa

        def reach(name):
            if name == "kv":
                return cfg.sliding_window
            return csa if name in ("ikv", "igate") or kind == "csa" else cfg.compress_rate_hca
        return [(n, sl, reach(n) - 1, 1, sl.stop - sl.start) for n, sl in dsv4_split(cfg, layer)[0].items()]
    h, kd, vd = ring_dims(cfg, layer)
    return [("k", None, cfg.sliding_window - 1, h, kd), ("v", None, cfg.sliding_window - 1, h, vd)]


def checkpoint_state_bytes(cfg: ModelConfig, dtype, ring=()) -> int:
    """One prefix-cache checkpoint: the recurrent state of every linear-attention layer and what
    a continuation reads of every ring layer's rows (window_parts)."""
    el = _el(dtype)
    window = sum(n * h * w * el for layer in ring for _, _, n, h, w in window_parts(cfg, layer))
    return slot_state_bytes(cfg, dtype) + window


def ring_scratch_bytes(cfg: ModelConfig, ring, page_size: int, dtype) -> int:
    """The rings' page 0 (idle decode rows write there), shared by every slot."""
    return page_size * _ring_token_bytes(cfg, ring, dtype)


def state_bytes(cfg: ModelConfig, slots: int, max_len: int, dtype, page_size: int = 16,
                chunk: int = RING_CHUNK, sliding: str = "window") -> int:
    """What a DecodeState with every slot's full context in its own pages allocates."""
    ring = ring_layers(cfg, max_len, page_size, chunk, sliding)
    pages = slots * -(-max_len // page_size) + 1
    return pages * kv_page_bytes(cfg, page_size, dtype, ring) + ring_scratch_bytes(cfg, ring, page_size, dtype) + \
        slots * slot_state_bytes(cfg, dtype, ring, page_size, chunk)


class DecodeState:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype,
                 kv_pages: int | None = None, page_size: int = 16, chunk: int = RING_CHUNK,
                 sliding: str = "window", ring: list[int] | None = None):
        """chunk: the longest prefill piece callers usually write (the rings are sized for it;
        longer pieces are split); sliding: "window" keeps window layers in rings where that is
        smaller, "full" every layer in the pool (ring_layers); ring: the ring layers as a memory
        plan chose them (overrides sliding)."""
        self.slots, self.max_len, self.page_size = slots, max_len, page_size
        self.width = -(-max_len // page_size)  # block-table entries per slot
        kv_pages = kv_pages or slots * self.width + 1
        self.pages = PageAllocator(kv_pages, page_size)
        self.ring = list(ring) if ring is not None else ring_layers(cfg, max_len, page_size, chunk, sliding)
        self.window_parts = {i: window_parts(cfg, i) for i in self.ring}  # what a checkpoint keeps of each
        self.reach = ring_reach(cfg) if self.ring else None
        r = self.ring_len = ring_pages(cfg, page_size, chunk) if self.ring else 0
        # the longest piece a ring takes at once: its rows and the reach before them on r pages
        self.ring_chunk = (r - 1) * page_size - self.reach + 1 if self.ring else None
        v4 = bool(cfg.compressed_attention)

        # empty, not zeros: host memory is committed only as pages are written, and no page is
        # read before it is written (lengths mask the rest). Rings are small and zeroed: the
        # torch references gather rows outside the window (masked), never NaN then
        def pool(dims, i, rows=page_size):
            return torch.empty((kv_pages, dims[0], rows, dims[i]), device=device, dtype=dtype)

        def ring_buf(dims, i):
            return torch.zeros((1 + slots * r, dims[0], page_size, dims[i]), device=device, dtype=dtype)
        # k, v: where each attention layer's K (V) lives: the pool's pages, or (softmax attention
        # in a ring) its ring; kr: a V4 ring layer's ring rows (its entries stay in k, pooled)
        self.k, self.v, self.kr = {}, {}, {}
        for i in cfg.attention_layers:
            pooled = layer_kv_dims(cfg, i, self.ring)
            if pooled is None:
                dims = ring_dims(cfg, i)
                self.k[i], self.v[i] = ring_buf(dims, 1), ring_buf(dims, 2)
            else:
                rows = pool_rows(cfg, i, page_size, self.ring)
                self.k[i], self.v[i] = pool(pooled, 1, rows), pool(pooled, 2, rows)
                if i in self.ring:
                    self.kr[i] = ring_buf(ring_dims(cfg, i), 1)
        self.pooled = [i for i in cfg.attention_layers if layer_kv_dims(cfg, i, self.ring) is not None]
        for t in (*self.k.values(), *self.v.values()):
            t[SCRATCH].zero_()
        # V4: each part of a layer's rows -> (in its ring, the slice of the row, positions a row)
        self.parts = {}
        if v4:
            for i in cfg.attention_layers:
                rr, pr = dsv4_split(cfg, i) if i in self.ring else ({}, dsv4_row(cfg, i))
                stride = entry_stride(cfg, i, page_size, self.ring)
                self.parts[i] = {**{n: (True, sl, 1) for n, sl in rr.items()},
                                 **{n: (False, sl, stride) for n, sl in pr.items()}}
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
        """The block table softmax attention layer `layer` reads through: [slots, width]."""
        return self.ring_table if layer in self.ring else self.block_table

    def part(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor, slice, int]:
        """A V4 row part (dsv4_row's names): (the pages holding it [pages, rows, width], the block
        table to them [slots, width], its columns, positions per row: position p's row is
        (p % P) // that in page table[p // P]; entry_stride)."""
        in_ring, sl, stride = self.parts[layer][name]
        if in_ring:
            return self.kr[layer][:, 0], self.ring_table, sl, 1
        return self.k[layer][:, 0], self.block_table, sl, stride

    def copy_page(self, src: int, dst: int) -> None:
        """Copy-on-write of a shared page before a sequence writes into it (the pool's tensors)."""
        for i in self.pooled:
            self.k[i][dst].copy_(self.k[i][src])
            self.v[i][dst].copy_(self.v[i][src])

    def ring_tensors(self, layer: int) -> list[torch.Tensor]:
        """The ring buffers of a ring layer: K and V (softmax attention) or V4's ring rows."""
        return [self.kr[layer]] if layer in self.kr else [self.k[layer], self.v[layer]]

    def _window_at(self, slot: int, p: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ring pages and offsets of positions p-n .. p-1 of `slot` (clamped at 0: the
        duplicates of position 0 carry its row)."""
        pos = torch.arange(p - n, p, device=self.ring_table.device).clamp(min=0)  # [n]
        return self.ring_table[slot, pos // self.page_size].long(), pos % self.page_size

    def _parts(self, layer: int):
        """(ring tensor, columns or None, positions) of each part a checkpoint keeps (window_parts)."""
        return [(self.kr[layer] if layer in self.kr else self.k[layer] if name != "v" else self.v[layer], cols, n)
                for name, cols, n, _, _ in self.window_parts[layer]]

    def read_window(self, layer: int, slot: int, p: int) -> list[torch.Tensor]:
        """What a ring layer's continuation after p tokens reads of the rows before p, part by
        part: [n, heads, width] each (a prefix-cache checkpoint of that state; window_parts)."""
        out = []
        for t, cols, n in self._parts(layer):
            page, off = self._window_at(slot, p, n)
            rows = t[page, :, off]  # [n, heads, row]
            out.append(rows if cols is None else rows[..., cols])
        return out

    def write_window(self, layer: int, slot: int, p: int, rows: list[torch.Tensor]) -> None:
        """Put back what read_window(layer, ., p) gave into `slot`'s ring."""
        for (t, cols, n), x in zip(self._parts(layer), rows):
            page, off = self._window_at(slot, p, n)
            if cols is None:
                t[page, :, off] = x
            else:
                t[page, :, off, cols] = x

    def reserve(self, slot: int, tokens: int) -> list[int]:
        """Give `slot` fresh pages for `tokens` positions (single-sequence use: tests, bench,
        one-off generation); the serving loop grows block tables itself as tokens arrive."""
        pages = self.pages.alloc(self.pages.pages_for(tokens))
        self.set_pages(slot, pages)
        return pages

    def nbytes(self) -> int:
        ts = [*self.k.values(), *self.v.values(), *self.kr.values(), *self.conv.values(), *self.rec.values()]
        return sum(t.numel() * t.element_size() for t in ts)
