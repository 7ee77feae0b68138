"""Entry points of the CUDA driver library that torch does not expose, through ctypes.

libcuda is present wherever CUDA runs (it ships with the driver), so these need no build and no
extra package. Each function is looked up once; None where the library or the symbol is missing
(no GPU, an old driver): callers keep a path without it.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("freetoken.kernels")
_lib = None
_fns: dict[str, object] = {}


def driver_fn(name: str, argtypes: list, restype=ctypes.c_int):
    """The driver function `name` with its ctypes signature, or None."""
    global _lib
    if name in _fns:
        return _fns[name]
    f = None
    try:
        if _lib is None:
            _lib = ctypes.CDLL("libcuda.so.1")
        f = getattr(_lib, name)
        f.argtypes, f.restype = argtypes, restype
    except (OSError, AttributeError) as e:
        log.info("CUDA driver entry %s unavailable (%s)", name, e)
        f = None
    _fns[name] = f
    return f
