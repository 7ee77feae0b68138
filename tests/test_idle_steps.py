"""Prompt steps while nothing decodes (--idle-step-tokens, runtime/budget.py idle_step_tokens): the
memory plan's work buffers follow the larger step, auto picks the largest candidate whose extra
buffers the KV pool can spare, and the serving loop prefills in those steps with the same tokens."""
import pytest
import torch

import hf_models
from freetoken.config import ModelConfig
from freetoken.errors import FreeTokenError
from freetoken.runtime import budget
from freetoken.runtime.budget import idle_step_tokens, plan_memory
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_hf(hf_models.qwen3_5(5, num_hidden_layers=4).config.to_dict())


def planner(cfg, total: int, max_len: int = 4096, **kw):
    def plan_for(n: int):
        return plan_memory(cfg, torch.device("cpu"), torch.float32, total, 100 << 20, 2, max_len, 2048, 16, 0,
                           work_chunk=n, **kw)
    return plan_for


def test_work_buffers_follow_the_larger_step(cfg):
    plan_for = planner(cfg, 4 << 30)
    base, big = plan_for(0), plan_for(8192)
    assert big.work - base.work == budget.work_bytes(cfg, 8192, 2, torch.float32) - budget.work_bytes(
        cfg, 2048, 2, torch.float32) > 0
    assert big.state == base.state  # the rings and slot state stay sized for --prefill-chunk
    assert big.kv < base.kv or big.kv_pages == base.kv_pages


def test_auto_takes_the_largest_step_the_kv_pool_can_spare(cfg):
    extra = {n: budget.work_bytes(cfg, n, 2, torch.float32) - budget.work_bytes(cfg, 2048, 2, torch.float32)
             for n in budget.IDLE_CANDIDATES}
    roomy = planner(cfg, 64 << 30)
    base = roomy(0)
    assert base.kv_pages == 2 * -(-4096 // 16) + 1  # a pool of every slot's whole context
    assert idle_step_tokens(roomy, base, 2048, 2048) == (8192, roomy(8192))  # nothing lost: the largest

    # a budget whose KV pool shrinks with the work buffers, sized from the model's own numbers so
    # that an eighth of the pool lies between 4096's extra buffers and 8192's
    fixed = base.weights + base.work + base.state + base.checkpoints
    pool = 4 * (extra[4096] + extra[8192])
    tight = planner(cfg, fixed + pool, max_len=1 << 20)
    b = tight(0)
    assert b.kv_pages < 2 * (1 << 20) // 16  # below every slot's context: the work comes out of it
    assert extra[4096] < b.kv / 8 < extra[8192]
    n, plan = idle_step_tokens(tight, b, 2048, 2048)
    assert n == 4096 and plan.work == tight(4096).work and plan.kv < b.kv
    # a step budget of 4096 already: no smaller candidate is taken, the plan stays the base one
    assert idle_step_tokens(tight, b, 2048, 4096) == (4096, b)
    # a pool that would then hold fewer tokens than the context a request may have: not taken
    assert idle_step_tokens(tight, b, 2048, 2048, context=b.kv_tokens) == (2048, b)
    # a pool too small for either: the step budget
    small = planner(cfg, fixed + 4 * extra[4096], max_len=1 << 20)
    assert idle_step_tokens(small, small(0), 2048, 2048) == (2048, small(0))


def test_auto_never_takes_expert_cache_slots_or_fails(cfg):
    slots = planner(cfg, 2 << 30, expert_slot_bytes=1 << 20, num_experts=100_000)
    base = slots(0)
    n, plan = idle_step_tokens(slots, base, 2048, 2048)
    assert plan.expert_slots == base.expert_slots and (n == 2048) == (plan is base)

    def refuse(n):
        if n > 2048:
            raise FreeTokenError("does not fit")
        return base
    assert idle_step_tokens(refuse, base, 2048, 2048) == (2048, base)
    assert idle_step_tokens(refuse, base, 8192, 2048) == (8192, base)  # --prefill-chunk 8192: its room is there


@pytest.fixture(scope="module")
def ftw(tmp_path_factory):
    d = tmp_path_factory.mktemp("idle")
    hf_models.save(hf_models.qwen3_5(44, num_hidden_layers=2, max_position_embeddings=1024), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw")


def run(ftw, **kw):
    """Two greedy requests, the second arriving once the first has its first token -> (tokens,
    prompt tokens of each step, the loop's idle budget)."""
    eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", prefill_chunk=16, max_step_tokens=24, **kw))
    srv = ServingEngine(eng, max_batch=2, max_queue=4, start=False)
    steps = []
    real = srv.sched.schedule

    def spy(*a, **k):
        b = real(*a, **k)
        steps.append(sum(e - s for _, s, e in b.prefill))
        return b
    srv.sched.schedule = spy
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(5, 200, (n,), generator=g).tolist(),
                    SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)) for n in (100, 70)]
    srv.sched.add(reqs[0])
    while not reqs[0].output_ids:
        srv.step()
    srv.sched.add(reqs[1])
    while srv.sched.busy:
        srv.step()
    return [r.output_ids for r in reqs], [n for n in steps if n], srv.describe()["idle_step_tokens"]


def test_the_loop_prefills_in_idle_steps_with_the_same_tokens(ftw):
    plain, plain_steps, plain_idle = run(ftw)
    idle, idle_steps, n = run(ftw, idle_step_tokens=64)
    assert plain_idle == 24  # auto with --max-step-tokens given: the step budget
    assert n == 64
    assert idle == plain
    assert plain_steps[:7] == [16] * 6 + [4]  # the first prompt, alone, in --prefill-chunk's 16
    assert idle_steps[:2] == [64, 36]  # alone: steps of 64, past --prefill-chunk's 16
    # the second prompt arrives while the first decodes: the step budget less the decode row
    assert max(idle_steps[2:]) <= 23


def test_auto_on_the_cpu_is_the_prefill_chunk(ftw):
    eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", prefill_chunk=300))
    d = ServingEngine(eng, max_batch=2, max_queue=4, start=False).describe()
    assert (d["max_step_tokens"], d["idle_step_tokens"]) == (512, 512)  # the larger of the two
    eng = Engine(ftw, EngineConfig(device="cpu", dtype="float32", prefill_chunk=900))
    d = ServingEngine(eng, max_batch=2, max_queue=4, start=False).describe()
    assert (d["max_step_tokens"], d["idle_step_tokens"]) == (512, 900)


def test_a_negative_idle_budget_is_refused():
    with pytest.raises(FreeTokenError, match="--idle-step-tokens"):
        EngineConfig(device="cpu", idle_step_tokens=-1)
