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
