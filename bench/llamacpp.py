"""llama.cpp side by side, on the same machine and the same weights.

llama.cpp is built from the source vendored in the llama-cpp-python sdist (`bench/fetch_llamacpp.sh`
puts a stripped copy in the git-ignored .llama/, which the device tool carries); the weights a
benchmark made in memory are written as a GGUF by llama.cpp's own converter (its
`conversion` package, fed our tensors under their published transformers names instead of
reading safetensors files), and decode is timed with `llama-bench`.

Used by bench.expert_cache (`--llamacpp`) to fill each row's `llamacpp_tok_s`; run alone it
checks the export on a tiny random model: llama.cpp's logits against FreeToken's engine on the
same weights and tokens (CPU build):
    python -m bench.llamacpp --check [--build-dir .llama/build-cpu] [--experts mxfp4]
(`--experts mxfp4`: the routed experts as our MXFP4 banks, written as ggml MXFP4 tensors by the
converter's own lossless repack: the same values on both sides).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from bench.decode import QWEN36_35B_A3B
from freetoken.cuda_queues import VAR, child_env

ROOT = Path(".llama")


def source(root: Path = ROOT) -> Path:
    """The llama.cpp source tree, unpacked from .llama/llama.cpp.tar.xz on first use."""
    src = root / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        tar = root / "llama.cpp.tar.xz"
        if not tar.exists():
            raise FileNotFoundError(f"no llama.cpp source in {root}/: run `bash bench/fetch_llamacpp.sh` from the repo root first")
        with tarfile.open(tar) as t:
            t.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return src


def build(src: Path, out: Path, cuda: bool, jobs: int | None = None, log=None, shared: bool | None = None) -> Path:
    """llama-bench (and its libraries) built into `out` once; the path of the binary.
    CUDA builds target sm_90 only (the H200): one architecture keeps the build to minutes; they
    link llama.cpp statically (one file to bring back from the GPU machine). The CPU build is
    shared: --check loads libllama.so through ctypes."""
    shared = (not cuda) if shared is None else shared
    binary = out / "bin" / "llama-bench"
    lock = out / ".building"  # another process building here (a device plan's background build): wait for it
    out.mkdir(parents=True, exist_ok=True)
    waited = time.perf_counter()
    while True:
        # the binary appears when its link starts (empty, not executable): it is done only once
        # no live builder holds the lock
        while lock.exists() and _alive(lock) and time.perf_counter() - waited < 1800:
            time.sleep(5)
        if binary.exists() and os.access(binary, os.X_OK) and not (lock.exists() and _alive(lock)):
            return binary
        lock.unlink(missing_ok=True)  # a dead builder's (or none)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # atomic: one builder at a time
        except FileExistsError:
            continue  # another process took it first: wait for that one
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    try:
        return _build(src, out, cuda, jobs, log, shared, binary)
    finally:
        lock.unlink(missing_ok=True)


def _alive(lock: Path) -> bool:
    """Whether the process that wrote the build lock still runs (a crashed build leaves it)."""
    try:
        pid = lock.read_text()
        if not pid:  # created, its pid not written yet
            return True
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError):
        return False


def _build(src: Path, out: Path, cuda: bool, jobs, log, shared: bool, binary: Path) -> Path:
    cfg = ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_BUILD_APP=OFF", "-DGGML_NATIVE=ON", f"-DGGML_CUDA={'ON' if cuda else 'OFF'}",
           f"-DBUILD_SHARED_LIBS={'ON' if shared else 'OFF'}"]
    if cuda:
        cfg.append("-DCMAKE_CUDA_ARCHITECTURES=90")
    t0 = time.perf_counter()
    subprocess.run(cfg, check=True, stdout=log, stderr=subprocess.STDOUT)
    subprocess.run(["cmake", "--build", str(out), "--target", "llama-bench", "-j", str(jobs or os.cpu_count())],
                   check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"llama.cpp built in {time.perf_counter() - t0:.0f} s: {binary}", flush=True)
    return binary


def _converter(src: Path):
    """llama.cpp's converter package (and the gguf-py it was written against)."""
    for p in (src / "gguf-py", src):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))
    import gguf
    from conversion import get_model_class
    from conversion.base import LazyTorchTensor
    return gguf, get_model_class, LazyTorchTensor


def export_gguf(config: dict, tensors: dict[str, torch.Tensor], out: Path, src: Path,
                mxfp4_experts: dict | None = None) -> Path:
    """Write `tensors` (transformers names and layouts, as published; any device) as a BF16 GGUF
    with llama.cpp's converter for config["architectures"][0]. The converter streams: each
    tensor is moved to the CPU, transformed and written one at a time. No tokenizer: the file
    says `none` with vocab_size dummy tokens, which is all llama-bench needs.
    mxfp4_experts: {layer: (gate_up, down)} MXFP4 QuantBanks of a layer's routed experts
    ([E, 2I, H] and [E, H, I], experts/banks.py's layout), written as ggml MXFP4 tensors
    (ffn_gate_exps, ffn_up_exps, ffn_down_exps) by the converter's own lossless repack, one
    tensor in memory at a time: the same values llama.cpp then reads, not a re-quantization."""
    gguf, get_model_class, Lazy = _converter(src)
    base = get_model_class(config["architectures"][0])
    experts = mxfp4_experts or {}

    class FromMemory(base):  # type: ignore[misc, valid-type]
        model_arch = base.model_arch
        no_mtp = True  # a benchmark slice has no multi-token-prediction head

        def index_tensors(self, remote_hf_model_id=None):
            type(self)._original_block_count = self.hparams["num_hidden_layers"]  # read by Qwen's name filter
            items = ((n, lambda t=t: Lazy.from_eager(t.detach().to("cpu"))) for n, t in tensors.items())
            return dict(it for it in map(self.filter_tensors, items) if it is not None)

        def set_vocab(self):
            self.gguf_writer.add_tokenizer_model("none")
            self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

        def generate_extra_tensors(self):
            kinds = gguf.MODEL_TENSOR
            for layer, (gu, dn) in experts.items():
                i = dn.shape[2]
                for kind, v, sc in ((kinds.FFN_GATE_EXP, gu.values[:, :i], gu.scale[:, :i]),  # [E, I, H/2], [E, I, H/32]
                                    (kinds.FFN_UP_EXP, gu.values[:, i:], gu.scale[:, i:]),
                                    (kinds.FFN_DOWN_EXP, dn.values, dn.scale)):  # [E, H, I/2], [E, H, I/32]
                    self.gguf_writer.add_tensor(self.format_tensor_name(kind, layer), _mxfp4_lazy(gguf, base, v, sc),
                                                raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            return ()

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:  # the converter looks for model-card files here
        (Path(d) / "config.json").write_text(json.dumps(config))
        model = FromMemory(Path(d), gguf.LlamaFileType.MOSTLY_BF16, out, hparams=dict(config))
        model.write()
    return out


def _mxfp4_lazy(gguf, base, values: torch.Tensor, scale: torch.Tensor):
    """One MXFP4 expert tensor [E, R, C/2] (+ scales [E, R, C/32]) as ggml block_mxfp4 bytes
    [E, R, C/32 x 17], made when the writer gets to it (llama.cpp's repack_mxfp4_blocks)."""
    import numpy as np
    e, r, half = values.shape
    shape = (e, r, half * 2 // 32 * 17)

    def make(v, sc):
        flat = base.repack_mxfp4_blocks(v.cpu().reshape(e * r, half), sc.cpu().reshape(e * r, -1))  # [E R, C/32 x 17]
        return flat.reshape(shape)
    return gguf.LazyNumpyTensor(meta=gguf.LazyNumpyTensor.meta_with_dtype_and_shape(np.uint8, shape),
                                args=(values, scale), func=make)


def slice_gguf(cfg: dict, mc, w: dict, gu, dn, path: str, src: Path, source_tag: str = "bench",
               seed: int = 0) -> tuple[Path, float | None]:
    """The GGUF of a benchmark slice (dense weights `w` by their published names, expert banks
    gu [N, 2I, H] and dn [N, H, I] with N = layers x experts: dense tensors, written BF16, or
    MXFP4 QuantBanks, written as ggml MXFP4 with the same values), written once per config: the
    benchmarks make their weights from the config with fixed seeds, so a file written for the
    same config, expert format and benchmark (`source_tag`: each makes its weights its own way)
    on this machine (a warm GPU machine between calls) is reused. Refused, before anything is
    written, when the file would not fit on its disk. -> (path, export seconds or None when
    reused)."""
    import shutil
    fmt = getattr(gu, "format", "bf16")
    if fmt not in ("bf16", "mxfp4"):
        raise ValueError(f"llama.cpp side by side takes bf16 or mxfp4 experts, not {fmt}")
    gguf, stamp = Path(path), Path(path + ".json")
    want = json.dumps({"config": cfg, "seed": seed, "experts": fmt, "source": source_tag}, sort_keys=True)
    if gguf.exists() and stamp.exists() and stamp.read_text() == want:
        return gguf, None
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.unlink(missing_ok=True)
    stamp.unlink(missing_ok=True)
    banks = [gu, dn] if isinstance(gu, torch.Tensor) else gu.tensors() + dn.tensors()
    need = sum(t.numel() * t.element_size() for t in list(w.values()) + banks) * 1.06  # + ggml block headers
    free = shutil.disk_usage(gguf.parent).free
    if need > free:
        raise RuntimeError(f"the GGUF needs ~{need / 1e9:.1f} GB and {gguf.parent} has {free / 1e9:.1f} GB free: "
                           "use fewer layers or MXFP4 experts, or another --gguf path")
    t0 = time.perf_counter()
    tensors, mx = dict(w), None
    e = mc.num_experts
    if isinstance(gu, torch.Tensor):
        for j, l in enumerate(mc.moe_layers):  # the banks' rows of layer l, as published (fused)
            tensors[f"model.layers.{l}.mlp.experts.gate_up_proj"] = gu[j * e:(j + 1) * e]  # [E, 2I, H]
            tensors[f"model.layers.{l}.mlp.experts.down_proj"] = dn[j * e:(j + 1) * e]  # [E, H, I]
    else:
        from freetoken.experts.banks import ExpertBanks
        mx = layer_banks(ExpertBanks(fmt, gu, dn), mc)
    export_gguf(cfg, tensors, gguf, src, mx)
    stamp.write_text(want)
    return gguf, time.perf_counter() - t0


def _llama_bench(cmd: list[str]) -> dict:
    # with the launch queues its user chose, not the 4x freetoken sets for itself (cuda_queues.py)
    env = child_env()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}): {p.stderr[-600:]}")
    row = json.loads(p.stdout)[0]
    return {"tok_s": round(row["avg_ts"], 1), "stddev": round(row["stddev_ts"], 1), "command": " ".join(cmd[1:]),
            "cuda_scale_launch_queues": env.get(VAR)}


def bench_decode(binary: Path, model: Path, *, threads: int, n_cpu_moe: int, n_gen: int = 64,
                 reps: int = 3, gpu: bool = True) -> dict:
    """llama-bench decode (tg, batch 1) with the experts of the first n_cpu_moe layers kept on
    the CPU (`-ncmoe`): tok/s mean and standard deviation over `reps` runs."""
    cmd = [str(binary), "-m", str(model), "-p", "0", "-n", str(n_gen), "-r", str(reps), "-t", str(threads),
           "-ngl", "99" if gpu else "0", "-fa", "1" if gpu else "0", "-o", "json"]
    if gpu:
        cmd += ["-ncmoe", str(n_cpu_moe)]
    return dict(_llama_bench(cmd), threads=threads, n_cpu_moe=n_cpu_moe if gpu else None)


def bench_prefill(binary: Path, model: Path, *, tokens: int, n_cpu_moe: int, threads: int, ubatch: int | None = None,
                  reps: int = 1, gpu: bool = True) -> dict:
    """llama-bench prompt processing (pp) of `tokens` tokens, experts of the first n_cpu_moe
    layers in host memory (llama.cpp copies them to the GPU for each micro-batch of `ubatch`
    tokens: its default 512, or larger with -ub; the batch -b follows). gpu False: everything on
    the CPU (-ngl 0; n_cpu_moe unused)."""
    cmd = [str(binary), "-m", str(model), "-p", str(tokens), "-n", "0", "-r", str(reps), "-t", str(threads),
           "-ngl", "99" if gpu else "0", "-fa", "1" if gpu else "0", "-o", "json"]
    if gpu:
        cmd += ["-ncmoe", str(n_cpu_moe)]
    if ubatch:
        cmd += ["-ub", str(ubatch), "-b", str(max(ubatch, 2048))]
    return dict(_llama_bench(cmd), tokens=tokens, ubatch=ubatch or 512, n_cpu_moe=n_cpu_moe, threads=threads)


def n_cpu_moe_for(capacity: float, layers: int) -> int:
    """The `-ncmoe` giving llama.cpp the same share of the experts in VRAM as a cache of
    `capacity` (llama.cpp keeps whole layers' experts on the CPU; -ncmoe counts blocks, so this
    holds for models whose every layer is MoE, as both benchmark shapes are)."""
    return max(0, min(layers, round(layers * (1.0 - capacity))))


# ------------------------------------------------------------------ export check (tiny model)

# the full-size shape's config, made tiny (same architecture and options)
TINY = dict(QWEN36_35B_A3B, vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            shared_expert_intermediate_size=128, max_position_embeddings=4096)


def llama_logits(lib_dir: Path, model: Path, tokens: list[int], n_vocab: int) -> torch.Tensor:
    """Logits of every position from libllama through llama-cpp-python's ctypes bindings (the
    sdist's `llama_cpp` package, pointed at our build with LLAMA_CPP_LIB_PATH)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    sys.path.insert(0, str(ROOT / "llama_cpp_python"))
    import types
    sys.modules.setdefault("diskcache", types.ModuleType("diskcache"))  # only its high-level cache imports it
    import llama_cpp.llama_cpp as ll
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = 0
    m = ll.llama_model_load_from_file(str(model).encode(), mp)
    if not m:
        raise RuntimeError(f"llama.cpp could not load {model}")
    cp = ll.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 2, 2
    ctx = ll.llama_init_from_model(m, cp)
    b = ll.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, True
        b.seq_id[i][0] = 0
    b.n_tokens = len(tokens)
    if ll.llama_decode(ctx, b) != 0:
        raise RuntimeError("llama_decode failed")
    out = torch.tensor([[ll.llama_get_logits_ith(ctx, i)[j] for j in range(n_vocab)] for i in range(len(tokens))])
    ll.llama_batch_free(b)
    ll.llama_free(ctx)
    ll.llama_model_free(m)
    return out  # [T, V]


def layer_banks(banks, mc) -> dict:
    """{layer: (gate_up, down)} views of each MoE layer's experts in QuantBanks of every layer
    (first dimension layer x E + e): export_gguf's mxfp4_experts."""
    from dataclasses import replace
    e = mc.num_experts

    def rows(b, j):
        return replace(b, values=b.values[j * e:(j + 1) * e], scale=b.scale[j * e:(j + 1) * e])
    return {l: (rows(banks.gate_up, j), rows(banks.down, j)) for j, l in enumerate(mc.moe_layers)}


def gguf_experts_diff(path: Path, mc, gu: torch.Tensor, dn: torch.Tensor) -> float:
    """The largest difference between the expert tensors of a written GGUF, dequantized by the
    gguf package, and ours (gu [N, 2I, H], dn [N, H, I] in fp32): 0 when the repack is lossless."""
    gguf, _, _ = _converter(source())
    from gguf.quants import dequantize
    e, i, worst = mc.num_experts, mc.moe_intermediate_size, 0.0
    for t in gguf.GGUFReader(str(path)).tensors:
        if "_exps." not in t.name:
            continue
        j = mc.moe_layers.index(int(t.name.split(".")[1]))
        ref = {"ffn_gate_exps": gu[j * e:(j + 1) * e, :i], "ffn_up_exps": gu[j * e:(j + 1) * e, i:],
               "ffn_down_exps": dn[j * e:(j + 1) * e]}[t.name.split(".")[2]]
        got = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()  # [E, rows, cols]
        if got.shape != ref.shape:
            raise AssertionError(f"{t.name}: {tuple(got.shape)} in the GGUF, {tuple(ref.shape)} ours")
        worst = max(worst, (got - ref).abs().max().item())
    return worst


def check(build_dir: Path, experts: str = "bf16") -> dict:
    """A tiny random Qwen3.5-MoE: FreeToken's prefill logits against llama.cpp's (CPU) on the
    GGUF written by export_gguf from the same tensors. experts "mxfp4": the routed experts as
    random MXFP4 banks (written as ggml MXFP4; ours the same values dequantized to fp32)."""
    from freetoken.config import ModelConfig
    from freetoken.demo import random_tensor, weight_shapes
    from freetoken.experts.executor import TorchExpertExecutor
    from freetoken.model.registry import model_class
    from freetoken.model.state import DecodeState
    src = source()
    mc = ModelConfig.from_hf(TINY)
    g = torch.Generator().manual_seed(0)
    w = {n: random_tensor(n, s, g, embed_std=0.5) for n, s in weight_shapes(mc).items()}
    banks = None
    if experts == "mxfp4":
        from bench.cpu_experts import quantized_banks
        for l in mc.moe_layers:
            del w[f"model.layers.{l}.mlp.experts.gate_up_proj"], w[f"model.layers.{l}.mlp.experts.down_proj"]
        banks = quantized_banks("mxfp4", mc.num_flat_experts, mc.hidden_size, mc.moe_intermediate_size, g)
    with tempfile.TemporaryDirectory() as d:
        path = export_gguf(TINY, w, Path(d) / "tiny.gguf", src, layer_banks(banks, mc) if banks else None)
        w = {n: t.float() for n, t in w.items()}  # ours in FP32 on the same BF16 values
        if banks is not None:
            gu, dn = banks.dequant(torch.arange(mc.num_flat_experts))  # [N, 2I, H], [N, H, I] fp32
        else:
            gu = torch.cat([w.pop(f"model.layers.{l}.mlp.experts.gate_up_proj") for l in mc.moe_layers])  # [N, 2I, H]
            dn = torch.cat([w.pop(f"model.layers.{l}.mlp.experts.down_proj") for l in mc.moe_layers])  # [N, H, I]
        ex = TorchExpertExecutor(gu, dn, layer_experts=mc.num_experts)
        model = model_class(mc.arch)(mc, w, ex, torch.device("cpu"), torch.float32, 256)
        tokens = torch.randint(0, TINY["vocab_size"], (24,), generator=g)
        st = DecodeState(mc, 1, 64, torch.device("cpu"), torch.float32)
        st.reserve(0, 64)
        ours = model.prefill(tokens, st, 0, 0, all_logits=True).float()  # [T, V]
        theirs = llama_logits(build_dir / "bin", path, tokens.tolist(), TINY["vocab_size"])
        exact = gguf_experts_diff(path, mc, gu, dn) if banks is not None else None
    per_pos = (ours - theirs).abs().max(-1).values  # [T]
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    # llama.cpp's BF16 dot products round the activations to BF16 too: ~0.03 of a 3.7 logit
    # scale; a position whose top-8 choice flips on that rounding differs more
    return {**({"gguf_experts_max_abs_diff": exact} if exact is not None else {}),
            "median_pos_max_abs_diff": round(per_pos.median().item(), 4), "max_abs_diff": round(per_pos.max().item(), 4),
            "logit_scale": round(ours.abs().max().item(), 3), "argmax_agreement": round(agree, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare llama.cpp's logits with ours on a tiny model")
    ap.add_argument("--experts", default="bf16", choices=["bf16", "mxfp4"],
                    help="--check: the routed experts' format in the GGUF (mxfp4: ggml MXFP4 from our banks)")
    ap.add_argument("--build-dir", default=str(ROOT / "build-cpu"))
    ap.add_argument("--build-only", action="store_true", help="build llama-bench and stop")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    try:
        binary = build(source(), Path(a.build_dir), a.cuda, a.jobs)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"bench.llamacpp: {e}") from None
    if a.check:
        from bench.common import write_result
        q = a.experts == "mxfp4"
        write_result("llamacpp-check" + ("-mxfp4" if q else ""), {
            "model": "tiny random Qwen3.5-MoE (TINY), BF16 values" + (", routed experts MXFP4" if q else "") + ", 24 tokens",
            "ours": "fp32 on the same values", "llamacpp": "CPU build, BF16 GGUF" + (" with MXFP4 experts" if q else ""),
            **check(Path(a.build_dir), a.experts)})
    elif not a.build_only:
        print(binary)


if __name__ == "__main__":
    main()
