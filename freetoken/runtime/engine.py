"""Engine: load an FTW model onto a device and generate.

Loading reads every entry straight into host tensors (weights/reader.py), moves the non-expert
weights to the compute device, and gives the expert banks to an ExpertExecutor: on the CPU
they stay in host memory for the C++ executor; on CUDA with experts="gpu" all experts are
resident in VRAM (the full-VRAM baseline); experts="cpu" on CUDA is the CPU-only MoE backend.
Quantized checkpoints (fp8_block, mxfp4, nvfp4): the expert banks keep their bytes (an
experts.banks.ExpertBanks) and the kernels dequantize the selected experts in place;
FP8 block dense weights stay FP8 on CUDA (--dense-fp8: weights/dense_fp8.py, model/linear.py),
the other quantized dense weights are dequantized to the compute dtype here, at load.
"""
from __future__ import annotations

import os
import logging
import time
from dataclasses import dataclass, field

import torch

from .. import limits
from ..config import ModelConfig
from ..errors import ContextOverflowError, FreeTokenError, notice
from ..experts.banks import ExpertBanks
from ..kernels import page_gather
from ..experts.executor import SILU, Activation, QuantizedHostExecutor, TorchExpertExecutor, expert_bias_banks
from ..model.registry import model_class
from ..model.state import DecodeState, state_bytes
from ..tokenizer import Tokenizer, load_json
from ..weights.ftw import DTYPES as DTYPES_BY_NAME, read_header
from ..weights.dense_fp8 import Fp8BlockWeight
from ..weights.reader import dense_weights, keeps_fp8, load_ftw
from . import host_wait
from .budget import device_budget
from .sampler import SamplingParams

log = logging.getLogger("freetoken.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda", "choices": ["auto", "cpu", "cuda"]})
    dtype: str = field(default="auto", metadata={
        "help": "compute dtype (auto: bfloat16 on CUDA, float32 on CPU)",
        "choices": ["auto", "float32", "bfloat16"]})
    moe: str = field(default="auto", metadata={
        "help": "where routed experts run: resident = all in VRAM; cache = a GPU cache of expert slots "
                "that follows the router, misses filled over PCIe or run on the CPU; cpu = all on the host "
                "(C++ executor) (auto: resident if every expert fits the budget, else cache; cpu without CUDA)",
        "choices": ["auto", "resident", "cache", "cpu"]})
    experts: str = field(default="auto", metadata={
        "help": "older spelling of --moe: gpu = resident, cpu = cpu", "choices": ["auto", "cpu", "gpu"]})
    expert_cache: str = field(default="", metadata={
        "help": "with --moe cache: VRAM for expert slots, a size (8GiB) or a fraction (0.5) of what is left "
                "after the weights and buffers (default: all of it but one full context of KV, at most "
                "every expert)"})
    fill_share: str = field(default="auto", metadata={
        "help": "with --moe cache: the share of a step's misses copied to the GPU (the rest run on the "
                "CPU); 1 = fill-only; auto = chosen from decode step times measured while serving. Decode steps "
                "inside a streamed prefill pass run every miss on the CPU whatever this says (the pass holds the slots)"})
    cache_policy: str = field(default="recent", metadata={
        "help": "with --moe cache: which experts the slots keep and which misses are filled first: recent "
                "(least recently used out; misses routed most recently in first), gate (misses with the largest "
                "gate weight first) or lfu (the lowest decayed routing count out, the highest in)",
        "choices": ["recent", "gate", "lfu"]})
    expert_prefetch: int = field(default=0, metadata={
        "help": "with --moe cache: experts a decode step's MoE layer copies in ahead for the next MoE "
                "layer, predicted by that layer's router on this layer's input (0: off)"})
    expert_pieces: int = field(default=1, metadata={
        "help": "with --moe cache: cut each expert into this many pieces of its intermediate dimension, each "
                "cached, filled or run on the CPU as an expert of its own, so that a layer's few large misses "
                "split between the PCIe fills and the CPU (models with few, large experts: Mixtral-like top-2); "
                "must divide the intermediate size, and with quantized experts leave each piece whole scale "
                "blocks (fp8_block 128 rows, mxfp4 32, nvfp4 16) (1: off)"})
    cpu_threads: int = field(default=0, metadata={"aliases": ("-t", "--threads"),
        "help": "CPU expert threads (0: the physical cores; on CUDA all but two, left to the thread that "
                "launches the GPU work and the one that runs the CPU branch of a decode step); on a CPU-only "
                "engine also torch's threads, so the whole step keeps to this many"})
    cpu_act: str = field(default="exact", metadata={
        "help": "activations of MXFP4 / NVFP4 experts on the CPU executor: exact = as the model computes them "
                "(f32 / bf16); int8 = quantized per 32 values for integer dot products (AVX512-VNNI, as "
                "llama.cpp's quantized CPU kernels; fewer instructions per weight; each expert output about 1%% "
                "off the exact one, more through a whole model: not bit-exact)",
        "choices": ["exact", "int8"]})
    prefill_chunk: int = field(default=2048, metadata={"help": "tokens per prefill chunk"})
    max_seq_len: int = field(default=0, metadata={"help": "context limit (0: the model's)",
                                                  "aliases": ("--max-model-len", "-c", "--ctx-size")})
    sliding_kv: str = field(default="window", metadata={
        "help": "K/V of sliding-window attention layers: window = a ring per batch slot holding only what "
                "the window sees (prefix reuse restores at checkpoints, as for DeltaNet layers); full = every "
                "page in the shared pool (restores at any cached page, the whole context's memory)",
        "choices": ["window", "full"]})
    verify: bool = field(default=True, metadata={"help": "check FTW block checksums while loading"})
    dense_fp8: str = field(default="auto", metadata={
        "help": "dense (non-expert) weights an FP8 checkpoint publishes in FP8: keep = as published, the "
                "GEMMs reading the FP8 bytes (half the memory of bf16); dequant = dequantized to the compute "
                "dtype at load (auto: keep, unless on the CPU without the C++ kernels, where every product "
                "would dequantize its weight)",
        "choices": ["auto", "keep", "dequant"]})
    dense_bf16: str = field(default="auto", metadata={
        "help": "2-D dense (non-expert) weights a checkpoint stores in bf16, when the compute dtype is float32 "
                "on the CPU (its default): keep = they stay bf16 in memory and each product widens them exactly "
                "to fp32 as it reads them (the same results as widen, half the memory and half the bytes a "
                "decode step reads); widen = float32 copies at load (auto: keep)",
        "choices": ["auto", "keep", "widen"]})
    vram_budget: str = field(default="", metadata={"aliases": ("--gpu-memory-utilization",),
        "help": "memory the engine may use on the device: a size (24GiB) or a fraction of it (0.9); "
                "on the CPU, of host memory (default: free memory less 1 GiB)"})
    kv_cache_tokens: int = field(default=0, metadata={
        "help": "tokens of KV the page pool holds, shared by running requests and the prefix cache "
                "(0: what the budget leaves, up to every batch slot's full context)"})
    max_step_tokens: int = field(default=0, metadata={"aliases": ("--max-num-batched-tokens",),
        "help": "tokens one engine step may process: decode rows plus prompt chunks of one or more "
                "requests (0: 512 on the CPU, 2048 on CUDA; a step in which nothing decodes: --idle-step-tokens)"})
    idle_step_tokens: int = field(default=0, metadata={
        "help": "prompt tokens a step may take while no stream decodes, one prompt's chunk included (0: auto: "
                "the step budget where --max-step-tokens is given; on CUDA with the experts in VRAM the largest "
                "of 8192 and 4096 whose work buffers cost the KV pool at most an eighth of it and none of the "
                "context (a 2,048-token chunk's forward is bound by host launch time there: the Qwen3.6 shape "
                "prefilled 2.3-2.7x faster in chunks of 8,192 on an H100), else the step budget; elsewhere the "
                "larger of the step budget and --prefill-chunk). Not with --moe cache (streamed passes). Steps "
                "that start while streams decode are bounded by --max-step-tokens and --decode-slowdown as "
                "before; a stream that starts inside an idle step (a short prompt that jumped in) decodes "
                "between its layers until it ends"})
    decode_slowdown: float = field(default=1.5, metadata={
        "help": "while streams decode, prompt work is paced so their inter-token gap is at most about "
                "this many times a plain decode step: decode steps run between a prompt forward's layers "
                "where decode is its own forward (CUDA graphs) and on the CPU, else a step's prompt chunk is sized for it "
                "(0: no limit, prompts get --max-step-tokens); a forward of short prompts that all get their "
                "first token in it (up to 512 tokens) may hold the streams up to 50 ms"})
    decode_between_layers: str = field(default="auto", metadata={
        "choices": ("auto", "on", "off"),
        "help": "decode steps between a prompt forward's layers, paced by --decode-slowdown, instead of "
                "the decode rows sharing one forward with a prompt chunk (as llama.cpp's and vLLM's steps "
                "do). auto: where decode is its own forward (CUDA graphs) and on the CPU, where a prompt "
                "chunk's forward costs a decode step or more whatever its size: decoding streams keep "
                "their gaps (2-core CPU, 32k prompt: p99 2.0-2.2x their unloaded gap against 3.05-3.6x "
                "mixed; the Qwen3.6 shape's 4-layer slice: 2.97x against 36x) while the long prompt "
                "prefills 1.3-3.2x slower (only while streams decode); on: also on eager CUDA (no graphs); "
                "off: never. Either way not with --decode-slowdown 0, nor for models whose forward keeps "
                "state its layers share (DeepSeek-V4, GLM-5: mixed). With --moe cache also inside streamed prefill passes (decode is "
                "its own forward there on any device), the expert cache frozen meanwhile (misses on the CPU)"})
    decode_overlap: bool = field(default=False, metadata={
        "help": "decoding streams step on a second, high-priority CUDA stream while a prompt forward "
                "runs, instead of between its layers (experts in VRAM, decode graphs; experimental: on the H200 "
                "the streams' p99 gap is 1.3x their unloaded one, but the prompt prefills ~20x slower than alone)"})
    cuda_graphs: bool = field(default=True, metadata={
        "help": "replay decode steps from one CUDA graph per batch size (CUDA, experts in VRAM)"})
    prefill_graphs: bool = field(default=True, metadata={
        "help": "replay a prompt chunk's MoE blocks and DeltaNet mixers from CUDA graphs captured at load, one per "
                "layer and token bucket up to --prefill-graph-tokens (CUDA, experts in VRAM): short chunks are bound "
                "by host launch time"})
    prefill_graph_tokens: int = field(default=512, metadata={
        "help": "largest prompt chunk replayed from the prefill graphs (buckets ~1.4x apart up to it; larger chunks "
                "run eagerly). More buckets cost capture time at load and a larger graph memory pool"})
    warm_up: bool = field(default=True, metadata={
        "help": "at load on CUDA with experts in VRAM, prefill a few short scratch prompts so Triton's "
                "autotuning happens then, not in the first requests (seconds, once per process); with "
                "--moe cache, compile the cache's control kernel for each prefill call size"})
    allow_eager: bool = field(default=False, metadata={
        "help": "decode eagerly when a CUDA graph cannot be captured, instead of failing at start-up"})

    def __post_init__(self):
        if self.prefill_chunk < 1:
            raise FreeTokenError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if min(self.max_step_tokens, self.idle_step_tokens, self.kv_cache_tokens, self.decode_slowdown) < 0:
            raise FreeTokenError("--max-step-tokens, --idle-step-tokens, --kv-cache-tokens and --decode-slowdown "
                                 "must be >= 0")
        if self.decode_slowdown and self.decode_slowdown < 1:
            raise FreeTokenError(f"--decode-slowdown must be 0 (off) or >= 1, got {self.decode_slowdown}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise FreeTokenError("--device cuda: no CUDA device is available")
        self.fill_share_value()  # refuses a bad value now
        if self.prefill_graph_tokens < 1:
            raise FreeTokenError(f"--prefill-graph-tokens must be >= 1, got {self.prefill_graph_tokens}")
        if self.expert_prefetch < 0:
            raise FreeTokenError(f"--expert-prefetch must be >= 0 experts (0: off), got {self.expert_prefetch}")
        if self.expert_pieces < 1:
            raise FreeTokenError(f"--expert-pieces must be >= 1 (1: off), got {self.expert_pieces}")
        if self.dense_fp8 not in ("auto", "keep", "dequant"):
            raise FreeTokenError(f"--dense-fp8 must be auto, keep or dequant, got {self.dense_fp8!r}")
        if self.decode_between_layers not in ("auto", "on", "off"):
            raise FreeTokenError(f"--decode-between-layers must be auto, on or off, got {self.decode_between_layers!r}")
        if self.cpu_act not in ("exact", "int8"):
            raise FreeTokenError(f"--cpu-act must be exact or int8, got {self.cpu_act!r}")
        if self.sliding_kv not in ("window", "full"):
            raise FreeTokenError(f"--sliding-kv must be window or full, got {self.sliding_kv!r}")
        if self.moe != "auto" and self.experts != "auto" and \
                {"gpu": "resident", "cpu": "cpu"}[self.experts] != self.moe:
            raise FreeTokenError(f"--experts {self.experts} contradicts --moe {self.moe}; give one")

    def fill_share_value(self) -> float | None:
        """--fill-share as a number in [0, 1], or None for auto (adaptive)."""
        v = str(self.fill_share).strip().lower()
        if v == "auto":
            return None
        try:
            r = float(v)
        except ValueError:
            r = -1.0
        if not 0 <= r <= 1:
            raise FreeTokenError(f"--fill-share must be auto or a number in [0, 1], got {self.fill_share!r}")
        return r

    def resolved(self):
        """(device, dtype, where the experts run: "gpu" (resident), "cache", "cpu", or "auto"
        for Engine to decide from the budget)."""
        if self.cpu_threads < 0:  # a negative count had run as the default, unsaid
            raise FreeTokenError(f"--cpu-threads must be 0 (the default) or a thread count, got {self.cpu_threads}")
        dev = "cuda" if self.device == "auto" and torch.cuda.is_available() else self.device
        dev = "cpu" if dev == "auto" else dev
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if dev == "cuda" else "float32")
        mode = self.moe if self.moe != "auto" else {"gpu": "resident", "cpu": "cpu"}.get(self.experts, "auto")
        if mode == "auto" and dev != "cuda":
            mode = "cpu"
        if mode == "resident" and dev != "cuda":
            raise FreeTokenError("--moe resident (--experts gpu) needs --device cuda")
        return torch.device(dev), DTYPES[dtype], {"resident": "gpu"}.get(mode, mode)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (end-of-sequence token) | "length"
    prompt_tokens: int
    prefill_s: float
    decode_s: float


class Engine:
    prefill_stream = None  # issue 11: layer-major prefill passes streaming the experts (--moe cache)

    def __init__(self, path: str, ecfg: EngineConfig | None = None, progress: bool = False):
        self.path = path
        self.ecfg = ecfg or EngineConfig()
        self.device, self.dtype, self.experts_on = self.ecfg.resolved()
        if self.device.type == "cpu" and self.ecfg.cpu_threads > 0:
            # a CPU engine's thread budget covers the whole step, as llama.cpp's -t does: torch's
            # ops and the dense rows / attention / DeltaNet kernels (torch's intra-op count) too,
            # not only the expert executor (they took every core whatever --cpu-threads said)
            torch.set_num_threads(self.ecfg.cpu_threads)
        self._keep_to_cpu_quota()
        # dense FP8 weights kept as published (--dense-fp8 auto): on CUDA (VRAM is what runs out; the
        # Triton GEMM reads the bytes in place) and on the CPU where the C++ rows kernel is built (a
        # decode step is bound by reading them: fp32 copies were 4x the bytes; model/linear.py)
        self.keep_fp8 = self.ecfg.dense_fp8 == "keep" or (self.ecfg.dense_fp8 == "auto" and (
            self.device.type == "cuda" or (self._has_fp8_dense(path) and self._host_fp8_kernel())))
        # bf16 dense weights kept bf16 under a float32 compute dtype on the CPU (--dense-bf16): a decode
        # step's dense products read them through the C++ rows kernel, widened exactly as they are read
        # (model/linear.py); at fp32 they were twice the bytes of a step bound by reading them
        self.keep_bf16 = (self.device.type == "cpu" and self.dtype == torch.float32
                          and self.ecfg.dense_bf16 in ("auto", "keep"))
        self.budget = device_budget(self.device, self.ecfg.vram_budget)
        if self.experts_on == "auto":  # every expert in VRAM if they fit with room to spare, else a cache
            self.experts_on = "gpu"
            if self._weight_bytes(path) > 0.9 * self.budget:
                self.experts_on = "cache"
        self.weight_bytes = self._check_weights_fit(path)
        t0 = time.perf_counter()
        meta, w = load_ftw(path, verify=self.ecfg.verify, progress=progress,
                           pin=self.device.type == "cuda")  # DMA-able: fast H2D, later the expert cache
        self.load_s = time.perf_counter() - t0
        self.meta = meta
        self.cfg = ModelConfig.from_hf(meta["config"], path)
        files = {k[5:]: bytes(v.numpy()) for k, v in w.items() if k.startswith("file/")}
        self.files = files  # embedded checkpoint files (tokenizer, templates, configs)
        tcfg = load_json(files.get("tokenizer_config.json"), "tokenizer_config.json")
        if "tokenizer.json" not in files:
            raise FreeTokenError(f"{path}: has no embedded tokenizer.json; re-run `ft convert`")
        self.tokenizer = Tokenizer(files["tokenizer.json"], tcfg)
        self.tokenizer.check_fits(self.cfg.vocab_size, path)  # ids past the embedding: refuse now, not per request
        self.eos_ids = self._eos_ids(files)
        banks = ExpertBanks.from_ftw(meta, w)  # None without experts; quantized banks keep their bytes
        self.expert_format = banks.label if banks is not None else "none"
        # what an expert computes (data for the executor): its activation and optional bias banks
        gu_bias, dn_bias = expert_bias_banks(meta, w)
        self.expert_fn = dict(activation=Activation.of(self.cfg), gate_up_bias=gu_bias, down_bias=dn_bias)
        # dense banks go to the GPU expert cache for SiLU-gated experts without biases only (as before;
        # the cache itself takes any function, and quantized banks with any: GPT-OSS's MXFP4)
        self.plain_experts = self.expert_fn["activation"] == SILU and gu_bias is None and dn_bias is None
        host_wait.mode()  # a bad FREETOKEN_HOST_WAIT fails the start, not every step
        if banks is not None and banks.quantized:
            self.executor = self._quantized_executor(banks)
        else:
            self.executor = self._executor(banks.gate_up if banks else None, banks.down if banks else None)
        self._warn_cache_flags_unused()
        if hasattr(self.executor, "warm_control"):  # the expert cache's control kernel, compiled when its pool is sized
            self.executor.warm_control = self.ecfg.warm_up
        cls = model_class(self.cfg.arch)
        # the class's fp32 modules; quantized weights dequantized (quant.py) but FP8 ones kept if asked
        dense = dense_weights(meta, w, self.device, self.dtype, getattr(cls, "KEEP_FP32", ()), self.keep_fp8,
                              getattr(cls, "DENSE_DEQUANT", ()), keep_bf16=self.keep_bf16,
                              bf16_widen=getattr(cls, "DENSE_WIDEN", ()))
        missing = [n for n in cls.expected_tensors(self.cfg) if n not in dense]
        if missing:  # a tensor an older convert dropped (Qwen's o_proj bias before 3924130) or a damaged file
            raise FreeTokenError(f"{path}: lacks {len(missing)} tensor(s) the model needs, first {missing[0]}; "
                                 "it was written by an older `ft convert` or is damaged: re-run `ft convert`")
        self.dense_fp8 = self._dense_fp8(dense)
        from ..kernels import prefill_kernels
        prefill_kernels()  # a bad FREETOKEN_PREFILL_KERNELS is an error at load, on any device
        self.max_len = min(self.cfg.max_position_embeddings, self.ecfg.max_seq_len or 1 << 62)
        self.model = cls(self.cfg, dense, self.executor, self.device, self.dtype, self.max_len)
        if self.cfg.linear_layers:
            from ..kernels import fla_delta
            fla_delta._switch()  # a bad FREETOKEN_FLA is an error at load, on any device
        self._runner = None  # the one-request serving loop behind generate()
        if self.ecfg.expert_prefetch and not self._lookahead_layers():
            log.warning("--expert-prefetch %d has no effect here: the lookahead needs --moe cache and a model whose "
                        "MoE layers predict the next one's routes (the Qwen MoE family and GPT-OSS; not the DeepSeek "
                        "family)",
                        self.ecfg.expert_prefetch)
        if self.experts_on == "cache":  # issue 11: prefill in layer-major passes, experts streamed per layer
            from .prefill_stream import PrefillStream
            self.prefill_stream = PrefillStream.for_engine(self)
        self.warm_up()

    # prompt lengths of the load-time warm-up: each row tile of the dense FP8 GEMM (16 / 32 / 64 /
    # 128, kernels/fp8_linear.py) and both sides of the grouped MoE kernels' switch from 16- to
    # 64-row tiles (kernels/moe_grouped.py: tokens x top-k against 16 x experts; added per model)
    WARM_UP_TOKENS = (16, 32, 64, 128, 1024)

    def warm_up(self) -> None:
        """Kernel autotuning and compiles at load, not in the first requests (CUDA): the prefill
        kernels against their references (kernels/prefill_proof.py), fla's DeltaNet kernels, then one prompt forward of each kind of length (_warm_up_prefill);
        then the prompt chunks' graphs of the MoE blocks and DeltaNet mixers (runtime/prefill_graphs.py)."""
        self.prefill_graphs = None
        self.prefill_graph_bytes = 0  # device memory they hold: the memory plan counts it with the weights
        if self.device.type != "cuda":
            return
        from ..kernels import prefill_proof
        prefill_proof.prove(self.cfg, self.device, self.dtype)  # off for the process where they fail here
        if self.cfg.linear_layers:
            from ..kernels import fla_delta
            fla_delta.warm_up(self.cfg, self.device, self.dtype)  # also its proof (kernels/fla_delta.py)
        if self.experts_on == "gpu" and self.ecfg.warm_up:
            self._warm_up_prefill()
            self._warm_up_gemms()
        if self.experts_on == "gpu" and self.ecfg.prefill_graphs and self.ecfg.cuda_graphs:
            from .prefill_graphs import attach
            self.prefill_graphs = attach(self.model, self.executor, self.device, self.dtype,
                                         self.ecfg.prefill_graph_tokens)
            self.prefill_graph_bytes = self.prefill_graphs.bytes if self.prefill_graphs is not None else 0

    WARM_GEMM_ROWS = 4096  # the padded row counts warmed at load go up to this (or the chunk cap)

    def _warm_up_gemms(self) -> None:
        """cuBLAS's kernel picks for every row count a prompt chunk's dense GEMMs run at (model/
        linear.py ROW_GRANULE) through the weights the warm-up forwards ran, at load: each new
        one held the host ~4.6 ms on the H200 inside the forward that met it. Up to the step
        budget (2,048 tokens by default on CUDA) or the chunk, capped at WARM_GEMM_ROWS; an idle
        step past it (--idle-step-tokens) meets a row count or two a prompt (its full steps and
        its last), not warmed here."""
        from ..model import linear as lin
        t0 = time.perf_counter()
        step = max(self.ecfg.prefill_chunk, self.ecfg.max_step_tokens or 2048)
        cap = min(step, self.max_len - 1, self.WARM_GEMM_ROWS)
        try:
            n = lin.warm_gemm_rows(cap)
            done = f"dense GEMMs warmed up: {n} row counts x weights in {time.perf_counter() - t0:.1f} s"
        except torch.OutOfMemoryError as e:  # memory this tight will tell again, where it matters
            done = f"dense GEMM warm-up skipped: {str(e).splitlines()[0]}"
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what the memory plan (and the prefill graphs' count) sees free is free
        log.info(done)

    def _warm_up_prefill(self) -> None:
        """One prompt forward of each kind of length on a scratch state, at load: Triton
        autotunes a kernel the first time it meets a new tile shape, which would otherwise land in
        a request (on the H200, 0.75 s inside one layer of the first long chunk, which the
        serving loop's cost model then read as that layer's cost: benchmarks/README.md, the
        interference rows of 2026-12-03). Resident experts only: a streamed pass (--moe cache)
        would move the whole pool, and the CPU executor has nothing to tune."""
        t0 = time.perf_counter()
        want = set(self.WARM_UP_TOKENS)
        if self.cfg.num_experts and self.cfg.top_k:  # just past the MoE tile switch
            want.add(-(-16 * self.cfg.num_experts // self.cfg.top_k) + 1)
        cap = min(max(self.ecfg.prefill_chunk, self.ecfg.max_step_tokens or 0), self.max_len - 1)
        lengths = sorted({min(n, cap) for n in want if min(n, cap) >= 1})
        if not lengths:
            return
        gen = torch.Generator().manual_seed(0)
        try:
            st = self.new_state(max(lengths) + 1)  # freed on return, before the memory plan
            with torch.no_grad():
                for n in lengths:
                    ids = torch.randint(0, self.cfg.vocab_size, (n,), generator=gen).tolist()
                    self.model.prefill(torch.tensor(ids, device=self.device), st, 0, 0)  # [1, V], dropped
            done = f"prefill kernels warmed up in {time.perf_counter() - t0:.1f} s (prompt lengths {lengths})"
        except (FreeTokenError, torch.OutOfMemoryError) as e:  # memory this tight will tell again, where it matters
            done = f"prefill warm-up skipped: {str(e).splitlines()[0]}"
        st = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            page_gather.WORKSPACE.clear()  # this thread's gather buffers: serving runs on another
            torch.cuda.empty_cache()  # what the memory plan sees free is free
        log.info(done)

    def _lookahead_layers(self) -> int:
        """MoE layers that hand the next layer's predicted routes to the expert cache."""
        return sum(bool(getattr(part, "ahead", False)) for layer in getattr(self.model, "layers", [])
                   for part in (layer if isinstance(layer, tuple) else (layer,)))

    def _weight_bytes(self, path: str) -> int:
        """Bytes of weights that will live on the compute device (on the CPU: all of them)."""
        meta, entries = read_header(path)
        el = torch.empty((), dtype=self.dtype).element_size()
        qd = (meta.get("quant") or {}).get("dense") or {}
        dequant, fp32_parts, widen_parts = (), set(), set()
        if (self.keep_fp8 and qd) or self.keep_bf16:  # the weights the model class reads other than through linear()
            cls = model_class(ModelConfig.from_hf(meta["config"], path).arch)
            dequant = getattr(cls, "DENSE_DEQUANT", ()) if self.keep_fp8 else ()
            fp32_parts, widen_parts = set(getattr(cls, "KEEP_FP32", ())), set(getattr(cls, "DENSE_WIDEN", ()))
        kept = {d["values"]: d for n, d in qd.items() if keeps_fp8(n, d, self.keep_fp8, dequant)}
        kept_scales = {d["scale"] for d in kept.values()}  # as stored; ue8m0 bytes become fp32
        # the others dequantized at load: values -> [R, C] of el, scales consumed
        dequantized = {d["values"]: d["shape"] for d in qd.values() if d["values"] not in kept}
        consumed = {d[k] for d in qd.values() for k in ("scale", "scale_2") if d.get(k)} - kept_scales
        quant_banks = (meta.get("banks") or {}).get("format", "dense") != "dense"  # bytes kept everywhere

        def size(name, e):  # floating weights are cast to the compute dtype, except host experts
            if name in consumed:
                return 0
            if name in kept:
                return e.nbytes
            if name in kept_scales:
                return e.nbytes * (4 if e.dtype == "uint8" else 1)
            if name in dequantized:
                return el * int(torch.tensor(dequantized[name]).prod())
            dt = DTYPES_BY_NAME[e.dtype]
            if not dt.is_floating_point or (name.startswith("experts.") and (self.experts_on != "gpu" or quant_banks)):
                return e.nbytes
            if (self.keep_bf16 and dt == torch.bfloat16 and len(e.shape) == 2 and not name.startswith("experts.")
                    and not (fp32_parts | widen_parts).intersection(name.split("."))):
                return e.nbytes  # kept bf16, as dense_weights keeps it
            return e.nbytes // dt.itemsize * el
        on_device = self.device.type == "cpu" or self.experts_on == "gpu"  # are the experts here?
        return sum(size(name, e) for name, e in entries.items()
                   if not name.startswith("file/") and (on_device or not name.startswith("experts.")))

    def _check_weights_fit(self, path: str) -> int:
        """The device's weight bytes, refused before loading if they exceed the budget."""
        n = self._weight_bytes(path)
        if n > self.budget:
            hint = "" if self.experts_on != "gpu" else ", or keep the experts on the host (--moe cache or cpu)"
            raise FreeTokenError(
                f"{path}: the weights take {n / 1e9:.1f} GB on {self.device}, more than the budget of "
                f"{self.budget / 1e9:.1f} GB; raise --vram-budget{hint}")
        if self.device.type == "cuda":
            self._check_host_fits(path)
        return n

    @staticmethod
    def _check_host_fits(path: str) -> None:
        """A CUDA engine reads the whole file into pinned host memory first (the experts stay
        there for the cache and the CPU branch), which cannot be swapped. Under a container's
        memory limit (a hard one: the OOM killer ends the process past it) a larger file is
        refused here with both figures, not killed half-way through the load. Against the host's
        MemAvailable only a warning: it can under-count what the kernel would free (ZFS's ARC is
        not in it), so the load is tried."""
        from .budget import host_available
        need, left, avail = os.path.getsize(path), limits.memory_left(), host_available()
        what = (f"{path}: loading it takes {need / 1e9:.1f} GB of host memory (it is read into pinned memory "
                "before the GPU gets its part)")
        if left is not None and need > left:
            raise FreeTokenError(f"{what} and this container's memory limit leaves {left / 1e9:.1f} GB; raise the "
                                 "container's limit (docker run --memory), or use a smaller quantization of the model")
        if avail and need > avail:
            log.warning("%s and the host reports %.1f GB available (MemAvailable): the load may fail or swap",
                        what, avail / 1e9)

    @staticmethod
    def _has_fp8_dense(path: str) -> bool:
        """Whether the checkpoint stores dense weights in FP8 blocks (its header alone)."""
        qd = (read_header(path)[0].get("quant") or {}).get("dense") or {}
        return any(d.get("format") == "fp8_block" for d in qd.values())

    def _host_fp8_kernel(self) -> bool:
        """Whether a CPU engine's decode rows can read FP8 dense weights in place (the C++ kernel
        built and not turned off by FREETOKEN_CPU_KERNELS=0)."""
        from ..experts import cpu
        return self.device.type == "cpu" and cpu.DECODE_KERNELS and cpu.extension() is not None

    def _dense_fp8(self, dense: dict) -> str:
        """describe()'s dense_fp8: "kept" (some dense weights are Fp8BlockWeight), "dequantized"
        (the checkpoint has FP8 dense weights, all dequantized at load) or "none"."""
        if any(isinstance(v, Fp8BlockWeight) for v in dense.values()):
            return "kept"
        qd = (self.meta.get("quant") or {}).get("dense") or {}
        return "dequantized" if any(d["format"] == "fp8_block" for d in qd.values()) else "none"

    def describe(self) -> dict:
        """What runs where (start-up banner, /health, /metrics): device, dtype, expert backend."""
        ex = self.executor
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "experts": self.experts_on, "expert_backend": ex.backend if ex is not None else "none",
                "expert_isa": getattr(ex, "isa", None), "expert_threads": getattr(ex, "threads", None),
                "expert_format": self.expert_format, "expert_pieces": getattr(ex, "pieces", 1), "cpu_act": self._cpu_act(ex), "dense_fp8": self.dense_fp8,
                "context": self.max_len, "prefill_graphs": getattr(self, "prefill_graphs", None) is not None,
                "prefill_kernels": self._prefill_kernels_state()}

    def _prefill_kernels_state(self) -> str | None:
        """CUDA: "on", "off" (FREETOKEN_PREFILL_KERNELS=0) or "off: why" (the load-time proof
        failed on this GPU, kernels/prefill_proof.py); None elsewhere (they are CUDA kernels)."""
        if self.device.type != "cuda":
            return None
        from ..kernels import _PREFILL_OFF, prefill_kernels
        if prefill_kernels():
            return "on"
        return f"off: {_PREFILL_OFF[0]}" if _PREFILL_OFF else "off"

    @staticmethod
    def _cpu_act(ex) -> str | None:
        """The host executor's activations (exact, int8, int8-scalar), through a cache or a
        streamed wrapper; None without a C++ host executor."""
        for e in (ex, getattr(ex, "cpu", None), getattr(ex, "inner", None)):
            if getattr(e, "act", None) is not None:
                return e.act
        return None

    def _quantized_executor(self, banks: ExpertBanks):
        """Quantized expert banks keep their bytes. Resident on the device (--moe resident): the
        Triton kernels that dequantize in registers (kernels/moe_quant.py; the torch path on the
        CPU). On the host: the C++ executor, which reads the banks in place and dequantizes in
        its kernels (any expert function: GPT-OSS's too); the torch path there ("torch-fallback")
        when the extension cannot be built. The GPU expert cache (--moe cache): slots holding the
        quantized bytes (and bias rows), the quantized kernels over them, that host executor for
        its CPU branch."""
        self._warn_pieces_unused()
        if self.experts_on == "gpu":
            if self.ecfg.cpu_act == "int8":
                log.info("--cpu-act int8: no expert runs on the CPU (--moe resident); ignored")
            b = banks.to(self.device)
            return TorchExpertExecutor(b.gate_up, b.down, layer_experts=self.cfg.num_experts, **self.expert_fn)
        gate_up, down, pieces, fn = self._cut_experts(banks.gate_up, banks.down)  # pieces: whole scale blocks each
        banks = ExpertBanks(banks.format, gate_up, down)
        from ..experts.cpu import CpuExpertExecutor, extension
        if extension() is not None:
            host = CpuExpertExecutor(banks, threads=self._cpu_threads(), act_int8=self.ecfg.cpu_act == "int8",
                                     spin=self._cpu_spin(), **fn)
        else:
            log.warning("%s experts: the C++ expert executor could not be built; the experts run on the torch "
                        "path on the host (slower%s)", banks.format,
                        "; --cpu-act int8 does not apply there" if self.ecfg.cpu_act == "int8" else "")
            host = QuantizedHostExecutor(banks.gate_up, banks.down, layer_experts=self.cfg.num_experts * pieces, **fn)
        if self.experts_on != "cache":
            return host
        return self._cache_executor(banks.gate_up, banks.down, host, pieces, fn)

    def _warn_pieces_unused(self) -> None:
        if self.ecfg.expert_pieces > 1 and self.experts_on != "cache":
            log.warning("--expert-pieces %d has no effect with the experts %s: pieces are for --moe cache",
                        self.ecfg.expert_pieces, "in VRAM" if self.experts_on == "gpu" else "on the CPU")

    def _warn_cache_flags_unused(self) -> None:
        """The expert cache's flags given where no cache runs: said, not silently dropped (a user
        who sized the cache by hand should hear that the engine chose another mode)."""
        if self.experts_on == "cache":
            return
        # (--expert-prefetch has its own warning, which covers more cases)
        given = [f"--{k.replace('_', '-')} {v}" for k, v, default in (
            ("expert_cache", self.ecfg.expert_cache, ""), ("fill_share", self.ecfg.fill_share, "auto"),
            ("cache_policy", self.ecfg.cache_policy, "recent")) if str(v).strip().lower() != default]
        if given:
            where = "in VRAM" if self.experts_on == "gpu" else "on the CPU"
            log.warning("%s: no effect, the experts run %s here; these flags are for --moe cache",
                        ", ".join(given), where)

    def _executor(self, gate_up, down):
        if gate_up is None:
            return None
        self._warn_pieces_unused()
        if self.experts_on == "gpu":
            return TorchExpertExecutor(gate_up.to(self.device, self.dtype), down.to(self.device, self.dtype),
                                       layer_experts=self.cfg.num_experts, **self.expert_fn)
        gate_up, down, pieces, fn = self._cut_experts(gate_up, down)  # with pieces, every executor below sees pieces
        from ..experts.cpu import CpuExpertExecutor, extension
        if not self.plain_experts and extension() is None:  # GPT-OSS without the C++ executor: the torch path
            log.warning("%s experts on the host run on the torch path (the C++ expert executor could not be "
                        "built; slower)", fn["activation"].kind)
            host = QuantizedHostExecutor(gate_up, down, layer_experts=self.cfg.num_experts * pieces, **fn)
            return self._cache_executor(gate_up, down, host, pieces, fn) if self.experts_on == "cache" else host
        if self.ecfg.cpu_act == "int8":
            log.info("--cpu-act int8: %s experts stay exact (int8 activations serve MXFP4 / NVFP4 banks)",
                     self.expert_format)
        cpu = CpuExpertExecutor(gate_up, down, threads=self._cpu_threads(), spin=self._cpu_spin(), **fn)
        if self.experts_on != "cache":
            from ..experts.cpu.hostcall import StreamedCpuExecutor, host_branch_ok
            if self.device.type == "cuda" and host_branch_ok(cpu):  # decode steps in stream order: one graph
                return StreamedCpuExecutor(cpu, self.device)
            return cpu
        return self._cache_executor(gate_up, down, cpu, pieces, fn)

    def _cut_experts(self, gate_up, down):
        """With --moe cache and --expert-pieces p > 1: the banks (dense or quantized) cut into p
        pieces per expert (experts/pieces.py), re-laid in place (no second copy of the banks),
        with the expert function's bias banks cut to match. -> (gate_up, down, p, expert_fn);
        otherwise the banks as they are, p = 1."""
        p = self.ecfg.expert_pieces if self.experts_on == "cache" else 1
        if p == 1:
            return gate_up, down, 1, self.expert_fn
        from ..experts.pieces import split_banks_, split_biases
        try:
            gate_up, down = split_banks_(gate_up, down, p)
        except ValueError as e:
            raise FreeTokenError(f"--expert-pieces {p}: {e}") from None
        gub, dnb = split_biases(self.expert_fn["gate_up_bias"], self.expert_fn["down_bias"], p)
        log.info("experts cut into %d pieces of %d intermediate rows each (--expert-pieces)", p, down.shape[-1])
        return gate_up, down, p, dict(self.expert_fn, gate_up_bias=gub, down_bias=dnb)

    def _cache_executor(self, gate_up, down, cpu, pieces: int = 1, expert_fn: dict | None = None):
        """The GPU expert cache over host banks (dense or QuantBanks) with `cpu` for its CPU
        branch; its slots are sized later by the memory plan (slot_bytes counts every bank).
        pieces > 1: the banks are cut (_cut_experts), the MoE layers' routes expanded per call."""
        from ..experts.cached import CachedExpertExecutor
        if self.device.type != "cuda":
            log.warning("--moe cache without CUDA: the expert slots are host memory (a functional test "
                        "of the cache, not a speed-up)")
        start = 1.0
        if self.ecfg.fill_share_value() is None:  # adaptive: start from `ft bench bw`'s profile if there is one
            from .bandwidth import load_profile, predicted_share
            prof = load_profile(self.cfg, getattr(cpu, "threads", 0) or 0, self.expert_format,
                                act=getattr(cpu, "act", None) or "exact")
            start = predicted_share(prof) if prof else 1.0
        cache = CachedExpertExecutor(gate_up, down, None, self.device, self.dtype, cpu,
                                     self.ecfg.fill_share_value(), self.ecfg.cache_policy, self.cfg.num_experts * pieces,
                                     start_share=start, prefetch=self.ecfg.expert_prefetch * pieces,
                                     **(expert_fn or self.expert_fn))
        if pieces > 1:
            from ..experts.pieces import PiecedExecutor
            return PiecedExecutor(cache, pieces)
        return cache

    def _cpu_spin(self) -> int | None:
        """The C++ pool's spin: none where torch computes on the same cores (a CPU engine:
        experts/cpu SPIN_SHARED), the pool's default on CUDA."""
        from ..experts.cpu import SPIN_SHARED
        return SPIN_SHARED if self.device.type == "cpu" else None

    def _keep_to_cpu_quota(self) -> None:
        """Under a container's CPU quota (freetoken/limits.py), said once at start: the default
        thread counts keep within it (physical_cores), torch's own too on a CPU engine (it sizes
        its pool from the affinity mask, the whole host), and a --cpu-threads above it is warned
        about (its workers would be throttled every period)."""
        quota = limits.process_cpu_limit()
        if quota is None:
            return
        if self.ecfg.cpu_threads > quota:
            log.warning("--cpu-threads %d is more than this container's CPU quota of %d CPUs: its workers will be "
                        "throttled, and a step waits for the slowest; try --cpu-threads %d", self.ecfg.cpu_threads,
                        quota, quota)
        elif not self.ecfg.cpu_threads and limits.quota_binds():
            notice(f"this container may use {quota} CPUs (its CPU quota): the CPU threads default to that, "
                   "unpinned (--cpu-threads overrides; FREETOKEN_IGNORE_CPU_QUOTA=1 ignores the quota)")
            if self.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > quota:
                torch.set_num_threads(quota)

    def _cpu_threads(self) -> int:
        """--cpu-threads, or its default: every physical core on a CPU-only machine; on CUDA two
        fewer (measured on the H200 host, 16 cores: a CPU branch on all 16 ran 2-3x slower than
        on 6, its pinned workers competing with the launching and callback threads)."""
        if self.ecfg.cpu_threads or self.device.type != "cuda":
            return self.ecfg.cpu_threads
        from ..experts.cpu import physical_cores
        return max(1, len(physical_cores()) - 2)

    def _eos_ids(self, files) -> set[int]:
        ids = set(self.cfg.eos_token_ids)
        gen = load_json(files.get("generation_config.json"), "generation_config.json")
        e = gen.get("eos_token_id")
        ids |= set([e] if isinstance(e, int) else (e or []))
        t = self.tokenizer.named_token("eos_token")
        if t is not None:
            ids.add(t)
        return ids

    def check_context(self, n_prompt: int, max_tokens: int) -> None:
        if n_prompt == 0:
            raise FreeTokenError("the prompt is empty")
        if n_prompt + max_tokens > self.max_len:
            raise ContextOverflowError(
                f"prompt of {n_prompt} tokens plus {max_tokens} new tokens exceeds the context of "
                f"{self.max_len} tokens; shorten the prompt or lower max tokens")

    def new_state(self, length: int, slots: int = 1) -> DecodeState:
        """A state whose slots each own pages for `length` positions (single-sequence use:
        tests, benchmarks; the serving loop sizes its pool from the memory plan)."""
        length = min(self.max_len, -(-length // 256) * 256)
        chunk, sliding = self.ecfg.prefill_chunk, self.ecfg.sliding_kv
        need = state_bytes(self.cfg, slots, length, self.dtype, chunk=chunk, sliding=sliding)
        if need > self.budget - self.weight_bytes:
            raise FreeTokenError(
                f"{slots} sequence slot(s) x {length} tokens of KV/recurrent state need {need / 1e9:.1f} GB "
                f"but {max(self.budget - self.weight_bytes, 0) / 1e9:.1f} GB is left on {self.device}; "
                "lower --max-seq-len or --max-batch")
        ex = self.executor
        if getattr(ex, "pool", 0) is None:  # a GPU expert cache: what the state leaves, at most every expert
            ex.allocate(max(1, (self.budget - self.weight_bytes - need) // ex.slot_bytes))
        st = DecodeState(self.cfg, slots, length, self.device, self.dtype, chunk=chunk, sliding=sliding)
        for s in range(slots):
            st.reserve(s, length)
        return st

    def prefill(self, ids: list[int], st: DecodeState, slot: int = 0, start: int = 0,
                all_logits: bool = False, logits: bool = True, capture=None) -> torch.Tensor | None:
        """Chunked prefill of ids at positions start..; returns logits of the last (or all),
        or None with logits=False. capture: recurrent-state checkpoints to take on the way."""
        if self.prefill_stream is not None and not all_logits:  # issue 11: passes, experts streamed
            return self.prefill_stream.prefill(ids, st, slot, start, logits, capture)
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        outs = []
        n = self.ecfg.prefill_chunk
        for s in range(0, len(ids), n):
            last = s + n >= len(ids)
            out = self.model.prefill(tokens[s:s + n], st, slot, start + s, all_logits,
                                     logits=all_logits or (logits and last), capture=capture)
            outs.append(out)
        return torch.cat(outs) if all_logits else outs[-1]

    def prefill_batch(self, st: DecodeState, segs: list, between=None, mid_layer: bool = False,
                      key_points: bool = False) -> torch.Tensor | None:
        """segs: [(tokens, slot, start, capture, logits)] -> logits of the segments asking
        for them ([S, V]) or None (model.prefill_batch). between(i): called before layer i
        (the serving loop's decode steps between layers; in streamed passes with the expert
        cache frozen, runtime/prefill_stream.py); mid_layer: also between each layer's mixer and
        its MLP, at i + 0.5 (not in streamed passes: a decode step there costs the pass);
        key_points: also between the key pieces of a long context's attention on the CPU
        (kernels/split_keys.py; not in streamed passes either)."""
        if self.prefill_stream is not None:  # issue 11: passes, experts streamed
            return self.prefill_stream.prefill_batch(st, segs, between)
        tokens = torch.tensor([t for seg in segs for t in seg[0]], dtype=torch.long, device=self.device)
        return self.model.prefill_batch(tokens, st, [(slot, start, len(toks), cap, want)
                                                     for toks, slot, start, cap, want in segs], hook=between,
                                        mid_layer=mid_layer and between is not None,
                                        key_points=key_points and between is not None)

    def forward_mixed(self, st: DecodeState, tokens: list[int], pos: list[int], active: list[bool],
                      segs: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode rows and prompt chunks in one forward (model.forward_mixed); segs as for
        prefill_batch."""
        dev = self.device
        pre = torch.tensor([t for seg in segs for t in seg[0]], dtype=torch.long, device=dev)
        return self.model.forward_mixed(
            torch.tensor(tokens, device=dev), st, torch.tensor(pos, device=dev), torch.tensor(active, device=dev),
            pre, [(slot, start, len(toks), cap, want) for toks, slot, start, cap, want in segs])

    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop_at_eos: bool = True, penalties: dict | None = None) -> Generation:
        """One request through the same engine step as the server (a one-slot serving loop
        driven in this thread, without the prefix cache). penalties: SamplingOptions' logit
        adjustments (presence_penalty, frequency_penalty, repetition_penalty, logit_bias)."""
        from .request import Request, SamplingOptions
        params = params or SamplingParams(temperature=0.0)
        self.check_context(len(prompt_ids), max_tokens)
        if self._runner is None:
            from .serving import ServingEngine
            self._runner = ServingEngine(self, max_batch=1, max_queue=1, start=False)
        req = Request(list(prompt_ids), SamplingOptions(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
            min_p=params.min_p, max_tokens=max_tokens, ignore_eos=not stop_at_eos, **(penalties or {})))
        self._runner.run_to_completion(req)
        if req.finish_reason == "error":
            raise RuntimeError(f"generation failed: {req.error}")
        first = req.first_token_at or req.finished_at
        return Generation(req.output_ids, req.logprobs, self.tokenizer.decode(req.output_ids),
                          "stop" if req.finish_reason == "stop" else "length", len(prompt_ids),
                          first - req.arrival, req.finished_at - first)

    @property
    def host_wait_blocks(self) -> bool:
        """Whether the serving loop waits for a decode step asleep (a blocking event) rather than
        spinning: on CUDA with a CPU branch in the step, unless FREETOKEN_HOST_WAIT says otherwise
        (runtime/host_wait.py: the spinning thread took a core the C++ executor's workers needed)."""
        return self.device.type == "cuda" and host_wait.blocks(host_wait.has_cpu_branch(getattr(self, "executor", None)))

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
