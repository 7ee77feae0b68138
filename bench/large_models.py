"""Decode tok/s of a slice of the full-size DeepSeek-V4-Flash, GLM-5 and Qwen3.6-35B-A3B shapes
(issues 14 and 12's benchmark): random weights made in place, experts in the published formats, batch 1.

Shapes: the defaults of transformers 5.x's `DeepseekV4Config` (DEEPSEEK_V4_FLASH: 43 layers,
hidden 4096, 256 experts of 4096 x 2048, top-6, the first 3 MoE layers hash-routed, CSA and HCA
attention over a sliding window of 128, 4 hyper-connection streams) and `GlmMoeDsaConfig`
(GLM5: 78 layers, hidden 6144, 256 experts of 6144 x 2048, top-8, the first 3 layers dense,
latent attention with the DSA indexer), and Qwen3.6-35B-A3B's text model (`--arch qwen3_5_moe`,
QWEN36: transformers' `Qwen3_5MoeTextConfig` defaults but for the release's rope theta 1e7 and
context; 40 layers, hidden 2048, 256 experts of 2048 x 512, top-8, a shared expert of 512, gated
DeltaNet layers with full attention every 4th), written out below as literal dicts; `--layers N`
keeps their first N layers (the per-layer lists cut to N; default 12, Qwen3.6 all 40). `--tiny`:
the same structure at hidden 256 with 16 experts (hash layers, dense layers, CSA/HCA, DSA,
DeltaNet and full attention all there), for a CPU.

Weights. The non-expert tensors are the ones `ft convert` would write for the slice: their names
and shapes come from the transformers model of the slice config built on the meta device (no
memory), its state_dict pushed through convert's own renaming (weights/hf.py canonical() and, for
DeepSeek-V4, deepseek_v4_name()) and checked against the model class's expected_tensors(); their
dtypes are what the engine's loader makes of them (weights/reader.py dense_weights: bf16, the
class's KEEP_FP32 modules and the routers' correction bias in fp32, DeepSeek-V4's token -> expert
tables as integers). Their values are random, made directly on the compute device (the hash
tables valid: k distinct experts per token). The dense weights are BF16, or with `--dense-format
fp8_block` their projections in FP8 as an FP8 release publishes them (Qwen3.6-FP8, DeepSeek-V4-Flash's
dense layers): kept, as the engine keeps them, or `fp8_dequant`, dequantized at load.
`--compute-dtype float32` runs the cpu-only rows as a CPU engine does (its bf16 2-D weights kept
bf16 and widened as read).
The routed experts: random banks in the published layout (bench/cpu_experts.py quantized_banks),
`--expert-format` mxfp4 (DeepSeek-V4-Flash's default), nvfp4 (GLM-5's default), bf16 (Qwen3.6's
default; Qwen also publishes FP8) or fp8_block, made one layer at a time on the device and copied
once into page-aligned host memory on huge pages, registered for DMA (cudaHostRegister), as the
engine's FTW banks are. A comma-separated list (`bf16,fp8_block,mxfp4,nvfp4`) measures each format
in turn in one call, the dense weights made once: one format's banks made, its rows run, the banks
freed before the next format's are made (host RAM and VRAM hold one format at a time); every row
carries `expert_format`, each format's own fields (pool_gb, expert_mb, banks_s, bp_gbs, bh_T_gbs,
...) are under `formats` (with one format also at the top, as before).

Modes (`--modes`, each row's `mode`), timed as bench/expert_cache.py times them (run_config: a
prompt prefilled, warm-up steps, then `--tokens` decode steps, each synchronised and its token
read, as the serving loop does; one CUDA graph per step where the executor allows it):
  resident   every expert in VRAM (TorchExpertExecutor; the quantized Triton kernels)
  cpu-only   every routed expert on the C++ CPU executor (`--threads`), the rest on the GPU; in
             stream order on CUDA (StreamedCpuExecutor: one graph)
  cache      the GPU expert cache, `--capacity` of the experts in slots, the adaptive split of the
             misses between fills and the CPU (warmed up until it has decided, at most
             `--cache-warmup` steps; `fill_share_chosen`, `miss_rate`)
A row that cannot run says so (`error`); a decode step that cannot be captured is timed eagerly
(`graph: false`, `graph_error`). Without CUDA every mode runs on the CPU (tiny shapes only).
Floors (`floor_ms`, `of_floor` = floor / measured): resident: the active bytes of a step (every
non-expert weight but one embedding row, the top-k experts of each MoE layer, an approximate
KV/indexer read, DeltaNet's fp32 state read and written) over the device read bandwidth measured
here; cpu-only: the expert bytes of a step over B_H (the C++ executor's read rate on these experts
at that thread count, measured here on each format's banks);
cache: the resident step (the resident row's, else its floor) plus the step's missed expert bytes
over B_P + B_H (B_P: the zero-copy fill kernel's rate, measured here).

`--llamacpp` (the qwen3_5_moe shape; bf16 or mxfp4 experts): llama.cpp side by side on the same
values (bench/llamacpp.py: its converter writes our dense weights as BF16 and MXFP4 banks as ggml
MXFP4, a lossless repack, checked against our logits by `python -m bench.llamacpp --check
--experts mxfp4`), llama-bench timed before our rows with -ncmoe giving it the cache's share of the
experts in VRAM (whole layers: 0.375 of 40 layers is 15) and every layer's experts on the CPU for
cpu-only, at the same threads; each batch-1 row gains `llamacpp_tok_s` and `vs_llamacpp`. A bf16
GGUF of all 40 layers (~67 GB) does not fit the GPU machine's disk; the MXFP4 one is ~19 GB.

Without CUDA, full-size shapes run in `--modes cpu-only` (everything on the host: the C++ executor for
the experts, the CPU's rows and DeltaNet kernels and torch for the rest), and `--llamacpp` runs
llama.cpp's CPU build (`-ngl 0`) on the same values; `--prefill N` adds a prompt of N tokens to
those rows (`prefill_tok_s`, through the model in the engine's 2,048-token chunks) beside
llama.cpp's pp N (`llamacpp_prefill_tok_s`, its default 512-token micro-batches). On the 2-core dev
machine:
    python -m bench.large_models --arch qwen3_5_moe --layers 12 --expert-format mxfp4 --modes cpu-only \
        --threads 2 --llamacpp --llamacpp-build .llama/build-cpu --gguf /tmp/ft-cpu12.gguf --tokens 32 --prefill 512

Before building, the run prints the expert bytes per MoE layer in each format and what the slice
needs in host RAM and VRAM per mode and format (each format of a list alone), and exits with the
reason if the slice would not fit (`--estimate-only`: print and stop; `--host-gb` plans for another
machine's RAM). On the GPU machine (128 GiB host RAM, 139 GiB VRAM), after
`bash bench/stamp_commit.sh` here (carry .devcache, as bench/device_suite.sh does); the 12-layer
calls took about 2 minutes each there (setup 16-20 s, rows 7-60 s; 12 layers: 41.1 GB of MXFP4
experts, 48.9 GB of NVFP4):
    python -m bench.large_models --arch deepseek_v4 --layers 12 --modes resident,cpu-only,cache --threads 6
    python -m bench.large_models --arch glm_moe_dsa --layers 12 --modes resident,cpu-only,cache --threads 6
and the largest slices (about 80% of the host RAM in experts: 95.8 GB of MXFP4, 92.4 GB of NVFP4):
    python -m bench.large_models --arch deepseek_v4 --layers 28 --modes resident,cpu-only,cache --threads 6 \
        --name large_models-deepseek_v4-28
    python -m bench.large_models --arch glm_moe_dsa --layers 20 --modes resident,cpu-only,cache --threads 6 \
        --name large_models-glm_moe_dsa-20
Issue 12: the full-size Qwen3.6 shape (all 40 layers), BF16, FP8, MXFP4 and NVFP4 experts, each
resident and CPU-only at 6 and 16 threads, one call (the largest format, bf16, is 64.4 GB of
experts: 72.4 GB of host RAM with the spare, 72.9 GB of VRAM resident; fp8_block 32.2 GB, mxfp4
17.1 GB, nvfp4 18.1 GB). Not yet timed there; by estimate about 4-6 minutes (run it with the
600 s limit): setup (transformers, the 4.9 GB of dense weights) ~10-20 s; each format's banks made
on the GPU and copied to registered host memory, about a third of a second a GB by the 12-layer
runs (bf16 ~25 s, all four ~50 s); 12 rows (4 formats x resident, cpu-only at 6 and at 16) of
~5-15 s each (the prompt's prefill, 16 warm-up steps, 64 timed, graph capture; a fresh machine
compiles each format's Triton kernels at its first resident row):
    python -m bench.large_models --arch qwen3_5_moe --expert-format bf16,fp8_block,mxfp4,nvfp4 \
        --modes resident,cpu-only --threads 6,16 --name large_models-qwen3_5_moe-formats
On a CPU machine: python -m bench.large_models --arch deepseek_v4 --tiny --threads 1
    python -m bench.large_models --arch qwen3_5_moe --tiny --expert-format bf16,mxfp4 --threads 1
Results: benchmarks/results/NAME-gpu.json (or $OUT), NAME = --name (default large_models-ARCH).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import torch

PER_LAYER = ("layer_types", "mlp_layer_types", "indexer_types")


def slice_config(cfg: dict, layers: int) -> dict:
    """cfg's first `layers` layers: num_hidden_layers and every per-layer list cut to it."""
    out = dict(cfg, num_hidden_layers=layers)
    for k in PER_LAYER:
        if k in out:
            out[k] = list(out[k][:layers])
    return out


HASH_LAYERS = 3
DEEPSEEK_V4_FLASH = {  # transformers 5.x DeepseekV4Config() (5.17 and 5.24 alike)
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    # two HCA layers, then CSA and HCA in turn
    "layer_types": ["heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(41)],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "mlp_layer_types": ["hash_moe"] * HASH_LAYERS + ["moe"] * 40, "swiglu_limit": 10.0, "sliding_window": 128,
    "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "bos_token_id": 0,
    "eos_token_id": 1, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.125}},
    "partial_rotary_factor": 0.125, "qk_rope_head_dim": 64,
}
GLM5 = {  # transformers 5.x GlmMoeDsaConfig() (5.17 and 5.24 alike; its layer_types, which the
    # versions name differently and the engine does not read, left out)
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
    "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
    "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
    "v_head_dim": 256, "qk_nope_head_dim": 192, "head_dim": 64, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False, "mlp_bias": False,
    "first_k_dense_replace": 3, "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
    "indexer_types": ["full"] * 78, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
}
QWEN36_LAYERS = 40
QWEN36 = {  # Qwen3.6-35B-A3B's text model (its config.json's text_config; bench/decode.py's
    # QWEN36_35B_A3B), its layer_types written out: gated DeltaNet, full attention every 4th layer
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
    "hidden_size": 2048, "num_hidden_layers": QWEN36_LAYERS, "full_attention_interval": 4,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(QWEN36_LAYERS)],
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "attention_bias": False,
}
QWEN3_NEXT_LAYERS = 48
# Qwen3-Next-80B-A3B (its config.json: transformers' Qwen3NextConfig() defaults with the release's
# vocabulary, context and rope theta), written as the Qwen3.5-MoE text config FreeToken runs it as:
# the layers are the same (weights/hf.py qwen3_next_split reads its fused DeltaNet projections apart)
QWEN3_NEXT = dict(
    QWEN36, num_hidden_layers=QWEN3_NEXT_LAYERS, vocab_size=151936, num_experts=512, num_experts_per_tok=10,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(QWEN3_NEXT_LAYERS)],
    max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})
# the same structure, small: 3 hash-routed layers then plain MoE, HCA/CSA (compress windows of 16
# and 4, a window of 16 keys, the indexer keeping 4 entries); 3 dense layers then MoE, the DSA
# indexer keeping 16 keys; three DeltaNet layers then full attention, every layer MoE with the
# shared expert. Prompts past 40 tokens pass every window and top-k.
TINY = {
    "deepseek_v4": slice_config(dict(
        DEEPSEEK_V4_FLASH, vocab_size=1024, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
        head_dim=64, q_lora_rank=64, n_routed_experts=16, o_groups=2, o_lora_rank=64, index_n_heads=4,
        index_head_dim=32, index_topk=4, sliding_window=16, qk_rope_head_dim=8, max_position_embeddings=4096,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}), 5),
    "glm_moe_dsa": slice_config(dict(
        GLM5, vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
        v_head_dim=32, qk_nope_head_dim=32, head_dim=16, n_routed_experts=16, index_topk=16, index_head_dim=32,
        index_n_heads=4, max_position_embeddings=4096), 5),
    "qwen3_5_moe": slice_config(dict(
        QWEN36, vocab_size=1024, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=16, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        max_position_embeddings=4096), 4),
}
TINY["qwen3_next"] = slice_config(dict(TINY["qwen3_5_moe"], num_experts=32, num_experts_per_tok=10), 4)
SHAPES = {"deepseek_v4": DEEPSEEK_V4_FLASH, "glm_moe_dsa": GLM5, "qwen3_5_moe": QWEN36, "qwen3_next": QWEN3_NEXT}
NAMES = {"deepseek_v4": "DeepSeek-V4-Flash", "glm_moe_dsa": "GLM-5", "qwen3_5_moe": "Qwen3.6-35B-A3B",
         "qwen3_next": "Qwen3-Next-80B-A3B"}
# the releases' expert formats (Qwen3.6 and Qwen3-Next also publish FP8 releases: fp8_block)
PUBLISHED_FORMAT = {"deepseek_v4": "mxfp4", "glm_moe_dsa": "nvfp4", "qwen3_5_moe": "bf16", "qwen3_next": "fp8_block"}
# without --layers (Qwen3-Next's 48 layers of BF16 experts, 155 GB, fit no host of the GPU machine's 128 GB)
DEFAULT_LAYERS = {"deepseek_v4": 12, "glm_moe_dsa": 12, "qwen3_5_moe": QWEN36_LAYERS, "qwen3_next": QWEN3_NEXT_LAYERS}
HF_CLASSES = {"deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM"),
              "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
              "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}
FORMATS = ("bf16", "fp8_block", "mxfp4", "nvfp4")
MODES = ("resident", "cpu-only", "cache", "split", "fill-only")
CACHED = ("cache", "split", "fill-only")  # the slot pool's modes: adaptive r, a fixed r (--fill-shares), r = 1
MAX_POS = 4096  # the rope tables run_config builds (bench/expert_cache.py)
HOST_SPARE = 8e9  # host bytes beside the banks: the process, CUDA's context, staging buffers
VRAM_WORK = 3e9  # device bytes beside weights, state and experts: activations, logits, graphs, allocator slack
GB = 1e9


# ---------------------------------------------------------------------------- the weights

def hf_tensors(cfg: dict) -> dict[str, tuple[tuple, torch.dtype]]:
    """{name: (shape, dtype)} of every non-expert tensor of the transformers model of `cfg`,
    under the names `ft convert` gives them: the model built on the meta device (no memory), its
    state_dict renamed as weights/hf.py renames a checkpoint's tensors."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("bench.large_models: the weight names and shapes come from transformers' model classes; "
                         "install transformers >= 5.x") from None

    from freetoken.config import ModelConfig
    from freetoken.weights.hf import canonical, deepseek_v4_name
    arch = ModelConfig.from_hf(cfg).arch
    cname, mname = HF_CLASSES[arch]
    try:
        config_cls, model_cls = getattr(transformers, cname), getattr(transformers, mname)
    except AttributeError:
        raise SystemExit(f"bench.large_models: transformers {transformers.__version__} has no {mname}; "
                         "the weight names and shapes come from it (transformers >= 5.x)") from None
    hc = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = model_cls(hc)
    out = {}
    for name, t in model.state_dict().items():
        c = canonical(name)
        if c is None:
            continue
        if arch == "deepseek_v4":
            c = deepseek_v4_name(c)
        if ".mlp.experts." in c:  # the routed experts: the banks
            continue
        out[c] = (tuple(t.shape), t.dtype)
    return out


def weight_plan(cfg: dict, dtype=torch.bfloat16) -> dict[str, tuple[tuple, torch.dtype]]:
    """{name: (shape, dtype as the engine loads it)} of the model class's non-expert tensors."""
    from freetoken.config import ModelConfig
    from freetoken.model.registry import model_class
    from freetoken.weights.reader import dense_weights
    mc = ModelConfig.from_hf(cfg)
    cls = model_class(mc.arch)
    hf = hf_tensors(cfg)
    want = cls.expected_tensors(mc)
    missing = [n for n in want if n not in hf]
    if missing:
        raise SystemExit(f"bench.large_models: the transformers model has no tensor {missing[0]} "
                         f"({len(missing)} of {len(want)} expected tensors missing)")
    # 2-D floating weights as a bf16 release stores them; under a float32 compute dtype they stay bf16
    # as a CPU engine keeps them (--dense-bf16 auto), widened where read
    meta = {n: torch.empty(hf[n][0], dtype=torch.bfloat16 if len(hf[n][0]) == 2 and hf[n][1].is_floating_point
                           else hf[n][1], device="meta") for n in want}
    loaded = dense_weights({}, meta, torch.device("meta"), dtype, getattr(cls, "KEEP_FP32", ()),
                           keep_bf16=dtype == torch.float32, bf16_widen=getattr(cls, "DENSE_WIDEN", ()))
    return {n: (tuple(t.shape), t.dtype) for n, t in loaded.items()}


def dense_value(name: str, shape, dtype, num_experts: int, g: torch.Generator, dev) -> torch.Tensor:
    """A random value for one non-expert tensor, made on `dev`."""
    if not dtype.is_floating_point:  # a hash layer's token -> experts table [V, k]: k distinct experts a row
        scores = torch.rand(shape[0], num_experts, generator=g, device=dev)
        return scores.topk(shape[1], dim=-1).indices.to(dtype)
    t = torch.randn(shape, generator=g, device=dev)
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if "norm" in module and leaf == "weight":
        t = t.mul_(0.02).add_(1.0)  # (RMS/Layer)Norm scales near 1
    elif "norm" in module or name.endswith("e_score_correction_bias"):
        t = t.mul_(0.01)
    elif name.endswith("embed_tokens.weight"):
        t = t.mul_(0.02)
    elif len(shape) >= 2:
        t = t.mul_(shape[-1] ** -0.5)
    else:
        t = t.mul_(0.1)
    return t.to(dtype)


def fp8_projections(w: dict, keep: bool, dtype: torch.dtype) -> None:
    """w's projections as an FP8 release publishes them (weights/quant.py is_projection, less
    SMALL_PROJECTIONS), quantized in place (bf16 scales, as Qwen's): kept as Fp8BlockWeight (what
    the engine holds with --dense-fp8 auto), or dequantized to `dtype` (--dense-fp8 dequant). The
    rest (lm_head, embeddings, norms, routers) stays."""
    from freetoken.weights.dense_fp8 import Fp8BlockWeight
    from freetoken.weights.quant import SMALL_PROJECTIONS, is_projection, quant_fp8_block
    for name, t in list(w.items()):
        if t.dim() == 2 and t.is_floating_point() and is_projection(name) and not name.endswith(SMALL_PROJECTIONS):
            q, sc = quant_fp8_block(t, torch.bfloat16)
            fw = Fp8BlockWeight(q, sc, dtype, name)
            w[name] = fw if keep else fw.dequantize(dtype)


def random_dense(plan: dict, mc, dev, seed: int = 0) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    return {n: dense_value(n, s, dt, mc.num_experts, g, dev) for n, (s, dt) in plan.items()}


def expert_bytes(fmt: str, h: int, i: int) -> int:
    """Bytes of one expert in a format: every bank's row (values, scales), as ft convert lays
    them out (weights/convert.py bank_entries; FP8 block scales in f32, as quantized_banks makes)."""
    from freetoken.weights.convert import bank_entries
    from freetoken.weights.ftw import Entry
    entries = bank_entries("dense" if fmt == "bf16" else fmt, 1, i, h, {"values": "bfloat16", "scale": "float32"})
    return sum(Entry(name, dt, shape).nbytes for name, dt, shape, _, _ in entries)


def make_banks(fmt: str, mc, dev, seed: int = 0):
    """Random expert banks of every MoE layer in host memory (page-aligned, huge pages, registered
    for DMA on CUDA), made one layer at a time on `dev` and copied once -> (ExpertBanks, pinned)."""
    from dataclasses import replace

    from bench.cpu_experts import quantized_banks
    from freetoken.experts.banks import ExpertBanks
    from freetoken.weights.hostmem import host_tensor
    from freetoken.weights.reader import pin_in_place
    e, h, i, n = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size, mc.num_flat_experts
    g = torch.Generator(device=dev).manual_seed(seed)
    banks, pinned = None, False
    for layer in range(len(mc.moe_layers)):
        if fmt == "bf16":
            one = ExpertBanks("dense", torch.randn(e, 2 * i, h, generator=g, device=dev).mul_(h ** -0.5).bfloat16(),
                              torch.randn(e, h, i, generator=g, device=dev).mul_(i ** -0.5).bfloat16())
        else:
            one = quantized_banks(fmt, e, h, i, g)
        if banks is None:  # the host banks, shaped as the first layer's with n experts
            def alloc(t):
                return None if t is None else host_tensor((n, *t.shape[1:]), t.dtype)

            def host(b):
                if isinstance(b, torch.Tensor):
                    return alloc(b)
                return replace(b, values=alloc(b.values), scale=alloc(b.scale), scale_2=alloc(b.scale_2))
            banks = ExpertBanks(one.format, host(one.gate_up), host(one.down))
            if torch.cuda.is_available():  # registered before the first write: the copies below are DMA
                pinned = pin_in_place(banks.tensors())
        for dst, src in zip(banks.tensors(), one.tensors()):
            dst[layer * e:(layer + 1) * e].copy_(src)
        del one
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return banks, pinned


# ---------------------------------------------------------------------------- estimates

def distinct_experts(e: int, k: int, batch: int) -> float:
    """Expected distinct experts of one MoE layer in a step of `batch` tokens (uniform routing)."""
    return e * (1 - (1 - k / e) ** batch)


def kv_read_bytes(mc, ctx: int, el: int = 2) -> int:
    """Approximate KV/indexer bytes a decode step reads at context `ctx` (one sequence)."""
    b = 0
    for layer in range(mc.num_layers):
        if mc.arch == "qwen3_5_moe":  # a DeltaNet layer's fp32 matrix read and written, else K and V
            if mc.layer_types[layer] == "linear_attention":
                b += mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4 * 2
            else:
                b += 2 * mc.num_kv_heads * ctx * mc.head_dim * el
        elif mc.arch == "deepseek_v4":
            b += min(ctx, mc.sliding_window) * mc.head_dim * el  # sliding keys (= values)
            kind = mc.compressed_attention[layer]
            if kind == "csa":
                n = ctx // mc.compress_rate_csa
                b += n * mc.index_head_dim * el + min(n, mc.index_topk) * mc.head_dim * el
            elif kind == "hca":
                b += ctx // mc.compress_rate_hca * mc.head_dim * el
        else:  # latent attention: the indexer's keys, then the selected latent rows
            b += ctx * mc.index_head_dim * el + min(ctx, mc.index_topk) * (mc.kv_lora_rank + mc.qk_rope_head_dim) * el
    return b


def dense_active_bytes(plan: dict) -> int:
    """Non-expert bytes a decode step reads: all, but one row of the embedding and of each hash table."""
    b = 0
    for name, (shape, dt) in plan.items():
        el = torch.empty((), dtype=dt).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if name.endswith(("embed_tokens.weight", "gate.tid2eid")):
            numel = shape[-1]
        b += numel * el
    return b


def plan_bytes(plan: dict) -> int:
    return sum(torch.empty((), dtype=dt).element_size() * int(torch.tensor(s).prod()) for s, dt in plan.values())


def host_available() -> float:
    """MemAvailable of /proc/meminfo, bytes (inf where unreadable: no refusal on a guess)."""
    from freetoken.runtime.budget import host_available as available
    return available() or float("inf")


def estimate(cfg: dict, mc, fmt: str, plan: dict, modes, capacity: float, batch: int, ctx: int, dev,
             host_have: float | None = None, on_cuda: bool | None = None, header: bool = True,
             name: str | None = None) -> dict:
    """What the slice needs with experts in `fmt`, printed; -> {"fits": bool, "why": [...], ...}.
    name: the shape's (default: its architecture's, NAMES)
    host_have: the host bytes available (default: MemAvailable); on_cuda: plan for a GPU run
    (default: dev is CUDA); header: print the slice's lines before the format's (once a run)."""
    from freetoken.model.state import state_bytes
    h, i, e = mc.hidden_size, mc.moe_intermediate_size, mc.num_experts
    per_layer = {f: e * expert_bytes(f, h, i) for f in FORMATS}
    moe = len(mc.moe_layers)
    eb = expert_bytes(fmt, h, i)
    pool = mc.num_flat_experts * eb
    dense = plan_bytes(plan)
    state = state_bytes(mc, batch, ctx, torch.bfloat16)
    on_cuda = dev.type == "cuda" if on_cuda is None else on_cuda
    host_need = pool + HOST_SPARE + (0 if on_cuda else dense + state)
    host_have = host_available() if host_have is None else host_have
    base = dense * 1.1 + state + VRAM_WORK  # + the model's fused copies of a few dense weights
    vram = {"resident": base + pool, "cpu-only": base, "cache": base + max(1, int(capacity * mc.num_flat_experts)) * eb}
    vram["split"] = vram["fill-only"] = vram["cache"]
    vram_have = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else float("inf")
    gen_peak = per_layer[fmt] * 2.5 if on_cuda else 0  # one layer's banks and their temporaries on the device
    if header:
        print(f"{name or NAMES[mc.arch]} shape ({mc.arch}), {mc.num_layers} layers: {moe} MoE layers "
              f"({len(mc.hash_layers)} hash-routed), {e} experts x ({h} x {i}), top-{mc.top_k}")
        print("  expert bytes per MoE layer: " + " | ".join(f"{f} {per_layer[f] / GB:.2f} GB" for f in FORMATS))
        if on_cuda:
            print(f"  VRAM beside the experts: non-expert weights {dense / GB:.2f} GB, state {state / GB:.3f} GB"
                  + (f"; free {vram_have / GB:.1f} GB" if dev.type == "cuda" else " (no CUDA here: not checked)"))
        else:
            print(f"  no CUDA: everything on the CPU (non-expert weights {dense / GB:.4f} GB, "
                  f"state {state / GB:.4f} GB)")
    print(f"  {fmt} ({eb / 1e6:.2f} MB an expert): host RAM: expert pool {pool / GB:.1f} GB + "
          f"{HOST_SPARE / GB:.0f} GB spare" + ("" if on_cuda else f" + weights and state {(dense + state) / GB:.2f} GB")
          + f" = {host_need / GB:.1f} GB; available {host_have / GB:.1f} GB")
    if on_cuda:
        print("    VRAM per mode: " + ", ".join(f"{m} {vram[m] / GB:.1f} GB" for m in modes))
    else:
        vram = {m: 0.0 for m in modes}
        gen_peak = 0
    why = []
    if host_need > host_have:
        fit = int((host_have - HOST_SPARE) // per_layer[fmt])
        why.append(f"the expert pool ({pool / GB:.1f} GB in {fmt}) and {HOST_SPARE / GB:.0f} GB spare need "
                   f"{host_need / GB:.1f} GB of host RAM, {host_have / GB:.1f} GB is available: "
                   f"at most {max(fit, 0)} MoE layers fit in {fmt}")
    for m in modes:
        if max(vram[m], gen_peak) > vram_have:
            why.append(f"{m} in {fmt} needs {max(vram[m], gen_peak) / GB:.1f} GB of VRAM, "
                       f"{vram_have / GB:.1f} GB is free")
    return {"fits": not why, "why": why, "expert_bytes": eb, "pool_bytes": pool, "dense_bytes": dense,
            "per_layer_gb": {f: round(b / GB, 4) for f, b in per_layer.items()},
            "host_need_gb": round(host_need / GB, 1), "host_available_gb": round(host_have / GB, 1),
            "vram_need_gb": {m: round(vram[m] / GB, 1) for m in modes} if on_cuda else None,
            "vram_free_gb": round(vram_have / GB, 1) if dev.type == "cuda" else None}


# ---------------------------------------------------------------------------- measurements

def measure_bh(cpu, banks, h: int, pairs: int = 64, rounds: int = 7, calls: int = 4,
               spread: list | None = None) -> float:
    """GB/s the CPU executor reads on these experts (batch 1, `pairs` distinct experts a call):
    the median of `rounds` rounds of `calls` calls, after one untimed call. One round of five
    calls (~10 ms) read 24.8, 25.4 and 51.2 GB/s at 14 threads on one H100 host within ten
    minutes (plans 83-85), and the rows' floors moved with it. spread: gets each round's GB/s."""
    n = banks.num_experts
    pairs = min(pairs, n)
    x = torch.randn(1, h, dtype=torch.bfloat16)
    w = torch.full((1, pairs), 1.0 / pairs)
    cpu.run(x, torch.randperm(n)[:pairs][None], w, "decode")
    per_round = []
    for _ in range(rounds):
        ids = [torch.randperm(n)[:pairs][None] for _ in range(calls)]
        t0 = time.perf_counter()
        for i in ids:
            cpu.run(x, i, w, "decode")
        per_round.append(calls * pairs * banks.expert_bytes / (time.perf_counter() - t0) / GB)
    if spread is not None:
        spread.extend(round(g, 2) for g in per_round)
    return statistics.median(per_round)


def measure_bp(banks, dev, experts: int = 64) -> float | None:
    """GB/s of the zero-copy fill kernel copying expert-sized rows of every bank (values,
    scales) from the registered host banks into VRAM slots; None where it cannot run."""
    from bench.common import timeit
    from freetoken.experts.cached import bank_parts
    from freetoken.kernels.expert_transfer import transfer_triton, zero_copy_ok
    host = bank_parts(banks.gate_up, banks.down)
    if dev.type != "cuda" or not all(zero_copy_ok(t) for t in host):
        return None
    k = min(experts, banks.num_experts)
    slots = [torch.empty(k, *t.shape[1:], dtype=t.dtype, device=dev) for t in host]
    src = torch.randperm(banks.num_experts)[:k].to(torch.int32).to(dev)
    dst = torch.arange(k, dtype=torch.int32, device=dev)
    s = timeit(lambda: transfer_triton(host, slots, src, dst), warmup=1, iters=5, sync=torch.cuda.synchronize)
    return k * banks.expert_bytes / s / GB


class EagerOnly:
    """An executor seen as not capturable (everything else its own): run_config then times eager
    decode steps."""
    capturable = False

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def make_executor(mode: str, banks, mc, dev, threads: int, slots: int, start_share: float, policy: str,
                  cpu_act: str = "exact", prefetch: int = 0, fill_share: float | None = None):
    """fill_share: the split's fixed r (mode split; fill-only is r = 1); None: the adaptive split."""
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    from freetoken.experts.executor import Activation, TorchExpertExecutor
    act = Activation.of(mc)
    if mode == "resident":
        b = banks.to(dev) if dev.type == "cuda" else banks
        return TorchExpertExecutor(b.gate_up, b.down, layer_experts=mc.num_experts, activation=act)
    from freetoken.experts.cpu import SPIN_SHARED
    cpu = CpuExpertExecutor(banks.gate_up, banks.down, threads=threads, activation=act, act_int8=cpu_act == "int8",
                            spin=SPIN_SHARED if dev.type == "cpu" else None)  # as the engine makes it (_cpu_spin)
    if mode == "cpu-only":
        from freetoken.experts.cpu.hostcall import StreamedCpuExecutor, host_branch_ok
        return StreamedCpuExecutor(cpu, dev) if dev.type == "cuda" and host_branch_ok(cpu) else cpu
    share = {"fill-only": 1.0, "split": fill_share}.get(mode)  # cache: None, adaptive
    return CachedExpertExecutor(banks.gate_up, banks.down, slots, dev, torch.bfloat16, cpu, share, policy,
                                mc.num_experts, start_share=start_share, prefetch=prefetch, activation=act)


def free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def host_threads(dev, threads: int):
    """With no GPU the whole step runs on the host: torch's own ops and the dense rows kernels
    (torch's intra-op thread count) get the row's thread count too, as llama.cpp's -t gives all
    of its work; on CUDA they are left alone (the dense work is the GPU's)."""
    old = torch.get_num_threads()
    if dev.type == "cpu" and threads > 0:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def drift_spec(a, threads: int) -> dict | None:
    """--drift-hog's hog for a cache row at `threads`: on the pool's own first CPUs unless named."""
    if not a.drift_hog:
        return None
    from freetoken.experts.cpu import pool_cpus
    cpus = [int(c) for c in a.drift_hog_cpus.split(",") if c] or pool_cpus(threads)[:a.drift_hog]
    return {"threads": a.drift_hog, "cpus": cpus, "steps": a.drift_steps}


def run_mode(mode: str, a, mc, w, banks, dev, batch: int, threads: int, slots: int, start: float,
             prefetch: int = 0, fill_share: float | None = None) -> dict:
    """One row: the mode timed with decode graphs where it can be, else eagerly (graph_error)."""
    with host_threads(dev, threads if mode != "resident" else 0) as torch_threads:
        row = _run_mode(mode, a, mc, w, banks, dev, batch, threads, slots, start, prefetch, fill_share)
    row["torch_threads"] = torch_threads
    return row


def _run_mode(mode: str, a, mc, w, banks, dev, batch: int, threads: int, slots: int, start: float,
              prefetch: int = 0, fill_share: float | None = None) -> dict:
    from bench.expert_cache import run_config
    row = {"mode": mode, "batch": batch, "threads": threads if mode != "resident" else None, "device": dev.type}
    if mode != "resident":
        row["cpu_act"] = a.cpu_act
    if mode in CACHED:
        row.update(capacity=a.capacity, slots=slots, prefetch=prefetch)
    if mode == "cache":
        row["start_share"] = round(start, 3)
    if mode == "split":
        row["fill_share"] = fill_share
    attempts = [False, True] if dev.type == "cuda" else [True]
    for eager in attempts:
        ex = None
        try:
            ex = make_executor(mode, banks, mc, dev, threads, slots, start, a.policy, a.cpu_act, prefetch, fill_share)
            row["expert_backend"] = ex.backend
            t0 = time.perf_counter()
            got = run_config(mc, w, EagerOnly(ex) if eager else ex, dev, batch, a.tokens, a.warmup, None,
                             prompt=a.prompt, max_warmup=a.cache_warmup, profile=a.profile,
                             timeline=a.timeline, drift=drift_spec(a, threads) if mode == "cache" else None,
                             dtype=getattr(torch, a.compute_dtype) if mode == "cpu-only" else torch.bfloat16)
            row.update(got, run_s=round(time.perf_counter() - t0, 1))
            if mode == "cache":  # without the CPU branch in stream order (no CUDA) the cache stays fill-only
                row["adaptive_split"] = ex.tuner is not None
                row.setdefault("fill_share_chosen", round(float(ex.fill_share[0]), 3))
            row.pop("error", None)
            break
        except Exception as e:  # noqa: BLE001  a row that cannot run says why; the others still run
            msg = f"{type(e).__name__}: {e}"[:400]
            row["graph_error" if not eager else "error"] = msg
            print(f"{mode}: {'graph run failed, timing eagerly' if not eager else 'failed'}: {msg}", flush=True)
        finally:
            del ex
            free(dev)
    return row


def time_prefill(a, mc, w, banks, dev, threads: int, chunk: int = 2048) -> float:
    """tok/s of a fresh `--prefill`-token prompt through the cpu-only model in the engine's
    default chunks, after a short warm-up prompt (what Engine.prefill runs on the CPU)."""
    with host_threads(dev, threads):
        return _time_prefill(a, mc, w, banks, dev, threads, chunk)


def _time_prefill(a, mc, w, banks, dev, threads: int, chunk: int) -> float:
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    n = a.prefill
    ex = make_executor("cpu-only", banks, mc, dev, threads, 1, 1.0, a.policy, a.cpu_act)
    dt = getattr(torch, a.compute_dtype)
    model = model_class(mc.arch)(mc, w, ex, dev, dt, n + 64)
    ids = torch.randint(0, mc.vocab_size, (n,), generator=torch.Generator().manual_seed(a.seed + 2)).to(dev)
    for timed in (False, True):
        st = DecodeState(mc, 1, n + 64, dev, dt)
        st.reserve(0, n + 64)
        end = n if timed else min(n, 64)
        t0 = time.perf_counter()
        for s in range(0, end, chunk):
            model.prefill(ids[s:min(end, s + chunk)], st, 0, s)
        took = time.perf_counter() - t0
    del ex, model
    free(dev)
    return round(n / took, 1)


def floors(res: dict, mc, plan: dict, eb: int, ctx: int, bw: float | None) -> None:
    """Each row's analytic floor (floor_ms) and the measured step against it (of_floor)."""
    dense = dense_active_bytes(plan) + kv_read_bytes(mc, ctx)
    moe = len(mc.moe_layers)
    resident_ms = {r["batch"]: r["ms_per_step"] for r in res["runs"] if r["mode"] == "resident" and "ms_per_step" in r}
    for r in res["runs"]:
        b = r["batch"]
        experts = moe * distinct_experts(mc.num_experts, mc.top_k, b) * eb
        floor = None
        if r["mode"] == "resident" and bw:
            floor = (dense + experts) / (bw * GB) * 1e3
            r["active_gb_per_step"] = round((dense + experts) / GB, 3)
        elif r["mode"] == "cpu-only" and res.get(f"bh_{r['threads']}_gbs"):
            floor = experts / (res[f"bh_{r['threads']}_gbs"] * GB) * 1e3
            r["expert_gb_per_step"] = round(experts / GB, 3)
        elif r["mode"] in CACHED and "fills_per_step" in r and res.get(f"bh_{r['threads']}_gbs"):
            base = resident_ms.get(b) or ((dense + experts) / (bw * GB) * 1e3 if bw else None)
            # fill-only: the misses cross PCIe alone; otherwise the link and the CPU share them
            link = (res.get("bp_gbs") or 0) + (0 if r["mode"] == "fill-only" else res[f"bh_{r['threads']}_gbs"])
            if base is not None and link > 0:  # fill-only without a measured B_P (no CUDA): no floor
                missed = (r["fills_per_step"] + r["cpu_experts_per_step"]) * eb
                floor = base + missed / (link * GB) * 1e3
        if floor is not None:
            r["floor_ms"] = round(floor, 3)
            r["floor_tok_s"] = round(b / floor * 1e3, 1)
            if r.get("ms_per_step"):
                r["of_floor"] = round(floor / r["ms_per_step"], 3)


# ---------------------------------------------------------------------------- main

def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="deepseek_v4", choices=sorted(SHAPES))
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of three eager steps in each "
                    "row (`profile`: the top kernels; CUDA only)")
    ap.add_argument("--timeline", action="store_true", help="device time of three replayed steps in each row by "
                    "kernel and the idle gaps before each (`timeline`, bench/step_timeline.py; CUDA only)")
    ap.add_argument("--drift-hog", type=int, default=0, help="cache rows: after the timed steps, start a host-memory "
                    "hog of N threads and run --drift-steps more (`drift`: how the adaptive split reacts; 0: off)")
    ap.add_argument("--drift-hog-cpus", default="", help="CPUs of the drift hog (default: the first N of the CPU "
                    "branch's pool, which it then competes with)")
    ap.add_argument("--drift-steps", type=int, default=600)
    ap.add_argument("--control-variant", default="", help="WARPS,BLOCK: the control kernel's warps and victim-scan "
                    "chunk for decode-sized calls (up to 64 pairs) instead of control_warps/scan_block's (an A/B of "
                    "the kernel in the real step: plan 82 timed the default at 29.9 us a call there, 17.8 alone)")
    ap.add_argument("--tiny", action="store_true", help="the small config of the same structure (a CPU run)")
    ap.add_argument("--layers", type=int, default=None, help="first N layers of the shape (default 12; "
                    "qwen3_5_moe all 40; --tiny 5, qwen3_5_moe 4)")
    ap.add_argument("--expert-format", default=None, help="routed experts' format, of " + ", ".join(FORMATS) +
                    " (comma-separated: each in turn, the banks of one freed before the next; default: the "
                    "release's, mxfp4 for DeepSeek-V4-Flash, nvfp4 for GLM-5, bf16 for Qwen3.6)")
    ap.add_argument("--dense-format", default="bf16", choices=["bf16", "fp8_block", "fp8_dequant"],
                    help="the non-expert projections: bf16; fp8_block as an FP8 release publishes them (every "
                    "Linear projection but DeltaNet's in_proj_a / in_proj_b; lm_head, embeddings, routers stay "
                    "bf16), kept FP8 as the engine keeps them (--dense-fp8 auto); fp8_dequant: the same values "
                    "dequantized to the compute dtype at load (--dense-fp8 dequant)")
    ap.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the model's compute dtype in cpu-only rows (float32: a CPU engine's default, its bf16 "
                    "dense weights kept bf16 and widened as read, as --dense-bf16 auto does)")
    ap.add_argument("--modes", default="resident,cpu-only,cache")
    ap.add_argument("--threads", default="6", help="CPU threads of the cpu-only and cache rows (comma-separated: "
                    "a row each)")
    ap.add_argument("--capacity", type=float, default=0.33, help="cache slots as a fraction of the slice's experts")
    ap.add_argument("--fill-shares", default="0.3,0.5", help="split rows: fixed fill shares r (comma-separated), "
                    "the misses' share copied into slots, the rest run on the CPU")
    ap.add_argument("--policy", default="recent", choices=["recent", "gate", "lfu"])
    ap.add_argument("--prefetch", default="0", help="cache rows: experts each MoE layer copies in ahead for the "
                    "next, predicted by that layer's router on this layer's input (ft's --expert-prefetch; "
                    "comma-separated: a row each; 0 off)")
    ap.add_argument("--cpu-act", default="exact", choices=["exact", "int8"],
                    help="the CPU executor's activations for MXFP4 / NVFP4 experts (ft's --cpu-act)")
    ap.add_argument("--batch", default="1", help="decode batch sizes (comma-separated)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256; --tiny 48)")
    ap.add_argument("--tokens", type=int, default=None, help="timed decode steps (default 64; --tiny 8)")
    ap.add_argument("--warmup", type=int, default=None, help="decode steps before the timed ones (default 16; "
                    "--tiny 2)")
    ap.add_argument("--cache-warmup", type=int, default=None, help="most warm-up steps of cache rows, until the "
                    "adaptive split has decided (default 600; --tiny 8)")
    ap.add_argument("--prefill", type=int, default=0, help="cpu-only rows without CUDA: also time a prefill of this "
                    "many tokens (the engine's 2,048-token chunks; prefill_tok_s), beside llama.cpp's pp of as many "
                    "with --llamacpp (llamacpp_prefill_tok_s); 0: off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="result file name (before -gpu.json / -cpu.json)")
    ap.add_argument("--estimate-only", action="store_true", help="print what the slice needs and stop (without "
                    "CUDA: as a GPU run would need it, VRAM unchecked)")
    ap.add_argument("--host-gb", type=float, default=None, help="host RAM available to plan with, GB (default: "
                    "MemAvailable)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp side by side (qwen3_5_moe; bf16 or mxfp4 "
                    "experts): the same weights written as a GGUF by its converter (MXFP4 experts as ggml MXFP4, "
                    "the same values), llama-bench before our rows of each format with -ncmoe giving it the "
                    "cache's share of the experts in VRAM (cpu-only: every layer's on the CPU), the same threads; "
                    "fills llamacpp_tok_s of batch-1 rows (source: bash bench/fetch_llamacpp.sh)")
    ap.add_argument("--llamacpp-build", default="/tmp/ft-llama-build", help="llama.cpp build folder (reused; "
                    "CUDA on the GPU machine, a CPU build without CUDA)")
    ap.add_argument("--gguf", default="/tmp/ft-large-models.gguf", help="where the GGUF is written (reused for "
                    "the same config, format and seed)")
    a = ap.parse_args(argv)
    if a.llamacpp and a.arch != "qwen3_5_moe":
        ap.error("--llamacpp: only the qwen3_5_moe shape is written as a GGUF here")
    a.modes = [m for m in a.modes.split(",") if m]
    if a.compute_dtype != "bfloat16" and set(a.modes) - {"cpu-only"}:
        ap.error("--compute-dtype float32 is for --modes cpu-only (the GPU modes run a bf16 model)")
    try:
        a.fill_shares = [float(r) for r in a.fill_shares.split(",") if r]
    except ValueError:
        ap.error(f"--fill-shares takes numbers in [0, 1], got {a.fill_shares!r}")
    if not all(0 <= r <= 1 for r in a.fill_shares) or ("split" in a.modes and not a.fill_shares):
        ap.error(f"--fill-shares takes numbers in [0, 1] (at least one for split rows), got {a.fill_shares}")
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
    a.threads = [int(t) for t in a.threads.split(",") if t]
    a.prefetch = [int(v) for v in a.prefetch.split(",") if v]
    if not a.prefetch or min(a.prefetch) < 0:
        ap.error("--prefetch: experts >= 0, comma-separated")
    if a.prefill < 0:
        ap.error("--prefill: tokens >= 0 (0: off)")
    a.batch = [int(b) for b in a.batch.split(",") if b]
    a.expert_format = [f for f in (a.expert_format or PUBLISHED_FORMAT[a.arch]).split(",") if f]
    bad = [f for f in a.expert_format if f not in FORMATS]
    if bad or not a.expert_format or len(set(a.expert_format)) < len(a.expert_format):
        ap.error(f"--expert-format: distinct formats of {', '.join(FORMATS)}, comma-separated")
    if a.llamacpp and set(a.expert_format) - {"bf16", "mxfp4"}:
        ap.error("--llamacpp: bf16 or mxfp4 experts (the others are not written as a GGUF here)")
    top = (TINY if a.tiny else SHAPES)[a.arch]["num_hidden_layers"]
    a.layers = a.layers or (top if a.tiny else DEFAULT_LAYERS[a.arch])
    if not 0 < a.layers <= top:
        ap.error(f"--layers: 1 to {top} ({'the tiny config' if a.tiny else NAMES[a.arch]} has {top} layers)")
    for k, full, tiny in (("prompt", 256, 48), ("tokens", 64, 8), ("warmup", 16, 2), ("cache_warmup", 600, 8)):
        if getattr(a, k) is None:
            setattr(a, k, tiny if a.tiny else full)
    a.name = a.name or f"large_models-{a.arch}" + ("-tiny" if a.tiny else "")
    if not 0 < a.capacity <= 1:
        ap.error("--capacity is a fraction of the experts, in (0, 1]")
    if a.control_variant:
        parts = a.control_variant.split(",")
        a.control_variant = tuple(int(v) for v in parts) if all(v.isdigit() for v in parts) else ()
        if len(a.control_variant) != 2 or a.control_variant[0] not in (1, 2, 4, 8, 16, 32) or \
                a.control_variant[1] < 16 or a.control_variant[1] & (a.control_variant[1] - 1):
            ap.error("--control-variant: WARPS,BLOCK, warps a power of two up to 32 and BLOCK a power of two >= 16")
    if a.drift_hog < 0 or a.drift_steps < 100:
        ap.error("--drift-hog is a thread count (0: off) and --drift-steps at least 100 (the summary's last 100)")
    if a.prompt + a.cache_warmup + a.tokens + 8 + (a.drift_steps if a.drift_hog else 0) > MAX_POS:
        ap.error(f"--prompt + --cache-warmup + --tokens (+ --drift-steps) must stay under {MAX_POS - 8} positions")
    return a


def llama_mode(mode: str) -> str:
    """llama.cpp's row for one of ours: every mode with a slot pool compares with the experts of
    the same share of layers in VRAM (`-ncmoe`), the cache's row."""
    return "cache" if mode in CACHED else mode


def side_by_side(a, cfg: dict, mc, w: dict, banks, f: dict, dev) -> dict:
    """llama.cpp on this format's weights, before our rows (nothing of ours runs meanwhile):
    {(mode, threads): tok/s}; f gains the runs, the build and export times, or llamacpp_error."""
    from pathlib import Path

    from bench import llamacpp
    out, gpu = {}, dev.type == "cuda"
    try:
        # the GGUF first: a device plan's background build of llama.cpp runs meanwhile (build() waits for it)
        gguf, took = llamacpp.slice_gguf(cfg, mc, w, banks.gate_up, banks.down, a.gguf, llamacpp.source(),
                                         "bench.large_models", a.seed)
        f["gguf_export_s"] = round(took, 1) if took is not None else "reused"
        t0 = time.perf_counter()
        binary = llamacpp.build(llamacpp.source(), Path(a.llamacpp_build), cuda=gpu)
        f["llamacpp_build_wait_s"] = round(time.perf_counter() - t0, 1)
        layers, runs = len(mc.moe_layers), []
        for mode in dict.fromkeys(llama_mode(m) for m in a.modes):
            for t in ([0] if mode == "resident" else a.threads):
                ncmoe = {"resident": 0, "cpu-only": layers}.get(mode, llamacpp.n_cpu_moe_for(a.capacity, layers))
                r = llamacpp.bench_decode(binary, gguf, threads=t or max(a.threads), n_cpu_moe=ncmoe,
                                          n_gen=a.tokens, gpu=gpu)
                runs.append(dict(r, mode=mode, threads=t, n_cpu_moe=ncmoe if gpu else None))  # -ngl 0 without a GPU
                out[(mode, t)] = r["tok_s"]
                print("llama.cpp", runs[-1], flush=True)
                if a.prefill and mode == "cpu-only" and not gpu:
                    r = llamacpp.bench_prefill(binary, gguf, tokens=a.prefill, n_cpu_moe=ncmoe, threads=t, gpu=False)
                    runs.append(dict(r, mode="prefill", threads=t))
                    out[("prefill", t)] = r["tok_s"]
                    print("llama.cpp", runs[-1], flush=True)
        f["llamacpp"] = runs
    except Exception as e:  # noqa: BLE001  our rows still run
        f["llamacpp_error"] = f"{type(e).__name__}: {e}"[:600]
        print("llama.cpp side by side failed:", f["llamacpp_error"], flush=True)
    return out


def run_format(a, fmt: str, mc, w, plan: dict, est: dict, dev, bw: float | None, cfg: dict | None = None) -> dict:
    """Every row of one expert format: its banks made, B_P and B_H measured on them, each
    (batch, mode, threads) timed, the floors; -> the format's fields and its rows ("runs"). The
    banks are gone when it returns."""
    t0 = time.perf_counter()
    banks, pinned = make_banks(fmt, mc, dev, a.seed)
    eb = banks.expert_bytes
    assert eb == est["expert_bytes"], (eb, est["expert_bytes"])
    slots = max(1, int(a.capacity * mc.num_flat_experts))
    from freetoken.weights.hostmem import huge_bytes
    hb = [huge_bytes(t) for t in banks.tensors()]
    f = {"expert_format": fmt, "pool_gb": round(est["pool_bytes"] / GB, 4), "expert_mb": round(eb / 1e6, 3),
         "host_need_gb": est["host_need_gb"], "vram_need_gb": est["vram_need_gb"], "banks_pinned": pinned,
         "banks_s": round(time.perf_counter() - t0, 1), "bank_huge_gb": None if None in hb else round(sum(hb) / GB, 2)}
    if dev.type == "cuda":
        try:
            bp = measure_bp(banks, dev)
        except Exception as e:  # noqa: BLE001  the rows still run; the cache's floor and start share without it
            bp, f["bp_error"] = None, f"{type(e).__name__}: {e}"[:300]
        f["bp_gbs"] = round(bp, 1) if bp else None
    print(f"{fmt}: banks made in {f['banks_s']:.1f} s", {k: v for k, v in f.items() if k in (
        "pool_gb", "expert_mb", "banks_pinned", "bank_huge_gb", "bp_gbs")}, flush=True)
    llama = side_by_side(a, cfg, mc, w, banks, f, dev) if a.llamacpp else {}
    runs = []
    for batch in a.batch:
        for mode in a.modes:
            for threads in ([0] if mode == "resident" else a.threads):
                start = 1.0
                if mode != "resident" and f"bh_{threads}_gbs" not in f:
                    from freetoken.experts.cpu import CpuExpertExecutor
                    from freetoken.experts.executor import Activation
                    try:
                        cpu = CpuExpertExecutor(banks.gate_up, banks.down, threads=threads,
                                                activation=Activation.of(mc), act_int8=a.cpu_act == "int8")
                        rounds = f[f"bh_{threads}_rounds_gbs"] = []  # each round's, beside the median
                        f[f"bh_{threads}_gbs"] = round(measure_bh(cpu, banks, mc.hidden_size, spread=rounds), 2)
                        del cpu
                    except Exception as e:  # noqa: BLE001  the rows still run, without their floors
                        f[f"bh_{threads}_gbs"] = None
                        f[f"bh_{threads}_error"] = f"{type(e).__name__}: {e}"[:300]
                    free(dev)
                if mode == "cache" and f.get("bp_gbs") and f[f"bh_{threads}_gbs"]:  # where the bandwidths point
                    start = f["bp_gbs"] / (f["bp_gbs"] + f[f"bh_{threads}_gbs"])
                variants = [(pf, None) for pf in (a.prefetch if mode == "cache" else [0])]
                if mode == "split":  # one row per fixed fill share
                    variants = [(0, r) for r in a.fill_shares]
                for pf, share in variants:
                    row = {"expert_format": fmt,
                           **run_mode(mode, a, mc, w, banks, dev, batch, threads, slots, start, pf, share)}
                    if a.llamacpp:  # llama-bench decodes one sequence: batch-1 rows only
                        row["llamacpp_tok_s"] = lt = llama.get((llama_mode(mode), threads)) if batch == 1 else None
                        row["vs_llamacpp"] = round(row["tok_s"] / lt, 2) if lt and row.get("tok_s") else None
                    if a.prefill and mode == "cpu-only" and dev.type == "cpu" and batch == a.batch[0]:
                        row["prefill_tokens"] = a.prefill
                        row["prefill_tok_s"] = pt = time_prefill(a, mc, w, banks, dev, threads)
                        lp = llama.get(("prefill", threads))
                        row["llamacpp_prefill_tok_s"] = lp
                        row["prefill_vs_llamacpp"] = round(pt / lp, 2) if lp else None
                    print(row, flush=True)
                    runs.append(row)
    f["runs"] = runs
    floors(f, mc, plan, eb, a.prompt + a.warmup + a.tokens // 2, bw)
    del banks
    free(dev)
    return f


def use_control_variant(warps: int, block_s: int) -> None:
    """Decode-sized control calls (pair buckets up to 64) compile with these warps and scan chunk
    from now on, in this process (the kernel reads control_warps and scan_block at each call)."""
    from freetoken.experts import control
    default_warps, default_block = control.control_warps, control.scan_block
    control.control_warps = lambda p_pad: warps if p_pad <= 64 else default_warps(p_pad)
    control.scan_block = lambda p_pad: block_s if p_pad <= 64 else default_block(p_pad)


def main(argv=None) -> str | None:
    a = parse(argv)
    from bench.common import write_result
    from freetoken.config import ModelConfig
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = slice_config(TINY[a.arch] if a.tiny else SHAPES[a.arch], a.layers)
    mc = ModelConfig.from_hf(cfg)
    if not mc.moe_layers:
        raise SystemExit(f"bench.large_models: {a.layers} layers of {a.arch} hold no MoE layer")
    if not cuda and not a.tiny and not a.estimate_only and set(a.modes) - {"cpu-only"}:
        raise SystemExit("bench.large_models: no CUDA device; full-size shapes run on the CPU in --modes cpu-only "
                         "only (everything on the host: the C++ executor for the experts, torch for the rest); "
                         "the other modes need the GPU machine (--tiny runs them all on the CPU)")
    t0 = time.perf_counter()
    plan = weight_plan(cfg, getattr(torch, a.compute_dtype))
    ctx = a.prompt + a.cache_warmup + a.tokens + 8 + (a.drift_steps if a.drift_hog else 0)
    ests = {fmt: estimate(cfg, mc, fmt, plan, a.modes, a.capacity, max(a.batch), ctx, dev,
                          a.host_gb * GB if a.host_gb else None, cuda or not a.tiny, header=n == 0, name=NAMES[a.arch])
            for n, fmt in enumerate(a.expert_format)}  # one format's banks at a time: each alone must fit
    why = [w for e in ests.values() for w in e["why"]]
    if why:
        raise SystemExit("bench.large_models: this slice does not fit: " + "; ".join(why) +
                         " (lower --layers, or drop the mode or the format)")
    if a.estimate_only:
        return None
    w = random_dense(plan, mc, dev, a.seed)
    if a.dense_format != "bf16":
        fp8_projections(w, keep=a.dense_format == "fp8_block", dtype=getattr(torch, a.compute_dtype))
    setup_s = time.perf_counter() - t0
    est = next(iter(ests.values()))
    fmts = ", ".join(a.expert_format)
    label = (f"{NAMES[a.arch]} shape{' (tiny)' if a.tiny else ''}, random weights, {a.layers} layers, "
             f"experts {fmts}")
    res = {"model": label, "arch": a.arch, "tiny": a.tiny, "config": cfg, "layers": a.layers,
           "moe_layers": len(mc.moe_layers), "hash_layers": mc.hash_layers, "expert_format": ",".join(a.expert_format),
           "expert_formats": list(a.expert_format), "dense_format": a.dense_format,
           "dense_dtype": "bfloat16 (KEEP_FP32 modules fp32)" + {
               "fp8_block": "; projections fp8_block (bf16 scales), kept",
               "fp8_dequant": f"; projections fp8_block (bf16 scales) dequantized to {a.compute_dtype}"}.get(
               a.dense_format, ""), "compute_dtype": a.compute_dtype,
           "dense_kept_gb": round(sum(getattr(t, "nbytes", 0) for t in w.values()) / GB, 4),
           "dense_gb": round(est["dense_bytes"] / GB, 4), "per_moe_layer_gb": est["per_layer_gb"],
           "host_available_gb": est["host_available_gb"], "prompt_tokens": a.prompt, "decode_tokens": a.tokens,
           "setup_s": round(setup_s, 1), "device": dev.type, "transformers": _transformers_version(), "runs": []}
    from freetoken.weights.hostmem import thp_mode
    res["thp"] = thp_mode()
    if a.control_variant:
        use_control_variant(*a.control_variant)
        res["control_variant"] = {"num_warps": a.control_variant[0], "block_s": a.control_variant[1], "up_to_pairs": 64}
    bw = None
    if cuda:
        from bench.decode import device_read_bw
        bw = device_read_bw(dev)
        res["device_read_gbs"] = round(bw, 1)
    print(f"setup {setup_s:.1f} s (the non-expert weights)", {k: v for k, v in res.items() if k in (
        "dense_gb", "device_read_gbs")}, flush=True)
    res["formats"] = {}
    for fmt in a.expert_format:  # one at a time: the banks of one freed before the next are made
        f = run_format(a, fmt, mc, w, plan, ests[fmt], dev, bw, cfg)
        res["runs"] += f.pop("runs")
        res["formats"][fmt] = f
    if len(a.expert_format) == 1:  # one format: its fields at the top, as before
        res.update(res["formats"][a.expert_format[0]])
    res["floor_notes"] = ("resident: active bytes of a step (non-expert weights but one embedding row, the top-k "
                          "experts of each MoE layer, an approximate KV/indexer/DeltaNet-state read) / "
                          "device_read_gbs; cpu-only: the step's expert bytes / bh_T_gbs; cache: the resident step "
                          "(its row, else its floor) + the step's missed expert bytes / (bp_gbs + bh_T_gbs); bp_gbs "
                          "and bh_T_gbs measured on each format's banks (formats.FMT); at batch > 1 the expected "
                          "distinct experts of uniform routing")
    keys = ("expert_format", "mode", "batch", "threads", "prefetch", "tok_s", "ms_per_step", "graph", "miss_rate",
            "fill_share_chosen", "floor_ms", "of_floor", "llamacpp_tok_s", "vs_llamacpp", "prefill_tok_s",
            "llamacpp_prefill_tok_s", "prefill_vs_llamacpp", "error")
    res["summary"] = [{k: r.get(k) for k in keys} for r in res["runs"]]
    return write_result(a.name, res)


if __name__ == "__main__":
    main()
