"""Agentic edit replays: how much each turn re-prefills, per checkpoint policy.

Multi-turn coding-agent sessions rendered with the chat template, where the client edits its
history the way real clients do:
  openclaw   thinking removed from every assistant turn except the latest
  opencode   old tool results replaced by "[Old tool result content cleared]" (also Claude Code)
  swe-agent  only the last 5 observations kept, older ones "Old environment output: (N lines omitted)"
  subagents  two sessions sharing a long system prompt, interleaved
For each policy (anchors, interval:N, none) at the same checkpoint budget: tokens prefilled per
turn against the truly new tokens (those after the longest prefix shared with any earlier
request), and TTFT (mean, worst).
    python -m bench.agentic [--turns 6] [--system-words 1500] [--interval 512] [--model FTW]
--model runs another converted model (e.g. small random GLM-5 or DeepSeek-V4 configs, whose
caches are all paged: the ratio shows what reuse gives them) with its own tokenizer.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from bench.common import write_result
from bench.fullsize import full_size_engine
from freetoken.cache.config import CacheConfig
from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.server.template import ChatTemplate

PLACEHOLDER = "[Old tool result content cleared]"


def tool_output(turn: int, lines: int) -> str:
    return "\n".join(f"src/module_{turn}.py:{i}: def handler_{turn}_{i}(request): return process(request, {i})"
                     for i in range(lines))


def session(style: str, turns: int, system_words: int, tag: str = ""):
    """The message list the client sends at each turn."""
    system = f"You are a coding agent{tag}. " + " ".join(f"rule{i}: keep diffs small." for i in range(system_words // 5))
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"Fix issue #{tag or 1} in the repo."}]
    requests = []
    for t in range(turns):
        requests.append([dict(m) for m in msgs])
        msgs.append({"role": "assistant", "content": f"Step {t}: inspecting.", "reasoning_content": f"Thinking about step {t}. " * 8,
                     "tool_calls": [{"id": f"c{t}", "type": "function",
                                     "function": {"name": "bash", "arguments": {"cmd": f"grep -n handler src/module_{t}.py"}}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{t}", "content": tool_output(t, 25)})
        # the client's edit of its own history before the next request
        tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
        if style == "openclaw":
            for m in msgs[:-2]:
                if m["role"] == "assistant":
                    m.pop("reasoning_content", None)
        elif style == "opencode" and len(tools) > 2:
            msgs[tools[-3]]["content"] = PLACEHOLDER
        elif style == "swe-agent" and len(tools) > 5:
            old = msgs[tools[-6]]
            if not old["content"].startswith("Old environment output"):
                old["content"] = f"Old environment output: ({old['content'].count(chr(10)) + 1} lines omitted)"
    return requests


def common(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def replay(eng, template, policy: str, style: str, args) -> dict:
    srv = ServingEngine(eng, max_batch=2, max_queue=8, start=False,
                        cache=CacheConfig(enabled=policy != "off", checkpoint_policy=policy if policy != "off" else "none",
                                          checkpoint_budget=str(args.budget), page_size=16))
    if style == "subagents":
        a = session("opencode", args.turns, args.system_words, "")
        b = session("opencode", args.turns, args.system_words, "")
        for r in b:  # same system prompt, a different task
            r[1]["content"] = "Write the changelog for the release."
        reqs = [x for pair in zip(a, b) for x in pair]
    else:
        reqs = session(style, args.turns, args.system_words)
    seen: list[list[int]] = []
    rows = []
    for msgs in reqs:
        ids = eng.tokenizer.encode(template.render(msgs, [{"type": "function", "function": {"name": "bash"}}]))
        new = len(ids) - max((common(ids, s) for s in seen), default=0)
        req = Request(ids, SamplingOptions(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        t0 = time.perf_counter()
        srv.sched.add(req)
        ttft = None
        while req.finished_at is None:
            srv.step()
            if ttft is None and req.output_ids:
                ttft = time.perf_counter() - t0
        seen.append(ids + req.output_ids[:-1])
        prefilled = len(ids) - req.cached_tokens
        rows.append({"prompt": len(ids), "truly_new": new, "prefilled": prefilled,
                     "ratio": round(prefilled / max(new, 1), 3), "ttft_s": round(ttft, 3)})
    later = rows[1:] if style != "subagents" else rows[2:]
    return {"turns": rows, "mean_ttft_s": round(sum(r["ttft_s"] for r in rows) / len(rows), 3),
            "worst_ttft_s": max(r["ttft_s"] for r in rows),
            "prefilled_total": sum(r["prefilled"] for r in rows), "truly_new_total": sum(r["truly_new"] for r in rows),
            "worst_ratio_after_first": max(r["ratio"] for r in later)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-words", type=int, default=1500)
    ap.add_argument("--interval", type=int, default=512)
    ap.add_argument("--budget", type=int, default=32, help="checkpoint slots, the same for every policy")
    ap.add_argument("--tokens", type=int, default=8, help="tokens generated per turn")
    ap.add_argument("--styles", default="openclaw,opencode,swe-agent,subagents")
    ap.add_argument("--full-size", action="store_true", help="Qwen3.6-35B-A3B shape, random weights (GPU machine)")
    ap.add_argument("--layers", type=int, default=40, help="with --full-size")
    ap.add_argument("--device", default="cuda", help="with --full-size")
    ap.add_argument("--model", default=None, help="an FTW file instead of the demo model")
    ap.add_argument("--styles-policies", default="anchors,interval,none",
                    help="checkpoint policies to replay (anchors, interval, none)")
    a = ap.parse_args()
    if a.full_size:
        eng = full_size_engine(a.layers, a.device)
    else:
        eng = Engine(a.model or demo_path(), EngineConfig(dtype="float32") if a.model else None)
    template = ChatTemplate(None)
    # kernels compiled and autotuned, and the allocator grown, before any turn is timed: one
    # templated request longer than a prefill chunk, with anchors in it
    warm = ServingEngine(eng, max_batch=1, max_queue=1, start=False, cache=CacheConfig(checkpoint_budget="2"))
    text = template.render(session("openclaw", 1, 2 * eng.ecfg.prefill_chunk // 3 + 600)[0], None)
    req = Request(eng.tokenizer.encode(text), SamplingOptions(temperature=0, max_tokens=4, ignore_eos=True))
    warm.sched.add(req)
    while req.finished_at is None:
        warm.step()
    del warm
    res = {"model": f"Qwen3.6-35B-A3B shape, {a.layers} layers, random BF16" if a.full_size else
           (f"{eng.cfg.arch} ({a.model})" if a.model else "demo"),
           "config": {k: v for k, v in dataclasses.asdict(eng.cfg).items() if isinstance(v, (int, float, str, bool, list))},
           "device": str(eng.device), "checkpoint_budget": a.budget, "styles": {}}
    for style in a.styles.split(","):
        res["styles"][style] = {}
        names = {"anchors": "anchors", "interval": f"interval:{a.interval}", "none": "none"}
        for policy in (names[p] for p in a.styles_policies.split(",")):
            r = replay(eng, template, policy, style, a)
            res["styles"][style][policy] = r
            print(style, policy, {k: v for k, v in r.items() if k != "turns"}, flush=True)
    write_result("agentic-full" if a.full_size else f"agentic-{eng.cfg.arch}" if a.model else "agentic", res)


if __name__ == "__main__":
    main()
