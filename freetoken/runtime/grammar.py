"""Grammar-constrained decoding (structured output) with llguidance.

A constrained request (`SamplingOptions.grammar`, a GrammarSpec) gets one matcher when it
starts: its grammar is compiled once per spec and kept in a bounded LRU of pristine matchers,
each request taking a copy (microseconds). The matcher is advanced with every token the request
accepts, forced ones included; when the grammar is complete the request ends ("stop").

Per step, the constrained rows' logits are masked on the device (masked_fill with -inf) before
greedy picks and host sampling alike, from one bitmask row per request (one bit per token of
the model's vocabulary). The mask of step t+1 depends on the token of step t, so it is computed
off the critical path: right after a step accepts its tokens, one job on a worker thread
computes the next masks of every constrained request (llguidance's executor spreads them over
cores and releases the GIL) while the engine thread goes on to schedule and launch the next
forward; the step joins the job just before it samples. Unconstrained requests never touch a
mask: a batch without constrained rows runs exactly the code it ran before.

Log-probabilities stay those of the model: a masked row's log-normalizer is taken before
masking (one logsumexp per constrained row), so a constrained token reports the same logprob
an unconstrained one would.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg
import numpy as np
import torch

from .request import CallSyntax, GrammarSpec, Request, ToolSchema

log = logging.getLogger("freetoken.grammar")

# compact JSON with the separators models write (json.dumps' defaults); no free whitespace, which
# a weak model can fill forever
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 64  # compiled grammars kept (LRU)
_WS = r"[ \t\r\n]*"
# a raw XML parameter value the output parser would read as JSON of another type (it tries
# json.loads first): numbers, literals, quoted strings, arrays and objects
_JSONISH = (_WS + r"(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null|NaN|-?Infinity"
            r'|"(?s:.*)"|\[(?s:.*)\]|\{(?s:.*)\})' + _WS)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, eos): LLTokenizer}
_TOKENIZERS_LOCK = threading.Lock()


class GrammarError(ValueError):
    """A spec that cannot be compiled: a malformed or unsupported schema, a bad regex."""


class GrammarRejected(RuntimeError):
    """The matcher refused a token the request produced (a forced token outside the grammar)."""


# ---- specs -> llguidance grammars ----------------------------------------------------------------
def _json_schema(schema, strict: bool) -> dict:
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    out = dict(schema)
    out["x-guidance"] = {**JSON_STYLE, "lenient": not strict, **(schema.get("x-guidance") or {})}
    return out


_META = set("\\.+*?()|[]{}^$#&-~/")  # escaped in a regex literal (never < or >: \\< is a word boundary)


def _re_escape(text: str) -> str:
    """A literal for llguidance's regex syntax, inside /.../ in Lark."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append(r"\n")
        elif ch == "\t":
            out.append(r"\t")
        elif ch == "\r":
            out.append(r"\r")
        elif ch in _META:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


class _Lark:
    """Builds a Lark grammar; literal text goes through lit(), which writes the tokenizer's
    special tokens (<tool_call> in Qwen's) as token references: llguidance never matches them
    as text."""

    def __init__(self, specials: dict[str, int]):
        self.specials = specials
        self.split = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))) \
            if specials else None
        self.rules: list[str] = []

    def lit(self, text: str) -> str:
        parts, pos = [], 0
        for m in self.split.finditer(text) if self.split else ():
            if m.start() > pos:
                parts.append(json.dumps(text[pos:m.start()], ensure_ascii=False))
            parts.append(f"<[{self.specials[m.group()]}]>")
            pos = m.end()
        if pos < len(text):
            parts.append(json.dumps(text[pos:], ensure_ascii=False))
        return " ".join(parts)

    def rule(self, name: str, *parts: str) -> str:
        body = " ".join(p for p in parts if p)
        self.rules.append(f"{name}: {body}" if body else f'{name}: ""')
        return name

    def text(self) -> str:
        return "\n".join(self.rules) + "\n"


def _tool_lark(spec: GrammarSpec, specials: dict[str, int]) -> str:
    syn = spec.syntax or CallSyntax("json", '<tool_call>\n{"name": "', '"', "}\n</tool_call>", args=', "arguments": ')
    if not spec.tools:
        raise GrammarError("a tool-call grammar needs at least one tool")
    g = _Lark(specials)
    calls = []
    for i, t in enumerate(spec.tools):
        calls.append(f"call{i}")
        if syn.style == "xml":
            _xml_call(g, i, t, syn)
        else:
            g.rule(f"call{i}", g.lit(syn.head + t.name + syn.tail + syn.args), f"args{i}", g.lit(syn.close))
            g.rules.append(f"args{i}: %json " + json.dumps(_json_schema(t.parameters, t.strict), ensure_ascii=False))
    g.rule("call", " | ".join(calls))
    if spec.text:  # free text around calls; a call opens with the template's tag
        trigger = syn.head.split("\n")[0] or syn.head
        g.rules.insert(0, "start: TEXT? (call TEXT?)*")
        g.rules.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*){_re_escape(trigger)}(?s:.*)/")
    else:
        more = f"({g.lit(syn.sep)} call)*" if spec.multiple else ""
        g.rules.insert(0, "start: " + " ".join(p for p in (g.lit(spec.lead), "call", more) if p))
    return g.text()


def _xml_call(g: _Lark, i: int, t: ToolSchema, syn: CallSyntax) -> None:
    """<function=NAME> then the parameters in schema order (required ones present) and the
    close. String values are raw text, as the model was trained to write them, kept from
    reading as JSON of another type; every other value is JSON."""
    schema = t.parameters if isinstance(t.parameters, dict) else {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    forbid = syn.end_param.strip() or syn.end_param
    items = []
    for j, (key, sub) in enumerate(props.items()):
        name = f"p{i}_{j}"
        items.append(name if key in required else name + "?")
        raw = raw_value(sub, syn.end_param, forbid)
        if raw is not None:
            g.rules.append(f"V{i}_{j}: {raw}")
            g.rule(name, g.lit(syn.param + key + syn.mid), f"V{i}_{j}")
        else:
            g.rules.append(f"v{i}_{j}: %json " + json.dumps(_json_schema(sub, t.strict), ensure_ascii=False))
            g.rule(name, g.lit(syn.param + key + syn.mid), f"v{i}_{j}", g.lit(syn.end_param))
    g.rule(f"call{i}", g.lit(syn.head + t.name + syn.tail), *items, g.lit(syn.close))


def raw_value(sub, end: str, forbid: str) -> str | None:
    """A lexeme for a raw string value followed by `end`, or None when the value goes as JSON
    (not a plain string: a pattern or a format needs the JSON route, which the parser reads back
    as a string as well)."""
    if not isinstance(sub, dict):
        return None
    e = _re_escape(end)
    if "enum" in sub or "const" in sub:
        values = sub["enum"] if "enum" in sub else [sub["const"]]
        if not values or not all(isinstance(v, str) for v in values):
            return None
        alts = []
        for v in values:
            try:
                json.loads(v)
                alts.append(_re_escape(json.dumps(v, ensure_ascii=False)))  # would read as JSON: quote it
            except ValueError:
                alts.append(_re_escape(v))
        return f"/({'|'.join(alts)}){e}/"
    if sub.get("type") != "string" or set(sub) - {"type", "description", "title", "minLength", "maxLength",
                                                  "default", "examples"}:
        return None
    lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
    body = f"(?s:.{{{lo},{int(hi) if hi is not None else ''}}})"
    return (f"/{body}{e}/ & ~/(?s:.*){_re_escape(forbid)}(?s:.*){e}/ & ~/{_JSONISH}{e}/")


def grammar_text(spec: GrammarSpec, specials: dict[str, int] | None = None) -> str:
    """The llguidance grammar for a spec. specials: the tokenizer's special tokens (text -> id),
    which literal tool-call syntax must name as tokens."""
    try:
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(_json_schema({"type": "object"}, True))
        if spec.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(_json_schema(spec.schema, spec.strict))
        if spec.kind == "regex":
            if not isinstance(spec.pattern, str):
                raise GrammarError("a regex grammar needs a pattern")
            return llg.LLMatcher.grammar_from_regex(spec.pattern)
        if spec.kind == "tool_call":
            return llg.LLMatcher.grammar_from_lark(_tool_lark(spec, specials or {}))
    except (TypeError, ValueError) as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(str(e)) from None
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def check(spec: GrammarSpec, specials: dict[str, int] | None = None) -> None:
    """Raise GrammarError if the spec cannot be compiled (no tokenizer needed: the server calls
    this before it queues a request, so a bad schema is a 400, not a failed generation)."""
    err, msgs = llg.LLMatcher.validate_grammar_with_warnings(grammar_text(spec, specials))
    if err:
        raise GrammarError(msgs[0] if msgs else "invalid grammar")


# ---- the engine side --------------------------------------------------------------------------------
class GrammarState:
    """One constrained request's matcher and mask row. Its `job` (compile, next mask) runs on
    the worker; the engine thread waits for it before it touches the matcher."""

    __slots__ = ("spec", "matcher", "row", "active", "job", "error", "fresh")

    def __init__(self, spec: GrammarSpec, row: int):
        self.spec, self.row = spec, row
        self.matcher: llg.LLMatcher | None = None
        self.active = spec.after is None  # the grammar applies (the end of thinking has been seen)
        self.job: Future | None = None
        self.error: str | None = None
        self.fresh = False  # the mask row matches the matcher's state

    def wait(self) -> float:
        """Seconds spent waiting for the pending job (0 if it was done)."""
        job, self.job = self.job, None
        if job is None or job.done():
            if job is not None:
                job.result()
            return 0.0
        t = time.perf_counter()
        job.result()
        return time.perf_counter() - t


class GrammarRunner:
    """The engine's constrained-decoding side: compiled-grammar cache, worker, mask rows.
    Nothing is built before the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, device: torch.device, cache_size: int = CACHE_SIZE,
                 threads: int | None = None, overlap: bool = True):
        """overlap: compute the next masks on the worker while the next forward runs (False:
        on the engine thread just before sampling; for benchmarks)."""
        self.tokenizer, self.vocab, self.device, self.overlap = tokenizer, vocab_size, device, overlap
        self.eos = sorted(eos_ids)
        self.words = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._cache: OrderedDict[str, llg.LLMatcher] = OrderedDict()  # spec key -> pristine matcher (worker only)
        self._lltok = None
        self._pool: ThreadPoolExecutor | None = None
        self._exec: llg.LLExecutor | None = None
        self._buf: torch.Tensor | None = None  # [rows, words] int32 host: one mask row per state
        self._stage: torch.Tensor | None = None  # pinned staging for the rows of one step (CUDA)
        self._ridx: torch.Tensor | None = None  # pinned staging for their logits rows (CUDA)
        self._free: list[int] = []
        self._shifts = None
        # counters for benchmarks and /metrics: masks computed, seconds the worker spent on them,
        # seconds the engine thread waited for them (what did not overlap), compiles, cache hits
        self.stats = {"masks": 0, "mask_s": 0.0, "wait_s": 0.0, "sync_masks": 0, "apply_s": 0.0, "compiles": 0,
                      "compile_s": 0.0, "cache_hits": 0}

    # ---- set-up (lazy) ----
    def _start(self) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-grammar")
            self._exec = llg.LLExecutor(num_threads=self.threads)
            self._grow(16)

    def _grow(self, rows: int) -> None:
        """Room for `rows` states; the old buffer's pending writes are waited for first."""
        if self._buf is not None:
            self._pool.submit(lambda: None).result()  # the worker is single: every earlier job is done
        pin = self.device.type == "cuda"
        buf = torch.full((rows, self.words), -1, dtype=torch.int32, pin_memory=pin)
        old = 0 if self._buf is None else self._buf.shape[0]
        if old:
            buf[:old] = self._buf
        self._buf = buf
        self._stage = torch.empty((rows, self.words), dtype=torch.int32, pin_memory=pin) if pin else None
        self._ridx = torch.empty(rows, dtype=torch.long, pin_memory=pin) if pin else None
        self._free += list(range(old, rows))

    def tokenizer_info(self) -> llg.LLTokenizer:
        """llguidance's view of the tokenizer, from its tokenizer.json (built once per tokenizer,
        on the worker: about 1.5 s for a 250k vocabulary)."""
        if self._lltok is None:
            with _TOKENIZERS_LOCK:
                built = _TOKENIZERS.setdefault(self.tokenizer, {})
                key = (self.vocab, tuple(self.eos))
                if key not in built:
                    t = time.perf_counter()
                    built[key] = llg.LLTokenizer(self.tokenizer.tk.to_str(), n_vocab=self.vocab, eos_token=self.eos)
                    log.info("grammar tokenizer built in %.2f s", time.perf_counter() - t)
                self._lltok = built[key]
        return self._lltok

    @property
    def specials(self) -> dict[str, int]:
        return dict(self.tokenizer.special)

    def warm(self) -> Future:
        """Build the tokenizer view on the worker now (a server can call this at start-up)."""
        self._start()
        return self._pool.submit(self.tokenizer_info)

    # ---- worker jobs ----
    def _compile(self, st: GrammarState) -> None:
        try:
            key = st.spec.key()
            proto = self._cache.get(key)
            if proto is None:
                t = time.perf_counter()
                proto = llg.LLMatcher(self.tokenizer_info(), grammar_text(st.spec, self.specials), log_level=0)
                self.stats["compiles"] += 1
                self.stats["compile_s"] += time.perf_counter() - t
                if proto.is_error():
                    self._fail(st, f"the grammar cannot be compiled: {proto.get_error()}")
                    return
                self._cache[key] = proto
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
            st.matcher = proto.deep_copy()
        except Exception as e:  # noqa: BLE001 - charged to the request, not the worker
            self._fail(st, f"the grammar cannot be compiled: {e}")

    def _fill(self, states: list[GrammarState]) -> None:
        t = time.perf_counter()
        live = [st for st in states if st.matcher is not None and st.error is None]
        try:
            if len(live) == 1:
                st = live[0]
                row = self._buf[st.row]
                st.matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
            elif live:
                self._exec.unsafe_compute_mask_ptr([(st.matcher, st.row) for st in live], self._buf.data_ptr(),
                                                   self.words * 4, self._buf.shape[0])
        except Exception as e:  # noqa: BLE001 - charged to the requests, not the worker
            for st in live:
                self._fail(st, f"mask computation failed: {e}")
        for st in live:
            st.fresh = True
            if st.error is None and st.matcher.is_error():
                self._fail(st, st.matcher.get_error())
        self.stats["masks"] += len(live)
        self.stats["mask_s"] += time.perf_counter() - t

    def _fail(self, st: GrammarState, error: str) -> None:
        """The request fails when it next takes a token; until then its row masks nothing."""
        st.error = error
        self._buf[st.row].fill_(-1)

    def _compile_and_fill(self, st: GrammarState, fill: bool) -> None:
        self._compile(st)
        if fill:
            self._fill([st])

    # ---- the engine thread ----
    def begin(self, req: Request) -> None:
        """Give a constrained request its matcher (compiled on the worker, with its first mask
        when the grammar applies from the first token and that token is not forced)."""
        if req.grammar is not None or req.sampling.grammar is None:
            return
        self._start()
        if not self._free:
            self._grow(self._buf.shape[0] * 2)
        st = GrammarState(req.sampling.grammar, self._free.pop())
        req.grammar = st
        st.job = self._pool.submit(self._compile_and_fill, st, st.active and not req.forcing())

    def prefetch(self, reqs: list[Request]) -> None:
        """Start the next masks of these requests (just after they accepted a token)."""
        states = [r.grammar for r in reqs if r.grammar is not None and r.finished_at is None and r.grammar.active
                  and r.grammar.error is None and not r.forcing()]
        if states and self.overlap:
            fut = self._pool.submit(self._fill, states)
            for st in states:
                st.job = fut

    def rows(self, reqs: list[Request], rows: list[int]) -> list[tuple[GrammarState, int]]:
        """(state, logits row) of the rows to mask this step: active grammar, token not forced."""
        return [(r.grammar, row) for r, row in zip(reqs, rows)
                if r.grammar is not None and r.grammar.active and not r.forcing()]

    def apply(self, logits: torch.Tensor, pairs: list[tuple[GrammarState, int]]) -> torch.Tensor:
        """Mask `pairs`' rows of logits [B, V] in place (-inf where the grammar forbids); waits
        for their masks first. -> the rows' log-normalizers before masking [R] (device)."""
        waited = sum(st.wait() for st, _ in pairs)
        self.stats["wait_s"] += waited
        stale = [st for st, _ in pairs if not st.fresh and st.matcher is not None and st.error is None]
        if stale:  # not prefetched (overlap off): computed here, on the critical path
            self._fill(stale)
            self.stats["sync_masks"] += len(stale)
        t = time.perf_counter()
        idx = [st.row for st, _ in pairs]
        rows = [row for _, row in pairs]
        n, dev, width = len(pairs), logits.device, logits.shape[1]
        if dev.type == "cuda":  # unpack on the device; the rows go over from pinned staging
            stage = self._stage[:n]
            torch.index_select(self._buf, 0, torch.tensor(idx), out=stage)
            bits = stage.to(dev, non_blocking=True)
            if self._shifts is None or self._shifts.device != dev:
                self._shifts = torch.arange(32, dtype=torch.int32, device=dev)
            forbid = ((bits.unsqueeze(-1) >> self._shifts) & 1).view(n, -1)[:, :width] == 0
        else:  # numpy unpacks bits fastest; 0/1 bytes read as bool without a copy
            host = ~self._buf[idx].numpy().view(np.uint8)
            forbid = torch.from_numpy(np.unpackbits(host, axis=1, count=width, bitorder="little")).view(torch.bool)
        with torch.inference_mode():  # the model's logits are inference tensors
            if rows == list(range(rows[0], rows[0] + n)):  # a view: no gather, no scatter
                sub = logits[rows[0]:rows[0] + n]
                lse = torch.logsumexp(sub.float(), -1)
                sub.masked_fill_(forbid, float("-inf"))
            else:
                if dev.type == "cuda":
                    self._ridx[:n] = torch.tensor(rows, dtype=torch.long)
                    ridx = self._ridx[:n].to(dev, non_blocking=True)  # pinned: no wait for the forward
                else:
                    ridx = torch.tensor(rows, dtype=torch.long)
                sub = logits.index_select(0, ridx)
                lse = torch.logsumexp(sub.float(), -1)
                logits.index_copy_(0, ridx, sub.masked_fill_(forbid, float("-inf")))
        self.stats["apply_s"] += time.perf_counter() - t
        return lse

    def accept(self, req: Request, tok: int) -> bool:
        """Advance the matcher with the token the request took. -> True when the grammar is
        complete (the request ends). Raises GrammarRejected if the token does not fit."""
        st = req.grammar
        st.wait()
        if not st.active:
            if tok == st.spec.after:
                st.active = True
            return False
        if st.error is not None:
            raise GrammarRejected(st.error)
        st.fresh = False
        if not st.matcher.consume_token(tok):
            raise GrammarRejected(f"token {tok} does not fit the grammar: {st.matcher.get_error()[:300]}")
        return st.matcher.is_stopped()

    def release(self, req: Request) -> None:
        st = req.grammar
        if st is None:
            return
        try:
            st.wait()
        except Exception:  # noqa: BLE001
            pass
        st.matcher = None
        self._free.append(st.row)
        req.grammar = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
