"""Constrained decoding (structured output): what a grammar costs per decode step.

Engine: the demo model (248k-token Qwen vocabulary), greedy, batch 1 and 8, decode steps timed
with every row free, every row constrained (mask computed on the grammar worker while the
forward runs: the production path), every row constrained with the overlap off (mask computed
on the engine thread just before sampling), and half the rows constrained. Reported per mode:
the step time, and for constrained modes the worker's mask time per step, the time the engine
thread waited for masks (what the overlap did not hide), and the time it spent applying them
(unpack + masked_fill on the device).

Libraries: the raw per-token mask time (batch 1 and 8) and compile time of llguidance (the
engine's) and, when installed, xgrammar, on the same tokenizer: the measurements behind the
choice of engine.

    python -m bench.grammar [--tokens 32] [--rounds 3] [--device cpu|cuda] [--no-libs]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import torch

from bench.common import write_result
from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import GrammarSpec, Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}, "score": {"type": "number"},
    "active": {"type": "boolean"}, "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["street", "city"], "additionalProperties": False},
    "items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                        "qty": {"type": "number"}},
                                         "required": ["id"], "additionalProperties": False}}},
    "required": ["name", "age", "active", "role", "address"], "additionalProperties": False}
DOC = {"name": "Alice Smith", "age": 31, "score": 4.5, "active": True, "role": "admin",
       "tags": ["a", "bb", "hello world"], "address": {"street": "1 Main St", "city": "Paris", "zip": "75001"},
       "items": [{"id": 1, "qty": 2.5}, {"id": 22}, {"id": 333, "qty": 1}]}


def _ms(x: float) -> float:
    return round(1e3 * x, 3)


def engine_mode(eng, prompt: list[int], batch: int, tokens: int, constrained: int, overlap: bool = True) -> dict:
    """Decode steps of `batch` greedy requests, `constrained` of them under SCHEMA."""
    srv = ServingEngine(eng, max_batch=batch, max_queue=batch, start=False)
    srv.grammar.overlap = overlap
    spec = GrammarSpec("json_schema", schema=SCHEMA, strict=True)
    reqs = [Request(prompt, SamplingOptions(temperature=0, max_tokens=tokens, ignore_eos=True,
                                            grammar=spec if i < constrained else None)) for i in range(batch)]
    for r in reqs:
        srv.sched.add(r)
    times, before = [], None
    while any(r.finished_at is None for r in reqs):
        full = all(r.finished_at is None and r.output_ids and not r.prefilling for r in reqs)
        if full and before is None:
            before = dict(srv.grammar.stats)
        t = time.perf_counter()
        srv.step()
        dt = time.perf_counter() - t
        if full and all(r.finished_at is None for r in reqs):
            times.append(dt)
    after = srv.grammar.stats
    n = max(len(times), 1)
    out = {"rows": batch, "constrained_rows": constrained, "steps_timed": len(times),
           "step_ms": _ms(statistics.median(times)) if times else None,
           "step_ms_mean": _ms(statistics.mean(times)) if times else None}
    if constrained and before is not None:
        d = {k: after[k] - before[k] for k in after}
        out.update(mask_ms_per_step=_ms(d["mask_s"] / n), wait_ms_per_step=_ms(d["wait_s"] / n),
                   apply_ms_per_step=_ms(d["apply_s"] / n), masks=d["masks"], sync_masks=d["sync_masks"],
                   overlap=overlap)
        if overlap and d["mask_s"] > 0:
            out["mask_hidden_fraction"] = round(max(0.0, 1 - d["wait_s"] / d["mask_s"]), 3)
    out["outputs_sample"] = eng.tokenizer.decode(reqs[0].output_ids)[:80]
    srv.grammar.close()
    return out


def _median_run(runs: list[dict]) -> dict:
    """Numbers: the median over runs (step_ms_runs: every run's median step)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = [r[k] for r in runs if r.get(k) is not None]
            out[k] = round(statistics.median(vals), 3) if vals else None
    out["step_ms_runs"] = [r["step_ms"] for r in runs]
    return out


def _walk(fill, accept, matchers, ids, bm) -> list[float]:
    ts = []
    for tkn in ids:
        t = time.perf_counter()
        fill(matchers, bm)
        ts.append(time.perf_counter() - t)
        for m in matchers:
            accept(m, tkn)
    return ts


def _lib_stats(ts: list[float]) -> dict:
    ts = sorted(ts)
    return {"mean_us": round(1e6 * statistics.mean(ts), 1), "p50_us": round(1e6 * ts[len(ts) // 2], 1),
            "p90_us": round(1e6 * ts[int(len(ts) * 0.9)], 1), "max_us": round(1e6 * ts[-1], 1)}


def libraries(tokenizer, vocab: int, eos: list[int]) -> dict:
    """Raw mask and compile costs of the grammar libraries on this tokenizer (one thread for
    batch 1; batch 8 in a loop on one thread, as a single grammar worker computes them)."""
    tj = tokenizer.tk.to_str()
    ids = tokenizer.encode(json.dumps(DOC)) + [eos[0]]
    out = {"document_tokens": len(ids), "vocab": vocab}
    import llguidance as llg
    import llguidance.torch as llt
    t = time.perf_counter()
    lt = llg.LLTokenizer(tj, n_vocab=vocab, eos_token=eos)
    res = {"version": version("llguidance"), "tokenizer_build_s": round(time.perf_counter() - t, 3)}
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compile_ms = []
    for k in range(5):  # distinct schemas: nothing cached
        s = json.loads(json.dumps(SCHEMA))
        s["properties"][f"extra{k}"] = {"type": "string"}
        t = time.perf_counter()
        m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(s, defaults=style))
        llt.fill_next_token_bitmask(m, llt.allocate_token_bitmask(1, vocab), 0)
        compile_ms.append(_ms(time.perf_counter() - t))
    res["compile_and_first_mask_ms"] = compile_ms
    g = llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=style)
    bm = llt.allocate_token_bitmask(8, vocab)
    for b in (1, 8):
        ms = [llg.LLMatcher(lt, g) for _ in range(b)]

        def fill(ms, bm):
            for i, m in enumerate(ms):
                llt.fill_next_token_bitmask(m, bm, i)
        res[f"mask_per_step_batch{b}"] = _lib_stats(_walk(fill, lambda m, x: m.consume_token(x), ms, ids, bm))
    out["llguidance"] = res
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed"
        return out
    t = time.perf_counter()
    vj = json.loads(tj)
    enc = [""] * vocab
    for s, i in vj["model"]["vocab"].items():
        enc[i] = s
    for a in vj["added_tokens"]:
        enc[a["id"]] = a["content"]
    info = xgr.TokenizerInfo(enc, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos,
                             add_prefix_space=False)
    res = {"version": version("xgrammar"), "tokenizer_build_s": round(time.perf_counter() - t, 3)}
    comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_ms = []
    for k in range(5):
        s = json.loads(json.dumps(SCHEMA))
        s["properties"][f"extra{k}"] = {"type": "string"}
        t = time.perf_counter()
        m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(s), any_whitespace=False))
        m.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, vocab), 0)
        compile_ms.append(_ms(time.perf_counter() - t))
    res["compile_and_first_mask_ms"] = compile_ms
    cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    bm = xgr.allocate_token_bitmask(8, vocab)
    for b in (1, 8):
        ms = [xgr.GrammarMatcher(cg) for _ in range(b)]

        def fill(ms, bm):
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(bm, i)
        res[f"mask_per_step_batch{b}"] = _lib_stats(_walk(fill, lambda m, x: m.accept_token(x), ms, ids, bm))
    out["xgrammar"] = res
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per request")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every mode (the median is reported)")
    ap.add_argument("--no-libs", action="store_true", help="skip the library comparison")
    a = ap.parse_args()
    eng = Engine(demo_path(), EngineConfig(device=a.device))
    tok = eng.tokenizer
    prompt = tok.encode("<|im_start|>user\nDescribe a user as JSON.<|im_end|>\n<|im_start|>assistant\n")
    engine_mode(eng, prompt, 1, 4, 1)  # warm-up: allocator, the grammar tokenizer, the schema's compile
    res = {"model": "demo (Qwen3.5-MoE arch, random weights, 248k vocab)", "device": str(eng.device),
           "dtype": str(eng.dtype), "torch_threads": torch.get_num_threads(), "schema": "SCHEMA in bench/grammar.py",
           "engine": {}}
    for b in (1, 8):
        kinds = {"free": (0, True), "constrained": (b, True), "constrained_no_overlap": (b, False)}
        if b > 1:
            kinds["half_constrained"] = (b // 2, True)
        runs = {k: [] for k in kinds}
        for _ in range(a.rounds):  # modes interleaved, so drift in the machine's load hits them alike
            for k, (cons, overlap) in kinds.items():
                runs[k].append(engine_mode(eng, prompt, b, a.tokens, cons, overlap))
        modes = {k: _median_run(v) for k, v in runs.items()}
        free, cons = modes["free"]["step_ms"], modes["constrained"]["step_ms"]
        modes["overhead_ms_per_step"] = round(cons - free, 3)
        modes["overhead_ms_per_token"] = round((cons - free) / b, 3)
        res["engine"][f"batch{b}"] = modes
    if not a.no_libs:
        res["libraries"] = libraries(tok, eng.cfg.vocab_size, sorted(eng.eos_ids))
    write_result("grammar", res)


if __name__ == "__main__":
    main()
