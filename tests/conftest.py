import atexit
import os
import shutil
import sys
import tempfile

import pytest

# Triton kernels run on the CPU through the interpreter when no GPU is present; this must be
# set before anything imports triton
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

sys.path.insert(0, os.path.dirname(__file__))


def _reference_models_without_fla():
    """Where flash-linear-attention is installed (the GPU machine), transformers binds its
    kernels into the DeltaNet models at import, for every device: the reference models, which
    run on the CPU here, then call GPU kernels with CPU tensors and fail. Import those model
    modules once with fla hidden, so the reference is transformers' own torch code (what the
    tests compare against); fla is visible again afterwards, for our kernels."""
    import importlib
    import importlib.util
    if importlib.util.find_spec("fla") is None:
        return
    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "fla" or k.startswith("fla.")}
    sys.modules["fla"] = None  # import fla raises ImportError
    try:
        for name in ("qwen3_5_moe", "qwen3_5", "qwen3_next"):
            module = f"transformers.models.{name}.modeling_{name}"
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:  # a transformers without this model: nothing to hide
                if not module.startswith(e.name or "\0"):
                    raise
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)


_reference_models_without_fla()


# One cache folder for the whole run (the JIT-built C++ executor, the demo model), chosen here,
# before any test module is imported: some call extension() at collection (skip marks), and
# that first build must land where the `ft` subprocesses of later tests look for it. Per run,
# not per machine: concurrent runs over different checkouts (worktrees, another engineer's
# edits) would otherwise rebuild each other's executor mid-run. FREETOKEN_TEST_CACHE reuses one.
TEST_CACHE = os.environ.get("FREETOKEN_TEST_CACHE") or tempfile.mkdtemp(prefix="ft-test-cache-")
os.environ["XDG_CACHE_HOME"] = TEST_CACHE
if not os.environ.get("FREETOKEN_TEST_CACHE"):
    atexit.register(shutil.rmtree, TEST_CACHE, True)


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch):
    """Every test sees the run's cache folder (a test may point XDG_CACHE_HOME elsewhere)."""
    monkeypatch.setenv("XDG_CACHE_HOME", TEST_CACHE)


@pytest.fixture(autouse=True, scope="session")
def _cpp_executor_built():
    """Build the C++ expert executor once, before any test: otherwise the first test that starts
    `ft` in a subprocess pays for the build and sees its one-time notice on stderr."""
    from freetoken.experts.cpu import extension
    extension()


@pytest.fixture(scope="session")
def qwen_json():
    """freetoken.demo.qwen_tokenizer_json(), built once for the run: each build takes seconds
    (the BPE merges from the ranks); make a Tokenizer of it per use."""
    from freetoken.demo import qwen_tokenizer_json
    return qwen_tokenizer_json()


@pytest.fixture(scope="session")
def api_server():
    """One `ft serve` (server_fixture.API_SERVER_ARGS) for the modules that ask for this
    server: started by the first test that needs it, stopped after the last (each start costs
    seconds of imports and model loading)."""
    from server_fixture import API_SERVER_ARGS, Server
    s = Server(*API_SERVER_ARGS)
    yield s
    s.stop()  # again, if pytest_runtest_teardown did: stopping twice is harmless


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared api_server once no later test of the run uses it, so that it does not
    idle (its memory held) through the rest of the run."""
    s = (getattr(item, "funcargs", None) or {}).get("api_server")
    if s is None:
        return
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else []
    if not any("api_server" in getattr(i, "fixturenames", ()) for i in later):
        s.stop()
