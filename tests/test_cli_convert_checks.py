"""`ft convert` refuses what it would convert wrongly (quantizations it does not read, a tokenizer
that does not fit the embedding), and the loader refuses FTW files made that way before the fix.
The three quantized formats FreeToken reads (FP8 128x128 block, MXFP4, NVFP4) convert: their
end-to-end tests are in test_quantized_models.py.

Each refusal: exit 2, one `ft: error:` line naming the format or the numbers, nothing written.
"""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_models
from test_bad_input import assert_one_line_error, ft
from freetoken.errors import FreeTokenError, UnsupportedModelError
from freetoken.weights.convert import convert

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    hf_models.save(hf_models.qwen3_moe(5, max_position_embeddings=64), str(d / "hf"))
    return d / "hf"


def variant(base, tmp_path, name, tensors=None, config=None, files=None):
    """A copy of the checkpoint with its tensors / config.json edited and extra files added."""
    d = tmp_path / name
    shutil.copytree(base, d)
    if tensors is not None:
        fn = d / "model.safetensors"
        w = tensors(load_file(str(fn)))
        save_file(w, str(fn), metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    for fn, doc in (files or {}).items():
        (d / fn).write_text(json.dumps(doc))
    return d


def to_fp8_block(w: dict) -> dict:
    """The layout Qwen and DeepSeek publish: e4m3 projection weights, each with a float32
    `weight_scale_inv` of one scale per 128x128 block."""
    out = {}
    for n, t in w.items():
        if n.endswith("_proj.weight") and t.dim() == 2:
            out[n] = t.to(torch.float8_e4m3fn)
            out[n[: -len("weight")] + "weight_scale_inv"] = torch.ones(-(-t.shape[0] // 128), -(-t.shape[1] // 128))
        else:
            out[n] = t
    return out


def to_mxfp4_gate_up_only(w: dict) -> dict:
    """gpt-oss style 4-bit blocks for the experts' gate_up, but the down projections left fused
    in BF16: experts in two formats, which one bank cannot hold."""
    out = hf_models.fuse_experts(w, 3, 16)
    for l in range(3):
        p = f"model.layers.{l}.mlp.experts."
        gu = out.pop(p + "gate_up_proj")
        out[p + "gate_up_proj_blocks"] = torch.zeros(gu.shape[0], gu.shape[1], gu.shape[2] // 32, 16, dtype=torch.uint8)
        out[p + "gate_up_proj_scales"] = torch.zeros(gu.shape[0], gu.shape[1], gu.shape[2] // 32, dtype=torch.uint8)
    return out


def to_fp8_per_tensor(w: dict) -> dict:
    """compressed-tensors / ModelOpt FP8: e4m3 weights with one `weight_scale` per tensor."""
    out = dict(w)
    for n, t in w.items():
        if n.endswith("_proj.weight") and t.dim() == 2:
            out[n] = t.to(torch.float8_e4m3fn)
            out[n[: -len("weight")] + "weight_scale"] = torch.ones(())
    return out


def to_awq(w: dict) -> dict:
    out = dict(w)
    t = out.pop("model.layers.0.self_attn.o_proj.weight")
    out["model.layers.0.self_attn.o_proj.qweight"] = torch.zeros(t.shape[1], t.shape[0] // 8, dtype=torch.int32)
    out["model.layers.0.self_attn.o_proj.qzeros"] = torch.zeros(1, t.shape[0] // 8, dtype=torch.int32)
    out["model.layers.0.self_attn.o_proj.scales"] = torch.ones(1, t.shape[0], dtype=torch.float16)
    return out


def one_int8(w: dict) -> dict:
    w["model.layers.0.self_attn.o_proj.weight"] = torch.zeros_like(w["model.layers.0.self_attn.o_proj.weight"],
                                                                     dtype=torch.int8)
    return w


def set_key(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


QUANTIZED = {
    # name: (variant kwargs, words the error line must contain)
    "fp8-per-tensor-config": (dict(tensors=to_fp8_per_tensor, config=set_key("quantization_config", {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"})),
        ["quantization 'fp8' (e4m3, per-tensor scales)", "config.json", "not supported", "128x128", "BF16"]),
    "fp8-block-64": (dict(tensors=to_fp8_block, config=set_key("quantization_config", dict(
        FP8_CONFIG, weight_block_size=[64, 64]))), ["'fp8' (e4m3, 64x64 block scales)", "not supported"]),
    "fp8-per-tensor-tensors-only": (dict(tensors=to_fp8_per_tensor),
                                    ["quantization 'fp8' (e4m3 weights; tensor", "not supported", "BF16"]),
    "modelopt-fp8": (dict(files={"hf_quant_config.json": {"producer": {"name": "modelopt", "version": "0.31"},
                                                          "quantization": {"quant_algo": "FP8"}}}),
                     ["hf_quant_config.json", "'FP8' (e4m3, per-tensor scales)", "not supported"]),
    "modelopt-nvfp4-awq": (dict(files={"hf_quant_config.json": {"producer": {"name": "modelopt"},
                                       "quantization": {"quant_algo": "NVFP4_AWQ", "group_size": 16}}}),
                           ["hf_quant_config.json", "NVFP4_AWQ", "not supported"]),
    "nvfp4-compressed-tensors": (dict(config=set_key("quantization_config", {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})),
        ["'compressed-tensors' (nvfp4-pack-quantized)", "not supported"]),
    "gptq-config": (dict(config=set_key("quantization_config", {"quant_method": "gptq", "bits": 4, "group_size": 128})),
                    ["quantization 'gptq' (4-bit, group size 128)", "not supported"]),
    "awq-config": (dict(config=set_key("quantization_config", {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                                "version": "gemm"})),
                   ["quantization 'awq' (4-bit, group size 128)", "not supported"]),
    "awq-tensors-only": (dict(tensors=to_awq), ["'gptq/awq'", "self_attn.o_proj.q", "not supported"]),
    "bitsandbytes": (dict(config=set_key("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                                  "bnb_4bit_quant_type": "nf4"})),
                     ["'bitsandbytes' (4-bit nf4)", "not supported"]),
    "int8-weight": (dict(tensors=one_int8), ["model.layers.0.self_attn.o_proj.weight", "I8", "BF16"]),
    "mxfp4-experts-in-two-formats": (dict(tensors=to_mxfp4_gate_up_only),
                                     ["routed experts are stored in more than one format", "dense", "mxfp4"]),
    "nvfp4-declared-on-no-tensor": (dict(files={"hf_quant_config.json": {
        "producer": {"name": "modelopt", "version": "0.31"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}}),
        ["hf_quant_config.json", "NVFP4", "none of its weights"]),
}


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_quantized_checkpoint_is_refused(base, tmp_path, kind):
    kw, words = QUANTIZED[kind]
    d = variant(base, tmp_path, kind, **kw)
    out = tmp_path / "out" / "m.ftw"
    with pytest.raises(FreeTokenError):
        convert(str(d), str(out), progress=False)
    code, _, err = ft("convert", str(d), str(out))
    assert_one_line_error(code, err, str(d), *words)
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


@pytest.mark.parametrize("text, words", [("{\"producer\": {\"name\": \"modelopt\"", ["is not valid JSON"]),
                                         ("[\"NVFP4\"]", ["holds a JSON list, not an object"])])
def test_damaged_hf_quant_config_is_named(base, tmp_path, text, words):
    """A damaged hf_quant_config.json says so (it declared an unknown quantization before)."""
    d = variant(base, tmp_path, "damaged-quant-config")
    (d / "hf_quant_config.json").write_text(text)
    out = tmp_path / "out" / "m.ftw"
    code, _, err = ft("convert", str(d), str(out))
    assert_one_line_error(code, err, "hf_quant_config.json", "copy it again from the release", *words)
    assert not (tmp_path / "out").exists()


ACCEPTED = {
    # the layouts refused before quantized formats existed, now read: (variant kwargs, format)
    "fp8-block": (dict(tensors=to_fp8_block, config=set_key("quantization_config", FP8_CONFIG)),
                  "fp8_block", "declared in config.json"),
    "fp8-block-tensors-only": (dict(tensors=to_fp8_block), "fp8_block", "found in the tensors"),
}


@pytest.mark.parametrize("kind", list(ACCEPTED))
def test_published_quantized_layouts_now_convert(base, tmp_path, kind):
    kw, fmt, where = ACCEPTED[kind]
    d = variant(base, tmp_path, kind, **kw)
    code, _, err = ft("convert", str(d), str(tmp_path / "m.ftw"), "--quiet")
    assert code == 0, err
    assert f"quantized checkpoint: {fmt}" in err and where in err and "routed experts kept as" in err
    from freetoken.weights.ftw import read_header
    meta, entries = read_header(str(tmp_path / "m.ftw"))
    assert meta["banks"]["format"] == fmt and entries["experts.gate_up.scale"].dtype == "float32"


def test_unquantized_copy_still_converts(base, tmp_path):
    """The refusals key on quantization, not on something every checkpoint has."""
    code, _, err = ft("convert", str(base), str(tmp_path / "m.ftw"), "--quiet")
    assert code == 0, err
    assert "quantized checkpoint" not in err


def fp8_ftw_as_before_the_fix(base, tmp_path) -> str:
    """What `ft convert` wrote for an FP8 checkpoint before it read them: e4m3 weights kept,
    their scales dropped, nothing in the header saying so."""
    from freetoken.weights.ftw import Entry, read_header
    from freetoken.weights.reader import load_ftw
    from freetoken.weights.writer import FTWWriter
    good = str(tmp_path / "good.ftw")
    convert(str(base), good, progress=False)
    meta, entries = read_header(good)
    _, tensors = load_ftw(good)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    fresh = [Entry(e.name, "float8_e4m3fn" if e.name == name else e.dtype, e.shape) for e in entries.values()]
    out = str(tmp_path / "old-fp8.ftw")
    with FTWWriter(out, fresh, meta) as w:
        for e in fresh:
            w.write(e.name, tensors[e.name])
    return out


def test_loader_refuses_float8_ftw(base, tmp_path):
    out = fp8_ftw_as_before_the_fix(base, tmp_path)
    from freetoken.weights.reader import load_ftw
    with pytest.raises(UnsupportedModelError, match="float8_e4m3fn"):
        load_ftw(out)
    code, _, err = ft("generate", out, "--prompt-ids", "1,2", "--max-tokens", "2")
    assert_one_line_error(code, err, "old-fp8.ftw", "float8_e4m3fn", "re-run `ft convert`", "BF16")


def add_tokens(d, n: int) -> int:
    """Give the checkpoint's tokenizer n more special tokens; returns the largest id."""
    from tokenizers import AddedToken, Tokenizer
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(f"<|extra_{i}|>", special=True, normalized=False) for i in range(n)])
    tk.save(str(d / "tokenizer.json"))
    return max(tk.get_vocab(with_added_tokens=True).values())


def test_tokenizer_larger_than_embedding_is_refused(base, tmp_path):
    d = tmp_path / "bigtok"
    shutil.copytree(base, d)
    top = add_tokens(d, 80)  # 270 ids + 80 > vocab_size 320
    assert top >= 320
    code, _, err = ft("convert", str(d), str(tmp_path / "m.ftw"))
    assert_one_line_error(code, err, str(d), f"up to {top}", "vocab_size is 320", "tokenizer.json")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("m.ftw")]


def test_padded_vocab_is_fine(base):
    """Real Qwen checkpoints pad vocab_size above the tokenizer: every id still fits."""
    from freetoken.tokenizer import Tokenizer
    tk = Tokenizer((base / "tokenizer.json").read_bytes())
    assert tk.max_id() < 320
    tk.check_fits(320, "x")
    with pytest.raises(FreeTokenError, match=f"up to {tk.max_id()}.*vocab_size is {tk.max_id()}"):
        tk.check_fits(tk.max_id(), "x")


def test_engine_refuses_tokenizer_past_the_embedding(base, tmp_path, monkeypatch, capsys):
    """An FTW converted before the check (or by hand): refused at load, in generate and serve,
    instead of an IndexError per request."""
    d = tmp_path / "bigtok"
    shutil.copytree(base, d)
    top = add_tokens(d, 80)
    from freetoken.tokenizer import Tokenizer
    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "check_fits", lambda *a: None)
        out = str(tmp_path / "bigtok.ftw")
        convert(str(d), out, progress=False)
    from freetoken.runtime.engine import Engine
    with pytest.raises(FreeTokenError, match=f"up to {top}"):
        Engine(out)
    from freetoken.cli import main  # generate in this process (one `ft` process start less)
    capsys.readouterr()
    code = main(["generate", out, "--prompt", "hi", "--max-tokens", "2"])
    assert_one_line_error(code, capsys.readouterr().err, "bigtok.ftw", f"up to {top}", "vocab_size is 320")
    from server_fixture import free_port
    code, _, err = ft("serve", out, "--port", str(free_port()))
    assert_one_line_error(code, err, "bigtok.ftw", f"up to {top}", "vocab_size is 320")


def test_a_checkpoint_folder_is_served_from_a_conversion_made_once(base, tmp_path, monkeypatch):
    """`ft generate DIR` with a transformers checkpoint folder (as vLLM users give one): converted
    once into the cache, said on stderr; the next start reuses the file; an edited checkpoint
    gets a new conversion. Its tokens are those of the FTW `ft convert` writes."""
    from test_bad_input import ft_in
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "Qwen3-Tiny"
    shutil.copytree(base, src)
    args = ["--prompt-ids", "5,6,7", "--max-tokens", "4", "--json", "--ignore-eos"]
    code, out, err = ft_in("generate", str(src), *args)
    assert code == 0, err
    made = list((tmp_path / "cache" / "freetoken" / "models").glob("Qwen3-Tiny-*.ftw"))
    assert len(made) == 1 and "converting it once" in err and str(made[0]) in err
    first, stamp = json.loads(out)["token_ids"], made[0].stat().st_mtime_ns
    code, out, err = ft_in("generate", str(src), *args)
    assert code == 0 and "converting" not in err and json.loads(out)["token_ids"] == first
    assert made[0].stat().st_mtime_ns == stamp  # reused, not written again
    convert(str(src), str(tmp_path / "by-hand.ftw"), progress=False)
    code, out, _ = ft_in("generate", str(tmp_path / "by-hand.ftw"), *args)
    assert json.loads(out)["token_ids"] == first
    cfg = json.loads((src / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5  # an edited checkpoint: another fingerprint, another conversion
    (src / "config.json").write_text(json.dumps(cfg))
    models = tmp_path / "cache" / "freetoken" / "models"
    # what a killed conversion of the new fingerprint would have left: removed before converting
    from freetoken.cli import checkpoint_fingerprint
    left = models / f"Qwen3-Tiny-{checkpoint_fingerprint(str(src))}.ftw.999999.partial"
    left.write_bytes(b"x" * 4096)
    code, _, err = ft_in("generate", str(src), *args)
    assert code == 0 and "converting it once" in err and not left.exists()
    now = list(models.glob("Qwen3-Tiny-*.ftw"))
    assert len(now) == 1 and now[0] != made[0]  # the older conversion of this folder replaced


def test_convert_refuses_up_front_without_the_disk_space(base, tmp_path, monkeypatch):
    import freetoken.weights.convert as conv
    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9 - 1000, 1000))
    out = tmp_path / "new" / "m.ftw"
    with pytest.raises(FreeTokenError, match=r"needs .* free; free some space or write it elsewhere"):
        convert(str(base), str(out), progress=False)
    assert not (tmp_path / "new").exists()  # nothing written, the folder it made removed
