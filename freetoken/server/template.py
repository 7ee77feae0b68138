"""Chat templates: the model's own jinja template (tokenizer_config.json / chat_template.jinja)
rendered with the semantics transformers gives it, or a built-in one: DeepSeek-V4's layout for a
deepseek_v4 checkpoint (its release ships no jinja template, only a Python encoder), else Qwen3.x.

Messages arrive already normalised by the API adapters: role, content as a string,
assistant tool_calls as [{"id", "type": "function", "function": {"name", "arguments": dict}}],
reasoning_content for the thinking part (also as `thinking`, the name GPT-OSS's template reads).
A call's arguments reach the template as a dict that also reads as its JSON text where a
template treats them as a string (ToolArgs).
"""
from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import FreeTokenError

# Qwen3-style chat format: <|im_start|>role ... <|im_end|>, thinking in <think>, tool calls as
# JSON in <tool_call>, tool results folded into a user turn in <tool_response>.
QWEN3_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages and messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'system' or m.role == 'user' -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' -%}
<|im_start|>assistant
{% if m.reasoning_content and loop.index0 > ns.last_user %}<think>
{{ m.reasoning_content.strip() }}
</think>

{% endif %}{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}
{%- if m.content or not loop.first %}{{ '\n' }}{% endif %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' }}{{ m.content }}{{ '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif -%}
{%- endif -%}
"""


# DeepSeek-V4's chat format (its release's encoding/encoding_dsv4.py), written here as a
# template: <｜begin▁of▁sentence｜>, the system text (and the tools), user turns after <｜User｜>
# (tool results folded into them as <tool_result>...</tool_result>, parts a blank line apart),
# the assistant turn after <｜Assistant｜> opened with <think> (thinking) or </think> (chat), its
# reasoning closed by </think>, its calls in a DSML block, and <｜end▁of▁sentence｜>. Thinking is on
# unless thinking_mode="chat", thinking=false or enable_thinking=false. Earlier turns' reasoning is
# dropped unless tools are given or drop_thinking=false. Not rendered: the reasoning_effort="max"
# preamble, response formats, the quick-instruction task tokens.
DEEPSEEK_V4_TEMPLATE = r"""
{%- set ds = '｜DSML｜' -%}
{%- if thinking_mode is defined -%}{%- set think = thinking_mode == 'thinking' -%}
{%- elif thinking is defined -%}{%- set think = thinking -%}
{%- elif enable_thinking is defined -%}{%- set think = enable_thinking -%}
{%- else -%}{%- set think = true -%}{%- endif -%}
{%- set drop = (drop_thinking if drop_thinking is defined else true) and not tools -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role in ('user', 'tool') -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{{- bos_token -}}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{{- system or '' -}}
{%- if tools -%}
{%- if system %}{{ '\n\n' }}{% endif -%}
{{- '## Tools\n\nYou can call the tools below. To call one or more of them, write a block in this form:\n\n' -}}
{{- '<' + ds + 'tool_calls>\n<' + ds + 'invoke name="TOOL_NAME">\n' -}}
{{- '<' + ds + 'parameter name="PARAMETER_NAME" string="true|false">VALUE</' + ds + 'parameter>\n...\n' -}}
{{- '</' + ds + 'invoke>\n...\n</' + ds + 'tool_calls>\n\n' -}}
{{- 'Write a string value as it is, with string="true"; write any other value (number, boolean, '
    'array, object, null) as JSON, with string="false".\n\n' -}}
{{- 'When thinking is on (<think>), end your reasoning with </think> before any tool call or answer.\n\n' -}}
{{- '### Tool schemas\n\n' -}}
{%- for t in tools -%}{{ (t.function if t.function is defined else t) | tojson }}{{ '\n' }}{%- endfor -%}
{{- '\nCall only the tools listed above, with their parameters as defined.\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- set prev = messages[loop.index0 - 1].role if not loop.first else none -%}
{%- set next = messages[loop.index0 + 1].role if not loop.last else none -%}
{%- if m.role == 'system' -%}
{%- if not loop.first %}{{ m.content or '' }}{% endif -%}
{%- elif m.role in ('user', 'tool') -%}
{%- if prev in ('user', 'tool') %}{{ '\n\n' }}{% else %}{{ '<｜User｜>' }}{% endif -%}
{%- if m.role == 'tool' %}{{ '<tool_result>' + (m.content or '') + '</tool_result>' }}
{%- else %}{{ m.content or '' }}{% endif -%}
{%- if next == 'assistant' or (loop.last and add_generation_prompt) -%}
{{- '<｜Assistant｜>' + ('<think>' if think and (not drop or loop.index0 >= ns.last_user) else '</think>') -}}
{%- endif -%}
{%- elif m.role == 'assistant' -%}
{%- if think and (not drop or loop.index0 > ns.last_user) %}{{ (m.reasoning_content or '') + '</think>' }}{% endif -%}
{{- m.content or '' -}}
{%- if m.tool_calls -%}
{{- '\n\n<' + ds + 'tool_calls>\n' -}}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{%- set args = f.arguments if f.arguments is mapping else {'arguments': f.arguments} -%}
{{- '<' + ds + 'invoke name="' + f.name + '">\n' -}}
{%- for k, v in args.items() -%}
{{- '<' + ds + 'parameter name="' + k + '" string="' + ('true' if v is string else 'false') + '">' -}}
{{- v if v is string else (v | tojson) -}}
{{- '</' + ds + 'parameter>' -}}
{%- if not loop.last %}{{ '\n' }}{% endif -%}
{%- endfor -%}
{{- '\n</' + ds + 'invoke>' -}}
{%- if not loop.last %}{{ '\n' }}{% endif -%}
{%- endfor -%}
{{- '\n</' + ds + 'tool_calls>' -}}
{%- endif -%}
{{- eos_token -}}
{%- endif -%}
{%- endfor -%}
"""
BUILTIN = {"deepseek_v4": DEEPSEEK_V4_TEMPLATE}  # model_type -> template, for checkpoints without one
BUILTIN_SPECIAL = {"deepseek_v4": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}}


class ToolArgs(dict):
    """A tool call's arguments as templates get them: a dict (`.items()`, `tojson`, `is mapping`)
    that prints as its JSON text and joins strings with `+` as that text (DeepSeek-V3.1's template
    concatenates the arguments as a string)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + str(self) if isinstance(other, str) else NotImplemented


def _with_tool_args(messages: list[dict]) -> list[dict]:
    """Messages whose tool calls' dict arguments are ToolArgs, and whose reasoning_content is
    also `thinking` (copies; the originals are kept)."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("reasoning_content") and "thinking" not in m:
            m = {**m, "thinking": m["reasoning_content"]}
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and calls:
            wrapped = []
            for tc in calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
                    tc = {**tc, "function": {**fn, "arguments": ToolArgs(fn["arguments"])}}
                wrapped.append(tc)
            m = {**m, "tool_calls": wrapped}
        out.append(m)
    return out


def _token_text(v) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken object ({"content": ...})."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


class ChatTemplate:
    def __init__(self, source: str | None, special: dict[str, str] | None = None):
        self.builtin = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source or QWEN3_TEMPLATE
        try:
            self.template = env.from_string(self.source)
        except jinja2.TemplateError as e:
            raise FreeTokenError(f"the model's chat template does not parse: {e}") from None
        self.special = special or {}

    @classmethod
    def from_files(cls, files: dict[str, bytes], tokenizer_config: dict) -> "ChatTemplate":
        src = tokenizer_config.get("chat_template")
        if isinstance(src, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
            src = named.get("default") or next(iter(named.values()), None)
        if not src and "chat_template.jinja" in files:
            src = files["chat_template.jinja"].decode()
        if not src and "chat_template.json" in files:
            src = json.loads(files["chat_template.json"]).get("chat_template")
        special = {k: v for k in ("bos_token", "eos_token") if (v := _token_text(tokenizer_config.get(k))) is not None}
        if not src:  # a checkpoint without a template: the built-in one of its model type, if any
            try:
                model_type = json.loads(files.get("config.json") or b"{}").get("model_type")
            except (ValueError, AttributeError):
                model_type = None
            if model_type in BUILTIN:
                t = cls(BUILTIN[model_type], {**BUILTIN_SPECIAL.get(model_type, {}), **special})
                t.builtin = True
                return t
        return cls(src or None, special)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final: bool = False, **kwargs) -> str:
        """continue_final: the last message, an assistant turn, is left open for the model to
        continue (Anthropic's prefill of a final assistant message, vLLM's and transformers'
        continue_final_message): rendered as a closed turn, then cut right after its text."""
        if continue_final:
            return self._continued(messages, tools, **kwargs)
        try:
            return self.template.render(messages=_with_tool_args(messages), tools=tools or None,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.special.get("bos_token", ""),
                                        eos_token=self.special.get("eos_token", ""), **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # a template that fails on these messages (e.g. `+` on a value of another type)
            raise FreeTokenError(f"chat template error: {e}") from None

    # marks the end of the final message's text in a render (private-use characters: no template
    # trims, escapes or repeats them), so the cut never lands in the template's own closing text
    CUT = "\ue000ft-continue\ue001"

    def _continued(self, messages: list[dict], tools, **kwargs) -> str:
        last = messages[-1] if messages else {}
        if last.get("role") != "assistant" or last.get("tool_calls"):
            raise FreeTokenError("continuing the final message needs an assistant message with text "
                                 "(and no tool calls) last")
        body = last.get("content") or ""
        if not body.strip():  # nothing to continue: an ordinary answer to the turns before it
            return self.render(messages[:-1], tools, add_generation_prompt=True, **kwargs)
        marked = self.render([*messages[:-1], {**last, "content": body + self.CUT}], tools,
                             add_generation_prompt=False, **kwargs)
        if marked.count(self.CUT) != 1:
            raise FreeTokenError("the chat template does not write the final assistant message's text as "
                                 "given, so it cannot be continued; send it without the final assistant message")
        text = marked[:marked.index(self.CUT)]
        # trailing whitespace of the message stays only where the template keeps it without the mark
        trail = len(body) - len(body.rstrip())
        if trail and not self.render(messages, tools, add_generation_prompt=False, **kwargs).startswith(text):
            text = text[:len(text) - trail]
        return text
