"""`ft`: the command line. Engine options are generated from EngineConfig's fields.

User errors (FreeTokenError) print one line and exit 2; anything else is a bug and keeps its
traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import socket
import sys
import time

from . import __distribution__, __version__
from .errors import CorruptModelError, FreeTokenError, notice

DEMO_NAME = "freetoken-demo"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show (None, off)."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if ("%(default)" in help_ or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return help_
        return help_ + " (default: %(default)s)"


def add_config_args(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per dataclass field, typed and documented from the field's metadata."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            # the names vLLM and llama.cpp users type for the same setting (metadata "aliases")
            parser.add_argument(flag, *f.metadata.get("aliases", ()), dest=f.name, type=typ, default=f.default,
                                choices=f.metadata.get("choices"), help=help_)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """MODEL as the positional argument, or as -m/--model (vLLM's and llama.cpp's spelling)."""
    parser.add_argument("model", nargs="?", help=MODEL_HELP)
    parser.add_argument("-m", "--model", dest="model_flag", metavar="MODEL", default=None,
                        help="the model, as the positional MODEL (either form)")


def merge_model_args(args) -> None:
    """args.model from the positional or the -m/--model form; both, naming different models, is
    an error."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model is not None and args.model != flag:
        raise FreeTokenError(f"two models given: {args.model} and --model {flag}; give one")
    args.model = flag


def config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]*/[\w.-]+")  # ORG/NAME as the hub spells a model id


def hf_hub_cache() -> str:
    """The Hugging Face hub cache folder, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(home, "hub")


def hub_snapshot(repo_dir: str) -> str | None:
    """The snapshot folder of a hub cache repo folder (models--ORG--NAME): the one refs/main
    names, else the only or newest snapshot; None if it holds none."""
    snaps = os.path.join(repo_dir, "snapshots")
    try:
        with open(os.path.join(repo_dir, "refs", "main")) as f:
            main = os.path.join(snaps, f.read().strip())
        if os.path.isdir(main):
            return main
    except OSError:
        pass
    try:
        found = [os.path.join(snaps, d) for d in os.listdir(snaps) if os.path.isdir(os.path.join(snaps, d))]
    except OSError:
        return None
    return max(found, key=os.path.getmtime) if found else None


def looks_like_hub_id(arg: str) -> bool:
    """ORG/NAME that is no local path: not an existing file or folder, no file suffix, and its
    ORG not a folder here (`checkpoints/Qwen3` mistyped is a missing path, not a hub id)."""
    return (not os.path.exists(arg) and bool(HUB_ID.fullmatch(arg))
            and not arg.lower().endswith((".ftw", ".gguf", ".safetensors", ".json", ".bin"))
            and not os.path.isdir(arg.split("/")[0]))


def hub_model(repo_id: str) -> str:
    """ORG/NAME, a model id as vLLM takes it, from the local Hugging Face cache (FreeToken does
    not download)."""
    repo_dir = os.path.join(hf_hub_cache(), "models--" + repo_id.replace("/", "--"))
    snap = hub_snapshot(repo_dir) if os.path.isdir(repo_dir) else None
    if snap is None:
        raise FreeTokenError(f"{repo_id}: no such file or folder; as a Hugging Face model id it is not in the local "
                             f"cache either ({repo_dir}): FreeToken does not download models, so fetch it first "
                             f"(`hf download {repo_id}`) or give a local path")
    return snap


def resolve_model(path: str | None) -> str:
    if path is None:
        from .demo import demo_path
        return demo_path()
    if looks_like_hub_id(path):
        path = hub_model(path)  # a hub id: its snapshot, a transformers checkpoint folder
    if os.path.isdir(path) and os.path.basename(os.path.normpath(path)).startswith("models--"):
        snap = hub_snapshot(path)  # a hub cache repo folder given as it is
        if snap is None:
            raise FreeTokenError(f"{path}: a Hugging Face cache folder with no snapshot in it; download the model "
                                 "again or give the checkpoint folder")
        path = snap
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        raise FreeTokenError(f"{path}: GGUF files are not supported; serve the model's safetensors release (a "
                             "transformers checkpoint folder, FP8 / MXFP4 / NVFP4 ones included), which "
                             "FreeToken converts once, or `ft convert` it")
    if os.path.isdir(path):
        ftws = sorted(f for f in os.listdir(path) if f.endswith(".ftw"))
        if len(ftws) == 1:
            return os.path.join(path, ftws[0])
        if len(ftws) > 1:
            raise FreeTokenError(f"{path}: holds {len(ftws)} .ftw files ({', '.join(ftws)}); "
                                 f"name one, e.g. {os.path.join(path, ftws[0])}")
        if os.path.exists(os.path.join(path, "config.json")):
            return converted(path)
        if any(f.lower().endswith(".gguf") for f in os.listdir(path)):
            raise FreeTokenError(f"{path}: holds GGUF files, which are not supported; serve the model's safetensors "
                                 "release (a transformers checkpoint folder) or an .ftw file")
        raise FreeTokenError(f"{path}: no .ftw file in this directory")
    if not os.path.exists(path):
        raise FreeTokenError(f"{path}: no such model file")
    return path


MODEL_HELP = ("FTW file, a folder holding one, or a transformers checkpoint folder (converted once into the "
              "cache) (default: the embedded demo model)")


def checkpoint_fingerprint(src: str) -> str:
    """12 hex digits naming a checkpoint folder's current contents, as this FreeToken converts
    them: its version, and every file's name, size and modification time (a re-downloaded or
    edited checkpoint, or a newer converter, gets a new conversion)."""
    import hashlib
    h = hashlib.sha256(__version__.encode())
    for fn in sorted(os.listdir(src)):
        st = os.stat(os.path.join(src, fn))  # a Hub snapshot's symlinks: their blobs
        h.update(f"{fn}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:12]


def converted(src: str) -> str:
    """A transformers checkpoint folder given where a model is expected, as vLLM users give one:
    converted once into FreeToken's cache (<cache>/models/NAME-FINGERPRINT.ftw), which later
    starts reuse; several processes at once convert it once (a lock). A new conversion of the
    same folder replaces the older ones, and partial files a killed conversion left are removed
    first. `ft convert` writes the file where the user chooses instead."""
    import glob

    from .paths import cache_dir, file_lock
    from .weights.convert import convert, source_name
    src_abs = os.path.abspath(src)
    try:
        folder = os.path.join(cache_dir(), "models")
        os.makedirs(folder, exist_ok=True)
        out = os.path.join(folder, f"{source_name(src)}-{checkpoint_fingerprint(src)}.ftw")
        with file_lock(out + ".lock", on_wait=lambda: notice(f"waiting for another process converting {src}")):
            if os.path.exists(out):
                return out
            for stale in glob.glob(glob.escape(out) + ".*.partial"):  # the lock holder owns none of them
                os.remove(stale)
            notice(f"{src} is a transformers checkpoint: converting it once into {out} (later starts reuse it; "
                   f"`ft convert {src} FILE` writes it where you choose)")
            convert(src, out, progress=sys.stderr.isatty())
            with open(out[:-4] + ".source", "w") as f:
                f.write(src_abs)
            for other in glob.glob(os.path.join(glob.escape(folder), "*.source")):  # older conversions of it
                if other != out[:-4] + ".source" and _read_text(other) == src_abs:
                    for ext in (".ftw", ".source", ".ftw.lock"):
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(other[:-7] + ext)
    except OSError as e:
        raise FreeTokenError(f"{src}: cannot convert it into FreeToken's cache ({e.strerror or e}: "
                             f"{e.filename or ''}); `ft convert {src} FILE` writes it elsewhere") from None
    return out


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def load_engine(args, progress: bool):
    """(path, Engine) for the MODEL argument. The demo model is FreeToken's own cache file: if
    it fails its checksums, it is generated again (said in one warning line) and loaded anew;
    any other model's corruption is the user's to fix and is reported."""
    from .runtime.engine import Engine, EngineConfig
    ecfg = config_from_args(EngineConfig, args)
    path = resolve_model(args.model)
    stat = os.stat(path)
    try:
        return path, Engine(path, ecfg, progress=progress)
    except CorruptModelError as e:
        if args.model is not None:
            raise
        from .demo import ensure_demo
        ensure_demo(path, stale=stat, reason=str(e))
        return path, Engine(path, ecfg, progress=progress)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FreeTokenError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise FreeTokenError("--prompt-ids is empty")
    return ids


def read_prompt_file(fn: str) -> str:
    """The prompt as UTF-8 text, exactly as written (`-`: standard input)."""
    try:
        if fn == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(fn, "rb") as f:
            return f.read().decode("utf-8")
    except OSError as e:
        raise FreeTokenError(f"--prompt-file {fn}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise FreeTokenError(f"--prompt-file {fn}: not UTF-8 text (byte {e.start})") from None


def cmd_generate(args) -> int:
    from .runtime.penalties import RANGES, out_of_range
    from .runtime.sampler import SamplingParams
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed, min_p=args.min_p)
    except ValueError as e:
        raise FreeTokenError(str(e)) from None
    penalties = {name: getattr(args, name) for name in RANGES}
    for name, v in penalties.items():
        bad = out_of_range(name, v)
        if bad:
            raise FreeTokenError(f"--{name.replace('_', '-')} must be {bad}, got {v}")
    if args.max_tokens < 1:
        raise FreeTokenError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompt = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
    ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    path, eng = load_engine(args, progress=not args.json and sys.stderr.isatty())
    if ids is not None:
        # the rows an id indexes: an FTW converted before `ft convert` checked shapes may have
        # fewer embedding rows than its vocab_size says
        vocab = min(eng.cfg.vocab_size, eng.model.embed.shape[0])
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise FreeTokenError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    else:
        ids = eng.tokenizer.encode(prompt)
    g = eng.generate(ids, args.max_tokens, params, stop_at_eos=not args.ignore_eos, penalties=penalties)
    n = len(g.token_ids)
    stats = {"load_s": round(eng.load_s, 3), "prefill_s": round(g.prefill_s, 4), "decode_s": round(g.decode_s, 4),
             "prefill_tok_s": round(g.prompt_tokens / g.prefill_s, 1) if g.prefill_s else None,
             "decode_tok_s": round((n - 1) / g.decode_s, 2) if n > 1 and g.decode_s else None}
    if args.json:
        print(json.dumps({"model": path, "prompt_tokens": g.prompt_tokens, "token_ids": g.token_ids,
                          "text": g.text, "logprobs": g.logprobs, "finish_reason": g.finish_reason,
                          **eng.describe(), **stats}))
    else:
        print(g.text)
        d = eng.describe()
        print(f"[{g.prompt_tokens} prompt tokens, {n} generated ({g.finish_reason}); "
              f"prefill {stats['prefill_tok_s']} tok/s, decode {stats['decode_tok_s']} tok/s; "
              f"{compute_summary(d)}, {experts_summary(d)}]", file=sys.stderr)
    return 0


def _exit_on_signal(signum, frame):
    # SIGTERM / SIGHUP (a closed terminal, `timeout`, `docker stop`) as an exception, so the
    # writer's cleanup removes its partial output as it does on Ctrl-C
    raise SystemExit(128 + signum)


def cmd_convert(args) -> int:
    import signal

    from .weights.convert import convert
    t0 = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(args.out))
    had_parent = os.path.isdir(parent)
    sigs = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    before = {s: signal.signal(s, _exit_on_signal) for s in sigs}
    src = args.src
    if looks_like_hub_id(src):
        src = hub_model(src)
    elif os.path.isdir(src) and os.path.basename(os.path.normpath(src)).startswith("models--"):
        src = hub_snapshot(src) or src
    try:
        out = convert(src, args.out, progress=not args.quiet)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    made = "" if had_parent else f"; created the folder {parent}"
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s{made}",
          file=sys.stderr)
    return 0


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) TCP sockets for host:port, one per address the host resolves to,
    made before the model loads: a busy port is reported at once, and nothing can take the port
    while the model loads. uvicorn listens on them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise FreeTokenError(f"--host {host}: cannot resolve it ({e.strerror}); pass an address such as 127.0.0.1") from None
    socks: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr[:2]) in seen or family not in (socket.AF_INET, socket.AF_INET6):
                continue
            seen.add((family, addr[:2]))
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # one free port for every address
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise FreeTokenError(f"port {port} on {host} is in use; pass --port to use another") from None
                if e.errno == errno.EACCES:
                    raise FreeTokenError(f"port {port} on {host}: permission denied "
                                         "(ports below 1024 need privileges); pass --port") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise FreeTokenError(f"--host {host}: not an address of this machine") from None
                raise FreeTokenError(f"cannot listen on {host}:{port} ({e.strerror})") from None
            s.set_inheritable(True)
    except BaseException:
        for s in socks:
            s.close()
        raise
    if not socks:
        raise FreeTokenError(f"--host {host}: no IPv4 or IPv6 address")
    return socks


def compute_summary(d: dict) -> str:
    """The device and dtype that run the model (describe()): "cuda bfloat16 (dense FP8 kept)"."""
    return f"{d.get('device')} {d.get('dtype')}" + (" (dense FP8 kept)" if d.get("dense_fp8") == "kept" else "")


def experts_summary(d: dict) -> str:
    """Where the routed experts run, in what format and by what (an Engine's or ServingEngine's
    describe()): "nvfp4 experts on cpu (cpp, avx512-bf16, 2 threads)"."""
    experts = f"experts on {d.get('experts')}"
    if d.get("expert_format") not in (None, "none"):
        experts = f"{d['expert_format']} {experts}"
    backend = d.get("expert_backend")
    if backend and backend != "none":
        how = [backend] + ([d["expert_isa"]] if d.get("expert_isa") else [])
        if d.get("expert_threads"):
            how.append(f"{d['expert_threads']} threads")
        if d.get("cpu_act") not in (None, "exact"):
            how.append(f"{d['cpu_act']} activations")
        experts += f" ({', '.join(how)})"
    return experts


def banner(name: str, arch: str, url: str, d: dict) -> str:
    """The start-up line: what is served where, and what runs it (ServingEngine.describe())."""
    cache = "on" if d.get("prefix_cache") else "off"
    return (f"FreeToken: serving {name!r} ({arch}) at {url} | {compute_summary(d)} | {experts_summary(d)} | "
            f"context {d.get('context')} | decode {d.get('decode_path')}, max batch {d.get('max_batch')}, "
            f"prefix cache {cache}")


def cmd_serve(args) -> int:
    if args.max_batch < 1 or args.max_queue < 0 or args.responses_store < 0:
        raise FreeTokenError("--max-batch must be >= 1, --max-queue and --responses-store >= 0")
    check_served_names(args)
    args.api_keys = api_keys_of(args)  # a bad key setting fails here, before the model loads
    socks = bind_sockets(args.host, args.port)
    try:
        return _serve(args, socks)
    finally:
        for s in socks:
            s.close()


def template_kwargs_arg(text: str) -> dict:
    """--default-chat-template-kwargs: a JSON object."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}")
    return v


def default_names(model: str | None, source: str | None) -> list[str]:
    """The ids served without --served-model-name: the checkpoint's name, and before it the
    Hugging Face id when MODEL was one (vLLM serves a hub id under itself: its clients send it)."""
    if model is None:
        return [DEMO_NAME]
    names = [model] if looks_like_hub_id(model) else []
    return names + [n for n in [source] if n and n not in names] or [os.path.basename(model)]


def api_keys_of(args) -> tuple[str, ...]:
    """The keys a client may send: those of --api-key (several separated by commas, as llama.cpp's
    server takes them) and the lines of --api-key-file (which keeps them off the process list and
    out of the environment); neither given: $FREETOKEN_API_KEY (said once: a variable exported for
    a client, such as Codex's provider, turns authentication on too). () serves without a key, and
    only `--api-key ''` asks for that: a setting that names no key (`--api-key ,`, an empty file
    or file name) is an error, never a server open to all."""
    keys = []
    if args.api_key is not None and args.api_key != "":
        keys = [k.strip() for k in args.api_key.split(",") if k.strip()]
        if not keys:
            raise FreeTokenError(f"--api-key {args.api_key!r} names no key; give KEY or KEY1,KEY2 "
                                 "(--api-key '' serves without one)")
    if args.api_key_file is not None:
        if not args.api_key_file.strip():
            raise FreeTokenError("--api-key-file was given an empty file name")
        try:
            with open(args.api_key_file, encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of a key
                lines = [ln.strip() for ln in f.read().splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise FreeTokenError(f"--api-key-file {args.api_key_file}: cannot read it "
                                 f"({getattr(e, 'strerror', None) or e}); give a text file with one key a line") from None
        found = [ln for ln in lines if ln and not ln.startswith("#")]
        if not found:
            raise FreeTokenError(f"--api-key-file {args.api_key_file}: the file holds no key "
                                 "(one key a line; blank lines and lines starting with # are skipped)")
        keys += found
    if args.api_key is not None or args.api_key_file is not None:
        return tuple(dict.fromkeys(keys))
    key = (os.environ.get("FREETOKEN_API_KEY") or "").strip()
    if key:
        notice("requiring the API key in $FREETOKEN_API_KEY from clients (--api-key '' serves without one)")
    return (key,) if key else ()


def check_served_names(args) -> None:
    """A served name that is a model path given after --served-model-name (its values run on to
    the next flag, so `--served-model-name qwen model.ftw` took the model for a name)."""
    for n in args.served_model_name or ():
        if args.model is None and (os.path.exists(n) or n.lower().endswith((".ftw", ".gguf"))):
            raise FreeTokenError(f"--served-model-name {n}: this is a model path; put MODEL before the flag "
                                 f"(`ft serve {n} --served-model-name ...`) or use -m/--model")


def served_names(values: list[str] | None) -> list[str]:
    """--served-model-name's values (repeated, or a,b in one) in order, without repeats."""
    out: list[str] = []
    for v in values or ():
        for n in v.split(","):
            if n.strip() and n.strip() not in out:
                out.append(n.strip())
    return out


def _serve(args, socks: list[socket.socket]) -> int:
    import asyncio

    import uvicorn
    from .cache.config import CacheConfig
    from .runtime.serving import ServingEngine
    from .server.app import ServerContext, build_app
    from .server.metrics import Metrics
    from .server.template import ChatTemplate
    from .tokenizer import load_json
    path, eng = load_engine(args, progress=sys.stderr.isatty())
    files = eng.files
    template = ChatTemplate.from_files(files, load_json(files.get("tokenizer_config.json"), "tokenizer_config.json"))
    names = served_names(args.served_model_name) or default_names(args.model, eng.meta.get("source"))
    name = names[0]
    metrics = Metrics()
    cache = CacheConfig(enabled=not args.no_prefix_cache, page_size=args.page_size,
                        checkpoint_budget=args.checkpoint_budget, checkpoint_policy=args.checkpoint_policy)
    serving = ServingEngine(eng, max_batch=args.max_batch, max_queue=args.max_queue, metrics=metrics,
                            max_new_tokens=args.max_new_tokens, cache=cache, page_size=args.page_size,
                            kv_tokens=args.prefix_cache_tokens)
    try:
        ctx = ServerContext(serving, eng.tokenizer, template, names, eng.cfg.vocab_size,
                            api_keys=args.api_keys,
                            default_template_kwargs=args.default_chat_template_kwargs or {},
                            metrics=metrics, responses_store=args.responses_store)
        app = build_app(ctx)
        host = socks[0].getsockname()[0]
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{socks[0].getsockname()[1]}/v1"
        line = banner(name, eng.cfg.arch, url, serving.describe()) + "\nFreeToken: " + serving.plan.summary()

        class Server(uvicorn.Server):
            loop = None  # the event loop, where a signal's shutdown work runs (handle_exit)

            async def startup(self, sockets=None):
                Server.loop = asyncio.get_running_loop()
                await super().startup(sockets=sockets)
                if self.started and not self.should_exit:  # listening now: clients may connect
                    serving.freeze_gc()  # the web app's and the server's objects out of the collector too
                    print(line, file=sys.stderr, flush=True)

            def handle_exit(self, sig, frame):
                # SIGINT/SIGTERM: end every request in flight with an error event that says why
                # before uvicorn drains the connections (instead of cutting the streams). Not in
                # the handler itself: it runs between two bytecodes of the main thread, which may
                # be inside a lock begin_shutdown takes (a second SIGTERM landing inside the
                # first one's Event.set hung the server: `timeout ... ft serve` and pkill send
                # two); the loop runs it next, before uvicorn's shutdown starts
                if Server.loop is not None and not Server.loop.is_closed():
                    Server.loop.call_soon_threadsafe(serving.begin_shutdown)
                else:
                    serving.begin_shutdown()
                super().handle_exit(sig, frame)

        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        Server(config).run(sockets=socks)
    finally:
        serving.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .runtime.engine import EngineConfig
    p = argparse.ArgumentParser(prog="ft", formatter_class=HelpFormatter,
                                description="FreeToken: big MoE models on one GPU plus host RAM")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    p.add_argument("--version", action="version", version=f"ft {__version__} (distribution {__distribution__})")
    # -v after the subcommand too (`ft serve -v`); SUPPRESS keeps it from resetting `ft -v serve`
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log what the engine does")
    sub = p.add_subparsers(dest="cmd", metavar="{generate,serve,convert,launch,bench}")

    def command(name, help_):
        return sub.add_parser(name, help=help_, description=help_, parents=[common], formatter_class=HelpFormatter)

    g = command("generate", "generate text from a prompt")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", metavar="FILE",
                     help="read the prompt from FILE as UTF-8 text, exactly as written ('-': standard input); "
                          "for prompts too long for the command line")
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate at most (fewer if the model ends the text, unless --ignore-eos)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to "
                                                             "this total probability (1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="keep only the K most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: unseeded)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the most likely one's probability (0 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token generated so far, in [-2, 2] (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times its count from each generated token's logit, in [-2, 2] (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens in the prompt or output by "
                        "this (1 = off)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object: tokens, text, logprobs, timings and what ran where")
    add_config_args(g, EngineConfig)
    g.set_defaults(func=cmd_generate)

    s = command("serve", "OpenAI- and Anthropic-compatible HTTP server")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="model id clients must send (default: the name of the checkpoint folder the FTW was "
                        f"converted from, and the id for a Hugging Face id given as MODEL; {DEMO_NAME} for the demo "
                        "model); several as `a b` (vLLM), a,b or the flag repeated, the first one reported")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'; several keys separated by commas "
                        "(default: $FREETOKEN_API_KEY, else no key; the variable or --api-key-file keeps the key off "
                        "the process list; --api-key '' for none)")
    s.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="keys clients may send, one a line (with --api-key: either's keys)")
    s.add_argument("--default-chat-template-kwargs", "--chat-template-kwargs", default=None, metavar="JSON",
                   type=template_kwargs_arg,
                   help="chat-template kwargs every request renders with unless it sets its own, as a JSON object "
                        "(e.g. '{\"enable_thinking\": false}' to answer without thinking by default)")
    s.add_argument("--max-batch", "--max-num-seqs", "--parallel", "-np", type=int, default=8,
                   help="requests decoded together (continuous batching)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    s.add_argument("--responses-store", type=int, default=256,
                   help="Responses API: stored responses kept in memory for previous_response_id "
                        "(least recently used evicted first; also bounded to 64 MiB)")
    s.add_argument("--max-new-tokens", type=int, default=0,
                   help="cap on tokens generated per request, whatever the client asks (0: no cap)")
    s.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt in full")
    s.add_argument("--prefix-cache-tokens", type=int, default=None, dest="prefix_cache_tokens",
                   help="alias of --kv-cache-tokens (the prefix cache lives in the one KV pool)")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--checkpoint-budget", default="32",
                   help="recurrent-state checkpoints kept: a slot count (32) or a size (2GiB)")
    s.add_argument("--checkpoint-policy", default="anchors",
                   help="where to checkpoint DeltaNet state: anchors | interval:N | none")
    add_config_args(s, EngineConfig)
    s.set_defaults(func=cmd_serve)

    c = command("convert", "convert a transformers checkpoint directory to FTW")
    c.add_argument("src", help="directory with config.json, *.safetensors, tokenizer files")
    c.add_argument("out", help="output .ftw file (missing folders are created)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_convert)

    from .launch import CLIENTS
    la = command("launch", "run an agentic client (Claude Code, Codex, OpenCode, OpenClaw) against a local "
                           "ft serve, started or reused, with its configuration written for it")
    la.add_argument("client", choices=list(CLIENTS), help="the client to run")
    la.add_argument("client_args", nargs="*", metavar="-- ARGS",
                    help="arguments for the client, after -- (e.g. -- -p 'say hi')")
    la.add_argument("--print", action="store_true",
                    help="print the client's configuration (files, environment, command); run nothing")
    la.add_argument("--port", type=int, default=8000, help="port of the server on 127.0.0.1 (reused if it "
                                                          "already serves the model)")
    la.add_argument("--model", default=None, help=MODEL_HELP)
    la.add_argument("--served-model-name", default=None, help="model id (default: as ft serve names it)")
    la.add_argument("--max-new-tokens", type=int, default=None,
                    help="server-side cap on a reply's tokens, also the output limit the client is given "
                         "(default: 256 for the demo model, whose replies never end; else none, and the "
                         "client is told a quarter of the context, at most 32768)")
    la.add_argument("--serve-args", default=None, metavar="'FLAGS'",
                    help="more ft serve flags for a server ft launch starts, as one string "
                         "(e.g. '--max-batch 4 --experts cpu')")
    la.set_defaults(func=cmd_launch)

    b = command("bench", "measure this machine")
    bsub = b.add_subparsers(dest="bench", metavar="{bw}")
    b.set_defaults(func=lambda _: (b.print_help(sys.stderr), 2)[1])  # `ft bench` alone: its help
    bw = bsub.add_parser("bw", help="expert bandwidths: CPU executor (B_H), host -> GPU slots (B_P), both at once",
                         description="Measure, on MODEL's expert shape (read from its header; the model is not "
                                     "loaded), the GB/s the CPU expert executor reads (B_H), the GB/s the zero-copy "
                                     "kernel copies from pinned host memory into GPU slots (B_P, CUDA only), both "
                                     "while the other runs, and the CPU's fixed cost per call; saves a profile the "
                                     "GPU expert cache can start its fill share from.",
                         parents=[common], formatter_class=HelpFormatter)
    add_model_args(bw)
    bw.add_argument("--threads", type=int, default=0,
                    help="CPU executor threads (0: as the engine, every physical core; on CUDA all but two)")
    bw.add_argument("--cpu-act", default="exact", choices=["exact", "int8"],
                    help="the CPU executor's activations, as `ft serve --cpu-act` runs them (int8: MXFP4 / NVFP4 "
                         "banks); the engine reads the profile of the path it runs")
    bw.add_argument("--seconds", type=float, default=2.0, help="seconds each measurement runs")
    bw.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    bw.add_argument("--out", default=None, metavar="FILE",
                    help="write the profile here (default: the cache folder, bw/<shape>.json, where the engine "
                         "looks for it)")
    bw.set_defaults(func=cmd_bench_bw)
    return p


def cmd_bench_bw(args) -> int:
    """Measure B_H, B_P and the CPU's fixed cost on the model's expert shape; save the profile."""
    from .runtime import bandwidth
    from .runtime.bw_measure import measure, table
    if not 0 < args.seconds <= 600:  # nan and inf refused too (a loop that never ends)
        raise FreeTokenError(f"--seconds must be in (0, 600], got {args.seconds:g}")
    if args.threads < 0:
        raise FreeTokenError(f"--threads must be >= 0 (0: the engine's default), got {args.threads}")
    path = resolve_model(args.model)
    prof, cfg = measure(path, args.threads, args.seconds, args.cpu_act)
    out = args.out or bandwidth.profile_path(cfg, prof["model"]["format"], prof["threads"], prof["cpu_act"])
    prof["predicted_fill_share"] = round(bandwidth.predicted_share(prof), 3)  # for people; the engine recomputes
    try:
        prof["profile"] = bandwidth.save_profile(prof, out)
    except OSError as e:
        raise FreeTokenError(f"cannot write the profile to {out}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(prof))
    else:
        print(table(prof))
        print(f"saved {out}")
    return 0


def cmd_launch(args) -> int:
    from .launch import cmd_launch as run
    return run(args)


def main(argv=None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `ft launch CLIENT [flags] -- ARGS`: everything after the first `--` is the client's, taken
    # apart before argparse, which loses them when a flag sits between CLIENT and `--` (its
    # ARGS positional is matched, empty, together with CLIENT)
    extra = None
    command = next((a for a in argv if not a.startswith("-")), None)  # ft's own flags take no values
    if command == "launch" and "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    if extra is not None:
        args.client_args = list(args.client_args or []) + extra
    if args.cmd is None:
        parser.print_help(sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        merge_model_args(args)
        return args.func(args)
    except FreeTokenError as e:
        print(f"ft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
