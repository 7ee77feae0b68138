"""DeepSeek-V4 attention (transformers DeepseekV4Attention, its CSA/HCA compressors and the
Lightning indexer), over the paged KV pool.

Every layer: queries through a q_lora_rank bottleneck (weighted RMSNorm), one RMS-normed
shared key per token that is also the value (multi-query, one KV head), RoPE on the trailing
qk_rope_head_dim dims of each head with adjacent pairs rotated in place (interleaved layout), a
learned sink logit per head in each softmax, the conjugate rotation applied to the output's
trailing dims at the query's position (the values carried rotated keys), then the grouped
low-rank output projection (o_groups blocks of o_lora_rank, then o_b_proj). A query sees the
last sliding_window keys (its own included) and, on compressed layers, compressed entries:
  - HCA ("hca"): window w of compress_rate_hca tokens w*m .. w*m+m-1 gives entry w, a per-feature
    softmax (gate + position bias) average of the tokens' kv projections, RMS-normed, rotated at
    position w*m; a query at t sees the entries w < (t + 1) // m (the windows it has closed).
  - CSA ("csa"): the same with two series per token; entry w averages the first series of window
    w - 1 with the second of window w (2m slots; window 0 only its own). The indexer (its own
    compressor at index_head_dim, queries from the query latent) scores each visible entry as
    sum_h w_h(x) relu(q_h . k / sqrt(d)) and the query attends to its index_topk best.
Sliding-only layers rotate with the "main" RoPE, compressed ones (entries, queries, keys and
the indexer) with the "compress" RoPE (its own theta and YaRN).

Caches (model/state.py dsv4_row): each token's row holds its sliding key, its compressor (and
indexer) projections with the position bias added, and, for a token that closes a window, the
window's entry; so chunked prefill, decode and prefix reuse all read one thing. With
--sliding-kv window (the default) the key and the projections, read only within ring_reach of
their position, live in a per-slot ring and the entries in the pool's pages (dsv4_split), one
row per window that closes in a page (entry_stride: CSA's 4 rows a page of 16, HCA's 1);
DecodeState.part says where a part lives and how positions map to its rows.

Decode is static-shape under CUDA-graph capture: the window's keys are gathered by position,
every row computes "the entry its token would close" (written only where the token does close
a window, the others' writes going to the scratch page), entries are read at every closing position the block table can
hold (eagerly: those the longest row has closed), the indexer's top-k of them gathered when
there are more than index_topk. On CUDA (unless FREETOKEN_FUSED_DECODE=0: kernels.fused_decode)
the small ops run as fused Triton kernels (kernels/csa_decode.py): the norms and the RoPE at positions (any N) and the compressor's entries read straight from the rows (decode's sink
attention has a kernel too: see SINK_TRITON); the *_torch functions and
Compressor.entries are the references and the CPU path. A paged attention kernel is later work.
"""
from __future__ import annotations

import torch

from ..cache.pages import SCRATCH
from ..kernels import fused_decode
from .layers import FusedLinear, rope_frequencies
from .linear import linear
from .mla import _capturing, index_scores
from .attention import ring_prefill
from .state import DecodeState

MAX_SCORES = 1 << 24  # fp32 scores live at once in a prefill block of queries (64 MiB)


def rope_tables(rd: int, theta: float, scaling: dict | None, max_pos: int, device, dtype):
    """(cos, sin) [P, rd/2]: one angle per rotary pair, as the reference computes them."""
    inv_freq, attn = rope_frequencies(rd, theta, scaling)
    freqs = torch.arange(max_pos, dtype=torch.float)[:, None] * inv_freq[None]  # [P, rd/2]
    return (freqs.cos() * attn).to(device, dtype), (freqs.sin() * attn).to(device, dtype)


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with cos, sin broadcastable to [..., rd/2]: the last rd dims rotated as adjacent
    pairs (x0, x1), (x2, x3), ... in fp32, left in place; the leading D - rd dims untouched."""
    rd = 2 * cos.shape[-1]
    tail = x[..., -rd:].float()
    a, b = tail[..., 0::2], tail[..., 1::2]  # [..., rd/2]
    rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rot], dim=-1)


# On CUDA the norms, the RoPE at positions and their pairs run as one fused kernel each
# (kernels/csa_decode.py: a row per program, so any N); the *_torch functions are the
# references and the CPU path.
def _fused(x: torch.Tensor) -> bool:
    return (fused_decode(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and x.shape[-1] % 2 == 0 and x.shape[-1] <= 16384 and x.numel() > 0)


def rope_at_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                  inverse: bool = False) -> torch.Tensor:
    """x [N, ..., D] rotated (rope_tail) at the positions pos [N] of the tables cos, sin [P, rd/2];
    inverse: the conjugate rotation (-sin)."""
    shape = (pos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)  # [N, 1.., rd/2]
    c, s = cos[pos].view(shape), sin[pos].view(shape)
    return rope_tail(x, c, -s if inverse else s)


def rope_at(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            inverse: bool = False) -> torch.Tensor:
    """See rope_at_torch; on CUDA one kernel (the table gather included)."""
    if _fused(x):
        from ..kernels.csa_decode import NORM_NONE, norm_rope_triton
        return norm_rope_triton(x, None, 0.0, NORM_NONE, cos, sin, pos, inverse)
    return rope_at_torch(x, cos, sin, pos, inverse)


def rms_weighted_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled by an fp32 weight in fp32, cast once (the reference keeps these norms fp32)."""
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def rms_weighted(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """See rms_weighted_torch; on CUDA one kernel."""
    if _fused(x):
        from ..kernels.csa_decode import NORM_WEIGHTED, norm_rope_triton
        return norm_rope_triton(x, w, eps, NORM_WEIGHTED)
    return rms_weighted_torch(x, w, eps)


def rms_plain_torch(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_plain(x: torch.Tensor, eps: float) -> torch.Tensor:
    """See rms_plain_torch; on CUDA one kernel."""
    if _fused(x):
        from ..kernels.csa_decode import NORM_PLAIN, norm_rope_triton
        return norm_rope_triton(x, None, eps, NORM_PLAIN)
    return rms_plain_torch(x, eps)


def rms_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
             pos: torch.Tensor) -> torch.Tensor:
    """rope_at(rms_weighted(x, w) or, w None, rms_plain(x)) at positions pos [N]; x [N, ..., D]:
    on CUDA one kernel."""
    if _fused(x):
        from ..kernels.csa_decode import NORM_PLAIN, NORM_WEIGHTED, norm_rope_triton
        return norm_rope_triton(x, w, eps, NORM_PLAIN if w is None else NORM_WEIGHTED, cos, sin, pos)
    return rms_rope_torch(x, w, eps, cos, sin, pos)


def rms_rope_torch(x, w, eps, cos, sin, pos):
    return rope_at_torch(rms_plain_torch(x, eps) if w is None else rms_weighted_torch(x, w, eps), cos, sin, pos)


# The sink-attention kernel (kernels/csa_decode.py) on CUDA. On the H200 at DeepSeek-V4-Flash's
# decode shape (64 heads, 640 keys of 512) its first form, 4 programs for the whole GPU, took
# 88.9 us against torch's 25.7; split over ~128 programs (sink_splits) the model's decode call
# (window keys + compressed entries) takes 21.4 us against torch's 34.8 at batch 1, 34.2 against
# 46.0 at batch 8 (`python -m freetoken.kernels.csa_decode 1`, commit 028debf). False: torch.
SINK_TRITON = True


def sink_attention(q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """See sink_attention_torch; on CUDA with per-row keys (decode) one kernel."""
    if (SINK_TRITON and keys.dim() == 3 and fused_decode(q) and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and keys.dtype == q.dtype and q.shape[-1] <= 1024 and keys.shape[1] > 0):
        from ..kernels.csa_decode import sink_attention_triton
        return sink_attention_triton(q, keys, sel, sinks, scale)
    return sink_attention_torch(q, keys, sel, sinks, scale)


def sink_attention_decode(q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, ent: torch.Tensor | None,
                          ent_sel: torch.Tensor | None, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode's attention: q [B, nh, D] over each row's window keys [B, win, D] (sel [B, win]) and
    compressed entries [B, n, D] (ent_sel [B, n]) or None, as one concatenated set. The
    unselected rows may hold anything (unwritten pages: NaN): they never enter. On CUDA one
    kernel reading both sources (no where, no cat)."""
    if SINK_TRITON and fused_decode(q) and q.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and q.shape[-1] <= 1024 and keys.dtype == q.dtype and (ent is None or ent.dtype == q.dtype):
        from ..kernels.csa_decode import sink_attention_triton
        return sink_attention_triton(q, keys, sel, sinks, scale, ent, ent_sel)
    return sink_attention_decode_torch(q, keys, sel, ent, ent_sel, sinks, scale)


def sink_attention_decode_torch(q, keys, sel, ent, ent_sel, sinks, scale):
    """sink_attention_decode's torch path: the unselected rows zeroed, the two sources joined."""
    keys = torch.where(sel[..., None], keys, 0.0)
    if ent is not None:
        keys = torch.cat([keys, torch.where(ent_sel[..., None], ent, 0.0)], dim=1)  # [B, win + n, D]
        sel = torch.cat([sel, ent_sel], dim=1)
    return sink_attention_torch(q, keys, sel, sinks, scale)


def sink_attention_torch(q: torch.Tensor, keys: torch.Tensor, sel: torch.Tensor, sinks: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """q [N, nh, D]; keys (= values) [K, D] shared by the N queries or [N, K, D]; sel [N, K] bool;
    sinks [nh] fp32 -> [N, nh, D]. The sink's logit joins the softmax and is dropped, so a row that
    sees nothing (an idle decode row) gives zeros."""
    s = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [N, nh, K]
    s = s.masked_fill(~sel[:, None, :], float("-inf"))
    sk = sinks[None, :, None].expand(s.shape[0], -1, 1)  # [N, nh, 1]
    p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p.to(q.dtype), keys)  # [N, nh, D]


class Compressor:
    """The window compressor of one layer (the attention's, or its indexer's at index_head_dim):
    row parts kv/gate/entry of dsv4_row, `o` series per token (2: CSA's overlapping windows)."""

    def __init__(self, w: dict, p: str, m: int, o: int, dim: int, eps: float, parts: tuple[str, str, str]):
        self.m, self.o, self.dim, self.eps = m, o, dim, eps
        self.bias = w[p + "position_bias"].float()  # [m, o * dim]
        self.norm = w[p + "kv_norm.weight"]  # [dim]
        self.kv, self.gate, self.entry = parts

    def entries(self, rows, ends: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype) -> torch.Tensor:
        """The entries of the windows closing at positions ends [...]: rows(name, positions) gathers
        that part of the tokens' rows; cos, sin: the compress rope [P, rd/2] -> [..., dim]."""
        m, d = self.m, self.dim
        span = torch.arange(-self.o * m + 1, 1, device=ends.device)  # the o*m tokens up to the end
        pos = ends[..., None] + span  # [..., o*m]
        ok = (pos >= 0)[..., None]
        pos = pos.clamp(min=0)
        kv, gate = rows(self.kv, pos), rows(self.gate, pos)  # [..., o*m, o*d]
        if self.o == 2:  # window w-1's first series, then window w's second
            kv = torch.cat([kv[..., :m, :d], kv[..., m:, d:]], dim=-2)  # [..., 2m, d]
            gate = torch.cat([gate[..., :m, :d], gate[..., m:, d:]], dim=-2)
        kv = torch.where(ok, kv, 0.0)  # before the sequence (window -1), or never written
        gate = torch.where(ok, gate.float(), float("-inf"))
        e = (kv * torch.softmax(gate, dim=-2).to(kv.dtype)).sum(-2)  # [..., d]
        e = rms_weighted(e, self.norm, self.eps)
        start = (ends - m + 1).clamp(min=0)  # the window's first position
        return rope_tail(e, cos[start], sin[start]).to(dtype)

    def decode_entries(self, part, page_size: int, ends: torch.Tensor, rows, cos: torch.Tensor,
                       sin: torch.Tensor, dtype) -> torch.Tensor:
        """entries(rows, ends [B], ...) at decode (row b of slot b); on CUDA one kernel that reads
        the rows where they live: part(name) -> DecodeState.part's (buf, table, cols, stride)."""
        kv, gate = part(self.kv), part(self.gate)
        if (fused_decode(ends) and dtype in (torch.float32, torch.bfloat16, torch.float16) and self.dim % 2 == 0
                and kv[0].dtype == gate[0].dtype and kv[0].stride(-1) == 1 and gate[0].stride(-1) == 1):
            from ..kernels.csa_decode import compress_entries_triton
            return compress_entries_triton(kv, gate, page_size, ends, self.m, self.o, self.dim, self.norm,
                                           self.eps, cos, sin, dtype)
        return self.entries(rows, ends, cos, sin, dtype)

    def projections(self, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor):
        """What a token stores: its kv projection and its gate with the position bias added."""
        return kv, (gate.float() + self.bias[pos % self.m]).to(kv.dtype)


class CompressedAttention:
    """One V4 attention layer, parameters by checkpoint name. ropes: {"main", "compress"} ->
    (cos, sin) tables [P, rd/2]."""

    def __init__(self, cfg, w: dict, layer: int, ropes: dict):
        p = f"model.layers.{layer}.self_attn."
        self.layer, self.kind = layer, cfg.compressed_attention[layer]
        self.nh, self.hd, self.win, self.eps = cfg.num_heads, cfg.head_dim, cfg.sliding_window, cfg.rms_norm_eps
        self.scale = self.hd ** -0.5
        self.cos, self.sin = ropes["main" if self.kind == "none" else "compress"]
        self.ccos, self.csin = ropes["compress"]
        c = p + "compressor."
        names = ["q_a_proj", "kv_proj"]
        if self.kind != "none":
            names += ["compressor.kv_proj", "compressor.gate_proj"]
        if self.kind == "csa":
            names += ["compressor.indexer.kv_proj", "compressor.indexer.gate_proj",
                      "compressor.indexer.scorer.weights_proj"]
        # everything that reads the hidden state, in one GEMM
        self.a_proj = FusedLinear([w[p + n + ".weight"] for n in names])
        self.q_norm, self.kv_norm = w[p + "q_a_norm.weight"], w[p + "kv_norm.weight"]
        self.q_b = w[p + "q_b_proj.weight"]  # [nh * hd, q_lora]
        g = cfg.o_groups
        self.o_a = w[p + "o_a_proj.weight"].view(g, cfg.o_lora_rank, -1)  # [g, olr, nh * hd / g]
        self.o_b = w[p + "o_b_proj.weight"]  # [H, g * olr]
        self.sinks = w[p + "sinks"].float()  # [nh]
        self.comp = self.index = None
        self.m = {"csa": cfg.compress_rate_csa, "hca": cfg.compress_rate_hca}.get(self.kind, 0)
        if self.kind != "none":
            o = 2 if self.kind == "csa" else 1
            self.comp = Compressor(w, c, self.m, o, self.hd, self.eps, ("ckv", "cgate", "centry"))
        if self.kind == "csa":
            self.index = Compressor(w, c + "indexer.", self.m, 2, cfg.index_head_dim, self.eps,
                                    ("ikv", "igate", "ientry"))
            self.ih, self.id, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
            self.iq_b = w[c + "indexer.q_b_proj.weight"]  # [ih * id, q_lora]

    # ------------------------------------------------------------------ pieces
    def _project(self, x: torch.Tensor, pos: torch.Tensor):
        """x [N, H], pos [N] -> q [N, nh, hd], the row parts to store {name: [N, width]}, the
        query latent [N, q_lora] and the indexer's head weights [N, ih] fp32 (CSA) or None."""
        n = x.shape[0]
        parts = self.a_proj(x)
        qr = rms_weighted(parts[0], self.q_norm, self.eps)  # [N, q_lora]
        q = rms_rope(linear(qr, self.q_b).view(n, self.nh, self.hd), None, self.eps, self.cos, self.sin, pos)  # [N, nh, hd]
        store = {"kv": rms_rope(parts[1], self.kv_norm, self.eps, self.cos, self.sin, pos)}  # [N, hd]
        hw = None
        if self.comp is not None:
            store["ckv"], store["cgate"] = self.comp.projections(parts[2], parts[3], pos)
        if self.index is not None:
            store["ikv"], store["igate"] = self.index.projections(parts[4], parts[5], pos)
            hw = parts[6].float() * self.ih ** -0.5  # [N, ih]
        return q, store, qr, hw

    def _index_query(self, qr: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The indexer's queries [N, ih, id], rotated with the compress rope at their positions."""
        iq = linear(qr, self.iq_b).view(qr.shape[0], self.ih, self.id)
        return rope_at(iq, self.ccos, self.csin, pos)

    def _write(self, st: DecodeState, at, pos: torch.Tensor, store: dict) -> None:
        """Each part's rows at positions pos into the pages holding that part; at(table, pos,
        stride) -> (pages, rows) through that part's block table. Parts side by side in one
        buffer (same table and stride, adjacent columns) go in one write: the ring row (kv, ckv,
        cgate, ikv, igate) is one write instead of five, each of which was several small
        launches of the decode step."""
        runs = []  # [buffer, table, stride, first column, end column, values]
        for name, val in store.items():
            buf, table, cols, stride = st.part(self.layer, name)  # [pages, rows, width], [slots, W]
            r = runs[-1] if runs else None
            if (r is not None and r[0].data_ptr() == buf.data_ptr() and r[0].shape == buf.shape
                    and r[1] is table and r[2] == stride and r[4] == cols.start and r[5][0].dtype == val.dtype):
                r[4] = cols.stop
                r[5].append(val)
            else:
                runs.append([buf, table, stride, cols.start, cols.stop, [val]])
        for buf, table, stride, first, end, vals in runs:
            page, row = at(table, pos, stride)
            buf[..., first:end][page, row] = vals[0] if len(vals) == 1 else torch.cat(vals, dim=-1)

    def _output(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """o [N, nh, hd] -> [N, H]: the values' rotation undone at the query's position, then the
        grouped projection (each group of heads to o_lora_rank) and o_b_proj."""
        n = o.shape[0]
        o = rope_at(o, self.cos, self.sin, pos, inverse=True)
        g = self.o_a.shape[0]
        y = torch.einsum("ngi,goi->ngo", o.reshape(n, g, -1), self.o_a)  # [N, g, olr]
        return linear(y.reshape(n, -1), self.o_b)

    # ------------------------------------------------------------------ prefill
    def prefill(self, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture=None) -> torch.Tensor:
        """One chunk of one sequence. x: [T, H] at positions start..start+T-1, whose pages are
        already in the slot's block table. With the layer's rows in a ring, in pieces the ring
        holds, handing `capture` (prefix-cache checkpoints) the ring rows at each of them."""
        return ring_prefill(self._piece, self.layer, x, st, slot, start, capture)

    def _piece(self, x: torch.Tensor, st: DecodeState, slot: int, start: int) -> torch.Tensor:
        t, ps = x.shape[0], st.page_size
        s_len = start + t
        pos = torch.arange(start, s_len, device=x.device)
        q, store, qr, hw = self._project(x, pos)

        def at(table, p, stride):  # pages and rows of one sequence's positions p [...]
            return table[slot][p // ps].long(), p % ps // stride

        def rows(name, p):  # that part of one sequence's rows at positions p [...]
            buf, table, cols, stride = st.part(self.layer, name)
            return buf[..., cols][at(table, p, stride)]

        self._write(st, at, pos, store)
        lo = max(0, start - self.win + 1)
        kpos = torch.arange(lo, s_len, device=x.device)
        keys = rows("kv", kpos)  # [S, hd]: the window's keys of every query in the chunk
        sel = (kpos[None] <= pos[:, None]) & (pos[:, None] - kpos[None] < self.win)  # [T, S]
        if self.comp is not None:
            m = self.m
            first = -(-(start + 1) // m) * m - 1  # the first closing position in the chunk
            ends = torch.tensor(range(first, s_len, m), dtype=torch.long, device=x.device)
            if len(ends):  # the windows this chunk closes: their entries into their closing rows
                new = {"centry": self.comp.entries(rows, ends, self.ccos, self.csin, x.dtype)}
                if self.index is not None:
                    new["ientry"] = self.index.entries(rows, ends, self.ccos, self.csin, x.dtype)
                self._write(st, at, ends, new)
            n_ent = s_len // m
            epos = torch.arange(n_ent, device=x.device) * m + m - 1  # closing positions
            ent_sel = torch.arange(n_ent, device=x.device)[None] < ((pos + 1) // m)[:, None]  # [T, n]
            if self.index is not None and n_ent:
                sc = index_scores(self._index_query(qr, pos), hw, rows("ientry", epos), self.id ** -0.5)
                sc = sc.masked_fill(~ent_sel, float("-inf"))  # [T, n]
                top = sc.topk(min(self.topk, n_ent), dim=-1).indices
                ent_sel = ent_sel & torch.zeros_like(ent_sel).scatter_(1, top, True)
            keys = torch.cat([keys, rows("centry", epos)])  # [S + n, hd]
            sel = torch.cat([sel, ent_sel], dim=1)
        out = torch.empty_like(q)
        step = max(1, MAX_SCORES // (self.nh * keys.shape[0]))
        for a in range(0, t, step):
            b = min(t, a + step)
            out[a:b] = sink_attention(q[a:b], keys, sel[a:b], self.sinks, self.scale)
        return self._output(out, pos)

    # ------------------------------------------------------------------ decode
    def decode(self, x: torch.Tensor, st: DecodeState, pos: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B slots. x: [B, H], pos: [B] (device data). active: [B] bool;
        rows that are not decoding write to the scratch page and attend to nothing."""
        b, ps = x.shape[0], st.page_size
        q, store, qr, hw = self._project(x, pos)
        live = torch.ones_like(pos, dtype=torch.bool) if active is None else active

        def write_at(ok):  # this step's token of each row [B]: the others write to the scratch page
            def at(table, p, stride):
                page = table[:b].gather(1, (p // ps)[:, None])[:, 0]
                return torch.where(ok, page, SCRATCH).long(), torch.where(ok, p % ps // stride, 0)
            return at

        def rows(name, p):  # that part of each row's sequence at positions p [B, ...]
            buf, table, cols, stride = st.part(self.layer, name)
            flat = p.reshape(b, -1)
            pg = table[:b].gather(1, flat // ps).long().view(p.shape)
            return buf[..., cols][pg, p % ps // stride]

        self._write(st, write_at(live), pos, store)
        if self.comp is not None:  # the entry this token closes, if it does (static: computed always)
            ends = torch.where(live, pos, 0)
            def part(name):
                return st.part(self.layer, name)
            new = {"centry": self.comp.decode_entries(part, ps, ends, rows, self.ccos, self.csin, x.dtype)}
            if self.index is not None:
                new["ientry"] = self.index.decode_entries(part, ps, ends, rows, self.ccos, self.csin, x.dtype)
            # a row per window in the pool (entry_stride): a token that closes none must not write
            self._write(st, write_at(live & (pos % self.m == self.m - 1)), pos, new)
        kpos = pos[:, None] - self.win + 1 + torch.arange(self.win, device=x.device)  # [B, win]
        sel = (kpos >= 0) & live[:, None]
        keys = rows("kv", kpos.clamp(min=0))  # [B, win, hd]: those not in sel masked by the attention
        ent = ent_sel = None
        if self.comp is not None:
            m = self.m
            # the closing positions to read: all the table holds when captured (static), else
            # those the longest row has closed
            cap = st.width * ps // m
            n = cap if _capturing(x) else max(1, min(cap, int(((pos + 1) // m).max())))
            idx = torch.arange(n, device=x.device)
            epos = (idx * m + m - 1)[None].expand(b, -1)  # [B, n]
            ent_sel = (idx[None] < ((pos + 1) // m)[:, None]) & live[:, None]  # [B, n]
            if self.index is not None and n > self.topk:  # a static choice, as in mla.py
                sc = index_scores(self._index_query(qr, pos), hw, rows("ientry", epos), self.id ** -0.5)
                top = sc.masked_fill(~ent_sel, float("-inf")).topk(self.topk, dim=-1).indices  # [B, k]
                epos, ent_sel = epos.gather(1, top), ent_sel.gather(1, top)
            ent = rows("centry", epos)  # [B, n', hd]: unwritten rows may hold NaN (masked)
        return self._output(sink_attention_decode(q, keys, sel, ent, ent_sel, self.sinks, self.scale), pos)
