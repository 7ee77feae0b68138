"""Where FreeToken keeps generated files (demo model, JIT-built extensions)."""
import os


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "freetoken")
    os.makedirs(path, exist_ok=True)
    return path
