"""Server benchmark: TTFT, per-request decode tok/s and inter-chunk gaps at 1, 2, 4 and 8 streams.

Starts a real `ft serve` (the demo model, prefix cache on as served) on 127.0.0.1 and drives it
with streaming /v1/chat/completions requests over raw HTTP (httpx), so it runs where the SDKs
are absent. Every request's prompt is unique from its first content token (a seeded word that
is one token of the vocabulary, a different one per request, before the filler), so no request
reuses another's prefix, across levels and the warm-up included, except the chat template's
fixed opening. That opening is measured here (the prompts rendered with the model's own
template and tokenizer, as the server renders them), the longest prefix any two prompts share
is checked to be no longer, and the server's own count of reused tokens
(`usage.prompt_tokens_details.cached_tokens` of the stream's usage chunk) is reported per level.
    python -m bench.serve [--concurrency 1,2,4,8] [--tokens 64] [--prompt-words 200] [--seed 0]
                          [-- serve flags]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time

import httpx

from bench.common import write_result
from freetoken.demo import demo_path
from freetoken.server.template import ChatTemplate
from freetoken.tokenizer import Tokenizer, load_json
from freetoken.weights.ftw import read_header
from freetoken.weights.reader import load_ftw

sys.path.insert(0, "tests")
from server_fixture import MODEL, Server  # noqa: E402


def chat_tokens(path: str):
    """messages -> prompt token ids, as `ft serve` renders them: the model's own chat template
    and tokenizer (read from the FTW file's embedded files only, not its weights)."""
    _, entries = read_header(path)
    _, w = load_ftw(path, [n for n in entries if n.startswith("file/")])
    files = {k[5:]: bytes(v.numpy()) for k, v in w.items()}
    tcfg = load_json(files.get("tokenizer_config.json"), "tokenizer_config.json")
    tok = Tokenizer(files["tokenizer.json"], tcfg)
    template = ChatTemplate.from_files(files, tcfg)
    return tok, lambda messages: tok.encode(template.render(messages))


def prompts(tok: Tokenizer, n: int, words: int, seed: int) -> list[str]:
    """n user messages, each opening with its own word (a whole token of the vocabulary, drawn
    without replacement in a seeded order), then three more seeded words, then the filler."""
    pool = sorted(w for w in tok.tk.get_vocab() if w.isascii() and w.isalpha() and w.islower() and 5 <= len(w) <= 9)
    rng = random.Random(seed)
    rng.shuffle(pool)
    if n > len(pool):
        raise SystemExit(f"only {len(pool)} opening words for {n} requests")
    return [" ".join([pool[i]] + rng.sample(pool, 3)) + ": " + "lorem ipsum " * (words // 2) for i in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_prefixes(ids: list[list[int]]) -> tuple[int, int]:
    """(tokens every prompt shares at its start, the longest prefix any two prompts share)."""
    s = sorted(ids)  # the closest pair in lexicographic order is adjacent
    every = min(common_prefix(ids[0], x) for x in ids)
    pair = max((common_prefix(x, y) for x, y in zip(s, s[1:])), default=every)
    return every, pair


async def one(client, url, text, tokens):
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": text}]}
    t0 = time.perf_counter()
    first = last = None
    chunks = []  # arrival time of each chunk that carries generated text
    usage = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            obj = json.loads(line[6:])
            if obj.get("error"):
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            if not obj.get("choices"):
                continue
            ch = obj["choices"][0]
            delta = ch.get("delta") or {}
            if delta.get("role"):
                continue  # the opening role chunk is not a token
            if any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                chunks.append(now)
            if delta or ch.get("finish_reason"):
                first = first or now
                last = now
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    n = usage["completion_tokens"]
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else None,
            "tokens": n, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "gaps": [b - a for a, b in zip(chunks, chunks[1:])]}


def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


async def level(url, texts, tokens):
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[one(client, url, t, tokens) for t in texts])
        wall = time.perf_counter() - t0
    speeds = [r["decode_tok_s"] for r in rs if r["decode_tok_s"]]
    gaps = [g for r in rs for g in r["gaps"]]
    cached = [r["cached_tokens"] for r in rs]
    return rs, {"concurrency": len(texts), "mean_ttft_s": round(statistics.mean(r["ttft_s"] for r in rs), 3),
                "worst_ttft_s": round(max(r["ttft_s"] for r in rs), 3),
                "mean_decode_tok_s": round(statistics.mean(speeds), 2) if speeds else None,
                "aggregate_tok_s": round(sum(r["tokens"] for r in rs) / wall, 2),
                "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in rs), 1),
                "cached_tokens_sum": sum(cached), "cached_tokens_mean": round(statistics.mean(cached), 2),
                "cached_tokens_max": max(cached),
                # gaps between consecutive chunks carrying text; tokens_per_gap > 1 means some
                # chunks carried several tokens (the detokenizer or parser held text back)
                "gap_p50_ms": round(pct(gaps, 50) * 1e3, 2) if gaps else None,
                "gap_p99_ms": round(pct(gaps, 99) * 1e3, 2) if gaps else None,
                "gaps": len(gaps),
                "tokens_per_gap": round(sum(r["tokens"] - 1 for r in rs) / len(gaps), 3) if gaps else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="orders the prompts' opening words")
    ap.add_argument("serve_args", nargs="*", help="extra `ft serve` flags (after --)")
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    tok, encode = chat_tokens(demo_path())
    texts = prompts(tok, 1 + sum(levels), a.prompt_words, a.seed)
    ids = [encode([{"role": "user", "content": t}]) for t in texts]
    opening, longest = shared_prefixes(ids)
    if longest > opening:
        raise SystemExit(f"two prompts share {longest} tokens, more than the template's opening ({opening})")
    srv = Server("--max-batch", "8", *a.serve_args)
    rows = []
    try:
        warm, _ = asyncio.run(level(srv.url, texts[:1], 4))  # warm-up (its prompt is unique too)
        k = 1
        for c in levels:
            rs, row = asyncio.run(level(srv.url, texts[k:k + c], a.tokens))
            for r, i in zip(rs, ids[k:k + c]):
                if r["prompt_tokens"] != len(i):
                    raise SystemExit(f"the server counts {r['prompt_tokens']} prompt tokens, this renders {len(i)}")
            k += c
            rows.append(row)
            print(row, flush=True)
    finally:
        head = srv.output().splitlines()[:1]
        srv.stop()
    write_result("serve", {"model": "demo", "server": head, "tokens_per_request": a.tokens,
                           "prompt_words": a.prompt_words, "seed": a.seed,
                           "unique_prompts": True, "template_opening_tokens": opening,
                           "template_opening_text": tok.decode(ids[0][:opening]),
                           "longest_prefix_shared_by_two_prompts": longest,
                           "warmup_cached_tokens": warm[0]["cached_tokens"], "levels": rows})


if __name__ == "__main__":
    main()
