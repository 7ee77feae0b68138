"""FP8 dense GEMMs on the published bytes (issue 12): the Triton kernels of kernels/fp8_linear.py
against fp8_linear_reference (quant.py's dequantization, F.linear in fp32) on fresh random
weights with every finite e4m3 code, fp32 / bf16 / ue8m0 block scales, fp32 and bf16
activations, N and K that are not multiples of 128 and the x rows of decode (1, 3) and prefill
(20, 300); the weight object (weights/dense_fp8.py) and its checks; linear() (model/linear.py)
equal to F.linear on plain tensors; FusedLinear with FP8 parts; and models loaded with their
dense FP8 weights kept equal to the same models dequantized at load (fp32, 1e-4 relative): a
Qwen3.6-FP8-style checkpoint (BF16 scales) and DeepSeek-V4-Flash's (ue8m0 scales) through the
engine, and every architecture with every 2-D weight FP8 (what DENSE_DEQUANT keeps dequantized
included). On a CPU machine the kernels run under TRITON_INTERPRET=1 (conftest.py); the CUDA
tests at the end run on a GPU machine.
"""
import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import hf_models  # noqa: E402
import quant_models  # noqa: E402
from freetoken.config import ModelConfig  # noqa: E402
from freetoken.experts.banks import ExpertBanks  # noqa: E402
from freetoken.experts.executor import Activation, TorchExpertExecutor, expert_bias_banks  # noqa: E402
from freetoken.kernels.fp8_linear import fp8_linear_reference, fp8_linear_triton  # noqa: E402
from freetoken.model.layers import FusedLinear  # noqa: E402
from freetoken.model.linear import linear  # noqa: E402
from freetoken.model.registry import model_class  # noqa: E402
from freetoken.model.state import DecodeState  # noqa: E402
from freetoken.runtime.engine import Engine, EngineConfig  # noqa: E402
from freetoken.weights.convert import convert  # noqa: E402
from freetoken.weights.dense_fp8 import Fp8BlockWeight  # noqa: E402
from freetoken.weights.hf import e8m0_f32  # noqa: E402
from freetoken.weights.quant import dequant_fp8_block  # noqa: E402
from freetoken.weights.reader import dense_weights, load_ftw  # noqa: E402
from test_reference import engine_greedy, prompt_for, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 outputs: one rounding each side; the CPU interpreter rounds to bf16 by truncation
BF16_TOL = 2e-2 if DEV == "cpu" else 1e-2
SCALES = ("f32", "bf16", "ue8m0")


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def random_fp8(n, k, scale: str, g, device=DEV):
    """e4m3 values [n, k] over every finite code (+-448, subnormals, +-0; no NaN) and block scales
    [ceil(n/128), ceil(k/128)] in the given kind: f32 / bf16 around 1e-3 (one block 0 where there
    are several), ue8m0 bytes of 2^-17 .. 2^2."""
    v = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    v[(v & 0x7F) == 0x7F] = 0x7E  # the NaN codes -> +-448
    shape = (-(-n // 128), -(-k // 128))
    if scale == "ue8m0":
        s = torch.randint(110, 130, shape, generator=g, dtype=torch.uint8)
    else:
        s = torch.rand(shape, generator=g) * 2e-3 + 2e-4
        if s.numel() > 1:
            s.view(-1)[-1] = 0.0
        s = s.to(torch.bfloat16 if scale == "bf16" else torch.float32)
    return v.view(torch.float8_e4m3fn).to(device), s.to(device)


# (M, N, K): decode GEMV with one and with three x rows, prefill tiles of 20 and 300 rows; partial
# 128-blocks along N and K except in the aligned (20, 256, 384)
SHAPES = [(1, 200, 300), (3, 136, 260), (300, 130, 129), (20, 256, 384)]


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_reference(m, n, k, scale, act):
    g = torch.Generator().manual_seed(m * 7 + n + k + SCALES.index(scale))
    v, s = random_fp8(n, k, scale, g)
    x = torch.randn(m, k, generator=g).to(DEV, act)
    bias = torch.randn(n, generator=g).to(DEV, act) if (m + SCALES.index(scale)) % 2 else None
    s_f = e8m0_f32(s) if scale == "ue8m0" else s  # the kernel takes float scales (made so at load)
    got = fp8_linear_triton(x, v, s_f, bias)
    ref = fp8_linear_reference(x, v, s, bias)
    assert got.dtype == act and got.shape == (m, n)
    assert rel(got, ref) < (1e-5 if act == torch.float32 else BF16_TOL)


def test_kernel_leading_dims_empty_and_bad_scales():
    g = torch.Generator().manual_seed(3)
    v, s = random_fp8(140, 150, "f32", g)
    x = torch.randn(2, 2, 150, generator=g).to(DEV)
    assert rel(fp8_linear_triton(x, v, s), fp8_linear_reference(x, v, s)) < 1e-5
    assert fp8_linear_triton(x[:0, 0], v, s).shape == (0, 140)
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_linear_triton(x, v, s[:1])
    with pytest.raises(ValueError, match="features"):
        fp8_linear_triton(x[..., :149], v, s)


@pytest.mark.parametrize("scale", SCALES)
def test_weight_dequantizes_as_quant_py(scale):
    g = torch.Generator().manual_seed(11)
    v, s = random_fp8(300, 260, scale, g, "cpu")
    w = Fp8BlockWeight(v, s, torch.bfloat16, "q_proj.weight")
    want = dequant_fp8_block(v, e8m0_f32(s) if scale == "ue8m0" else s)
    assert w.scale_inv.is_floating_point() and w.shape == (300, 260) and w.dtype == torch.bfloat16
    assert torch.equal(w.dequantize(torch.float32), want)
    assert torch.equal(w.dequantize(), want.to(torch.bfloat16))  # what dense_weights gives at load
    part = w.rows(256, 44)  # a view of the last block row
    assert part.values.data_ptr() == v[256:].data_ptr() and torch.equal(part.dequantize(torch.float32), want[256:])


def test_weight_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(12)
    v, s = random_fp8(300, 260, "f32", g, "cpu")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.weight.*scale_inv.*\[3, 3\]"):
        Fp8BlockWeight(v, s[:2], torch.float32, "model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="k_proj.*float8_e4m3fn"):
        Fp8BlockWeight(v.view(torch.uint8), s, torch.float32, "k_proj.weight")
    with pytest.raises(ValueError, match="start on a 128-row block"):
        Fp8BlockWeight(v, s, torch.float32).rows(100, 10)
    a = Fp8BlockWeight(*random_fp8(100, 260, "f32", g, "cpu"), torch.float32, "a")
    with pytest.raises(ValueError, match="cannot follow"):
        Fp8BlockWeight.cat([a, Fp8BlockWeight(v, s, torch.float32, "b")])  # a's rows end mid-block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_plain_tensors_is_f_linear(dtype):
    """Past a decode step's rows (model/linear.py HOST_ROWS: the C++ rows kernel below them on the
    CPU, tests/test_cpu_decode_kernels.py), plain tensors go to F.linear as they are."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 7, 48, generator=g).to(dtype)
    w, b = torch.randn(40, 48, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    assert torch.equal(linear(x, w), F.linear(x, w)) and torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_fp8_on_the_cpu_is_the_reference(dtype):
    g = torch.Generator().manual_seed(14)
    v, s = random_fp8(200, 140, "bf16", g, "cpu")
    x, b = torch.randn(40, 140, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    w = Fp8BlockWeight(v, s, dtype)
    # past a decode step's rows: the weight dequantized per call, torch's GEMM (the reference's own)
    assert torch.equal(linear(x, w, b), fp8_linear_reference(x, v, s, b))
    # a decode step's rows: the C++ kernel where built (tests/test_cpu_dense_fp8.py), to a sum's order
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(linear(x[:3], w, b).float(), fp8_linear_reference(x[:3], v, s, b).float(), **tol)


def test_fused_linear():
    """All plain: one GEMM, the concatenated weight and bias, as it always was. Mixed: the plain
    weights one GEMM, FP8 ones joined while the rows before end on a block; the outputs in the
    order given, each equal to its own linear(); part(i) the views of projection i."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(6, 150, generator=g)
    plain = [torch.randn(r, 150, generator=g) for r in (8, 1, 30)]
    bias = [torch.randn(8, generator=g), None, torch.randn(30, generator=g)]
    fl = FusedLinear(plain, bias)
    zero = torch.zeros(1)
    # one linear() of the joined weight and bias (on the CPU at 6 rows: the C++ rows kernel)
    want = linear(x, torch.cat(plain), torch.cat([bias[0], zero, bias[2]])).split([8, 1, 30], dim=-1)
    assert len(fl.groups) == 1 and all(torch.equal(a, b) for a, b in zip(fl(x), want))
    ref = F.linear(x, torch.cat(plain), torch.cat([bias[0], zero, bias[2]])).split([8, 1, 30], dim=-1)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(fl(x), ref))

    fp8 = [Fp8BlockWeight(*random_fp8(r, 150, "f32", g, "cpu"), torch.float32, f"w{r}") for r in (128, 40, 50)]
    ws = [plain[0], fp8[0], fp8[1], plain[1], fp8[2]]  # joins: [p0, p1], [128 + 40], [50]
    bs = [bias[0], None, torch.randn(40, generator=g), None, None]
    fl = FusedLinear(ws, bs)
    assert [idx for _, _, idx, _ in fl.groups] == [[0, 3], [1, 2], [4]]
    assert isinstance(fl.groups[1][0], Fp8BlockWeight) and fl.groups[1][0].shape == (168, 150)
    assert fl.groups[2][1] is None  # no bias for a group without one
    for i, (y, w, b) in enumerate(zip(fl(x), ws, bs)):
        assert rel(y, linear(x, w, b)) < 1e-6, i
        pw, pb = fl.part(i)
        assert rel(linear(x, pw, pb), linear(x, w, b)) < 1e-6, i


# ------------------------------------------------------------------ models, through the engine

QWEN = dict(hidden_size=256, moe_intermediate_size=160, head_dim=48, shared_expert_intermediate_size=192)


@pytest.fixture(scope="module")
def qwen_fp8(tmp_path_factory):
    """Qwen3.6-FP8's layout (every dense Linear FP8 but routers, in_proj_a/b and lm_head; BF16
    scales): q_proj's 384 rows end on a block (joined with k_proj), k_proj's 96 do not."""
    d = tmp_path_factory.mktemp("qwen-fp8")
    model = hf_models.qwen3_5(41, **QWEN)
    quant_models.write(model, str(d / "hf"), "fp8_block", "all", scale_dtype=torch.bfloat16)
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return str(d / "m.ftw")


def kept_weights(eng) -> list:
    found = []
    for mixer, mlp, _, _ in eng.model.layers:
        for part in (mixer, mlp):
            for v in vars(part).values():
                ws = [w for w, _, _, _ in v.groups] if isinstance(v, FusedLinear) else [v]
                found += [w for w in ws if isinstance(w, Fp8BlockWeight)]
    return found


def kept_vs_dequantized(path: str, prompt, steps: int, **kw):
    """(kept engine, dequantized engine, their prefill logits and decode logits)."""
    out = []
    for mode in ("keep", "dequant"):
        eng = Engine(path, EngineConfig(device="cpu", dtype="float32", dense_fp8=mode, **kw))
        out.append((eng, *engine_greedy(eng, prompt, steps)))
    return out


def test_qwen_fp8_dense_kept_equals_dequantized(qwen_fp8):
    (ek, pk, tk, sk), (ed, pd, td, sd) = kept_vs_dequantized(qwen_fp8, prompt_for(4), 4)
    assert ek.describe()["dense_fp8"] == "kept" and ed.describe()["dense_fp8"] == "dequantized"
    kept = kept_weights(ek)
    assert kept and not kept_weights(ed)
    assert any(w.shape[0] == 384 + 96 for w in kept)  # q_proj (384 rows) joined with k_proj in one GEMM
    mixer0 = ek.model.layers[0][0]  # a DeltaNet layer: in_proj_qkv / in_proj_z are FP8 in the release
    assert type(mixer0).__name__ == "GatedDeltaNet" and any(
        isinstance(w, Fp8BlockWeight) for v in vars(mixer0).values() if isinstance(v, FusedLinear)
        for w, _, _, _ in v.groups)
    assert not isinstance(ek.model.lm_head, Fp8BlockWeight)
    assert ek.weight_bytes < ed.weight_bytes
    assert rel_err(pk, pd) < 1e-4 and rel_err(sk, sd) < 1e-4 and tk == td
    cpu_default = Engine(qwen_fp8, EngineConfig(device="cpu", dtype="float32"))
    # auto: kept on the CPU too, where the C++ rows kernel reads the FP8 bytes (tests/test_cpu_dense_fp8.py)
    import freetoken.experts.cpu as cpu_mod
    assert cpu_default.describe()["dense_fp8"] == ("kept" if cpu_mod.extension() is not None else "dequantized")
    with mock.patch.object(cpu_mod, "DECODE_KERNELS", False):  # FREETOKEN_CPU_KERNELS=0: dequantized at load
        assert Engine(qwen_fp8, EngineConfig(device="cpu", dtype="float32")).describe()["dense_fp8"] == "dequantized"


def test_deepseek_v4_flash_ue8m0_kept_equals_dequantized(tmp_path):
    """DeepSeek-V4-Flash's FP8 attention and shared-expert weights with ue8m0 scales."""
    q, _ = quant_models.write_deepseek_v4(hf_models.deepseek_v4(0), str(tmp_path), "flash")
    convert(q, str(tmp_path / "m.ftw"), progress=False)
    with mock.patch("freetoken.experts.cpu.extension", lambda: None):
        (ek, pk, tk, sk), (ed, pd, td, sd) = kept_vs_dequantized(str(tmp_path / "m.ftw"), prompt_for(5, n=20), 3)
    assert ek.describe()["dense_fp8"] == "kept" and kept_weights(ek)
    assert all(w.scale_inv.dtype == torch.float32 for w in kept_weights(ek))  # ue8m0 made fp32 at load
    assert rel_err(pk, pd) < 1e-4 and rel_err(sk, sd) < 1e-4 and tk == td


def test_qwen_fp8_through_the_interpreted_kernel(qwen_fp8, monkeypatch):
    """The model's GEMMs on the Triton kernels (here under the interpreter, as CUDA would run
    them): logits within 1e-4 of the dequantized load, the same greedy ids."""
    import freetoken.model.linear as lin
    prompt = prompt_for(7, n=9)
    ref = engine_greedy(Engine(qwen_fp8, EngineConfig(device="cpu", dtype="float32", dense_fp8="dequant")), prompt, 2)
    calls = []
    monkeypatch.setattr(lin, "use_triton", lambda x: calls.append(x.shape[0]) or True)
    got = engine_greedy(Engine(qwen_fp8, EngineConfig(device="cpu", dtype="float32", dense_fp8="keep")), prompt, 2)
    assert 1 in calls and 9 in calls  # decode (the GEMV kernel) and prefill (tiles)
    assert rel_err(got[0], ref[0]) < 1e-4 and rel_err(got[2], ref[2]) < 1e-4 and got[1] == ref[1]


# ------------------------------------------- every architecture, every 2-D weight FP8 (synthetic)

def all_fp8(meta: dict, w: dict):
    """The FTW's meta and tensors as if the checkpoint had published every 2-D floating `.weight`
    outside the experts (embeddings, lm_head, routers, kv_b_proj, o_a_proj included) in FP8."""
    meta, w, qd = copy.deepcopy(meta), dict(w), {}
    for name, t in list(w.items()):
        if name.startswith(("file/", "experts.")) or t.dim() != 2 or not t.is_floating_point() \
                or not name.endswith(".weight"):
            continue
        w[name], w[name + "_scale_inv"] = quant_models.quant_fp8_block(t.float())
        qd[name] = {"format": "fp8_block", "values": name, "scale": name + "_scale_inv", "shape": list(t.shape)}
    meta["quant"] = {"format": "fp8_block", "dense": qd}
    return meta, w


BUILDERS = {
    "qwen3_moe-dense-mlp-bias": lambda: hf_models.qwen3_moe(1, mlp_only_layers=[1], attention_bias=True),
    "qwen3_5": lambda: hf_models.qwen3_5(2),
    "gpt_oss": lambda: hf_models.gpt_oss(3),
    "glm_moe_dsa": lambda: hf_models.glm_moe_dsa(4),
    "deepseek_v4": lambda: hf_models.deepseek_v4(5),
}


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_every_architecture_with_every_weight_fp8(arch, tmp_path):
    """The model files take a kept FP8 weight wherever a Linear weight goes (linear(), FusedLinear),
    and their DENSE_DEQUANT names come dequantized: logits equal to the all-dequantized load."""
    hf_models.save(BUILDERS[arch](), str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    meta, w = all_fp8(*load_ftw(str(tmp_path / "m.ftw")))
    cfg = ModelConfig.from_hf(meta["config"])
    cls = model_class(cfg.arch)
    banks = ExpertBanks.from_ftw(meta, w)
    gub, db = expert_bias_banks(meta, w)
    ex = TorchExpertExecutor(banks.gate_up, banks.down, layer_experts=cfg.num_experts, activation=Activation.of(cfg),
                             gate_up_bias=gub, down_bias=db)
    cpu, prompt, logits = torch.device("cpu"), prompt_for(6, n=21), []
    for keep in (True, False):
        dense = dense_weights(meta, w, cpu, torch.float32, getattr(cls, "KEEP_FP32", ()), keep, cls.DENSE_DEQUANT)
        kept = {k for k, v in dense.items() if isinstance(v, Fp8BlockWeight)}
        assert bool(kept) == keep and not any(set(cls.DENSE_DEQUANT) & set(k.split(".")) for k in kept)
        m = cls(cfg, dense, ex, cpu, torch.float32, 128)
        st = DecodeState(cfg, 1, 64, cpu, torch.float32, page_size=4)
        st.reserve(0, 64)
        pre = m.prefill(torch.tensor(prompt), st, 0, 0, all_logits=True)  # [P, V]
        tok = torch.tensor([int(pre[-1].argmax())])
        logits.append((pre, m.decode(tok, st, torch.tensor([len(prompt)]))))
    (pk, dk), (pd, dd) = logits
    assert rel_err(pk, pd) < 1e-4 and rel_err(dk, dd) < 1e-4


# ------------------------------------------------------------------ CUDA (the GPU machine)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_cuda_kernel_at_serving_shapes(act):
    """Native Triton on the GPU at a Qwen3.6-like shape and a ragged one, every x-row count the
    engine produces (decode batches 1-64, prefill chunks), with a bias: within 1e-5 (fp32) / 1e-2
    (bf16) of the reference; and the same under CUDA-graph replay."""
    g = torch.Generator().manual_seed(21)
    for n, k in ((4096, 2048), (1000, 700)):
        v, s = random_fp8(n, k, "bf16", g, "cuda")
        b = torch.randn(n, generator=g).to("cuda", act)
        for m in (1, 2, 4, 5, 8, 17, 64, 333, 2048):
            x = torch.randn(m, k, generator=g).to("cuda", act)
            assert rel(fp8_linear_triton(x, v, s, b), fp8_linear_reference(x, v, s, b)) < (
                1e-5 if act == torch.float32 else 1e-2), (n, k, m)
    x = torch.randn(4, k, generator=g).to("cuda", act)
    fp8_linear_triton(x, v, s, b)  # compiled and tuned outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear_triton(x, v, s, b)
    x.copy_(torch.randn(4, k, generator=g).to("cuda", act))
    graph.replay()
    assert rel(y, fp8_linear_reference(x, v, s, b)) < (1e-5 if act == torch.float32 else 1e-2)


def served(path: str, prompts, **kw):
    """The model served on CUDA (experts resident, continuous batching, decode steps replayed from
    CUDA graphs): (describe(), weight bytes, [(logits [steps, V], ids) per request])."""
    from drive import drive
    from freetoken.cache.config import CacheConfig
    from freetoken.runtime.request import Request, SamplingOptions
    from freetoken.runtime.serving import ServingEngine
    eng = Engine(path, EngineConfig(device="cuda", moe="resident", prefill_chunk=16, **kw))
    srv = ServingEngine(eng, max_batch=2, max_queue=4, record_logits=True, start=False, cache=CacheConfig(enabled=False))
    reqs = [Request(p, SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True)) for p in prompts]
    drive(srv, reqs, arrive=[0, 2])
    out = ({**eng.describe(), **srv.describe()}, eng.weight_bytes, [(torch.stack(r.logits), r.output_ids) for r in reqs])
    srv.shutdown()
    del srv, eng
    torch.cuda.empty_cache()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_dense_fp8_kept_equals_dequantized(qwen_fp8):
    """On the GPU the dense FP8 is kept by default. Served (decode graphs, two requests in one
    batch): fp32 logits of every step within 1e-4 of the dequantized load and the same greedy ids,
    in less VRAM; bf16 prefill logits (eager) within 2e-2."""
    prompts = [prompt_for(4), prompt_for(8, n=30)]
    (dk, bk, rk), (dd, bd, rd) = (served(qwen_fp8, prompts, dtype="float32", dense_fp8=m) for m in ("auto", "dequant"))
    assert (dk["dense_fp8"], dd["dense_fp8"]) == ("kept", "dequantized") and bk < bd
    assert dk["decode_path"] == "cuda-graphs"
    for (lk, ik), (ld, id_) in zip(rk, rd):
        assert ik == id_ and rel_err(lk, ld) < 1e-4
    pre = []
    for mode in ("auto", "dequant"):
        eng = Engine(qwen_fp8, EngineConfig(device="cuda", dtype="bfloat16", moe="resident", dense_fp8=mode))
        pre.append(eng.prefill(prompts[1], eng.new_state(len(prompts[1])), all_logits=True))
    assert rel_err(*pre) < 2e-2
