"""Per-sequence decode state, preallocated so that decode has static shapes.

A state has `slots` rows (one per sequence in the batch) and `max_len` positions. Attention
layers keep K/V; gated DeltaNet layers keep their causal-conv window and recurrent matrix.
Nothing here grows during decode: a CUDA graph can capture a step over these buffers.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig


def state_bytes(cfg: ModelConfig, slots: int, max_len: int, dtype) -> int:
    """What a DecodeState of this size allocates (to check it fits before allocating)."""
    el = torch.empty((), dtype=dtype).element_size()
    kv = 2 * len(cfg.attention_layers) * cfg.num_kv_heads * (max_len + 1) * cfg.head_dim * el
    conv = len(cfg.linear_layers) * cfg.conv_dim * max(cfg.linear_conv_kernel_dim - 1, 0) * el
    rec = len(cfg.linear_layers) * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return slots * (kv + conv + rec)


class DecodeState:
    def __init__(self, cfg: ModelConfig, slots: int, max_len: int, device, dtype):
        self.slots, self.max_len = slots, max_len
        # one extra position: decode rows that are not active write their K/V there
        self.scratch = max_len
        kv_shape = (slots, cfg.num_kv_heads, max_len + 1, cfg.head_dim)
        self.k = {i: torch.zeros(kv_shape, device=device, dtype=dtype) for i in cfg.attention_layers}
        self.v = {i: torch.zeros(kv_shape, device=device, dtype=dtype) for i in cfg.attention_layers}
        conv_shape = (slots, cfg.conv_dim, max(cfg.linear_conv_kernel_dim - 1, 0))
        rec_shape = (slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
        self.conv = {i: torch.zeros(conv_shape, device=device, dtype=dtype) for i in cfg.linear_layers}
        # the delta-rule state accumulates over the whole context: keep it in fp32
        self.rec = {i: torch.zeros(rec_shape, device=device, dtype=torch.float32)
                    for i in cfg.linear_layers}

    def reset(self, slot: int) -> None:
        """Forget a sequence (its K/V need no clearing: positions past the length are masked)."""
        for t in list(self.conv.values()) + list(self.rec.values()):
            t[slot].zero_()

    def nbytes(self) -> int:
        ts = [*self.k.values(), *self.v.values(), *self.conv.values(), *self.rec.values()]
        return sum(t.numel() * t.element_size() for t in ts)
