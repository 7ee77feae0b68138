"""Scheduler (plain Python, no torch) with fake requests."""
import sys

import pytest

from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.scheduler import QueueFull, Scheduler


def req(n=10):
    return Request(list(range(n)), SamplingOptions(max_tokens=4))


def test_scheduler_imports_no_torch():
    import subprocess
    code = "import sys, freetoken.runtime.scheduler, freetoken.runtime.request; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_admission_chunking_and_decode():
    s = Scheduler(slots=2, max_queue=1, chunk=4, step_tokens=4, order="arrival")
    a, b, c = req(10), req(3), req(5)
    for r in (a, b, c):
        s.add(r)
    batch = s.schedule()
    assert (a.slot, b.slot, c.slot) == (0, 1, None)
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(a.id, 0, 4)]  # the step's budget: 4 tokens
    a.computed = 4
    batch = s.schedule()
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(a.id, 4, 8)]
    a.computed = 10  # pretend the rest went through
    b.computed = 3
    b.output_ids.append(7)
    batch = s.schedule()
    assert b in batch.decode and a in batch.decode
    s.finish(a)
    batch = s.schedule()
    assert c.slot == 0  # the freed lowest slot is reused
    assert [r.id for r, _, _ in batch.prefill] == [c.id]


def test_queue_bound_counts_free_slots():
    s = Scheduler(slots=2, max_queue=1, chunk=8)
    for _ in range(3):
        s.add(req())
    with pytest.raises(QueueFull):
        s.add(req())
    s.schedule()  # two enter slots, one waits
    with pytest.raises(QueueFull):
        s.add(req())


def test_cancelled_requests_leave():
    s = Scheduler(slots=1, max_queue=2, chunk=8)
    a, b = req(), req()
    s.add(a)
    s.add(b)
    s.schedule()
    b.cancelled = True
    batch = s.schedule()
    assert batch.cancelled == [b] and b not in s.waiting
    a.cancelled = True
    batch = s.schedule()
    assert batch.cancelled == [a]
    s.finish(a)
    assert s.free == [0] and not s.busy


def test_token_budget_spans_requests_shortest_first():
    s = Scheduler(slots=3, max_queue=4, chunk=8, step_tokens=12)
    long, short, mid = req(30), req(3), req(6)
    for r in (long, short, mid):
        s.add(r)
    batch = s.schedule()
    # decode rows: none yet; prompts shortest-remaining first, each at most one chunk, 12 tokens in all
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(short.id, 0, 3), (mid.id, 0, 6), (long.id, 0, 3)]
    short.computed, mid.computed, long.computed = 3, 6, 3
    short.output_ids.append(1)
    mid.output_ids.append(1)
    batch = s.schedule()
    assert batch.decode == [short, mid]  # two decode rows take two tokens of the budget
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(long.id, 3, 11)]
    batch = s.schedule(prefill_budget=2)  # the runtime keeps decoders' latency bounded
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(long.id, 3, 5)]


def test_preempted_request_goes_first_and_recomputes_its_tokens():
    s = Scheduler(slots=1, max_queue=4, chunk=64)
    a, b = req(10), req(5)
    s.add(a)
    s.add(b)
    s.schedule()
    a.computed = 10
    a.output_ids += [5, 6]
    a.computed, a.prefill_end = 0, a.length  # what the runtime does when it preempts
    s.preempt(a)
    assert a.slot is None and s.waiting[0] is a and s.free == [0]
    batch = s.schedule()
    assert a.slot == 0 and [(r.id, st, en) for r, st, en in batch.prefill] == [(a.id, 0, 12)]


def test_a_short_prompt_goes_whole_past_the_latency_budget():
    """short_whole: the latency budget sizes a long prompt's chunk by its costliest layer at a
    deep context; a prompt that fits the step whole goes whole (its layers are cheap), the long
    prompt waits for the next step, and a prompt longer than the step does not qualify."""
    s = Scheduler(slots=4, max_queue=4, chunk=16, step_tokens=16)
    dec, long = req(2), req(40)
    for r in (dec, long):
        s.add(r)
    s.schedule()
    dec.computed, long.computed = 2, 5
    dec.output_ids.append(1)
    short = req(9)
    s.add(short)
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=4).prefill] == [(short.id, 0, 4)]
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=4, short_whole=True).prefill] == \
        [(short.id, 0, 9)]  # whole, and nothing for the long prompt in this step
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=12, short_whole=True).prefill] == \
        [(short.id, 0, 9), (long.id, 5, 8)]  # within the budget: the usual sharing
    short.computed = 9
    short.output_ids.append(1)
    longer = req(16)  # more than the 14 tokens the step has beside two decode rows
    s.add(longer)
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=4, short_whole=True).prefill] == \
        [(longer.id, 0, 4)]


def test_short_prompts_further_on_go_whole_in_arrival_order_too():
    s = Scheduler(slots=3, max_queue=4, chunk=16, step_tokens=16, order="arrival")
    long, short = req(40), req(6)
    for r in (long, short):
        s.add(r)
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=4).prefill] == [(long.id, 0, 4)]
    assert [(r.id, a, b) for r, a, b in s.schedule(prefill_budget=4, short_whole=True).prefill] == \
        [(long.id, 0, 4), (short.id, 0, 6)]  # past the spent budget, whole


def test_an_idle_step_takes_its_own_budget_until_a_stream_decodes():
    """idle_tokens: a step in which nothing decodes (and no latency budget is set) prefills up to
    it, one request's chunk included; once a row decodes, the step budget and the chunk hold again."""
    s = Scheduler(slots=2, max_queue=2, chunk=4, step_tokens=6, idle_tokens=16)
    a, b = req(40), req(3)
    s.add(a)
    batch = s.schedule()
    assert [(st, en) for _, st, en in batch.prefill] == [(0, 16)]  # past chunk and step budget
    a.computed = 16
    # a latency budget set by the runtime: the ordinary step's rules (its chunk of 4 here)
    assert [(st, en) for _, st, en in s.schedule(prefill_budget=5).prefill] == [(16, 20)]
    s.add(b)
    batch = s.schedule()
    assert [(r.id, st, en) for r, st, en in batch.prefill] == [(b.id, 0, 3), (a.id, 16, 29)]  # 16 in all
    b.computed = 3
    b.output_ids.append(1)  # b decodes now: the step's budget (6 - 1 row) and the chunk of 4 again
    batch = s.schedule()
    assert batch.decode == [b] and [(st, en) for _, st, en in batch.prefill] == [(16, 20)]


def test_idle_tokens_follow_the_step_budget_unless_set():
    s = Scheduler(slots=1, max_queue=1, chunk=8, step_tokens=6)
    assert s.idle_tokens == 6
    s.step_tokens = 3  # as tests and benchmarks change it after construction
    assert s.idle_tokens == 3
    a = req(20)
    s.add(a)
    assert [(st, en) for _, st, en in s.schedule().prefill] == [(0, 3)]


def test_an_idle_budget_equal_to_the_step_budget_still_takes_the_chunk_past_its_cap():
    s = Scheduler(slots=1, max_queue=1, chunk=4, step_tokens=16, idle_tokens=16)
    a = req(40)
    s.add(a)
    assert [(st, en) for _, st, en in s.schedule().prefill] == [(0, 16)]  # one request's chunk included
