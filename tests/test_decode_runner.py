"""The serving decode step in graph mode (every slot, static input buffers, attend length
rounded up to a bucket) gives the logits of the plain step. On the CPU graph mode runs the
same static step eagerly (capture itself needs CUDA: the GPU machine's suite runs it)."""
import torch

import hf_models
from freetoken.runtime.decode_runner import DecodeRunner, length_bucket
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


def test_length_bucket():
    prev = 0
    for n in list(range(1, 5000, 37)) + [8191, 8192, 8193, 100_000, 262_143]:
        b = length_bucket(n, 1 << 20)
        assert n <= b <= max(n + 511, int(n * 1.13))
        assert b >= prev  # monotone: a growing context walks through few buckets
        prev = b
    assert length_bucket(1000, 700) == 700  # never past the state's length
    assert len({length_bucket(n, 1 << 20) for n in range(1, 262_144)}) < 64


def run_all(srv, prompts, arrive):
    """Requests joining at different steps, so some slots are idle or mid-prefill while
    others decode."""
    reqs = [Request(p, SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
    step = 0
    while any(r.finished_at is None for r in reqs):
        for r, at in zip(reqs, arrive):
            if at == step:
                srv.sched.add(r)
        srv.step()
        step += 1
    return reqs


def test_static_bucketed_step_matches_plain(tmp_path):
    hf_models.save(hf_models.qwen3_5(17, num_hidden_layers=4, max_position_embeddings=2048), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=32))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (40, 7, 90)]
    arrive = [0, 2, 3]
    plain = ServingEngine(eng, max_batch=3, max_queue=4, record_logits=True, start=False)
    static = ServingEngine(eng, max_batch=3, max_queue=4, record_logits=True, start=False)
    static.decode = DecodeRunner(eng.model, static.state, graphs=True)
    assert static.decode.static and not static.decode.graphs  # no capture on the CPU
    for a, b in zip(run_all(plain, prompts, arrive), run_all(static, prompts, arrive)):
        assert a.output_ids == b.output_ids
        for x, y in zip(a.logits, b.logits):
            assert float((x - y).abs().max()) <= 1e-5 * float(x.abs().max())
