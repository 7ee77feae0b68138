import os
import sys

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


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the JIT build shared across tests but the demo model out of the user's cache."""
    build = os.environ.get("FREETOKEN_TEST_CACHE") or str(tmp_path_factory.getbasetemp().parent / "ft-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", build)


@pytest.fixture(autouse=True, scope="session")
def _cpp_executor_built(tmp_path_factory):
    """Build the C++ expert executor once, before any test: otherwise the first test that starts
    `ft` in a subprocess pays for the build and sees its one-time notice on stderr."""
    build = os.environ.get("FREETOKEN_TEST_CACHE") or str(tmp_path_factory.getbasetemp().parent / "ft-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = build
    try:
        from freetoken.experts.cpu import extension
        extension()
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = old
