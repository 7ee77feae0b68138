"""Anthropic-compatible API: /v1/messages (streaming and not) and /v1/messages/count_tokens.

Fields the engine does not use (thinking, context_management, output_config's effort, metadata,
cache_control, anthropic-beta headers, ...) are accepted and ignored. Structured outputs are
honoured: output_config.format (and the beta's top-level output_format) json_schema, tools with
`strict: true`, and tool_choice any / tool with arguments held to the tool's input_schema.
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
import uuid

from starlette.responses import JSONResponse

from .common import (ApiError, build_prompt, constrain, field, grammar_for, json_args, off_loop,
                     refuse_continued_grammar, render, sampling_from, text_of, with_defaults)
from .tool_choice import call_grammar, forced_opening, strict_grammar, wanted
from .generation import Done, Ping, RequestStream, collect, events
from .openai import submit
from .parser import Event

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def signature(thinking: str) -> str:
    """Opaque, non-empty signature for a thinking block (clients send it back unchanged)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: content must be a string or a list of blocks")
    for b in content:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise ApiError(400, f"{where}: each content block must be an object with a type")
    return content


def normalize(body: dict) -> list[dict]:
    """Anthropic system + messages -> the template's message list."""
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": text_of(system, "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "system"):
            raise ApiError(400, f"{where}: role must be 'user' or 'assistant'")
        blocks = _blocks(m.get("content"), where)
        if role == "system":  # Claude Code puts these inside messages
            out.append({"role": "system", "content": text_of(blocks, where)})
        elif role == "assistant":
            msg = {"role": "assistant", "content": "", "tool_calls": []}
            for b in blocks:
                t = b["type"]
                if t == "text":
                    msg["content"] += str(b.get("text", ""))
                elif t == "thinking":
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + str(b.get("thinking", ""))
                elif t == "tool_use":
                    if not isinstance(b.get("name"), str):
                        raise ApiError(400, f"{where}: tool_use blocks need a name")
                    msg["tool_calls"].append({"id": b.get("id", ""), "type": "function",
                                              "function": {"name": b["name"], "arguments": json_args(b.get("input", {}))}})
                elif t in ("redacted_thinking", "server_tool_use", "web_search_tool_result"):
                    continue
                else:
                    raise ApiError(400, f"{where}: unsupported content block type {t!r}")
            out.append(msg)
        else:
            text = []
            for b in blocks:
                t = b["type"]
                if t == "tool_result":
                    c = b.get("content", "")
                    body_text = text_of(c if isinstance(c, (str, list)) else str(c), where)
                    if b.get("is_error"):
                        body_text = "Error: " + body_text
                    out.append({"role": "tool", "tool_call_id": b.get("tool_use_id", ""), "content": body_text})
                else:
                    text.append(text_of([b], where))
            if text or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": "".join(text)})
    return out


def tools_of(body: dict):
    tools = field(body, "tools", "array")
    choice = body.get("tool_choice") or {}
    if not tools or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ApiError(400, "each tool needs a name")
        if "input_schema" not in t:  # server tools (web search, ...): not ours to run
            continue
        fn = {"name": t["name"], "description": t.get("description", ""), "parameters": t["input_schema"]}
        if t.get("strict") is True:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out or None


def check_model(ctx, body: dict) -> str:
    model = field(body, "model", "string", required=True)
    if model not in ctx.model_names:
        raise ApiError(404, f"model '{model}' not found; this server serves {ctx.model_names[0]!r}")
    return model


def output_format(body: dict):
    """output_config.format (or the beta's top-level output_format): {"type": "json_schema",
    "schema": {...}} -> a GrammarSpec (Anthropic's structured outputs are strict), or None."""
    config = field(body, "output_config", "object") or {}
    fmt, param = config.get("format"), "output_config.format"
    if fmt is None:
        fmt, param = field(body, "output_format", "object"), "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, f"{param} must be {{'type': 'json_schema', 'schema': {{...}}}}")
    return grammar_for({"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                               "strict": True}}, param)


def prepare(ctx, body: dict):
    """-> (rendered prompt, tools, constrain(sampling, in_reasoning): forces a demanded tool call
    and sets the grammar of the call, of the output format or of strict tools)."""
    messages = normalize(body)
    tools = tools_of(body)
    spec = output_format(body)
    thinking = body.get("thinking")
    kwargs = {}
    # "disabled" turns thinking off; "enabled" (which Claude Code sends on every turn) leaves the
    # template's or the server's default (--default-chat-template-kwargs) in charge
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        kwargs["enable_thinking"] = False
    # a final assistant message is a prefill: the answer continues its text (Anthropic's API)
    last = messages[-1]
    prefill = last["role"] == "assistant" and not last.get("tool_calls") and bool(last["content"].strip())
    kwargs = with_defaults(ctx, kwargs)
    text = render(ctx, messages, tools, kwargs, continue_final=prefill)
    choice = body.get("tool_choice")
    must, name = wanted(choice, [t["function"]["name"] for t in tools or []], "anthropic") \
        if tools else (False, None)
    parallel = not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is True)

    def constrain_output(sampling, in_reasoning: bool) -> None:
        if must:  # open the call by forced tokens; the grammar holds the rest to the input_schema
            f = forced_opening(ctx, name, in_reasoning, **kwargs)
            sampling.forced, sampling.forced_after = f.tokens, f.after
            sampling.grammar = call_grammar(ctx, tools, name, f, parallel, **kwargs)
        elif spec is not None:
            constrain(ctx, sampling, spec, in_reasoning)
        else:
            sampling.grammar = strict_grammar(ctx, tools, in_reasoning, **kwargs)
        if prefill:
            refuse_continued_grammar(sampling, "messages")
    return text, tools, constrain_output


def _count(ctx, body: dict) -> int:
    check_model(ctx, body)
    text, _, _ = prepare(ctx, body)
    return len(ctx.tokenizer.encode(text))


async def count_tokens(ctx, body: dict, request):
    return JSONResponse({"input_tokens": await off_loop(_count, ctx, body)})


def _plan(ctx, body: dict):
    """Validation, the rendered and tokenized prompt, the grammar (off the event loop)."""
    model = check_model(ctx, body)
    max_tokens = field(body, "max_tokens", "integer", required=True)
    sampling = sampling_from(body, max_tokens, field(body, "stop_sequences", "array"), ctx.serving.max_len)
    text, tools, constrain_output = prepare(ctx, body)
    prompt = build_prompt(ctx, text, sampling)
    constrain_output(sampling, prompt.in_reasoning)
    return model, sampling, tools, prompt


async def messages(ctx, body: dict, request):
    model, sampling, tools, prompt = await off_loop(_plan, ctx, body)
    stream = field(body, "stream", "boolean", False)
    req, queue = submit(ctx, prompt.ids, sampling)
    gen = events(ctx, req, queue, tools, prompt.in_reasoning, request.is_disconnected)
    mid = "msg_" + uuid.uuid4().hex[:24]
    if stream:
        return RequestStream(ctx, [(req, queue)], _stream(gen, req, mid, model))
    reasoning, content, calls, done = collect([e async for e in gen])
    if done.finish_reason == "error":
        raise ApiError(500, f"generation failed: {done.error}")
    blocks = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)})
    if content or not (calls or reasoning):
        blocks.append({"type": "text", "text": content})
    for c in calls:
        blocks.append({"type": "tool_use", "id": "toolu_" + c.id[5:], "name": c.name, "input": json.loads(c.arguments)})
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
                         "stop_reason": stop_reason(done, bool(calls)), "stop_sequence": done.stop_sequence,
                         "usage": usage(done)})


def usage(done: Done) -> dict:
    return _usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    """Anthropic's meaning: input_tokens are the prompt tokens NOT read from the cache."""
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(done: Done, tool_use: bool) -> str:
    if done.finish_reason == "length":
        return "max_tokens"
    if done.finish_reason == "stop_sequence":
        return "stop_sequence"
    return "tool_use" if tool_use else "end_turn"


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _message_start(req, mid, model) -> str:
    return _event("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(len(req.prompt_ids), req.cached_tokens, 0)}}) + _event("ping", {})


async def _stream(gen, req, mid, model):
    """message_start waits for the first engine output: clients read the input and cache
    figures from it, and how much of the prompt the cache restored is known only once the
    engine has taken the request (req.cached_tokens is set before its first token). Pings
    before it keep the connection alive (the SDKs skip them wherever they come)."""
    started = False
    index, open_kind, thinking_text, used_tool = -1, None, "", False

    def close():
        out = []
        if open_kind == "thinking":
            out.append(_event("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": signature(thinking_text)}}))
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        return out

    try:
        async for ev in gen:
            if isinstance(ev, Ping):
                yield _event("ping", {})
                continue
            if not started and not (isinstance(ev, Done) and ev.finish_reason == "error"):
                started = True
                yield _message_start(req, mid, model)
            if isinstance(ev, Event) and ev.kind in ("reasoning", "content"):
                kind = "thinking" if ev.kind == "reasoning" else "text"
                if open_kind != kind:
                    for s in close():
                        yield s
                    index, open_kind = index + 1, kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                if kind == "thinking":
                    thinking_text += ev.text
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": ev.text}})
                else:
                    yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": ev.text}})
            elif isinstance(ev, Event) and ev.kind == "tool_call":
                for s in close():
                    yield s
                index, open_kind, used_tool = index + 1, "tool_use", True
                t = ev.tool
                yield _event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": "toolu_" + t.id[5:], "name": t.name, "input": {}}})
                yield _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": t.arguments}})
            elif isinstance(ev, Done):
                if ev.finish_reason == "error":
                    yield _event("error", {"error": {"type": "api_error", "message": f"generation failed: {ev.error}"}})
                    return
                for s in close():
                    yield s
                open_kind = None
                if index < 0:  # always at least one block
                    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                    yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason(ev, used_tool),
                                                         "stop_sequence": ev.stop_sequence},
                                               "usage": usage(ev)})
                yield _event("message_stop", {})
    finally:
        await gen.aclose()


def _model_card(ctx, name: str) -> dict:
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ctx.started))
    return {"type": "model", "id": name, "display_name": name, "created_at": created}


def models(ctx) -> JSONResponse:
    data = [_model_card(ctx, n) for n in ctx.model_names]
    return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]})


def model(ctx, name: str) -> JSONResponse:
    if name not in ctx.model_names:
        raise ApiError(404, f"model '{name}' not found; this server serves {ctx.model_names[0]!r}")
    return JSONResponse(_model_card(ctx, name))
