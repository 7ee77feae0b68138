"""tool_choice that demands a call ("required" / "any", or one named tool), and strict tools.

The opening of a demanded call is forced: the engine emits the given tokens in place of sampled
ones (runtime.request). What follows is grammar-constrained (runtime.grammar): the name when
any tool will do, arguments valid for that tool's JSON schema, and the close of the call. The
call's syntax comes from the model's own chat template, probed by rendering a dummy call, so
the JSON form (`<tool_call>\n{"name": "X", "arguments": {...}}\n</tool_call>`) and the XML form
(`<tool_call>\n<function=X>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>`) both
work. When the prompt leaves the model thinking (`<think>` opened), the forcing and the grammar
wait for the model to close its thinking, so reasoning is kept. Without a demanded call, tools
marked `strict` still get a grammar: free text, in which any call that opens follows its
tool's schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..runtime.grammar import GrammarError, check
from ..runtime.request import CallSyntax, GrammarSpec, ToolSchema
from .common import ApiError

_NAME = "ft_probe_tool"
_THINK = "ft probe thinking"
_KEY, _VALUE = "ft_probe_key", "ft_probe_value"
_CLOSERS = "\"'>"  # what ends a tool name in the known formats: JSON string, XML tag


@dataclass
class Forced:
    tokens: list[int]
    after: int | None  # token id that arms the forcing (</think>), None: from the first token
    lead: str = ""  # forced text before the call's opening (the gap after </think>)


def wanted(choice, names: list[str], api: str) -> tuple[bool, str | None]:
    """(must call a tool, the one it must call or None). api: 'openai' | 'anthropic'."""
    if api == "openai":
        if choice in (None, "auto", "none"):
            return False, None
        if choice == "required":
            return True, None
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")
        else:
            raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    else:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if choice is None or kind in ("auto", "none"):
            return False, None
        if kind == "any":
            return True, None
        if kind != "tool":
            raise ApiError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice")
        name = choice.get("name")
    if not isinstance(name, str) or name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools given ({', '.join(names)})",
                       param="tool_choice")
    return True, name


@dataclass(frozen=True)
class CallFormat:
    """How the template writes a tool call: `head` NAME `tail`, and the `gap` between the end of
    thinking and the call; `syntax`: the whole call, for the grammar."""
    head: str
    tail: str
    gap: str
    syntax: CallSyntax | None = None


def call_format(template, **kwargs) -> CallFormat:
    """Probe the template once (per set of template kwargs) by rendering a dummy call."""
    cache = template.__dict__.setdefault("_call_formats", {})
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if key not in cache:
        cache[key] = _probe(template, kwargs)
    return cache[key]


def _render_probe(template, kwargs: dict, arguments: dict) -> str:
    probe = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "reasoning_content": _THINK,
              "tool_calls": [{"id": "call_0", "type": "function",
                              "function": {"name": _NAME, "arguments": arguments}}]}]
    tools = [{"type": "function", "function": {"name": _NAME, "parameters": {"type": "object"}}}]
    try:
        return template.render(probe, tools, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: plain Qwen form
        return ""


def _probe(template, kwargs: dict) -> CallFormat:
    text = _render_probe(template, kwargs, {})
    at = text.rfind(_NAME)
    start = text.rfind("<tool_call>", 0, at) if at >= 0 else -1
    if start < 0:  # the template does not show the format; Qwen3's JSON form
        head, tail = '<tool_call>\n{"name": "', '"'
        return CallFormat(head, tail, "\n\n", _syntax(head, tail, None, None))
    end = at + len(_NAME)
    tail = ""
    while end < len(text) and text[end] in _CLOSERS:
        tail += text[end]
        end += 1
    t = text.find("</think>", text.find(_THINK)) if _THINK in text else -1
    gap = text[t + len("</think>"):start] if 0 <= t < start else "\n\n"
    head = text[start:at]
    return CallFormat(head, tail, gap, _syntax(head, tail, _after_name(text, tail),
                                               _after_name(_render_probe(template, kwargs, {_KEY: _VALUE}), tail)))


def _after_name(text: str, tail: str) -> str | None:
    """What the rendered probe call writes after its name and tail, through `</tool_call>`."""
    at = text.rfind(_NAME)
    end = text.find("</tool_call>", at) if at >= 0 else -1
    return text[at + len(_NAME) + len(tail):end + len("</tool_call>")] if end >= 0 else None


def _syntax(head: str, tail: str, bare: str | None, one: str | None) -> CallSyntax:
    """The whole call's syntax from two renderings of the probe call: without arguments
    (`bare`, what follows the name) and with one string argument (`one`). Where a template
    does not show a part, the Qwen3 (JSON) or Qwen3-Coder / Qwen3.5 (XML) form fills it in."""
    if "<function=" in head:
        syn = CallSyntax("xml", head, tail, close=bare or "\n</function>\n</tool_call>", param="\n<parameter=",
                         mid=">\n", end_param="\n</parameter>")
        if one and bare and _KEY in one and _VALUE in one and one.endswith(bare):
            k = one.index(_KEY)
            v = one.index(_VALUE, k)
            syn = replace(syn, param=one[:k], mid=one[k + len(_KEY):v],
                          end_param=one[v + len(_VALUE):len(one) - len(bare)])
        return syn
    syn = CallSyntax("json", head, tail, close="}\n</tool_call>", args=', "arguments": ')
    if one and f'"{_KEY}"' in one and f'"{_VALUE}"' in one:
        k = one.index(f'"{_KEY}"')
        a = one.rfind("{", 0, k)
        e = one.find("}", one.index(f'"{_VALUE}"', k))
        if a >= 0 and e >= 0:
            syn = replace(syn, args=one[:a], close=one[e + 1:])
    return syn


def forced_opening(ctx, name: str | None, in_reasoning: bool, **kwargs) -> Forced:
    """Tokens that open a tool call (naming `name` if given), and when to emit them."""
    fmt = call_format(ctx.template, **kwargs)
    opening = fmt.head + name + fmt.tail if name else "<tool_call>"
    after, lead = None, ""
    if in_reasoning:
        close = ctx.tokenizer.token_id("</think>")
        if close is not None:
            after, lead = close, fmt.gap
        else:
            lead = "</think>" + fmt.gap
    return Forced(ctx.tokenizer.encode(lead + opening), after, lead)


def _tool_schemas(ctx, tools: list[dict], names=None) -> tuple[ToolSchema, ...]:
    """ToolSchemas of (the named) tools; a strict tool whose schema cannot be enforced is a 400,
    a non-strict one falls back to any JSON object."""
    out = []
    for t in tools:
        fn = t.get("function", t)
        if names is not None and fn["name"] not in names:
            continue
        params = fn.get("parameters")
        strict = fn.get("strict") is True
        if params is None:
            params = {"type": "object"}
        if not isinstance(params, dict):
            raise ApiError(400, f"tool {fn['name']!r}: parameters must be a JSON schema object", param="tools")
        try:
            check(GrammarSpec("json_schema", schema=params, strict=strict))
        except GrammarError as e:
            if strict:
                raise ApiError(400, f"tool {fn['name']!r}: its parameters schema cannot be enforced ({e})",
                               param="tools") from None
            params = {"type": "object"}
        out.append(ToolSchema(fn["name"], params, strict))
    return tuple(out)


def _checked(ctx, spec: GrammarSpec) -> GrammarSpec:
    try:
        check(spec, dict(ctx.tokenizer.special))
    except GrammarError as e:
        raise ApiError(400, f"the tools' call grammar cannot be built: {e}", param="tools") from None
    return spec


def call_grammar(ctx, tools: list[dict], name: str | None, forced: Forced, parallel: bool = False,
                 **kwargs) -> GrammarSpec:
    """The grammar of a demanded call: it starts with the forced tokens (`forced`, from
    forced_opening) and ends with the call's close; the arguments follow the called tool's
    schema. With `parallel` (and no named tool) more calls may follow. tools: the template's
    shape ({"type": "function", "function": {"name", "parameters", "strict"}})."""
    fmt = call_format(ctx.template, **kwargs)
    schemas = _tool_schemas(ctx, tools, None if name is None else {name})
    return _checked(ctx, GrammarSpec("tool_call", tools=schemas, syntax=fmt.syntax, lead=forced.lead,
                                     multiple=parallel and name is None, after=forced.after))


def strict_grammar(ctx, tools: list[dict] | None, in_reasoning: bool, **kwargs) -> GrammarSpec | None:
    """When any tool is `strict` (and no call is demanded): free text in which every call that
    opens follows its tool's schema. None when no tool is strict."""
    if not tools or not any(t.get("function", t).get("strict") is True for t in tools):
        return None
    fmt = call_format(ctx.template, **kwargs)
    after = ctx.tokenizer.token_id("</think>") if in_reasoning else None
    return _checked(ctx, GrammarSpec("tool_call", tools=_tool_schemas(ctx, tools), syntax=fmt.syntax, text=True,
                                     after=after))
