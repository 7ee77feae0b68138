"""Gated DeltaNet (linear attention) layer: causal conv1d + gated delta rule.

Prefill uses the chunked (UT-transform) form of the delta rule; decode the one-step
recurrence. Both carry state across calls: the last K-1 conv inputs and the [Hv, dk, dv]
fp32 recurrent matrix, so a prompt may be prefilled in chunks of any size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..experts.cpu.denormals import flushed
from ..kernels import fla_delta, prefill_kernels, use_triton
from ..kernels.causal_conv import causal_conv_silu_torch, conv_sequence, conv_state_after
from .layers import FusedLinear, gated_rms_norm
from .linear import linear
from .state import DecodeState


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _cut_layout(t: int, cuts, chunk: int, device):
    """Padded layout that puts every cut on a chunk boundary.

    Segment i (tokens between consecutive cuts) starts on a chunk boundary and is padded up
    to a chunk multiple. Returns (index [T] of each token in the padded sequence, padded
    length, the chunk index ending at each cut)."""
    bounds = sorted({c for c in cuts if 0 < c < t}) + [t]
    idx, ends, p, s = [], [], 0, 0
    for b in bounds:
        idx.append(torch.arange(p, p + b - s, device=device))
        p += -(-(b - s) // chunk) * chunk
        ends.append(p // chunk - 1)
        s = b
    return torch.cat(idx), p, dict(zip(bounds, ends))


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, cuts=()):
    """q, k: [T, Hv, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]; state: [Hv, dk, dv] fp32.

    Returns (out [T, Hv, dv] fp32, new state, [state after c tokens for c in cuts]). q/k must
    already be l2-normalised and q scaled. Within a chunk the updates are solved as one
    triangular system; across chunks the state is carried sequentially.

    cuts (offsets in 1..T) ask for intermediate states, for prefix-cache checkpoints, in the
    same pass: zero padding after each cut moves it onto a chunk boundary. A padded step has
    beta = 0 and g = 0, so it neither writes to nor decays the state: the result is exactly
    that of separate calls split at the cuts, without running the rest of the model per piece.
    """
    t = q.shape[0]
    h = q.shape[1]
    if any(0 < c < t for c in cuts):
        idx, tp, end_chunk = _cut_layout(t, cuts, chunk, q.device)

        def spread(x):  # [T, Hv, ...] -> [Hv, Tp, ...] with each segment chunk-aligned
            out = x.new_zeros((tp, *x.shape[1:]))
            out[idx] = x
            return out.transpose(0, 1)
        q, k, v, g, beta = (spread(x) for x in (q, k, v, g, beta))
    else:
        idx, pad = None, (-t) % chunk
        end_chunk = {t: (t + pad) // chunk - 1}
        q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [Hv, Tp, d]
        g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [Hv, Tp]
    want = {end_chunk[c] for c in cuts if c in end_chunk}
    snaps = {}
    n = q.shape[1] // chunk
    q, k, v = (x.reshape(h, n, chunk, -1) for x in (q, k, v))  # [Hv, n, C, d]
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [Hv, n, C] log-decay from chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [Hv, n, C, C], unit lower triangular
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    q = q * cum.exp()[..., None]
    k_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # [Hv, n, dk, C] decayed to chunk end
    # Chunk i starts from state S_i. What S_i does not predict is vi = new_v_i - k_cum_i S_i, so
    #   out_i   = q_i S_i + intra_i vi         = (q_i - intra_i k_cum_i) S_i + intra_i new_v_i
    #   S_{i+1} = d_i S_i + k_end_i vi         = (d_i I - k_end_i k_cum_i) S_i + k_end_i new_v_i
    # Everything but the product with S_i is batched over chunks up front, so the sequential
    # part is one baddbmm per chunk (it was nine small ops: the loop bounds prefill on the GPU
    # by host time), and the outputs are one batched product after it.
    trans = -(k_end @ k_cum)  # [Hv, n, dk, dk]
    trans.diagonal(dim1=-2, dim2=-1).add_(cum[..., -1:].exp())  # + d_i I
    trans = trans.transpose(0, 1).contiguous()  # [n, Hv, dk, dk]: each step reads one block
    inject = (k_end @ new_v).transpose(0, 1).contiguous()  # [n, Hv, dk, dv]
    starts = []
    for i in range(n):
        starts.append(state)
        state = torch.baddbmm(inject[i], trans[i], state)  # [Hv, dk, dv]
        if i in want:
            snaps[i] = state
    out = (q - intra @ k_cum) @ torch.stack(starts, 1) + intra @ new_v  # [Hv, n, C, dv]
    out = out.reshape(h, n * chunk, -1).transpose(0, 1)  # [Tp, Hv, dv]
    out = out[:t] if idx is None else out[idx]  # [T, Hv, dv]
    return out, state, [snaps[end_chunk[c]] for c in cuts if c in end_chunk]


def recurrent_gated_delta_step(q, k, v, g, beta, state):
    """One token per batch row. q, k: [B, Hv, dk]; v: [B, Hv, dv]; g, beta: [B, Hv];
    state: [B, Hv, dk, dv] fp32 -> (out [B, Hv, dv], new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)  # [B, Hv, dv]
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


class GatedDeltaNet:
    def __init__(self, cfg, w: dict, layer: int):
        p = f"model.layers.{layer}.linear_attn."
        self.layer = layer
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.in_proj = FusedLinear([w[p + n + ".weight"] for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")])
        self.w_out, self.norm_w = w[p + "out_proj.weight"], w[p + "norm.weight"]
        self.conv_w = w[p + "conv1d.weight"].reshape(-1, self.kernel)  # [C, K]
        self.conv_b = w.get(p + "conv1d.bias")
        self.neg_a = -w[p + "A_log"].float().exp()  # [Hv]
        self.dt_bias = w[p + "dt_bias"]
        # the fused decode kernels need power-of-two head dims and no conv bias
        self.fusable = _pow2(self.dk) and _pow2(self.dv) and self.kernel >= 2 and self.conv_b is None
        self.fla = fla_delta.supports(self.dk, self.dv)  # head widths fla is verified at
        self.prefill_graphs = None  # runtime.prefill_graphs.PrefillGraphs, where captured
        self._host_args = None  # _decode_host's constants, made at its first call

    def _raw_heads(self, mixed, a, b):
        """Split conv output into q, k [N, Hk, dk] and v [N, Hv, dv] heads (mixed's dtype, q/k
        not normalised); decay g and beta [N, Hv] fp32."""
        n = mixed.shape[0]
        kd = self.hk * self.dk
        q, k, v = torch.split(mixed, [kd, kd, self.hv * self.dv], dim=-1)
        beta = b.sigmoid().float()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)  # [n, Hv] log-decay, <= 0
        return q.reshape(n, self.hk, self.dk), k.reshape(n, self.hk, self.dk), v.reshape(n, self.hv, self.dv), g, beta

    def _gates_and_heads(self, mixed, a, b):
        """_raw_heads for the torch rule: fp32, q/k l2-normalised (q scaled) and repeated to
        the value heads."""
        q, k, v, g, beta = self._raw_heads(mixed, a, b)
        q, k, v = q.float(), k.float(), v.float()
        if self.hv != self.hk:  # each q/k head serves hv/hk consecutive value heads
            q = q.repeat_interleave(self.hv // self.hk, dim=1)
            k = k.repeat_interleave(self.hv // self.hk, dim=1)
        return l2norm(q) * self.dk ** -0.5, l2norm(k), v, g, beta

    def _finish(self, core: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
        """core: [N, Hv, dv] (fp32 from the torch rule, 16-bit from fla), z: [N, Hv*dv] -> [N, H]"""
        n = core.shape[0]
        core = core.to(dtype)
        o = gated_rms_norm(core, z.view(n, self.hv, self.dv), self.norm_w, self.eps)
        return linear(o.reshape(n, self.hv * self.dv), self.w_out)

    def _conv_in(self, x: torch.Tensor, conv_state: torch.Tensor):
        """The in-projection and causal conv of a chunk x [N, H] after conv_state [C, K-1] ->
        (mixed [N, C] after the conv and SiLU, z [N, Hv*dv], b, a [N, Hv], raw [N, C]: the conv's
        inputs, from which the next conv state is taken: kernels/causal_conv.py conv_state_after,
        conv_sequence). On CUDA (unless FREETOKEN_PREFILL_KERNELS=0) one kernel (causal_conv_silu_triton),
        else the torch reference."""
        raw, z, b, a = self.in_proj(x)  # [N, C], [N, Hv*dv], [N, Hv], [N, Hv]
        if (use_triton(x) and prefill_kernels() and conv_state.dtype == raw.dtype and raw.stride(1) == 1
                and conv_state.stride(1) == 1 and self.conv_w.is_contiguous()):  # what the kernel takes
            from ..kernels.causal_conv import causal_conv_silu_triton
            mixed = causal_conv_silu_triton(raw, conv_state, self.conv_w, self.conv_b)
        else:
            mixed = causal_conv_silu_torch(raw, conv_state, self.conv_w, self.conv_b)
        return mixed, z, b, a, raw

    def prefill(self, x: torch.Tensor, st: DecodeState, slot: int, start: int, capture=None) -> torch.Tensor:
        """x: [T, H] for one sequence, continuing from the state in `slot`. capture (a
        cache.prefix.StateCapture) receives the conv and recurrent state at its positions
        inside this chunk."""
        t = x.shape[0]
        cuts = capture.offsets(start, t) if capture is not None else []
        if self.prefill_graphs is not None and not cuts:  # a captured graph of this chunk's bucket
            y = self.prefill_graphs.run_mixer(self, x, st.conv[self.layer][slot], st.rec[self.layer][slot])
            if y is not None:
                return y
        conv_state = st.conv[self.layer][slot]  # [C, K-1]
        mixed, z, b, a, raw = self._conv_in(x, conv_state)  # mixed, raw [T, C]
        seq = conv_sequence(raw, conv_state) if cuts else None  # [C, K-1+T]: the checkpoints' conv states
        conv_state.copy_(seq[:, t:] if seq is not None else conv_state_after(raw, conv_state))
        rec = st.rec[self.layer][slot]  # [Hv, dk, dv] fp32
        done = None
        if self.fla and fla_delta.available(x):  # CUDA: flash-linear-attention's kernels (kernels/fla_delta.py)
            q, k, v, g, beta = self._raw_heads(mixed, a, b)
            done = fla_delta.try_chunk_delta_fla(q, k, v, g, beta, rec, self.dk ** -0.5, cuts)
        if done is not None:
            core, new, snaps = done
        else:
            q, k, v, g, beta = self._gates_and_heads(mixed, a, b)
            with flushed(x.device):  # its decays' products are fp32 denormals (experts/cpu/denormals.h)
                core, new, snaps = chunk_gated_delta_rule(q, k, v, g, beta, rec, cuts=cuts)
        rec.copy_(new)
        w = conv_state.shape[1]
        for c, snap in zip(cuts, snaps):  # conv state after c tokens: the K-1 inputs before it
            capture.store(self.layer, start + c, seq[:, c:c + w], snap)
        return self._finish(core, z, x.dtype)

    def prefill_padded(self, x: torch.Tensor, n: torch.Tensor, rows: torch.Tensor, conv_state: torch.Tensor,
                       rec: torch.Tensor) -> torch.Tensor:
        """prefill() of a chunk in the first n rows of x, static shapes and no host sync (what a
        prompt chunk's graph records: runtime/prefill_graphs.py). x: [B, H]; n: device scalar,
        1 <= n <= B; rows: arange(B) on the device; conv_state [C, K-1] and rec [Hv, dk, dv] fp32,
        one sequence's, updated in place. The rows >= n get decay 0 and beta 0: they neither
        decay nor write the recurrent state (as the chunk rule's own padding), and the conv
        state is the K-1 inputs before row n. -> [B, H], rows >= n meaningless."""
        w = conv_state.shape[1]
        mixed, z, b, a, raw = self._conv_in(x, conv_state)  # mixed, raw [B, C]
        seq = conv_sequence(raw, conv_state)  # [C, K-1+B]
        # column c of seq is input c - w: the inputs n-w .. n-1 are columns n .. n+w-1
        conv_state.copy_(seq.index_select(1, n + rows[:w]))
        real = (rows < n)[:, None]  # [B, 1]
        done = None
        if self.fla and fla_delta.available(x):
            q, k, v, g, beta = self._raw_heads(mixed, a, b)
            done = fla_delta.try_chunk_delta_fla(q, k, v, g * real, beta * real, rec, self.dk ** -0.5)
        if done is None:
            q, k, v, g, beta = self._gates_and_heads(mixed, a, b)
            with flushed(x.device):
                done = chunk_gated_delta_rule(q, k, v, g * real, beta * real, rec)
        core, new, _ = done
        rec.copy_(new)
        return self._finish(core, z, x.dtype)

    def _decode_host(self, mixed, z, b, a, conv_state, rec, active):
        """The decode step between the projections by the C++ kernel (experts/cpu/deltanet.h): the
        torch path's ~40 small ops and five passes over the recurrent state in one call, the conv
        window and state stepped in place in the active rows. -> the gated-normed readout [B,
        Hv*dv] in mixed's dtype, or None where the kernel does not serve (the extension not
        built, another dtype: then the torch path)."""
        from ..experts import cpu
        ext = cpu.extension() if cpu.DECODE_KERNELS else None
        dt = mixed.dtype
        if (ext is None or dt not in (torch.float32, torch.bfloat16) or conv_state.dtype != dt
                or self.conv_w.device.type != "cpu" or b.stride(0) != a.stride(0)  # one GEMM's views (not
                # so where FP8 dense weights split the in-projection's runs: the torch path then)
                or rec.dtype != torch.float32 or self.conv_w.dtype != dt
                or (self.conv_b is not None and self.conv_b.dtype != dt)):
            return None
        if self._host_args is None:  # the layer's constants as the kernel reads them, made once
            self._host_args = (self.conv_w.contiguous(),
                               self.conv_b.contiguous() if self.conv_b is not None else torch.empty(0, dtype=dt),
                               self.neg_a.float().contiguous(), self.dt_bias.float().contiguous(),
                               self.norm_w.float().contiguous(), self.norm_w.dtype == dt)
        cw, cb, neg_a, dt_bias, norm_w, norm_rounds = self._host_args
        act = torch.empty(0, dtype=torch.bool) if active is None else active.to("cpu", torch.bool).contiguous()
        return ext.deltanet_decode(mixed, z, b, a, conv_state, cw, cb, neg_a, dt_bias, rec, norm_w, norm_rounds,
                                   self.eps, self.hk, self.dk, act)

    def decode(self, x: torch.Tensor, st: DecodeState, pos: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, H], one token per slot. active: [B] bool; inactive rows leave their state alone
        (a slot mid-prefill keeps what it has)."""
        bsz = x.shape[0]
        mixed, z, b, a = self.in_proj(x)  # [B, C], [B, Hv*dv], [B, Hv], [B, Hv]
        conv_state = st.conv[self.layer][:bsz]  # [B, C, K-1]
        if self.fusable and use_triton(x):
            from ..kernels.deltanet_decode import conv_update_triton, delta_step_triton
            mixed = conv_update_triton(mixed, conv_state, self.conv_w, active)
            o = delta_step_triton(mixed, z, b, a, self.neg_a, self.dt_bias, st.rec[self.layer][:bsz],
                                  self.norm_w, self.eps, self.hk, self.hv, self.dk, self.dv, active)
            return linear(o, self.w_out)
        if x.device.type == "cpu":
            out = self._decode_host(mixed, z, b, a, conv_state, st.rec[self.layer], active)
            if out is not None:
                return linear(out, self.w_out)
        window = torch.cat([conv_state, mixed[..., None].to(conv_state.dtype)], dim=-1)  # [B, C, K]
        conv = (window * self.conv_w).sum(-1)
        if self.conv_b is not None:
            conv = conv + self.conv_b
        mixed = F.silu(conv).to(x.dtype)
        q, k, v, g, beta = self._gates_and_heads(mixed, a, b)
        rec = st.rec[self.layer][:bsz]
        core, new = recurrent_gated_delta_step(q, k, v, g, beta, rec)
        if active is None:
            conv_state.copy_(window[..., 1:])
            rec.copy_(new)
        elif x.is_cuda:  # no host sync: the step may be captured in a graph
            keep = active[:, None, None]
            conv_state.copy_(torch.where(keep, window[..., 1:], conv_state))
            rec.copy_(torch.where(keep[..., None], new, rec))
        else:  # the decoding rows only: a slot mid-prefill may be written meanwhile by a prompt
            rows = active.nonzero()[:, 0]  # forward on another thread (runtime/overlap.py)
            conv_state[rows] = window[rows, :, 1:]
            rec[rows] = new[rows].to(rec.dtype)
        return self._finish(core, z, x.dtype)
