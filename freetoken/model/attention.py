"""Full (softmax) attention with a preallocated KV cache; optional output gate (Qwen3.5)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import FusedLinear, Rope, rms_norm
from .state import DecodeState


class Attention:
    def __init__(self, cfg, w: dict, layer: int, rope: Rope, gated: bool, one_centered: bool):
        p = f"model.layers.{layer}.self_attn."
        self.layer, self.rope, self.gated, self.one_centered = layer, rope, gated, one_centered
        self.nh, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.window = cfg.rms_norm_eps, cfg.sliding_window
        qkv = ("q_proj", "k_proj", "v_proj")
        self.qkv = FusedLinear([w[p + n + ".weight"] for n in qkv], [w.get(p + n + ".bias") for n in qkv])
        self.wo, self.bo = w[p + "o_proj.weight"], w.get(p + "o_proj.bias")
        self.q_norm, self.k_norm = w[p + "q_norm.weight"], w[p + "k_norm.weight"]

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [N, H], positions: [N] -> q [N, nh, hd], k/v [N, kvh, hd], gate [N, nh*hd] or None."""
        n = x.shape[0]
        q, k, v = self.qkv(x)
        gate = None
        if self.gated:  # q_proj emits [query | gate] per head
            q, gate = q.view(n, self.nh, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(n, self.nh * self.hd)
        q = rms_norm(q.reshape(n, self.nh, self.hd), self.q_norm, self.eps, self.one_centered)
        k = rms_norm(k.view(n, self.kvh, self.hd), self.k_norm, self.eps, self.one_centered)
        v = v.view(n, self.kvh, self.hd)
        return self.rope(q, positions), self.rope(k, positions), v, gate

    def _output(self, o: torch.Tensor, gate) -> torch.Tensor:
        """o: [N, nh*hd] -> [N, H]"""
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return F.linear(o, self.wo, self.bo)

    def _mask(self, q_pos: torch.Tensor, length: int) -> torch.Tensor:
        """Boolean [.., Tq, length] mask: key j visible to a query at position p."""
        j = torch.arange(length, device=q_pos.device)
        m = j <= q_pos[..., None]
        if self.window:
            m &= j > q_pos[..., None] - self.window
        return m

    def prefill(self, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture=None) -> torch.Tensor:
        """One chunk of one sequence. x: [T, H] at positions start..start+T-1. (capture is for
        recurrent layers: the prefix cache keeps K/V as pages, not checkpoints.)"""
        t = x.shape[0]
        pos = torch.arange(start, start + t, device=x.device)
        q, k, v, gate = self._project(x, pos)
        kc, vc = st.k[self.layer][slot], st.v[self.layer][slot]  # [kvh, max_len, hd]
        kc[:, start:start + t] = k.transpose(0, 1)
        vc[:, start:start + t] = v.transpose(0, 1)
        end = start + t
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kc[None, :, :end], vc[None, :, :end],  # [1, h, T|S, hd]
            attn_mask=self._mask(pos, end), scale=self.hd ** -0.5, enable_gqa=True)
        o = o[0].transpose(0, 1).reshape(t, self.nh * self.hd)  # [T, nh*hd]
        return self._output(o, gate)

    def decode(self, x: torch.Tensor, st: DecodeState, pos: torch.Tensor, attend_len: int,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B slots. x: [B, H], pos: [B]; keys beyond attend_len unseen.
        active: [B] bool; inactive rows (slots prefilling or idle) write to the scratch position."""
        b = x.shape[0]
        q, k, v, gate = self._project(x, pos)  # q [B, nh, hd]
        rows = torch.arange(b, device=x.device)
        wpos = pos if active is None else torch.where(active, pos, st.scratch)
        st.k[self.layer][rows, :, wpos] = k  # [B, kvh, hd] scattered at each slot's position
        st.v[self.layer][rows, :, wpos] = v
        kc = st.k[self.layer][:b, :, :attend_len]  # [B, kvh, L, hd]
        vc = st.v[self.layer][:b, :, :attend_len]
        mask = self._mask(pos, attend_len)[:, None, None, :]  # [B, 1, 1, L]
        o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, attn_mask=mask,
                                           scale=self.hd ** -0.5, enable_gqa=True)
        return self._output(o.reshape(b, self.nh * self.hd), gate)
