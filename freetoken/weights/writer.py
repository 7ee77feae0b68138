"""Streaming FTW writer: entries are appended in layout order, one chunk at a time.

The output appears under its final name only when everything was written and checked (one
atomic rename); a failure (or Ctrl-C) removes the partial file, so a failed convert leaves
nothing behind. The partial file's name carries the process id (`OUT.<pid>.partial`), so
processes writing the same output at once never write into or remove each other's file.
"""
from __future__ import annotations

import os
import zlib

import torch

from .ftw import BLOCK, Entry, align_up, layout, total_size, write_preamble


def partial_name(path: str) -> str:
    """The temporary name this process writes `path` under."""
    return f"{path}.{os.getpid()}.partial"


class FTWWriter:
    def __init__(self, path: str, entries: list[Entry], meta: dict):
        self.path = path
        self.entries = entries
        self.meta = meta
        self.data_start = layout(entries, meta)
        self.tmp = partial_name(path)
        self.f = open(self.tmp, "wb")
        try:
            self.f.truncate(total_size(entries))
            self.f.seek(self.data_start)
        except BaseException:
            self.abort()
            raise
        self._i = 0  # index of the entry being written
        self._done = 0  # bytes of it written so far
        self._crc = 0  # running CRC of the current block
        for e in entries:
            e.crc = []

    @property
    def current(self) -> Entry:
        return self.entries[self._i]

    def write(self, name: str, data) -> None:
        """Append bytes (bytes, memoryview or a CPU tensor) to entry `name`."""
        e = self.current
        if name != e.name:
            raise RuntimeError(f"FTW writer expected {e.name}, got {name}")
        if isinstance(data, torch.Tensor):
            data = memoryview(data.detach().contiguous().view(-1).view(torch.uint8).numpy())
        mv = memoryview(data).cast("B")
        if self._done + len(mv) > e.nbytes:
            raise RuntimeError(f"too many bytes for {e.name}")
        self.f.write(mv)
        pos = 0
        while pos < len(mv):  # split at block boundaries for the per-block CRC
            room = BLOCK - self._done % BLOCK
            part = mv[pos:pos + room]
            self._crc = zlib.crc32(part, self._crc) & 0xFFFFFFFF
            self._done += len(part)
            pos += len(part)
            if self._done % BLOCK == 0 or self._done == e.nbytes:
                e.crc.append(self._crc)
                self._crc = 0
        if self._done == e.nbytes:
            self._next()

    def _next(self):
        e = self.current
        self.f.seek(align_up(e.offset + e.nbytes))
        self._i += 1
        self._done = 0

    def close(self) -> None:
        if self._i != len(self.entries):
            raise RuntimeError(f"FTW writer closed before {self.current.name} was written")
        try:
            write_preamble(self.f, self.entries, self.meta, self.data_start)
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
