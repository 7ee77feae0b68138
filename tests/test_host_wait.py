"""runtime/host_wait.py: how the serving loop's thread waits for a decode step on the GPU (asleep
where the step has a CPU branch, spinning otherwise), FREETOKEN_HOST_WAIT's override, and which
executors count as having a CPU branch. The wait itself on CUDA: tests/test_gpu_production.py's
engine runs (GPU machine)."""
import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.runtime import host_wait


class _Cpu:  # the C++ executor's marks, as has_cpu_branch reads them
    name = "cpu"


class _Cache:  # the expert cache's answer, as CachedExpertExecutor.runs_cpu_branch gives it
    def __init__(self, runs):
        self.runs_cpu_branch = runs
        self.cpu = _Cpu()  # not what decides: a fill-only cache has its CPU executor too


class _Streamed:
    branch = object()


class _Wrapper:
    def __init__(self, inner):
        self.inner = inner


def test_which_executors_have_a_cpu_branch():
    from freetoken.experts.executor import TorchExpertExecutor
    gu, dn = torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    assert not host_wait.has_cpu_branch(TorchExpertExecutor(gu, dn))
    assert not host_wait.has_cpu_branch(None)
    assert not host_wait.has_cpu_branch(_Cache(False))  # fill-only now: its graph has no host node
    assert not host_wait.has_cpu_branch(_Wrapper(_Cache(False)))
    for ex in (_Cpu(), _Cache(True), _Streamed(), _Wrapper(_Cache(True)), _Wrapper(_Wrapper(_Cpu()))):
        assert host_wait.has_cpu_branch(ex), ex


def test_the_cache_answers_by_its_split():
    """A fill-only cache (r = 1) with a pool that holds a layer's experts runs nothing on the host;
    a split one does, and so does a fill-only one inside frozen() (a streamed pass's decode steps)
    or with fewer slots than a layer's experts."""
    from freetoken.experts.cached import CachedExpertExecutor
    from freetoken.experts.cpu import CpuExpertExecutor
    gu, dn = torch.randn(8, 16, 32), torch.randn(8, 32, 8)
    cpu = CpuExpertExecutor(gu, dn, threads=1)
    fill = CachedExpertExecutor(gu, dn, 8, "cpu", torch.float32, cpu, 1.0, layer_experts=8)
    split = CachedExpertExecutor(gu, dn, 8, "cpu", torch.float32, cpu, 0.5, layer_experts=8)
    small = CachedExpertExecutor(gu, dn, 4, "cpu", torch.float32, cpu, 1.0, layer_experts=8)
    assert not host_wait.has_cpu_branch(fill)
    assert host_wait.has_cpu_branch(split) and host_wait.has_cpu_branch(small)
    with fill.frozen():
        assert host_wait.has_cpu_branch(fill)
    assert not host_wait.has_cpu_branch(fill)


def test_the_real_cpu_executor_counts():
    from freetoken.experts.cpu import CpuExpertExecutor
    ex = CpuExpertExecutor(torch.randn(4, 8, 16).bfloat16(), torch.randn(4, 16, 4).bfloat16(), threads=1)
    assert host_wait.has_cpu_branch(ex)


@pytest.mark.parametrize("env,cpu,want", [(None, True, True), (None, False, False), ("auto", True, True),
                                          ("block", False, True), ("spin", True, False), (" Block ", False, True),
                                          ("", True, True)])
def test_blocks_follows_the_mode(monkeypatch, env, cpu, want):
    if env is None:
        monkeypatch.delenv("FREETOKEN_HOST_WAIT", raising=False)
    else:
        monkeypatch.setenv("FREETOKEN_HOST_WAIT", env)
    assert host_wait.blocks(cpu) is want


def test_a_bad_mode_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv("FREETOKEN_HOST_WAIT", "sleepy")
    with pytest.raises(FreeTokenError, match="FREETOKEN_HOST_WAIT must be one of auto, block, spin"):
        host_wait.mode()


def test_wait_on_the_cpu_returns_at_once(monkeypatch):
    monkeypatch.setenv("FREETOKEN_HOST_WAIT", "block")
    host_wait.wait(torch.device("cpu"), True)  # nothing queued anywhere: no CUDA call made


def test_a_bad_mode_fails_the_engine_start(monkeypatch, tmp_path):
    """Not every step of a running server: the engine refuses to start, naming the variable."""
    import hf_models
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert
    hf_models.save(hf_models.qwen3_moe(3, num_hidden_layers=1), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    monkeypatch.setenv("FREETOKEN_HOST_WAIT", "fast")
    with pytest.raises(FreeTokenError, match="FREETOKEN_HOST_WAIT"):
        Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))
    monkeypatch.setenv("FREETOKEN_HOST_WAIT", "spin")
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))
    assert eng.host_wait_blocks is False  # the CPU: nothing to wait for on a device


def test_a_cpu_engine_keeps_its_whole_step_to_cpu_threads(tmp_path):
    """--cpu-threads on a CPU-only engine is the step's thread budget (llama.cpp's -t): torch's
    own ops and the dense kernels (torch's intra-op count) too; without it torch's count stays."""
    import hf_models
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert
    hf_models.save(hf_models.qwen3_moe(3, num_hidden_layers=1), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    before = torch.get_num_threads()
    try:
        Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))
        assert torch.get_num_threads() == before
        eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", cpu_threads=1))
        assert torch.get_num_threads() == 1
        assert eng.generate([1, 2, 3], 2).token_ids  # and it still runs
    finally:
        torch.set_num_threads(before)
