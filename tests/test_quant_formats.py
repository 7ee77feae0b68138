"""The reference dequantizers, from the formats' specifications, on random data with the edge
values (zero, the largest e2m1, tiny and large scales), against transformers where it has one."""
import torch

from freetoken.weights.quant import (E2M1_VALUES, dequant_fp8_block, dequant_fp8_block_pair, dequant_mxfp4,
                                     dequant_nvfp4, e8m0_to_float, pack_fp4, unpack_fp4)


def test_fp4_pack_roundtrip_and_values():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # every code, [3, 32]
    packed = pack_fp4(codes)  # [3, 16]
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(unpack_fp4(packed), torch.tensor(E2M1_VALUES).repeat(3, 2))
    assert unpack_fp4(torch.tensor([0x71], dtype=torch.uint8)).tolist() == [0.5, 6.0]  # low nibble first


def test_e8m0():
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(s)
    assert v[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert torch.isnan(v[6])


def test_mxfp4_matches_transformers_gpt_oss():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=g, dtype=torch.uint8)  # [E, R, C/32, 16] as GPT-OSS
    scales = torch.randint(0, 255, (3, 8, 4), generator=g, dtype=torch.uint8)  # e8m0 without NaN
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R]
    ours = dequant_mxfp4(blocks.reshape(3, 8, 64), scales)  # [E, R, C]
    assert torch.equal(ours.transpose(1, 2), ref)


def test_nvfp4_formula():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    scales = (torch.rand(5, 4, generator=g) * 448).to(torch.float8_e4m3fn)  # up to e4m3's max
    scales[0, 0] = 0  # a zero block
    s2 = torch.tensor([0.5, 2.0, 1e-3, 7.0, 1.0])
    got = dequant_nvfp4(pack_fp4(codes), scales, s2)
    want = torch.tensor(E2M1_VALUES)[codes.long()] * scales.float().repeat_interleave(16, 1) * s2[:, None]
    assert torch.equal(got, want) and got[0, :16].abs().sum() == 0


def test_fp8_block_grid_with_ragged_edges():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(2, 300, 200, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, 2, generator=g) + 0.1  # ceil(300/128) x ceil(200/128)
    got = dequant_fp8_block(w, s)
    r, c = torch.meshgrid(torch.arange(300), torch.arange(200), indexing="ij")
    assert torch.equal(got, w.float() * s[:, r // 128, c // 128])
    # a gate_up pair: 200 gate rows (2 block rows), 100 up rows (1 block row)
    pair = dequant_fp8_block_pair(w, torch.cat([s[:, :2], s[:, 2:]], 1), rows_first=200)
    assert torch.equal(pair[:, :200], dequant_fp8_block(w[:, :200], s[:, :2]))
    assert torch.equal(pair[:, 200:], dequant_fp8_block(w[:, 200:], s[:, 2:]))


def e4m3_spec(byte: int) -> float:
    """OCP FP8 E4M3 (float8_e4m3fn) from its definition: sign bit 7, exponent bits 6-3 (bias 7),
    mantissa bits 2-0; exponent 0 is subnormal (m/8 * 2^-6); 0x7f/0xff are NaN, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def e2m1_spec(code: int) -> float:
    """OCP E2M1 from its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0;
    exponent 0 is subnormal (m/2)."""
    sign = -1.0 if code & 8 else 1.0
    e, m = (code >> 1) & 3, code & 1
    return sign * (m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))


def test_every_code_against_the_specification():
    """Every e2m1 code, every e8m0 scale and every e4m3 byte (subnormals, 448, both zeros, the
    NaNs), as the reference dequantizers read them, against the formats' definitions, signed
    zeros included: what every kernel is checked against is checked here against the spec."""
    e2 = unpack_fp4(pack_fp4(torch.arange(16, dtype=torch.uint8)))
    want = torch.tensor([e2m1_spec(c) for c in range(16)])
    assert torch.equal(e2, want) and torch.equal(torch.signbit(e2), torch.signbit(want))  # -0.0 at code 8
    e8 = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    assert torch.equal(e8[:255], torch.tensor([2.0 ** (s - 127) for s in range(255)])) and torch.isnan(e8[255])
    b = torch.arange(256, dtype=torch.uint8)
    spec = torch.tensor([e4m3_spec(int(x)) for x in b])
    nan = torch.isnan(spec)
    assert b[nan].tolist() == [0x7F, 0xFF]
    fp8 = b.view(torch.float8_e4m3fn)
    assert float(spec[0x7E]) == 448.0 and float(spec[0x01]) == 2.0 ** -9  # largest, smallest subnormal
    # fp8_block values: every byte times a block scale of one (exact), then times 3 (each product
    # of an e4m3 value and 3 is exact in fp32)
    for scale in (1.0, 3.0):
        got = dequant_fp8_block(fp8.view(1, 2, 128), torch.full((1, 1, 1), scale)).flatten()
        assert torch.equal(got[~nan], spec[~nan] * scale) and torch.isnan(got[nan]).all()
        assert torch.equal(torch.signbit(got[~nan]), torch.signbit(spec[~nan]))
    # nvfp4 block scales: every non-NaN e4m3 byte as the scale of a block of code-2 values (1.0)
    scales = fp8[~nan].view(-1, 1)  # [254, 1]
    got = dequant_nvfp4(pack_fp4(torch.full((scales.shape[0], 16), 2, dtype=torch.uint8)), scales, 1.0)
    assert torch.equal(got, spec[~nan].view(-1, 1).expand(-1, 16))
    assert torch.equal(torch.signbit(got), torch.signbit(spec[~nan].view(-1, 1).expand(-1, 16)))
