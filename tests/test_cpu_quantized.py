"""The C++ CPU expert executor on quantized banks (fp8_block, mxfp4, nvfp4), read in place and
dequantized in the kernels, against the reference: ExpertBanks.dequant (quant.py's bit-exact
fp32 dequantization) and the torch reference experts on those float banks.

Every format (fp8 with each published scale dtype) x every ISA this CPU has (capped from
above: scalar, avx2, avx512, avx512-bf16) x batch 1..17 and 31 x fp32 / bf16 activations x 1
and 2 threads. fp32 activations: within 1e-5 relative (the weights are exact in fp32, only the
summation order differs); bf16 activations on the VDPBF16PS path (fp4 formats, avx512-bf16:
the weights exact in bf16, the activations and h rounded to bf16) within 2e-2, as the bf16
kernel's test; elsewhere bf16 activations are exact in fp32 and held to 1e-5 too. The
thread count never changes a bit. Shapes leave tails: columns past the last full 128 (or 64)
column chunk, partial 128-row fp8 blocks in each half of gate_up, 4-row blocks cut short.
"""
import pytest
import torch

from freetoken.errors import FreeTokenError
from freetoken.experts.banks import ExpertBanks, QuantBank
from freetoken.experts.cpu import ISA_NAMES, CpuExpertExecutor, extension
from freetoken.experts.executor import NO_EXPERT, reference_experts

N, K = 24, 4
BATCHES = list(range(1, 18)) + [31]
# (format, fp8 scale dtype) -> (hidden, intermediate)
CASES = {
    "fp8_block-f32": ("fp8_block", torch.float32, 202, 70),  # DeepSeek's scale dtype; rows 202 = 50 blocks of 4 + 2
    "fp8_block-bf16": ("fp8_block", torch.bfloat16, 328, 136),  # Qwen3.6-FP8's
    "fp8_block-f16": ("fp8_block", torch.float16, 160, 200),
    "mxfp4": ("mxfp4", None, 288, 96),  # 2 full 128-column chunks + 32; I: a 96-column tail chunk only
    "nvfp4": ("nvfp4", None, 272, 176),  # H: 2 chunks + 16; I: 128 + 48
}

pytestmark = pytest.mark.skipif(extension() is None, reason="the C++ executor could not be built")


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def fp8_values(shape, g):
    """Random e4m3 bytes over every code but NaN: +-448 (0x7e/0xfe), subnormals, +-0."""
    v = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    v[(v & 0x7F) == 0x7F] = 0x7E
    return v.view(torch.float8_e4m3fn)


def random_banks(fmt, scale_dtype, n, h, i, seed) -> ExpertBanks:
    """Random banks in every format's layout, with edge values: every e2m1 code (+-6, -0),
    e8m0 scales from 2^-127 (0) up, e4m3 scales 0, subnormal and 448, whole zero blocks."""
    g = torch.Generator().manual_seed(seed)

    def pick(t, p):
        return torch.rand(t.shape, generator=g) < p

    def bank(rows, cols, halves):
        if fmt == "fp8_block":
            v = fp8_values((n, rows, cols), g)
            per = -(-(rows // halves) // 128)
            s = torch.rand(n, halves * per, -(-cols // 128), generator=g) * 0.02 + 0.002
            s[pick(s, 0.05)] = 0.0  # zero blocks
            return QuantBank(fmt, v, s.to(scale_dtype), None, halves)
        v = torch.randint(0, 256, (n, rows, cols // 2), generator=g, dtype=torch.uint8)
        blk = 32 if fmt == "mxfp4" else 16
        zero = pick(torch.empty(n, rows, cols // blk), 0.03).repeat_interleave(blk // 2, -1)
        v[zero] = 0  # whole blocks of +0
        six = pick(torch.empty(n, rows, cols // blk), 0.03).repeat_interleave(blk // 2, -1)
        v[six] = 0xF7  # +6, -6 pairs
        if fmt == "mxfp4":
            s = torch.randint(118, 124, (n, rows, cols // 32), generator=g, dtype=torch.uint8)
            s[pick(s, 0.03)] = 0  # 2^-127 (subnormal scale)
            s[pick(s, 0.03)] = 1
            return QuantBank(fmt, v, s, None, halves)
        s = torch.randint(0x28, 0x50, (n, rows, cols // 16), generator=g, dtype=torch.uint8)
        s[pick(s, 0.02)] = 0x00  # zero scale
        s[pick(s, 0.02)] = 0x03  # subnormal e4m3
        s[pick(s, 0.01)] = 0x7E  # 448, the e4m3 maximum
        s[pick(s, 0.02)] |= 0x80  # negative scales (e4m3 has a sign; the kernels must keep it)
        s2 = torch.rand(n, halves, generator=g) * 0.02 + 1e-3  # gate's and up's differ
        return QuantBank(fmt, v, s.view(torch.float8_e4m3fn), s2, halves)

    return ExpertBanks(fmt, bank(2 * i, h, 2), bank(h, i, 1))


def inputs(t, h, seed, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    if t > 2:
        ids[1] = NO_EXPERT  # a row that is not running
        ids[t - 1, 0] = NO_EXPERT
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return x, ids, w


@pytest.fixture(scope="module")
def case_data():
    """Per case: the banks, their dequantized float banks, and the reference outputs (computed
    once, shared by every ISA)."""
    out = {}
    for name, (fmt, sdt, h, i) in CASES.items():
        b = random_banks(fmt, sdt, N, h, i, seed=len(out) + 1)
        gu, dn = b.dequant(torch.arange(N))
        assert torch.isfinite(gu).all() and torch.isfinite(dn).all()
        refs = {}
        for t in BATCHES:
            x, ids, w = inputs(t, h, seed=t)
            refs[t] = (x, ids, w, reference_experts(x, ids, w, gu, dn),
                       reference_experts(x.bfloat16().float(), ids, w, gu, dn))
        out[name] = (b, refs)
    return out


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=ISA_NAMES)
@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(case_data, name, isa):
    banks, refs = case_data[name]
    exs = [CpuExpertExecutor(banks, threads=n, isa_cap=isa) for n in (1, 2)]
    if exs[0].isa != ISA_NAMES[isa]:
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    assert exs[0].backend == "cpp" and exs[0].quantized and exs[1].threads == 2
    dp = isa == 3 and banks.format != "fp8_block"  # bf16 activations take VDPBF16PS
    for t in BATCHES:
        x, ids, w, ref, ref_b = refs[t]
        one, two = (ex.kernel(x, ids, w) for ex in exs)
        assert torch.equal(one, two), (t, "thread count changed the result")
        assert torch.isfinite(one).all()
        assert rel(one, ref) < 1e-5, (t, rel(one, ref))
        if t > 2:
            assert not one[1].any(), "a NO_EXPERT row gets nothing"
        one_b, two_b = (ex.kernel(x.bfloat16(), ids, w) for ex in exs)
        assert torch.equal(one_b, two_b), t
        assert rel(one_b, ref_b) < (2e-2 if dp else 1e-5), (t, rel(one_b, ref_b))


def extreme_mx_banks(n, h, i, gu_scales, dn_scales, dn_max_code=7, seed=0):
    g = torch.Generator().manual_seed(seed)

    def bank(rows, cols, halves, scales, max_code):
        codes = torch.randint(0, max_code + 1, (n, rows, cols), generator=g, dtype=torch.uint8)
        codes |= (torch.rand(n, rows, cols, generator=g) < 0.5).to(torch.uint8) << 3  # signs
        v = codes[..., 0::2] | (codes[..., 1::2] << 4)
        s = torch.tensor(scales, dtype=torch.uint8)[torch.randint(0, len(scales), (n, rows, cols // 32), generator=g)]
        return QuantBank("mxfp4", v, s, None, halves)

    return ExpertBanks("mxfp4", bank(2 * i, h, 2, gu_scales, 7), bank(h, i, 1, dn_scales, dn_max_code))


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=ISA_NAMES)
@pytest.mark.parametrize("case", ["large-then-subnormal", "small-then-254"])
def test_mxfp4_extreme_scales(case, isa):
    """e8m0 scales at both ends where they decide the result: gate_up at 2^33..2^43 then down at
    2^-127..2^-124 (subnormal weights); gate_up at 2^-67..2^-57 then down at 2^123..2^127 (254,
    the largest finite scale, with codes up to 1.5 so the weights stay finite)."""
    h, i = 160, 96
    if case == "large-then-subnormal":
        b = extreme_mx_banks(8, h, i, [160, 165, 170], [0, 1, 2, 3])
    else:
        b = extreme_mx_banks(8, h, i, [60, 65, 70], [250, 252, 254], dn_max_code=3)
    ex = CpuExpertExecutor(b, isa_cap=isa)
    if ex.isa != ISA_NAMES[isa]:
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    gu, dn = b.dequant(torch.arange(8))
    assert torch.isfinite(gu).all() and torch.isfinite(dn).all()
    for t in (1, 5):
        x, ids, w = inputs(t, h, seed=t, n=8, k=2)
        ref = reference_experts(x, ids, w, gu, dn)
        out = ex.kernel(x, ids, w)
        assert torch.isfinite(ref).all() and ref.abs().max() > 0
        assert rel(out, ref) < 1e-5, rel(out, ref)
        if isa == 3:
            ref_b = reference_experts(x.bfloat16().float(), ids, w, gu, dn)
            assert rel(ex.kernel(x.bfloat16(), ids, w), ref_b) < 2e-2


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_scale_extremes(sdt):
    """fp8 block scales far from 1 in every published dtype (f16: subnormal 2^-20 and 2^15;
    bf16 / f32: 2^-40 then 2^40), and all e4m3 codes, on every ISA."""
    h, i, n = 256, 128, 6
    g = torch.Generator().manual_seed(7)
    lo, hi = (2.0 ** -20, 2.0 ** 15) if sdt == torch.float16 else (2.0 ** -40, 2.0 ** 40)

    def bank(rows, cols, halves, s):
        per = -(-(rows // halves) // 128)
        scale = torch.full((n, halves * per, -(-cols // 128)), s) * (1 + torch.rand(n, halves * per, -(-cols // 128), generator=g))
        return QuantBank("fp8_block", fp8_values((n, rows, cols), g), scale.to(sdt), None, halves)

    b = ExpertBanks("fp8_block", bank(2 * i, h, 2, lo), bank(h, i, 1, hi))
    gu, dn = b.dequant(torch.arange(n))
    x, ids, w = inputs(3, h, seed=3, n=n, k=2)
    x = x * 1e3
    ref = reference_experts(x, ids, w, gu, dn)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    for isa in range(4):
        ex = CpuExpertExecutor(b, isa_cap=isa)
        assert rel(ex.kernel(x, ids, w), ref) < 1e-5, ex.isa


def test_executor_takes_banks_in_every_form_and_big_batches_go_to_torch():
    b = random_banks("nvfp4", None, 10, 64, 32, seed=11)
    x, ids, w = inputs(5, 64, seed=5, n=10)
    gu, dn = b.dequant(torch.arange(10))
    ref = reference_experts(x, ids, w, gu, dn)
    a = CpuExpertExecutor(b)
    p = CpuExpertExecutor(b.gate_up, b.down, torch_batch_threshold=4)
    assert a.format == p.format == "nvfp4" and a.isa in ISA_NAMES
    assert a.torch_batch_threshold == 4096  # prefill chunks too: the torch path dequantizes first
    assert torch.equal(a.kernel(x, ids, w), p.kernel(x, ids, w))
    assert rel(a(x, ids, w), ref) < 1e-5  # 5 tokens: the C++ kernel
    out = p(x.double(), ids, w)  # above the threshold: the torch reference, in x's dtype
    assert out.dtype == torch.float64 and rel(out, ref) < 1e-5
    # the bank tensors are used in place, never copied
    assert a._qargs[1].data_ptr() == b.gate_up.values.data_ptr()
    assert a._qargs[5].data_ptr() == b.down.scale.data_ptr()
    with pytest.raises(TypeError):
        CpuExpertExecutor(b.gate_up, gu)
    with pytest.raises(TypeError):
        CpuExpertExecutor(b, b.down)


def test_bad_expert_id_and_bad_bank_shapes_are_rejected():
    b = random_banks("mxfp4", None, 4, 64, 32, seed=12)
    ex = CpuExpertExecutor(b)
    with pytest.raises(RuntimeError, match="out of range"):
        ex.kernel(torch.randn(1, 64), torch.tensor([[4]]), torch.ones(1, 1))
    # a bank whose scales do not match its values is refused when it is made (at load)
    with pytest.raises(ValueError, match=r"scale must be \[4, 64, 1\].*ft convert") as err:
        QuantBank("mxfp4", b.down.values, b.down.scale[..., :0], None, 1)
    assert isinstance(err.value, FreeTokenError)  # the CLI's one line, no traceback
    with pytest.raises(ValueError, match="scale_2"):
        QuantBank("nvfp4", b.down.values, b.down.scale.repeat_interleave(2, -1), None, 1)
    with pytest.raises(ValueError, match=r"scale must be \[4, 1, 1\]"):  # fp8: one grid per 128 x 128
        QuantBank("fp8_block", torch.zeros(4, 64, 32, dtype=torch.uint8), torch.ones(4, 2, 1), None, 1)


@pytest.mark.skipif(extension() is None, reason="needs the C++ extension")
def test_the_kernel_checks_bank_shapes_itself():
    """forward_q's own check, behind QuantBank's: a raised error, not a crash (the GPU machine
    crashed in this call once, not reproduced here)."""
    b = random_banks("mxfp4", None, 4, 64, 32, seed=12)
    ex = CpuExpertExecutor(b)
    args = list(ex._qargs)
    args[5] = args[5][..., :0]  # the down bank's scale
    with pytest.raises(RuntimeError, match="scale"):
        extension().forward_q(ex.handle, torch.randn(1, 64), torch.tensor([[0]]), torch.ones(1, 1), *args,
                              False, **ex._fn)


PREFETCH_SCRIPT = r'''
import sys, torch
from bench.cpu_experts import quantized_banks
from freetoken.experts.cpu import CpuExpertExecutor
g = torch.Generator().manual_seed(5)
out = {}
for fmt in ("fp8_block", "mxfp4", "nvfp4"):
    ex = CpuExpertExecutor(quantized_banks(fmt, 12, 256, 128, g), threads=2)
    for t in (1, 4):
        x = torch.randn(t, 256, generator=g)
        ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 4, generator=g), -1)
        out[f"{fmt}-{t}"] = ex.kernel(x, ids, w)
        out[f"{fmt}-{t}-bf16act"] = ex.kernel(x.bfloat16(), ids, w)
torch.save(out, sys.argv[1])
'''


@pytest.mark.skipif(extension() is None, reason="needs the C++ extension")
def test_prefetch_settings_give_the_same_bits(tmp_path):
    """FREETOKEN_CPU_PREFETCH_HINT / _BYTES (read once when the library loads: fresh processes)
    move only where the look-ahead lines go, never a result bit: the default (t2: into L2)
    against L1 and other L2 hints at other distances and against no software prefetch, for the
    three formats."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    got = {}
    assert not os.environ.get("FREETOKEN_CPU_PREFETCH_HINT") and not os.environ.get("FREETOKEN_CPU_PREFETCH_BYTES")
    path = str(tmp_path / "default.pt")  # this process loaded the library with the defaults
    exec(compile(PREFETCH_SCRIPT.replace("sys.argv[1]", repr(path)), "prefetch_script", "exec"), {})
    base = torch.load(path)
    for hint, dist in (("t0", "4096"), ("t1", "16384"), ("off", "0")):
        path = str(tmp_path / f"{hint}.pt")
        env = dict(os.environ, FREETOKEN_CPU_PREFETCH_HINT=hint, FREETOKEN_CPU_PREFETCH_BYTES=dist, PYTHONPATH=root)
        subprocess.run([sys.executable, "-c", PREFETCH_SCRIPT, path], check=True, env=env, cwd=root, timeout=300)
        got[hint] = torch.load(path)
    assert len(base) == 12 and all(v.abs().max() > 0 for v in base.values())
    for name, res in got.items():
        assert res.keys() == base.keys()
        for k, v in base.items():
            assert torch.equal(res[k], v), (name, k)


@pytest.mark.parametrize("var,value", [("FREETOKEN_CPU_PREFETCH_HINT", "L2"), ("FREETOKEN_CPU_PREFETCH_BYTES", "-1"),
                                       ("FREETOKEN_CPU_PREFETCH_BYTES", "8k"), ("FREETOKEN_CPU_ROW_SCALES", "on"),
                                       ("FREETOKEN_CPU_ROW_SCALES", "4"), ("FREETOKEN_CPU_DECODE_ONCE", "-1"),
                                       ("FREETOKEN_CPU_ROW_SEQ", "yes"), ("FREETOKEN_CPU_ROW_RUNS", "2")])
def test_a_bad_prefetch_setting_is_named(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    b = random_banks("mxfp4", None, 4, 64, 32, seed=3)
    with pytest.raises(FreeTokenError, match=var):
        CpuExpertExecutor(b)


def every_code_bank(fmt, scale_dtype=None) -> QuantBank:
    """One expert of 8 rows whose values and scales run through every code of the format: every
    e4m3 byte but the NaNs as fp8 values; every e2m1 code under every e8m0 scale from 2^-127 (0)
    to 2^125 (252; past it 6 x the scale overflows fp32, and one inf weight makes every one-hot
    dot product of its row NaN: test_mxfp4_extreme_scales takes 254 with small codes); every e4m3
    byte but the NaNs as an nvfp4 block scale (subnormals, 448, negatives, both zeros). Widths
    leave tails as real shapes do (GPT-OSS's 2,880 columns are 22 chunks of 128 and 64): the
    kernels' partial chunks, the layout of a short last chunk and fp8's scalar remainder run."""
    r = 8
    if fmt == "fp8_block":
        c = 256 + 16 + 7  # two 128-column blocks, a 16-wide step, 7 columns of scalar remainder
        b = torch.tensor([x for x in range(256) if x & 0x7F != 0x7F] * 9, dtype=torch.uint8)[:r * c]
        s = torch.tensor([[[0.5, 3.0, 0.25]]]).to(scale_dtype)  # one 128-row block, three column blocks
        return QuantBank(fmt, b.view(1, r, c).view(torch.float8_e4m3fn), s, None, 1)
    scales = (torch.arange(253) if fmt == "mxfp4" else
              torch.tensor([x for x in range(256) if x & 0x7F != 0x7F]))
    blk = 32 if fmt == "mxfp4" else 16
    per_row = 33  # 264 blocks: every scale once (the last ones repeat); 1,056 / 528 columns, a tail chunk
    assert r * per_row >= scales.numel()
    s = scales.repeat(2)[:r * per_row].to(torch.uint8).view(1, r, per_row)
    col = torch.arange(per_row * blk)
    # row i holds code (c - i) mod 16 at column c: every code at every place of a lane over the rows
    codes = torch.stack([(col - i) % 16 for i in range(r)]).to(torch.uint8)  # [r, C]
    v = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(1, r, per_row * blk // 2)
    if fmt == "mxfp4":
        return QuantBank(fmt, v, s, None, 1)
    return QuantBank(fmt, v, s.view(torch.float8_e4m3fn), torch.tensor([[0.5]]), 1)


@pytest.mark.parametrize("isa", [0, 1, 2, 3], ids=ISA_NAMES)
@pytest.mark.parametrize("case", ["fp8_block-f32", "fp8_block-bf16", "fp8_block-f16", "mxfp4", "nvfp4"])
def test_kernels_dequantize_every_code_as_the_reference(case, isa):
    """The decode kernels read with one-hot activations, column by column, give each weight
    times its scales: bit for bit the reference dequantizer's (quant.py, which
    test_quant_formats.py holds to the formats' definitions), on every ISA this CPU has, with
    fp32 and bf16 activations. So the CPU's dequantization is the GPU kernels' (held to the same
    reference bit for bit there, test_quant_kernels.py)."""
    fmt, sdt = (case.split("-")[0], {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
                [case.split("-")[1]]) if "-" in case else (case, None)
    ext = extension()
    if CpuExpertExecutor(random_banks("mxfp4", None, 1, 64, 32, 0), threads=1, isa_cap=isa).isa != ISA_NAMES[isa]:
        pytest.skip(f"this CPU has no {ISA_NAMES[isa]}")
    bank = every_code_bank(fmt, sdt)
    want = bank.dequant(0)  # [R, C]
    v = bank.values.contiguous().view(torch.uint8)
    s = bank.scale.contiguous()
    s = s.view(torch.uint8) if s.element_size() == 1 else s
    s2 = bank.scale_2.float().contiguous() if bank.scale_2 is not None else torch.empty(0)
    eye = torch.eye(want.shape[1])  # [C, C]: column c of the weights in row c of the output
    for bf16_act in (False, True):
        got = ext.qdot_rows(CpuExpertExecutor.FORMAT_CODES[fmt], v, s, s2, eye, isa, bf16_act).T  # [R, C]
        assert torch.equal(got, want), (case, bf16_act, int((got != want).sum()))
    assert torch.isfinite(want).all() and (want != 0).any()


# H 240 = 128 + 112 and I 176 = 128 + 48: a 128-column block with 16 columns past its 32-column
# steps (the kernels' 16-wide step), which the other cases' sizes never reach
PAIR_CASES = {**CASES, "fp8_block-bf16-16": ("fp8_block", torch.bfloat16, 240, 176)}


# FP8 takes the decode-once kernel where both widths are multiples of 16 (every published shape):
# H 272 = 2 chunks of 128 + one 16-column group, I 144 = 128 + 16
ONCE_CASES = {"mxfp4": CASES["mxfp4"], "nvfp4": CASES["nvfp4"],
              **{f"fp8_block-{n}-272": ("fp8_block", d, 272, 144)
                 for n, d in (("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16))}}


def decode_once_outputs(ex, x, ids, w):
    """ex's outputs for one prompt chunk with the decode-once threshold at 2, at the middle of the
    three experts' token counts (one call mixing both paths) and past it, and off; and each
    token's output from a call of its own. ids: three experts, top-2, rows routed to fewer until
    the counts differ, odd and even (changed in place)."""
    def routed():  # tokens per expert, ascending
        return sorted(int(c) for c in torch.bincount(ids[ids >= 0], minlength=3))
    r = 2
    while not ({c % 2 for c in routed()} == {0, 1} and len(set(routed())) == 3):
        ids[r, 1] = NO_EXPERT
        r += 1
    counts = routed()
    outs = {}
    before = extension().set_decode_once(2)
    try:
        for m in (2, counts[1], counts[1] + 1, 0):
            extension().set_decode_once(m)
            outs[m] = ex.kernel(x, ids, w)
        alone = torch.cat([ex.kernel(x[r:r + 1], ids[r:r + 1], w[r:r + 1]) for r in range(x.shape[0])])
    finally:
        extension().set_decode_once(before)
    return outs, alone


@pytest.mark.parametrize("name", sorted(ONCE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_once_gives_the_per_token_bits(name, dtype):
    """A prompt chunk, float activations (a CPU engine's default dtype) and bf16 ones: an expert
    with at least set_decode_once's count of the call's tokens has each 4-row block decoded once for
    all of them (qdot4xn_fp4_avx512 / qdot4xn_fp4_bf16dp / qdot4xn_fp8_avx512, the FP8 scales in
    each published dtype), even and odd counts, column tails in both phases. Its outputs equal, bit
    for bit, the pair kernels' (decode once off) and what each token gets in a call of its own."""
    fmt, sdt, h, i = ONCE_CASES[name]
    banks = random_banks(fmt, sdt, 3, h, i, seed=23)
    ex = CpuExpertExecutor(banks, threads=2)
    need = "avx512-bf16" if dtype == torch.bfloat16 and fmt != "fp8_block" else "avx512"
    if ISA_NAMES.index(ex.isa) < ISA_NAMES.index(need):
        pytest.skip(f"the decode-once kernel needs {need}; this CPU's executor runs {ex.isa}")
    x, ids, w = inputs(41, h, seed=9, n=3, k=2)  # 3 experts: ~27 tokens each, one row routed nowhere
    xa = x.to(dtype)
    outs, alone = decode_once_outputs(ex, xa, ids, w)
    once = outs[2]
    assert all(torch.equal(o, alone) for o in outs.values()), name
    gu, dn = banks.dequant(torch.arange(3))
    dp = dtype == torch.bfloat16 and fmt != "fp8_block"  # VDPBF16PS: bf16 products
    assert rel(once, reference_experts(xa.float(), ids, w, gu, dn)) < (2e-2 if dp else 1e-5)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_avx2_decode_once_gives_the_per_token_bits(fmt):
    """A CPU without AVX-512 (an ISA cap here), float activations (the exact path's default): an
    expert with at least set_decode_once's count of a prompt chunk's tokens has each 4-row block
    decoded once for all of them (qdot4xn_fp4_avx2). Its outputs equal, bit for bit, the one-token
    AVX2 kernel's (decode once off) and each token's own call, with the cases' column tails."""
    _, sdt, h, i = CASES[fmt]
    banks = random_banks(fmt, sdt, 3, h, i, seed=37)
    ex = CpuExpertExecutor(banks, threads=2, isa_cap=1)
    if ex.isa != "avx2":
        pytest.skip(f"this CPU's executor runs {ex.isa} under an AVX2 cap")
    x, ids, w = inputs(41, h, seed=13, n=3, k=2)
    outs, alone = decode_once_outputs(ex, x, ids, w)
    assert torch.isfinite(alone).all() and (alone != 0).any()
    for m, o in outs.items():
        assert torch.equal(o, alone), (m, int((o != alone).sum()))
    gu, dn = banks.dequant(torch.arange(3))
    assert rel(outs[2], reference_experts(x, ids, w, gu, dn)) < 1e-5


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("kernel", ["vbmi", "vnni", "avx2"])
def test_int8_decode_once_gives_the_per_token_bits(fmt, kernel):
    """int8 activations (--cpu-act int8) on a prompt chunk: an expert with at least set_decode_once's
    count of the call's tokens has each 4-row block's codes looked up once for all of them
    (qdot4xn_fp4_q8, qdot4xn_fp4_q8_avx2), even and odd counts, one call mixing both paths, the
    cases' column tails in both phases. Its outputs equal, bit for bit, the one-token int8 kernel's
    (decode once off) and what each token gets in a call of its own, on the VBMI, VNNI and AVX2
    kernels alike."""
    _, sdt, h, i = CASES[fmt]
    banks = random_banks(fmt, sdt, 3, h, i, seed=29)
    ex = CpuExpertExecutor(banks, threads=2)
    ex.set_act(True, max_kernel=kernel)
    if ex.int8_kernel != kernel:
        pytest.skip(f"this CPU's int8 kernel is {ex.int8_kernel}, not {kernel}")
    x, ids, w = inputs(41, h, seed=11, n=3, k=2)
    try:
        outs, alone = decode_once_outputs(ex, x, ids, w)
    finally:
        ex.set_act(False)
    once = outs[2]
    assert torch.isfinite(once).all() and (once != 0).any()
    for m, o in outs.items():
        assert torch.equal(o, alone), (m, int((o != alone).sum()))
    gu, dn = banks.dequant(torch.arange(3))
    assert rel(once, reference_experts(x, ids, w, gu, dn)) < 3e-2  # int8 activations: ~1% off exact


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_row_scales_give_the_per_chunk_bits(fmt):
    """The fp4 kernels take each row's block scales decoded once per call (fp4_block_scales, the
    default for the AVX2 kernels, set_row_scales' mask) or made per chunk: the same bits in every
    kernel that reads them: float and bf16 activations one token at a time and in pairs, the
    int8 kernels this CPU has (VBMI, VNNI, AVX2), and the float AVX2 kernel (an ISA cap), with the
    cases' short last chunks (96 and 48 columns). (The decode-once kernels, ~6 tokens an expert
    here, make their scales once per call already: unaffected, run to show it.) The same for the
    row order of the int8 and bf16-activation kernels (set_row_seq: a 4-row block's rows side by
    side or one after another), under both scale settings."""
    _, sdt, h, i = CASES[fmt]
    banks = random_banks(fmt, sdt, N, h, i, seed=31)
    ex = CpuExpertExecutor(banks, threads=2)
    if ISA_NAMES.index(ex.isa) < ISA_NAMES.index("avx512"):
        pytest.skip(f"the block scales are the AVX-512 kernels'; this CPU's executor runs {ex.isa}")
    ext = extension()
    runs = []  # (activation, tokens)
    for t in (1, 5, 19):  # 6 experts, top-2: one token; ~2 an expert (pairs, odd ones); ~6 (decoded once)
        x, ids, w = inputs(t, h, seed=40 + t, n=6, k=2)
        runs += [("f32", x, ids, w), ("bf16", x.bfloat16(), ids, w)]
    int8 = []  # the int8 kernels this CPU runs
    for kernel in ("vbmi", "vnni", "avx2"):
        ex.set_act(True, max_kernel=kernel)
        if ex.int8_kernel == kernel:
            int8.append(kernel)
    ex.set_act(False)
    assert "avx2" in int8  # every AVX-512 CPU has AVX2
    avx2 = CpuExpertExecutor(banks, threads=2, isa_cap=1)  # the float AVX2 kernel
    outs = []
    # (row-scales mask, row order): every template of the kernels, the first one again last
    configs = [(3, 0), (0, 0), (3, 1), (0, 1), (3, 0)]
    before = ext.set_row_scales(3), ext.set_row_seq(0)
    try:
        for mask, seq in configs:
            ext.set_row_scales(mask)
            ext.set_row_seq(seq)
            got = [ex.kernel(x, ids, w) for _, x, ids, w in runs]
            got += [avx2.kernel(x, ids, w) for act, x, ids, w in runs if act == "f32"]
            for kernel in int8:
                ex.set_act(True, max_kernel=kernel)
                got += [ex.kernel(x, ids, w) for act, x, ids, w in runs if act == "f32"]
                ex.set_act(False)
            outs.append(got)
    finally:
        ext.set_row_scales(before[0])
        ext.set_row_seq(before[1])
    for (mask, seq), got in zip(configs[1:], outs[1:]):
        for a, b in zip(outs[0], got):
            assert torch.isfinite(a).all() and (a != 0).any()
            assert torch.equal(a, b), (mask, seq, int((a != b).sum()))
    gu, dn = banks.dequant(torch.arange(N))
    x, ids, w = runs[0][1:]
    assert rel(outs[0][0], reference_experts(x, ids, w, gu, dn)) < 1e-5


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("shape", ["tails", "whole-chunks", "clamped"])
def test_row_runs_give_the_per_block_bits(fmt, shape):
    """The fp4 kernels take a decode call's rows a run at a time (row_runs.h: one call per token for
    a work unit's gate and up rows, one per expert for the thread's down rows) or a 4-row block at a
    time (set_row_runs(0)): the same bits, for int8 activations (the VBMI kernel, and the AVX2 one
    under an ISA cap), float ones (AVX-512, and AVX2 under the cap) and bf16 ones (where the CPU
    has AVX512-BF16), with short last chunks (the CASES shapes), whole
    128-column chunks only (the Qwen shapes' kind), and GPT-OSS's clamped SwiGLU with bias banks
    (the per-row epilogue). Calls of 1, 3 and 9 tokens: experts with one token, a few (int8 runs
    them; the exact kernels take pairs), and some at the decode-once threshold (qdot4xn either way)."""
    from freetoken.experts.executor import Activation
    h, i = {"tails": CASES[fmt][2:], "whole-chunks": (512, 256), "clamped": (384, 128)}[shape]
    banks = random_banks(fmt, None, N, h, i, seed=71)
    fn = {}
    if shape == "clamped":
        g = torch.Generator().manual_seed(72)
        fn = dict(activation=Activation("swiglu_clamp", 1.702, 7.0),
                  gate_up_bias=(torch.randn(N, 2 * i, generator=g) * 0.1).bfloat16(),
                  down_bias=(torch.randn(N, h, generator=g) * 0.1).bfloat16())
    ex = CpuExpertExecutor(banks, threads=2, **fn)
    avx2 = CpuExpertExecutor(banks, threads=2, isa_cap=1, **fn)  # what a CPU without AVX-512 runs
    if ex.isa == "scalar":
        pytest.skip("the run kernels are AVX2 and AVX-512 ones; this CPU has neither")
    calls = [inputs(t, h, seed=80 + t) for t in (1, 3, 9)]
    modes = [(avx2, "f32"), (avx2, "int8")]  # (executor, activations)
    if ISA_NAMES.index(ex.isa) >= ISA_NAMES.index("avx512"):
        modes += [(ex, "f32")] + ([(ex, "bf16")] if ex.isa == "avx512-bf16" else [])
        ex.set_act(True)
        if ex.int8_kernel == "vbmi":
            modes.append((ex, "int8"))
        ex.set_act(False)

    def outputs():
        got = []
        for e, mode in modes:
            e.set_act(mode == "int8")
            got += [e.kernel(x.bfloat16() if mode == "bf16" else x, ids, w) for x, ids, w in calls]
            e.set_act(False)
        return got

    ext = extension()
    before = ext.set_row_runs(1)
    try:
        runs = outputs()
        ext.set_row_runs(0)
        blocks = outputs()
    finally:
        ext.set_row_runs(before)
    # and the runs are taken: a one-thread executor does its work on this thread, which counts them
    one = CpuExpertExecutor(banks, threads=1, isa_cap=1 if ex.isa == "avx2" else 3, **fn)
    before = ext.set_row_runs(1)
    try:
        for on in (0, 1):
            ext.set_row_runs(on)
            n0 = ext.row_runs_here()
            one.kernel(*calls[0])
            assert (ext.row_runs_here() > n0) == bool(on), on
    finally:
        ext.set_row_runs(before)
    for n, (a, b) in enumerate(zip(runs, blocks)):
        assert torch.isfinite(a).all() and (a != 0).any()
        e, mode = modes[n // len(calls)]
        assert torch.equal(a, b), (e.isa, mode, n % len(calls), int((a != b).sum()))
    if not fn:  # and near the exact experts (int8 activations: ~1% off)
        x, ids, w = calls[1]
        gu, dn = banks.dequant(torch.arange(N))
        ref = reference_experts(x, ids, w, gu, dn)
        for n, (e, mode) in enumerate(modes):
            assert rel(runs[n * len(calls) + 1], ref) < (3e-2 if mode != "f32" else 1e-5), (e.isa, mode)


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "fp8_block-bf16", "fp8_block-f32", "fp8_block-f16",
                                  "fp8_block-bf16-16"])
def test_token_pairs_give_the_per_token_bits(name):
    """A prompt chunk's tokens of one expert go through the exact kernels two at a time
    (qdot4x2_fp4_avx512, qdot4x2_fp8_avx512; with bf16 activations qdot4x2_fp4_bf16dp; the
    decode-once kernels turned off, as they would take these experts' ~11 tokens); every
    output equals, bit for bit, what the token gets in a call of its own (the per-token kernels),
    at every ISA this CPU has, with column and row tails and a row that routes nowhere."""
    fmt, sdt, h, i = PAIR_CASES[name]
    banks = random_banks(fmt, sdt, 5, h, i, seed=11)
    x, ids, w = inputs(19, h, seed=5, n=5, k=3)  # 5 experts: each gets ~11 tokens, pairs and a remainder
    before = extension().set_decode_once(0)
    try:
        check_pairs(name, fmt, banks, x, ids, w)
    finally:
        extension().set_decode_once(before)


def check_pairs(name, fmt, banks, x, ids, w):
    for isa in (0, 1, 2, 3):
        ex = CpuExpertExecutor(banks, threads=2, isa_cap=isa)
        if ex.isa != ISA_NAMES[isa]:
            continue
        whole = ex.kernel(x, ids, w)
        alone = torch.cat([ex.kernel(x[r:r + 1], ids[r:r + 1], w[r:r + 1]) for r in range(x.shape[0])])
        assert torch.equal(whole, alone), (name, ISA_NAMES[isa])
        gu, dn = banks.dequant(torch.arange(5))
        assert rel(whole, reference_experts(x, ids, w, gu, dn)) < 1e-5
        xb = x.bfloat16()  # a bf16 model's rows: VDPBF16PS for the fp4 formats on avx512-bf16
        whole_b = ex.kernel(xb, ids, w)
        alone_b = torch.cat([ex.kernel(xb[r:r + 1], ids[r:r + 1], w[r:r + 1]) for r in range(x.shape[0])])
        assert torch.equal(whole_b, alone_b), (name, ISA_NAMES[isa], "bf16")
        dp = ISA_NAMES[isa] == "avx512-bf16" and fmt != "fp8_block"
        assert rel(whole_b, reference_experts(xb.float(), ids, w, gu, dn)) < (2e-2 if dp else 1e-5)
