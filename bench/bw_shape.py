"""`ft bench bw` on a full-size expert shape without its checkpoint (the GPU machine's disk is
smaller than the checkpoints): a sparse FTW file whose header declares the expert banks of the
shape (no bytes written; `ft bench bw` reads only the header and measures on scratch banks of
its own), then the same measurement the command makes, saved as a result JSON.

    python -m bench.bw_shape [--shape qwen36] [--layers 12] [--format bf16|fp8_block|mxfp4|nvfp4]
"""
from __future__ import annotations

import argparse
import os
import tempfile

from bench.common import write_result
from bench.decode import QWEN36_35B_A3B
from freetoken.runtime import bandwidth
from freetoken.runtime.bw_measure import measure, table
from freetoken.weights.convert import bank_entries, banks_meta
from freetoken.weights.ftw import ALIGN, Entry, align_up, write_preamble

SHAPES = {"qwen36": QWEN36_35B_A3B}


def sparse_model(cfg: dict, fmt: str, path: str) -> str:
    """An FTW file at `path` whose header holds the config and the expert banks of all MoE
    layers (flat ids l*E+e); the data region is a hole, so it costs no disk."""
    n = cfg["num_hidden_layers"] * cfg["num_experts"]
    values = "bfloat16" if fmt in ("dense", "fp8_block") else "uint8"
    rows = bank_entries(fmt, n, cfg["moe_intermediate_size"], cfg["hidden_size"],
                        {"values": values, "scale": "float32"})
    data_start = 1 << 20  # room for the header
    entries, off = [], data_start
    for name, dt, shape, _, _ in rows:
        e = Entry(name, dt, shape, off)
        entries.append(e)
        off = align_up(off + e.nbytes, ALIGN)
    meta = {"config": cfg, "banks": banks_meta(fmt)}
    with open(path, "wb") as f:
        write_preamble(f, entries, meta, data_start)
        f.truncate(off)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen36")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--format", default="dense", choices=["dense", "fp8_block", "mxfp4", "nvfp4"])
    ap.add_argument("--threads", type=int, default=0, help="0: the engine's rule (all cores but two on CUDA)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--name", default=None, help="result file name (before -gpu.json / -cpu.json)")
    a = ap.parse_args()
    cfg = dict(SHAPES[a.shape], num_hidden_layers=a.layers)
    with tempfile.TemporaryDirectory() as d:
        path = sparse_model(cfg, a.format, os.path.join(d, "shape.ftw"))
        prof, mc = measure(path, a.threads, a.seconds)
    prof["predicted_fill_share"] = round(bandwidth.predicted_share(prof), 3)
    prof["model"]["path"] = f"{a.shape} shape, {a.layers} layers ({a.format}), no checkpoint"
    print(table(prof))
    write_result(a.name or f"bw-{a.shape}-{a.format}-t{prof['threads']}", prof)


if __name__ == "__main__":
    main()
