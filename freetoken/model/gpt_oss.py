"""GPT-OSS (transformers GptOssForCausalLM): sliding-window (128) and full attention layers in
turn, both with q/k/v/o biases and a learned sink logit per head, YaRN RoPE, no q/k norms;
every layer routes to experts through a biased router (top-k of the logits, softmax over those
k), experts with biases and the clamped SwiGLU (the executor's Activation), no shared expert."""
from ..config import ModelConfig
from .attention import Attention
from .base import DecoderModel
from .layers import Rope
from .moe import MoE, link_lookahead


class GptOssModel(DecoderModel):
    one_centered_norm = False
    gated_attention = False

    def __init__(self, cfg: ModelConfig, w: dict, executor, device, dtype, max_pos: int):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, max_pos, device, dtype, cfg.rope_scaling)
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            self.layers.append((Attention(cfg, w, i, self.rope, False, False),
                                MoE(cfg, w, i, i, executor, router="router"),
                                w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]))
        link_lookahead([layer[1] for layer in self.layers])

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> list[str]:
        """Non-expert tensors (the experts and their biases: weights/convert.py ExpertReader)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      p + "self_attn.sinks", p + "mlp.router.weight", p + "mlp.router.bias"]
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.append(p + f"self_attn.{n}.weight")
                if cfg.attention_bias:
                    names.append(p + f"self_attn.{n}.bias")
        return names
