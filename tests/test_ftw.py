"""FTW format: bit-identical round trip, truncation and corruption detected, no partial files."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from freetoken.errors import CorruptModelError, FreeTokenError
from freetoken.weights import ftw
from freetoken.weights.convert import convert
from freetoken.weights.reader import load_ftw
from freetoken.weights.writer import FTWWriter


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ftw")
    m = hf_models.qwen3_5(21, num_hidden_layers=4)
    hf_models.save(m.to(torch.bfloat16), str(d / "hf"), "sharded")
    out = str(d / "m.ftw")
    convert(str(d / "hf"), out, progress=False)
    return d, out, m.config


def checkpoint_tensors(d):
    w = {}
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            w.update(load_file(os.path.join(d, fn)))
    return w


def test_round_trip_bit_identical(ckpt):
    d, out, cfg = ckpt
    meta, got = load_ftw(out)
    src = checkpoint_tensors(str(d / "hf"))
    E, L = cfg.num_experts, cfg.num_hidden_layers
    for name, t in src.items():
        if ".mlp.experts." in name:
            continue
        assert same_bits(got[name], t), name
    for l in range(L):
        for e in range(E):
            p = f"model.layers.{l}.mlp.experts.{e}."
            gu = torch.cat([src[p + "gate_proj.weight"], src[p + "up_proj.weight"]])
            assert same_bits(got["experts.gate_up"][l * E + e], gu)
            assert same_bits(got["experts.down"][l * E + e], src[p + "down_proj.weight"])
    with open(d / "hf" / "tokenizer.json", "rb") as f:
        assert bytes(got["file/tokenizer.json"].numpy()) == f.read()
    assert meta["arch"] == "qwen3_5_moe"


def test_buffered_and_direct_io_agree(ckpt):
    _, out, _ = ckpt
    _, a = load_ftw(out, direct=True, threads=3)
    _, b = load_ftw(out, direct=False, threads=1)
    assert a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


def test_entries_are_aligned(ckpt):
    _, out, _ = ckpt
    _, entries = ftw.read_header(out)
    assert all(e.offset % ftw.ALIGN == 0 for e in entries.values())
    _, t = load_ftw(out, names=["experts.gate_up"])
    assert t["experts.gate_up"].data_ptr() % ftw.ALIGN == 0  # exact-size, aligned host bank


def test_truncated_file_is_reported(ckpt, tmp_path):
    _, out, _ = ckpt
    bad = tmp_path / "trunc.ftw"
    data = open(out, "rb").read()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="truncated.*trunc.ftw|trunc.ftw.*truncated"):
        load_ftw(str(bad))


def test_flipped_byte_fails_checksum(ckpt, tmp_path):
    _, out, _ = ckpt
    _, entries = ftw.read_header(out)
    e = entries["experts.down"]
    data = bytearray(open(out, "rb").read())
    data[e.offset + e.nbytes // 2] ^= 0x5A
    bad = tmp_path / "flip.ftw"
    bad.write_bytes(bytes(data))
    with pytest.raises(CorruptModelError, match="checksum mismatch in 'experts.down'"):
        load_ftw(str(bad))
    load_ftw(str(bad), verify=False)  # the check is what caught it


def test_not_an_ftw_file(tmp_path):
    p = tmp_path / "x.ftw"
    p.write_bytes(b"GGUF" + os.urandom(100))
    with pytest.raises(CorruptModelError, match="not an FTW file"):
        load_ftw(str(p))


def test_multi_block_entry_crc(tmp_path, monkeypatch):
    """Entries spanning several checksum blocks, written in uneven pieces, read back exactly."""
    monkeypatch.setattr(ftw, "BLOCK", 8192)
    import freetoken.weights.reader as reader
    import freetoken.weights.writer as writer
    monkeypatch.setattr(reader, "BLOCK", 8192)
    monkeypatch.setattr(writer, "BLOCK", 8192)
    t = torch.randn(3, 5000)
    entries = [ftw.Entry("a", "float32", [3, 5000]), ftw.Entry("b", "uint8", [7])]
    path = str(tmp_path / "blocks.ftw")
    with FTWWriter(path, entries, {"arch": "x"}) as w:
        flat = t.view(-1)
        for s in range(0, flat.numel(), 3001):
            w.write("a", flat[s:s + 3001])
        w.write("b", b"1234567")
    _, entries2 = ftw.read_header(path)
    assert len(entries2["a"].crc) == -(-60000 // 8192)
    _, got = load_ftw(path)
    assert torch.equal(got["a"], t) and bytes(got["b"].numpy()) == b"1234567"


def test_failed_convert_leaves_nothing(tmp_path, monkeypatch):
    m = hf_models.qwen3_moe(3)
    d = hf_models.save(m, str(tmp_path / "hf"))
    fn = os.path.join(d, "model.safetensors")
    orig = load_file(fn)
    # a wrong-shaped expert: refused by the shape check, before anything is written
    save_file({**orig, "model.layers.2.mlp.experts.7.down_proj.weight": torch.randn(3, 3)}, fn,
              metadata={"format": "pt"})
    out = tmp_path / "out.ftw"
    with pytest.raises(FreeTokenError, match=r"experts\.7\.down_proj.*\[3, 3\]"):
        convert(d, str(out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    # a failure while streaming the banks, after writing began (a read error of expert 7):
    # no output, no OUT.<pid>.partial
    save_file(orig, fn, metadata={"format": "pt"})
    from freetoken.weights import convert as conv
    real = conv.ExpertReader.read

    def failing(self, part, e, comp="values"):
        if e == 7:
            raise FreeTokenError("expert 7: a read error")
        return real(self, part, e, comp)
    monkeypatch.setattr(conv.ExpertReader, "read", failing)
    with pytest.raises(FreeTokenError, match="expert 7"):
        convert(d, str(out), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no OUT.<pid>.partial


def test_partial_name_is_per_process(tmp_path):
    """Two processes writing one output never share (or remove) each other's partial file."""
    path = str(tmp_path / "x.ftw")
    entries = [ftw.Entry("b", "uint8", [3])]
    w = FTWWriter(path, entries, {"arch": "x"})
    assert w.tmp == f"{path}.{os.getpid()}.partial" and os.path.exists(w.tmp)
    other = tmp_path / "x.ftw.99999999.partial"  # another process's file, half written
    other.write_bytes(b"half")
    w.write("b", b"abc")
    w.close()
    assert other.read_bytes() == b"half" and not os.path.exists(w.tmp)
    _, got = load_ftw(path)
    assert bytes(got["b"].numpy()) == b"abc"
    w = FTWWriter(path + "2", [ftw.Entry("b", "uint8", [3])], {"arch": "x"})
    w.abort()
    assert other.exists() and not os.path.exists(w.tmp)
