"""What users of vLLM and llama.cpp bring with them: a container's CPU and memory limits, their
flag names, a hub model id from the local Hugging Face cache, a GGUF path, server-wide template
defaults, several served names, /v1/tokenize."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from freetoken import cli, limits
from freetoken.errors import FreeTokenError
from freetoken.server import common, openai
from freetoken.server.common import ApiError
from freetoken.server.template import QWEN3_TEMPLATE, ChatTemplate


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _v2_tree(root, cg="/", files=None):
    """A fake /proc/self and a cgroup2 mount at /sys/fs/cgroup, the process in cgroup `cg`."""
    _write(f"{root}/proc/self/mountinfo",
           "22 1 0:20 / / rw - ext4 /dev/sda1 rw\n"
           "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    _write(f"{root}/proc/self/cgroup", f"0::{cg}\n")
    for rel, text in (files or {}).items():
        _write(f"{root}/sys/fs/cgroup/{rel}", text)
    return str(root)


def _v1_tree(root, cg, files):
    """cgroup v1: cpu and memory hierarchies mounted apart, the process in `cg` in both."""
    _write(f"{root}/proc/self/mountinfo",
           "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
           "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    _write(f"{root}/proc/self/cgroup", f"4:memory:{cg}\n2:cpu,cpuacct:{cg}\n0::/\n")
    for rel, text in files.items():
        _write(f"{root}/sys/fs/cgroup/{rel}", text)
    return str(root)


def test_cgroup_v2_limits_take_the_tightest_on_the_path(tmp_path):
    root = _v2_tree(tmp_path, "/kube/pod1", {
        "cpu.max": "max 100000",  # the root: none
        "kube/cpu.max": "250000 100000",  # a parent's 2.5 CPUs bind the child
        "kube/pod1/cpu.max": "600000 100000",
        "kube/pod1/memory.max": str(8 << 30),
        "kube/pod1/memory.current": str(3 << 30),
        "kube/pod1/memory.stat": f"anon 123\nfile {1 << 30}\nactive_file {1 << 29}\ninactive_file {1 << 29}\n",
        "kube/memory.max": "max",
    })
    assert limits.cpu_quota(root) == pytest.approx(2.5)
    assert limits.cpu_limit(root) == 3  # whole CPUs: a pool of 3 uses the quota
    # 8 GiB limit, 3 GiB charged of which 1 GiB is page cache the kernel reclaims first
    assert limits.memory_left(root) == (8 << 30) - (2 << 30)


def test_cgroup_v2_without_limits_and_no_cgroup_at_all(tmp_path):
    root = _v2_tree(tmp_path / "a", "/", {"cpu.max": "max 100000", "memory.max": "max", "memory.current": "5"})
    assert limits.cpu_quota(root) is None and limits.memory_left(root) is None
    os.makedirs(tmp_path / "b")
    assert limits.cpu_limit(str(tmp_path / "b")) is None and limits.memory_left(str(tmp_path / "b")) is None


def test_cgroup_v1_quota_and_memory_limit(tmp_path):
    root = _v1_tree(tmp_path, "/docker/abc", {
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1",
        "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "memory/docker/abc/memory.limit_in_bytes": str(4 << 30),
        "memory/docker/abc/memory.usage_in_bytes": str(1 << 30),
        "memory/docker/abc/memory.stat": f"cache 10\ntotal_active_file {1 << 29}\ntotal_inactive_file {1 << 29}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "memory/memory.usage_in_bytes": "1",
    })
    assert limits.cpu_quota(root) == pytest.approx(1.5)
    assert limits.cpu_limit(root) == 2
    assert limits.memory_left(root) == 4 << 30


def test_cpu_defaults_and_host_memory_keep_to_the_container(monkeypatch):
    from freetoken.experts import cpu
    from freetoken.runtime import budget
    monkeypatch.setattr(limits, "process_cpu_limit", lambda: None)
    free = cpu.physical_cores()
    monkeypatch.setattr(limits, "process_cpu_limit", lambda: 1)
    assert cpu.physical_cores() == free[:1]
    assert cpu.pool_cpus(0) == free[:1]
    monkeypatch.setattr(limits, "memory_left", lambda: None)
    host = budget.host_available()
    assert host > 0
    monkeypatch.setattr(limits, "memory_left", lambda: 12345)
    assert budget.host_available() == 12345
    monkeypatch.setattr(limits, "memory_left", lambda: host * 4)
    assert budget.host_available() <= host * 1.5  # MemAvailable still bounds it (it moves a little)


def test_quota_unpins_the_pool(monkeypatch):
    """Under a binding quota the executor's workers are not pinned (cpu -1: the scheduler places
    them), the default count keeps to the quota."""
    from freetoken.experts import cpu
    if cpu.extension() is None:
        pytest.skip("no C++ executor here")
    made = []
    real = cpu.extension()

    class Ext:
        def __getattr__(self, name):
            return getattr(real, name)

        def create(self, cpus, isa, spin):
            made.append(list(cpus))
            return real.create(cpus, isa, spin)
    monkeypatch.setattr(cpu, "extension", lambda: Ext())
    gate_up, down = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    monkeypatch.setattr(limits, "process_cpu_limit", lambda: 1)
    if not limits.quota_binds():
        pytest.skip("one CPU here: a quota of 1 does not bind")
    ex = cpu.CpuExpertExecutor(gate_up, down)
    assert made[-1] == [-1] and ex.threads == 1
    monkeypatch.setattr(limits, "process_cpu_limit", lambda: None)
    cpu.CpuExpertExecutor(gate_up, down)
    assert made[-1] == cpu.physical_cores() and -1 not in made[-1]


def test_ignore_cpu_quota_switch(monkeypatch):
    limits.process_cpu_limit.cache_clear()
    monkeypatch.setenv("FREETOKEN_IGNORE_CPU_QUOTA", "1")
    try:
        assert limits.process_cpu_limit() is None
    finally:
        limits.process_cpu_limit.cache_clear()


def _parse(*argv):
    args = cli.build_parser().parse_args(list(argv))
    cli.merge_model_args(args)
    return args


def test_vllm_and_llamacpp_flag_names():
    a = _parse("serve", "-m", "m.ftw", "--max-model-len", "4096", "-t", "3", "--gpu-memory-utilization", "0.8",
               "--max-num-seqs", "2", "--max-num-batched-tokens", "1024")
    assert (a.model, a.max_seq_len, a.cpu_threads, a.vram_budget, a.max_batch, a.max_step_tokens) == \
        ("m.ftw", 4096, 3, "0.8", 2, 1024)
    a = _parse("serve", "--model", "m.ftw", "-c", "8192", "--threads", "5", "-np", "3")
    assert (a.model, a.max_seq_len, a.cpu_threads, a.max_batch) == ("m.ftw", 8192, 5, 3)
    a = _parse("generate", "--ctx-size", "100", "--prompt", "x", "m.ftw")
    assert (a.model, a.max_seq_len) == ("m.ftw", 100)
    assert _parse("bench", "bw", "-m", "x.ftw").model == "x.ftw"
    assert _parse("serve", "m.ftw", "--model", "m.ftw").model == "m.ftw"  # the same one twice is fine
    with pytest.raises(FreeTokenError, match="two models given"):
        _parse("serve", "a.ftw", "--model", "b.ftw")


def test_served_names_and_template_defaults_flags(capsys):
    a = _parse("serve", "--served-model-name", "qwen,qwen-coder", "--served-model-name", "gpt-4o",
               "--served-model-name", "qwen", "--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert cli.served_names(a.served_model_name) == ["qwen", "qwen-coder", "gpt-4o"]
    v = _parse("serve", "m.ftw", "--served-model-name", "a", "b", "--port", "1")  # vLLM's form
    assert cli.served_names(v.served_model_name) == ["a", "b"] and v.model == "m.ftw"
    cli.check_served_names(v)
    with pytest.raises(FreeTokenError, match="is a model path; put MODEL before the flag"):
        cli.check_served_names(_parse("serve", "--served-model-name", "a", "m.ftw"))
    assert a.default_chat_template_kwargs == {"enable_thinking": False}
    assert _parse("serve", "--chat-template-kwargs", "{}").default_chat_template_kwargs == {}
    for bad, says in (("{nope", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(SystemExit) as e:
            _parse("serve", "--default-chat-template-kwargs", bad)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_hub_ids_resolve_from_the_local_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    repo = hub / "models--Org--Model-A3B"
    old, new = repo / "snapshots" / "c0ffee", repo / "snapshots" / "decaf"
    for snap in (old, new):
        _write(str(snap / "model.ftw"), "x")
    _write(str(repo / "refs" / "main"), "c0ffee\n")  # refs/main names the older one: it wins over mtime
    assert cli.resolve_model("Org/Model-A3B") == str(old / "model.ftw")
    assert cli.resolve_model(str(repo)) == str(old / "model.ftw")  # the repo folder given as it is
    os.remove(repo / "refs" / "main")
    os.utime(old, (1, 1))
    assert cli.resolve_model("Org/Model-A3B") == str(new / "model.ftw")  # else the newest snapshot
    with pytest.raises(FreeTokenError, match="no such file or folder; as a Hugging Face model id .*does not download"):
        cli.resolve_model("Org/Missing")
    assert cli.default_names("Org/Model-A3B", "Model-A3B") == ["Org/Model-A3B", "Model-A3B"]  # vLLM's id first
    assert cli.default_names(str(old / "model.ftw"), "Model-A3B") == ["Model-A3B"]
    assert cli.default_names(None, None) == [cli.DEMO_NAME]
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert cli.hf_hub_cache() == str(tmp_path / "home" / "hub")
    # a local relative path that exists is a path, not a hub id; a mistyped one is a missing path
    monkeypatch.chdir(tmp_path)
    _write(str(tmp_path / "Org" / "local.ftw"), "x")
    assert cli.resolve_model("Org/local.ftw") == "Org/local.ftw"
    for typo in ("Org/lokal.ftw", "Org/Qwen3", "models/foo.ftw"):
        with pytest.raises(FreeTokenError, match="no such model file"):
            cli.resolve_model(typo)


def test_gguf_is_refused_with_what_to_do(tmp_path):
    g = tmp_path / "model-Q4_K_M.gguf"
    g.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(FreeTokenError, match="GGUF files are not supported; serve the model's safetensors"):
        cli.resolve_model(str(g))
    with pytest.raises(FreeTokenError, match="holds GGUF files, which are not supported"):
        cli.resolve_model(str(tmp_path))


def test_api_key_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("FREETOKEN_API_KEY", "env-key")
    assert cli.api_keys_of(_parse("serve")) == ("env-key",)
    assert "requiring the API key in $FREETOKEN_API_KEY" in capsys.readouterr().err
    assert cli.api_keys_of(_parse("serve", "--api-key", "")) == ()  # '' serves without a key
    assert cli.api_keys_of(_parse("serve", "--api-key", "k")) == ("k",)
    monkeypatch.delenv("FREETOKEN_API_KEY")
    assert cli.api_keys_of(_parse("serve")) == ()


def test_api_keys_several_and_from_a_file(tmp_path, monkeypatch):
    """llama.cpp's forms: --api-key a,b and --api-key-file (one key a line), either's keys; the
    environment's key only when neither is given; a missing or empty file is one clear error."""
    monkeypatch.setenv("FREETOKEN_API_KEY", "env-key")
    f = tmp_path / "keys"
    f.write_text("# team keys\nk1\n\n  k2  \nk1\n")
    assert cli.api_keys_of(_parse("serve", "--api-key", "a, b,")) == ("a", "b")
    assert cli.api_keys_of(_parse("serve", "--api-key-file", str(f))) == ("k1", "k2")
    assert cli.api_keys_of(_parse("serve", "--api-key", "a", "--api-key-file", str(f))) == ("a", "k1", "k2")
    with pytest.raises(FreeTokenError, match="--api-key-file .*missing: cannot read it"):
        cli.api_keys_of(_parse("serve", "--api-key-file", str(tmp_path / "missing")))
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(FreeTokenError, match="the file holds no key"):
        cli.api_keys_of(_parse("serve", "--api-key-file", str(tmp_path / "empty")))
    # a setting that names no key is an error, not a server open to all; only --api-key '' is that
    for bad in ((",",), (" , ",)):
        with pytest.raises(FreeTokenError, match="names no key"):
            cli.api_keys_of(_parse("serve", "--api-key", *bad))
    with pytest.raises(FreeTokenError, match="empty file name"):
        cli.api_keys_of(_parse("serve", "--api-key-file", ""))
    (tmp_path / "bom").write_bytes("\ufeffk-bom\n".encode("utf-8"))
    assert cli.api_keys_of(_parse("serve", "--api-key-file", str(tmp_path / "bom"))) == ("k-bom",)


def test_any_of_several_keys_authorizes(monkeypatch):
    """The server takes any of its keys, as a bearer token or x-api-key; a wrong, empty or
    missing key is a 401 in the API's error shape; no keys: no check. (/v1/models needs no
    model: a stand-in engine and tokenizer.)"""
    from fastapi.testclient import TestClient
    from freetoken.server import app as server_app
    from freetoken.server.app import ServerContext, build_app
    monkeypatch.setattr(server_app, "TokenText", lambda tok: None)
    serving = SimpleNamespace(describe=lambda: {}, max_len=4096)
    tok = SimpleNamespace()
    app = build_app(ServerContext(serving, tok, ChatTemplate(None), ["m"], 100, api_keys=("k1", "k2")))
    c = TestClient(app)
    assert c.get("/v1/models", headers={"authorization": "Bearer k2"}).status_code == 200
    assert c.get("/v1/models", headers={"x-api-key": "k1"}).status_code == 200
    # a key with non-ASCII characters, sent as its UTF-8 bytes (httpx takes bytes header values)
    utf = TestClient(build_app(ServerContext(serving, tok, ChatTemplate(None), ["m"], 100, api_keys=("clé",))))
    assert utf.get("/v1/models", headers={"x-api-key": "clé".encode()}).status_code == 200
    for h in ({"authorization": "Bearer k3"}, {"authorization": "Bearer "}, {"x-api-key": "k"}, {}):
        r = c.get("/v1/models", headers=h)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", h
    open_app = TestClient(build_app(ServerContext(serving, tok, ChatTemplate(None), ["m"], 100)))
    assert open_app.get("/v1/models").status_code == 200


def _ctx(defaults=None):
    return SimpleNamespace(template=ChatTemplate(QWEN3_TEMPLATE), default_template_kwargs=defaults or {},
                           model_names=["m"], vocab_size=100, serving=SimpleNamespace(max_len=4096))


MSGS = [{"role": "user", "content": "hi"}]


def test_server_template_defaults_under_the_request():
    """Chat completions' plan renders with the server's defaults under the request's own keys."""
    def prompt(defaults, **body):
        return openai._chat_plan(_ctx(defaults), {"model": "m", "messages": MSGS, **body})
    plain, off = common.render(_ctx(), MSGS, None), common.render(_ctx(), MSGS, None, {"enable_thinking": False})
    assert off != plain and off.rstrip().endswith("</think>")
    seen = []
    import freetoken.server.openai as o
    real = o.render
    try:
        o.render = lambda ctx, m, t, kw, **k: seen.append(kw) or real(ctx, m, t, kw, **k)
        for defaults, body, want in (({"enable_thinking": False}, {}, {"enable_thinking": False}),
                                     ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": True}},
                                      {"enable_thinking": True}),
                                     ({"enable_thinking": False}, {"reasoning_effort": "high"},
                                      {"enable_thinking": True, "reasoning_effort": "high"}),
                                     ({"add_generation_prompt": False}, {}, {})):
            seen.clear()
            try:
                prompt(defaults, **body)
            except Exception:  # past rendering, the stub context has no tokenizer
                pass
            assert seen == [want]
    finally:
        o.render = real


def test_defaults_merge_once_for_prompt_and_probes():
    ctx = _ctx({"enable_thinking": False, "add_generation_prompt": False})
    assert common.with_defaults(ctx, {}) == {"enable_thinking": False}  # what the renderer owns dropped
    assert common.with_defaults(ctx, {"enable_thinking": True, "x": 1}) == {"enable_thinking": True, "x": 1}


def test_chat_reasoning_effort():
    assert common.effort_kwargs(None) == {}
    assert common.effort_kwargs("minimal") == {"enable_thinking": False}
    assert common.effort_kwargs("xhigh") == {"enable_thinking": True, "reasoning_effort": "high"}
    body = {"model": "m", "messages": MSGS, "reasoning_effort": "extreme"}
    with pytest.raises(ApiError, match="reasoning_effort must be one of none, minimal"):
        openai._chat_plan(_ctx(), body)


def test_cuda_load_refuses_a_file_larger_than_host_memory(tmp_path, monkeypatch, caplog):
    from freetoken.runtime import budget
    from freetoken.runtime.engine import Engine
    f = tmp_path / "big.ftw"
    f.write_bytes(os.urandom(4096))
    monkeypatch.setattr(budget, "host_available", lambda: 1 << 20)
    monkeypatch.setattr(limits, "memory_left", lambda: 1000)  # a container's hard limit: refused
    with pytest.raises(FreeTokenError, match=r"takes 0.0 GB of host memory .* container's memory limit leaves"):
        Engine._check_host_fits(str(f))
    monkeypatch.setattr(limits, "memory_left", lambda: 0)  # at its limit already
    with pytest.raises(FreeTokenError):
        Engine._check_host_fits(str(f))
    monkeypatch.setattr(limits, "memory_left", lambda: None)
    Engine._check_host_fits(str(f))
    monkeypatch.setattr(budget, "host_available", lambda: 1000)  # MemAvailable alone: a warning, tried
    with caplog.at_level("WARNING", logger="freetoken"):
        Engine._check_host_fits(str(f))
    assert "the load may fail or swap" in caplog.text


def test_cache_flags_outside_the_cache_are_said(caplog):
    from freetoken.runtime.engine import Engine, EngineConfig
    eng = SimpleNamespace(experts_on="cpu", ecfg=EngineConfig(moe="cpu", expert_cache="8GiB", fill_share="0.5"))
    with caplog.at_level("WARNING", logger="freetoken"):
        Engine._warn_cache_flags_unused(eng)
    assert "--expert-cache 8GiB, --fill-share 0.5: no effect, the experts run on the CPU here" in caplog.text
    caplog.clear()
    for on, cfg in (("cache", EngineConfig(expert_cache="8GiB")), ("gpu", EngineConfig(fill_share="AUTO"))):
        with caplog.at_level("WARNING", logger="freetoken"):
            Engine._warn_cache_flags_unused(SimpleNamespace(experts_on=on, ecfg=cfg))
    assert caplog.text == ""


def test_launch_client_args_after_flags(monkeypatch):
    """`ft launch codex --port N -- exec ...`: a flag between the client and `--` kept its ARGS
    (argparse dropped them: 'unrecognized arguments')."""
    seen = []

    def fake_launch(args):
        seen.append((args.client, args.port, args.client_args))
        return 0
    monkeypatch.setattr(cli, "cmd_launch", fake_launch)
    want = ("codex", 8144, ["exec", "--skip-git-repo-check", "say hi"])
    for argv in (["launch", "codex", "--port", "8144", "--", "exec", "--skip-git-repo-check", "say hi"],
                 ["launch", "--port", "8144", "codex", "--", "exec", "--skip-git-repo-check", "say hi"]):
        assert cli.main(argv) == 0 and seen.pop() == want
    assert cli.main(["launch", "codex", "--", "--port", "1"]) == 0 and seen.pop() == ("codex", 8000, ["--port", "1"])
    args = cli.build_parser().parse_args(["generate", "--prompt", "launch", "--", "m.ftw"])  # not launch's
    assert args.cmd == "generate" and args.model == "m.ftw"
