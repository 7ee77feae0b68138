"""Model output -> thinking, text and tool calls, incrementally (Qwen3.x and GLM formats).

Thinking sits between <think> and </think> (the prompt may already have opened it);
tool calls between <tool_call> and </tool_call>, either as JSON
({"name": ..., "arguments": {...}}), in the XML form
(<function=NAME><parameter=P>value</parameter></function>), or in GLM's (4.5 to 5)
NAME<arg_key>K</arg_key><arg_value>V</arg_value>... (newlines between the parts or not; string
values raw, others as JSON; at least one argument). Text is emitted as soon as it
cannot be the start of a tag, so a stream split at any boundary gives the same result.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


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


def parse_tool_call(body: str) -> ToolCall | None:
    body = body.strip()
    cid = "call_" + uuid.uuid4().hex[:24]
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            return ToolCall(cid, obj["name"], json.dumps(args, ensure_ascii=False))
    except ValueError:
        pass
    m = re.search(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", body, re.S)
    if m:
        args = {}
        for pm in re.finditer(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S):
            raw = pm.group(2)
            try:
                args[pm.group(1).strip()] = json.loads(raw)
            except ValueError:
                args[pm.group(1).strip()] = raw
        return ToolCall(cid, m.group(1).strip(), json.dumps(args, ensure_ascii=False))
    # GLM: the name, then key/value pairs. A call without arguments (the bare name) is not told
    # apart from stray text here: it stays text
    name, key, rest = body.partition("<arg_key>")
    if key and re.fullmatch(r"[\w.:/-]+", name.strip()):
        args = {}
        for k, v in GLM_ARG.findall(key + rest):
            try:  # strings are written raw, other values as JSON
                args[k.strip()] = json.loads(v)
            except ValueError:
                args[k.strip()] = v
        return ToolCall(cid, name.strip(), json.dumps(args, ensure_ascii=False))
    return None


class OutputParser:
    def __init__(self, in_reasoning: bool = False, tools: bool = True):
        self.state = "reasoning" if in_reasoning else "content"
        self.tools = tools
        self.buf = ""
        self.tool_buf = ""
        self.strip_next = in_reasoning  # drop the newline(s) right after a tag

    def _tags(self) -> list[str]:
        if self.state == "reasoning":
            return [THINK_CLOSE]
        if self.state == "tool":
            return [TOOL_CLOSE]
        return [THINK_OPEN] + ([TOOL_OPEN] if self.tools else [])

    def _emit(self, text: str, out: list[Event]) -> None:
        if self.strip_next:
            text = text.lstrip("\n") if self.state == "reasoning" else text.lstrip()
            if text:
                self.strip_next = False
        if not text:
            return
        if self.state == "tool":
            self.tool_buf += text
        elif out and out[-1].kind == self.state:
            out[-1].text += text
        else:
            out.append(Event(self.state, text))

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
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
        if tag == THINK_OPEN:
            self.state, self.strip_next = "reasoning", True
        elif tag == THINK_CLOSE:
            self.state, self.strip_next = "content", True
        elif tag == TOOL_OPEN:
            self.state, self.tool_buf = "tool", ""
        elif tag == TOOL_CLOSE:
            call = parse_tool_call(self.tool_buf)
            self.state, self.strip_next = "content", True
            if call is None:  # not a call we can read: keep the text rather than lose it
                out.append(Event("content", TOOL_OPEN + self.tool_buf + TOOL_CLOSE))
            else:
                out.append(Event("tool_call", tool=call))

    def finish(self) -> list[Event]:
        """End of output: flush what was held back; an unterminated tool call is tried as is."""
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.state == "tool":
            call = parse_tool_call(self.tool_buf + rest)
            if call:
                out.append(Event("tool_call", tool=call))
            else:
                self.state = "content"
                self._emit(TOOL_OPEN + self.tool_buf + rest, out)
        else:
            self._emit(rest, out)
        return out


def merge(events: list[Event]) -> tuple[str, str, list[ToolCall]]:
    """Whole-response view: (reasoning, content, tool calls)."""
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    return reasoning, content, [e.tool for e in events if e.kind == "tool_call"]
