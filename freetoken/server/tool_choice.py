"""tool_choice that demands a call ("required" / "any", or one named tool), and strict tools.

The opening of a demanded call is forced: the engine emits the given tokens in place of sampled
ones (runtime.request). What follows is grammar-constrained (runtime.grammar): the name when
any tool will do, arguments valid for that tool's JSON schema, and the close of the call. The
call's syntax comes from the model's own chat template, probed by rendering a dummy call, so
the JSON form (`<tool_call>\n{"name": "X", "arguments": {...}}\n</tool_call>`), the XML form
(`<tool_call>\n<function=X>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>`),
GLM's (`<tool_call>X<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`), DeepSeek's DSML
(`<｜DSML｜tool_calls>\n<｜DSML｜invoke name="X">\n<｜DSML｜parameter name="k" string="true">v
</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>`, string="false" before a JSON
value) and DeepSeek-V3.1's (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>X<｜tool▁sep｜>{...}
<｜tool▁call▁end｜><｜tool▁calls▁end｜>`) all work; the same probe tells the output parser which
format to read (parser_format). When the prompt leaves the model thinking (`<think>` opened),
the forcing and the grammar wait for the model to close its thinking, so reasoning is kept.
Without a demanded call, tools marked `strict` still get a grammar: free text, in which any call
that opens follows its tool's schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..runtime.grammar import GrammarError, raw_value, check
from ..runtime.request import CallSyntax, GrammarSpec, ToolSchema
from .common import ApiError
from .harmony import writes_harmony

_NAME = "ft_probe_tool"
_THINK = "ft probe thinking"
_KEY, _VALUE = "ft_probe_key", "ft_probe_value"
_CLOSERS = "\"'>"  # what ends a tool name in the known formats: JSON string, XML tag
# what opens a block of calls, and what closes it, in the known formats
_BLOCKS = {"<tool_call>": "</tool_call>", "<｜DSML｜tool_calls>": "</｜DSML｜tool_calls>",
           "<｜DSML｜function_calls>": "</｜DSML｜function_calls>", "<｜tool▁calls▁begin｜>": "<｜tool▁calls▁end｜>"}
# the output parser's format (parser.FORMATS, and harmony.py's) for each call syntax
_PARSER = {"json": "tool_call", "xml": "tool_call_xml", "glm": "glm", "dsml": "dsml", "deepseek_v3": "deepseek_v3",
           "harmony": "harmony"}
# GPT-OSS's Harmony (server/harmony.py): a call is a commentary message to functions.NAME whose
# body is the JSON arguments, ended by <|call|> (a stop token: one call a turn). Not probed: the
# template writes calls in history with <|call|> dropped, and its headers vary by message
_HARMONY_HEAD, _HARMONY_TAIL = "<|channel|>commentary to=functions.", " <|constrain|>json"
# source markers of a format, for templates whose rendering does not show their calls
_MARKERS = (("DSML", "dsml"), ("tool▁calls▁begin", "deepseek_v3"), ("<arg_key>", "glm"))


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
    thinking and the call; `syntax`: the whole call, for the grammar. `family`: "json", "xml"
    (Qwen), "glm", "dsml" or "deepseek_v3"; `opener`: the tag that opens a call (a block of
    them); `flags` (dsml): what follows a parameter's name before a raw string value and before
    a JSON one (`" string="true` / `" string="false`), the syntax's `mid` after either."""
    head: str
    tail: str
    gap: str
    syntax: CallSyntax | None = None
    family: str = "json"
    opener: str = "<tool_call>"
    flags: tuple[str, str] | None = None


def parser_format(template) -> str:
    """The output parser's tool-call format (parser.FORMATS) for a chat template."""
    fmt = call_format(template)
    if fmt.family == "json" and fmt.opener == "<tool_call>":  # not shown, or Qwen's: the source may say
        src = getattr(template, "source", "") or ""
        return next((f for marker, f in _MARKERS if marker in src), "tool_call")
    return _PARSER[fmt.family]


def call_format(template, **kwargs) -> CallFormat:
    """Probe the template once (per set of template kwargs) by rendering a dummy call (Harmony's
    format is known, not probed)."""
    if writes_harmony(template):
        syn = CallSyntax("json", _HARMONY_HEAD, _HARMONY_TAIL, close="<|call|>", args="<|message|>")
        return CallFormat(_HARMONY_HEAD, _HARMONY_TAIL, "", syn, family="harmony", opener=_HARMONY_HEAD)
    cache = template.__dict__.setdefault("_call_formats", {})
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if key not in cache:
        cache[key] = _probe(template, kwargs)
    return cache[key]


def _render_probe(template, kwargs: dict, arguments: dict, calls: int = 1) -> str:
    probe = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "reasoning_content": _THINK,
              "tool_calls": [{"id": f"call_{i}", "type": "function",
                              "function": {"name": _NAME, "arguments": arguments}} for i in range(calls)]}]
    tools = [{"type": "function", "function": {"name": _NAME, "parameters": {"type": "object"}}}]
    try:
        return template.render(probe, tools, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: plain Qwen form
        return ""


def _probe(template, kwargs: dict) -> CallFormat:
    text = _render_probe(template, kwargs, {})
    at = text.rfind(_NAME)
    starts = [(text.rfind(o, 0, at), o) for o in _BLOCKS] if at >= 0 else []
    start, opener = max(starts, default=(-1, ""))
    if start < 0:  # the template does not show the format; Qwen3's JSON form
        head, tail = '<tool_call>\n{"name": "', '"'
        return CallFormat(head, tail, "\n\n", _syntax(head, tail, None, None)[0])
    end = at + len(_NAME)
    tail = ""
    while end < len(text) and text[end] in _CLOSERS:
        tail += text[end]
        end += 1
    t = text.find("</think>", text.find(_THINK)) if _THINK in text else -1
    gap = text[t + len("</think>"):start] if 0 <= t < start else "\n\n"
    head = text[start:at]
    closer = _BLOCKS[opener]
    one = _after_name(_render_probe(template, kwargs, {_KEY: _VALUE}), tail, closer)
    syn, family, flags = _syntax(head, tail, _after_name(text, tail, closer), one, opener)
    sep = _between_calls(_render_probe(template, kwargs, {}, calls=2), head, tail, closer)
    if sep is not None:
        syn = replace(syn, sep=sep)
    return CallFormat(head, tail, gap, syn, family, opener, flags)


def _between_calls(text: str, head: str, tail: str, closer: str) -> str | None:
    """What the template writes between two calls that are each a block of their own (GLM writes
    nothing, Qwen a newline); None when they share one block (DSML, DeepSeek-V3.1: then each
    call the grammar adds is a block of its own, a newline apart)."""
    second = text.rfind(_NAME)
    first = text.rfind(_NAME, 0, second)
    if first < 0 or text.rfind(head, 0, second) != second - len(head):
        return None
    end = text.find(closer, first + len(_NAME) + len(tail))
    if end < 0 or end + len(closer) > second - len(head):
        return None
    sep = text[end + len(closer):second - len(head)]
    return sep if not sep.strip() else None


def _after_name(text: str, tail: str, closer: str = "</tool_call>") -> str | None:
    """What the rendered probe call writes after its name and tail, through the block's close."""
    at = text.rfind(_NAME)
    end = text.find(closer, at) if at >= 0 else -1
    return text[at + len(_NAME) + len(tail):end + len(closer)] if end >= 0 else None


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n:]


def _syntax(head: str, tail: str, bare: str | None, one: str | None, opener: str = "<tool_call>"):
    """The whole call's syntax from two renderings of the probe call: without arguments
    (`bare`, what follows the name) and with one string argument (`one`). Where a template
    does not show a part, the Qwen3 (JSON) or Qwen3-Coder / Qwen3.5 (XML) form fills it in.
    -> (syntax, family, flags) (see CallFormat)."""
    dsml = "DSML" in opener
    shown = one is not None and bare is not None and _KEY in one and _VALUE in one
    if "<function=" in head or dsml or (shown and ("<arg_key>" in one or f'"{_VALUE}"' not in one)):
        syn = CallSyntax("xml", head, tail, close=bare or "\n</function>\n</tool_call>", param="\n<parameter=",
                         mid=">\n", end_param="\n</parameter>")
        family, flags = "dsml" if dsml else "xml", None
        if shown:
            k = one.index(_KEY)
            v = one.index(_VALUE, k)
            e = v + len(_VALUE)
            if one[v - 1] == '"' and one[e:e + 1] == '"':  # a template that quotes strings: values go as JSON
                v, e = v - 1, e + 1
            rest = one[e:]
            close = _common_suffix(rest, bare)  # DSML writes a blank line where a call has no parameters
            syn = replace(syn, param=one[:k], mid=one[k + len(_KEY):v], end_param=rest[:len(rest) - len(close)],
                          close=close)
            if "<arg_key>" in syn.param:
                family = "glm"
            if dsml and 'string="true"' in syn.mid:  # the flag differs by value: it goes with the name
                at = syn.mid.index('string="true"') + len('string="true"')
                flag, syn = syn.mid[:at], replace(syn, mid=syn.mid[at:])
                flags = (flag, flag.replace('string="true"', 'string="false"'))
        return syn, family, flags
    syn = CallSyntax("json", head, tail, close="}\n</tool_call>", args=', "arguments": ')
    if one and f'"{_KEY}"' in one and f'"{_VALUE}"' in one:
        k = one.index(f'"{_KEY}"')
        a = one.rfind("{", 0, k)
        e = one.find("}", one.index(f'"{_VALUE}"', k))
        if a >= 0 and e >= 0:
            syn = replace(syn, args=one[:a], close=one[e + 1:])
    return syn, "deepseek_v3" if opener == "<｜tool▁calls▁begin｜>" else "json", None


def forced_opening(ctx, name: str | None, in_reasoning: bool, **kwargs) -> Forced:
    """Tokens that open a tool call (naming `name` if given), and when to emit them."""
    fmt = call_format(ctx.template, **kwargs)
    opening = fmt.head + name + fmt.tail if name else fmt.opener
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


def _for_syntax(ctx, fmt: CallFormat, schemas: tuple[ToolSchema, ...]) -> tuple[ToolSchema, ...]:
    """Tool schemas as the grammar must see them to write the template's syntax. In the XML-style
    syntaxes runtime.grammar writes a plain string value raw and others as JSON; a raw value
    cannot end on a special token (its lexeme is text), so where the value's close is one (GLM's
    `</arg_value>` in its tokenizer) every value is written as JSON, which the parser reads back
    as well. DSML: the string flag goes with the parameter's name, "true" before a raw value,
    "false" before a JSON one (a string enum with a value that reads as JSON goes as JSON)."""
    syn = fmt.syntax
    if syn is None or syn.style != "xml":
        return schemas
    no_raw = any(sp in syn.end_param for sp in getattr(ctx.tokenizer, "special", None) or {})
    if not no_raw and fmt.flags is None:
        return schemas
    out = []
    for t in schemas:
        params = t.parameters if isinstance(t.parameters, dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        names, shaped = {}, {}
        for key, sub in props.items():
            raw = not no_raw and raw_value(sub, syn.end_param, syn.end_param) is not None
            if raw and fmt.flags is not None and ("enum" in sub or "const" in sub):
                values = sub["enum"] if "enum" in sub else [sub["const"]]
                raw = not any(_reads_as_json(v) for v in values)
            names[key] = key + (fmt.flags[0] if raw else fmt.flags[1]) if fmt.flags else key
            grammar_raw = raw_value(sub, syn.end_param, syn.end_param) is not None
            shaped[names[key]] = {"anyOf": [sub]} if grammar_raw and not raw else sub  # anyOf: the JSON route
        required = [names.get(k, k) for k in params.get("required") or []]
        out.append(replace(t, parameters={**params, "properties": shaped, "required": required}))
    return tuple(out)


def _reads_as_json(v: str) -> bool:
    try:
        json.loads(v)
        return True
    except ValueError:
        return False


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
    schemas = _for_syntax(ctx, fmt, _tool_schemas(ctx, tools, None if name is None else {name}))
    multiple = parallel and name is None and fmt.family != "harmony"  # Harmony: <|call|> ends the turn
    return _checked(ctx, GrammarSpec("tool_call", tools=schemas, syntax=fmt.syntax, lead=forced.lead,
                                     multiple=multiple, after=forced.after))


def strict_grammar(ctx, tools: list[dict] | None, in_reasoning: bool, **kwargs) -> GrammarSpec | None:
    """When any tool is `strict` (and no call is demanded): free text in which every call that
    opens follows its tool's schema. None when no tool is strict, or when the text could not be
    told apart from a call's opening: runtime.grammar's text lexeme stops short of the opening
    only where it starts with a special token (Qwen's and GLM's <tool_call>); where it is plain
    text (DSML in a tokenizer without it as a token) the text would swallow it and no call could
    open, so calls go unchecked instead."""
    if not tools or not any(t.get("function", t).get("strict") is True for t in tools):
        return None
    fmt = call_format(ctx.template, **kwargs)
    schemas = _for_syntax(ctx, fmt, _tool_schemas(ctx, tools))  # a strict schema that cannot be enforced: 400
    if fmt.family == "harmony":  # its messages' headers are special tokens the free text must also write
        return None
    trigger = fmt.syntax.head.split("\n")[0] or fmt.syntax.head
    if not any(trigger.startswith(sp) for sp in getattr(ctx.tokenizer, "special", None) or {}):
        return None
    after = ctx.tokenizer.token_id("</think>") if in_reasoning else None
    return _checked(ctx, GrammarSpec("tool_call", tools=schemas, syntax=fmt.syntax, text=True, after=after))
