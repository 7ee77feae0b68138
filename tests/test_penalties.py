"""Logit adjustments before the pick (runtime/penalties.py) and min-p (runtime/sampler.py):
against formulas written out here from OpenAI's and transformers' definitions, on fresh random
logits; then through the serving loop, where every pick must be the argmax of the adjusted
logits the engine saw (recorded), and through the HTTP API's validation."""
import json
from collections import Counter

import pytest
import torch

import hf_models
from drive import drive
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.penalties import LogitAdjuster
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.sampler import SamplingParams, sample
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


def reference(logits, opts, prompt, out):
    """The adjustments one token at a time, as their definitions read."""
    x = logits.float().tolist()
    for t, b in opts.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / opts.repetition_penalty if x[t] > 0 else x[t] * opts.repetition_penalty
    for t, c in Counter(out).items():
        x[t] -= opts.frequency_penalty * c + opts.presence_penalty
    return torch.tensor(x)


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.5), dict(frequency_penalty=-0.7),
                                dict(repetition_penalty=1.3), dict(repetition_penalty=0.8),
                                dict(logit_bias={3: 100.0, 17: -5.5}),
                                dict(presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.1,
                                     logit_bias={0: 2.0})])
def test_adjuster_equals_the_definitions(kw):
    g = torch.Generator().manual_seed(len(str(kw)))
    v = 97
    opts = SamplingOptions(**kw)
    assert opts.adjusts_logits()
    prompt = torch.randint(0, v, (40,), generator=g).tolist()
    out = torch.randint(0, v, (25,), generator=g).tolist()  # repeats: counts above 1
    adj = LogitAdjuster(opts, prompt, out[:10])  # built mid-request: the outputs so far count
    for tok in out[10:]:
        adj.update(tok)
    logits = torch.randn(v, generator=g) * 4
    got = adj.apply(logits)
    assert torch.allclose(got, reference(logits, opts, prompt, out), atol=1e-5)
    assert not torch.equal(got, logits.float())  # something moved
    padded = torch.cat([logits, torch.randn(7, generator=g)])  # a head padded past the vocabulary
    assert torch.allclose(adj.apply(padded)[:v], got, atol=1e-6)


def test_no_adjustment_by_default():
    assert not SamplingOptions().adjusts_logits() and not SamplingOptions(temperature=0.3).adjusts_logits()


def test_min_p_keeps_tokens_near_the_most_likely():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(200, generator=g) * 3
    p = torch.softmax(logits, -1)
    allowed = set((p >= 0.2 * p.max()).nonzero()[:, 0].tolist())
    assert 1 < len(allowed) < 200
    picks = {sample(logits, SamplingParams(temperature=1.0, min_p=0.2), g)[0] for _ in range(300)}
    assert picks <= allowed and len(picks) > 1
    # min_p = 1: only the most likely token is left, whatever the temperature
    assert {sample(logits, SamplingParams(temperature=1.5, min_p=1.0), g)[0] for _ in range(20)} == \
        {int(logits.argmax())}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_sample_reports_the_models_logprobs_when_the_pick_is_adjusted():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(50, generator=g)
    adjusted = logits.clone()
    adjusted[7] += 100
    tok, lp, tops = sample(logits, SamplingParams(temperature=0), None, top_n=3, adjusted=adjusted)
    assert tok == 7
    ref = torch.log_softmax(logits, -1)
    assert abs(lp - float(ref[7])) < 1e-6 and tops[0][0] == int(ref.argmax())


# ----------------------------------------------------------------------------- the serving loop


@pytest.fixture(scope="module")
def ftw(tmp_path_factory):
    d = tmp_path_factory.mktemp("penalties")
    hf_models.save(hf_models.qwen3_5(43, num_hidden_layers=2, max_position_embeddings=512), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def eng(ftw, request):
    """The CPU engine, and on CUDA the GPU one: decode graphs per batch size and the deferred
    step, whose device-side greedy pick must leave adjusted requests to the host."""
    return Engine(ftw, EngineConfig(device=request.param, dtype="float32", prefill_chunk=32))


def test_served_picks_are_the_argmax_of_the_adjusted_logits(eng):
    """Greedy requests with penalties and a bias, batched with a plain greedy one (picked on the
    device path) and a sampled one: each pick is the argmax of its recorded logits adjusted by
    the outputs before it, and the plain request is what it is alone."""
    g = torch.Generator().manual_seed(11)
    p = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=g).tolist() for n in (21, 9, 14, 30)]
    kws = [dict(presence_penalty=2.0, frequency_penalty=1.0), dict(repetition_penalty=1.5),
           dict(logit_bias={5: -100.0, 6: 3.0}, presence_penalty=0.5), {}]
    reqs = [Request(list(q), SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True, **kw))
            for q, kw in zip(p, kws)]
    alone = drive(ServingEngine(eng, max_batch=1, max_queue=2, start=False),
                  [Request(list(p[3]), SamplingOptions(temperature=0, max_tokens=12, ignore_eos=True))])[0]
    srv = ServingEngine(eng, max_batch=4, max_queue=4, record_logits=True, start=False)
    drive(srv, reqs, arrive=[0, 1, 1, 2])
    for r in reqs:
        assert len(r.output_ids) == 12 and len(r.logits) == 12
        for i, (tok, lg) in enumerate(zip(r.output_ids, r.logits)):
            want = reference(lg, r.sampling, r.prompt_ids, r.output_ids[:i])
            assert tok == int(want.argmax()), (r.sampling, i)
            assert abs(r.logprobs[i] - float(torch.log_softmax(lg.float(), -1)[tok])) < 1e-5  # the model's
    assert reqs[3].output_ids == alone.output_ids
    assert 5 not in reqs[2].output_ids


def test_a_bias_forces_its_token_until_the_frequency_penalty_outweighs_it(eng):
    def run(**kw):
        r = Request([7, 8, 9], SamplingOptions(**{"temperature": 0, "max_tokens": 12, "ignore_eos": True, **kw}))
        return drive(ServingEngine(eng, max_batch=1, max_queue=2, start=False), [r])[0].output_ids
    assert run(logit_bias={42: 100.0}, temperature=0.8, seed=1) == [42] * 12  # sampled, too
    assert run(logit_bias={42: 20.0}) == [42] * 12
    got = run(logit_bias={42: 20.0}, frequency_penalty=2.0)  # 42 loses 2 a use: others come in
    assert 2 <= got.count(42) < 12 and got[0] == 42


def test_generate_flags_reach_the_pick(ftw, eng, capsys):
    """ft generate's --frequency-penalty / --presence-penalty / --repetition-penalty / --min-p:
    the tokens Engine.generate gives with the same adjustments, which differ from plain greedy."""
    from freetoken.cli import main
    pen = dict(presence_penalty=0.5, frequency_penalty=2.0, repetition_penalty=1.2)
    args = ["generate", ftw, "--prompt-ids", "7,8,9", "--max-tokens", "10", "--ignore-eos", "--json",
            "--cpu-threads", "1", "--temperature", "0.9", "--seed", "4", "--min-p", "0.05"]
    assert main(args + ["--presence-penalty", "0.5", "--frequency-penalty", "2", "--repetition-penalty", "1.2"]) == 0
    got = json.loads(capsys.readouterr().out)["token_ids"]
    want = eng.generate([7, 8, 9], 10, SamplingParams(0.9, seed=4, min_p=0.05), stop_at_eos=False, penalties=pen)
    assert got == want.token_ids
    biased = eng.generate([7, 8, 9], 10, SamplingParams(0.0), stop_at_eos=False,
                          penalties=dict(logit_bias={42: 20.0}, frequency_penalty=2.0))
    assert biased.token_ids[0] == 42 and biased.token_ids != [42] * 10


def test_min_tokens_holds_back_the_stop_ids(eng):
    """A +100 bias on a stop id: without min_tokens the output is that id, ended at once; with
    min_tokens = 3 it is masked for three tokens and ends the output at the fourth."""
    def run(**kw):
        r = Request([7, 8, 9], SamplingOptions(temperature=0, max_tokens=10, logit_bias={42: 100.0},
                                               stop_token_ids=[42], **kw))
        return drive(ServingEngine(eng, max_batch=1, max_queue=2, start=False), [r])[0]
    r = run()
    assert r.output_ids == [42] and r.finish_reason == "stop"
    r = run(min_tokens=3)
    assert len(r.output_ids) == 4 and 42 not in r.output_ids[:3] and r.output_ids[3] == 42
    assert r.finish_reason == "stop"
    eos = sorted(eng.eos_ids)[0]
    r = drive(ServingEngine(eng, max_batch=1, max_queue=2, start=False),
              [Request([7, 8, 9], SamplingOptions(temperature=0, max_tokens=10, logit_bias={eos: 100.0},
                                                  min_tokens=2))])[0]
    assert len(r.output_ids) == 3 and eos not in r.output_ids[:2] and r.output_ids[2] == eos


def test_a_stop_id_inside_a_forced_opening_does_not_end_it(eng):
    """Forced tokens (a tool call's opening) are emitted whole even where one of them is a stop
    id; a stop id the model then picks ends the output."""
    r = Request([7, 8, 9], SamplingOptions(temperature=0, max_tokens=8, forced=[42, 43, 44], stop_token_ids=[42, 50],
                                           logit_bias={50: 100.0}))
    drive(ServingEngine(eng, max_batch=1, max_queue=2, start=False), [r])
    assert r.output_ids == [42, 43, 44, 50] and r.finish_reason == "stop"
