"""Engine: load an FTW model onto a device and generate.

Loading reads every entry straight into host tensors (weights/reader.py), moves the non-expert
weights to the compute device, and gives the expert banks to an ExpertExecutor: on the CPU
they stay in host memory for the C++ executor; on CUDA with experts="gpu" all experts are
resident in VRAM (the full-VRAM baseline); experts="cpu" on CUDA is the CPU-only MoE backend.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import ContextOverflowError, FreeTokenError
from ..experts.executor import TorchExpertExecutor
from ..model.registry import model_class
from ..model.state import DecodeState, state_bytes
from ..tokenizer import Tokenizer, load_json
from ..weights.reader import load_ftw
from .sampler import SamplingParams, sample

log = logging.getLogger("freetoken.engine")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda", "choices": ["auto", "cpu", "cuda"]})
    dtype: str = field(default="auto", metadata={
        "help": "compute dtype (auto: bfloat16 on CUDA, float32 on CPU)",
        "choices": ["auto", "float32", "bfloat16"]})
    experts: str = field(default="auto", metadata={
        "help": "where routed experts run: gpu = all resident in VRAM, cpu = C++ executor on host "
                "memory (auto: gpu on CUDA, cpu otherwise)", "choices": ["auto", "cpu", "gpu"]})
    cpu_threads: int = field(default=0, metadata={"help": "CPU expert threads (0: physical cores)"})
    prefill_chunk: int = field(default=2048, metadata={"help": "tokens per prefill chunk"})
    max_seq_len: int = field(default=0, metadata={"help": "context limit (0: the model's)"})
    verify: bool = field(default=True, metadata={"help": "check FTW block checksums while loading"})

    def __post_init__(self):
        if self.prefill_chunk < 1:
            raise FreeTokenError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise FreeTokenError("--device cuda: no CUDA device is available")

    def resolved(self):
        dev = "cuda" if self.device == "auto" and torch.cuda.is_available() else self.device
        dev = "cpu" if dev == "auto" else dev
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if dev == "cuda" else "float32")
        experts = self.experts if self.experts != "auto" else ("gpu" if dev == "cuda" else "cpu")
        if experts == "gpu" and dev != "cuda":
            raise FreeTokenError("--experts gpu needs --device cuda")
        return torch.device(dev), DTYPES[dtype], experts


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (end-of-sequence token) | "length"
    prompt_tokens: int
    prefill_s: float
    decode_s: float


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Engine:
    def __init__(self, path: str, ecfg: EngineConfig | None = None, progress: bool = False):
        self.path = path
        self.ecfg = ecfg or EngineConfig()
        self.device, self.dtype, self.experts_on = self.ecfg.resolved()
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
        banks = meta.get("banks", {})
        self.executor = self._executor(w.get(banks.get("gate_up")), w.get(banks.get("down")))
        dense = {k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                 for k, v in w.items() if not k.startswith(("file/", "experts."))}
        self.max_len = min(self.cfg.max_position_embeddings, self.ecfg.max_seq_len or 1 << 62)
        self.model = model_class(self.cfg.arch)(self.cfg, dense, self.executor, self.device,
                                                self.dtype, self.max_len)

    def describe(self) -> dict:
        """What runs where (start-up banner, /health, /metrics): device, dtype, expert backend."""
        ex = self.executor
        return {"device": str(self.device), "dtype": str(self.dtype).replace("torch.", ""),
                "experts": self.experts_on, "expert_backend": ex.backend if ex is not None else "none",
                "expert_isa": getattr(ex, "isa", None), "expert_threads": getattr(ex, "threads", None),
                "context": self.max_len}

    def _executor(self, gate_up, down):
        if gate_up is None:
            return None
        if self.experts_on == "gpu":
            return TorchExpertExecutor(gate_up.to(self.device, self.dtype), down.to(self.device, self.dtype),
                                       layer_experts=self.cfg.num_experts)
        from ..experts.cpu import CpuExpertExecutor
        return CpuExpertExecutor(gate_up, down, threads=self.ecfg.cpu_threads)

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
        length = min(self.max_len, -(-length // 256) * 256)
        self.check_memory(state_bytes(self.cfg, slots, length, self.dtype),
                          f"{slots} sequence slot(s) x {length} tokens of KV/recurrent state")
        return DecodeState(self.cfg, slots, length, self.device, self.dtype)

    def check_memory(self, need: int, what: str) -> None:
        """Refuse an allocation that cannot fit, with what to change, rather than dying in it."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = _host_available()
        if free and need > 0.95 * free:
            raise FreeTokenError(
                f"{what} needs {need / 1e9:.1f} GB but only {free / 1e9:.1f} GB is free on {self.device}; "
                "lower --max-seq-len or --max-batch")

    def prefill(self, ids: list[int], st: DecodeState, slot: int = 0, start: int = 0,
                all_logits: bool = False, logits: bool = True, capture=None) -> torch.Tensor | None:
        """Chunked prefill of ids at positions start..; returns logits of the last (or all),
        or None with logits=False. capture: recurrent-state checkpoints to take on the way."""
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        outs = []
        n = self.ecfg.prefill_chunk
        for s in range(0, len(ids), n):
            last = s + n >= len(ids)
            out = self.model.prefill(tokens[s:s + n], st, slot, start + s, all_logits,
                                     logits=all_logits or (logits and last), capture=capture)
            outs.append(out)
        return torch.cat(outs) if all_logits else outs[-1]

    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop_at_eos: bool = True) -> Generation:
        params = params or SamplingParams(temperature=0.0)
        self.check_context(len(prompt_ids), max_tokens)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        st = self.new_state(len(prompt_ids) + max_tokens)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, st)[-1]
        self._sync()
        t1 = time.perf_counter()
        out, lps, finish = [], [], "length"
        pos = len(prompt_ids)
        for _ in range(max_tokens):
            tok, lp, _ = sample(logits, params, gen)
            out.append(tok)
            lps.append(lp)
            if stop_at_eos and tok in self.eos_ids:
                finish = "stop"
                break
            if len(out) == max_tokens:
                break
            t = torch.tensor([tok], device=self.device)
            p = torch.tensor([pos], device=self.device)
            logits = self.model.decode(t, st, p, pos + 1)[0]
            pos += 1
        self._sync()
        t2 = time.perf_counter()
        return Generation(out, lps, self.tokenizer.decode(out), finish, len(prompt_ids), t1 - t0, t2 - t1)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
