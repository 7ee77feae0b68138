"""The configurations users run on a GPU, against transformers: bfloat16 with experts in VRAM,
the CPU-only MoE backend (`--experts cpu` on CUDA, bf16 and fp32), the serving decode step
replayed from CUDA graphs, and expert banks pinned in place. Runs on the GPU machine
(bench/device_suite.sh); skipped where there is no CUDA device."""
import copy

import pytest
import torch

import hf_models
from drive import drive
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert
from freetoken.weights.reader import load_ftw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 32


@pytest.fixture(scope="module")
def model_and_ftw(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu")
    model = hf_models.qwen3_5(21, num_hidden_layers=4, max_position_embeddings=1024)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return model, str(d / "m.ftw")


def rel(a, b):
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def teacher_forced(eng, prompt, toks):
    """Prefill logits [P, V] and the logits of each decode step fed the reference's tokens."""
    st = eng.new_state(len(prompt) + len(toks) + 1)
    pre = eng.prefill(prompt, st, all_logits=True)
    steps = []
    for i, tok in enumerate(toks):
        pos = len(prompt) + i
        steps.append(eng.model.decode(torch.tensor([tok], device=eng.device), st,
                                      torch.tensor([pos], device=eng.device))[0])
    return torch.cat([pre, torch.stack(steps)])


def prompt_for(seed, n=23):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype,experts", [("bfloat16", "gpu"), ("bfloat16", "cpu"), ("float32", "cpu")])
def test_production_configs_match_transformers(model_and_ftw, dtype, experts):
    model, ftw = model_and_ftw
    prompt = prompt_for(1)
    # the reference's fp32 greedy continuation, teacher-forced into every configuration
    seq = list(prompt)
    for _ in range(STEPS):
        seq.append(int(hf_models.reference_logits(model, seq)[-1].argmax()))
    toks = seq[len(prompt):]
    ref = hf_models.reference_logits(model, seq[:-1])  # [P + STEPS - 1, V]: after each prefix
    eng = Engine(ftw, EngineConfig(device="cuda", dtype=dtype, experts=experts))
    got = teacher_forced(eng, prompt, toks[:-1])
    assert got.shape == ref.shape
    if dtype == "float32":
        assert rel(got, ref) < 1e-4
        return
    ref_bf16 = hf_models.reference_logits(copy.deepcopy(model).to(torch.bfloat16), seq[:-1])
    # bf16 rounding is the reference's too: no further from fp32 than transformers in bf16
    assert rel(got, ref) <= 1.5 * rel(ref_bf16, ref) + 1e-2
    # greedy choices flip against fp32 where the top two logits nearly tie (a small random
    # model has many such positions); about as often as transformers' own bf16 flips
    flips = int((got.float().cpu().argmax(-1) != ref.argmax(-1)).sum())
    ref_flips = int((ref_bf16.argmax(-1) != ref.argmax(-1)).sum())
    assert flips <= max(2 * ref_flips, ref_flips + 3), (flips, ref_flips, len(ref))


def _serve(eng, graphs, prompts, arrive):
    eng.ecfg.cuda_graphs = graphs
    srv = ServingEngine(eng, max_batch=4, max_queue=8, record_logits=True, start=False)
    assert srv.decode.path == ("cuda-graphs" if graphs else "eager")
    # the same forwards in both: no merged prompt+decode steps, no timing-dependent prompt budget
    srv.mixed, srv.slowdown = False, 0.0
    srv.between.slowdown = 0.0  # nor decode steps between a prompt forward's layers (graphs only)
    reqs = [Request(p, SamplingOptions(temperature=0, max_tokens=STEPS, ignore_eos=True)) for p in prompts]
    return srv, drive(srv, reqs, arrive)


def test_decode_graphs_replay_equal_to_eager(model_and_ftw):
    """Rows of different lengths join and leave; every step after the first of each bucket is
    a replay, and its logits equal the eager step's."""
    _, ftw = model_and_ftw
    eng = Engine(ftw, EngineConfig(device="cuda", dtype="bfloat16", experts="gpu"))
    prompts = [prompt_for(s, n) for s, n in ((2, 30), (3, 7), (4, 90), (5, 13))]
    arrive = [0, 3, 5, 9]
    g_srv, graph = _serve(eng, True, prompts, arrive)
    _, eager = _serve(eng, False, prompts, arrive)
    assert sorted(b for _, b in g_srv.decode._captured) == [1, 2, 4]  # one graph per batch size
    for a, b in zip(graph, eager):
        assert a.output_ids == b.output_ids
        for x, y in zip(a.logits, b.logits):
            assert rel(x, y) < 1e-2


def test_banks_pinned_in_place(tmp_path, caplog):
    """FTW banks are registered for DMA where they lie (no copy): the registration succeeds and
    copies from them are exact."""
    from freetoken.weights.reader import pin_in_place
    hf_models.save(hf_models.qwen3_5(22, hidden_size=128, moe_intermediate_size=128), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    meta, w = load_ftw(str(tmp_path / "m.ftw"))
    bank = w[meta["banks"]["gate_up"]]
    assert bank.numel() * bank.element_size() >= 1 << 20  # large enough to be registered
    assert pin_in_place([bank]), caplog.text
    dev = bank.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), bank)
