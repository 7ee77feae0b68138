"""Qwen3.5 / Qwen3.6 MoE (transformers Qwen3_5MoeForCausalLM): gated DeltaNet and gated full
attention 3:1, partial RoPE, one-centered RMSNorm, routed experts plus a gated shared expert."""
from .base import DecoderModel


class Qwen3_5MoeModel(DecoderModel):
    one_centered_norm = True
    gated_attention = True
