"""`ft launch CLIENT [-- ARGS]`: run an agentic client against a local `ft serve`.

It starts `ft serve` in the background (or reuses one already serving the same model on the
port), writes the client's configuration for it (base URL, model id, API key, context window,
output limit, wire API) where it cannot clobber the user's own settings, runs the client with
ARGS, and stops the server when the client exits if `ft launch` started it and no other
`ft launch` still uses it. `ft launch --print CLIENT` prints that configuration instead.

One small function per client turns a `Target` (the server: URL, model id, key, limits) into a
`Setup` (files to write, environment, arguments placed before ARGS). Everything `ft launch`
keeps lives in `<cache>/launch/`: the API key (`api-key`, made once, random), the state of the
server it started on each port (`server-PORT.json`, with the `ft launch` processes using it),
the server's log (`serve-PORT.log`) and the client files that are not the client's own.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from .cuda_queues import child_env
from .errors import FreeTokenError, notice
from .paths import cache_dir, file_lock

DEMO_NAME = "freetoken-demo"
HOST = "127.0.0.1"
PROVIDER_ID = "freetoken"   # the provider / profile name written into the clients' configs
KEY_ENV = "FREETOKEN_API_KEY"  # where Codex reads the key (its provider's env_key)
DEMO_MAX_NEW_TOKENS = 256  # the demo model never ends a reply: cap it unless told otherwise
MARKER = "Written by `ft launch"  # first line of files we write outside our cache folder
START_TIMEOUT_S = 1800


# ---- what a client is given ---------------------------------------------------------------

@dataclass
class Target:
    """The server a client is pointed at."""
    url: str          # http://127.0.0.1:PORT (no /v1)
    model: str        # the model id the client sends
    api_key: str
    context: int      # tokens of context (prompt + reply)
    max_output: int   # tokens a reply may take

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@dataclass
class Setup:
    """What running a client takes: files to write (path -> text), environment variables to set
    and to remove for the child process, arguments placed before the user's ARGS, and the
    arguments to use when the user gives none."""
    files: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()
    args: list[str] = field(default_factory=list)
    default_args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Client:
    name: str        # as typed after `ft launch`
    title: str
    binary: str
    install: str     # how to install it
    configure: Callable[[Target], Setup]


def launch_dir() -> str:
    path = os.path.join(cache_dir(), "launch")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _json(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string (ASCII, \uXXXX escapes) is a valid TOML basic string


def auto_compact_limit(t: Target) -> int:
    """Where a client should compact its history: leave room for one reply, and 10%."""
    return max(1, min(int(t.context * 0.9), t.context - t.max_output))


# ---- one function per client -------------------------------------------------------------

def claude_setup(t: Target) -> Setup:
    """Claude Code speaks the Anthropic Messages API (`ANTHROPIC_BASE_URL` without /v1). The
    settings go in a separate file passed with `--settings` (its `env` block outranks the
    user's and the project's settings files, which are left alone) and in the child's
    environment. Every model alias (sonnet, opus, haiku, the small/fast and sub-agent models)
    maps to the one served model; `CLAUDE_CODE_MAX_CONTEXT_TOKENS` gives the context window of
    a model id Claude Code does not know (it assumes 200k otherwise);
    `CLAUDE_CODE_ATTRIBUTION_HEADER=0` keeps the attribution block (which can change from one
    request to the next) out of the head of the system prompt, where it would defeat prefix
    reuse; nonessential traffic (telemetry, update checks) is off."""
    path = os.path.join(launch_dir(), "claude-settings.json")
    env = {
        "ANTHROPIC_BASE_URL": t.url,
        "ANTHROPIC_AUTH_TOKEN": t.api_key,
        "ANTHROPIC_MODEL": t.model,
        "ANTHROPIC_SMALL_FAST_MODEL": t.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": t.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": t.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": t.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": t.model,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(t.context),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(t.max_output),
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    settings = {"model": t.model, "env": env}
    notes = []
    if "ANTHROPIC_API_KEY" in os.environ:
        notes.append("your ANTHROPIC_API_KEY is left out of Claude Code's environment (the key goes in "
                     "ANTHROPIC_AUTH_TOKEN; both set is a conflict it warns about)")
    return Setup(files={path: _json(settings)}, env=env, unset=("ANTHROPIC_API_KEY",),
                 args=["--settings", path], notes=notes)


def codex_home() -> str:
    return os.environ.get("CODEX_HOME") or os.path.join(os.path.expanduser("~"), ".codex")


def codex_setup(t: Target) -> Setup:
    """Codex CLI speaks only the Responses API. A profile file `$CODEX_HOME/freetoken.config.toml`
    (selected with `--profile freetoken`, layered over the user's config.toml, which is not
    touched) defines a model provider with `wire_api = "responses"`; the key is read from the
    variable its `env_key` names. Hosted web search is off (`web_search = "disabled"`: a local
    server has none to run). Sub-agents stay on: Codex sends their tools grouped in a `namespace`
    tool, which /v1/responses takes (responses.py). Codex has no output-limit setting."""
    path = os.path.join(codex_home(), f"{PROVIDER_ID}.config.toml")
    text = "\n".join([
        f"# {MARKER} codex`: FreeToken at {t.v1} (`codex --profile {PROVIDER_ID}`; "
        f"the key is read from ${KEY_ENV}).",
        f"model = {_toml_str(t.model)}",
        f"model_provider = {_toml_str(PROVIDER_ID)}",
        f"model_context_window = {t.context}",
        f"model_auto_compact_token_limit = {auto_compact_limit(t)}",
        'web_search = "disabled"',  # hosted search: a local server has none to run
        "",
        f"[model_providers.{PROVIDER_ID}]",
        f"name = {_toml_str('FreeToken')}",
        f"base_url = {_toml_str(t.v1)}",
        f"env_key = {_toml_str(KEY_ENV)}",
        'wire_api = "responses"',
        "requires_openai_auth = false",
        "stream_idle_timeout_ms = 600000",  # a long prompt prefills for minutes on a CPU
        "",
    ])
    return Setup(files={path: text}, env={KEY_ENV: t.api_key}, args=["--profile", PROVIDER_ID])


def opencode_setup(t: Target) -> Setup:
    """OpenCode: a provider on `@ai-sdk/openai-compatible` (Chat Completions) in a config file of
    our own, named by `OPENCODE_CONFIG` (merged over the user's global config, which is not
    touched). The model choice also goes in `OPENCODE_CONFIG_CONTENT`, the one layer above a
    project's opencode.json, so that a project's own `model` does not send the turn elsewhere."""
    ref = f"{PROVIDER_ID}/{t.model}"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER_ID: {
            "npm": "@ai-sdk/openai-compatible",
            "name": "FreeToken",
            "options": {"baseURL": t.v1, "apiKey": t.api_key},
            "models": {t.model: {"name": t.model, "tool_call": True,
                                 "limit": {"context": t.context, "output": t.max_output}}},
        }},
        "model": ref,
        "small_model": ref,
    }
    path = os.path.join(launch_dir(), "opencode.json")
    inline = {}
    with contextlib.suppress(ValueError, TypeError):
        inline = dict(json.loads(os.environ.get("OPENCODE_CONFIG_CONTENT") or "{}"))
    inline.update(model=ref, small_model=ref)
    notes = [f"your OPENCODE_CONFIG ({os.environ['OPENCODE_CONFIG']}) is not read in this run: ft launch's "
             "file takes its place"] if os.environ.get("OPENCODE_CONFIG") else []
    return Setup(files={path: _json(config)},
                 env={"OPENCODE_CONFIG": path, "OPENCODE_CONFIG_CONTENT": json.dumps(inline)}, notes=notes)


def openclaw_setup(t: Target) -> Setup:
    """OpenClaw: its own config file and state folder under our cache (`OPENCLAW_CONFIG_PATH`,
    `OPENCLAW_STATE_DIR`: an isolated profile; `~/.openclaw` is not touched), with a provider on
    the `openai-completions` API and the model as the agents' primary. Without ARGS it opens
    the terminal UI on the embedded agent (`openclaw chat`); one turn: `-- agent exec "..."`."""
    d = os.path.join(launch_dir(), "openclaw")
    path = os.path.join(d, "openclaw.json")
    config = {
        "models": {"mode": "merge", "providers": {PROVIDER_ID: {
            "baseUrl": t.v1,
            "apiKey": t.api_key,
            "api": "openai-completions",
            "timeoutSeconds": 600,
            "models": [{"id": t.model, "name": t.model, "reasoning": False, "input": ["text"],
                        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                        "contextWindow": t.context, "maxTokens": t.max_output}],
        }}},
        "agents": {"defaults": {"model": {"primary": f"{PROVIDER_ID}/{t.model}"}}},
    }
    mine = [v for v in ("OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "OPENCLAW_PROFILE") if os.environ.get(v)]
    notes = [f"your {', '.join(mine)} {'is' if len(mine) == 1 else 'are'} not used in this run: "
             "OpenClaw runs on ft launch's own profile"] if mine else []
    return Setup(files={path: _json(config)},
                 env={"OPENCLAW_CONFIG_PATH": path, "OPENCLAW_STATE_DIR": os.path.join(d, "state")},
                 unset=("OPENCLAW_PROFILE",), default_args=["chat"], notes=notes)


CLIENTS = {c.name: c for c in [
    Client("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code", claude_setup),
    Client("codex", "Codex CLI", "codex", "npm install -g @openai/codex", codex_setup),
    Client("opencode", "OpenCode", "opencode", "npm install -g opencode-ai", opencode_setup),
    Client("openclaw", "OpenClaw", "openclaw", "npm install -g openclaw (it needs Node.js >= 24)", openclaw_setup),
]}


# ---- files ---------------------------------------------------------------------------------

def _ours(path: str) -> bool:
    """Files under our cache folder are ours; elsewhere, a file is ours if we marked it."""
    if os.path.abspath(path).startswith(os.path.abspath(cache_dir()) + os.sep):
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return MARKER in f.readline()
    except OSError:
        return False


def write_files(files: dict[str, str]) -> list[str]:
    """Write each file (mode 0600: they hold the key), atomically. A file of the same name that
    is not ours is kept as PATH.bak-TIMESTAMP first. Returns what was backed up, as lines."""
    said = []
    for path, text in files.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.exists(path) and not _ours(path):
            bak = f"{path}.bak-{time.strftime('%Y%m%d-%H%M%S')}"
            shutil.copy2(path, bak)
            said.append(f"{path} existed and was not written by ft launch; kept a copy as {bak}")
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    return said


def api_key_path() -> str:
    """The file holding ft launch's key (mode 0600): the servers it starts read it
    (--api-key-file), so the key is on no process list."""
    return os.path.join(launch_dir(), "api-key")


def api_key() -> str:
    """The key `ft launch` gives the servers it starts: random, made once, kept in the cache.
    Made whole in a private temporary file, then linked into place (fails if one is there): two
    ft launch starting at once never see a half-written file, and both end with the one key the
    file holds, which is what their servers read (--api-key-file)."""
    path = api_key_path()
    for _ in range(2):
        with contextlib.suppress(FileNotFoundError):
            with open(path) as f:
                key = f.read().strip()
            if key:
                return key
            os.unlink(path)  # empty (an older ft launch died mid-write): made again below
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".api-key-")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write("ft-" + secrets.token_urlsafe(24) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:  # another ft launch linked its key first: read that
                pass
            except OSError:  # a file system without hard links: renamed into place, last writer wins
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    with open(path) as f:
        key = f.read().strip()
    if not key:
        raise FreeTokenError(f"{path} holds no API key; delete it and run ft launch again")
    return key


# ---- the server ----------------------------------------------------------------------------

def model_info(model: str | None, context: bool = False) -> tuple[str | None, int | None]:
    """(model id the server will serve, the model's context if asked) from the FTW header,
    without loading the model. The demo model's id is fixed; its file may not exist yet."""
    if model is None:
        if not context:
            return DEMO_NAME, None
        from .demo import DEMO_CONFIG  # imports torch
        return DEMO_NAME, DEMO_CONFIG["max_position_embeddings"]
    from .cli import resolve_model
    from .config import ModelConfig
    from .weights.ftw import read_header
    path = resolve_model(model)
    meta, _ = read_header(path)
    ctx = None
    if context:
        with contextlib.suppress(Exception):
            ctx = ModelConfig.from_hf(meta["config"], path).max_position_embeddings
    return meta.get("source"), ctx


def _get(url: str, key: str | None = None, timeout: float = 3.0) -> tuple[int, object]:
    req = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def probe(port: int, key: str) -> dict | None:
    """What serves 127.0.0.1:PORT: None if nothing listens; a FreeToken server's /health with
    `max_model_len` and `key_ok` added; FreeTokenError for anything else."""
    url = f"http://{HOST}:{port}"
    try:
        status, health = _get(url + "/health")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, ConnectionRefusedError) or "refused" in str(reason).lower():
            return None
        raise FreeTokenError(f"port {port} on {HOST} does not answer as a FreeToken server ({reason}); "
                             "pass --port to use another") from None
    if status != 200 or not isinstance(health, dict) or "model" not in health or "context" not in health:
        raise FreeTokenError(f"port {port} on {HOST} is in use by something that is not a FreeToken "
                             "server; pass --port to use another")
    status, models = _get(url + "/v1/models", key)
    health = dict(health, key_ok=status == 200, max_model_len=None)
    if status == 200 and isinstance(models, dict):
        for m in models.get("data") or []:
            if m.get("id") == health["model"]:
                health["max_model_len"] = m.get("max_model_len")
    return health


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (our own child that exited, not yet reaped) is not alive
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class Server:
    """A server on 127.0.0.1:PORT that this `ft launch` uses: started here or reused. The state
    file lists the `ft launch` processes using a server that `ft launch` started; the last one
    to leave stops it. A server `ft launch` did not start is never stopped."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://{HOST}:{port}"
        d = launch_dir()
        self.state_path = os.path.join(d, f"server-{port}.json")
        self.lock_path = os.path.join(d, f"server-{port}.lock")
        self.log_path = os.path.join(d, f"serve-{port}.log")
        self.health: dict = {}
        self.managed = False      # started by ft launch (here or by another one)
        self.started_here = False
        self.max_new_tokens: int | None = None
        self.start_s: float | None = None  # how long the server it started took to answer

    # state file (read and written under the lock)
    def _state(self) -> dict:
        try:
            with open(self.state_path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def _save(self, state: dict | None) -> None:
        if state is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.state_path)
            return
        tmp = self.state_path + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.state_path)

    def acquire(self, name: str, key: str, serve_cmd: list[str], max_new_tokens: int | None) -> dict:
        """Reuse the server on the port if it serves `name`, else start one; wait until it is
        healthy. Returns its /health (plus max_model_len)."""
        with file_lock(self.lock_path, on_wait=lambda: notice(
                f"another ft launch is starting the server on port {self.port}; waiting for it ...")):
            found = probe(self.port, key)
            if found is not None:
                self._check(found, name)
                state = self._state()
                self.managed = bool(state) and _pid_alive(state.get("pid", -1))
                if self.managed:
                    state["users"] = [p for p in state.get("users", []) if _pid_alive(p)] + [os.getpid()]
                    self._save(state)
                    self.max_new_tokens = state.get("max_new_tokens")
                how = "started by an earlier ft launch" if self.managed else "not started by ft launch; left running"
                notice(f"using the FreeToken server already on {self.url} ({found['model']}; {how})")
                self.health = found
                return found
            self._save(None)  # a stale state file from a server that is gone
            self.health = self._start(serve_cmd, name, key)
            self.managed = self.started_here = True
            self.max_new_tokens = max_new_tokens
            self._save({"pid": self.proc.pid, "port": self.port, "model": name,
                        "max_new_tokens": max_new_tokens, "users": [os.getpid()]})
            return self.health

    def _check(self, found: dict, name: str) -> None:
        if found["model"] != name:
            raise FreeTokenError(f"port {self.port} serves {found['model']!r}, not {name!r}; pass --port to "
                                 f"start another server (or --served-model-name {found['model']} to use it)")
        if not found["key_ok"]:
            raise FreeTokenError(f"the FreeToken server on port {self.port} wants an API key that ft launch "
                                 "does not have (it was not started by ft launch); stop it or pass --port")

    def _start(self, cmd: list[str], name: str, key: str) -> dict:
        notice(f"starting ft serve for {name} on {self.url} (log: {self.log_path}) ...")
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,  # the terminal's Ctrl-C goes to the client
                                     env=child_env())  # it chooses its own CUDA launch queues
        log.close()
        relayed = 0
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT_S
        try:
            while True:
                relayed = self._relay(relayed)
                code = self.proc.poll()
                if code is not None:
                    self._relay(relayed)
                    raise FreeTokenError(f"ft serve exited with status {code} before it served: "
                                         f"{self._last_error()} (log: {self.log_path})")
                with contextlib.suppress(FreeTokenError):
                    found = probe(self.port, key)
                    if found is not None:
                        self._check(found, name)
                        self._relay(relayed)
                        self.start_s = time.monotonic() - t0
                        return found
                if time.monotonic() > deadline:
                    raise FreeTokenError(f"ft serve did not answer within {START_TIMEOUT_S} s (log: {self.log_path})")
                time.sleep(0.5)
        except BaseException:
            self._stop_proc()
            raise

    def _relay(self, done: int) -> int:
        """Print the server's own notices (first-run steps) as they appear in its log."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return done
        complete = lines if not lines else lines[:-1]  # the last line may be half written
        for line in complete[done:]:
            if line.startswith("ft: ") and not line.startswith("ft: error"):
                print(line, file=sys.stderr, flush=True)
        return max(done, len(complete))

    def _last_error(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if ln.startswith("ft: error")]
        return (errors or lines or ["no output"])[-1]

    def _stop_proc(self) -> None:
        if getattr(self, "proc", None) is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def release(self) -> None:
        """Leave the server; stop it if ft launch started it and no other ft launch uses it."""
        if not self.managed:
            return
        with file_lock(self.lock_path):
            state = self._state()
            users = [p for p in state.get("users", []) if p != os.getpid() and _pid_alive(p)]
            pid = state.get("pid")
            if users:
                state["users"] = users
                self._save(state)
                notice(f"left the server on {self.url} running: {len(users)} other ft launch "
                       f"{'uses' if len(users) == 1 else 'use'} it")
                return
            self._save(None)
            if self.started_here and self.proc.poll() is None:
                self._stop_proc()
            elif pid and _pid_alive(pid):  # started by an ft launch that has gone
                os.kill(pid, signal.SIGTERM)
                for _ in range(200):
                    if not _pid_alive(pid):
                        break
                    time.sleep(0.1)
                else:
                    os.kill(pid, signal.SIGKILL)
            notice(f"stopped the server on {self.url}")


# ---- the command ---------------------------------------------------------------------------

def serve_command(args, name: str, max_new_tokens: int | None) -> list[str]:
    """The server ft launch starts: the key from its file (api_key() made it), never in argv."""
    cmd = [sys.executable, "-m", "freetoken.cli", "serve"]
    if args.model is not None:
        from .cli import resolve_model
        cmd.append(os.path.abspath(resolve_model(args.model)))
    cmd += ["--host", HOST, "--port", str(args.port), "--api-key-file", api_key_path()]
    if args.served_model_name:
        cmd += ["--served-model-name", args.served_model_name]
    if max_new_tokens:
        cmd += ["--max-new-tokens", str(max_new_tokens)]
    try:
        cmd += shlex.split(args.serve_args or "")
    except ValueError as e:
        raise FreeTokenError(f"--serve-args: {e}") from None
    return cmd


def default_output(context: int) -> int:
    return max(1, min(32768, context // 4))


def render(client: Client, t: Target, setup: Setup, user_args: list[str], header: list[str]) -> str:
    """The configuration as `--print` shows it: files, environment, command (shell syntax)."""
    out = [f"# {line}" for line in header]
    for path, text in setup.files.items():
        out += ["", f"# --- file {path} ---", text.rstrip("\n")]
    out += ["", "# --- environment of the client ---"]
    out += [f"export {k}={shlex.quote(v)}" for k, v in setup.env.items()]
    out += [f"unset {k}" for k in setup.unset]
    out += ["", "# --- command ---",
            shlex.join([client.binary, *setup.args, *(user_args or setup.default_args)])]
    out += [f"# note: {n}" for n in setup.notes]
    return "\n".join(out) + "\n"


def cmd_launch(args) -> int:
    client = CLIENTS[args.client]
    user_args = list(args.client_args or [])
    if args.port < 1 or args.port > 65535:
        raise FreeTokenError(f"--port must be 1-65535, got {args.port}")
    if args.max_new_tokens is not None and args.max_new_tokens < 0:
        raise FreeTokenError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.served_model_name is not None and (not args.served_model_name.strip() or "," in args.served_model_name):
        raise FreeTokenError(f"--served-model-name {args.served_model_name!r}: one model id (the client is "
                             "configured with it), without commas")
    binary = None
    if not args.print:
        binary = shutil.which(client.binary)
        if binary is None:
            raise FreeTokenError(f"{client.title} is not installed ({client.binary!r} is not on PATH); "
                                 f"install it with: {client.install}")
    file_name, file_context = model_info(args.model, context=args.print)
    name = args.served_model_name or file_name
    if not name:
        raise FreeTokenError(f"{args.model}: the file does not record the checkpoint's name; "
                             "pass --served-model-name")
    max_new = args.max_new_tokens
    if max_new is None and args.model is None:
        max_new = DEMO_MAX_NEW_TOKENS
    key = api_key()
    server = Server(args.port)

    if args.print:
        found = probe(args.port, key)
        if found is not None:
            server._check(found, name)
            state = server._state()
            managed = state.get("model") == name and _pid_alive(state.get("pid", -1))
            cap = state.get("max_new_tokens") if managed else args.max_new_tokens
            context = min(c for c in (found["context"], found.get("max_model_len")) if c)
            how = "started by ft launch" if managed else "not started by ft launch"
            where = [f"the server already running on {server.url} ({how})"]
        else:
            cap = max_new
            context = file_context or 32768
            where = ["no server running there yet; ft launch would start one:",
                     shlex.join(["ft", *serve_command(args, name, max_new)[3:]]),
                     "(context from the model file: the server may report less)"]
        t = Target(server.url, name, key, context, cap or default_output(context))
        setup = client.configure(t)
        header = [f"ft launch {client.name}: {client.title} against FreeToken at {t.v1}, model {name!r}, "
                  f"context {t.context} tokens, replies up to {t.max_output}", *where]
        sys.stdout.write(render(client, t, setup, user_args, header))
        return 0

    server.acquire(name, key, serve_command(args, name, max_new), max_new)
    try:
        h = server.health
        context = min(c for c in (h["context"], h.get("max_model_len")) if c)
        cap = server.max_new_tokens if server.managed else args.max_new_tokens
        t = Target(server.url, name, key, context, cap or default_output(context))
        setup = client.configure(t)
        for line in write_files(setup.files) + setup.notes:
            notice(line)
        env = {k: v for k, v in child_env().items() if k not in setup.unset}
        env.update(setup.env)
        cmd = [binary, *setup.args, *(user_args or setup.default_args)]
        took = f" after {server.start_s:.0f} s" if server.start_s is not None else ""
        notice(f"server ready{took}: {name} at {t.v1}, context {t.context}, replies up to {t.max_output} tokens; "
               f"running {shlex.join([client.binary, *cmd[1:]])}")
        return run_child(cmd, env)
    finally:
        server.release()


def run_child(cmd: list[str], env: dict[str, str]) -> int:
    """Run the client in the foreground; the terminal's Ctrl-C is its to handle (we ignore it
    while it runs); SIGTERM/SIGHUP sent to us are passed on. Returns its exit status."""
    try:
        proc = subprocess.Popen(cmd, env=env)
    except OSError as e:
        raise FreeTokenError(f"cannot run {cmd[0]}: {e.strerror or e}") from None
    forward = lambda sig, frame: proc.send_signal(sig)  # noqa: E731
    old = {s: signal.signal(s, h) for s, h in [(signal.SIGINT, signal.SIG_IGN), (signal.SIGTERM, forward),
                                                (signal.SIGHUP, forward)]}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code
