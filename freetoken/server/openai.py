"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import uuid

from starlette.responses import JSONResponse

from ..runtime.scheduler import QueueFull
from ..runtime.serving import ShuttingDown
from .common import (EFFORTS, ApiError, build_prompt, constrain, continuation, effort_kwargs, field, fit_prompt, grammar_for, json_args,
                     logit_options, off_loop, refuse_continued_grammar, render, sampling_from, template_kwargs,
                     text_of, with_defaults)
from .generation import Done, Ping, RequestStream, Tokens, cancel_unfinished, collect, events, start
from .logprobs import TokenText, chat_entries, chat_options, completion_logprobs, completion_options
from .merge import END, merged
from .parser import Event
from .tool_choice import call_grammar, forced_opening, strict_grammar, wanted

log = logging.getLogger("freetoken.server")

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def check_model(ctx, body: dict) -> str:
    """The request's model id, which must be one this server serves; left out, the first of them
    (vLLM's rule: a client written for llama.cpp's server, which ignores the field, may omit it)."""
    model = field(body, "model", "string")
    if model is None:
        return ctx.model_names[0]
    if model not in ctx.model_names:
        raise ApiError(404, f"model '{model}' does not exist; this server serves {ctx.model_names[0]!r}",
                       param="model", code="model_not_found")
    return model


def normalize_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"{where}: role must be one of {sorted(ROLES)}", param="messages")
        role = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
        if role in ("user", "system") and m.get("content") is None:  # only an assistant turn may have none
            raise ApiError(400, f"{where}: a {m['role']} message needs 'content' (a string or a list of text parts)",
                           param="messages")
        msg = {"role": role, "content": text_of(m.get("content"), where)}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not calls and isinstance(m.get("function_call"), dict):  # the deprecated functions API's call
                calls = [{"id": "", "function": m["function_call"]}]
            if not msg["content"] and isinstance(m.get("refusal"), str):  # an earlier refusal, as text
                msg["content"] = m["refusal"]
            if not isinstance(calls, list):
                raise ApiError(400, f"{where}: tool_calls must be a list", param="messages")
            msg["tool_calls"] = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ApiError(400, f"{where}: each tool call needs function.name", param="messages")
                msg["tool_calls"].append({"id": c.get("id") or "", "type": "function",
                                          "function": {"name": fn["name"], "arguments": json_args(fn.get("arguments"))}})
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or m.get("name") or ""
        out.append(msg)
    return out


def normalize_tools(body: dict):
    tools = field(body, "tools", "array")
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                or not isinstance(t["function"].get("name"), str):
            raise ApiError(400, "each tool must be {'type': 'function', 'function': {'name': ..., ...}}", param="tools")
        out.append({"type": "function", "function": t["function"]})
    return out


def _max_tokens(body: dict):
    a = field(body, "max_completion_tokens", "integer")
    b = field(body, "max_tokens", "integer")
    return a if a is not None else b


MAX_N = 16  # choices a request may ask for (each is a request of its own in the engine)


def choice_count(body) -> int:
    """OpenAI's `n`: choices sampled from one prompt, each its own request in the engine (they
    share the prompt's prefix-cache pages). Streamed, every choice's chunks carry its index."""
    n = field(body, "n", "integer", 1)
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be from 1 to {MAX_N}, got {n}", param="n")
    return n


def choice_sampling(sampling, i: int):
    """Choice i's sampling options: a seeded request's choices take seeds seed, seed + 1, ...
    (the same seed would sample the same text n times); the rest is shared, read-only (a
    grammar's matcher is made per request)."""
    if i == 0:
        return sampling
    seed = None if sampling.seed is None else (sampling.seed + i) % (1 << 64)
    return dataclasses.replace(sampling, seed=seed)


def start_all(ctx, jobs: list[tuple[list[int], object]]) -> list[tuple]:
    """Start a request per (prompt ids, sampling) job -> [(request, queue)]. A start refused part
    way (a full queue) cancels those already started, then raises its error (a 429)."""
    started = []
    try:
        for ids, sampling in jobs:
            started.append(submit(ctx, ids, sampling))
    except ApiError:
        for req, _ in started:
            ctx.serving.cancel(req)
        raise
    return started


async def run_choices(ctx, jobs: list[tuple[list[int], object]], open_events) -> list[list]:
    """Start a request per (prompt ids, sampling) job, then collect each one's events
    concurrently (the engine batches them). open_events(req, queue) -> the events iterator. A
    start refused part way (a full queue) cancels those already started."""
    started = start_all(ctx, jobs)
    gens = [open_events(req, q) for req, q in started]
    runs: list[list] = [[] for _ in gens]
    try:  # merged() stops and closes every choice when one fails or this request is cancelled
        async with contextlib.aclosing(merged(gens)) as evs:
            async for i, ev in evs:
                if ev is not END:
                    runs[i].append(ev)
        return runs
    finally:
        cancel_unfinished(ctx, started)


def allowed_tools(tools, choice: dict):
    """tool_choice {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required",
    "tools": [{"type": "function", "function": {"name": ...}}, ...]}} -> (the tools kept, the
    plain tool_choice): the model sees and may call only the tools named."""
    spec = choice.get("allowed_tools")
    mode, named = (spec.get("mode", "auto"), spec.get("tools")) if isinstance(spec, dict) else (None, None)
    if mode not in ("auto", "required") or not isinstance(named, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in named):
        raise ApiError(400, "tool_choice allowed_tools needs {'mode': 'auto' | 'required', 'tools': "
                            "[{'type': 'function', 'function': {'name': ...}}, ...]}", param="tool_choice")
    if not tools or not named:
        raise ApiError(400, "tool_choice allowed_tools needs tools, and names at least one of them", param="tool_choice")
    keep = {t["function"]["name"] for t in named}
    have = {t["function"]["name"] for t in tools}
    if keep - have:
        raise ApiError(400, f"tool_choice allowed_tools names {sorted(keep - have)}, which are not among the tools "
                            "given", param="tool_choice")
    return [t for t in tools if t["function"]["name"] in keep], mode


def legacy_functions(body: dict) -> tuple[dict, bool]:
    """OpenAI's deprecated function calling -> tools: `functions` [{name, description,
    parameters}] and `function_call` ("none" | "auto" | {"name"}) become `tools` and
    `tool_choice`, one call at most (the old API returns a single `function_call`). -> (the body to
    serve, whether the answer takes the old shape). A body with `tools` is served as it is."""
    if body.get("functions") is None or body.get("tools") is not None:
        return body, False
    fns = body["functions"]
    if not isinstance(fns, list) or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in fns):
        raise ApiError(400, "functions must be a list of {'name': ..., 'parameters': ...}", param="functions")
    call = body.get("function_call")
    if isinstance(call, dict):
        if not isinstance(call.get("name"), str):
            raise ApiError(400, "function_call must be 'none', 'auto' or {'name': ...}", param="function_call")
        choice = {"type": "function", "function": {"name": call["name"]}}
    elif call in (None, "none", "auto"):
        choice = call or "auto"
    else:
        raise ApiError(400, "function_call must be 'none', 'auto' or {'name': ...}", param="function_call")
    return {**body, "tools": [{"type": "function", "function": f} for f in fns], "tool_choice": choice,
            "parallel_tool_calls": False}, True


def _chat_plan(ctx, body: dict):
    """Validation, the rendered and tokenized prompt, the grammar: the CPU-heavy part of a chat
    request, run off the event loop (common.off_loop)."""
    model = check_model(ctx, body)
    n = choice_count(body)
    spec = grammar_for(field(body, "response_format", "object"))
    parallel = field(body, "parallel_tool_calls", "boolean", True)
    messages = normalize_messages(body.get("messages"))
    tools = normalize_tools(body)
    sampling = sampling_from(body, _max_tokens(body), body.get("stop"), default_max=ctx.serving.max_len)
    logit_options(body, sampling, ctx.vocab_size)
    want_logprobs = chat_options(body, sampling)
    effort = field(body, "reasoning_effort", "string")
    if effort is not None and effort not in EFFORTS:
        raise ApiError(400, f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort!r}",
                       param="reasoning_effort")
    kwargs = with_defaults(ctx, {**effort_kwargs(effort), **template_kwargs(body)})  # chat_template_kwargs win
    cont, gen = continuation(body)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = allowed_tools(tools, choice)
    text = render(ctx, messages, tools, kwargs, continue_final=cont, generation=gen)
    prompt = build_prompt(ctx, text, sampling)
    if choice not in (None, "none", "auto") and not tools:
        raise ApiError(400, "tool_choice other than 'none'/'auto' needs tools", param="tool_choice")
    must, name = wanted(choice, [t["function"]["name"] for t in tools or []], "openai")
    if must:  # open the call by forced tokens; the grammar holds the rest to the tool's schema
        f = forced_opening(ctx, name, prompt.in_reasoning, **kwargs)
        sampling.forced, sampling.forced_after = f.tokens, f.after
        sampling.grammar = call_grammar(ctx, tools, name, f, parallel, **kwargs)
    elif spec is not None:  # the answer in the response format (no room left for tool calls)
        constrain(ctx, sampling, spec, prompt.in_reasoning)
    else:  # strict tools: any call the model opens follows its tool's schema
        sampling.grammar = strict_grammar(ctx, tools, prompt.in_reasoning, **kwargs)
    if cont:
        refuse_continued_grammar(sampling, "continue_final_message")
    return model, tools, sampling, prompt, want_logprobs, n


async def chat_completions(ctx, body: dict, request):
    body, legacy = legacy_functions(body)
    model, tools, sampling, prompt, want_logprobs, n = await off_loop(_chat_plan, ctx, body)
    stream = field(body, "stream", "boolean", False)
    include_usage = bool((field(body, "stream_options", "object") or {}).get("include_usage"))
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
    jobs = [(prompt.ids, choice_sampling(sampling, i)) for i in range(n)]
    if stream:  # every choice's chunks as they come, each with its index
        started = start_all(ctx, jobs)
        gens = [events(ctx, req, queue, tools, prompt.in_reasoning, request.is_disconnected, tokens=want_logprobs)
                for req, queue in started]
        text_of_token = ctx.token_text if want_logprobs else None
        body_iter = _chat_stream(gens, cid, created, model, include_usage, text_of_token, legacy)
        return RequestStream(ctx, started, body_iter)
    runs = await run_choices(ctx, jobs, lambda req, queue: events(
        ctx, req, queue, tools, prompt.in_reasoning, request.is_disconnected))
    choices, dones = [], []
    for i, evs in enumerate(runs):
        reasoning, content, calls, done = collect(evs)
        _raise_if_failed(done)
        msg = {"role": "assistant", "content": content if (content or not calls) else None}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if calls and legacy:  # the deprecated shape: one function_call, no tool_calls
            msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        choice = {"index": i, "message": msg, "finish_reason": _finish(done, bool(calls), legacy), "logprobs": None}
        if want_logprobs:
            choice["logprobs"] = _chat_logprobs(ctx, done.tokens)
        choices.append(choice)
        dones.append(done)
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": total_usage(dones), "system_fingerprint": "freetoken"})


def _chat_logprobs(ctx, t: Tokens) -> dict:
    # every output token, thinking and tool-call text included, in generation order
    return {"content": chat_entries(ctx.token_text, t.ids, t.logprobs, t.top_logprobs), "refusal": None}


def total_usage(dones: list[Done], prompts: int = 1) -> dict:
    """Usage of a request's choices: its prompt counted once per prompt (as OpenAI counts n > 1),
    every choice's completion tokens summed; dones are in prompt-major order, n per prompt."""
    per = len(dones) // prompts
    prompt = sum(d.prompt_tokens for d in dones[::per])
    out = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in dones[::per])}}


def _finish(done: Done, tool_calls: bool, legacy: bool = False) -> str:
    if done.finish_reason == "length":
        return "length"
    return ("function_call" if legacy else "tool_calls") if tool_calls else "stop"


def _raise_if_failed(done: Done):
    if done.finish_reason == "error":
        raise ApiError(500, f"generation failed: {done.error}", kind="server_error")


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def submit(ctx, ids, sampling):
    try:
        return start(ctx, ids, sampling)
    except ShuttingDown as e:
        raise ApiError(503, str(e), kind="server_error") from None
    except QueueFull as e:
        raise ApiError(429, f"server busy: {e}; retry shortly", kind="rate_limit_error",
                       headers={"retry-after": "1"}) from None


async def _choice_events(gens, pending: list):
    """merged() for the streams: (index, event) of every choice's text events and Done, with
    - each choice's Tokens put onto pending[index] (its next chunk's logprobs);
    - a keep-alive line in place of a Ping, unless another went out within the last second
      (each of n choices pings on its own while a long prompt prefills);
    - a failed choice (an error Done, or an exception: the headers are gone, and a dropped
      connection would tell the client nothing) as one error event, and the end (no [DONE];
      closing merged() cancels the other choices)."""
    last_ping = 0.0
    try:
        async with contextlib.aclosing(merged(gens)) as evs:
            async for i, ev in evs:
                if isinstance(ev, Ping):
                    if time.monotonic() - last_ping >= 1.0:
                        last_ping = time.monotonic()
                        yield i, ": keep-alive\n\n"
                elif isinstance(ev, Tokens):
                    pending[i].extend(ev)
                elif isinstance(ev, Done) and ev.finish_reason == "error":
                    yield i, _sse({"error": {"message": f"generation failed: {ev.error}", "type": "server_error"}})
                    return
                else:
                    yield i, ev
    except Exception as e:  # noqa: BLE001  a bug in a choice's event stream, not the client's doing
        log.exception("a streamed answer failed")
        yield -1, _sse({"error": {"message": f"generation failed: {type(e).__name__}: {e}", "type": "server_error"}})


async def _chat_stream(gens, cid, created, model, include_usage, text_of_token: TokenText | None,
                       legacy: bool = False):
    """gens: one events iterator per choice (index = position). text_of_token: given when the
    client asked for logprobs; each chunk then carries the tokens of its choice that arrived
    since its previous chunk (a token that shows no text yet, a held-back partial tag say, goes
    with the next one). legacy: the call as a `function_call` delta (the deprecated `functions`
    API), one at most. A failed choice ends the stream with an error event (no [DONE])."""
    n = len(gens)
    pending = [Tokens() for _ in range(n)]
    n_calls = [0] * n
    dones: list[Done | None] = [None] * n

    def chunk(i, delta, finish=None):
        lp = None
        if text_of_token is not None and pending[i].ids:
            t, pending[i] = pending[i], Tokens()
            lp = {"content": chat_entries(text_of_token, t.ids, t.logprobs, t.top_logprobs), "refusal": None}
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": "freetoken",
                     "choices": [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}]})
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async with contextlib.aclosing(_choice_events(gens, pending)) as evs:
        async for i, ev in evs:
            if isinstance(ev, str):  # a keep-alive, or a failed choice's error event (the last)
                yield ev
            elif isinstance(ev, Event) and ev.kind == "content":
                yield chunk(i, {"content": ev.text})
            elif isinstance(ev, Event) and ev.kind == "reasoning":
                yield chunk(i, {"reasoning_content": ev.text})
            elif isinstance(ev, Event) and ev.kind == "tool_call":
                t = ev.tool
                if legacy:
                    if not n_calls[i]:
                        yield chunk(i, {"function_call": {"name": t.name, "arguments": t.arguments}})
                else:
                    yield chunk(i, {"tool_calls": [{"index": n_calls[i], "id": t.id, "type": "function",
                                                    "function": {"name": t.name, "arguments": t.arguments}}]})
                n_calls[i] += 1
            elif isinstance(ev, Done):
                dones[i] = ev
                yield chunk(i, {}, _finish(ev, n_calls[i] > 0, legacy))
                if all(d is not None for d in dones):
                    if include_usage:
                        yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [], "usage": total_usage(dones)})
                    yield "data: [DONE]\n\n"


MAX_PROMPTS = 16  # prompts one /v1/completions request may list (each is a request in the engine)


def _is_ids(x) -> bool:
    """A non-empty list of token ids (ints, not bools)."""
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(prompt) -> list:
    """/v1/completions' `prompt`: a string, a list of token ids, or a list of either (a batch)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"prompt lists at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
        return prompt
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those", param="prompt")


def _completion_ids(ctx, prompt, suffix) -> list[int]:
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(fill_in_middle(ctx, prompt, suffix) if suffix else prompt)
    if _is_ids(prompt):
        if suffix:
            raise ApiError(400, "suffix needs the prompt as a string (fill-in-the-middle is built from text)",
                           param="suffix")
        if any(not 0 <= t < ctx.vocab_size for t in prompt):
            raise ApiError(400, "prompt token ids must be in [0, vocab size)", param="prompt")
        return list(prompt)
    raise ApiError(400, "each prompt must be a string or a non-empty list of token ids", param="prompt")


def _completion_plan(ctx, body: dict):
    """A raw completion's validated, tokenized prompts and sampling (off the event loop)."""
    model = check_model(ctx, body)
    n = choice_count(body)
    spec = grammar_for(field(body, "response_format", "object"))
    prompts = _prompts(body.get("prompt"))
    suffix = field(body, "suffix", "string")
    ids = [_completion_ids(ctx, p, suffix) for p in prompts]
    sampling = sampling_from(body, field(body, "max_tokens", "integer"), body.get("stop"), default_max=16)
    logit_options(body, sampling, ctx.vocab_size)
    want_logprobs = completion_options(body, sampling)
    echo = None
    if field(body, "echo", "boolean", False):
        if want_logprobs:
            raise ApiError(400, "echo with logprobs is not supported (this server does not score prompt tokens)",
                           param="echo")
        echo = [p if isinstance(p, str) else ctx.tokenizer.decode(i) for p, i in zip(prompts, ids)]
    samplings = []  # one per prompt: each prompt's max_tokens fits its own context left
    for one in ids:
        own = dataclasses.replace(sampling)
        fit_prompt(ctx, one, own)
        own.grammar = spec  # a raw completion: the format holds from the first token
        samplings.append(own)
    return model, ids, samplings, want_logprobs, echo, n


# the fill-in-the-middle tokens of the Qwen and StarCoder families, the order the models were trained on
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fill_in_middle(ctx, prefix: str, suffix: str) -> str:
    """/v1/completions with a `suffix` (editor autocomplete, e.g. Continue): the prompt in the
    model's fill-in-the-middle form, prefix-suffix-middle, where its tokenizer has those tokens."""
    for pre, suf, mid in FIM_TOKENS:
        if all(ctx.tokenizer.token_id(t) is not None for t in (pre, suf, mid)):
            return f"{pre}{prefix}{suf}{suffix}{mid}"
    raise ApiError(400, "suffix (fill-in-the-middle) is not supported: this model's tokenizer has no "
                        "fill-in-the-middle tokens", param="suffix")


async def completions(ctx, body: dict, request):
    model, ids, samplings, want_logprobs, echo, n = await off_loop(_completion_plan, ctx, body)
    stream = field(body, "stream", "boolean", False)
    include_usage = bool((field(body, "stream_options", "object") or {}).get("include_usage"))
    cid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
    # raw completions: no chat parsing, thinking tags are just text
    jobs = [(one, choice_sampling(own, j)) for one, own in zip(ids, samplings) for j in range(n)]  # prompt*n+choice
    if stream:  # every choice's chunks as they come, each with its index (prompt * n + choice)
        started = start_all(ctx, jobs)
        gens = [events(ctx, req, queue, tools=False, in_reasoning=False, is_disconnected=request.is_disconnected,
                       raw=True, tokens=want_logprobs) for req, queue in started]
        text_of_token = ctx.token_text if want_logprobs else None
        echoes = [echo[i // n] for i in range(len(jobs))] if echo else None
        body_iter = _completion_stream(gens, cid, created, model, include_usage, text_of_token, echoes, len(ids))
        return RequestStream(ctx, started, body_iter)
    runs = await run_choices(ctx, jobs, lambda req, queue: events(
        ctx, req, queue, tools=False, in_reasoning=False, is_disconnected=request.is_disconnected, raw=True))
    choices, dones = [], []
    for i, evs in enumerate(runs):
        _, text, _, done = collect(evs)
        _raise_if_failed(done)
        t = done.tokens
        lp = completion_logprobs(ctx.token_text, t.ids, t.logprobs, t.top_logprobs, t.text_offsets) \
            if want_logprobs else None
        choices.append({"index": i, "text": (echo[i // n] if echo else "") + text, "logprobs": lp,
                        "finish_reason": "length" if done.finish_reason == "length" else "stop"})
        dones.append(done)
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices, "usage": total_usage(dones, len(ids))})


async def _completion_stream(gens, cid, created, model, include_usage, text_of_token: TokenText | None,
                             echoes: list[str] | None = None, prompts: int = 1):
    """gens: one events iterator per choice (index = position, prompt-major); echoes: each
    choice's prompt text to send first (echo), or None."""
    n = len(gens)
    pending = [Tokens() for _ in range(n)]
    dones: list[Done | None] = [None] * n

    def chunk(i, text, finish=None):
        lp = None
        if text_of_token is not None and pending[i].ids:
            t, pending[i] = pending[i], Tokens()
            lp = completion_logprobs(text_of_token, t.ids, t.logprobs, t.top_logprobs, t.text_offsets)
        return _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]})
    for i, e in enumerate(echoes or []):
        if e:  # the prompt first, as OpenAI's legacy endpoint streams it
            yield chunk(i, e)
    async with contextlib.aclosing(_choice_events(gens, pending)) as evs:
        async for i, ev in evs:
            if isinstance(ev, str):  # a keep-alive, or a failed choice's error event (the last)
                yield ev
            elif isinstance(ev, Event):
                yield chunk(i, ev.text)
            elif isinstance(ev, Done):
                dones[i] = ev
                yield chunk(i, "", "length" if ev.finish_reason == "length" else "stop")
                if all(d is not None for d in dones):
                    if include_usage:
                        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [], "usage": total_usage(dones, prompts)})
                    yield "data: [DONE]\n\n"


def _model_card(ctx, name: str) -> dict:
    return {"id": name, "object": "model", "created": ctx.started, "owned_by": "freetoken",
            "max_model_len": ctx.serving.max_len}


def models(ctx) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(ctx, n) for n in ctx.model_names]})


def model(ctx, name: str) -> JSONResponse:
    if name not in ctx.model_names:
        raise ApiError(404, f"model '{name}' does not exist; this server serves {ctx.model_names[0]!r}",
                       param="model", code="model_not_found")
    return JSONResponse(_model_card(ctx, name))
