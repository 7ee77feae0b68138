"""tool_choice that demands a call ("required" / "any", or one named tool), by forced tokens.

There is no grammar-constrained decoding here; instead the opening of a tool call is forced:
the engine emits the given tokens in place of sampled ones (runtime.request), and the model
writes the rest (the name when any tool will do, the arguments) in the format it was trained
on. The opening comes from the model's own chat template, probed by rendering a dummy call,
so the JSON form (`<tool_call>\n{"name": "X", ...`) and the XML form (`<tool_call>\n<function=X>`)
both work. When the prompt leaves the model thinking (`<think>` opened), the forcing waits for
the model to close its thinking, so reasoning is kept.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .common import ApiError

_NAME = "ft_probe_tool"
_THINK = "ft probe thinking"
_CLOSERS = "\"'>"  # what ends a tool name in the known formats: JSON string, XML tag


@dataclass
class Forced:
    tokens: list[int]
    after: int | None  # token id that arms the forcing (</think>), None: from the first token


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
    thinking and the call."""
    head: str
    tail: str
    gap: str


def call_format(template, **kwargs) -> CallFormat:
    """Probe the template once (per set of template kwargs) by rendering a dummy call."""
    cache = template.__dict__.setdefault("_call_formats", {})
    key = json.dumps(kwargs, sort_keys=True, default=str)
    if key not in cache:
        cache[key] = _probe(template, kwargs)
    return cache[key]


def _probe(template, kwargs: dict) -> CallFormat:
    probe = [{"role": "user", "content": "x"},
             {"role": "assistant", "content": "", "reasoning_content": _THINK,
              "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": _NAME, "arguments": {}}}]}]
    tools = [{"type": "function", "function": {"name": _NAME, "parameters": {"type": "object"}}}]
    try:
        text = template.render(probe, tools, add_generation_prompt=False, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe: plain Qwen form
        text = ""
    at = text.rfind(_NAME)
    start = text.rfind("<tool_call>", 0, at) if at >= 0 else -1
    if start < 0:  # the template does not show the format; Qwen3's JSON form
        return CallFormat('<tool_call>\n{"name": "', '"', "\n\n")
    end = at + len(_NAME)
    tail = ""
    while end < len(text) and text[end] in _CLOSERS:
        tail += text[end]
        end += 1
    t = text.find("</think>", text.find(_THINK)) if _THINK in text else -1
    gap = text[t + len("</think>"):start] if 0 <= t < start else "\n\n"
    return CallFormat(text[start:at], tail, gap)


def forced_opening(ctx, name: str | None, in_reasoning: bool, **kwargs) -> Forced:
    """Tokens that open a tool call (naming `name` if given), and when to emit them."""
    fmt = call_format(ctx.template, **kwargs)
    opening = fmt.head + name + fmt.tail if name else "<tool_call>"
    after = None
    if in_reasoning:
        close = ctx.tokenizer.token_id("</think>")
        if close is not None:
            after, opening = close, fmt.gap + opening
        else:
            opening = "</think>" + fmt.gap + opening
    return Forced(ctx.tokenizer.encode(opening), after)
