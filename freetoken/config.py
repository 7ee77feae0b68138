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
    # Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers with its DeltaNet input projections
    # fused per key-head group (weights/hf.py qwen3_next_split reads them apart) and optional
    # dense-MLP layers (mlp_only_layers, decoder_sparse_step)
    "Qwen3NextForCausalLM": "qwen3_5_moe",
    "qwen3_next": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
    "gpt_oss": "gpt_oss",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
    "glm_moe_dsa": "glm_moe_dsa",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "deepseek_v4": "deepseek_v4",
}
ARCHS = ("qwen3_5_moe", "qwen3_moe", "gpt_oss", "glm_moe_dsa", "deepseek_v4")
# per layer: softmax attention over the whole context, over the last `sliding_window` keys, or
# gated DeltaNet (linear attention)
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ROPE_TYPES = ("default", "yarn")
EXPERT_ACTIVATIONS = ("silu", "swiglu_clamp", "silu_clamp")
SUPPORTED = sorted(set(k for k in ARCH_ALIASES if k[0].isupper()))


# sizes every family reads as integers: a string or a float there ("64", 64.0) made a bare
# TypeError (or a shape of strings) far from config.json
POSITIVE_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
         "shared_expert_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
         "num_experts_per_tok", "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads",
         "linear_key_head_dim", "linear_value_head_dim")


# the config.json field each family gives its routed-expert count in (for errors that name it)
EXPERT_COUNT_FIELD = {"qwen3_5_moe": "num_experts", "qwen3_moe": "num_experts", "gpt_oss": "num_local_experts",
                      "glm_moe_dsa": "n_routed_experts", "deepseek_v4": "n_routed_experts"}


def _sparse_layers(t: dict, num_layers: int, num_experts: int) -> list[int]:
    """Qwen3-MoE's and Qwen3-Next's MoE layers: where the sparse step and mlp_only_layers say so
    (a dense MLP elsewhere)."""
    only = set(t.get("mlp_only_layers") or [])
    step = t.get("decoder_sparse_step", 1) or 1
    return [i for i in range(num_layers) if i not in only and num_experts > 0 and (i + 1) % step == 0]


def _check_sizes(source: str, t: dict) -> None:
    for k in POSITIVE_SIZES + SIZES:
        v = t.get(k)
        if v is None:  # absent (a required one is named by the family's reading) or null
            continue
        low = 1 if k in POSITIVE_SIZES else 0
        if type(v) is not int or v < low:
            raise UnsupportedModelError(f"{source}: {k} must be an integer of at least {low}, got {v!r}; "
                                        "fix config.json")


@dataclass
class ModelConfig:
    arch: str  # "qwen3_5_moe" | "qwen3_moe" | "gpt_oss" | "glm_moe_dsa" | "deepseek_v4"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # rope_parameters / rope_scaling of config.json beyond theta (None: plain RoPE); "yarn":
    # factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, attention_factor,
    # mscale, mscale_all_dim, as transformers reads them (model/layers.py rope_frequencies)
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0  # fraction of head_dim that RoPE rotates
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator
    sliding_window: int | None = None  # keys a "sliding_attention" layer sees (the query's included)
    # per layer: one of LAYER_TYPES
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
    # "softmax_topk": softmax over every expert, then top-k (renormalised if norm_topk_prob);
    # "topk_softmax": top-k of the logits, then softmax over those k (GPT-OSS)
    router: str = "softmax_topk"
    router_bias: bool = False
    # the routed experts' function (experts/executor.py Activation): "silu" = silu(g) * u;
    # "swiglu_clamp" (GPT-OSS) = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),
    # g' = min(g, limit); expert_bias: gate_up and down projections have biases
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    moe_layers: list[int] = field(default_factory=list)  # layers with routed experts
    intermediate_size: int = 0  # dense MLP of the non-MoE layers
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the text config as read
    # ---- multi-head latent attention with the DSA indexer (glm_moe_dsa: model/mla.py) ----
    # kv_lora_rank 0: no latent attention. Queries go through a q_lora_rank bottleneck; each
    # head's query/key is qk_nope_head_dim without RoPE + qk_rope_head_dim with it (head_dim
    # is their sum), values v_head_dim; keys and values come from one cached latent per token
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # the indexer: its own heads score every earlier key, each query attends to its index_topk best
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # per layer: "full" runs its indexer, "shared" reuses the selection of the last full layer
    indexer_types: list[str] = field(default_factory=list)
    # router "sigmoid_group" (DeepSeek-V3 / GLM-5): sigmoid scores, a correction bias that steers
    # only the choice, the experts in n_group groups of which the topk_group best (by the sum of
    # their two best scores) are eligible, weights times routed_scaling_factor; n_shared_experts
    # plain SwiGLU shared experts of moe_intermediate_size each, fused into one
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # ---- DeepSeek-V4 (deepseek_v4: model/deepseek_v4.py, model/csa.py, model/hyper.py) ----
    # per layer: "none" (sliding window only), "csa" (+ entries compressed from overlapping windows
    # of compress_rate_csa tokens, picked by the indexer: index_topk of them) or "hca" (+ every
    # entry of non-overlapping windows of compress_rate_hca tokens); all keep the sliding window
    compressed_attention: list[str] = field(default_factory=list)
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    compress_rope_theta: float = 160000.0  # the compressed layers' RoPE base (rope_scaling: its YaRN)
    hc_mult: int = 1  # hyper-connection residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    o_groups: int = 1  # grouped low-rank output projection: groups, rank of each
    o_lora_rank: int = 0
    # router "noaux_topk": score_fn(x W^T) with score_fn scoring_func ("sigmoid" | "sqrtsoftplus"),
    # top-k of score + correction bias, weights the chosen scores renormalised, times
    # routed_scaling_factor; the hash_layers pick their experts by token id (gate.tid2eid)
    scoring_func: str = "sigmoid"
    hash_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise UnsupportedModelError(f"unsupported architecture {self.arch!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}")
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        bad = set(self.layer_types) - set(LAYER_TYPES)
        if bad:
            raise UnsupportedModelError(f"unsupported layer types {sorted(bad)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UnsupportedModelError("sliding_attention layers need a sliding_window")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported expert activation {self.expert_activation!r}")
        if self.router not in ("softmax_topk", "topk_softmax", "sigmoid_group", "noaux_topk"):
            raise UnsupportedModelError(f"unsupported router {self.router!r}")
        if self.moe_layers and (self.num_experts or 0) < 1:  # MoE layers of no experts (0, or null)
            field_name = EXPERT_COUNT_FIELD.get(self.arch, "num_experts")
            raise UnsupportedModelError(
                f"config.json: {field_name}={self.num_experts}, but {len(self.moe_layers)} layers are MoE layers: "
                f"each needs at least num_experts_per_tok routed experts; fix {field_name} in config.json")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.router == "sigmoid_group":
            self._check_groups()
        if self.kv_lora_rank:
            self._check_latent()

    def _check_groups(self) -> None:
        e, g, tg = self.num_experts, self.n_group, self.topk_group
        if g < 1 or e % g or e // g < 2:  # a group's score is the sum of its two best experts
            raise UnsupportedModelError(f"n_group={g} must divide n_routed_experts={e} into groups of 2 or more")
        if not 1 <= tg <= g or self.top_k > tg * (e // g):
            raise UnsupportedModelError(
                f"topk_group={tg} groups of {e // g} experts cannot hold num_experts_per_tok={self.top_k}")

    def _check_latent(self) -> None:
        if not self.q_lora_rank:
            raise UnsupportedModelError("latent attention without q_lora_rank (uncompressed queries) is not supported")
        if self.qk_rope_head_dim % 2 or self.index_head_dim < self.qk_rope_head_dim:
            raise UnsupportedModelError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and fit index_head_dim={self.index_head_dim}")
        if len(self.indexer_types) != self.num_layers or set(self.indexer_types) - {"full", "shared"}:
            raise UnsupportedModelError(
                f"indexer_types must give 'full' or 'shared' for each of {self.num_layers} layers")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise UnsupportedModelError("the first layer's indexer cannot be 'shared': no earlier layer selects for it")
        if self.index_topk < 1:
            raise UnsupportedModelError(f"index_topk={self.index_topk} must be positive")

    # ---- derived shapes -------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> list[int]:
        """Softmax attention layers (full or sliding): the ones with K/V pages."""
        return [i for i, t in enumerate(self.layer_types) if t != "linear_attention"]

    def window(self, layer: int) -> int | None:
        """Keys the attention layer `layer` sees (None: the whole context)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

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
        if name in ("Qwen3NextForCausalLM", "qwen3_next"):  # what _from_text and convert key Qwen3-Next's reading on
            text = {**text, "model_type": "qwen3_next"}
        _check_sizes(source, text)
        try:
            return cls._from_text(arch, text)
        except KeyError as e:
            raise UnsupportedModelError(f"{source}: missing field {e.args[0]!r}") from None

    @classmethod
    def _from_text(cls, arch: str, t: dict) -> "ModelConfig":
        if arch == "deepseek_v4":  # its rope parameters nest per rope kind: read apart
            return cls._deepseek_v4(t)
        rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported yet")
        theta = rope.get("rope_theta", t.get("rope_theta", 150000.0 if arch == "gpt_oss" else 10000.0))
        scaling = None
        if rope_type == "yarn" and arch == "glm_moe_dsa":  # transformers also scales its softmax (mscale): not here
            raise UnsupportedModelError("rope type 'yarn' is not supported for GLM-MoE-DSA yet (its latent attention "
                                        "would need YaRN's softmax scale too); remove rope_scaling to run its native context")
        if rope_type == "yarn":  # Qwen3's documented long-context setting, GPT-OSS's own
            if not rope.get("original_max_position_embeddings"):
                raise UnsupportedModelError("yarn rope scaling needs original_max_position_embeddings")
            for k in ("factor", "original_max_position_embeddings"):
                v = rope.get(k)
                if v is not None and (type(v) not in (int, float) or v <= 0):
                    raise UnsupportedModelError(f"yarn rope scaling: {k} must be a positive number, got {v!r}; "
                                                "fix config.json")
            keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                    "attention_factor", "mscale", "mscale_all_dim")
            scaling = {"rope_type": "yarn", **{k: rope[k] for k in keep if rope.get(k) is not None}}
            if scaling.get("factor") is None:  # as transformers: the context's stretch
                orig = scaling["original_max_position_embeddings"]
                scaling["factor"] = t.get("max_position_embeddings", 32768) / orig
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
            # YaRN stretches the original context `factor` times: Qwen3 turns it on in rope_scaling and
            # leaves max_position_embeddings at its native 40,960 (vLLM serves factor x original too)
            max_position_embeddings=max(t.get("max_position_embeddings", 32768),
                                        int(scaling["factor"] * scaling["original_max_position_embeddings"])
                                        if scaling else 0),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            attention_bias=bool(t.get("attention_bias", arch == "gpt_oss")),
            num_experts=num_experts, top_k=t.get("num_experts_per_tok", 0),
            moe_intermediate_size=t.get("moe_intermediate_size", 0), rope_scaling=scaling,
            eos_token_ids=eos, raw=t)
        if t.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {t['hidden_act']!r} is not supported")
        if arch == "gpt_oss":
            # alternating sliding-window and full attention with sinks; every layer routed
            # experts of `intermediate_size`, biased, with the clamped SwiGLU; no dense MLP
            types = t.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                             for i in range(num_layers)]
            common["moe_intermediate_size"] = t["intermediate_size"]
            return cls(
                **common, layer_types=list(types), sliding_window=t.get("sliding_window", 128),
                partial_rotary_factor=rope.get("partial_rotary_factor", 1.0), attention_sinks=True,
                router="topk_softmax", router_bias=True, expert_activation="swiglu_clamp",
                swiglu_alpha=float(t.get("swiglu_alpha", 1.702)), swiglu_limit=float(t.get("swiglu_limit", 7.0)),
                expert_bias=True, moe_layers=list(range(num_layers)))
        if arch == "qwen3_5_moe":
            types = t.get("layer_types")
            if types is None:
                every = t.get("full_attention_interval", 4)
                types = ["linear_attention" if (i + 1) % every else "full_attention"
                         for i in range(num_layers)]
            moe_layers, dense, norm_topk = list(range(num_layers)), {}, True  # Qwen3.5 always renormalises
            if t.get("model_type") == "qwen3_next":  # Qwen3-Next may make layers dense, as Qwen3-MoE
                moe_layers = _sparse_layers(t, num_layers, num_experts)
                dense = dict(intermediate_size=t["intermediate_size"] if len(moe_layers) < num_layers else 0)
                norm_topk = bool(t.get("norm_topk_prob", True))
            return cls(
                **common, layer_types=list(types), **dense,
                partial_rotary_factor=rope.get("partial_rotary_factor",
                                               t.get("partial_rotary_factor", 0.25)),
                linear_num_key_heads=t["linear_num_key_heads"],
                linear_num_value_heads=t["linear_num_value_heads"],
                linear_key_head_dim=t["linear_key_head_dim"],
                linear_value_head_dim=t["linear_value_head_dim"],
                linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
                norm_topk_prob=norm_topk,
                shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 0),
                moe_layers=moe_layers)
        if arch == "glm_moe_dsa":
            return cls._glm_moe_dsa(common, t)
        # qwen3_moe: every layer full attention; MoE where the sparse step and
        # mlp_only_layers say so, a dense MLP elsewhere
        moe_layers = _sparse_layers(t, num_layers, num_experts)
        window = t.get("sliding_window") if t.get("use_sliding_window") else None
        return cls(
            **common, layer_types=["sliding_attention" if window else "full_attention"] * num_layers,
            partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
            norm_topk_prob=bool(t.get("norm_topk_prob", False)),
            moe_layers=moe_layers, intermediate_size=t.get("intermediate_size", 0),
            sliding_window=window)

    @classmethod
    def _glm_moe_dsa(cls, common: dict, t: dict) -> "ModelConfig":
        """GLM-5 (transformers GlmMoeDsaConfig): every layer latent attention with the DSA indexer
        ("full_attention" for the cache: paged, the whole context), the first
        first_k_dense_replace layers (or mlp_layer_types) a dense MLP, the rest routed experts
        behind the sigmoid group-limited router, plus shared experts. The MTP layers a release
        ships past num_hidden_layers are not read (weights/convert.py says so)."""
        n = common["num_layers"]
        mlp = t.get("mlp_layer_types")
        if mlp is None:
            dense = min(t.get("first_k_dense_replace", 3), n)
            mlp = ["dense"] * dense + ["sparse"] * (n - dense)
        idx = t.get("indexer_types")
        if idx is None:  # as transformers derives it: a pattern, or a frequency with an offset
            pattern = t.get("index_topk_pattern")
            if pattern is not None:
                idx = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            else:
                freq, off = max(t.get("index_topk_freq", 1), 1), t.get("index_skip_topk_offset", 2)
                idx = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]
        nope, rope = t["qk_nope_head_dim"], t["qk_rope_head_dim"]
        shared = t.get("n_shared_experts", 1) or 0  # defaults as transformers' GlmMoeDsaConfig
        common.update(head_dim=nope + rope, num_kv_heads=t["num_attention_heads"],
                      num_experts=t.get("n_routed_experts", common["num_experts"]),
                      rms_norm_eps=t.get("rms_norm_eps", 1e-5))
        return cls(
            **common, layer_types=["full_attention"] * n, intermediate_size=t.get("intermediate_size", 0),
            moe_layers=[i for i, k in enumerate(mlp) if k == "sparse"],
            norm_topk_prob=bool(t.get("norm_topk_prob", True)), router="sigmoid_group",
            n_group=t.get("n_group", 1) or 1, topk_group=t.get("topk_group", 1) or 1,
            routed_scaling_factor=float(t.get("routed_scaling_factor", 2.5)), n_shared_experts=shared,
            shared_expert_intermediate_size=common["moe_intermediate_size"] * shared,
            q_lora_rank=t.get("q_lora_rank") or 0, kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=nope,
            qk_rope_head_dim=rope, v_head_dim=t["v_head_dim"], index_n_heads=t["index_n_heads"],
            index_head_dim=t["index_head_dim"], index_topk=t["index_topk"], indexer_types=list(idx))

    @classmethod
    def _deepseek_v4(cls, t: dict) -> "ModelConfig":
        """DeepSeek-V4 (transformers DeepseekV4Config), its defaults and its legacy keys
        (compress_ratios, compress_rate_csa/_hca, num_hash_layers, qk_rope_head_dim, a flat
        rope_scaling) read as transformers reads them. Every layer keeps a sliding window
        ("sliding_attention" for the cache: every token's row in the pages); the compressed
        branch per layer in compressed_attention. Every layer routed experts (the first
        num_hash_layers by token id) plus one shared expert. The MTP layers are not read."""
        n = t["num_hidden_layers"]
        rates = dict(t.get("compress_rates") or {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
        rates["compressed_sparse_attention"] = t.get("compress_rate_csa") or rates.get("compressed_sparse_attention", 4)
        rates["heavily_compressed_attention"] = t.get("compress_rate_hca") or rates.get("heavily_compressed_attention", 128)
        kinds = {"sliding_attention": "none", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
        types = t.get("layer_types")
        if types is None and t.get("compress_ratios") is not None:
            by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
            bad = sorted(set(t["compress_ratios"]) - set(by_ratio))
            if bad:
                raise UnsupportedModelError(f"compress_ratios {bad}: DeepSeek-V4 knows 0, 4 and 128")
            types = [by_ratio[r] for r in t["compress_ratios"]]
        if types is None:  # transformers' default: two HCA layers, then CSA and HCA in turn
            types = ["heavily_compressed_attention"] * min(n, 2) + [
                "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
        types = list(types[:n])
        if len(types) != n or set(types) - set(kinds):
            raise UnsupportedModelError(f"layer_types must give one of {sorted(kinds)} for each of {n} layers")
        mlp = t.get("mlp_layer_types")
        if mlp is None:
            hashed = t.get("num_hash_layers")
            hashed = 3 if hashed is None else hashed
            mlp = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
        mlp = list(mlp[:n])
        if len(mlp) != n or set(mlp) - {"hash_moe", "moe"}:
            raise UnsupportedModelError(f"mlp_layer_types must give 'hash_moe' or 'moe' for each of {n} layers")
        head_dim = t.get("head_dim") or 512
        prf = t.get("partial_rotary_factor")
        if prf is None:
            prf = t["qk_rope_head_dim"] / head_dim if t.get("qk_rope_head_dim") else 64 / 512
        rd = int(head_dim * prf)
        main, compress = cls._dsv4_rope(t)
        scoring = t.get("scoring_func", "sqrtsoftplus")
        if scoring not in ("sigmoid", "sqrtsoftplus"):
            raise UnsupportedModelError(f"scoring_func {scoring!r} is not supported (sigmoid, sqrtsoftplus)")
        for key in ("mlp_bias", "attention_bias"):
            if t.get(key):
                raise UnsupportedModelError(f"{key}=true is not supported for deepseek_v4")
        if t.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {t['hidden_act']!r} is not supported")
        eos = t.get("eos_token_id", 1)
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        experts = t.get("n_routed_experts", 256)
        inter = t.get("moe_intermediate_size", 2048)
        cfg = cls(
            arch="deepseek_v4", vocab_size=t.get("vocab_size", 129280), hidden_size=t.get("hidden_size", 4096),
            num_layers=n, num_heads=t.get("num_attention_heads", 64), num_kv_heads=1, head_dim=head_dim,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=main, rope_scaling=compress[1],
            partial_rotary_factor=prf, max_position_embeddings=t.get("max_position_embeddings", 1048576),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            sliding_window=t.get("sliding_window", 128), layer_types=["sliding_attention"] * n,
            num_experts=experts, top_k=t.get("num_experts_per_tok", 6), moe_intermediate_size=inter,
            norm_topk_prob=True,  # the V4 routers always renormalise (transformers ignores the key)
            router="noaux_topk", scoring_func=scoring, routed_scaling_factor=float(t.get("routed_scaling_factor", 1.5)),
            # routed and shared experts clamp gate and up at swiglu_limit before silu(g) * u
            expert_activation="silu_clamp", swiglu_limit=float(t.get("swiglu_limit", 10.0)),
            n_shared_experts=1, shared_expert_intermediate_size=inter,  # one shared MLP, as transformers builds
            moe_layers=list(range(n)), hash_layers=[i for i, k in enumerate(mlp) if k == "hash_moe"],
            eos_token_ids=eos, raw=t, q_lora_rank=t.get("q_lora_rank", 1024), qk_rope_head_dim=rd,
            index_n_heads=t.get("index_n_heads", 64), index_head_dim=t.get("index_head_dim", 128),
            index_topk=t.get("index_topk", 512), compressed_attention=[kinds[k] for k in types],
            compress_rate_csa=rates["compressed_sparse_attention"],
            compress_rate_hca=rates["heavily_compressed_attention"], compress_rope_theta=compress[0],
            hc_mult=t.get("hc_mult", 4), hc_sinkhorn_iters=t.get("hc_sinkhorn_iters", 20),
            hc_eps=float(t.get("hc_eps", 1e-6)), o_groups=t.get("o_groups", 8), o_lora_rank=t.get("o_lora_rank", 1024))
        cfg._check_dsv4()
        return cfg

    @staticmethod
    def _dsv4_rope(t: dict) -> tuple[float, tuple[float, dict | None]]:
        """-> (main theta, (compress theta, compress YaRN or None)). Sliding-only layers rotate with
        plain RoPE at rope_theta; compressed layers at compress_rope_theta with the config's YaRN,
        whose cos/sin transformers leaves unscaled (attention_factor 1 unless given)."""
        rp = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, comp = rp["main"], dict(rp["compress"])
        else:
            main = {"rope_type": "default", "rope_theta": t.get("rope_theta", 10000.0)}
            comp = {k: v for k, v in rp.items() if k not in ("main", "compress", "rope_theta")}
            comp["rope_theta"] = t.get("compress_rope_theta", 160000.0)
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise UnsupportedModelError("deepseek_v4: only plain RoPE is supported for the sliding layers ('main')")
        kind = comp.get("rope_type", comp.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {kind!r} is not supported yet")
        scaling = None
        if kind == "yarn":
            if not comp.get("original_max_position_embeddings") or comp.get("factor") is None:
                raise UnsupportedModelError("yarn rope scaling needs factor and original_max_position_embeddings")
            keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "mscale",
                    "mscale_all_dim")
            scaling = {"rope_type": "yarn", **{k: comp[k] for k in keep if comp.get(k) is not None},
                       "attention_factor": comp.get("attention_factor", 1.0)}
        return float(main.get("rope_theta", 10000.0)), (float(comp.get("rope_theta", 160000.0)), scaling)

    def _check_dsv4(self) -> None:
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise UnsupportedModelError(
                f"the rotary dims ({self.qk_rope_head_dim}) must be even and fit head_dim and index_head_dim")
        if self.o_groups < 1 or (self.num_heads * self.head_dim) % self.o_groups or self.o_lora_rank < 1:
            raise UnsupportedModelError(f"o_groups={self.o_groups} must divide the heads' output into groups")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise UnsupportedModelError("hc_mult and hc_sinkhorn_iters must be positive")
        if self.index_topk < 1 or self.compress_rate_csa < 1 or self.compress_rate_hca < 1 or not self.q_lora_rank:
            raise UnsupportedModelError("index_topk, the compress rates and q_lora_rank must be positive")
