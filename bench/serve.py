"""Server benchmark: per-request decode tok/s and TTFT at 1, 2, 4 and 8 concurrent streams.

Starts a real `ft serve` (default: the demo model) on 127.0.0.1 and drives it with streaming
/v1/chat/completions requests over raw HTTP (httpx), so it runs where the SDKs are absent.
    python -m bench.serve [--concurrency 1,2,4,8] [--tokens 64] [--prompt-words 200] [-- serve flags]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from bench.common import write_result

sys.path.insert(0, "tests")
from server_fixture import Server  # noqa: E402


async def one(client, url, i, tokens, words):
    body = {"model": "freetoken-demo", "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Request {i}: " + "lorem ipsum " * (words // 2)}]}
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("error"):
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("choices") and obj["choices"][0]["delta"].get("content") is not None and n == 0 and first is None \
                    and obj["choices"][0]["delta"].get("role"):
                continue  # the opening role chunk is not a token
            if obj.get("choices") and (obj["choices"][0]["delta"] or obj["choices"][0].get("finish_reason")):
                first = first or time.perf_counter()
                last = time.perf_counter()
            if obj.get("usage"):
                n = obj["usage"]["completion_tokens"]
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (last - first) if n > 1 and last > first else None,
            "tokens": n}


async def level(url, c, tokens, words):
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[one(client, url, i, tokens, words) for i in range(c)])
        wall = time.perf_counter() - t0
    speeds = [r["decode_tok_s"] for r in rs if r["decode_tok_s"]]
    return {"concurrency": c, "mean_ttft_s": round(statistics.mean(r["ttft_s"] for r in rs), 3),
            "worst_ttft_s": round(max(r["ttft_s"] for r in rs), 3),
            "mean_decode_tok_s": round(statistics.mean(speeds), 2) if speeds else None,
            "aggregate_tok_s": round(sum(r["tokens"] for r in rs) / wall, 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("serve_args", nargs="*", help="extra `ft serve` flags (after --)")
    a = ap.parse_args()
    srv = Server("--max-batch", "8", *a.serve_args)
    try:
        asyncio.run(level(srv.url, 1, 4, 20))  # warm-up
        rows = [asyncio.run(level(srv.url, int(c), a.tokens, a.prompt_words)) for c in a.concurrency.split(",")]
    finally:
        head = srv.output().splitlines()[:1]
        srv.stop()
    for r in rows:
        print(r, flush=True)
    write_result("serve", {"model": "demo", "server": head, "tokens_per_request": a.tokens,
                           "prompt_words": a.prompt_words, "levels": rows})


if __name__ == "__main__":
    main()
