"""The serving step over the paged pool: rows of different lengths joining and leaving a
batch (idle and mid-prefill rows masked, several prompts prefilled in one varlen forward)
give what each request gets alone. On CUDA the same step replays one graph per batch size
(tests/test_gpu_production.py checks replay against eager on the GPU machine)."""
import pytest
import torch

import hf_models
from drive import drive
from freetoken.runtime.decode_runner import batch_sizes
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


def test_batch_sizes():
    assert batch_sizes(1) == [1]
    assert batch_sizes(8) == [1, 2, 4, 8]
    assert batch_sizes(6) == [1, 2, 4, 6]


def run_all(srv, prompts, arrive, n=6):
    return drive(srv, [Request(p, SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True)) for p in prompts],
                 arrive)


@pytest.mark.parametrize("mixed", [False, True], ids=["interleaved", "mixed"])
def test_batched_steps_match_each_request_alone(tmp_path, mixed):
    """Requests served together (prompt chunks of several in one forward; decode rows between
    the prompt's layers, the CPU's default, or in the same forward, --decode-between-layers
    off) get what each gets alone."""
    from freetoken.runtime.interleave import Interleaver
    hf_models.save(hf_models.qwen3_5(17, num_hidden_layers=4, max_position_embeddings=2048), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32", prefill_chunk=32,
                                                       max_step_tokens=48))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, eng.cfg.vocab_size, (n,), generator=gen).tolist() for n in (40, 7, 90, 3)]
    arrive = [0, 2, 3, 3]
    batched = ServingEngine(eng, max_batch=3, max_queue=4, record_logits=True, start=False, page_size=8)
    assert batched.decode.path == "eager" and batched.mixed is False
    if mixed:
        batched.mixed, batched.between = True, Interleaver(0.0)
    segments, real, real_mixed = [], eng.prefill_batch, eng.forward_mixed
    eng.prefill_batch = lambda st, segs, **kw: segments.append(len(segs)) or real(st, segs, **kw)
    eng.forward_mixed = lambda st, *rows, segs=None: segments.append(len(rows[-1]) + 1) or real_mixed(st, *rows)
    try:
        together = run_all(batched, prompts, arrive)
    finally:
        del eng.prefill_batch, eng.forward_mixed
    assert max(segments) >= 2  # several prompts (or prompts and decode rows) shared a forward
    if not mixed:  # decode steps ran between a prompt forward's layers, or prompts jumped in there
        assert batched.between.steps or batched.jump_ins
    for p, got in zip(prompts, together):
        alone = run_all(ServingEngine(eng, max_batch=1, max_queue=1, record_logits=True, start=False), [p], [0])[0]
        assert got.output_ids == alone.output_ids
        for x, y in zip(got.logits, alone.logits):
            assert float((x - y).abs().max()) <= 1e-4 * float(y.abs().max())
    st = batched.state.pages
    assert st.used == 0 and st.high_water > 0  # every page came back; they were taken as tokens came
