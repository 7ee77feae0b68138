"""run_choices (OpenAI `n` > 1, prompt lists) without a server: when one choice fails, the
original error comes out (not aclose's RuntimeError on a generator still running) and every
other choice's request is cancelled, including one whose generator never started."""
import asyncio
import types

import pytest

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
