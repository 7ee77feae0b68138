"""How long one heavy request holds the server's event loop: what the other clients see.

A request's preparation (rendering the chat history, tokenizing it, Responses' truncation) used
to run on the event loop, so every other stream, /health and /metrics waited for it. Two cases,
each against a real `ft serve` on the demo model:

  big_prompt  a chat request whose one message is --big-mb of text (over the context: it ends in
              a 400), while a streamed chat request is decoding: the stream's longest gap
              between chunks during the big request, against its median gap
  truncation  a Responses request with truncation "auto" over a --turns-turn history far past
              the context, while /health is polled every 0.1 s: the longest /health answer

    python -m bench.loop_stall --name loop_stall
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import httpx

from bench.common import write_result

sys.path.insert(0, "tests")
from server_fixture import MODEL, Server  # noqa: E402


def stream_gaps(url: str, tokens: int, out: list, started: threading.Event) -> None:
    """One streamed chat request; out gets (arrival time) of every chunk."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(time.perf_counter())
                started.set()


def big_prompt(url: str, mb: float, tokens: int) -> dict:
    arrivals: list[float] = []
    started = threading.Event()
    th = threading.Thread(target=stream_gaps, args=(url, tokens, arrivals, started))
    th.start()
    started.wait(120)
    time.sleep(0.5)  # a few steady gaps first
    words = int(mb * 1e6 / 6)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "words " * words}], "max_tokens": 4}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    t1 = time.perf_counter()
    th.join()
    gaps = [(b - a, a) for a, b in zip(arrivals, arrivals[1:])]
    during = [g for g, a in gaps if t0 - 0.05 <= a <= t1]
    return {"prompt_mb": mb, "status": r.status_code, "big_request_s": round(t1 - t0, 3),
            "stream_chunks": len(arrivals), "stream_median_gap_ms": round(statistics.median(g for g, _ in gaps) * 1e3, 1),
            "stream_max_gap_during_ms": round(max(during, default=0.0) * 1e3, 1)}


def truncation(url: str, turns: int, words: int) -> dict:
    turn = " ".join(f"w{i}" for i in range(words))
    items = []
    for k in range(turns):
        items += [{"role": "user", "content": f"q{k} {turn}"}, {"role": "assistant", "content": f"a{k} {turn}"}]
    items.append({"role": "user", "content": "final"})
    lat: list[float] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=600)
            lat.append(time.perf_counter() - t)
            time.sleep(0.1)
    th = threading.Thread(target=poll)
    th.start()
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 1,
                                                 "truncation": "auto", "store": False}, timeout=900)
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    return {"turns": turns, "words_a_message": words, "status": r.status_code, "request_s": round(took, 3),
            "input_tokens": (r.json().get("usage") or {}).get("input_tokens") if r.status_code == 200 else None,
            "health_polls": len(lat), "health_max_ms": round(max(lat, default=0.0) * 1e3, 1),
            "health_median_ms": round(statistics.median(lat) * 1e3, 1) if lat else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big-mb", type=float, default=4.0)
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--turns", type=int, default=120)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--name", default="loop_stall")
    ap.add_argument("serve_args", nargs="*", help="extra `ft serve` flags (after --)")
    a = ap.parse_args()
    srv = Server(*a.serve_args)
    try:
        rows = {"big_prompt": big_prompt(srv.url, a.big_mb, a.stream_tokens)}
        print(rows["big_prompt"], flush=True)
        rows["truncation"] = truncation(srv.url, a.turns, a.words)
        print(rows["truncation"], flush=True)
        head = srv.output().splitlines()[:1]
    finally:
        srv.stop()
    write_result(a.name, {"model": "demo", "server": head, **rows})


if __name__ == "__main__":
    main()
