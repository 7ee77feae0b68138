"""Multi-head latent attention (MLA) with DeepSeek's sparse-attention indexer (DSA), as GLM-5
defines it (transformers GlmMoeDsaAttention and GlmMoeDsaIndexer).

Each token leaves one row per layer in the paged pool (model/state.py kv_dims): the K pages hold
[c | k_rope], the RMS-normed KV latent (kv_lora_rank) and the rotated key every head shares
(qk_rope_head_dim); the V pages hold the indexer's key (index_head_dim). Attention runs in the
absorbed form: each head's no-RoPE query is taken into the latent space through its slice of
kv_b_proj's key half, so every head scores the cached rows directly (a multi-query attention of
head dim kv_lora_rank + qk_rope_head_dim whose values are c), and the value half of kv_b_proj
brings the weighted latent back to v_head_dim. The same function as the reference's expanded
keys and values, in another summation order, and no per-head K/V is ever materialised.

The indexer: q_i from the query latent, k_j from the hidden state (LayerNorm), the first
qk_rope_head_dim dims of both rotated; score(i, j) = sum_h w_h(x_i) relu(q_ih . k_j / sqrt(d)).
A query attends only to its index_topk best-scoring keys among those it may see (all of them
while it sees no more than that). A "shared" layer (cfg.indexer_types) reuses the selection the
last "full" layer made in the same forward.

RoPE here rotates adjacent pairs (x0, x1), (x2, x3), ... and writes them out de-interleaved
(first members, then second members), as the reference does for queries and keys alike, so dot
products are those of the interleaved rotation.

Decode is static-shape under CUDA-graph capture (the whole block table is read; lengths are
device data); eagerly it reads only the pages the longest row needs. Only the top-k rows of the
latent cache are gathered once the context passes index_topk; the indexer keys are read whole,
as DSA does. These are torch references: a paged sparse-MLA kernel is later work.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.pages import SCRATCH
from .layers import FusedLinear, Rope, rms_norm
from .linear import linear
from .state import DecodeState

LATENT_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm: the reference builds them with its default eps
INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm
MAX_SCORES = 1 << 24  # fp32 scores live at once in a prefill block of queries (64 MiB)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, rd] with rotary pairs adjacent; cos, sin [N, rd/2] -> [N, heads, rd] rotated,
    laid out [first members | second members]."""
    a, b = x[..., 0::2], x[..., 1::2]  # [N, heads, rd/2]
    c, s = cos[:, None], sin[:, None]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def index_scores(iq: torch.Tensor, hw: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's scores in fp32. iq [N, ih, d]; hw [N, ih] fp32 (head weights); keys [S, d]
    (one sequence's, every query) or [N, S, d] (one row each) -> [N, S]."""
    s = torch.relu(torch.matmul(iq.float(), keys.float().transpose(-1, -2)) * scale)  # [N, ih, S]
    return torch.matmul(hw[:, None, :], s)[:, 0]  # [N, S]


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, scale: float, kvr: int) -> torch.Tensor:
    """q [N, nh, D]; keys [K, D] (shared by the N queries) or [N, K, D]; sel [N, K] bool (what each
    query attends to) -> latent output [N, nh, kvr] (the values are the keys' first kvr dims).
    A row that selects nothing (an idle decode row) gives zeros."""
    s = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [N, nh, K]
    s = s.masked_fill(~sel[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where(sel.any(-1)[:, None, None], p, 0.0).to(q.dtype)  # all -inf -> NaN -> 0
    return torch.matmul(p, keys[..., :kvr])  # [N, nh, kvr]


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


class LatentAttention:
    """One layer's MLA and indexer, parameters by checkpoint name. share: the model's dict through
    which a "full" layer hands its selection to the "shared" layers after it, keyed by the part
    of the forward (a decode step, or one prefill chunk); None there: no selection (the context
    fits index_topk). The model empties it at the start of each forward."""

    def __init__(self, cfg, w: dict, layer: int, rope: Rope, share: dict):
        p = f"model.layers.{layer}.self_attn."
        self.layer, self.rope, self.share = layer, rope, share
        self.nh, self.nope, self.rd, self.vd = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kvr, self.topk = cfg.kv_lora_rank, cfg.index_topk
        self.scale = (self.nope + self.rd) ** -0.5
        self.full = cfg.indexer_types[layer] == "full"
        self.ih, self.id = cfg.index_n_heads, cfg.index_head_dim
        # everything that reads the hidden state in one GEMM: query latent, KV latent with the
        # rope key, the indexer's key
        names = ["q_a_proj", "kv_a_proj_with_mqa"] + (["indexer.wk"] if self.full else [])
        self.a_proj = FusedLinear([w[p + n + ".weight"] for n in names], [w.get(p + n + ".bias") for n in names])
        self.q_norm, self.kv_norm = w[p + "q_a_layernorm.weight"], w[p + "kv_a_layernorm.weight"]
        self.q_b = w[p + "q_b_proj.weight"]  # [nh * (nope + rd), q_lora]
        kv_b = w[p + "kv_b_proj.weight"].view(self.nh, self.nope + self.vd, self.kvr)
        self.w_uk = kv_b[:, :self.nope]  # [nh, nope, kvr]: no-RoPE query -> latent space
        self.w_uv = kv_b[:, self.nope:]  # [nh, vd, kvr]: weighted latent -> value
        self.wo, self.bo = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")
        if self.full:
            i = p + "indexer."
            self.iscale = self.id ** -0.5
            self.iq_b = w[i + "wq_b.weight"]  # [ih * id, q_lora]
            self.ik_norm = (w[i + "k_norm.weight"], w[i + "k_norm.bias"])  # [id] each
            self.iw = w[i + "weights_proj.weight"].float()  # [ih, H]: fp32, as the reference keeps it

    def _project(self, x: torch.Tensor, pos: torch.Tensor):
        """x [N, H], positions [N] -> q [N, nh, kvr + rd] (absorbed no-RoPE part | rotated part),
        row [N, kvr + rd] (what the K pages keep), and for a full layer the indexer's (query
        [N, ih, id], key [N, id], head weights [N, ih] fp32), else None."""
        n = x.shape[0]
        parts = self.a_proj(x)
        half = self.rd // 2
        cos, sin = self.rope.cos[pos, :half], self.rope.sin[pos, :half]  # [N, rd/2]
        ql = rms_norm(parts[0], self.q_norm, LATENT_NORM_EPS, False)  # [N, q_lora]
        q_nope, q_rope = linear(ql, self.q_b).view(n, self.nh, self.nope + self.rd).split([self.nope, self.rd], -1)
        q_abs = torch.einsum("nhd,hdc->nhc", q_nope, self.w_uk)  # [N, nh, kvr]
        q = torch.cat([q_abs, rope_pairs(q_rope, cos, sin)], dim=-1)  # [N, nh, kvr + rd]
        c, kr = parts[1].split([self.kvr, self.rd], dim=-1)
        row = torch.cat([rms_norm(c, self.kv_norm, LATENT_NORM_EPS, False),
                         rope_pairs(kr[:, None], cos, sin)[:, 0]], dim=-1)  # [N, kvr + rd]
        if not self.full:
            return q, row, None
        iq = linear(ql, self.iq_b).view(n, self.ih, self.id)  # the indexer rotates its first rd dims
        iq = torch.cat([rope_pairs(iq[..., :self.rd], cos, sin), iq[..., self.rd:]], dim=-1)  # [N, ih, id]
        ik = F.layer_norm(parts[2], (self.id,), *self.ik_norm, INDEXER_NORM_EPS)  # [N, id]
        ik = torch.cat([rope_pairs(ik[:, None, :self.rd], cos, sin)[:, 0], ik[:, self.rd:]], dim=-1)
        hw = F.linear(x.float(), self.iw) * self.ih ** -0.5  # [N, ih]
        return q, row, (iq, ik, hw)

    def _output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [N, nh, kvr] -> [N, H]"""
        o = torch.einsum("nhc,hvc->nhv", o_lat, self.w_uv)  # [N, nh, vd]
        return linear(o.reshape(o.shape[0], self.nh * self.vd), self.wo, self.bo)

    def prefill(self, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture=None) -> torch.Tensor:
        """One chunk of one sequence. x: [T, H] at positions start..start+T-1, whose pages are
        already in the slot's block table. (capture is for recurrent layers: this layer's state
        is its pages, which the prefix cache shares as they are.)"""
        t = x.shape[0]
        s_len = start + t
        pos = torch.arange(start, s_len, device=x.device)
        q, row, ind = self._project(x, pos)
        table = st.block_table[slot]  # [W]
        page, off = table[pos // st.page_size].long(), pos % st.page_size
        st.k[self.layer][page, 0, off] = row
        if ind is not None:
            st.v[self.layer][page, 0, off] = ind[1]
        ids = table[:-(-s_len // st.page_size)].long()
        rows = st.k[self.layer][ids].reshape(-1, row.shape[-1])[:s_len]  # [S, kvr + rd]: keys 0..S-1
        key = ("prefill", slot, start)  # a forward may hold several chunks of one sequence
        select = s_len > self.topk  # else every visible key is selected
        if select and ind is not None:
            ikeys = st.v[self.layer][ids].reshape(-1, self.id)[:s_len]  # [S, id]
        if self.full:
            self.share[key] = None
        tops = []
        j = torch.arange(s_len, device=x.device)
        step = max(1, MAX_SCORES // (max(self.nh, self.ih) * s_len))
        out = torch.empty(t, self.nh, self.kvr, device=x.device, dtype=x.dtype)
        for a in range(0, t, step):
            b = min(t, a + step)
            sel = j[None] <= pos[a:b, None]  # [Tb, S] causal
            if select:
                if ind is not None:
                    sc = index_scores(ind[0][a:b], ind[2][a:b], ikeys, self.iscale).masked_fill(~sel, float("-inf"))
                    top = sc.topk(self.topk, dim=-1).indices  # [Tb, k]
                    tops.append(top)
                else:
                    top = self.share[key][a:b]
                sel = sel & torch.zeros_like(sel).scatter_(1, top, True)
            out[a:b] = sparse_attention(q[a:b], rows, sel, self.scale, self.kvr)
        if self.full and select:
            self.share[key] = torch.cat(tops)  # [T, k]
        return self._output(out)

    def decode(self, x: torch.Tensor, st: DecodeState, pos: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B slots. x: [B, H], pos: [B] (device data). active: [B] bool;
        rows that are not decoding write to the scratch page and attend to nothing."""
        b, ps = x.shape[0], st.page_size
        q, row, ind = self._project(x, pos)
        table = st.block_table[:b]  # [B, W]
        page = table.gather(1, (pos // ps)[:, None])[:, 0]  # [B]
        off, lens = pos % ps, pos + 1
        if active is not None:
            page = torch.where(active, page, SCRATCH)
            off = torch.where(active, off, 0)
            lens = torch.where(active, lens, 0)
        page = page.long()
        st.k[self.layer][page, 0, off] = row
        if ind is not None:
            st.v[self.layer][page, 0, off] = ind[1]
        # the pages to read: the whole table when captured (static), else what the longest row needs
        w = table.shape[1] if _capturing(x) else max(1, min(table.shape[1], -(-int(lens.max()) // ps)))
        ids = table[:, :w].long()  # [B, w]
        length = w * ps
        sel = torch.arange(length, device=x.device)[None] < lens[:, None]  # [B, L]
        if length > self.topk:  # a static choice: the same for every step of one graph
            if ind is not None:
                ikeys = st.v[self.layer][ids].reshape(b, length, -1)  # [B, L, id]
                sc = index_scores(ind[0], ind[2], ikeys, self.iscale).masked_fill(~sel, float("-inf"))
                top = sc.topk(self.topk, dim=-1).indices  # [B, k] positions
                self.share["decode"] = top
            else:
                top = self.share["decode"]
            keys = st.k[self.layer][table.gather(1, top // ps).long(), 0, top % ps]  # [B, k, kvr + rd]
            sel = sel.gather(1, top)  # [B, k]
        else:
            if ind is not None:
                self.share["decode"] = None
            keys = st.k[self.layer][ids].reshape(b, length, -1)  # [B, L, kvr + rd]
        keys = torch.where(sel[..., None], keys, 0.0)  # unwritten pages may hold anything, NaN included
        return self._output(sparse_attention(q, keys, sel, self.scale, self.kvr))
