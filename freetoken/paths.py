"""Where FreeToken keeps generated files (demo model, JIT-built extensions), and the lock that
lets several processes share them: one generates, the others wait and use the result."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os

log = logging.getLogger("freetoken.paths")


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "freetoken")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(path: str, on_wait=None):
    """Hold an exclusive flock on `path` (created if needed, never removed: removing a lock
    file while another process waits on it would let a third one in). `on_wait()` is called
    once if another process holds the lock, before blocking. Released on exit, and by the
    kernel if the process dies. On a filesystem without flock, runs unlocked (logged)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # e.g. ENOLCK on some network filesystems
            log.warning("cannot lock %s (%s); going on without the lock", path, e.strerror)
        yield
    finally:
        os.close(fd)
