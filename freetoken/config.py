"""ModelConfig: the architecture, read from a checkpoint's config.json.

One dataclass covers the supported families; the architecture file (model/*.py) decides which
fields it uses. Unknown architectures and options fail here with a clear error, before any
weight is touched.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedModelError

# config.json "architectures" / "model_type" -> our architecture name
ARCH_ALIASES = {
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_moe": "qwen3_moe",
}
SUPPORTED = sorted(set(k for k in ARCH_ALIASES if k[0].isupper()))


@dataclass
class ModelConfig:
    arch: str  # "qwen3_5_moe" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None  # None: every attention layer sees the whole context
    # per layer: "full_attention" | "linear_attention" (gated DeltaNet)
    layer_types: list[str] = field(default_factory=list)
    # gated DeltaNet (linear attention) shape
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_layers: list[int] = field(default_factory=list)  # layers with routed experts
    intermediate_size: int = 0  # dense MLP of the non-MoE layers
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the text config as read

    def __post_init__(self):
        if self.arch not in ("qwen3_5_moe", "qwen3_moe"):
            raise UnsupportedModelError(f"unsupported architecture {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - {"full_attention", "linear_attention"}
        if bad:
            raise UnsupportedModelError(f"unsupported layer types {sorted(bad)}")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")

    # ---- derived shapes -------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def num_flat_experts(self) -> int:
        """First dimension of every expert bank: flat id = moe_ordinal * E + e."""
        return len(self.moe_layers) * self.num_experts

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d

    # ---- reading config.json ----------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        """Build from a transformers config.json dict (plain or multimodal wrapper)."""
        archs = cfg.get("architectures") or []
        name = next((a for a in archs if a in ARCH_ALIASES), None)
        if name is None:
            name = cfg.get("model_type")
        arch = ARCH_ALIASES.get(name or "")
        if arch is None:
            got = ", ".join(archs) or cfg.get("model_type") or "nothing"
            raise UnsupportedModelError(
                f"{source}: architecture {got} is not supported; FreeToken serves "
                f"{', '.join(SUPPORTED)}")
        text = cfg.get("text_config") or cfg
        if isinstance(text, dict) and "text_config" in cfg:
            # the multimodal wrapper keeps eos and friends on the outer dict at times
            text = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
        try:
            return cls._from_text(arch, text)
        except KeyError as e:
            raise UnsupportedModelError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def _from_text(cls, arch: str, t: dict) -> "ModelConfig":
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported yet")
        theta = rope.get("rope_theta", t.get("rope_theta", 10000.0))
        num_layers = t["num_hidden_layers"]
        head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
        eos = t.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_experts = t.get("num_experts", t.get("num_local_experts", 0)) or 0
        common = dict(
            arch=arch, vocab_size=t["vocab_size"], hidden_size=t["hidden_size"],
            num_layers=num_layers, num_heads=t["num_attention_heads"],
            num_kv_heads=t.get("num_key_value_heads") or t["num_attention_heads"],
            head_dim=head_dim, rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=theta,
            max_position_embeddings=t.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attention_bias=bool(t.get("attention_bias", False)),
            num_experts=num_experts, top_k=t.get("num_experts_per_tok", 0),
            moe_intermediate_size=t.get("moe_intermediate_size", 0),
            eos_token_ids=eos, raw=t)
        if t.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {t['hidden_act']!r} is not supported")
        if arch == "qwen3_5_moe":
            types = t.get("layer_types")
            if types is None:
                every = t.get("full_attention_interval", 4)
                types = ["linear_attention" if (i + 1) % every else "full_attention"
                         for i in range(num_layers)]
            return cls(
                **common, layer_types=list(types),
                partial_rotary_factor=rope.get("partial_rotary_factor",
                                               t.get("partial_rotary_factor", 0.25)),
                linear_num_key_heads=t["linear_num_key_heads"],
                linear_num_value_heads=t["linear_num_value_heads"],
                linear_key_head_dim=t["linear_key_head_dim"],
                linear_value_head_dim=t["linear_value_head_dim"],
                linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
                norm_topk_prob=True,
                shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 0),
                moe_layers=list(range(num_layers)))
        # qwen3_moe: every layer full attention; MoE where the sparse step and
        # mlp_only_layers say so, a dense MLP elsewhere
        only = set(t.get("mlp_only_layers") or [])
        step = t.get("decoder_sparse_step", 1) or 1
        moe_layers = [i for i in range(num_layers)
                      if i not in only and num_experts > 0 and (i + 1) % step == 0]
        window = t.get("sliding_window") if t.get("use_sliding_window") else None
        return cls(
            **common, layer_types=["full_attention"] * num_layers,
            partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
            norm_topk_prob=bool(t.get("norm_topk_prob", False)),
            moe_layers=moe_layers, intermediate_size=t.get("intermediate_size", 0),
            sliding_window=window)
