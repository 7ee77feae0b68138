"""Softmax attention over the paged KV pool, full or sliding-window; optional q/k norms (Qwen3),
output gate (Qwen3.5), q/k/v/o biases and per-head attention sinks (GPT-OSS)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..cache.pages import SCRATCH
from .layers import FusedLinear, Rope, rms_norm
from .linear import linear
from .state import DecodeState


class Attention:
    """Parameters by checkpoint name; those a family lacks are absent from `w` (no q/k norm in
    GPT-OSS, no biases or sinks in Qwen). The layer's window comes from cfg.layer_types."""

    def __init__(self, cfg, w: dict, layer: int, rope: Rope, gated: bool, one_centered: bool):
        p = f"model.layers.{layer}.self_attn."
        self.layer, self.rope, self.gated, self.one_centered = layer, rope, gated, one_centered
        self.nh, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.window = cfg.rms_norm_eps, cfg.window(layer)
        qkv = ("q_proj", "k_proj", "v_proj")
        self.qkv = FusedLinear([w[p + n + ".weight"] for n in qkv], [w.get(p + n + ".bias") for n in qkv])
        self.wo, self.bo = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")
        self.q_norm, self.k_norm = w.get(p + "q_norm.weight"), w.get(p + "k_norm.weight")
        self.sinks = w[p + "sinks"] if cfg.attention_sinks else None  # [nh]

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [N, H], positions: [N] -> q [N, nh, hd], k/v [N, kvh, hd], gate [N, nh*hd] or None."""
        n = x.shape[0]
        q, k, v = self.qkv(x)
        gate = None
        if self.gated:  # q_proj emits [query | gate] per head
            q, gate = q.view(n, self.nh, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(n, self.nh * self.hd)
        q = q.reshape(n, self.nh, self.hd)
        k = k.reshape(n, self.kvh, self.hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps, self.one_centered)
            k = rms_norm(k, self.k_norm, self.eps, self.one_centered)
        v = v.reshape(n, self.kvh, self.hd)
        return self.rope(q, positions), self.rope(k, positions), v, gate

    def _output(self, o: torch.Tensor, gate) -> torch.Tensor:
        """o: [N, nh*hd] -> [N, H]"""
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return linear(o, self.wo, self.bo)

    def prefill(self, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture=None) -> torch.Tensor:
        """One chunk of one sequence. x: [T, H] at positions start..start+T-1, whose pages are
        already in the slot's block table. A layer kept in a ring (model/state.py) takes the
        chunk in pieces the ring can hold, and hands `capture` (the prefix cache's checkpoints
        inside the chunk) the window's keys at each of its positions."""
        return ring_prefill(self._piece, self.layer, x, st, slot, start, capture)

    def _piece(self, x: torch.Tensor, st: DecodeState, slot: int, start: int) -> torch.Tensor:
        from ..kernels.paged_attention import paged_prefill_attention, write_kv
        t = x.shape[0]
        pos = torch.arange(start, start + t, device=x.device)
        q, k, v, gate = self._project(x, pos)
        table = st.table(self.layer)[slot]  # [W]
        write_kv(st.k[self.layer], st.v[self.layer], k, v, table[pos // st.page_size], pos % st.page_size)
        o = paged_prefill_attention(q, st.k[self.layer], st.v[self.layer], table, start, self.hd ** -0.5,
                                    self.window, self.sinks)  # [T, nh, hd]
        return self._output(o.reshape(t, self.nh * self.hd), gate)

    def decode(self, x: torch.Tensor, st: DecodeState, pos: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B slots. x: [B, H], pos: [B] (each row's position, device data:
        one captured step serves every length). active: [B] bool; rows that are not decoding
        (idle or mid-prefill slots) write to the scratch page and attend to nothing."""
        from ..kernels.paged_attention import paged_decode_attention, write_kv
        b = x.shape[0]
        q, k, v, gate = self._project(x, pos)  # q [B, nh, hd]
        table = st.table(self.layer)[:b]  # [B, W]
        page = table.gather(1, (pos // st.page_size)[:, None])[:, 0]  # [B]
        off = pos % st.page_size
        lens = pos + 1
        if active is not None:
            page = torch.where(active, page, SCRATCH)
            off = torch.where(active, off, 0)
            lens = torch.where(active, lens, 0)
        write_kv(st.k[self.layer], st.v[self.layer], k, v, page, off)
        o = paged_decode_attention(q, st.k[self.layer], st.v[self.layer], table, lens.to(torch.int32),
                                   self.hd ** -0.5, self.window, sinks=self.sinks)  # [B, nh, hd]
        return self._output(o.reshape(b, self.nh * self.hd), gate)


def ring_prefill(piece, layer: int, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture):
    """A chunk through piece(x, st, slot, start) -> [t, H]: whole for a layer in the pool; for a
    ring layer in pieces the ring holds (st.ring_chunk), handing `capture` (the prefix cache's
    checkpoints inside the chunk, if any) the rows a continuation reads at each of them."""
    t = x.shape[0]
    if layer not in st.ring:
        return piece(x, st, slot, start)
    outs = []
    for a in range(0, max(t, 1), st.ring_chunk):  # an empty chunk: one empty piece
        b = min(t, a + st.ring_chunk)
        outs.append(piece(x[a:b], st, slot, start + a))
        if capture is not None:
            for c in capture.offsets(start + a, b - a):  # the state after start + a + c tokens
                capture.store_window(layer, start + a + c, st.read_window(layer, slot, start + a + c))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk's T queries over S >= T keys, the chunk being the last T of them.
    q: [nh, T, hd]; k, v: [kvh, S, hd]; mask: [T, S] bool or None for plain causal; sinks: [nh]
    or None -> [nh, T, hd].

    Plain causal goes in as a bottom-right-aligned causal bias: SDPA runs it on the flash
    kernel with no [T, S] mask in memory (an explicit mask sent each new chunk shape down a
    path that cost ~20 ms of host time per call on the H200). SDPA cannot add a sink to its
    denominator: with sinks the softmax is written out (sinks_attention)."""
    t, s = q.shape[1], k.shape[1]
    if sinks is not None:
        return sinks_attention(q, k, v, mask, scale, sinks)
    bias = mask if mask is not None else causal_lower_right(t, s)
    with sdpa_kernel(NO_CUDNN):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias, scale=scale,
                                              enable_gqa=True)[0]


# SDPA's backends for prefill, cuDNN left out: where the general dispatcher picks it (a prompt's
# first chunk, T == S, on the H200), it builds a graph for every new shape, 67-70 ms of host time
# each against 0.5-0.6 ms for the flash kernel (benchmarks/results/attention_shapes-gpu.json):
# every new prompt length stalled decoding streams and its own first token by that much
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sinks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, sinks: torch.Tensor, max_scores: int = 1 << 24) -> torch.Tensor:
    """prefill_attention with a learned sink logit per head in each softmax (GPT-OSS), as the
    reference computes it: scores in fp32, the sink's column appended, softmax, column dropped.
    Query rows go in blocks of at most `max_scores` scores (64 MiB of fp32) at a time."""
    nh, t, hd = q.shape
    kvh, s = k.shape[0], k.shape[1]
    g = nh // kvh
    out = torch.empty_like(q)
    kt = k.float().transpose(-1, -2)  # [kvh, hd, S]
    vf = v.float()
    sk = sinks.float().view(kvh, g, 1, 1)
    rows = max(1, max_scores // (nh * s))
    for a in range(0, t, rows):
        b = min(t, a + rows)
        qg = q[:, a:b].float().reshape(kvh, g * (b - a), hd)  # heads of a group share K/V
        sc = torch.matmul(qg, kt).view(kvh, g, b - a, s) * scale  # [kvh, g, Tb, S]
        if mask is not None:
            vis = mask[a:b]
        else:  # causal, the chunk being the last t keys
            vis = torch.arange(s, device=q.device)[None] <= torch.arange(s - t + a, s - t + b, device=q.device)[:, None]
        sc = sc.masked_fill(~vis, float("-inf"))
        pr = torch.softmax(torch.cat([sc, sk.expand(-1, -1, b - a, 1)], dim=-1), dim=-1)[..., :-1]
        o = torch.matmul(pr.reshape(kvh, g * (b - a), s), vf)  # [kvh, g*Tb, hd]
        out[:, a:b] = o.view(nh, b - a, hd).to(q.dtype)
    return out


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per row over its cached keys. q: [B, nh, hd]; k, v: [B, kvh, L, hd] (views
    of the cache, any strides); mask: [B, L] bool -> [B, nh, hd].

    Written out rather than through SDPA: with a mask and GQA, SDPA on the H200 took ~20 ms of
    host time per call as the length changed every step, against a few us of GPU work here.
    Query heads are grouped onto their KV head, so K/V are read once and never expanded."""
    b, nh, hd = q.shape
    kvh = k.shape[1]
    qg = q.view(b, kvh, nh // kvh, hd)  # [B, kvh, g, hd]
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, kvh, g, L]
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v).reshape(b, nh, hd)  # [B, kvh, g, hd] -> [B, nh, hd]
