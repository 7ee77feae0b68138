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
as DSA does. On CUDA (unless FREETOKEN_FUSED_DECODE=0) a decode step runs as six fused Triton kernels between its three GEMMs
(kernels/mla_decode.py: the norms, RoPEs and page writes; the absorbed query; the indexer's scores
read from the pages; split-K attention over the latent rows with the value up-projection); the
torch functions here (latent_prep, latent_q, paged_index_scores, paged_latent_attention) are
their references and the CPU path. Prefill stays in torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.pages import SCRATCH
from ..kernels import fused_decode
from .layers import FusedLinear, Rope, rms_norm
from .linear import linear
from .state import DecodeState

LATENT_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm: the reference builds them with its default eps
INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm
MAX_SCORES = 1 << 24  # fp32 scores live at once in a prefill block of queries (64 MiB)
FUSED = None  # decode through the Triton kernels: None = kernels.fused_decode (CUDA, unless FREETOKEN_FUSED_DECODE=0); True/False forces it (tests, bench)


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


def latent_rows(kv: torch.Tensor, ik: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_norm: torch.Tensor, ik_norm, eps: float, ieps: float):
    """kv [N, kvr + rd] (kv_a_proj_with_mqa's output), ik [N, id] (the indexer's wk) or None;
    cos, sin [N, rd/2] -> (row [N, kvr + rd]: [RMSNorm(c) | rotated key], indexer key [N, id]
    (LayerNorm, first rd dims rotated) or None)."""
    rd = cos.shape[-1] * 2
    c, kr = kv.split([kv.shape[-1] - rd, rd], dim=-1)
    row = torch.cat([rms_norm(c, kv_norm, eps, False), rope_pairs(kr[:, None], cos, sin)[:, 0]], dim=-1)
    if ik is None:
        return row, None
    ik = F.layer_norm(ik, (ik.shape[-1],), *ik_norm, ieps)  # [N, id]
    return row, torch.cat([rope_pairs(ik[:, None, :rd], cos, sin)[:, 0], ik[:, rd:]], dim=-1)


def latent_prep(q_lat, kv, ik, pos, active, table, page_size, cos, sin, q_norm, kv_norm, ik_norm, eps, ieps,
                kc, vc, scratch: int = SCRATCH):
    """A decode step's norms, RoPEs and page writes (kernels/mla_decode.py mla_prep_triton).
    q_lat [N, q_lora], kv [N, kvr + rd], ik [N, id] or None; pos [N]; active [N] bool or None
    (rows that are not decoding write to the scratch page and get length 0); table [>= N, W];
    cos, sin the Rope tables [P, rd]; kc / vc the layer's K / V pages, written at each row's
    position -> (normed query latent [N, q_lora], lens [N])."""
    n, half = q_lat.shape[0], cos.shape[1] // 2
    row, ikey = latent_rows(kv, ik, cos[pos, :half], sin[pos, :half], kv_norm, ik_norm, eps, ieps)
    page = table[:n].gather(1, (pos // page_size)[:, None])[:, 0]  # [N]
    off, lens = pos % page_size, pos + 1
    if active is not None:
        page = torch.where(active, page, scratch)
        off = torch.where(active, off, 0)
        lens = torch.where(active, lens, 0)
    page = page.long()
    kc[page, 0, off] = row
    if ikey is not None:
        vc[page, 0, off] = ikey
    return rms_norm(q_lat, q_norm, eps, False), lens


def latent_q(q: torch.Tensor, iq: torch.Tensor | None, w_uk: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, nh: int, ih: int):
    """q [N, nh * (nope + rd)] (q_b_proj's output), iq [N, ih * id] (the indexer's wq_b) or None;
    w_uk [nh, nope, kvr]; cos, sin the Rope tables [P, rd] -> (query [N, nh, kvr + rd]: the
    absorbed no-RoPE part | the rotated part; the indexer's query [N, ih, id], first rd dims
    rotated, or None). (kernels/mla_decode.py mla_q_triton)"""
    n, nope, half = q.shape[0], w_uk.shape[1], cos.shape[1] // 2
    rd = 2 * half
    c, s = cos[pos, :half], sin[pos, :half]  # [N, rd/2]
    q_nope, q_rope = q.view(n, nh, nope + rd).split([nope, rd], -1)
    q_abs = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)  # [N, nh, kvr]
    out = torch.cat([q_abs, rope_pairs(q_rope, c, s)], dim=-1)  # [N, nh, kvr + rd]
    if iq is None:
        return out, None
    iq = iq.view(n, ih, -1)
    return out, torch.cat([rope_pairs(iq[..., :rd], c, s), iq[..., rd:]], dim=-1)  # [N, ih, id]


def paged_index_scores(iq, hw, hscale: float, vc, table, lens, length: int, page_size: int, scale: float):
    """Decode rows' indexer scores over the first `length` positions of their block tables (a
    multiple of page_size): iq [N, ih, id]; hw [N, ih] fp32 (times hscale); vc the V pages
    (the indexer keys) -> [N, length] fp32, -inf from each row's length on.
    (kernels/mla_decode.py index_scores_triton)"""
    b = iq.shape[0]
    ikeys = vc[table[:b, :length // page_size].long()].reshape(b, length, -1)  # [N, L, id]
    sel = torch.arange(length, device=iq.device)[None] < lens[:, None]
    return index_scores(iq, hw * hscale, ikeys, scale).masked_fill(~sel, float("-inf"))


def paged_latent_attention(q, kc, table, lens, top, length: int, page_size: int, scale: float, w_uv):
    """Decode attention over the latent rows in the K pages: q [N, nh, kvr + rd]; top [N, k]
    positions (the indexer's choice) or None (every position below `length`); lens [N]; w_uv
    [nh, vd, kvr] -> [N, nh * vd] (o_proj's input). (kernels/mla_decode.py mla_attention_triton)"""
    b, kvr = q.shape[0], w_uv.shape[2]
    table = table[:b]
    sel = torch.arange(length, device=q.device)[None] < lens[:, None]  # [N, L]
    if top is not None:
        keys = kc[table.gather(1, top // page_size).long(), 0, top % page_size]  # [N, k, kvr + rd]
        sel = sel.gather(1, top)  # [N, k]
    else:
        keys = kc[table[:, :length // page_size].long()].reshape(b, length, -1)  # [N, L, kvr + rd]
    keys = torch.where(sel[..., None], keys, 0.0)  # unwritten pages may hold anything, NaN included
    o = torch.einsum("nhc,hvc->nhv", sparse_attention(q, keys, sel, scale, kvr), w_uv)  # [N, nh, vd]
    return o.reshape(b, -1)


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
        # everything that reads the normed query latent in one GEMM: q_b_proj [nh * (nope + rd),
        # q_lora], the indexer's wq_b [ih * id, q_lora]
        names = ["q_b_proj"] + (["indexer.wq_b"] if self.full else [])
        self.b_proj = FusedLinear([w[p + n + ".weight"] for n in names])
        kv_b = w[p + "kv_b_proj.weight"].view(self.nh, self.nope + self.vd, self.kvr)
        self.w_uk = kv_b[:, :self.nope]  # [nh, nope, kvr]: no-RoPE query -> latent space
        self.w_uv = kv_b[:, self.nope:]  # [nh, vd, kvr]: weighted latent -> value
        self.wo, self.bo = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")
        if self.full:
            i = p + "indexer."
            self.iscale = self.id ** -0.5
            self.ik_norm = (w[i + "k_norm.weight"], w[i + "k_norm.bias"])  # [id] each
            self.iw = w[i + "weights_proj.weight"].float()  # [ih, H]: fp32, as the reference keeps it
        else:
            self.ik_norm = None

    def _project(self, x: torch.Tensor, pos: torch.Tensor):
        """x [N, H], positions [N] -> q [N, nh, kvr + rd] (absorbed no-RoPE part | rotated part),
        row [N, kvr + rd] (what the K pages keep), and for a full layer the indexer's (query
        [N, ih, id], key [N, id], head weights [N, ih] fp32), else None."""
        parts = self.a_proj(x)
        half = self.rd // 2
        ql = rms_norm(parts[0], self.q_norm, LATENT_NORM_EPS, False)  # [N, q_lora]
        qb = self.b_proj(ql)
        q, iq = latent_q(qb[0], qb[1] if self.full else None, self.w_uk, pos, self.rope.cos, self.rope.sin,
                         self.nh, self.ih)
        row, ik = latent_rows(parts[1], parts[2] if self.full else None, self.rope.cos[pos, :half],
                              self.rope.sin[pos, :half], self.kv_norm, self.ik_norm, LATENT_NORM_EPS,
                              INDEXER_NORM_EPS)
        if not self.full:
            return q, row, None
        hw = linear(x.float(), self.iw) * self.ih ** -0.5  # [N, ih] (CUDA: rows padded, model/linear.py)
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
        fused = fused_decode(x) if FUSED is None else FUSED
        if fused:
            from ..kernels import mla_decode as K
            prep, qf, scores, attend = K.mla_prep_triton, K.mla_q_triton, K.index_scores_triton, K.mla_attention_triton
        else:
            prep, qf, scores, attend = latent_prep, latent_q, paged_index_scores, paged_latent_attention
        kc, vc = st.k[self.layer], st.v[self.layer]
        table = st.block_table[:b]  # [B, W]
        parts = self.a_proj(x)
        ql, lens = prep(parts[0], parts[1], parts[2] if self.full else None, pos, active, table, ps,
                        self.rope.cos, self.rope.sin, self.q_norm, self.kv_norm, self.ik_norm,
                        LATENT_NORM_EPS, INDEXER_NORM_EPS, kc, vc)
        qb = self.b_proj(ql)
        q, iq = qf(qb[0], qb[1] if self.full else None, self.w_uk, pos, self.rope.cos, self.rope.sin, self.nh, self.ih)
        # the positions to read: the whole table when captured (static), else what the longest row needs
        w = table.shape[1] if _capturing(x) else max(1, min(table.shape[1], -(-int(lens.max()) // ps)))
        length = w * ps
        top = None
        if length > self.topk:  # a static choice: the same for every step of one graph
            if self.full:
                hw = F.linear(x.float(), self.iw)  # [B, ih]
                sc = scores(iq, hw, self.ih ** -0.5, vc, table, lens, length, ps, self.iscale)
                top = sc.topk(self.topk, dim=-1).indices  # [B, k] positions
                self.share["decode"] = top
            else:
                top = self.share["decode"]
        elif self.full:
            self.share["decode"] = None
        o = attend(q, kc, table, lens, top, length, ps, self.scale, self.w_uv)  # [B, nh * vd]
        return linear(o, self.wo, self.bo)
