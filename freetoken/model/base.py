"""The decoder stack shared by every supported architecture.

An architecture file supplies the per-layer token mixer (attention or gated DeltaNet), the
norm style and the list of tensors it expects; this file runs embedding -> layers -> norm ->
lm_head for a prefill chunk of one sequence or a decode step over all batch slots.
"""
from __future__ import annotations

import contextlib

import torch

from ..config import ModelConfig
from ..experts import split_experts
from ..kernels import split_keys
from .attention import Attention
from .deltanet import GatedDeltaNet
from .layers import Rope, add_rms_norm, lm_head, rms_norm
from .moe import DenseMLP, MoE, link_lookahead
from .state import DecodeState


def _key_points(hook, i: int):
    """The key pieces' hook of layer i (kernels/split_keys.py) in effect while its mixer runs:
    hook(split_keys.point(i, n)) before its n-th piece, n counting on across the segments of a
    batch (each long segment's attention splits on its own); nothing where hook is None."""
    if hook is None:
        return contextlib.nullcontext()
    n = 0

    def at(_piece: int) -> None:
        nonlocal n
        n += 1
        hook(split_keys.point(i, n))
    return split_keys.key_points(at)


def _expert_points(hook, i: int):
    """The expert pieces' hook of layer i (experts/split_experts.py) in effect while its MoE
    block runs: hook(split_experts.point(i, n)) before its n-th piece; nothing where hook is None."""
    if hook is None:
        return contextlib.nullcontext()
    return split_experts.expert_points(lambda n: hook(split_experts.point(i, n)))


class DecoderModel:
    one_centered_norm = False  # Qwen3.5 norms scale by (1 + w)
    gated_attention = False  # Qwen3.5 attention has a sigmoid output gate
    # True where a forward keeps its data in Python state its layers share (GLM-DSA's indexer
    # selections, DeepSeek-V4's token ids): two eager forwards at once would mix it
    per_forward_state = False
    # dense weights this code reads other than through linear() (model/linear.py), dequantized at
    # load even when the engine keeps dense FP8 (--dense-fp8; weights/reader.py dense_weights,
    # matched by the dotted parts of a name): the embedding is gathered by token id, the lm_head
    # (the embedding when tied) goes through lm_head()'s own CPU product, and routers keep the
    # dtype they route in (the DeepSeek family reads theirs in fp32). Releases publish all of
    # them unquantized; this only says what happens if one does not.
    DENSE_DEQUANT = ("embed_tokens", "lm_head", "gate", "router")
    # bf16 dense weights this code reads where a float32 model's activations would meet them
    # unwidened (an einsum, a cut into per-head operands): widened at load even where the engine
    # keeps bf16 weights under float32 (--dense-bf16; weights/reader.py dense_weights). linear(),
    # lm_head() and the embedding gather widen as they read, and routers read in fp32 are widened
    # by their .float() at construction.
    DENSE_WIDEN = ()

    def __init__(self, cfg: ModelConfig, w: dict, executor, device, dtype, max_pos: int):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, max_pos, device, dtype, cfg.rope_scaling)  # YaRN or plain
        ordinal = {l: i for i, l in enumerate(cfg.moe_layers)}
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            if kind == "linear_attention":
                mixer = GatedDeltaNet(cfg, w, i)
            else:
                mixer = Attention(cfg, w, i, self.rope, self.gated_attention, self.one_centered_norm)
            mlp = MoE(cfg, w, i, ordinal[i], executor) if i in ordinal else DenseMLP(w, i)
            p = f"model.layers.{i}."
            self.layers.append((mixer, mlp, w[p + "input_layernorm.weight"],
                                w[p + "post_attention_layernorm.weight"]))
        link_lookahead([layer[1] for layer in self.layers])

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> list[str]:
        """Non-expert tensor names the checkpoint must provide."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i, kind in enumerate(cfg.layer_types):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if kind == "linear_attention":
                a = p + "linear_attn."
                names += [a + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                          "in_proj_a.weight", "out_proj.weight", "conv1d.weight",
                                          "dt_bias", "A_log", "norm.weight")]
            else:
                a = p + "self_attn."
                names += [a + n + ".weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
                if cfg.attention_bias:  # transformers' Qwen3/Qwen3.5 attention biases o_proj too
                    names += [a + n + ".bias" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            m = p + "mlp."
            if i in cfg.moe_layers:
                names.append(m + "gate.weight")
                if cfg.shared_expert_intermediate_size:
                    names += [m + "shared_expert." + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
                    names.append(m + "shared_expert_gate.weight")
            else:
                names += [m + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
        return names

    def _stack(self, x: torch.Tensor, mix, phase: str, active=None, hook=None, mid_layer: bool = False,
               key_points: bool = False) -> torch.Tensor:
        """Embeddings [N, H] through every layer -> final-normed hidden states [N, H].

        Each residual add is fused with the norm that follows it (the next sub-layer's input
        norm, or the final norm): pre-norm blocks, the same arithmetic as the reference.
        hook(i), if given, runs before layer i (the prefill expert loader's schedule); with
        mid_layer also hook(i + 0.5) between layer i's token mixer and its MLP (the serving
        loop's decode steps: a finer grain than a layer, runtime/interleave.py); with key_points
        also hook(split_keys.point(i, n)) before the n-th key piece of a long context's attention,
        where it runs in pieces (kernels/split_keys.py: the CPU), and hook(split_experts.point(i, n))
        before the n-th piece of a prompt chunk's experts (experts/split_experts.py: the CPU executor)."""
        eps, oc = self.cfg.rms_norm_eps, self.one_centered_norm
        normed = rms_norm(x, self.layers[0][2], eps, oc)
        for i, (mixer, mlp, _, ln2) in enumerate(self.layers):
            if hook is not None:
                hook(i)
            with _key_points(hook if key_points else None, i):
                mixed = mix(mixer, normed)
            x, normed = add_rms_norm(x, mixed, ln2, eps, oc)
            if hook is not None and mid_layer:
                hook(i + 0.5)
            nxt = self.layers[i + 1][2] if i + 1 < len(self.layers) else self.norm
            with _expert_points(hook if key_points else None, i):
                y = mlp(normed, phase, active)
            x, normed = add_rms_norm(x, y, nxt, eps, oc)
        return normed

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, st: DecodeState, slot: int, start: int,
                all_logits: bool = False, logits: bool = True, capture=None) -> torch.Tensor | None:
        """tokens: [T] of one sequence at positions start.. (their pages already in the slot's
        block table) -> logits [T, V] or [1, V] (last); None with logits=False (a chunk that
        only fills the state: skips the lm_head GEMM). capture: recurrent-state checkpoints to
        take inside the chunk (cache.prefix)."""
        x = self.embed[tokens].to(self.dtype)  # [T, H]
        h = self._stack(x, lambda m, h: m.prefill(h, st, slot, start, capture), "prefill")
        if not logits:
            return None
        return lm_head(h if all_logits else h[-1:], self.lm_head).float()

    @torch.inference_mode()
    def prefill_batch(self, tokens: torch.Tensor, st: DecodeState, segs: list, hook=None,
                      mid_layer: bool = False, key_points: bool = False) -> torch.Tensor | None:
        """Prompt chunks of several sequences as one varlen forward: the dense layers and the
        experts see every token at once, attention and DeltaNet run per segment, in order
        (consecutive segments of one sequence: a layer-major pass, runtime/prefill_stream.py).
        tokens: [N] (the chunks back to back); segs: [(slot, start, length, capture, logits)];
        hook(i): called before layer i (and with mid_layer at i + 0.5, between its mixer and its
        MLP; with key_points between key pieces of a long context's attention: _stack)
        -> logits [S, V] of the last token of each segment with logits=True, or None."""
        x = self.embed[tokens].to(self.dtype)  # [N, H]
        ends = torch.tensor([s[2] for s in segs]).cumsum(0).tolist()
        bounds = list(zip([0] + ends[:-1], ends))

        def mix(m, h):
            if len(segs) == 1:
                slot, start, _, capture, _ = segs[0]
                return m.prefill(h, st, slot, start, capture)
            return torch.cat([m.prefill(h[a:b], st, slot, start, capture)
                              for (a, b), (slot, start, _, capture, _) in zip(bounds, segs)])
        h = self._stack(x, mix, "prefill", hook=hook, mid_layer=mid_layer, key_points=key_points and hook is not None)
        rows = [b - 1 for (_, b), seg in zip(bounds, segs) if seg[4]]
        if not rows:
            return None
        return lm_head(h[rows], self.lm_head).float()

    @torch.inference_mode()
    def forward_mixed(self, dec_tokens: torch.Tensor, st: DecodeState, pos: torch.Tensor, active: torch.Tensor,
                      pre_tokens: torch.Tensor, segs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decode step and prompt chunks in one forward (eager steps: the dense layers and the
        experts pay their fixed cost once for both). Rows 0..B-1 decode as in decode() (rows =
        slots, `active` masks the others); then the chunks as in prefill_batch().
        -> (decode logits [B, V], logits of the segments asking for them [S, V] or None)."""
        b = dec_tokens.shape[0]
        x = self.embed[torch.cat([dec_tokens, pre_tokens])].to(self.dtype)  # [B + N, H]
        ends = (torch.tensor([s[2] for s in segs]).cumsum(0) + b).tolist()
        bounds = list(zip([b] + ends[:-1], ends))

        def mix(m, h):
            return torch.cat([m.decode(h[:b], st, pos, active)] +
                             [m.prefill(h[lo:hi], st, slot, start, capture)
                              for (lo, hi), (slot, start, _, capture, _) in zip(bounds, segs)])
        routed = torch.cat([active, torch.ones(x.shape[0] - b, dtype=torch.bool, device=x.device)])
        h = self._stack(x, mix, "prefill", routed)
        rows = list(range(b)) + [hi - 1 for (_, hi), seg in zip(bounds, segs) if seg[4]]
        logits = lm_head(h[rows], self.lm_head).float()  # [B + S, V]
        return logits[:b], (logits[b:] if len(rows) > b else None)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, st: DecodeState, pos: torch.Tensor,
               active: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, pos: [B] (one per slot) -> logits [B, V]. Static shapes for a given B: no
        data-dependent Python branching, lengths are device data, so one captured graph
        serves every length. active [B] bool masks the rows that are not decoding (idle or
        mid-prefill slots): their state is untouched and they route to no expert."""
        x = self.embed[tokens].to(self.dtype)  # [B, H]
        h = self._stack(x, lambda m, h: m.decode(h, st, pos, active), "decode", active)
        return lm_head(h, self.lm_head).float()
