"""GLM-5 (transformers GlmMoeDsaForCausalLM, model_type glm_moe_dsa): every layer multi-head
latent attention with the DSA indexer (model/mla.py); the first first_k_dense_replace layers a
dense SwiGLU MLP, the others routed experts behind the sigmoid group-limited router plus shared
experts (model/deepseek_moe.py); plain RMSNorm, default RoPE on the rope part of each head.
The MTP layers a release ships past num_hidden_layers are not used."""
from ..config import ModelConfig
from .base import DecoderModel
from .deepseek_moe import DeepseekMoE
from .layers import Rope
from .mla import LatentAttention
from .moe import DenseMLP


class GlmMoeDsaModel(DecoderModel):
    per_forward_state = True  # self.share: one forward's indexer selections (runtime/overlap.py)
    # kv_b_proj is cut per head into the absorbed attention's two einsum operands (mla.py), and the
    # indexer's weights_proj is read in fp32: both dequantized at load
    DENSE_DEQUANT = DecoderModel.DENSE_DEQUANT + ("kv_b_proj", "weights_proj")
    DENSE_WIDEN = ("kv_b_proj", "weights_proj")  # the same two under --dense-bf16
    one_centered_norm = False
    gated_attention = False

    def __init__(self, cfg: ModelConfig, w: dict, executor, device, dtype, max_pos: int):
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, max_pos, device, dtype, cfg.rope_scaling)
        self.share: dict = {}  # a full indexer layer's selection, for the shared layers after it
        ordinal = {l: i for i, l in enumerate(cfg.moe_layers)}
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            mlp = DeepseekMoE(cfg, w, i, ordinal[i], executor) if i in ordinal else DenseMLP(w, i)
            self.layers.append((LatentAttention(cfg, w, i, self.rope, self.share), mlp,
                                w[p + "input_layernorm.weight"], w[p + "post_attention_layernorm.weight"]))

    def _stack(self, *args, **kw):
        self.share.clear()  # selections live for one forward
        return super()._stack(*args, **kw)

    @classmethod
    def expected_tensors(cls, cfg: ModelConfig) -> list[str]:
        """Non-expert tensors (the routed experts: weights/convert.py ExpertReader)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                      a + "q_a_layernorm.weight", a + "kv_a_layernorm.weight"]
            for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
                names.append(a + n + ".weight")
                if cfg.attention_bias and n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
                    names.append(a + n + ".bias")
            if cfg.indexer_types[i] == "full":
                names += [a + "indexer." + n for n in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                                       "k_norm.bias", "weights_proj.weight")]
            m = p + "mlp."
            if i in cfg.moe_layers:
                names += [m + "gate.weight", m + "gate.e_score_correction_bias"]
                if cfg.n_shared_experts:
                    names += [m + "shared_experts." + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
            else:
                names += [m + n + ".weight" for n in ("gate_proj", "up_proj", "down_proj")]
        return names
