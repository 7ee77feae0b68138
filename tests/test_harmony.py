"""GPT-OSS's Harmony output (server/harmony.py): analysis -> reasoning, final and preambles ->
content, messages to functions.NAME -> tool calls, the same events whichever way the stream is
split; a template that writes Harmony is recognised, and a demanded call is forced and
constrained in Harmony's own syntax."""
from types import SimpleNamespace

import json

import pytest

from freetoken.server.harmony import HarmonyParser, writes_harmony
from freetoken.server.parser import merge
from freetoken.server.template import ChatTemplate
from freetoken.server.tool_choice import call_format, call_grammar, forced_opening, parser_format, strict_grammar
from freetoken.tokenizer import Tokenizer

CALL = ('<|channel|>analysis<|message|>The user wants the weather.<|end|>'
        '<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>'
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris", "days": 2}<|call|>')
FINAL = ('<|channel|>analysis<|message|>Short answer.<|end|>'
         '<|start|>assistant<|channel|>final<|message|>It is sunny <b>today</b>.')  # <|return|>: a stop token, hidden


def parse(chunks, tools=True):
    p = HarmonyParser(tools=tools)
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    reasoning, content, calls = merge(events)
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text,want", [
    (CALL, ("The user wants the weather.", "Checking the forecast.", [("get_weather", {"city": "Paris", "days": 2})])),
    (FINAL, ("Short answer.", "It is sunny <b>today</b>.", [])),
    # the recipient in the role header, a JSON hint after the channel, the call's end dropped
    ('<|channel|>analysis<|message|>ls it<|end|><|start|>assistant to=functions.run<|channel|>commentary json'
     '<|message|>{"cmd": "ls -la"}', ("ls it", "", [("run", {"cmd": "ls -la"})])),
    # a body that is no JSON object stays text; a header the output never finished shows its words
    ('<|channel|>commentary to=functions.run <|constrain|>json<|message|>not json<|call|>', ("", "not json", [])),
    ('<|channel|>final', ("", "final", [])),
])
def test_every_split_gives_the_same_events(text, want):
    assert parse([text]) == want
    assert parse(list(text)) == want  # a character at a time
    for i in range(len(text) + 1):
        assert parse([text[:i], text[i:]]) == want, i


def test_without_tools_a_call_stays_text():
    reasoning, content, calls = parse([CALL], tools=False)
    assert calls == [] and reasoning == "The user wants the weather."
    assert content == 'Checking the forecast.{"city": "Paris", "days": 2}'


# Harmony as GPT-OSS's template writes it (our own minimal one): the reasoning before a call from
# `thinking`, the call with its recipient in the role header, the tool's answer from functions.NAME
HARMONY_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% set f = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ f.name }}<|channel|>commentary json"
    "<|message|>{{ f.arguments | tojson }}<|call|>{% set ns_last = f.name %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def ctx(qwen_json):
    return SimpleNamespace(template=ChatTemplate(HARMONY_TEMPLATE), tokenizer=Tokenizer(qwen_json.encode()))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "strict": True}}]


def test_a_harmony_template_is_recognised_and_calls_are_forced_in_its_syntax(ctx):
    assert writes_harmony(ctx.template) and not writes_harmony(ChatTemplate(None))
    assert parser_format(ctx.template) == "harmony"
    fmt = call_format(ctx.template)
    assert (fmt.family, fmt.syntax.args, fmt.syntax.close) == ("harmony", "<|message|>", "<|call|>")
    f = forced_opening(ctx, "get_weather", in_reasoning=False)
    assert ctx.tokenizer.decode(f.tokens) == "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    spec = call_grammar(ctx, TOOLS, None, forced_opening(ctx, None, in_reasoning=False), parallel=True)
    assert spec.syntax.head == "<|channel|>commentary to=functions." and not spec.multiple  # <|call|> ends the turn
    assert strict_grammar(ctx, TOOLS, in_reasoning=False) is None  # free Harmony text is not constrained
    # what the constrained call then reads back as
    text = ctx.tokenizer.decode(f.tokens) + '<|message|>{"city": "Oslo"}'
    assert parse([text]) == ("", "", [("get_weather", {"city": "Oslo"})])


def test_history_renders_for_harmony(ctx):
    """The reasoning of a turn that called a tool reaches a Harmony template as `thinking`, and
    what the model wrote parses back into the same reasoning and call."""
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "reasoning_content": "Need the forecast.",
                "tool_calls": [{"id": "c1", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = ctx.template.render(history, TOOLS)
    turn = text[text.index("<|start|>assistant<|channel|>analysis"):text.index("<|start|>functions.")]
    assert turn == ('<|start|>assistant<|channel|>analysis<|message|>Need the forecast.<|end|>'
                    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
                    '<|call|>')
    # the model's own output for that turn (after the prompt's <|start|>assistant) reads back the same
    out = turn[len("<|start|>assistant"):-len("<|call|>")]
    assert parse([out]) == ("Need the forecast.", "", [("get_weather", {"city": "Oslo"})])
    assert text.endswith("<|start|>assistant")
