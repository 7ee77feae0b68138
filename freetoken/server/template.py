"""Chat templates: the model's own jinja template (tokenizer_config.json / chat_template.jinja)
rendered with the semantics transformers gives it, or a built-in Qwen3.x template.

Messages arrive already normalised by the API adapters: role, content as a string,
assistant tool_calls as [{"id", "type": "function", "function": {"name", "arguments": dict}}],
reasoning_content for the thinking part.
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
{%- if loop.first and m.content %}{{ '\n' }}{% endif %}
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
        try:
            self.template = env.from_string(source or QWEN3_TEMPLATE)
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
        special = {k: tokenizer_config.get(k) for k in ("bos_token", "eos_token") if isinstance(tokenizer_config.get(k), str)}
        return cls(src or None, special)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        try:
            return self.template.render(messages=messages, tools=tools or None,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.special.get("bos_token", ""),
                                        eos_token=self.special.get("eos_token", ""), **kwargs)
        except jinja2.TemplateError as e:
            raise FreeTokenError(f"chat template error: {e}") from None
