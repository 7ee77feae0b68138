"""First contact on an empty cache: processes started together share one demo generation and
one C++ build (the others wait and use the result), each step is announced once on stderr, a
broken demo cache file is regenerated, a busy port is refused before anything loads.

These run on their own empty XDG_CACHE_HOME, so the first test pays for a real demo generation
and a real C++ build (about a minute on two cores).
"""
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_fixture import Server
from test_bad_input import assert_one_line_error

DEMO_MSG = "ft: first run: generating the demo model"
BUILD_MSG = "ft: building the C++ expert executor"  # the waiting processes say "another process is ..."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fresh-cache"))


def ft_cmd(*args):
    return [sys.executable, "-m", "freetoken.cli", *args]


def run(cache, *args, timeout=300):
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    r = subprocess.run(ft_cmd(*args), capture_output=True, text=True, env=env, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def demo_file(cache):
    return os.path.join(cache, "freetoken", "demo-v1.ftw")


def test_concurrent_first_start(cache, monkeypatch):
    """Two `ft generate` and an `ft serve` at once on an empty cache: all three start."""
    assert not os.path.exists(os.path.join(cache, "freetoken"))
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    gens = [subprocess.Popen(ft_cmd("generate", "--prompt", "hi", "--max-tokens", "2", "--json"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    server = None
    try:
        server = Server()  # waits until /health answers
        outs = [p.communicate(timeout=300) for p in gens]
        for p, (out, err) in zip(gens, outs):
            assert p.returncode == 0, err
            res = json.loads(out)
            assert len(res["token_ids"]) == 2 and res["model"] == demo_file(cache)
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "freetoken-demo", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2})
        assert r.status_code == 200, r.text
        log = server.output()
    finally:
        for p in gens:
            if p.poll() is None:
                p.kill()
        if server is not None:
            server.stop()
    errs = [e for _, e in outs] + [log]
    everything = "\n".join(errs)
    assert "Traceback" not in everything and "bad magic" not in everything, everything
    # each first-run step announced once, by the process that did it
    assert everything.count(DEMO_MSG) == 1, everything
    assert everything.count(BUILD_MSG) == 1, everything
    left = os.listdir(os.path.join(cache, "freetoken"))
    assert "demo-v1.ftw" in left and not [f for f in left if f.endswith(".partial")], left
    # the banner: printed once listening, naming the expert backend, its ISA and threads
    banner = [l for l in log.splitlines() if "serving 'freetoken-demo'" in l]
    assert len(banner) == 1, log
    assert f":{server.port}/v1" in banner[0]
    assert " threads)" in banner[0] and ("experts on cpu (cpp, " in banner[0]
                                        or "experts on cpu (torch-fallback" in banner[0]), banner[0]


@pytest.fixture(scope="module")
def cached_run(cache):
    """One `ft generate --json` on the cache the first test filled: the tests below check what
    it says on stderr and compare their own runs' tokens with its (one process start for both)."""
    return run(cache, "generate", "--prompt", "hi", "--max-tokens", "3", "--json")


def test_cached_start_is_silent(cached_run):
    code, out, err = cached_run
    assert code == 0, err
    assert DEMO_MSG not in err and BUILD_MSG not in err, err
    res = json.loads(out)
    for key in ("device", "dtype", "experts", "expert_backend", "expert_isa", "expert_threads", "context"):
        assert key in res, key
    assert res["expert_backend"] in ("cpp", "torch-fallback") and res["expert_threads"] >= 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_broken_demo_cache_is_regenerated(cache, cached_run, damage, capsys, monkeypatch):
    """The engine made the demo file, so it remakes it (one warning line) instead of telling
    the user to re-run `ft convert`."""
    fn = demo_file(cache)
    code, ref, err = cached_run  # a run on the intact file, before any damage
    assert code == 0, err
    with open(fn, "r+b") as f:
        if damage == "flip":
            f.seek(os.path.getsize(fn) - 5000)  # inside the last bank: found by the checksums
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
        else:
            f.truncate(os.path.getsize(fn) // 2)  # found before loading, from the header
    code, out, err = run(cache, "generate", "--prompt", "hi", "--max-tokens", "3", "--json")
    assert code == 0, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("ft: warning: the cached demo model"), err
    assert "generating it again" in lines[0] and ("checksum" if damage == "flip" else "truncated") in lines[0]
    assert json.loads(out)["token_ids"] == json.loads(ref)["token_ids"]  # the same model again
    # the remade file is used as it is from now on (main() in this process: one `ft` process
    # start less)
    from freetoken.cli import main
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    capsys.readouterr()
    code = main(["generate", "--prompt", "hi", "--max-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 0 and "warning" not in err, err


def test_stale_torch_build_lock_does_not_hang(cache):
    """A build killed midway leaves torch's `lock` file; torch alone would wait on it forever."""
    builds = os.path.join(cache, "freetoken", "build")
    (sub,) = os.listdir(builds)
    open(os.path.join(builds, sub, "lock"), "w").close()
    code, _, err = run(cache, "-v", "generate", "--prompt", "hi", "--max-tokens", "2", timeout=120)
    assert code == 0, err
    assert "left by a build that did not finish" in err
    assert not os.path.exists(os.path.join(builds, sub, "lock"))


def test_busy_port_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """One line, exit 2, and nothing loaded or generated first (the cache stays empty)."""
    from freetoken.cli import main
    empty = str(tmp_path / "empty-cache")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        code, _, err = run(empty, "serve", "--port", str(port), timeout=120)
        # -v after the subcommand is accepted too (main() in this process: a second `ft` process
        # would add seconds of imports and nothing else)
        monkeypatch.setenv("XDG_CACHE_HOME", empty)
        capsys.readouterr()
        code_v = main(["serve", "-v", "--port", str(port)])
        err_v = capsys.readouterr().err
    assert_one_line_error(code, err, f"port {port} on 127.0.0.1 is in use", "--port")
    assert code_v == 2 and f"port {port} on 127.0.0.1 is in use" in err_v and "unrecognized" not in err_v
    assert not os.path.exists(demo_file(empty)), "the model was prepared before the port was checked"
    assert time.time() - t0 < 60
