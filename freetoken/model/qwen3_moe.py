"""Qwen3 MoE (transformers Qwen3MoeForCausalLM): full attention with q/k norms, full RoPE,
routed experts (optionally top-k renormalised), dense MLP on mlp_only_layers."""
from .base import DecoderModel


class Qwen3MoeModel(DecoderModel):
    one_centered_norm = False
    gated_attention = False
