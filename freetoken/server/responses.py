"""OpenAI Responses API: POST /v1/responses (streaming and not), GET and DELETE /v1/responses/{id}.

The request (instructions, input items, the conversation of a previous response) is turned into
the template's message list and rendered with the model's chat template, as chat completions
are; the parser's thinking / text / tool-call events become output items: a `reasoning` item,
`message` items with `output_text`, `function_call` items. A stream is the documented event
sequence, each event with an `event:` line and a `sequence_number`.

Thinking is given both as the reasoning item's `content` (`reasoning_text`) and as its
`summary` (`summary_text`; this server has no summariser, the summary is the thinking itself):
Codex shows the summary and, when it replays the conversation (`store: false`), sends the
summary back without the content, so either is read back as the turn's reasoning_content.

Stored responses (`store`, default true) live in memory, least recently used evicted first,
bounded by count and by size (`ft serve --responses-store`, default 256 responses, and
STORE_BYTES, 64 MiB of JSON: each entry counts the whole
conversation it can replay).
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from starlette.responses import JSONResponse

from . import common
from .common import ApiError, Prompt, field, fit_prompt, json_args, sampling_from
from .generation import Done, Ping, RequestStream, collect, events
from .openai import check_model, submit
from .parser import Event
from .tool_choice import call_grammar, forced_opening, strict_grammar, wanted

EFFORTS = common.EFFORTS
SUMMARIES = ("auto", "concise", "detailed")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


# ---------------------------------------------------------------- the store
@dataclass
class Stored:
    response: dict  # the Response object as it was answered
    history: list[dict]  # template messages: the conversation it continued, its input and output
    size: int  # bytes of JSON, for the store's budget


class Store:
    """Stored responses, least recently used evicted first past `max_items` or `max_bytes`.
    Locked: a request's plan reads it on a worker thread (common.off_loop) while the event loop
    stores and deletes."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max(1, max_items), max(1, max_bytes)
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, rid: str) -> Stored | None:
        with self.lock:
            entry = self.entries.get(rid)
            if entry is not None:
                self.entries.move_to_end(rid)
            return entry

    def put(self, rid: str, response: dict, history: list[dict]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False, default=str))
        with self.lock:
            self._pop(rid)
            self.entries[rid] = Stored(response, history, size)
            self.bytes += size
            while len(self.entries) > 1 and (len(self.entries) > self.max_items or self.bytes > self.max_bytes):
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.size

    def delete(self, rid: str) -> bool:
        with self.lock:
            return self._pop(rid)

    def _pop(self, rid: str) -> bool:
        old = self.entries.pop(rid, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None


STORE_BYTES = 64 << 20  # JSON bytes the stored responses may take
_STORE_MADE = threading.Lock()


def store_of(ctx) -> Store:
    store = ctx.__dict__.get("_responses_store")
    if store is None:
        with _STORE_MADE:  # two first requests on two threads must not make two stores
            store = ctx.__dict__.get("_responses_store")
            if store is None:
                store = ctx.__dict__["_responses_store"] = Store(ctx.responses_store, STORE_BYTES)
    return store


def _not_found(rid: str, param: str | None = None) -> ApiError:
    s = "Previous response" if param else "Response"
    return ApiError(404, f"{s} with id '{rid}' not found: it was not stored (store: false) or has been evicted "
                         "(this server keeps the most recently used stored responses in memory)",
                    param=param, code="previous_response_not_found" if param else None)


def stored(ctx, method: str, rid: str) -> JSONResponse:
    """GET /v1/responses/{id}: the stored Response; DELETE: forget it."""
    store = store_of(ctx)
    if method == "DELETE":
        if not store.delete(rid):
            raise _not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
    entry = store.get(rid)
    if entry is None:
        raise _not_found(rid)
    return JSONResponse(entry.response)


# ---------------------------------------------------------------- input -> template messages
def _bad(message: str, param: str = "input") -> ApiError:
    return ApiError(400, message, param=param)


def _text(content, where: str, param: str = "input") -> str:
    """Content as a string or a list of text parts -> plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of content parts", param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise _bad(f"{where}.content[{j}]: {kind} content is not supported by this text model", param)
        elif kind is None:
            raise _bad(f"{where}.content[{j}]: content parts must be objects with a type", param)
        else:
            raise _bad(f"{where}.content[{j}]: unsupported content part type {kind!r} "
                       f"(text parts are {', '.join(TEXT_PARTS[:2])})", param)
    return "".join(out)


def _turn(out: list[dict], fresh) -> dict:
    """The assistant message an output item belongs to: the last one while `fresh(it)` holds
    (items of one turn arrive as reasoning, message, function calls), else a new one."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and fresh(last):
        return last
    msg = {"role": "assistant", "content": "", "tool_calls": []}
    out.append(msg)
    return msg


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's thinking: its content, else its summary (what Codex sends back)."""
    for key, kinds in (("content", ("reasoning_text", "text")), ("summary", ("summary_text",))):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise _bad(f"{where}.{key} must be a list")
        texts = []
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or p.get("type") not in kinds or not isinstance(p.get("text"), str):
                raise _bad(f"{where}.{key}[{j}] must be {{'type': {kinds[0]!r}, 'text': ...}}")
            texts.append(p["text"])
        if any(texts):
            return "\n\n".join(t for t in texts if t)
    return ""


def to_messages(items, where: str = "input") -> list[dict]:
    """Responses input (or output) items -> the template's messages (roles system / user /
    assistant / tool; assistant turns with reasoning_content and tool_calls)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad(f"'{where}' must be a string or a list of items")
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{at}: items must be objects")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise _bad(f"{at}: role must be one of user, system, developer, assistant")
            text = _text(item.get("content"), at)
            if role == "assistant":
                msg = _turn(out, lambda m: not m["tool_calls"])
                msg["content"] = msg["content"] + "\n\n" + text if msg["content"] and text else msg["content"] + text
            else:
                out.append({"role": role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, at)
            if text:
                msg = _turn(out, lambda m: not (m["content"] or m["tool_calls"] or m.get("reasoning_content")))
                msg["reasoning_content"] = text
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise _bad(f"{at}: function_call items need a name and a call_id")
            if not isinstance(args, (str, dict)):
                raise _bad(f"{at}: function_call arguments must be a JSON string")
            ns = item.get("namespace")
            if ns is not None and not isinstance(ns, str):
                raise _bad(f"{at}: function_call namespace must be a string")
            _turn(out, lambda m: True)["tool_calls"].append(
                {"id": call_id, "type": "function", "function": {"name": qualified(name, ns), "arguments": json_args(args)}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{at}: function_call_output items need a call_id")
            if "output" not in item:
                raise _bad(f"{at}: function_call_output items need an output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item["output"], at)})
        elif kind is None:
            raise _bad(f"{at}: items need a type (message, function_call, function_call_output, reasoning)")
        else:
            raise _bad(f"{at}: input item type {kind!r} is not supported; this server takes message, "
                       "function_call, function_call_output and reasoning items")
    return out


def _leading_system_merged(messages: list[dict]) -> list[dict]:
    """instructions and the developer / system messages that open the input -> one system
    message (templates take one system message, and some accept it only first)."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:n] if m["content"])
    return [{"role": "system", "content": text}] + messages[n:]


# ---------------------------------------------------------------- request fields
# A namespace tool ({"type": "namespace", "name": NS, "tools": [function tools]}: a group of tools
# such as an MCP server's or Codex's sub-agent tools) reaches the model as its function tools named
# NS.NAME; a call to one comes back as a function_call item with name NAME and namespace NS, and
# such items in the input are rendered under NS.NAME again.
NS_SEP = "."


def qualified(name: str, namespace: str | None) -> str:
    return f"{namespace}{NS_SEP}{name}" if namespace else name


def _tools(body: dict) -> tuple[list[dict], list[dict], dict[str, tuple[str, str]]]:
    """-> (tools as given, for the response; tools in the template's shape; NS.NAME -> (NS, NAME)
    for the namespaces' tools)."""
    raw = field(body, "tools", "array") or []
    echo, out, spaced = [], [], {}
    for i, t in enumerate(raw):
        if isinstance(t, dict) and t.get("type") == "namespace":
            ns, desc, inner = t.get("name"), t.get("description"), t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise _bad(f"tools[{i}]: namespace tools need a name and a list of tools", "tools")
            if desc is not None and not isinstance(desc, str):
                raise _bad(f"tools[{i}]: description must be a string", "tools")
            pairs = [_function_tool(x, f"tools[{i}].tools[{j}]") for j, x in enumerate(inner)]
            e, o = [p[0] for p in pairs], [p[1] for p in pairs]
            for fn in (x["function"] for x in o):
                spaced[qualified(fn["name"], ns)] = (ns, fn["name"])
                fn["name"] = qualified(fn["name"], ns)
                if desc:  # the group's description, which the model sees nowhere else
                    fn["description"] = f"[{ns}: {desc}] " + fn.get("description", "")
            out += o
            echo.append({"type": "namespace", "name": ns, "description": desc, "tools": e})
        else:
            e, o = _function_tool(t, f"tools[{i}]")
            echo.append(e)
            out.append(o)
    return echo, out, spaced


def _function_tool(t, at: str) -> tuple[dict, dict]:
    """A function tool -> (as echoed, in the template's shape)."""
    if not isinstance(t, dict):
        raise _bad(f"{at} must be an object", "tools")
    kind = t.get("type")
    if kind != "function":
        if not isinstance(kind, str):
            raise _bad(f"{at}: missing the tool's type", "tools")
        raise _bad(f"{at}: tool type {kind!r} is not supported: this server runs only function tools "
                   "({'type': 'function', 'name': ..., 'parameters': {...}}) and namespaces of them; built-in "
                   "tools (web search, file search, code interpreter, computer use, image generation, MCP, "
                   "shells, custom tools) are not available", "tools")
    if "name" not in t and isinstance(t.get("function"), dict):
        raise _bad(f"{at}: Responses function tools are flat, {{'type': 'function', 'name': ..., "
                   "'parameters': {...}}, not Chat Completions' {'type': 'function', 'function': {...}}",
                   "tools")
    name, desc, params = t.get("name"), t.get("description"), t.get("parameters")
    if not isinstance(name, str) or not name:
        raise _bad(f"{at}: function tools need a name", "tools")
    if desc is not None and not isinstance(desc, str):
        raise _bad(f"{at}: description must be a string", "tools")
    if params is not None and not isinstance(params, dict):
        raise _bad(f"{at}: parameters must be a JSON schema object", "tools")
    if t.get("strict") is not None and not isinstance(t.get("strict"), bool):
        raise _bad(f"{at}: strict must be a boolean", "tools")
    fn = {"name": name}
    if desc:
        fn["description"] = desc
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if t.get("strict") is not None:  # as chat passes it: strict tools' calls follow their schema
        fn["strict"] = t["strict"]
    return ({"type": "function", "name": name, "description": desc, "parameters": params, "strict": t.get("strict")},
            {"type": "function", "function": fn})


def _tool_choice(body: dict, tools: list[dict]) -> tuple[object, list[dict], bool, str | None]:
    """-> (tool_choice as given, the tools to render, must call, the one to call or None)."""
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    names = [t["function"]["name"] for t in tools]
    if choice in ("auto", "none", "required"):
        chat_choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice {'type': 'function'} needs the function's name", "tool_choice")
        chat_choice = {"type": "function", "function": {"name": qualified(choice["name"], choice.get("namespace"))}}
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        mode, allowed = choice.get("mode", "auto"), choice.get("tools")
        if mode not in ("auto", "required") or not isinstance(allowed, list) or \
                not all(isinstance(a, dict) and a.get("type") == "function" and isinstance(a.get("name"), str)
                        for a in allowed):
            raise _bad("tool_choice allowed_tools needs mode 'auto' or 'required' and tools "
                       "[{'type': 'function', 'name': ...}, ...]", "tool_choice")
        keep = {qualified(a["name"], a.get("namespace")) for a in allowed}
        if keep - set(names):
            raise _bad(f"tool_choice allowed_tools names {sorted(keep - set(names))}, which are not among "
                       "the tools given", "tool_choice")
        tools = [t for t in tools if t["function"]["name"] in keep]
        names, chat_choice = [t["function"]["name"] for t in tools], mode
    elif isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise _bad(f"tool_choice type {choice['type']!r} is not supported: this server runs only function tools",
                   "tool_choice")
    else:
        raise _bad("tool_choice must be 'none', 'auto', 'required', {'type': 'function', 'name': ...} or "
                   "{'type': 'allowed_tools', ...}", "tool_choice")
    if chat_choice == "none":
        return choice, [], False, None
    if chat_choice != "auto" and not tools:
        raise _bad("tool_choice other than 'none' / 'auto' needs tools", "tool_choice")
    must, name = wanted(chat_choice, names, "openai")
    return choice, tools, must, name


def _reasoning(body: dict) -> tuple[dict, dict]:
    """-> (reasoning as echoed, chat-template kwargs): effort none / minimal turns the
    template's thinking switch off, any other effort on."""
    r = field(body, "reasoning", "object") or {}
    effort, summary = r.get("effort"), r.get("summary", r.get("generate_summary"))
    if effort is not None and effort not in EFFORTS:
        raise _bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {effort!r}", "reasoning.effort")
    if summary is not None and summary not in SUMMARIES:
        raise _bad(f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {summary!r}", "reasoning.summary")
    kwargs = common.effort_kwargs(effort)
    kwargs.update(common.template_kwargs(body))  # vLLM's extension, as in chat completions
    return {"effort": effort, "summary": summary}, kwargs


def _text_format(body: dict, sampling) -> dict:
    """text.format: plain text, or JSON (object / schema) through grammar-constrained decoding
    when the server has it (common.grammar_for); refused with a 400 until then."""
    text = field(body, "text", "object") or {}
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise _bad("text.verbosity must be 'low', 'medium' or 'high'", "text.verbosity")
    fmt = text.get("format")
    echo = {"format": {"type": "text"}, "verbosity": verbosity or "medium"}
    if fmt is None:
        return echo
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("text.format must be an object with a type", "text.format")
    kind = fmt["type"]
    if kind == "text":
        return echo
    if kind not in ("json_object", "json_schema"):
        raise _bad(f"text.format type {kind!r} is not one of text, json_object, json_schema", "text.format")
    if kind == "json_schema" and (not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict)):
        raise _bad("text.format json_schema needs a name and a schema object", "text.format")
    grammar_for = getattr(common, "grammar_for", None)
    if grammar_for is None:
        raise _bad(f"text.format type {kind!r} is not supported: this server has no grammar-constrained "
                   "decoding yet; only {'type': 'text'} is accepted", "text.format")
    # the grammar helper takes chat's response_format shape
    chat = {"type": kind} if kind == "json_object" else {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    options = grammar_for(chat, param="text.format")
    if isinstance(options, dict):
        for k, v in options.items():
            setattr(sampling, k, v)
    elif options is not None:
        sampling.grammar = options
    echo["format"] = fmt
    return echo


def _metadata(body: dict) -> dict:
    meta = field(body, "metadata", "object") or {}
    if len(meta) > 16 or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad("metadata must map at most 16 string keys to string values", "metadata")
    return meta


def _refuse_unsupported(body: dict) -> None:
    if field(body, "background", "boolean", False):
        raise _bad("background responses are not supported", "background")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise _bad(f"'{name}' is not supported: send the conversation as input items or use "
                       "previous_response_id", name)
    top = field(body, "top_logprobs", "integer", 0)
    if top:
        raise _bad("top_logprobs is not supported on /v1/responses (chat completions has logprobs)", "top_logprobs")


@dataclass
class Plan:
    """A validated request: the prompt, how to sample, and what the response echoes."""
    model: str
    history: list[dict]  # the conversation this response continues (instructions excluded)
    tools: list[dict]  # rendered tools (template shape)
    prompt: Prompt
    sampling: object
    kwargs: dict
    echo: dict  # request fields the Response object repeats
    store: bool
    parallel: bool
    spaced: dict = dataclasses.field(default_factory=dict)  # NS.NAME -> (NS, NAME): namespace tools


def plan(ctx, body: dict) -> Plan:
    model = check_model(ctx, body)
    _refuse_unsupported(body)
    instructions = field(body, "instructions", "string")
    prev_id = field(body, "previous_response_id", "string")
    store = field(body, "store", "boolean", True)
    parallel = field(body, "parallel_tool_calls", "boolean", True)
    truncation = field(body, "truncation", "string", "disabled")
    if truncation not in ("disabled", "auto"):
        raise _bad("truncation must be 'disabled' or 'auto'", "truncation")
    include = field(body, "include", "array") or []
    if not all(isinstance(x, str) for x in include):
        raise _bad("include must be a list of strings", "include")
    max_out = field(body, "max_output_tokens", "integer")
    if max_out is not None and max_out < 1:
        raise _bad(f"max_output_tokens must be >= 1, got {max_out}", "max_output_tokens")
    for name in ("user", "prompt_cache_key", "safety_identifier", "service_tier"):
        field(body, name, "string")
    tools_echo, tools, spaced = _tools(body)
    choice_echo, tools, must, name = _tool_choice(body, tools)
    reasoning_echo, kwargs = _reasoning(body)
    kwargs = common.with_defaults(ctx, kwargs)
    sampling = sampling_from(body, max_out, None, default_max=ctx.serving.max_len)
    text_echo = _text_format(body, sampling)
    history: list[dict] = []
    if prev_id is not None:
        entry = store_of(ctx).get(prev_id)
        if entry is None:
            raise _not_found(prev_id, "previous_response_id")
        history = list(entry.history)
    if body.get("input") is None and prev_id is None:
        raise _bad("missing required field 'input'")
    history += to_messages(body["input"]) if body.get("input") is not None else []
    system = [{"role": "system", "content": instructions}] if instructions is not None else []
    prompt = _fit(ctx, system, history, tools, kwargs, sampling, truncation == "auto")
    spec = getattr(sampling, "grammar", None)
    if spec is not None and prompt.in_reasoning and getattr(spec, "after", 0) is None:
        close = ctx.tokenizer.token_id("</think>")  # the format holds from the end of thinking on
        if close is not None:
            sampling.grammar = dataclasses.replace(spec, after=close)
    if must:  # open the call by forced tokens; the grammar holds the rest to the tool's schema
        f = forced_opening(ctx, name, prompt.in_reasoning, **kwargs)
        sampling.forced, sampling.forced_after = f.tokens, f.after
        sampling.grammar = call_grammar(ctx, tools, name, f, parallel, **kwargs)
    elif spec is None:  # strict tools: any call the model opens follows its tool's schema
        sampling.grammar = strict_grammar(ctx, tools, prompt.in_reasoning, **kwargs)
    echo = {"instructions": instructions, "max_output_tokens": max_out, "metadata": _metadata(body),
            "parallel_tool_calls": parallel, "previous_response_id": prev_id, "reasoning": reasoning_echo,
            "temperature": field(body, "temperature", "number", 1.0), "text": text_echo, "tool_choice": choice_echo,
            "tools": tools_echo, "top_p": field(body, "top_p", "number", 1.0), "truncation": truncation,
            "user": body.get("user"), "store": store}
    return Plan(model, history, tools, prompt, sampling, kwargs, echo, store, parallel, spaced)


def _fit(ctx, system: list[dict], history: list[dict], tools, kwargs, sampling, auto: bool) -> Prompt:
    """Render and tokenize; with truncation 'auto', drop the oldest turns (each up to the next
    user message) until the prompt leaves room to generate: the fewest turns that fit, found by
    bisection (a few renders of the history, not one per turn dropped)."""
    if not history:
        raise _bad("the input is empty")

    def attempt(h: list[dict]) -> tuple[str, list[int]]:
        text = common.render(ctx, _leading_system_merged(system + h), tools or None, kwargs)
        return text, ctx.tokenizer.encode(text)

    text, ids = attempt(history)
    limit = ctx.serving.max_len
    first = next((i for i, m in enumerate(history) if m["role"] != "system"), None)
    if auto and len(ids) >= limit and first is not None:
        # cuts[k - 1]: where the history resumes after dropping the k oldest turns
        cuts = [i for i in range(first + 1, len(history)) if history[i]["role"] == "user"]
        lo, hi, best, tried = 1, len(cuts), None, {}  # fewer tokens the more turns are dropped
        while lo <= hi:
            k = (lo + hi) // 2
            tried[k] = t, got = attempt(history[:first] + history[cuts[k - 1]:])
            if len(got) < limit:
                best, hi = (t, got), k - 1
            else:
                lo = k + 1
        if best is not None:
            text, ids = best
        elif cuts:  # too long even with only the last turn left: fit_prompt says so
            text, ids = tried.get(len(cuts)) or attempt(history[:first] + history[cuts[-1]:])
    fit_prompt(ctx, ids, sampling)
    return Prompt(ids, text.rstrip().endswith("<think>"))


# ---------------------------------------------------------------- output items
def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Output:
    """Parser events -> output items, and the stream events that build them (type, data)."""

    def __init__(self, parallel: bool, spaced: dict | None = None):
        self.spaced = spaced or {}  # NS.NAME -> (NS, NAME): calls of namespace tools
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.parallel = parallel
        self.calls = 0

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def feed(self, ev: Event) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if ev.kind == "reasoning":
            if self.open is None or self.open["type"] != "reasoning":
                out += self.close()
                self.open = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": [],
                             "encrypted_content": None, "status": "in_progress"}
                self.items.append(self.open)
                self.open["_text"] = ""
                out.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                           "item": self._public(self.open)}))
                out.append(("response.reasoning_summary_part.added", {
                    **self._at(), "summary_index": 0, "part": {"type": "summary_text", "text": ""}}))
                out.append(("response.content_part.added", {
                    **self._at(), "content_index": 0, "part": {"type": "reasoning_text", "text": ""}}))
            self.open["_text"] += ev.text
            out.append(("response.reasoning_text.delta", {**self._at(), "content_index": 0, "delta": ev.text}))
            out.append(("response.reasoning_summary_text.delta", {**self._at(), "summary_index": 0,
                                                                  "delta": ev.text}))
        elif ev.kind == "content":
            if self.open is None or self.open["type"] != "message":
                out += self.close()
                self.open = {"id": _id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                             "content": [], "_text": ""}
                self.items.append(self.open)
                out.append(("response.output_item.added", {"output_index": len(self.items) - 1,
                                                           "item": self._public(self.open)}))
                out.append(("response.content_part.added", {**self._at(), "content_index": 0,
                                                            "part": _output_text("")}))
            self.open["_text"] += ev.text
            if ev.text:
                out.append(("response.output_text.delta", {**self._at(), "content_index": 0, "delta": ev.text,
                                                           "logprobs": []}))
        elif ev.kind == "tool_call":
            out += self.close()
            if self.calls and not self.parallel:
                return out  # parallel_tool_calls false: the first call only
            self.calls += 1
            t = ev.tool
            item = {"id": _id("fc_"), "type": "function_call", "status": "in_progress", "arguments": "",
                    "call_id": t.id, "name": t.name}
            if t.name in self.spaced:
                item["namespace"], item["name"] = self.spaced[t.name]
            self.items.append(item)
            at = {"item_id": item["id"], "output_index": len(self.items) - 1}
            out.append(("response.output_item.added", {"output_index": at["output_index"], "item": dict(item)}))
            out.append(("response.function_call_arguments.delta", {**at, "delta": t.arguments}))
            out.append(("response.function_call_arguments.done", {**at, "arguments": t.arguments}))
            item.update(arguments=t.arguments, status="completed")
            out.append(("response.output_item.done", {"output_index": at["output_index"], "item": dict(item)}))
        return out

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        item, out = self.open, []
        if item is None:
            return out
        text = item.pop("_text")
        item["status"] = status
        if item["type"] == "reasoning":
            item["summary"] = [{"type": "summary_text", "text": text}]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(("response.reasoning_text.done", {**self._at(), "content_index": 0, "text": text}))
            out.append(("response.content_part.done", {**self._at(), "content_index": 0, "part": item["content"][0]}))
            out.append(("response.reasoning_summary_text.done", {**self._at(), "summary_index": 0, "text": text}))
            out.append(("response.reasoning_summary_part.done", {**self._at(), "summary_index": 0,
                                                                 "part": item["summary"][0]}))
        else:
            item["content"] = [_output_text(text)]
            out.append(("response.output_text.done", {**self._at(), "content_index": 0, "text": text,
                                                      "logprobs": []}))
            out.append(("response.content_part.done", {**self._at(), "content_index": 0, "part": item["content"][0]}))
        out.append(("response.output_item.done", {"output_index": len(self.items) - 1, "item": self._public(item)}))
        self.open = None
        return out

    def finish(self, complete: bool) -> list[tuple[str, dict]]:
        """End of output: close the open item (incomplete if the output was cut); a response
        without any item gets one empty message."""
        out = self.close("completed" if complete else "incomplete")
        if not self.items:
            out += self.feed(Event("content", ""))
            out += self.close("completed" if complete else "incomplete")
        return out

    @staticmethod
    def _public(item: dict) -> dict:
        return {k: v for k, v in item.items() if not k.startswith("_")}


def _output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(ctx, done: Done, in_reasoning: bool) -> dict:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(ctx, done.tokens.ids, in_reasoning)},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def reasoning_tokens(ctx, ids: list[int], in_reasoning: bool) -> int:
    """Output tokens from <think> to </think> (both counted), from the start when the prompt
    opened the thinking."""
    tok = ctx.tokenizer
    opening, closing = tok.token_id("<think>"), tok.token_id("</think>")
    if closing is None:
        return 0
    n, inside = 0, in_reasoning
    for t in ids:
        if t == opening:
            inside = True
        n += inside
        if t == closing:
            inside = False
    return n


# ---------------------------------------------------------------- the endpoint
class Answer:
    """One response's identity and the Response objects it goes through."""

    def __init__(self, ctx, p: Plan):
        self.ctx, self.p = ctx, p
        self.id, self.created = _id("resp_"), int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None = None, incomplete: bool = False,
                 error: dict | None = None) -> dict:
        r = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
             "background": False, "error": error,
             "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
             "model": self.p.model, "output": [Output._public(i) for i in output], "service_tier": "default",
             "usage": usage, **self.p.echo}
        if status == "completed":
            r["completed_at"] = int(time.time())
        return r

    def final(self, out: Output, done: Done, in_reasoning: bool) -> dict:
        complete = done.finish_reason != "length"
        r = self.response("completed" if complete else "incomplete", out.items, _usage(self.ctx, done, in_reasoning),
                          incomplete=not complete)
        if self.p.store:
            store_of(self.ctx).put(self.id, r, self.p.history + to_messages(r["output"], "output"))
        return r


async def create(ctx, body: dict, request):
    p = await common.off_loop(plan, ctx, body)
    stream = field(body, "stream", "boolean", False)
    req, queue = submit(ctx, p.prompt.ids, p.sampling)
    gen = events(ctx, req, queue, p.tools or None, p.prompt.in_reasoning, request.is_disconnected)
    answer = Answer(ctx, p)
    if stream:
        return RequestStream(ctx, [(req, queue)], _stream(gen, answer))
    evs = [e async for e in gen]
    done = collect(evs)[3]  # ClientGone when the client left
    if done.finish_reason == "error":
        raise ApiError(500, f"generation failed: {done.error}", kind="server_error")
    out = Output(p.parallel, p.spaced)
    for e in evs:
        if isinstance(e, Event):
            out.feed(e)
    out.finish(done.finish_reason != "length")
    return JSONResponse(answer.final(out, done, p.prompt.in_reasoning))


def _sse(kind: str, data: dict, seq: int) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data, 'sequence_number': seq}, ensure_ascii=False)}\n\n"


async def _stream(gen, answer: Answer):
    seq = -1

    def sse(kind, data):
        nonlocal seq
        seq += 1
        return _sse(kind, data, seq)
    out = Output(answer.p.parallel, answer.p.spaced)
    start = answer.response("in_progress", [])
    yield sse("response.created", {"response": start})
    yield sse("response.in_progress", {"response": start})
    try:
        async for ev in gen:
            if isinstance(ev, Ping):
                yield ": keep-alive\n\n"
            elif isinstance(ev, Event):
                for kind, data in out.feed(ev):
                    yield sse(kind, data)
            elif isinstance(ev, Done):
                if ev.finish_reason == "error":
                    message = f"generation failed: {ev.error}"
                    yield sse("error", {"code": "server_error", "message": message, "param": None})
                    out.close("incomplete")
                    yield sse("response.failed", {"response": answer.response(
                        "failed", out.items, error={"code": "server_error", "message": message})})
                    return
                for kind, data in out.finish(ev.finish_reason != "length"):
                    yield sse(kind, data)
                r = answer.final(out, ev, answer.p.prompt.in_reasoning)
                yield sse("response.completed" if r["status"] == "completed" else "response.incomplete",
                          {"response": r})
    finally:
        await gen.aclose()
