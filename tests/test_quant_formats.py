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
