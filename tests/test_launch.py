"""`ft launch`: each client's configuration against its documented format, `--print`, starting,
reusing and stopping a server, and the not-installed error.

The clients themselves are not needed here: a stand-in executable named like each client
records the arguments and environment it was run with and, like the real client would, reads
its configuration and sends one request to the server with it. (Real runs of the real clients
are recorded in docs/clients.md.)
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import tomllib

import httpx
import pytest

from freetoken import launch
from freetoken.cli import main
from server_fixture import Server, free_port

T = launch.Target("http://127.0.0.1:8123", "org/Model-1", "ft-secret", 65536, 4096)


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """Every folder a client configuration could be written to, inside tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex"))
    monkeypatch.delenv("OPENCODE_CONFIG_CONTENT", raising=False)
    return tmp_path


# ---- each client's configuration ---------------------------------------------------------

def test_claude_code_settings(homes):
    s = launch.claude_setup(T)
    (path, text), = s.files.items()
    assert path.startswith(str(homes / "cache" / "freetoken" / "launch"))  # not ~/.claude/settings.json
    assert s.args == ["--settings", path]
    settings = json.loads(text)
    assert settings["model"] == T.model and settings["env"] == s.env
    env = s.env
    assert env["ANTHROPIC_BASE_URL"] == T.url  # Claude Code appends /v1/messages itself
    assert env["ANTHROPIC_AUTH_TOKEN"] == T.api_key
    for var in ["ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"]:
        assert env[var] == T.model, var
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert all(isinstance(v, str) for v in env.values())  # settings.json env values are strings
    assert "ANTHROPIC_API_KEY" in s.unset and "ANTHROPIC_API_KEY" not in env


# keys of Codex 0.171's config.toml (ConfigToml) and of a model provider (ModelProviderInfo)
# that a profile may set, as the binary's config schema names them
CODEX_TOP = {"model", "model_provider", "model_context_window", "model_auto_compact_token_limit",
             "model_providers", "web_search", "agents", "review_model", "approval_policy", "sandbox_mode"}
CODEX_PROVIDER = {"name", "base_url", "env_key", "env_key_instructions", "wire_api", "query_params",
                  "http_headers", "env_http_headers", "request_max_retries", "stream_max_retries",
                  "stream_idle_timeout_ms", "requires_openai_auth", "supports_websockets"}


def test_codex_profile(homes):
    s = launch.codex_setup(T)
    (path, text), = s.files.items()
    assert path == str(homes / "codex" / "freetoken.config.toml")  # a profile file, not config.toml
    assert s.args == ["--profile", "freetoken"]
    assert text.splitlines()[0].startswith("# " + launch.MARKER)
    cfg = tomllib.loads(text)
    assert set(cfg) <= CODEX_TOP
    assert cfg["model"] == T.model and cfg["model_provider"] == "freetoken"
    assert cfg["model_context_window"] == 65536
    assert 0 < cfg["model_auto_compact_token_limit"] <= 65536 - 4096
    assert cfg["web_search"] == "disabled" and "agents" not in cfg  # sub-agents' namespace tool is taken
    p = cfg["model_providers"]["freetoken"]
    assert set(p) <= CODEX_PROVIDER
    assert p["base_url"] == T.v1  # Codex appends /responses
    assert p["wire_api"] == "responses" and p["requires_openai_auth"] is False
    assert s.env == {p["env_key"]: T.api_key}


def test_codex_profile_escapes_strings(homes):
    odd = launch.Target(T.url, 'we"ird\\name\u00e9', "k", 1000, 100)
    assert tomllib.loads(launch.codex_setup(odd).files.popitem()[1])["model"] == odd.model


def test_opencode_config(homes, monkeypatch):
    monkeypatch.setenv("OPENCODE_CONFIG_CONTENT", json.dumps({"theme": "mine", "model": "other/x"}))
    s = launch.opencode_setup(T)
    (path, text), = s.files.items()
    assert s.env["OPENCODE_CONFIG"] == path and path.startswith(str(homes / "cache"))
    cfg = json.loads(text)
    assert cfg["$schema"] == "https://opencode.ai/config.json"
    p = cfg["provider"]["freetoken"]
    assert p["npm"] == "@ai-sdk/openai-compatible"
    assert p["options"] == {"baseURL": T.v1, "apiKey": T.api_key}
    m = p["models"][T.model]
    assert m["limit"] == {"context": 65536, "output": 4096} and m["tool_call"] is True
    assert cfg["model"] == cfg["small_model"] == "freetoken/org/Model-1"  # provider/model
    inline = json.loads(s.env["OPENCODE_CONFIG_CONTENT"])  # outranks a project's opencode.json
    assert inline == {"theme": "mine", "model": "freetoken/org/Model-1", "small_model": "freetoken/org/Model-1"}
    assert s.args == [] and s.unset == ()


def test_openclaw_config(homes):
    s = launch.openclaw_setup(T)
    (path, text), = s.files.items()
    assert s.env["OPENCLAW_CONFIG_PATH"] == path and path.startswith(str(homes / "cache"))
    assert s.env["OPENCLAW_STATE_DIR"].startswith(str(homes / "cache"))  # not ~/.openclaw
    assert "OPENCLAW_PROFILE" in s.unset
    cfg = json.loads(text)
    assert cfg["models"]["mode"] == "merge"
    p = cfg["models"]["providers"]["freetoken"]
    assert p["baseUrl"] == T.v1 and p["apiKey"] == T.api_key and p["api"] == "openai-completions"
    (m,) = p["models"]
    assert m["id"] == T.model and m["contextWindow"] == 65536 and m["maxTokens"] == 4096
    assert m["input"] == ["text"] and set(m["cost"]) == {"input", "output", "cacheRead", "cacheWrite"}
    assert cfg["agents"]["defaults"]["model"]["primary"] == "freetoken/org/Model-1"
    assert s.default_args == ["chat"]  # the terminal UI on the embedded agent


def test_notes_name_the_users_own_settings_left_out(homes, monkeypatch):
    for f in (launch.claude_setup, launch.opencode_setup, launch.openclaw_setup, launch.codex_setup):
        assert f(T).notes == []
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-mine")
    monkeypatch.setenv("OPENCODE_CONFIG", "/home/me/oc.json")
    monkeypatch.setenv("OPENCLAW_PROFILE", "work")
    assert "ANTHROPIC_API_KEY is left out" in launch.claude_setup(T).notes[0]
    assert "/home/me/oc.json" in launch.opencode_setup(T).notes[0]
    assert "your OPENCLAW_PROFILE is not used" in launch.openclaw_setup(T).notes[0]


def test_auto_compact_leaves_room_for_a_reply():
    assert launch.auto_compact_limit(launch.Target("u", "m", "k", 65536, 256)) == int(65536 * 0.9)
    assert launch.auto_compact_limit(launch.Target("u", "m", "k", 8192, 4096)) == 4096


# ---- files and key -------------------------------------------------------------------------

def test_files_not_ours_are_backed_up(homes):
    codex = homes / "codex"
    codex.mkdir()
    theirs = codex / "freetoken.config.toml"
    theirs.write_text('model = "mine"\n')
    s = launch.codex_setup(T)
    said = launch.write_files(s.files)
    assert len(said) == 1 and "kept a copy" in said[0]
    (bak,) = [p for p in codex.iterdir() if ".bak-" in p.name]
    assert bak.read_text() == 'model = "mine"\n'
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o600
    assert tomllib.loads(theirs.read_text())["model"] == T.model
    assert launch.write_files(s.files) == []  # ours now: rewritten without another copy
    assert len([p for p in codex.iterdir() if ".bak-" in p.name]) == 1


def test_api_key_is_random_and_kept(homes):
    k = launch.api_key()
    assert k.startswith("ft-") and len(k) > 20
    assert launch.api_key() == k
    path = homes / "cache" / "freetoken" / "launch" / "api-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert str(path) == launch.api_key_path()
    path.write_text("")  # left empty by an ft launch that died mid-write: made again
    k2 = launch.api_key()
    assert k2.startswith("ft-") and k2 != k and path.read_text().strip() == k2
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".api-key-")]  # no temporary left


def test_api_key_made_once_by_concurrent_launches(homes):
    """ft launch processes starting together all get the one key the file ends with (the key
    their servers read from it): made whole, then linked into place."""
    import concurrent.futures
    import subprocess
    import sys
    code = "from freetoken import launch; print(launch.api_key())"
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda _: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                      env=dict(os.environ)).stdout.strip(), range(6)))
    path = homes / "cache" / "freetoken" / "launch" / "api-key"
    assert len(set(outs)) == 1 and outs[0] == path.read_text().strip() and outs[0].startswith("ft-")


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_last_user_stops_a_server_ft_launch_started(homes):
    """The ft launch that started the server may leave first: the last one stops it."""
    fake_server, other = _sleeper(), _sleeper()
    try:
        s = launch.Server(free_port())
        s.managed = True
        s._save({"pid": fake_server.pid, "users": [os.getpid(), other.pid]})
        s.release()  # another ft launch (other) still uses it
        assert fake_server.poll() is None
        assert s._state()["users"] == [other.pid]
        other.kill()
        other.wait()
        s._save(dict(s._state(), users=[os.getpid(), other.pid]))
        s.release()  # the other one has gone: we are the last
        assert fake_server.wait(10) == -15
        assert s._state() == {}
    finally:
        for p in (fake_server, other):
            p.kill()
            p.wait()


def test_a_server_not_started_by_ft_launch_is_never_stopped(homes):
    fake_server = _sleeper()
    try:
        s = launch.Server(free_port())
        s._save({"pid": fake_server.pid, "users": []})
        s.managed = False
        s.release()
        assert fake_server.poll() is None
    finally:
        fake_server.kill()
        fake_server.wait()


# ---- the command ---------------------------------------------------------------------------

@pytest.mark.parametrize("client", list(launch.CLIENTS))
def test_print_writes_and_runs_nothing(client, homes, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(homes / "empty"))  # --print does not need the client installed
    port = free_port()
    assert main(["launch", "--print", "--port", str(port), client, "--", "run", "say hi"]) == 0
    out = capsys.readouterr().out
    setup = launch.CLIENTS[client].configure(
        launch.Target(f"http://127.0.0.1:{port}", "freetoken-demo", launch.api_key(), 65536, 256))
    for path, text in setup.files.items():
        assert f"# --- file {path} ---" in out and text.rstrip("\n") in out
        assert not os.path.exists(path)
    for k in setup.env:
        assert f"export {k}=" in out
    assert f"context 65536 tokens, replies up to 256" in out  # the demo model's, capped
    # the key stays in its file: the command a user would run names the file, not the key
    assert f"ft serve --host 127.0.0.1 --port {port} --api-key-file {launch.api_key_path()}" in out
    serve_line = next(ln for ln in out.splitlines() if "ft serve --host" in ln)
    assert launch.api_key() not in serve_line
    cmd = out.split("# --- command ---\n")[1].splitlines()[0]
    assert cmd.startswith(launch.CLIENTS[client].binary) and cmd.endswith("run 'say hi'")


def test_not_installed(homes, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(homes / "empty"))
    assert main(["launch", "codex"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ft: error: Codex CLI is not installed ('codex' is not on PATH); "
                   "install it with: npm install -g @openai/codex"]


FAKE_CLIENT = '''\
#!{python}
"""Stands in for a client: records argv and environment, then sends one request to the server
with the configuration it was given, as the real client would."""
import json, os, subprocess, sys, urllib.request
name = os.path.basename(sys.argv[0])
prefixes = ("ANTHROPIC_", "CLAUDE_", "OPENCODE_", "OPENCLAW_", "FREETOKEN_")
env = {{k: v for k, v in os.environ.items() if k.startswith(prefixes)}}
if name == "claude":
    settings = json.load(open(sys.argv[sys.argv.index("--settings") + 1]))["env"]
    url, key = settings["ANTHROPIC_BASE_URL"] + "/v1/messages", settings["ANTHROPIC_AUTH_TOKEN"]
    model = settings["ANTHROPIC_MODEL"]
    body = {{"model": model, "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}]}}
elif name == "opencode":
    p = json.load(open(os.environ["OPENCODE_CONFIG"]))["provider"]["freetoken"]
    url, key = p["options"]["baseURL"] + "/chat/completions", p["options"]["apiKey"]
    body = {{"model": next(iter(p["models"])), "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}]}}
else:
    url = None
if url:
    headers = {{"authorization": "Bearer " + key, "content-type": "application/json"}}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers)
    status = urllib.request.urlopen(req, timeout=120).status
else:
    status = None
nested = None
if os.environ.get("FAKE_NEST") and not os.environ.get("FAKE_INNER"):  # a second ft launch meanwhile
    nested = subprocess.run([{python!r}, "-m", "freetoken.cli", "launch",
                             "--port", os.environ["FAKE_PORT"], name],
                            env=dict(os.environ, FAKE_INNER="1"), capture_output=True, text=True)
    nested = {{"rc": nested.returncode, "stderr": nested.stderr}}
out = os.path.join(os.environ["FAKE_OUT"], name + ("-inner" if os.environ.get("FAKE_INNER") else "") + ".json")
json.dump({{"argv": sys.argv[1:], "env": env, "status": status, "nested": nested}}, open(out, "w"))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
'''


@pytest.fixture
def fake_clients(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = FAKE_CLIENT.format(python=sys.executable)
    for c in launch.CLIENTS.values():
        p = bindir / c.binary
        p.write_text(script)
        p.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", FAKE_OUT=str(out),
               CODEX_HOME=str(tmp_path / "codex"))
    env.pop("OPENCODE_CONFIG_CONTENT", None)
    return env, out


def ft(env, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "freetoken.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def ft_here(env, capsys, monkeypatch, *args):
    """`ft ARGS` run in this process (main(), as the command line calls it), in `env`: what
    a subprocess would return, without its seconds of imports. The client it runs is still a
    process of its own."""
    for k in set(os.environ) - set(env):
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_reuses_a_running_server(fake_clients, capsys, monkeypatch):
    """A server already serving the model on the port is used as it is, and left running."""
    env, out = fake_clients
    key = launch.api_key()  # the key ft launch will send (shared cache folder, see conftest)
    server = Server("--api-key", key)
    try:
        port = str(server.port)
        # the whole command once, as a process: the client's exit status is ft's
        r = ft(dict(env, FAKE_EXIT="3"), "launch", "--port", port, "claude", "--", "-p", "say hi")
        assert r.returncode == 3, r.stderr  # the client's own exit status
        assert f"using the FreeToken server already on {server.url}" in r.stderr
        assert "not started by ft launch; left running" in r.stderr
        rec = json.loads((out / "claude.json").read_text())
        assert rec["argv"][0] == "--settings" and rec["argv"][2:] == ["-p", "say hi"]
        assert rec["env"]["ANTHROPIC_BASE_URL"] == server.url and rec["env"]["ANTHROPIC_AUTH_TOKEN"] == key
        assert rec["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "65536"
        assert rec["status"] == 200  # the settings it was given reach the server
        # the rest in this process (each `ft` process costs seconds of imports)
        r = ft_here(env, capsys, monkeypatch, "launch", "--port", port, "opencode", "--", "run", "hi")
        assert r.returncode == 0, r.stderr
        assert "not started by ft launch; left running" in r.stderr
        assert json.loads((out / "opencode.json").read_text())["status"] == 200
        assert httpx.get(server.url + "/health").status_code == 200  # not ours to stop

        # --print describes the running server
        r = ft_here(env, capsys, monkeypatch, "launch", "--print", "--port", port, "codex")
        assert r.returncode == 0 and f"already running on {server.url} (not started by ft launch)" in r.stdout

        # another model on that port, or a key ft launch does not have: one error line each
        r = ft_here(env, capsys, monkeypatch, "launch", "--port", port, "--served-model-name", "other", "claude")
        assert r.returncode == 2
        assert r.stderr.strip() == (f"ft: error: port {port} serves 'freetoken-demo', not 'other'; pass --port to "
                                    "start another server (or --served-model-name freetoken-demo to use it)")

        # a server whose key is not the one ft launch has (not started by ft launch)
        key_file = os.path.join(launch.launch_dir(), "api-key")
        os.replace(key_file, key_file + ".kept")
        try:
            with open(key_file, "w") as f:
                f.write("ft-another-key\n")
            r = ft_here(env, capsys, monkeypatch, "launch", "--port", port, "claude")
        finally:
            os.replace(key_file + ".kept", key_file)
        assert r.returncode == 2 and "wants an API key that ft launch does not have" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    finally:
        server.stop()


def test_starts_shares_and_stops_its_server(fake_clients):
    """ft launch starts a server, a second ft launch meanwhile reuses it and leaves it running
    for the first; when the first client exits, the server is stopped."""
    env, out = fake_clients
    port = str(free_port())
    r = ft(dict(env, FAKE_NEST="1", FAKE_PORT=port), "launch", "--port", port, "claude", "--", "-p", "hi")
    assert r.returncode == 0, r.stderr
    assert f"starting ft serve for freetoken-demo on http://127.0.0.1:{port}" in r.stderr
    assert "replies up to 256 tokens" in r.stderr  # the demo model's replies are capped
    assert f"stopped the server on http://127.0.0.1:{port}" in r.stderr
    outer = json.loads((out / "claude.json").read_text())
    assert outer["status"] == 200
    nested = outer["nested"]
    assert nested["rc"] == 0
    assert "started by an earlier ft launch" in nested["stderr"]
    assert "left the server on" in nested["stderr"] and "1 other ft launch uses it" in nested["stderr"]
    assert json.loads((out / "claude-inner.json").read_text())["status"] == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    d = launch.launch_dir()
    assert not os.path.exists(os.path.join(d, f"server-{port}.json"))
    assert "FreeToken: serving 'freetoken-demo'" in open(os.path.join(d, f"serve-{port}.log")).read()


def test_server_that_fails_to_start(fake_clients, capsys, monkeypatch):
    """ft serve's own error, in one line, and the client is not run."""
    env, out = fake_clients
    r = ft_here(env, capsys, monkeypatch, "launch", "--port", str(free_port()), "--serve-args", "--max-batch 0",
                "claude")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("ft: error: ft serve exited with status 2 before it served: "
                              "ft: error: --max-batch must be >= 1")
    assert not (out / "claude.json").exists()
