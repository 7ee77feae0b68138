"""Model output -> thinking, text and tool calls, incrementally.

Thinking sits between <think> and </think> (the prompt may already have opened it). Tool calls
are read in the model's own format (FORMATS; tool_choice.parser_format picks it from the chat
template):

- "tool_call" (the default; Qwen3.x): between <tool_call> and </tool_call>, either JSON
  ({"name": ..., "arguments": {...}}), the XML form
  (<function=NAME><parameter=P>value</parameter></function>), or GLM's (4.5 to 5)
  NAME<arg_key>K</arg_key><arg_value>V</arg_value>... (newlines between the parts or not; string
  values raw, others as JSON; at least one argument: a bare word stays text). A value of the XML
  and GLM forms is typed by its parameter's schema in the request's tools where there is one (a
  string parameter keeps "02139" or "true" as written), else read as JSON when it parses.
- "tool_call_xml": the same, for templates that write the XML form; a call without the
  <tool_call> wrapper (<function=NAME> then a parameter or </function>, NAME one of the request's
  tools, closed by </function>) is read as a call too.
- "glm": the same as "tool_call", and a bare NAME is a call without arguments (as GLM's templates write one).
- "dsml" (DeepSeek-V3.2 and V4): a block <｜DSML｜tool_calls> ... </｜DSML｜tool_calls> (V3.2:
  function_calls) of one or more <｜DSML｜invoke name="NAME"> ... </｜DSML｜invoke>, each
  parameter <｜DSML｜parameter name="P" string="true|false">V</｜DSML｜parameter>: V is raw text
  with string="true", JSON with string="false".
- "deepseek_v3" (DeepSeek-V3.1; V3 and R1): a block <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
  of <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜> (V3 and R1:
  function<｜tool▁sep｜>NAME, then the JSON in a ```json fence).

A block that cannot be read as calls is kept as text. Text is emitted as soon as it cannot be
the start of a tag, so a stream split at any boundary gives the same events.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"  # an XML-form call without its wrapper
GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
NAME = re.compile(r"[\w.:/-]+")

DSML = "｜DSML｜"
DSML_BLOCKS = ("tool_calls", "function_calls")  # V4, V3.2
DSML_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>(.*?)(?:</{DSML}invoke>|\Z)', re.S)
DSML_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)'
                        rf'</{DSML}parameter>', re.S)

V3_OPEN, V3_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
V3_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|\Z)", re.S)
V3_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*(?:```)?$", re.S)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON object text


@dataclass
class Event:
    kind: str  # "reasoning" | "content" | "tool_call"
    text: str = ""
    tool: ToolCall | None = None


def add_text(out: list[Event], kind: str, text: str) -> None:
    """Text of `kind` onto the events: joined to the last one when it is of that kind."""
    if out and out[-1].kind == kind:
        out[-1].text += text
    else:
        out.append(Event(kind, text))


def _call(name: str, args) -> ToolCall:
    return ToolCall("call_" + uuid.uuid4().hex[:24], name, json.dumps(args, ensure_ascii=False))


def _loose(raw: str):
    """A value written raw or as JSON: JSON when it parses, else the text itself."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


Schemas = dict  # tool name -> its parameters' JSON schema (param_schemas)


def param_schemas(tools) -> Schemas:
    """The request's tools (the template's shape {"type": "function", "function": {...}}, or flat
    {"name", "parameters"} / Anthropic's {"name", "input_schema"}) -> {name: parameters schema}."""
    out = {}
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            params = f.get("parameters", f.get("input_schema"))
            out[f["name"]] = params if isinstance(params, dict) else {}
    return out


def _is_string(schema) -> bool:
    """Whether a parameter's schema makes it a string whatever the text looks like."""
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if t == "string" or (isinstance(t, list) and "string" in t and set(t) <= {"string", "null"}):
        return True
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _typed(raw: str, tool: str, key: str, schemas: Schemas | None):
    """An XML / GLM argument value: for a string parameter of the tool's schema the text as
    written, unless it is a JSON string literal (the form the strict-tools grammar gives a string
    with a pattern or a format: runtime/grammar.py raw_value); else JSON when it parses
    (numbers, booleans, objects), else the text."""
    v = _loose(raw)
    props = ((schemas or {}).get(tool) or {}).get("properties")
    if isinstance(props, dict) and _is_string(props.get(key)) and not isinstance(v, str):
        return raw
    return v


def parse_tool_call(body: str, bare: bool = False, schemas: Schemas | None = None) -> ToolCall | None:
    """One call inside <tool_call>: JSON, XML or GLM. bare: a lone NAME is a call (GLM);
    schemas: the request's tools (param_schemas), which type the XML and GLM values."""
    body = body.strip()
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = _loose(args)
            return _call(obj["name"], args)
    except ValueError:
        pass
    m = re.search(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", body, re.S)
    if m:
        args, name = {}, m.group(1).strip()
        for pm in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
            args[pm.group(1).strip()] = _typed(pm.group(2), name, pm.group(1).strip(), schemas)
        return _call(name, args)
    # GLM: the name, then key/value pairs (strings raw, other values as JSON). Without `bare`, a
    # call without arguments (the bare name) is not told apart from stray text: it stays text
    name, key, rest = body.partition("<arg_key>")
    if NAME.fullmatch(name.strip()) and (key or bare):
        args = {k.strip(): _typed(v, name.strip(), k.strip(), schemas) for k, v in GLM_ARG.findall(key + rest)}
        return _call(name.strip(), args)
    return None


def parse_dsml(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
    """The inside of a DSML block: its invokes, in order (None: no call in it)."""
    calls = []
    for name, inner in DSML_INVOKE.findall(body):
        if not NAME.fullmatch(name.strip()):
            return None
        args = {}
        for key, string, value in DSML_PARAM.findall(inner):
            args[key] = value if string == "true" else _loose(value)
        calls.append(_call(name.strip(), args))
    return calls or None


def parse_deepseek_v3(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
    """The inside of a <｜tool▁calls▁begin｜> block (None: no call, or one that does not read)."""
    calls = []
    for head, rest in V3_CALL.findall(body):
        name, text = head.strip(), rest.strip()
        if name == "function":  # V3 / R1: the type, then the name and the arguments in a fence
            name, _, text = text.partition("\n")
            fence = V3_FENCE.match(text.strip())
            name, text = name.strip(), fence.group(1) if fence else text.strip()
        args = _loose(text) if text else {}
        if isinstance(args, str):
            args = _loose(args)  # arguments written as a JSON string
        if not NAME.fullmatch(name) or not isinstance(args, dict):
            return None
        calls.append(_call(name, args))
    return calls or None


@dataclass(frozen=True)
class Block:
    """A tool-call block: its opening and closing tags, and what reads the calls between them."""
    open: str
    close: str
    read: Callable[..., list[ToolCall] | None]  # (body, schemas) -> calls or None


def _single(bare: bool) -> Callable[..., list[ToolCall] | None]:
    def read(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
        call = parse_tool_call(body, bare, schemas)
        return None if call is None else [call]
    return read


def _bare_function(body: str, schemas: Schemas | None = None) -> list[ToolCall] | None:
    """An XML-form call the model wrote without its <tool_call> wrapper (Qwen3-Coder and Qwen3.5/3.6
    drop it at times, as vLLM's qwen3_coder parser allows): <function=NAME> ... </function>, NAME
    one of the request's tools (OutputParser checks the opening as it streams: bare_opening)."""
    name = body.partition(">")[0].strip()
    if not schemas or name not in schemas:
        return None
    call = parse_tool_call(FUNCTION_OPEN + body + FUNCTION_CLOSE, False, schemas)
    return None if call is None else [call]


# what may follow <function=NAME> in an unwrapped call: a parameter, or the close of a call
# without arguments (a newline between them or not)
BARE_NEXT = ("\n<parameter=", "<parameter=", "\n</function>", "</function>")


def bare_opening(text: str, names) -> bool | None:
    """Whether `text` (what follows "<function=") opens an unwrapped call: True, False, or None
    while too little of it has come to say."""
    name, gt, rest = text.partition(">")
    if not gt:
        return None if len(name) <= 128 and "\n" not in name and any(n.startswith(name) for n in names) else False
    if name not in names:
        return False
    if any(rest.startswith(b) for b in BARE_NEXT):
        return True
    return None if any(b.startswith(rest) for b in BARE_NEXT) else False


FORMATS: dict[str, tuple[Block, ...]] = {
    "tool_call": (Block(TOOL_OPEN, TOOL_CLOSE, _single(False)),),
    # the XML call form's templates (Qwen3-Coder, Qwen3.5/3.6): an unwrapped call is read too
    "tool_call_xml": (Block(TOOL_OPEN, TOOL_CLOSE, _single(False)), Block(FUNCTION_OPEN, FUNCTION_CLOSE, _bare_function)),
    "glm": (Block(TOOL_OPEN, TOOL_CLOSE, _single(True)),),
    "dsml": tuple(Block(f"<{DSML}{b}>", f"</{DSML}{b}>", parse_dsml) for b in DSML_BLOCKS),
    "deepseek_v3": (Block(V3_OPEN, V3_CLOSE, parse_deepseek_v3),),
}


class OutputParser:
    """fmt: the model's tool-call format (a FORMATS key; None: "tool_call"). tools=False: no
    tool calls are read, their text stays text. schemas: the request's tools' parameter schemas
    (param_schemas), which type the values of the XML and GLM call forms."""

    def __init__(self, in_reasoning: bool = False, tools: bool = True, fmt: str | None = None,
                 schemas: Schemas | None = None):
        if (fmt or "tool_call") not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.state = "reasoning" if in_reasoning else "content"
        self.tools = tools
        self.blocks = {b.open: b for b in FORMATS[fmt or "tool_call"]} if tools else {}
        if not schemas:  # an unwrapped call is read only as a call of one of the request's tools
            self.blocks.pop(FUNCTION_OPEN, None)
        self.block: Block | None = None  # the open tool-call block
        self.buf = ""
        self.tool_buf = ""
        self.strip_next = in_reasoning  # drop the newline(s) right after a tag
        self.schemas = schemas

    def _tags(self) -> list[str]:
        if self.state == "reasoning":
            return [THINK_CLOSE]
        if self.state == "tool":
            return [self.block.close]
        return [THINK_OPEN, *self.blocks]

    def _emit(self, text: str, out: list[Event]) -> None:
        if self.strip_next:
            text = text.lstrip("\n") if self.state == "reasoning" else text.lstrip()
            if text:
                self.strip_next = False
        if not text:
            return
        if self.state == "tool":
            self.tool_buf += text
        else:
            add_text(out, self.state, text)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
            if self.state == "tool" and self.block.open == FUNCTION_OPEN:
                ok = bare_opening(self.tool_buf + self.buf, self.schemas)
                if ok is False:  # not a call after all: its text again, read as text
                    self._unbare(out)
                    continue
            tags = self._tags()
            hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
            if hits:
                idx, tag = min(hits)
                before = self.buf[:idx]
                self._emit(before.rstrip("\n") if tag == THINK_CLOSE else before, out)
                self.buf = self.buf[idx + len(tag):]
                self._switch(tag, out)
                continue
            keep = max((k for t in tags for k in range(1, len(t)) if self.buf.endswith(t[:k])), default=0)
            part = self.buf[:len(self.buf) - keep]
            if self.state == "reasoning":  # trailing newlines may precede </think>: hold them
                held = len(part) - len(part.rstrip("\n"))
                keep += held
                part = part[:len(part) - held]
            self._emit(part, out)
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _switch(self, tag: str, out: list[Event]) -> None:
        if self.state == "reasoning":  # </think>
            self.state, self.strip_next = "content", True
        elif self.state == "tool":  # the block's close
            self._calls(self.block.read(self.tool_buf, self.schemas), tag, out)
            self.state, self.strip_next = "content", True
        elif tag == THINK_OPEN:
            self.state, self.strip_next = "reasoning", True
        else:  # a block opens
            self.state, self.block, self.tool_buf = "tool", self.blocks[tag], ""

    def _calls(self, calls: list[ToolCall] | None, close: str, out: list[Event]) -> None:
        if calls is None and self.block.open == FUNCTION_OPEN:
            self.buf = close + self.buf
            self._unbare(out)
        elif calls is None:  # not calls we can read: keep the text rather than lose it
            self.state = "content"
            out.append(Event("content", self.block.open + self.tool_buf + close))
        else:
            out += [Event("tool_call", tool=c) for c in calls]

    def _unbare(self, out: list[Event]) -> None:
        """An unwrapped-call opening that is not one: "<function=" is text, and what followed it
        is parsed again as content (it may hold a real <tool_call> or <think>)."""
        add_text(out, "content", FUNCTION_OPEN)
        self.state, self.buf, self.tool_buf = "content", self.tool_buf + self.buf, ""

    def finish(self) -> list[Event]:
        """End of output: flush what was held back; an unterminated block is tried as is (an
        unwrapped call needs its </function>: without it, it is text)."""
        out: list[Event] = []
        if self.state == "tool" and self.block.open == FUNCTION_OPEN:
            self._unbare(out)
            out += self.feed("")
        rest, self.buf = self.buf, ""
        if self.state == "tool":
            self.tool_buf += rest
            self._calls(self.block.read(self.tool_buf, self.schemas), "", out)
        else:
            self._emit(rest, out)
        return out


def merge(events: list[Event]) -> tuple[str, str, list[ToolCall]]:
    """Whole-response view: (reasoning, content, tool calls)."""
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    return reasoning, content, [e.tool for e in events if e.kind == "tool_call"]
