"""run_choices (OpenAI `n` > 1, prompt lists) without a server: when one choice fails, the
original error comes out (not aclose's RuntimeError on a generator still running) and every
other choice's request is cancelled, including one whose generator never started."""
import asyncio
import types

import pytest

from freetoken.server import generation as gen_mod
from freetoken.server import openai as api


class FakeServing:
    def __init__(self):
        self.cancelled = []

    def cancel(self, req, reason=None):
        self.cancelled.append(req.id)


def test_a_failed_choice_cancels_the_others(monkeypatch):
    ctx = types.SimpleNamespace(serving=FakeServing())
    reqs = [types.SimpleNamespace(id=i, finish_reason=None, finished_at=None) for i in range(3)]
    it = iter(reqs)
    monkeypatch.setattr(api, "submit", lambda ctx, ids, sampling: (next(it), None))
    closed = []

    def open_events(req, queue):
        async def gen():
            try:
                if req.id == 1:
                    await asyncio.sleep(0.01)
                    raise ValueError("choice 1 failed")
                await asyncio.Event().wait()  # a choice still decoding
                yield None
            finally:
                closed.append(req.id)
        return gen()

    with pytest.raises(ValueError, match="choice 1 failed"):
        asyncio.run(api.run_choices(ctx, [([1], None)] * 3, open_events))
    assert sorted(closed) == [0, 1, 2]  # every generator ran its finally
    assert sorted(ctx.serving.cancelled) == [0, 1, 2]  # and no request was left decoding


def test_choices_come_back_in_order(monkeypatch):
    ctx = types.SimpleNamespace(serving=FakeServing())
    reqs = iter(types.SimpleNamespace(id=i, finish_reason="stop", finished_at=1.0) for i in range(4))
    monkeypatch.setattr(api, "submit", lambda ctx, ids, sampling: (next(reqs), None))

    def open_events(req, queue):
        async def gen():
            await asyncio.sleep(0.01 * (4 - req.id))  # later choices finish first
            yield req.id
        return gen()
    assert asyncio.run(api.run_choices(ctx, [([1], None)] * 4, open_events)) == [[0], [1], [2], [3]]
    assert ctx.serving.cancelled == []  # finished requests are not cancelled


def test_choice_seeds():
    from freetoken.runtime.request import SamplingOptions
    s = SamplingOptions(seed=2 ** 64 - 1, stop=["x"])
    assert api.choice_sampling(s, 0) is s
    assert api.choice_sampling(s, 1).seed == 0 and api.choice_sampling(s, 1).stop == ["x"]
    assert api.choice_sampling(SamplingOptions(), 3).seed is None


def _collect(agen):
    async def run():
        return [part async for part in agen]
    return asyncio.run(run())


def test_a_streamed_choice_that_fails_ends_the_stream_and_cancels_the_others():
    """stream with n > 1: a choice whose generation failed sends one error event (no [DONE]);
    every other choice's generator is closed and its request cancelled (generation._closing)."""
    from freetoken.server.generation import Done, Tokens
    from freetoken.server.parser import Event
    ctx = types.SimpleNamespace(serving=FakeServing())
    reqs = [types.SimpleNamespace(id=i, finish_reason=None, finished_at=None) for i in range(3)]
    closed = []

    def gen(i):
        async def g():
            try:
                yield Tokens()
                yield Event("content", f"c{i}")
                if i == 1:
                    await asyncio.sleep(0.01)
                    yield Done("error", None, 0, 0, 0, error="boom")
                await asyncio.Event().wait()  # still decoding
            finally:
                closed.append(i)
        return g()
    body = api._chat_stream([gen(i) for i in range(3)], "id", 0, "m", False, None)
    parts = _collect(gen_mod._closing(ctx, [(r, None) for r in reqs], body))
    assert sum('"role": "assistant"' in p for p in parts) == 3  # one opening chunk per choice
    import json
    chunks = [json.loads(p[len("data: "):]) for p in parts if p.startswith("data: ")]
    content = [(c["choices"][0]["index"], c["choices"][0]["delta"].get("content")) for c in chunks if c.get("choices")]
    assert {(i, f"c{i}") for i in range(3)} <= set(content)  # each choice's text under its own index
    assert "boom" in parts[-1] and not any("[DONE]" in p for p in parts)
    assert sorted(closed) == [0, 1, 2] and sorted(ctx.serving.cancelled) == [0, 1, 2]


def test_merged_interleaves_and_raises_in_place():
    from freetoken.server.merge import END, merged

    def gen(i, delays, fail=False):
        async def g():
            for d in delays:
                await asyncio.sleep(d)
                yield (i, d)
            if fail:
                raise RuntimeError(f"stream {i}")
        return g()

    async def run(gens):
        return [x async for x in merged(gens)]
    out = asyncio.run(run([gen(0, [0.03, 0.03]), gen(1, [0.01, 0.01, 0.01])]))
    seen = [ev for _, ev in out if ev is not END]
    assert seen == [(1, 0.01), (1, 0.01), (0, 0.03), (1, 0.01), (0, 0.03)]  # arrival order
    assert sorted(i for i, ev in out if ev is END) == [0, 1]
    with pytest.raises(RuntimeError, match="stream 1"):
        asyncio.run(run([gen(0, [0.05] * 3), gen(1, [0.01], fail=True)]))


def test_a_stream_whose_body_never_starts_cancels_its_requests():
    """The client gone before the headers went out: Starlette never iterates the body, so no
    generator's finally runs; RequestStream still cancels every request it started."""
    ctx = types.SimpleNamespace(serving=FakeServing())
    reqs = [types.SimpleNamespace(id=i, finish_reason=None, finished_at=None) for i in range(3)]

    async def body():
        yield "data: {}\n\n"

    async def send(message):
        raise OSError("client gone")

    async def receive():
        await asyncio.Event().wait()
    resp = gen_mod.RequestStream(ctx, [(r, None) for r in reqs], body())
    with pytest.raises(Exception):
        asyncio.run(resp({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    assert sorted(ctx.serving.cancelled) == [0, 1, 2]
