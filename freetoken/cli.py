"""`ft`: the command line. Engine options are generated from EngineConfig's fields.

User errors (FreeTokenError) print one line and exit 2; anything else is a bug and keeps its
traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from .errors import FreeTokenError


def add_config_args(parser: argparse.ArgumentParser, cls) -> None:
    """One --flag per dataclass field, typed and documented from the field's metadata."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "") + f" (default: {f.default})"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=f.default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            parser.add_argument(flag, dest=f.name, type=typ, default=f.default,
                                choices=f.metadata.get("choices"), help=help_)


def config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def resolve_model(path: str | None) -> str:
    if path is None:
        from .demo import demo_path
        return demo_path()
    if os.path.isdir(path):
        ftws = sorted(f for f in os.listdir(path) if f.endswith(".ftw"))
        if len(ftws) == 1:
            return os.path.join(path, ftws[0])
        if os.path.exists(os.path.join(path, "config.json")):
            raise FreeTokenError(f"{path}: is a transformers checkpoint; convert it first: "
                                 f"ft convert {path} model.ftw")
        raise FreeTokenError(f"{path}: no .ftw file in this directory")
    if not os.path.exists(path):
        raise FreeTokenError(f"{path}: no such model file")
    return path


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise FreeTokenError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise FreeTokenError("--prompt-ids is empty")
    return ids


def cmd_generate(args) -> int:
    from .runtime.engine import Engine, EngineConfig
    from .runtime.sampler import SamplingParams
    try:
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as e:
        raise FreeTokenError(str(e)) from None
    if args.max_tokens < 1:
        raise FreeTokenError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    path = resolve_model(args.model)
    eng = Engine(path, config_from_args(EngineConfig, args), progress=not args.json and sys.stderr.isatty())
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < eng.cfg.vocab_size]
        if bad:
            raise FreeTokenError(f"--prompt-ids: token id {bad[0]} is outside the vocabulary [0, {eng.cfg.vocab_size})")
    else:
        ids = eng.tokenizer.encode(args.prompt)
    g = eng.generate(ids, args.max_tokens, params, stop_at_eos=not args.ignore_eos)
    n = len(g.token_ids)
    stats = {"load_s": round(eng.load_s, 3), "prefill_s": round(g.prefill_s, 4), "decode_s": round(g.decode_s, 4),
             "prefill_tok_s": round(g.prompt_tokens / g.prefill_s, 1) if g.prefill_s else None,
             "decode_tok_s": round((n - 1) / g.decode_s, 2) if n > 1 and g.decode_s else None}
    if args.json:
        print(json.dumps({"model": path, "prompt_tokens": g.prompt_tokens, "token_ids": g.token_ids,
                          "text": g.text, "logprobs": g.logprobs, "finish_reason": g.finish_reason,
                          "device": str(eng.device), "dtype": str(eng.dtype).replace("torch.", ""),
                          "experts": eng.experts_on, **stats}))
    else:
        print(g.text)
        print(f"[{g.prompt_tokens} prompt tokens, {n} generated ({g.finish_reason}); "
              f"prefill {stats['prefill_tok_s']} tok/s, decode {stats['decode_tok_s']} tok/s]", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from .weights.convert import convert
    t0 = time.perf_counter()
    out = convert(args.src, args.out, progress=not args.quiet)
    print(f"wrote {out} ({os.path.getsize(out) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import uvicorn
    from .runtime.engine import Engine, EngineConfig
    from .runtime.serving import ServingEngine
    from .server.app import ServerContext, build_app
    from .server.metrics import Metrics
    from .cache.config import CacheConfig
    from .server.template import ChatTemplate
    from .tokenizer import load_json
    if args.max_batch < 1 or args.max_queue < 0:
        raise FreeTokenError("--max-batch must be >= 1 and --max-queue >= 0")
    path = resolve_model(args.model)
    eng = Engine(path, config_from_args(EngineConfig, args), progress=sys.stderr.isatty())
    files = eng.files
    template = ChatTemplate.from_files(files, load_json(files.get("tokenizer_config.json"), "tokenizer_config.json"))
    name = args.served_model_name or (eng.meta.get("source") if args.model else "freetoken-demo")
    metrics = Metrics()
    cache = CacheConfig(enabled=not args.no_prefix_cache, page_size=args.page_size, tokens=args.prefix_cache_tokens,
                        checkpoint_budget=args.checkpoint_budget, checkpoint_policy=args.checkpoint_policy)
    serving = ServingEngine(eng, max_batch=args.max_batch, max_queue=args.max_queue, metrics=metrics,
                            max_new_tokens=args.max_new_tokens, cache=cache, cuda_graphs=args.cuda_graphs)
    ctx = ServerContext(serving, eng.tokenizer, template, [name], eng.cfg.vocab_size, api_key=args.api_key,
                        metrics=metrics)
    app = build_app(ctx)
    print(f"FreeToken: serving {name!r} ({eng.cfg.arch}, {eng.device}, experts on {eng.experts_on}, "
          f"context {eng.max_len}) at http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        serving.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .runtime.engine import EngineConfig
    p = argparse.ArgumentParser(prog="ft", description="FreeToken: big MoE models on one GPU plus host RAM")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("model", nargs="?", help="FTW file (default: the embedded demo model)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_args(g, EngineConfig)
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    s.add_argument("model", nargs="?", help="FTW file (default: the embedded demo model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model id clients must send (default: the checkpoint's name)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (continuous batching)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    s.add_argument("--max-new-tokens", type=int, default=0,
                   help="cap on tokens generated per request, whatever the client asks (0: no cap)")
    s.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt in full")
    s.add_argument("--cuda-graphs", action="store_true",
                   help="replay decode steps from CUDA graphs (experts on the GPU; experimental: see README)")
    s.add_argument("--prefix-cache-tokens", type=int, default=0, help="KV page pool size in tokens (0: one context)")
    s.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    s.add_argument("--checkpoint-budget", default="32",
                   help="recurrent-state checkpoints kept: a slot count (32) or a size (2GiB)")
    s.add_argument("--checkpoint-policy", default="anchors",
                   help="where to checkpoint DeltaNet state: anchors | interval:N | none")
    add_config_args(s, EngineConfig)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("convert", help="convert a transformers checkpoint directory to FTW")
    c.add_argument("src", help="directory with config.json, *.safetensors, tokenizer files")
    c.add_argument("out", help="output .ftw file")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(func=cmd_convert)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except FreeTokenError as e:
        print(f"ft: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ft: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
