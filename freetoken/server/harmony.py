"""GPT-OSS's Harmony output -> thinking, text and tool calls, incrementally.

An assistant turn in Harmony is a sequence of messages, each a header and a body:
    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>
(the chat template's generation prompt ends at `<|start|>assistant`, so the output starts with
the first header's `<|channel|>`). The header names the channel and, for a tool call, the
recipient (`to=functions.NAME`, in the header before or after the channel). Bodies become:
  analysis                          reasoning
  final, or commentary to no one    content (commentary without a recipient is a preamble the
                                    user sees)
  any channel to=RECIPIENT          a tool call: name RECIPIENT less its "functions." prefix,
                                    arguments the body (JSON); a body that is not a JSON object
                                    is kept as content, as the other formats keep unreadable calls
A body ends at <|end|>, <|call|> or <|return|> (the last two also end the turn: they are the
model's stop tokens, so the output may end without them) or where a new <|start|> begins.
Text is emitted as soon as it cannot be the start of a tag, so a stream split at any boundary
gives the same events (tests/test_harmony.py).
"""
from __future__ import annotations

import json
import re

from .parser import Event, ToolCall, _call, add_text

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")
MARKER = CHANNEL  # in a chat template's source: the template writes Harmony


class HarmonyParser:
    """The OutputParser interface (feed, finish -> Events) for Harmony's messages."""

    def __init__(self, tools: bool = True):
        self.tools = tools  # False: a tool call's body stays text (content)
        self.state = "header"  # "header" (until <|message|>) or "body" (until an end tag)
        self.buf = ""  # text not yet consumed (a header until its <|message|>, or a partial tag)
        self.kind = "content"  # the open body's event kind
        self.recipient: str | None = None
        self.call_buf = ""  # the open tool call's body

    def _open(self, header: str) -> None:
        """A header is complete: what its body will be."""
        m = CHANNEL_NAME.search(header)
        channel = m.group(1) if m else ""
        r = RECIPIENT.search(header)
        self.recipient = r.group(1) if r else None
        if self.recipient is not None and self.tools:
            self.kind, self.call_buf = "tool", ""
        else:
            self.kind = "reasoning" if channel == "analysis" else "content"

    def _emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self.kind == "tool":
            self.call_buf += text
        else:
            add_text(out, self.kind, text)

    def _close(self, out: list[Event]) -> None:
        """The body ends: a tool call is read."""
        if self.kind != "tool":
            return
        body = self.call_buf.strip()
        try:
            args = json.loads(body) if body else {}
        except ValueError:
            args = None
        if isinstance(args, dict):
            name = self.recipient[len("functions."):] if self.recipient.startswith("functions.") else self.recipient
            out.append(Event("tool_call", tool=_call(name, args)))
        else:  # not a call we can read: keep the text rather than lose it
            self.kind = "content"
            self._emit(self.call_buf, out)
        self.kind, self.call_buf = "content", ""

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
            if self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    return out  # a header is never shown: hold it all
                self._open(self.buf[:at])
                self.buf, self.state = self.buf[at + len(MESSAGE):], "body"
                continue
            hits = [(self.buf.find(t), t) for t in (*ENDS, START) if t in self.buf]
            if hits:
                at, tag = min(hits)
                self._emit(self.buf[:at], out)
                self._close(out)
                # an end tag is consumed; a <|start|> begins the next header (its role word too)
                self.buf = self.buf[at + (len(tag) if tag in ENDS else 0):]
                self.state = "header"
                continue
            tags = (*ENDS, START)
            keep = max((k for t in tags for k in range(1, len(t)) if self.buf.endswith(t[:k])), default=0)
            self._emit(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def finish(self) -> list[Event]:
        """End of output (after a stop token, or cut short): the open body ends here; text left
        in an unfinished header (no <|message|> came) is shown as content, without its tags."""
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.state == "body":
            self._emit(rest, out)
            self._close(out)
        else:
            text = re.sub(r"<\|[a-z_]+\|>", " ", rest).strip()
            if text:
                out.append(Event("content", text))
        return out


def writes_harmony(template) -> bool:
    """Whether a chat template writes Harmony (GPT-OSS's): its source has the channel tag."""
    return MARKER in (getattr(template, "source", "") or "")


__all__ = ["HarmonyParser", "ToolCall", "writes_harmony"]
