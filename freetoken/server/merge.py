"""Several requests' event streams as one: a streamed answer with n > 1 choices (or several
/v1/completions prompts) sends every choice's chunks as they arrive, each tagged with its index,
as OpenAI and vLLM stream them. The engine batches the requests; this only interleaves their
events on the event loop."""
from __future__ import annotations

import asyncio

END = object()  # a stream's end, as merged() reports it


async def merged(gens: list):
    """gens: async iterators -> async iterator of (index, event) in arrival order, then
    (index, END) when iterator `index` ends. An exception inside one is raised here, in its
    place. Closing this iterator (the client went away, or a choice failed) stops every pump and
    closes every iterator, whose own finally cancels its request."""
    queue: asyncio.Queue = asyncio.Queue()  # unbounded: put_nowait never waits

    async def pump(i, g):
        try:
            async for ev in g:
                queue.put_nowait((i, ev))
        except Exception as e:  # noqa: BLE001  handed to the consumer, raised there in order
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, END))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, ev = await queue.get()
            if isinstance(ev, Exception):
                raise ev
            if ev is END:
                left -= 1
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
