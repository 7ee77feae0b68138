"""Prefix reuse is exact: a conversation prefilled in pieces through cache hits, checkpoint
restores and evictions gives the logits of one cold prefill (float32, 1e-4), for each way
agent clients edit their history, and under memory pressure."""
import pytest
import torch

import hf_models
from freetoken.cache.config import CacheConfig
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = {}
    for name, build in (("hybrid", lambda: hf_models.qwen3_5(31, num_hidden_layers=4, max_position_embeddings=1024)),
                        ("attention", lambda: hf_models.qwen3_moe(32, max_position_embeddings=1024))):
        d = tmp_path_factory.mktemp(name)
        hf_models.save(build(), str(d / "hf"))
        convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
        out[name] = Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=48))
    return out


class Conv:
    """Builds Qwen-format token sequences with the test tokenizer."""

    def __init__(self, eng):
        self.tk = eng.tokenizer
        self.s = {t: self.tk.token_id(t) for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                                     "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")}

    def turn(self, role, *parts):
        ids = [self.s["<|im_start|>"]] + self.tk.encode(role + "\n")
        for p in parts:
            ids += [self.s[p]] if p in self.s else self.tk.encode(p)
        return ids + [self.s["<|im_end|>"]] + self.tk.encode("\n")


def serve(eng, cache, slots=2, kv_tokens=None):
    return ServingEngine(eng, max_batch=slots, max_queue=8, cache=cache, record_logits=True, start=False,
                         kv_tokens=kv_tokens)


def run(srv, prompt, max_tokens=3):
    req = Request(list(prompt), SamplingOptions(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    srv.sched.add(req)
    while req.finished_at is None:
        srv.step()
    return req


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def check_same(warm, cold):
    assert warm.output_ids == cold.output_ids
    for a, b in zip(warm.logits, cold.logits):
        assert rel(a, b) < 1e-4


def common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def sessions(c):
    """(name, first request, second request, tokens the second truly shares with the first)."""
    sys_p = c.turn("system", "You are a careful coding agent. " * 6)
    u1 = c.turn("user", "Fix the failing test in utils.py please.")
    a1 = c.turn("assistant", "<think>", "The test fails because of an off-by-one.", "</think>", "Let me look.",
                "<tool_call>", '{"name": "read", "arguments": {"path": "utils.py"}}', "</tool_call>")
    a1_stripped = c.turn("assistant", "Let me look.", "<tool_call>", '{"name": "read", "arguments": {"path": "utils.py"}}',
                         "</tool_call>")
    obs = c.turn("user", "<tool_response>", "def f(x):\n    return x + 1\n" * 8, "</tool_response>")
    cleared = c.turn("user", "<tool_response>", "[Old tool result content cleared]", "</tool_response>")
    omitted = c.turn("user", "<tool_response>", "Old environment output: (16 lines omitted)", "</tool_response>")
    a2 = c.turn("assistant", "<think>", "Now edit.", "</think>", "Editing.")
    u2 = c.turn("user", "Also run the tests.")
    first = sys_p + u1 + a1 + obs + a2 + u2
    return [
        # OpenClaw: thinking stripped from every assistant turn but the latest
        ("openclaw", first, sys_p + u1 + a1_stripped + obs + a2 + u2 + c.turn("user", "go on"), len(sys_p + u1)),
        # OpenCode / Claude Code: old tool output replaced by a placeholder
        ("opencode", first, sys_p + u1 + a1 + cleared + a2 + u2 + c.turn("user", "next"), len(sys_p + u1 + a1)),
        # SWE-agent: observations older than the last n replaced by an omission line
        ("swe-agent", first, sys_p + u1 + a1 + omitted + a2 + u2 + c.turn("user", "next"), len(sys_p + u1 + a1)),
        # sub-agents: two sessions sharing a long system prompt
        ("subagents", sys_p + u1, sys_p + c.turn("user", "Summarise the repository layout."), len(sys_p)),
    ]


@pytest.mark.parametrize("model", ["hybrid", "attention"])
@pytest.mark.parametrize("policy", ["anchors", "interval:8", "none"])
def test_edits_are_exact(engines, model, policy):
    eng = engines[model]
    c = Conv(eng)
    for name, first, second, _ in sessions(c):
        shared = common(first, second)
        assert shared < len(first)  # the edit is inside the first request, not past its end
        # interval:8 keeps a checkpoint every 8 tokens of the first request; a budget that
        # holds them all makes its reuse exact below (the default 32 slots would evict the
        # early ones of a long first request)
        budget = str(len(first) // 8 + 4) if policy == "interval:8" else "32"
        warm = serve(eng, CacheConfig(page_size=4, checkpoint_policy=policy, min_gap=8, checkpoint_budget=budget))
        run(warm, first)
        got = run(warm, second)
        cold = run(serve(eng, CacheConfig(enabled=False)), second)
        check_same(got, cold)
        assert got.cached_tokens <= shared, name  # never reuses past the edit
        if model == "attention" or policy == "anchors":
            # KV alone (attention) or an anchor near the edit (hybrid) reuse all but at most
            # one page or min_gap tokens
            assert got.cached_tokens >= shared - 8 - 4, (name, got.cached_tokens, shared)
        if model == "hybrid" and policy == "interval:8":
            # the restore point is the deepest checkpoint inside both the shared prefix and the
            # KV match (all of it: page_size 4 with partial pages), short of the last prompt
            # token, which is always prefilled: the deepest multiple of 8 there
            assert got.cached_tokens == min(shared, len(second) - 1) // 8 * 8, (name, got.cached_tokens, shared)
        if model == "hybrid" and policy == "none":
            assert got.cached_tokens == 0


def test_decode_checkpoints_serve_the_next_turn(engines):
    """Checkpoints are also taken while decoding: the next turn, which appends to the full
    reply, restores from inside the reply, past the old prompt."""
    eng = engines["hybrid"]
    c = Conv(eng)
    srv = serve(eng, CacheConfig(page_size=4, checkpoint_policy="interval:2"))
    prompt = c.turn("system", "Be brief. " * 10) + c.turn("user", "hello there")
    first = run(srv, prompt, max_tokens=9)
    follow = prompt + first.output_ids[:-1] + [c.s["<|im_end|>"]] + c.tk.encode("\n") + c.turn("user", "more")
    got = run(srv, follow)
    check_same(got, run(serve(eng, CacheConfig(enabled=False)), follow))
    assert got.cached_tokens > len(prompt)


def test_memory_pressure_stays_exact(engines):
    eng = engines["hybrid"]
    c = Conv(eng)
    longest = max(len(r) for _, a, b, _ in sessions(c) for r in (a, b)) + 3
    # one pool for running requests and the cache: room for the longest request and 48 tokens more
    srv = serve(eng, CacheConfig(page_size=4, checkpoint_budget="2"), kv_tokens=longest + 48)
    cold = serve(eng, CacheConfig(enabled=False))
    for name, first, second, _ in sessions(c):
        run(srv, first)
        check_same(run(srv, second), run(cold, second))
        other = c.turn("user", f"An unrelated session about {name}, " * 4)  # pushes the old prefix out
        check_same(run(srv, other), run(cold, other))
    st = srv.cache.stats()
    assert st["kv_pages_evicted"] > 0 and st["checkpoint_evictions"] > 0, st


def test_budget_in_bytes(engines):
    eng = engines["hybrid"]
    srv = serve(eng, CacheConfig(checkpoint_budget="1MiB"))
    per = srv.cache.checkpoint_bytes()
    assert srv.cache.ckpt.capacity == (1 << 20) // per


@pytest.mark.parametrize("bad", ["lots", "3XB", "1.5"])
def test_bad_budget(bad):
    from freetoken.errors import FreeTokenError
    with pytest.raises(FreeTokenError):
        CacheConfig(checkpoint_budget=bad)
