"""The C++ CPU expert executor against the pure-torch reference, on fresh random inputs."""
import pytest
import torch

from freetoken.experts.cpu import CpuExpertExecutor, extension, physical_cores
from freetoken.experts.executor import TorchExpertExecutor, reference_experts


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def banks(n, h, i, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(n, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    dn = (torch.randn(n, h, i, generator=g) * i ** -0.5).to(dtype)
    return gu, dn


def inputs(t, h, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])  # distinct per token
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return x, ids, w


def test_extension_builds():
    assert extension() is not None, "the C++ executor must build where CI runs"


# shapes with tails that do not fill a SIMD vector or a 4-row block
@pytest.mark.parametrize("h,i", [(64, 32), (96, 40), (136, 22)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_all_batch_sizes(h, i, dtype):
    n, k = 40, 4
    gu, dn = banks(n, h, i, dtype, seed=h + i)
    ex = CpuExpertExecutor(gu, dn)
    for t in list(range(1, 18)) + [31, 64, 130]:
        x, ids, w = inputs(t, h, k, n, seed=t)
        ref = reference_experts(x, ids, w, gu.float(), dn.float())
        assert rel(ex.kernel(x, ids, w), ref) < 2e-6, t


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    gu, dn = banks(16, 64, 48, torch.bfloat16, 1)
    x, ids, w = inputs(5, 64, 4, 16, 2)
    one = CpuExpertExecutor(gu, dn, threads=1).kernel(x, ids, w)
    assert torch.equal(CpuExpertExecutor(gu, dn, threads=threads).kernel(x, ids, w), one)


def test_pool_spin_changes_no_result_and_the_env_override_wins(monkeypatch):
    """spin (the pool's pause loops before a worker sleeps): 0, a small one and the default give
    the same bits over repeated calls (workers that slept wake for each); FREETOKEN_CPU_SPIN,
    when set, overrides what the caller asked (A/B runs)."""
    gu, dn = banks(16, 64, 48, torch.bfloat16, 3)
    x, ids, w = inputs(3, 64, 4, 16, 4)
    monkeypatch.delenv("FREETOKEN_CPU_SPIN", raising=False)
    default = CpuExpertExecutor(gu, dn, threads=3)
    assert default.spin is None
    want = default.kernel(x, ids, w)
    for spin in (0, 50):
        ex = CpuExpertExecutor(gu, dn, threads=3, spin=spin)
        assert ex.spin == spin
        for _ in range(5):
            assert torch.equal(ex.kernel(x, ids, w), want)
    monkeypatch.setenv("FREETOKEN_CPU_SPIN", "0")
    assert CpuExpertExecutor(gu, dn, threads=2, spin=100).spin is None
    from freetoken.errors import FreeTokenError
    for bad in ("fast", "-5", ""):
        monkeypatch.setenv("FREETOKEN_CPU_SPIN", bad)
        with pytest.raises(FreeTokenError, match="FREETOKEN_CPU_SPIN"):
            CpuExpertExecutor(gu, dn, threads=2)


def test_a_cpu_engine_runs_the_pool_without_spin(monkeypatch, tmp_path):
    """On a CPU engine torch computes on the pool's cores between its calls: the pool does not
    spin (experts/cpu SPIN_SHARED); the default everywhere else."""
    from freetoken.experts.cpu import SPIN_SHARED
    from freetoken.runtime.engine import Engine
    monkeypatch.delenv("FREETOKEN_CPU_SPIN", raising=False)
    fake = type("E", (), {"device": torch.device("cpu")})()
    assert Engine._cpu_spin(fake) == SPIN_SHARED == 0
    fake.device = torch.device("cuda")
    assert Engine._cpu_spin(fake) is None


def test_released_executor_ends_its_threads_and_still_computes():
    """An executor's pinned workers end when it is garbage collected (a process that makes
    many does not pile up threads); one released while still referenced computes the same
    result on the caller's thread alone. The workers are tracked by their task ids, so a thread
    something else in the process starts or ends meanwhile does not disturb the counts."""
    import gc
    import os
    import time

    def tasks():  # native thread ids of this process
        return set(os.listdir("/proc/self/task"))

    def left(ids, within=2.0):  # those of ids still alive; a thread's exit is asynchronous
        end = time.monotonic() + within
        while ids & tasks() and time.monotonic() < end:
            time.sleep(0.01)
        return ids & tasks()

    gu, dn = banks(16, 64, 48, torch.bfloat16, 5)
    x, ids, w = inputs(5, 64, 4, 16, 6)
    torch.randn(256, 256) @ torch.randn(256, 256)  # torch's own pools started before counting
    gc.collect()
    before = tasks()
    ex = CpuExpertExecutor(gu, dn, threads=3)
    workers = tasks() - before
    assert len(workers) == 2, workers  # the caller is the third
    want = ex.kernel(x, ids, w)
    del ex
    gc.collect()
    assert not left(workers), "a garbage-collected executor's workers must end"
    before = tasks()
    kept = CpuExpertExecutor(gu, dn, threads=3)
    workers = tasks() - before
    assert len(workers) == 2, workers
    extension().release(kept.handle)
    extension().release(kept.handle)  # idempotent
    assert not left(workers), "a released executor's workers must end"
    assert torch.equal(kept.kernel(x, ids, w), want)


@pytest.mark.parametrize("isa", [0, 1, 2, 3])
def test_every_available_isa_matches(isa):
    """Each SIMD level this CPU has (capped from above) gives the reference's result."""
    gu, dn = banks(12, 80, 36, torch.bfloat16, 3)
    ex = CpuExpertExecutor(gu, dn, isa_cap=isa)
    x, ids, w = inputs(3, 80, 3, 12, 4)
    ref = reference_experts(x, ids, w, gu.float(), dn.float())
    assert rel(ex.kernel(x, ids, w), ref) < 2e-6
    if ex.isa == "avx512-bf16":
        # bf16 activations take the VDPBF16PS path: compare with bf16-rounded inputs
        ref_b = reference_experts(x.bfloat16().float(), ids, w, gu.float(), dn.float())
        assert rel(ex.kernel(x.bfloat16(), ids, w), ref_b) < 2e-2


def test_repeated_expert_ids_and_shared_experts_across_tokens():
    gu, dn = banks(8, 64, 32, torch.float32, 5)
    ex = CpuExpertExecutor(gu, dn)
    x = torch.randn(6, 64)
    ids = torch.tensor([[1, 1], [1, 2], [7, 1], [0, 7], [2, 2], [3, 1]])
    w = torch.rand(6, 2)
    assert rel(ex.kernel(x, ids, w), reference_experts(x, ids, w, gu, dn)) < 2e-6


def test_executor_call_keeps_dtype_and_uses_torch_for_big_batches():
    gu, dn = banks(10, 64, 32, torch.float32, 6)
    ex = CpuExpertExecutor(gu, dn, torch_batch_threshold=4)
    for t in (2, 9):
        x, ids, w = inputs(t, 64, 2, 10, t)
        out = ex(x.double(), ids, w)
        assert out.dtype == torch.float64
        assert rel(out, reference_experts(x.double(), ids, w, gu.double(), dn.double())) < 2e-6


def test_the_torch_threshold_for_float_banks_follows_amx(monkeypatch, tmp_path):
    """Float banks: prefill chunks up to 128 tokens stay on the C++ kernel where the CPU has no
    AMX (it beat torch's GEMMs there), up to 256 where it has (measured on the Xeon, AMX GEMMs);
    quantized banks: 4096 either way."""
    import freetoken.experts.cpu as cpu
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert cpu.has_amx(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    assert not cpu.has_amx(str(info)) and not cpu.has_amx(str(tmp_path / "missing"))
    gu, dn = banks(4, 32, 16, torch.bfloat16, 9)
    for amx, want in ((True, 256), (False, 128)):
        monkeypatch.setattr(cpu, "has_amx", lambda amx=amx: amx)
        assert CpuExpertExecutor(gu, dn).torch_batch_threshold == want
    assert CpuExpertExecutor(gu, dn, torch_batch_threshold=7).torch_batch_threshold == 7


def test_static_torch_executor_matches_reference():
    gu, dn = banks(10, 64, 32, torch.float32, 7)
    ex = TorchExpertExecutor(gu, dn)
    for t in (1, 3, 8):
        x, ids, w = inputs(t, 64, 4, 10, t)
        assert rel(ex._static(x, ids, w), reference_experts(x, ids, w, gu, dn)) < 2e-6


def test_bad_expert_id_is_rejected():
    gu, dn = banks(4, 64, 32, torch.float32, 8)
    ex = CpuExpertExecutor(gu, dn)
    with pytest.raises(RuntimeError, match="out of range"):
        ex.kernel(torch.randn(1, 64), torch.tensor([[4]]), torch.ones(1, 1))


def test_physical_cores_nonempty():
    assert len(physical_cores()) >= 1


def test_pool_cpus_take_smt_siblings_before_repeating(monkeypatch):
    """8 cores with two hardware threads each (CPUs c and c + 8 share core c): 12 threads pin to
    the 8 first CPUs, then 4 siblings; 16 to all 16 CPUs once; past 16 the order repeats."""
    import freetoken.experts.cpu as cpu_mod
    monkeypatch.setattr(cpu_mod.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(cpu_mod, "physical_cores", lambda: list(range(8)))
    assert cpu_mod.pool_cpus(0) == list(range(8))
    assert cpu_mod.pool_cpus(6) == list(range(6))
    assert cpu_mod.pool_cpus(12) == list(range(12))
    assert cpu_mod.pool_cpus(16) == list(range(16))
    assert cpu_mod.pool_cpus(18) == list(range(16)) + [0, 1]


def test_dynamic_schedule_gives_the_same_bits(tmp_path):
    """FREETOKEN_CPU_SCHEDULE=dynamic (work in chunks from a shared counter, read once when the
    library loads: a fresh process) computes every output bit for bit as the fixed shares do:
    each work item owns its outputs and sums them in one order, whichever thread takes it."""
    import os
    import subprocess
    import sys
    script = r'''
import sys, torch
from bench.cpu_experts import quantized_banks
from freetoken.experts.cpu import CpuExpertExecutor
g = torch.Generator().manual_seed(7)
out = {}
for name, (gu, dn) in {"bf16": ((torch.randn(24, 96, 160, generator=g) * 0.05).bfloat16(),
                                (torch.randn(24, 160, 48, generator=g) * 0.05).bfloat16()),
                       "f32": (torch.randn(24, 96, 160, generator=g) * 0.05, torch.randn(24, 160, 48, generator=g) * 0.05)}.items():
    ex = CpuExpertExecutor(gu, dn, threads=3)
    for t in (1, 5, 40):
        x = torch.randn(t, 160, generator=g)
        ids = torch.stack([torch.randperm(24, generator=g)[:6] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 6, generator=g), -1)
        out[f"{name}-{t}"] = ex.kernel(x, ids, w)
        out[f"{name}-{t}-bf16act"] = ex.kernel(x.bfloat16(), ids, w)
banks = quantized_banks("mxfp4", 24, 160, 64, g)
ex = CpuExpertExecutor(banks, threads=3)
for t in (1, 7):
    x = torch.randn(t, 160, generator=g)
    ids = torch.stack([torch.randperm(24, generator=g)[:6] for _ in range(t)])
    w = torch.softmax(torch.randn(t, 6, generator=g), -1)
    out[f"mxfp4-{t}"] = ex.kernel(x, ids, w)
torch.save(out, sys.argv[1])
'''
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = {}
    for mode in ("static", "dynamic"):
        path = str(tmp_path / f"{mode}.pt")
        env = dict(os.environ, FREETOKEN_CPU_SCHEDULE=mode, PYTHONPATH=root)
        subprocess.run([sys.executable, "-c", script, path], check=True, env=env, cwd=root, timeout=300)
        got[mode] = torch.load(path)
    assert got["static"].keys() == got["dynamic"].keys() and len(got["static"]) == 14
    for k, v in got["static"].items():
        assert torch.equal(v, got["dynamic"][k]), k
        assert v.abs().max() > 0, k  # a real output, not an untouched buffer


def test_a_bad_schedule_value_is_named(monkeypatch):
    from freetoken.errors import FreeTokenError
    monkeypatch.setenv("FREETOKEN_CPU_SCHEDULE", "fast")
    gu, dn = banks(4, 32, 16, torch.float32, 0)
    with pytest.raises(FreeTokenError, match="FREETOKEN_CPU_SCHEDULE must be static or dynamic"):
        CpuExpertExecutor(gu, dn)


def test_f16_experts_are_widened_exactly():
    """f16 banks (a checkpoint converted as f16): the C++ kernels take bf16 / f32, so they are
    widened to f32 once, exactly: the same bits as f32 banks of the same values."""
    gu, dn = banks(16, 64, 48, torch.float32, 5)
    gu16, dn16 = gu.half(), dn.half()
    x, ids, w = inputs(3, 64, 4, 16, 6)
    got = CpuExpertExecutor(gu16, dn16, threads=2)
    assert got.format == "f32"
    assert torch.equal(got.kernel(x, ids, w), CpuExpertExecutor(gu16.float(), dn16.float(), threads=2).kernel(x, ids, w))


def test_float32_calls_over_bf16_banks_keep_the_cpp_kernel_while_experts_get_few_pairs():
    """bf16 banks under float32 activations (a CPU engine's default): the torch path would widen
    every expert it touches first, so past the float threshold the C++ kernel keeps a call whose
    experts get fewer than WIDENING_PAIRS_PER_EXPERT pairs each; bf16 activations keep the float
    threshold, and a threshold given by the caller is kept."""
    from freetoken.experts.cpu import WIDENING_PAIRS_PER_EXPERT as P
    gu, dn = banks(64, 64, 32, torch.bfloat16, 11)
    ex = CpuExpertExecutor(gu, dn)
    t = ex.torch_batch_threshold + 1
    x, ids, w = inputs(t, 64, 4, 64, 13)  # 4t pairs over 64 experts: 8 a expert at t = 129
    assert ex.torch_path(x.bfloat16(), ids) and not ex.torch_path(x, ids)
    few = ids % 2  # the same pairs on 2 experts: past P each
    assert 4 * t >= 2 * P and ex.torch_path(x, few)
    assert CpuExpertExecutor(gu, dn, torch_batch_threshold=4).torch_path(x[:5], ids[:5])
    f32 = CpuExpertExecutor(*banks(64, 64, 32, torch.float32, 12))
    assert f32.torch_path(x, ids)  # no widening: the float threshold
    # and a chunk past the float threshold through the kernel equals the reference (fp32)
    assert rel(ex.launch(x, ids, w, phase="prefill").out, reference_experts(x, ids, w, gu.float(), dn.float())) < 2e-6


@pytest.mark.parametrize("h,i", [(64, 32), (136, 22), (2048 // 16, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_blocks_give_the_per_token_bits(h, i, dtype):
    """A prompt chunk's tokens routed to one expert go through the kernels four at a time
    (dot4x4_*: each weight vector widened once for four tokens); every output equals, bit for
    bit, what the same token gets in a call of its own (one token a call: the per-token
    kernels), with float and bf16 activations, row and column tails included."""
    n, k, t = 6, 3, 23  # few experts: each gets ~11 of the tokens, blocks of four and a remainder
    gu, dn = banks(n, h, i, dtype, seed=h * i)
    ex = CpuExpertExecutor(gu, dn, threads=2)
    x, ids, w = inputs(t, h, k, n, seed=7)
    for act in (x, x.bfloat16()):
        whole = ex.kernel(act, ids, w)
        alone = torch.cat([ex.kernel(act[r:r + 1], ids[r:r + 1], w[r:r + 1]) for r in range(t)])
        assert torch.equal(whole, alone)
        ref = reference_experts(act.float(), ids, w, gu.float(), dn.float())
        assert rel(whole, ref) < (2e-2 if act.dtype == torch.bfloat16 else 2e-6)
