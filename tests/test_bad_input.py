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
])
def test_bad_generate_flags(good, args, needle):
    code, _, err = ft_in("generate", str(good / "m.ftw"), *args)
    assert_one_line_error(code, err, needle)


def test_model_path_errors(good, tmp_path):
    code, _, err = ft_in("generate", str(tmp_path / "nope.ftw"), "--prompt", "hi")
    assert_one_line_error(code, err, "nope.ftw")
    code, _, err = ft_in("generate", str(good / "hf"), "--prompt", "hi")
    assert_one_line_error(code, err, "ft convert")


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
