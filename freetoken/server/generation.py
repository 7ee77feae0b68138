"""One request's server-side life: submit, detokenize incrementally, cut at stop strings,
parse thinking / text / tool calls, and report usage. Shared by the OpenAI and Anthropic
adapters, which only format what this yields."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse

from ..runtime.request import Request, SamplingOptions
from .common import ClientGone
from .harmony import HarmonyParser, writes_harmony
from .parser import Event, OutputParser, merge, param_schemas
from .tool_choice import parser_format

PING_EVERY_S = 10.0  # keep-alive while a long prompt prefills


@dataclass
class Tokens:
    """Output tokens with their log-probabilities. events() yields them (when asked) just
    before the text they produce, so a stream can attach each token to its chunk."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # most likely first
    text_offsets: list[int] = field(default_factory=list)  # where each token's text starts in the output

    def extend(self, other: "Tokens") -> None:
        self.ids += other.ids
        self.logprobs += other.logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offsets += other.text_offsets


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "stop_sequence" | "cancelled" | "error"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
    # the tokens behind the output text: EOS / stop ids (hidden) and tokens the engine made
    # after a stop string are left out
    tokens: Tokens = field(default_factory=Tokens)


@dataclass
class Ping:
    pass


class Detokenizer:
    """Incremental decode that never emits half a multi-byte character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


class RawParser:
    """No chat parsing (/v1/completions): all text is content."""

    def feed(self, text: str) -> list[Event]:
        return [Event("content", text)]

    def finish(self) -> list[Event]:
        return []


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """-> (text safe to emit, the stop string if one was hit)."""
        self.buf += text
        hits = [(self.buf.find(s), s) for s in self.stops if s in self.buf]
        if hits:
            idx, s = min(hits)
            out, self.buf = self.buf[:idx], ""
            return out, s
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, None
        cut = max(0, len(self.buf) - self.hold)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, None

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def cancel_unfinished(ctx, started) -> None:
    """Cancel the requests whose events nobody will read: a generator that never ran has no
    finally of its own to do it (a choice that failed first, a client gone at the first chunk)."""
    for req, _ in started:
        if req.finish_reason is None or req.finished_at is None:
            ctx.serving.cancel(req)


class RequestStream(StreamingResponse):
    """A streamed (SSE) answer whose requests are cancelled however the response ends: its last
    chunk, a failed choice, the client gone mid-stream, or the client gone before the headers
    went out (Starlette then never iterates the body, so no events generator runs its finally
    and the request would decode to max_tokens for nobody). started: [(request, queue)]."""

    def __init__(self, ctx, started, body_iter, **kw):
        kw.setdefault("headers", {"cache-control": "no-cache"})
        super().__init__(_closing(ctx, started, body_iter), media_type="text/event-stream", **kw)
        self._ctx, self._started = ctx, started

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_unfinished(self._ctx, self._started)  # no await: a cancelled task may not get past one


async def _closing(ctx, started, body_iter):
    try:
        async for part in body_iter:
            yield part
    finally:
        cancel_unfinished(ctx, started)  # first, without an await: a cancelled task may not get past one
        await body_iter.aclose()


def start(ctx, prompt_ids: list[int], sampling: SamplingOptions):
    """Queue a request now (raises QueueFull before any response byte is sent)."""
    req = Request(prompt_ids, sampling)
    return req, ctx.serving.submit(req)


async def events(ctx, req: Request, queue, tools, in_reasoning: bool, is_disconnected=None,
                 raw: bool = False, tokens: bool = False):
    """Async iterator of parser Events, Pings and a final Done for a started request; with
    tokens=True also a Tokens before the text each engine event produces.
    is_disconnected: polled twice a second; a vanished client cancels its request and the
    iterator ends without a Done (collect() turns that into ClientGone)."""
    sampling, prompt_ids = req.sampling, req.prompt_ids
    detok = Detokenizer(ctx.tokenizer)
    stops = StopMatcher(sampling.stop)
    # tool calls are read in the model's own format, probed from its chat template
    # tools: the request's tools (a list, typing the call forms that write values raw), or a bool
    schemas = param_schemas(tools) if isinstance(tools, (list, tuple)) else None
    tools = tools is not None and tools is not False
    fmt = parser_format(ctx.template) if tools and not raw else None
    if raw:
        parser = RawParser()
    elif writes_harmony(ctx.template):  # GPT-OSS: channels, not tags (server/harmony.py)
        parser = HarmonyParser(tools=tools)
    else:
        parser = OutputParser(in_reasoning=in_reasoning, tools=tools, fmt=fmt, schemas=schemas)
    hidden = set(ctx.serving.engine.eos_ids) | set(sampling.stop_token_ids)
    stop_hit = None
    kept = Tokens()
    n_out = chars = 0  # output tokens seen (index into req.top_logprobs), characters decoded
    counted = 0  # output tokens up to the one that completed a stop string (usage counts these)
    last_out = last_check = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if is_disconnected is not None and now - last_check > 0.5:
                last_check = now
                if await is_disconnected():  # client gone: free the slot, stop streaming
                    ctx.serving.cancel(req)
                    return
            try:
                ev = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if time.monotonic() - last_out > PING_EVERY_S:
                    last_out = time.monotonic()
                    yield Ping()
                continue
            last_out = time.monotonic()
            shown = [t not in hidden or sampling.ignore_eos for t in ev.token_ids]
            visible = [t for t, s in zip(ev.token_ids, shown) if s]
            text = detok.push(visible) if visible else ""
            if ev.finish_reason is not None:
                text += detok.flush()
            new = None
            if stop_hit is None:  # past a stop string the engine's tokens are not output
                new = _tokens_of(req, ev, n_out, shown, chars)
                kept.extend(new)
                counted += len(ev.token_ids)
            n_out += len(ev.token_ids)
            chars += len(text)
            if stop_hit is not None:
                text = ""  # tokens the engine made before it saw the cancel
            elif text and n_out >= sampling.min_tokens:  # vLLM's: no stop string ends an output shorter
                text, stop_hit = stops.push(text)
                if stop_hit is not None:
                    ctx.serving.cancel(req, "stop_sequence")
            if ev.finish_reason is not None and stop_hit is None:
                text += stops.flush()
            if tokens and new is not None and new.ids:
                yield new
            for e in parser.feed(text) if text else []:
                yield e
            if ev.finish_reason is not None:
                for e in parser.finish():
                    yield e
                reason = "stop_sequence" if stop_hit is not None else ev.finish_reason
                # with a stop string, the tokens the engine made before the cancel landed are not
                # the answer's: usage counts up to the token that completed the stop string
                made = len(req.output_ids) if stop_hit is None else counted
                yield Done(reason, stop_hit, len(prompt_ids), made, req.cached_tokens, ev.error, kept)
                return
    finally:
        if req.finish_reason is None or req.finished_at is None:
            ctx.serving.cancel(req)  # client went away mid-stream: free the slot
        ctx.metrics.request_finished(req, time.monotonic())


def _tokens_of(req: Request, ev, first: int, shown: list[bool], offset: int) -> Tokens:
    """The shown tokens of one engine event, with their top alternatives (the engine appends
    to req.top_logprobs before it emits the event; empty when none were asked for)."""
    tops = req.top_logprobs
    out = Tokens()
    for j, (t, lp, s) in enumerate(zip(ev.token_ids, ev.logprobs, shown)):
        if s:
            i = first + j
            out.extend(Tokens([t], [lp], [list(tops[i]) if i < len(tops) else []], [offset]))
    return out


def collect(events: list) -> tuple[str, str, list, Done]:
    """Whole-response view of a finished generation; ClientGone if it ended because the
    client went away (no Done: nobody to answer)."""
    done = next((e for e in events if isinstance(e, Done)), None)
    if done is None:
        raise ClientGone()
    return *merge([e for e in events if isinstance(e, Event)]), done
