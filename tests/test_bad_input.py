"""User errors: one clear line naming the problem and the file; exit code 2; no traceback."""
import contextlib
import io
import json
import logging
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

import hf_models
from freetoken.errors import ContextOverflowError, FreeTokenError, UnsupportedModelError
from freetoken.weights.convert import convert


def ft(*args):
    """`ft ARGS` as a real process (`python -m freetoken.cli`) -> (exit code, stdout, stderr):
    the entry point and the exit code the shell sees (other test modules use this one)."""
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", *args], capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def ft_in(*args):
    """`ft ARGS` in this process, through cli.main (what `ft` runs) -> (exit code, stdout,
    stderr): the error checks below need no Python + torch start each."""
    from freetoken.cli import main
    out, err = io.StringIO(), io.StringIO()
    # what `ft`'s logging.basicConfig would print (under pytest it is a no-op: pytest's handlers
    # are already there), so a stray warning line still fails the one-line check
    handler = logging.StreamHandler(err)
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's own errors
                code = e.code
    finally:
        logging.getLogger().removeHandler(handler)
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [l for l in err.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ft: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    hf_models.save(hf_models.qwen3_moe(1, max_position_embeddings=64), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return d


def test_unsupported_architecture(good, tmp_path):
    import shutil
    d = tmp_path / "llama"
    shutil.copytree(good / "hf", d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError):
        convert(str(d), str(tmp_path / "o.ftw"), progress=False)
    code, _, err = ft("convert", str(d), str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, "config.json", "LlamaForCausalLM", "not supported")
    assert not (tmp_path / "o.ftw").exists()


@pytest.mark.parametrize("existing", [True, False])
def test_output_that_names_a_folder(good, tmp_path, existing):
    """An output path that is a folder, or ends in '/' (a folder not made yet), is refused before the
    checkpoint is read, with the file name to give; nothing is created."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    arg = str(out) if existing else str(out) + "/"
    code, _, err = ft("convert", str(good / "hf"), arg)
    assert_one_line_error(code, err, "is a directory", os.path.join(str(out), "model.ftw"))
    assert out.exists() == existing and (not existing or not any(out.iterdir()))


def test_missing_tensor(good, tmp_path):
    import shutil
    d = tmp_path / "missing"
    shutil.copytree(good / "hf", d)
    fn = d / "model.safetensors"
    w = load_file(str(fn))
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_file(w, str(fn), metadata={"format": "pt"})
    code, _, err = ft_in("convert", str(d), str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, "missing", "model.layers.1.self_attn.k_norm.weight", str(d))
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o.ftw")]  # no output, no o.ftw.<pid>.partial


@pytest.mark.parametrize("fn", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_missing_checkpoint_file(good, tmp_path, fn):
    import shutil
    d = tmp_path / "nofile"
    shutil.copytree(good / "hf", d)
    os.remove(d / fn)
    code, _, err = ft_in("convert", str(d), str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, fn)


def test_corrupt_safetensors(good, tmp_path):
    import shutil
    d = tmp_path / "corrupt"
    shutil.copytree(good / "hf", d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    code, _, err = ft_in("convert", str(d), str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, "model.safetensors")


def test_truncated_ftw_cli(good, tmp_path):
    data = (good / "m.ftw").read_bytes()
    bad = tmp_path / "cut.ftw"
    bad.write_bytes(data[: len(data) - 5000])
    code, _, err = ft_in("generate", str(bad), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert_one_line_error(code, err, "cut.ftw", "truncated")


def test_corrupt_ftw_cli(good, tmp_path):
    data = bytearray((good / "m.ftw").read_bytes())
    data[-4096 - 100] ^= 0xFF  # inside the last entry's data
    bad = tmp_path / "bad.ftw"
    bad.write_bytes(bytes(data))
    code, _, err = ft("generate", str(bad), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert_one_line_error(code, err, "bad.ftw", "checksum")


def test_ftw_lacking_a_tensor_the_model_needs(good, tmp_path, monkeypatch):
    """An FTW without a tensor the model loads (an older `ft convert` dropped Qwen's o_proj bias
    with attention_bias; or a file written by hand) is refused at load, naming the tensor and
    saying to convert again, instead of serving without it."""
    from freetoken.model.registry import model_class
    cls = model_class("qwen3_moe")
    every = cls.expected_tensors
    dropped = "model.layers.1.self_attn.q_norm.weight"  # read with w.get: without the check, silently none
    monkeypatch.setattr(cls, "expected_tensors", classmethod(
        lambda c, cfg: [n for n in every(cfg) if n != dropped]))  # convert writes what this lists
    convert(str(good / "hf"), str(tmp_path / "old.ftw"), progress=False)
    monkeypatch.undo()
    code, _, err = ft_in("generate", str(tmp_path / "old.ftw"), "--prompt-ids", "1,2,3", "--max-tokens", "2")
    assert_one_line_error(code, err, "old.ftw", dropped, "re-run `ft convert`")


def test_prompt_longer_than_context(good):
    code, _, err = ft("generate", str(good / "m.ftw"), "--prompt-ids", ",".join(["5"] * 60), "--max-tokens", "10")
    assert_one_line_error(code, err, "60 tokens", "context of 64")
    from freetoken.runtime.engine import Engine
    eng = Engine(str(good / "m.ftw"))
    with pytest.raises(ContextOverflowError):
        eng.generate([1] * 65, 1)


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", "1,x,3"], "comma-separated"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
    (["--prompt-ids", "1", "--cpu-threads", "-2"], "--cpu-threads"),
    (["--prompt-ids", "1", "--min-p", "2"], "min_p"),
    (["--prompt-ids", "1", "--presence-penalty", "3"], "--presence-penalty"),
    (["--prompt-ids", "1", "--repetition-penalty", "0"], "--repetition-penalty"),
])
def test_bad_generate_flags(good, args, needle):
    code, _, err = ft_in("generate", str(good / "m.ftw"), *args)
    assert_one_line_error(code, err, needle)


def test_model_path_errors(good, tmp_path, monkeypatch):
    code, _, err = ft_in("generate", str(tmp_path / "nope.ftw"), "--prompt", "hi")
    assert_one_line_error(code, err, "nope.ftw")
    # a checkpoint folder is converted on the fly (test_cli_convert_checks.py); a broken one
    # fails that conversion with its own error, and nothing lands in the cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((good / "hf" / "config.json").read_text())
    code, _, err = ft_in("generate", str(broken), "--prompt", "hi")
    assert code == 2 and "ft: error:" in err and "broken" in err
    assert not list((tmp_path / "cache" / "freetoken" / "models").glob("*.ftw"))


def test_convert_errors_are_freetoken_errors(tmp_path):
    with pytest.raises(FreeTokenError, match="not a checkpoint directory"):
        convert(str(tmp_path / "absent"), str(tmp_path / "o.ftw"), progress=False)


def test_state_that_cannot_fit_is_refused(good):
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.runtime.serving import ServingEngine
    eng = Engine(str(good / "m.ftw"))
    eng.budget = eng.weight_bytes + 1000  # as if only 1000 bytes were left after the weights
    with pytest.raises(FreeTokenError, match="lower --max-seq-len or --max-batch"):
        eng.new_state(64, slots=8)
    with pytest.raises(FreeTokenError, match="raise --vram-budget"):
        ServingEngine(eng, max_batch=8, start=False)
    with pytest.raises(FreeTokenError, match="more than the budget.*raise --vram-budget"):
        Engine(str(good / "m.ftw"), EngineConfig(vram_budget="1000"))
    with pytest.raises(FreeTokenError, match="--vram-budget"):
        EngineConfig(vram_budget="lots") and Engine(str(good / "m.ftw"), EngineConfig(vram_budget="lots"))


def _copy_checkpoint(good, tmp_path, name: str) -> str:
    import shutil
    d = tmp_path / name
    shutil.copytree(good / "hf", d)
    return str(d)


@pytest.mark.parametrize("fn,blob,needle", [
    ("tokenizer_config.json", b"[1, 2]", "expected a JSON object"),
    ("generation_config.json", b"{broken", "invalid JSON"),
    ("chat_template.json", b"not json", "invalid JSON"),
    ("chat_template.jinja", "{{ 'caf\u00e9' }}".encode("latin-1"), "not UTF-8"),
])
def test_side_files_the_engine_cannot_read_are_refused_at_convert(good, tmp_path, fn, blob, needle):
    src = _copy_checkpoint(good, tmp_path, "side")
    with open(os.path.join(src, fn), "wb") as f:
        f.write(blob)
    with pytest.raises(FreeTokenError, match=needle) as e:
        convert(src, str(tmp_path / "out.ftw"), progress=False)
    assert fn in str(e.value)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out.ftw")]  # nothing written


def test_config_that_is_not_an_object(good, tmp_path):
    src = _copy_checkpoint(good, tmp_path, "cfglist")
    with open(os.path.join(src, "config.json"), "w") as f:
        f.write("[]")
    code, _, err = ft_in("convert", src, str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, "config.json", "expected a JSON object")


def test_served_name_of_a_hugging_face_cache_snapshot(tmp_path):
    from freetoken.weights.convert import source_name
    assert source_name(str(tmp_path / "hub" / "models--Org--Tiny-MoE" / "snapshots" / "0123abcd")) == "Tiny-MoE"
    assert source_name(str(tmp_path / "Qwen3.6-35B-A3B") + "/") == "Qwen3.6-35B-A3B"
    assert source_name(str(tmp_path / "snapshots" / "abc")) == "abc"  # not a cache layout: the folder's name


def test_a_damaged_header_length_is_a_clear_error(good, tmp_path):
    import shutil
    from freetoken.weights.ftw import PREAMBLE
    bad = tmp_path / "hlen.ftw"
    shutil.copy(good / "m.ftw", bad)
    with open(bad, "r+b") as f:
        magic, version, _ = PREAMBLE.unpack(f.read(PREAMBLE.size))
        f.seek(0)
        f.write(PREAMBLE.pack(magic, version, 1 << 60))
    code, _, err = ft_in("generate", str(bad), "--prompt-ids", "1,2", "--max-tokens", "1")
    assert_one_line_error(code, err, "claims")


def test_sigterm_during_convert_exits_through_the_cleanup(monkeypatch, tmp_path):
    """SIGTERM / SIGHUP during `ft convert` raise SystemExit in the converting thread, so the
    writer's cleanup (which removes OUT.<pid>.partial on any exception) runs; the handlers are
    put back afterwards."""
    import signal
    import time

    import freetoken.weights.convert as conv
    from freetoken.cli import main
    seen = []

    def slow_convert(src, out, progress=True):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except BaseException as e:  # what FTWWriter's cleanup sees
            seen.append(type(e))
            raise
    monkeypatch.setattr(conv, "convert", slow_convert)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tmp_path / "src"), str(tmp_path / "o.ftw")])
    assert e.value.code == 128 + signal.SIGTERM and seen == [SystemExit]
    assert signal.getsignal(signal.SIGTERM) is before


def test_git_lfs_pointer_shards_say_so(good, tmp_path):
    src = _copy_checkpoint(good, tmp_path, "lfs")
    shard = next(fn for fn in os.listdir(src) if fn.endswith(".safetensors"))
    with open(os.path.join(src, shard), "w") as f:
        f.write("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 123456\n")
    code, _, err = ft_in("convert", src, str(tmp_path / "o.ftw"))
    assert_one_line_error(code, err, "Git LFS pointer", "git lfs pull")
