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
