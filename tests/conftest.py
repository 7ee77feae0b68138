import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the JIT build shared across tests but the demo model out of the user's cache."""
    build = os.environ.get("FREETOKEN_TEST_CACHE") or str(tmp_path_factory.getbasetemp().parent / "ft-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", build)
