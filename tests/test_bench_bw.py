"""`ft bench bw`: measures on the model's expert shape without loading the model, prints JSON
(or a table), saves a profile the engine can read back (load_profile), refuses bad input in
one line; a corrupt, missing or foreign profile reads as None with a log line."""
import json
import logging
import os
import subprocess
import sys

import pytest

import hf_models
import quant_models
from test_bad_input import assert_one_line_error
from freetoken.config import ModelConfig
from freetoken.runtime import bandwidth
from freetoken.weights.convert import convert
from freetoken.weights.ftw import read_header


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bw")
    hf_models.save(hf_models.qwen3_moe(3, max_position_embeddings=64), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return d


_RUN = {}


@pytest.fixture
def measured(tiny):
    """One real run (default profile path), shared by the tests. Function-scoped but run once:
    it must see conftest's per-test cache folder (XDG_CACHE_HOME), where the engine looks."""
    if "out" not in _RUN:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "freetoken.cli", "bench", "bw", str(tiny / "m.ftw"), "--json",
                            "--seconds", "0.5"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        _RUN["out"] = json.loads(r.stdout), r.stderr
    return _RUN["out"]


def cfg_of(path):
    return ModelConfig.from_hf(read_header(str(path))[0]["config"], str(path))


def test_json_numbers_and_profile(tiny, measured):
    prof, err = measured
    assert "ft bench bw: [1/" in err  # the progress lines
    assert prof["B_H"] > 0 and prof["cpu_fixed_us"] > 0 and prof["cpu_call_us"] > 0
    if not __import__("torch").cuda.is_available():
        assert prof["B_P"] is None and prof["B_P_concurrent"] is None and prof["B_H_concurrent"] is None
        assert prof["predicted_fill_share"] == 1.0  # no link measured: fill-only
    cfg = cfg_of(tiny / "m.ftw")
    m = prof["model"]
    fmt = {"float32": "f32", "bfloat16": "bf16"}[read_header(str(tiny / "m.ftw"))[1]["experts.gate_up"].dtype]
    assert (m["hidden"], m["inter"], m["top_k"], m["format"]) == (cfg.hidden_size, cfg.moe_intermediate_size,
                                                                 cfg.top_k, fmt)
    assert prof["bank"]["experts"] >= 64 and prof["machine"]["cpu"] and prof["date"]
    # saved where the engine looks, atomically (no temp file left), and read back
    assert prof["profile"] == bandwidth.profile_path(cfg, fmt, prof["threads"])
    assert not [f for f in os.listdir(os.path.dirname(prof["profile"])) if f.endswith(".partial")]
    back = bandwidth.load_profile(cfg, prof["threads"], fmt)
    assert back is not None and back["B_H"] == prof["B_H"]
    assert 0.0 <= bandwidth.predicted_share(back) <= 1.0


def test_predicted_share():
    base = {"model": {"moe_layers": 40, "top_k": 8, "expert_bytes": 3 << 20}, "cpu_fixed_us": 20.0,
            "B_P": 50.0, "B_H": 10.0}
    assert bandwidth.predicted_share({**base, "B_P": None}) == 1.0  # no CUDA
    r = bandwidth.predicted_share({**base, "B_P_concurrent": 40.0, "B_H_concurrent": 10.0})
    assert r == pytest.approx(0.8)  # the concurrent numbers win
    assert bandwidth.predicted_share(base) == pytest.approx(50 / 60)
    # a fixed cost per call that eats what the split saves: fill-only
    assert bandwidth.predicted_share({**base, "cpu_fixed_us": 5000.0}) == 1.0


def test_bad_profiles_read_as_none(tiny, measured, tmp_path, caplog):
    cfg = cfg_of(tiny / "m.ftw")
    threads, fmt = measured[0]["threads"], measured[0]["model"]["format"]
    caplog.set_level(logging.INFO, logger="freetoken.bandwidth")
    assert bandwidth.load_profile(cfg, threads, fmt, path=str(tmp_path / "none.json")) is None
    assert "no bandwidth profile" in caplog.text and "ft bench bw" in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "B_H": ')
    caplog.clear()
    assert bandwidth.load_profile(cfg, threads, fmt, path=str(bad)) is None
    assert "unreadable" in caplog.text and str(bad) in caplog.text
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**measured[0], "threads": threads + 1}))
    caplog.clear()
    assert bandwidth.load_profile(cfg, threads, fmt, path=str(other)) is None
    assert "CPU threads" in caplog.text


def test_out_and_table(tiny, tmp_path):
    out = tmp_path / "sub" / "p.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "bench", "bw", str(tiny / "m.ftw"), "--seconds", "0.2",
                        "--threads", "1", "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "B_H  CPU executor" in r.stdout and str(out) in r.stdout
    assert json.loads(out.read_text())["threads"] == 1


def test_int8_profile_is_the_engines_for_int8(tiny, tmp_path, caplog):
    """`--cpu-act int8` on an MXFP4 model: B_H is the int8 kernels' (the profile says which path
    it measured), saved under its own name beside the exact one; the engine's load_profile finds
    it only for an int8 executor and tells an exact one why not. On float banks int8 does not
    apply: the profile says exact, with a note."""
    d = tmp_path / "q"
    quant_models.write(hf_models.qwen3_moe(5, max_position_embeddings=64), str(d / "hf"), "mxfp4")
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def bw(model, *extra):
        r = subprocess.run([sys.executable, "-m", "freetoken.cli", "bench", "bw", str(model), "--json", "--seconds",
                            "0.2", "--threads", "1", *extra], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    prof = bw(d / "m.ftw", "--cpu-act", "int8")
    cfg = cfg_of(d / "m.ftw")
    assert prof["model"]["format"] == "mxfp4" and prof["B_H"] > 0
    if prof["backend"] != "cpp":
        pytest.skip("no C++ executor here: int8 does not apply")
    assert prof["cpu_act"] in ("int8", "int8-scalar")
    assert prof["profile"] == bandwidth.profile_path(cfg, "mxfp4", 1, prof["cpu_act"])
    assert prof["profile"] != bandwidth.profile_path(cfg, "mxfp4", 1)  # the exact one keeps its name
    back = bandwidth.load_profile(cfg, 1, "mxfp4", act=prof["cpu_act"])
    assert back is not None and back["B_H"] == prof["B_H"]
    caplog.set_level(logging.INFO, logger="freetoken.bandwidth")
    assert bandwidth.load_profile(cfg, 1, "mxfp4", path=prof["profile"]) is None  # an exact executor
    assert "CPU activations" in caplog.text and "--cpu-act" in caplog.text
    dense = bw(tiny / "m.ftw", "--cpu-act", "int8")  # float banks: measured exact, said so
    assert dense["cpu_act"] == "exact" and any("--cpu-act int8" in n for n in dense["notes"])


@pytest.mark.parametrize("args,needle", [
    (["--seconds", "0"], "--seconds"),
    (["--seconds", "inf"], "--seconds"),
    (["--threads", "-1"], "--threads"),
    (["/nonexistent/m.ftw"], "no such model file"),
])
def test_bad_arguments(tiny, args, needle, capsys):
    """In process (main() is what `ft` runs; a subprocess each would cost seconds of imports)."""
    from freetoken.cli import main
    if args[0].startswith("--"):
        args = [str(tiny / "m.ftw"), *args]
    code = main(["bench", "bw", *args])
    assert_one_line_error(code, capsys.readouterr().err, needle)
