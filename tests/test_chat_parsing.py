"""Output parsing on scripted streams split at every boundary, and template rendering."""
import json

import pytest

from freetoken.server.parser import OutputParser, merge, parse_tool_call
from freetoken.server.template import ChatTemplate

SCRIPTS = [
    # (text, starts inside <think>, expected reasoning, content, tool calls [(name, args)])
    ("<think>\nLet me add.\n</think>\n\nThe answer is 4.", False, "Let me add.", "The answer is 4.", []),
    ("plan it\n\n</think>\n\nDone.", True, "plan it", "Done.", []),
    ("I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
     False, "", "I'll check.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("<think>x < y and </thinking> is not a tag</think><tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
     "<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
     False, "x < y and </thinking> is not a tag", "", [("a", {}), ("run", {"cmd": "ls -la", "n": 3})]),
    ("no tags at all, just <b>html</b> and a lone <", False, "", "no tags at all, just <b>html</b> and a lone <", []),
    ("<tool_call>not json at all</tool_call> tail", False, "", "<tool_call>not json at all</tool_call>tail", []),
]


def run(parser, pieces):
    events = []
    for p in pieces:
        events += parser.feed(p)
    events += parser.finish()
    return merge(events)


def check(result, reasoning, content, calls):
    r, c, tools = result
    assert r == reasoning
    assert c == content
    assert [(t.name, json.loads(t.arguments)) for t in tools] == calls


@pytest.mark.parametrize("i", range(len(SCRIPTS)))
def test_every_split_point(i):
    text, in_think, *expected = SCRIPTS[i]
    check(run(OutputParser(in_think), [text]), *expected)
    for cut in range(len(text) + 1):
        check(run(OutputParser(in_think), [text[:cut], text[cut:]]), *expected)
    check(run(OutputParser(in_think), list(text)), *expected)  # one character at a time


def test_three_way_splits_on_a_tool_script():
    text, in_think, *expected = SCRIPTS[3]
    for a in range(0, len(text), 3):
        for b in range(a, len(text), 5):
            check(run(OutputParser(in_think), [text[:a], text[a:b], text[b:]]), *expected)


def test_tools_disabled_keeps_text():
    text = "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>"
    assert run(OutputParser(tools=False), [text]) == ("", text, [])


def test_unterminated_tool_call_at_end():
    r, c, tools = run(OutputParser(), ["<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}"])
    assert [t.name for t in tools] == ["f"]


def test_parse_tool_call_variants():
    assert parse_tool_call('{"name": "f", "arguments": "{\\"x\\": 1}"}').arguments == '{"x": 1}'
    assert parse_tool_call("garbage") is None


TYPED_TOOLS = [{"type": "function", "function": {"name": "ship", "parameters": {"type": "object", "properties": {
    "zip": {"type": "string"}, "note": {"type": ["string", "null"]}, "mode": {"enum": ["1", "2"]},
    "count": {"type": "integer"}, "express": {"type": "boolean"}, "dims": {"type": "object"},
    "code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}]


@pytest.mark.parametrize("fmt, text", [
    ("tool_call", "<tool_call>\n<function=ship>\n<parameter=zip>\n02139\n</parameter>\n<parameter=note>\n123\n"
                  "</parameter>\n<parameter=mode>\n2\n</parameter>\n<parameter=count>\n3\n</parameter>\n"
                  "<parameter=express>\ntrue\n</parameter>\n<parameter=dims>\n{\"w\": 1}\n</parameter>\n"
                  "<parameter=extra>\n7\n</parameter>\n<parameter=code>\n\"AB\"\n</parameter>\n</function>\n</tool_call>"),
    ("glm", "<tool_call>ship\n<arg_key>zip</arg_key>\n<arg_value>02139</arg_value>\n<arg_key>note</arg_key>\n"
            "<arg_value>123</arg_value>\n<arg_key>mode</arg_key>\n<arg_value>2</arg_value>\n<arg_key>count</arg_key>\n"
            "<arg_value>3</arg_value>\n<arg_key>express</arg_key>\n<arg_value>true</arg_value>\n<arg_key>dims</arg_key>\n"
            "<arg_value>{\"w\": 1}</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>7</arg_value>\n"
            "<arg_key>code</arg_key>\n<arg_value>\"AB\"</arg_value>\n</tool_call>"),
])
def test_raw_values_are_typed_by_the_tools_schema(fmt, text):
    """The XML and GLM call forms write a string argument raw: "123" for a string parameter
    stays a string (it came back as the number 123), numbers, booleans and objects by their
    types; a parameter the schema does not name, or no tools given, reads as JSON when it parses;
    a JSON string literal (what the strict-tools grammar writes for a patterned string) is decoded."""
    from freetoken.server.parser import param_schemas
    want = {"zip": "02139", "note": "123", "mode": "2", "count": 3, "express": True, "dims": {"w": 1}, "extra": 7,
            "code": "AB"}
    for pieces in ([text], list(text)):  # whole, and one character at a time
        _, _, calls = run(OutputParser(fmt=fmt, schemas=param_schemas(TYPED_TOOLS)), pieces)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ship", want)]
    _, _, calls = run(OutputParser(fmt=fmt), [text])  # without the tools: JSON where it parses
    assert json.loads(calls[0].arguments)["note"] == 123
    # Anthropic's shape of a tool names its schema input_schema
    assert param_schemas([{"name": "ship", "input_schema": {"type": "object"}}]) == {"ship": {"type": "object"}}


def test_builtin_template_renders_tools_history_and_thinking():
    t = ChatTemplate(None)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "need tool",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "warm"},
            {"role": "user", "content": "thanks"}]
    out = t.render(msgs, tools)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in out and "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>" in out
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>" in out
    assert "need tool" not in out  # thinking of turns before the last user message is dropped
    assert out.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    no_think = t.render([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_model_template_from_tokenizer_config():
    cfg = {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}",
           "eos_token": "</s>"}
    t = ChatTemplate.from_files({}, cfg)
    assert not t.builtin
    assert t.render([{"role": "user", "content": "hi"}]) == "[user]hi[assistant]</s>"


# an XML-form call without its <tool_call> wrapper (Qwen3-Coder, Qwen3.5/3.6 at times), read with the
# XML templates' format when it calls one of the request's tools and opens like a call; anything
# else that mentions the tag stays text, and tags after it are still read
BARE = [
    ("Let me look.\n<function=read_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n</function>\nthen more",
     "", "Let me look.\nthen more", [("read_file", {"path": "src/a.py"})]),
    ("<function=now>\n</function>", "", "", [("now", {})]),
    ("Write <function=my func> here.", "", "Write <function=my func> here.", []),
    ("Qwen writes <function=read_file> like so, then <tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
     "", "Qwen writes <function=read_file> like so, then ", [("now", {})]),
    ("In HTML: <function=unknown>\n<parameter=a>\n1\n</parameter>\n</function> is not ours", "",
     "In HTML: <function=unknown>\n<parameter=a>\n1\n</parameter>\n</function> is not ours", []),
    ("cut <function=read_file>\n<parameter=path>\nx", "", "cut <function=read_file>\n<parameter=path>\nx", []),
    ("<think>a <function=now> in thought</think>ok", "a <function=now> in thought", "ok", []),
]
BARE_SCHEMAS = {"read_file": {"type": "object", "properties": {"path": {"type": "string"}}}, "now": {}}


@pytest.mark.parametrize("i", range(len(BARE)))
def test_unwrapped_xml_calls_at_every_split(i):
    text, *expected = BARE[i]
    for cut in range(len(text) + 1):
        parser = OutputParser(fmt="tool_call_xml", schemas=BARE_SCHEMAS)
        check(run(parser, [text[:cut], text[cut:]]), *expected)
    check(run(OutputParser(fmt="tool_call_xml", schemas=BARE_SCHEMAS), list(text)), *expected)
    if expected[2]:  # JSON-form templates, or no tools given: the unwrapped form is text
        for p in (OutputParser(schemas=BARE_SCHEMAS), OutputParser(fmt="tool_call_xml")):
            assert run(p, [text])[2] == [] or "<tool_call>" in text
