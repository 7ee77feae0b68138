"""DeepSeek (DSML of V3.2 / V4, and V3.1's) and GLM chat formats: the streaming output parser on
streams split at every boundary, tool calls held by a grammar in each model's own syntax (they
parse back), and chat templates of our own in those layouts: tool-call histories render, and what
the template writes for an assistant turn parses back to that turn.

The templates here are minimal equivalents written for these tests (turn markers, thinking, tool
declarations, calls, results), not the published ones."""
import codecs
import json
import random
from types import SimpleNamespace

import jsonschema
import llguidance as llg
import pytest
import torch
from tokenizers import AddedToken

from freetoken.demo import demo_path
from freetoken.errors import FreeTokenError
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.grammar import grammar_text
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.server.common import build_prompt
from freetoken.server.parser import FORMATS, OutputParser, merge
from freetoken.server.template import DEEPSEEK_V4_TEMPLATE, QWEN3_TEMPLATE, ChatTemplate, ToolArgs
from freetoken.server.tool_choice import call_format, call_grammar, forced_opening, parser_format, strict_grammar
from freetoken.tokenizer import Tokenizer
from test_structured_output import SCHEMAS, TOOLS  # the same two strict tools

D = "｜DSML｜"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


# ---- the streaming parser ----------------------------------------------------------------------------
def dsml_call(name: str, params: list[tuple[str, bool, str]], block: str = "tool_calls") -> str:
    inner = "\n".join(f'<{D}parameter name="{k}" string="{"true" if s else "false"}">{v}</{D}parameter>'
                      for k, s, v in params)
    return f'<{D}{block}>\n<{D}invoke name="{name}">\n{inner}\n</{D}invoke>\n</{D}{block}>'


V4_TWO_CALLS = (
    "Let me look.\nThe user wrote a < b and </think-ish things.\n\n</think>I'll check both.\n\n"
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">São Paulo <"x"></{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f'<{D}parameter name="opts" string="false">{{"units": ["C", "F"], "raw": true, "n": null}}</{D}parameter>\n'
    f'</{D}invoke>\n<{D}invoke name="read_file">\n'
    f'<{D}parameter name="path" string="true">a\nb.txt</{D}parameter>\n'
    f'<{D}parameter name="code" string="true">123</{D}parameter>\n'
    f'</{D}invoke>\n</{D}tool_calls>')

SCRIPTS = [
    # (format, the prompt opened <think>, text, reasoning, content, calls [(name, arguments)])
    ("dsml", True, V4_TWO_CALLS, "Let me look.\nThe user wrote a < b and </think-ish things.", "I'll check both.\n\n",
     [("get_weather", {"city": 'São Paulo <"x">', "days": 3, "opts": {"units": ["C", "F"], "raw": True, "n": None}}),
      ("read_file", {"path": "a\nb.txt", "code": "123"})]),
    # V3.2's block name; a call without parameters (the template leaves a blank line)
    ("dsml", False, f'<think>\n\n</think>\n\n<{D}function_calls>\n<{D}invoke name="now">\n\n</{D}invoke>\n'
                    f'</{D}function_calls>', "", "", [("now", {})]),
    # two blocks (as a grammar writes parallel calls), text before them
    ("dsml", False, "Sure.\n\n" + dsml_call("a", [("x", False, "[1, 2]")]) + "\n" + dsml_call("b", [("q", True, "")]),
     "", "Sure.\n\n", [("a", {"x": [1, 2]}), ("b", {"q": ""})]),
    # a block without a call in it stays text; tag-like text outside a block is text
    ("dsml", False, f"<{D}tool_calls>no invoke here</{D}tool_calls> then <{D} and <{D}invoke name=\"x\"> and <{D}",
     "", f"<{D}tool_calls>no invoke here</{D}tool_calls>then <{D} and <{D}invoke name=\"x\"> and <{D}", []),
    # cut short (max_tokens): the open block is read as it is
    ("dsml", False, f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="q" string="true">hi</{D}parameter>\n',
     "", "", [("f", {"q": "hi"})]),
    # DeepSeek-V3.1: several calls in one block, after thinking
    ("deepseek_v3", True, "Hmm, weather.</think>Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", "Hmm, weather.", "Checking.", [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]),
    # DeepSeek-V3 / R1: the type, then the name and the arguments in a fence
    ("deepseek_v3", False, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
     '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", "", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", False, "<｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜>", "",
     "<｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜>", []),
    # GLM (5 / 4.7 back to back, 4.5 with newlines); in its own format a bare name is a call
    ("glm", True, "plan\n</think>Reading.<tool_call>read_file<arg_key>path</arg_key><arg_value>a b.txt</arg_value>"
     "<arg_key>limit</arg_key><arg_value>20</arg_value></tool_call><tool_call>list_files</tool_call>", "plan",
     "Reading.", [("read_file", {"path": "a b.txt", "limit": 20}), ("list_files", {})]),
    ("glm", False, "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
     "", "\n", [("get_weather", {"city": "Paris"})]),
]


def norm(events):
    """Events with adjacent text of one kind joined (how a stream is cut decides where text
    events split, nothing else), calls as (name, arguments)."""
    out = []
    for e in events:
        if e.kind == "tool_call":
            out.append(("tool_call", e.tool.name, json.loads(e.tool.arguments)))
        elif e.text:
            if out and out[-1][0] == e.kind:
                out[-1] = (e.kind, out[-1][1] + e.text)
            else:
                out.append((e.kind, e.text))
    return out


def run(fmt, in_think, pieces):
    p, events = OutputParser(in_think, tools=True, fmt=fmt), []
    for piece in pieces:
        events += p.feed(piece)
    return events + p.finish()


def random_splits(text: str, rng: random.Random, n: int):
    for _ in range(n):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("i", range(len(SCRIPTS)))
def test_every_split_point_gives_the_same_events(i):
    fmt, in_think, text, reasoning, content, calls = SCRIPTS[i]
    whole = run(fmt, in_think, [text])
    r, c, tools = merge(whole)
    assert (r, c) == (reasoning, content)
    assert [(t.name, json.loads(t.arguments)) for t in tools] == calls
    want = norm(whole)
    for cut in range(len(text) + 1):
        assert norm(run(fmt, in_think, [text[:cut], text[cut:]])) == want, cut
    assert norm(run(fmt, in_think, list(text))) == want  # one character at a time
    for pieces in random_splits(text, random.Random(i), 300):
        assert norm(run(fmt, in_think, pieces)) == want, pieces


@pytest.mark.parametrize("i", [0, 2, 5])
def test_every_byte_split_through_an_incremental_decoder(i):
    """The tags hold 3-byte characters (｜, ▁): a stream cut inside one reaches the parser once the
    character is whole (as the server's detokenizer does), and gives the same events."""
    fmt, in_think, text, *_ = SCRIPTS[i]
    want = norm(run(fmt, in_think, [text]))
    data = text.encode()
    for cut in range(len(data) + 1):
        dec = codecs.getincrementaldecoder("utf-8")()
        pieces = [dec.decode(data[:cut]), dec.decode(data[cut:], final=True)]
        assert norm(run(fmt, in_think, pieces)) == want, cut
    dec = codecs.getincrementaldecoder("utf-8")()
    assert norm(run(fmt, in_think, [dec.decode(bytes([b])) for b in data])) == want  # one byte at a time


def test_three_way_splits_of_a_dsml_stream():
    fmt, in_think, text, *_ = SCRIPTS[0]
    want = norm(run(fmt, in_think, [text]))
    for a in range(0, len(text), 3):
        for b in range(a, len(text), 7):
            assert norm(run(fmt, in_think, [text[:a], text[a:b], text[b:]])) == want


def test_text_goes_out_as_soon_as_it_cannot_open_a_tag():
    p = OutputParser(fmt="dsml")
    assert norm(p.feed("Hello <")) == [("content", "Hello ")]  # '<' may open a block: held
    assert norm(p.feed("｜DSML｜x")) == [("content", "<｜DSML｜x")]  # it does not
    assert norm(p.feed(" <｜DSML｜tool_c")) == [("content", " ")]
    assert norm(p.feed("alls>")) == []
    p = OutputParser(fmt="deepseek_v3")
    assert norm(p.feed("a<｜tool▁calls")) == [("content", "a")]
    assert norm(p.finish()) == [("content", "<｜tool▁calls")]


def test_formats_do_not_misfire_on_other_models_text():
    """Each parser reads its own model's calls only; another format's markup stays text."""
    qwen = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    dsml = dsml_call("f", [("x", True, "1")])
    v3 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    for fmt, others in [("tool_call", [dsml, v3, "<tool_call>f</tool_call>"]),
                        ("tool_call_xml", [dsml, v3, "<tool_call>f</tool_call>"]), ("glm", [dsml, v3]),
                        ("dsml", [qwen, v3]), ("deepseek_v3", [qwen, dsml])]:
        for text in others:
            assert merge(run(fmt, False, [text])) == ("", text, []), (fmt, text)
    for fmt, text in [("tool_call", qwen), ("tool_call_xml", qwen), ("glm", qwen), ("dsml", dsml),
                      ("deepseek_v3", v3)]:
        assert [t.name for t in merge(run(fmt, False, [text]))[2]] == ["f"]
    assert set(FORMATS) == {"tool_call", "tool_call_xml", "glm", "dsml", "deepseek_v3"}
    with pytest.raises(ValueError, match="unknown tool-call format"):
        OutputParser(fmt="nope")
    assert merge(run(None, False, [dsml]))[2] == []  # no format given: Qwen's (as before)
    assert merge(OutputParser(tools=False, fmt="dsml").feed(dsml))[1] == dsml


# ---- templates of our own in GLM's and DeepSeek's layouts --------------------------------------------
# GLM-5 / 4.7: [gMASK]<sop>, turns after <|system|> <|user|> <|assistant|> <|observation|>; thinking
# in <think></think> (an empty </think> on turns whose thinking is not shown); calls back to back,
# NAME<arg_key>K</arg_key><arg_value>V</arg_value> (strings raw, other values JSON)
GLM5_TEMPLATE = r"""[gMASK]<sop>
{%- macro text_of(c) -%}
{%- if c is string -%}{{ c }}{%- elif c is iterable and c is not mapping -%}
{%- for p in c -%}{{ p.text if p is mapping else p }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
Call a function as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|system|>{{ text_of(m.content) }}
{%- elif m.role == 'user' -%}<|user|>{{ text_of(m.content) }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}{{ '<think>' + m.reasoning_content.strip() + '</think>' }}
{%- else -%}{{ '</think>' }}{%- endif -%}
{{- text_of(m.content).strip() -}}
{%- for tc in m.tool_calls or [] -%}
{%- set f = tc.function if tc.function is defined else tc -%}
{{- '<tool_call>' + f.name -}}
{%- for k, v in f.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if enable_thinking is defined and not enable_thinking else '<think>' }}
{%- endif -%}"""

# GLM-4.5: the same with newlines between a call's parts
GLM45_TEMPLATE = GLM5_TEMPLATE.replace(
    "{{- '<tool_call>' + f.name -}}", "{{- '\\n<tool_call>' + f.name + '\\n' -}}").replace(
    "</arg_key><arg_value>", "</arg_key>{{ '\\n' }}<arg_value>").replace(
    "</arg_value>\n{%- endfor -%}\n</tool_call>", "</arg_value>{{ '\\n' }}\n{%- endfor -%}\n</tool_call>")

# DeepSeek-V3.1: <｜User｜> / <｜Assistant｜> turns, the prompt closing thinking (</think>) unless
# thinking=true, calls in <｜tool▁calls▁begin｜>, each NAME<｜tool▁sep｜>ARGUMENTS written by string
# concatenation (the arguments are a dict here: they join as their JSON), results in
# <｜tool▁output▁begin｜>
V31_TEMPLATE = r"""{{ bos_token }}{{ messages[0].content if messages[0].role == 'system' else '' }}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{ '<｜User｜>' + m.content + '<｜Assistant｜>' }}{{ '<think>' if thinking is defined and thinking else '</think>' }}
{%- elif m.role == 'assistant' -%}
{%- if m.reasoning_content and thinking is defined and thinking %}{{ m.reasoning_content + '</think>' }}{% endif -%}
{{ m.content or '' }}
{%- if m.tool_calls -%}
{{ '<｜tool▁calls▁begin｜>' }}
{%- for tc in m.tool_calls -%}
{{ '<｜tool▁call▁begin｜>' + tc['function']['name'] + '<｜tool▁sep｜>' }}
{{- tc['function']['arguments'] + '<｜tool▁call▁end｜>' }}
{%- endfor -%}
{{ '<｜tool▁calls▁end｜>' }}
{%- endif -%}
{{ '<｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' -%}
{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
{%- endif -%}
{%- endfor -%}"""

# the Qwen3.5 XML call format, for comparison
XML_TEMPLATE = QWEN3_TEMPLATE.replace(
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>',
    '<tool_call>\n<function={{ tc.function.name }}>\n{% for k, v in tc.function.arguments.items() %}'
    '<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>')



def template(name: str) -> ChatTemplate:
    src = {"glm5": GLM5_TEMPLATE, "glm45": GLM45_TEMPLATE, "v31": V31_TEMPLATE, "v4": DEEPSEEK_V4_TEMPLATE,
           "qwen": None, "xml": XML_TEMPLATE}[name]
    return ChatTemplate(src, {"bos_token": BOS, "eos_token": EOS} if name in ("v31", "v4") else {})


def call(name, args, i=0):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


ARGS = {"city": "Paris", "days": 3, "opts": {"units": ["C"], "deep": {"x": None}}, "flag": False, "note": "a < b\nc"}

# (template, parser format, what opens a call, the forced opening of a call to get_weather, the end of a call)
FAMILIES = [
    ("glm5", "glm", "<tool_call>", "<tool_call>get_weather", "</tool_call>"),
    ("glm45", "glm", "<tool_call>", "<tool_call>get_weather", "</tool_call>"),
    ("v4", "dsml", f"<{D}tool_calls>", f'<{D}tool_calls>\n<{D}invoke name="get_weather">', f"</{D}tool_calls>"),
    ("v31", "deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather",
     "<｜tool▁calls▁end｜>"),
    ("qwen", "tool_call", "<tool_call>", '<tool_call>\n{"name": "get_weather"', "</tool_call>"),
    ("xml", "tool_call_xml", "<tool_call>", "<tool_call>\n<function=get_weather>", "</tool_call>"),
]


def test_glm_template_renders_a_tool_history():
    t = template("glm5")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "need a tool",
             "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}), call("now", {}, 1)]},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            {"role": "assistant", "content": "Sunny at noon.", "reasoning_content": "done"},
            {"role": "user", "content": "thanks"}]
    out = t.render(msgs, TOOLS[:1])
    assert out.startswith("[gMASK]<sop><|system|>\n# Tools\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n")
    assert out.endswith(
        "<|system|>Be brief.<|user|>Weather in Paris?<|assistant|></think>Checking.<tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        "<tool_call>now</tool_call><|observation|><tool_response>sunny</tool_response><tool_response>noon"
        "</tool_response><|assistant|></think>Sunny at noon.<|user|>thanks<|assistant|><think>")
    assert t.render(msgs[:2], enable_thinking=False).endswith("<|assistant|></think>")


def test_deepseek_v4_template_renders_a_tool_history(tok):
    t = template("v4")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "need a tool",
             "tool_calls": [call("get_weather", {"city": "Paris", "days": 2}), call("now", {}, 1)]},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            {"role": "user", "content": "And tomorrow?"}]
    out = t.render(msgs, TOOLS[:1])
    assert out.startswith(BOS + "Be brief.\n\n## Tools\n")
    assert json.dumps(TOOLS[0]["function"], ensure_ascii=False) + "\n" in out  # one schema a line
    turns = out[out.index("<｜User｜>"):]
    assert turns == (
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>need a tool</think>\n\n"
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
        f'</{D}parameter>\n<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
        f'<{D}invoke name="now">\n\n</{D}invoke>\n</{D}tool_calls>{EOS}'
        "<｜User｜><tool_result>sunny</tool_result>\n\n<tool_result>noon</tool_result>\n\nAnd tomorrow?"
        "<｜Assistant｜><think>")
    # chat mode closes the thinking in the prompt; without tools, earlier turns' thinking is dropped
    assert t.render(msgs[1:2], thinking=False).endswith("<｜User｜>Weather in Paris?<｜Assistant｜></think>")
    assert t.render(msgs[1:2], enable_thinking=False).endswith("<｜Assistant｜></think>")
    assert t.render(msgs[1:2], thinking_mode="chat").endswith("<｜Assistant｜></think>")
    plain = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r"},
             {"role": "user", "content": "c"}]
    assert t.render(plain) == BOS + "<｜User｜>a<｜Assistant｜></think>b" + EOS + "<｜User｜>c<｜Assistant｜><think>"
    assert t.render(plain, drop_thinking=False) == (BOS + "<｜User｜>a<｜Assistant｜><think>r</think>b" + EOS +
                                                    "<｜User｜>c<｜Assistant｜><think>")
    # the prompt it leaves open is what the server reads as "the model starts inside <think>"
    ctx = SimpleNamespace(tokenizer=tok, serving=SimpleNamespace(max_len=4096))
    assert build_prompt(ctx, t.render(plain), SamplingOptions()).in_reasoning
    assert not build_prompt(ctx, t.render(plain, thinking=False), SamplingOptions()).in_reasoning


def test_deepseek_v4_checkpoint_without_a_template_gets_the_builtin():
    v4 = {"config.json": json.dumps({"model_type": "deepseek_v4"}).encode()}
    tcfg = {"bos_token": {"__type": "AddedToken", "content": BOS}, "eos_token": {"content": EOS}}
    t = ChatTemplate.from_files(v4, tcfg)
    assert t.builtin and t.source == DEEPSEEK_V4_TEMPLATE and t.special == {"bos_token": BOS, "eos_token": EOS}
    assert t.render([{"role": "user", "content": "hi"}]) == BOS + "<｜User｜>hi<｜Assistant｜><think>"
    assert ChatTemplate.from_files(v4, {}).special["bos_token"] == BOS
    own = ChatTemplate.from_files(v4, {**tcfg, "chat_template": "{{ bos_token }}[{{ messages[0].content }}]"})
    assert not own.builtin and own.render([{"role": "user", "content": "hi"}]) == BOS + "[hi]"
    glm = ChatTemplate.from_files({"config.json": b'{"model_type": "glm_moe_dsa"}',
                                   "chat_template.jinja": GLM5_TEMPLATE.encode()}, {})
    assert parser_format(glm) == "glm"
    other = ChatTemplate.from_files({"config.json": b'{"model_type": "qwen3"}'}, {})
    assert other.source == QWEN3_TEMPLATE and parser_format(other) == "tool_call"


def test_tool_arguments_read_as_a_dict_and_as_json_text():
    a = ToolArgs({"city": "Paris", "n": 2})
    assert str(a) == '{"city": "Paris", "n": 2}' and "x" + a == 'x{"city": "Paris", "n": 2}' and a + "!" == str(a) + "!"
    t = ChatTemplate("{% set f = messages[0].tool_calls[0].function %}{{ f.arguments is mapping }}|{{ f.arguments }}|"
                     "{{ '<' + f.arguments + '>' }}|{{ f.arguments | tojson }}|{% for k, v in f.arguments.items() %}"
                     "{{ k }}={{ v }};{% endfor %}")
    msgs = [{"role": "assistant", "content": "", "tool_calls": [call("f", {"city": "Paris", "n": 2})]}]
    assert t.render(msgs) == ('True|{"city": "Paris", "n": 2}|<{"city": "Paris", "n": 2}>|{"city": "Paris", "n": 2}|'
                              "city=Paris;n=2;")
    assert type(msgs[0]["tool_calls"][0]["function"]["arguments"]) is dict  # the caller's messages are kept
    with pytest.raises(FreeTokenError, match="chat template error"):  # a type error is the template's, not a 500
        ChatTemplate("{{ 'a' + messages[0].n }}").render([{"role": "user", "content": "", "n": 1}])


@pytest.mark.parametrize("name,fmt,opener,opening,closer", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_an_assistant_turn_parses_back_to_itself(name, fmt, opener, opening, closer):
    """Render a conversation up to the assistant's turn (the prompt) and with it: what the
    template added is what the model would have written. The parser, in the format the template
    was probed for, reads it back to the turn's thinking, text and calls."""
    t = template(name)
    assert parser_format(t) == fmt
    kw = {"thinking": True} if name == "v31" else {}
    args = dict(ARGS, code="123") if fmt == "dsml" else ARGS  # a number-like string survives DSML's flag
    turn = {"role": "assistant", "content": "Let me check.", "reasoning_content": "need a tool",
            "tool_calls": [call("get_weather", args), call("now", {}, 1)]}
    history = [{"role": "user", "content": "Weather?"}]
    prompt = t.render(history, TOOLS, add_generation_prompt=True, **kw)
    full = t.render(history + [turn], TOOLS, add_generation_prompt=False, **kw)
    assert full.startswith(prompt)
    out = full[len(prompt):].removesuffix(EOS).removesuffix("<|im_end|>\n")  # the end of turn: an EOS token
    reasoning, content, calls = merge(run(fmt, prompt.endswith("<think>"), [out]))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", args), ("now", {})]
    assert content.strip() == "Let me check."
    assert reasoning == "need a tool"  # the prompt opened the thinking (DeepSeek, GLM) or the turn did (Qwen)


# ---- calls held by a grammar, in each model's syntax -----------------------------------------------
@pytest.fixture(scope="module")
def tok(qwen_json):
    return Tokenizer(qwen_json.encode())


@pytest.fixture(scope="module")
def lltok(tok):
    return llg.LLTokenizer(tok.tk.to_str(), n_vocab=tok.vocab_size, eos_token=[tok.token_id("<|endoftext|>")])


@pytest.mark.parametrize("name,fmt,opener,opening,closer", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_probe_reads_each_format(tok, name, fmt, opener, opening, closer):
    ctx = SimpleNamespace(template=template(name), tokenizer=tok)
    f = call_format(ctx.template)
    assert f.opener == opener and f.syntax.close.endswith(closer)
    assert tok.decode(forced_opening(ctx, "get_weather", False).tokens) == opening
    assert tok.decode(forced_opening(ctx, None, False).tokens) == opener
    if name == "glm5":
        assert (f.syntax.param, f.syntax.mid, f.syntax.end_param, f.syntax.close, f.syntax.sep) == (
            "<arg_key>", "</arg_key><arg_value>", "</arg_value>", "</tool_call>", "")
    if name == "glm45":
        assert (f.syntax.param, f.syntax.mid, f.syntax.end_param, f.syntax.close, f.syntax.sep) == (
            "\n<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>", "\n</tool_call>", "\n")
    if name == "v4":
        assert (f.syntax.param, f.syntax.mid, f.syntax.end_param, f.syntax.close, f.flags) == (
            f'\n<{D}parameter name="', ">", f"</{D}parameter>", f"\n</{D}invoke>\n</{D}tool_calls>",
            ('" string="true"', '" string="false"'))
        assert f.gap == "\n\n"


def matcher(lltok, spec, tok):
    m = llg.LLMatcher(lltok, grammar_text(spec, dict(tok.special)), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(lltok, spec, tok, text: str) -> bool:
    m = matcher(lltok, spec, tok)
    ids = tok.encode(text)
    return m.consume_tokens(ids) and m.is_accepting()


CANONICAL = [("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"}),
             ("search", {"query": "cats", "exact": True, "tags": ["a"]}),
             ("search", {"query": "x y", "exact": False})]


@pytest.mark.parametrize("name,fmt,opener,opening,closer", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_grammar_takes_the_templates_own_calls(tok, lltok, name, fmt, opener, opening, closer):
    """Calls written by the template itself fit the grammar of a demanded call (strict schemas),
    and parse back; a call that breaks the format or the schema does not fit."""
    ctx = SimpleNamespace(template=template(name), tokenizer=tok)
    for tool, args in CANONICAL:
        text = template_call(ctx.template, tool, args, opener, closer)
        for demanded in (tool, None):
            spec = call_grammar(ctx, TOOLS, demanded, forced_opening(ctx, demanded, False))
            assert accepts(lltok, spec, tok, text), (demanded, text)
        _, _, calls = merge(run(fmt, False, [text]))
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(tool, args)]
        strict = strict_grammar(ctx, TOOLS, False)
        if opener in tok.special:  # free text, then a call that follows its schema
            assert accepts(lltok, strict, tok, "Sure. " + text) and accepts(lltok, strict, tok, "Sure.")
        else:  # text could not be told from a plain-text opening: no grammar rather than no calls
            assert strict is None
    spec = call_grammar(ctx, TOOLS, "get_weather", forced_opening(ctx, "get_weather", False))
    bad = template_call(ctx.template, "get_weather", {"city": "Paris", "days": 9, "unit": "celsius"}, opener, closer)
    assert not accepts(lltok, spec, tok, bad)  # days > 7
    if fmt == "dsml":  # a JSON value under the string flag, and the other way round
        good = template_call(ctx.template, *CANONICAL[0], opener, closer)
        assert not accepts(lltok, spec, tok, good.replace('"days" string="false"', '"days" string="true"'))
        assert not accepts(lltok, spec, tok, good.replace('"city" string="true"', '"city" string="false"'))


def template_call(t: ChatTemplate, tool: str, args: dict, opener: str, closer: str) -> str:
    """One call as the template writes it in an assistant turn."""
    full = t.render([{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "", "tool_calls": [call(tool, args)]}], TOOLS,
                    add_generation_prompt=False)
    start = full.rindex(opener)
    return full[start:full.index(closer, start) + len(closer)]


@pytest.fixture(scope="module")
def special_tok(tok):
    """The Qwen tokenizer with GLM's argument tags and the call-block openers of DeepSeek V4 and
    V3.1 added as special tokens (as those models' tokenizers may hold them), and its llguidance
    tokenizer: one for the three tests below, as each takes seconds to build. No format's calls
    hold another format's markers, so each test sees its own model's specials as it would alone."""
    marks = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"] + [call_format(template(n)).opener
                                                                          for n in ("v4", "v31")]
    tk = type(tok.tk).from_str(tok.tk.to_str())
    tk.add_special_tokens([AddedToken(s, special=True) for s in marks])
    t = Tokenizer(tk.to_str().encode())
    assert all(m in t.special for m in marks)
    return t, llg.LLTokenizer(t.tk.to_str(), n_vocab=t.vocab_size, eos_token=[t.token_id("<|endoftext|>")])


def test_a_value_closed_by_a_special_token_goes_as_json(tok, special_tok):
    """GLM's tokenizer has <arg_key> ... </arg_value> as special tokens: a raw value could never
    close, so the grammar writes every value as JSON (the parser reads it back the same)."""
    glm_tok, lt = special_tok
    assert "</arg_value>" in glm_tok.special
    ctx = SimpleNamespace(template=template("glm5"), tokenizer=glm_tok)
    spec = call_grammar(ctx, TOOLS, "get_weather", forced_opening(ctx, "get_weather", False))
    props = spec.tools[0].parameters["properties"]
    assert props["city"] == {"anyOf": [{"type": "string", "maxLength": 10}]} and props["days"]["type"] == "integer"
    json_valued = ('<tool_call>get_weather<arg_key>city</arg_key><arg_value>"Paris"</arg_value><arg_key>days</arg_key>'
                   '<arg_value>3</arg_value><arg_key>unit</arg_key><arg_value>"celsius"</arg_value></tool_call>')
    assert accepts(lt, spec, glm_tok, json_valued)
    assert not accepts(lt, spec, glm_tok, json_valued.replace('"Paris"', "Paris"))
    assert merge(run("glm", False, [json_valued]))[2][0].arguments == '{"city": "Paris", "days": 3, "unit": "celsius"}'
    # without those specials (this test's Qwen tokenizer) strings stay raw, as GLM writes them
    plain = call_grammar(SimpleNamespace(template=ctx.template, tokenizer=tok), TOOLS, "get_weather",
                         forced_opening(SimpleNamespace(template=ctx.template, tokenizer=tok), "get_weather", False))
    assert plain.tools[0].parameters["properties"]["city"] == {"type": "string", "maxLength": 10}


@pytest.mark.parametrize("name", ["v4", "v31"])
def test_strict_tools_in_free_text_where_the_opening_is_a_special_token(special_tok, name):
    """DeepSeek's tokenizers may hold the block's opening as one special token: then free text
    can be told from a call, and a strict tool gets its grammar."""
    t = template(name)
    opener = call_format(t).opener
    ds_tok, lt = special_tok
    assert opener in ds_tok.special
    ctx = SimpleNamespace(template=t, tokenizer=ds_tok)
    strict = strict_grammar(ctx, TOOLS, False)
    closer = {"v4": f"</{D}tool_calls>", "v31": "<｜tool▁calls▁end｜>"}[name]
    text = template_call(t, *CANONICAL[0], opener, closer)
    assert accepts(lt, strict, ds_tok, "Sure. " + text) and accepts(lt, strict, ds_tok, "No call.")
    bad = template_call(t, "get_weather", {"city": "Paris", "days": 9, "unit": "celsius"}, opener, closer)
    assert not accepts(lt, strict, ds_tok, "Sure. " + bad)


def test_dsml_flags_follow_how_each_value_is_written(tok):
    ctx = SimpleNamespace(template=template("v4"), tokenizer=tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "number"}, "e": {"enum": ["x", "y"]}, "j": {"enum": ["1", "y"]},
        "p": {"type": "string", "pattern": "^a+$"}}, "required": ["s", "j"]}}}]
    spec = call_grammar(ctx, tools, "f", forced_opening(ctx, "f", False))
    params = spec.tools[0].parameters
    t, f = '" string="true"', '" string="false"'
    assert list(params["properties"]) == ["s" + t, "n" + f, "e" + t, "j" + f, "p" + f]
    assert params["required"] == ["s" + t, "j" + f]
    assert params["properties"]["j" + f] == {"anyOf": [{"enum": ["1", "y"]}]}  # "1" raw would read back as a string
    assert params["properties"]["p" + f] == {"type": "string", "pattern": "^a+$"}  # JSON already


# ---- the engine forcing and holding calls, end to end ---------------------------------------------------
@pytest.fixture(scope="module")
def eng():
    """The demo model (random weights), biased toward closing characters so values end."""
    e = Engine(demo_path(), EngineConfig(device="cpu"))
    bias = torch.zeros(e.cfg.vocab_size)
    for text, i in e.tokenizer.tk.get_vocab().items():
        if '"' in text:
            bias[i] = 12.0
        elif any(c in text for c in ",}]<"):
            bias[i] = 8.0
    close = e.tokenizer.token_id("</think>")
    bias[close] = 40.0  # the random model closes its thinking at once

    def biased(f):
        def g(*a, **k):
            out = f(*a, **k)
            if isinstance(out, tuple):
                return tuple(None if o is None else o + bias for o in out)
            return None if out is None else out + bias
        return g
    e.forward_mixed, e.prefill_batch = biased(e.forward_mixed), biased(e.prefill_batch)
    e.biased = biased
    return e


def drive(eng, reqs, limit=3000):
    srv = ServingEngine(eng, max_batch=len(reqs), max_queue=64, start=False)
    srv.decode = eng.biased(srv.decode)
    for r in reqs:
        srv.sched.add(r)
    steps = 0
    while any(r.finished_at is None for r in reqs):
        srv.step()
        steps += 1
        assert steps < limit
    return reqs


@pytest.mark.parametrize("name", ["glm5", "v4", "v31"])
def test_forced_calls_in_the_models_own_syntax_parse_back(eng, name):
    ctx = SimpleNamespace(template=template(name), tokenizer=eng.tokenizer)
    fmt = parser_format(ctx.template)
    prompt = eng.tokenizer.encode(ctx.template.render([{"role": "user", "content": "Weather in Paris?"}], TOOLS,
                                                      add_generation_prompt=True, enable_thinking=False))
    cases = [("get_weather", False), ("search", False), (None, False), ("get_weather", True), (None, True)]
    reqs = []
    for i, (tool, think) in enumerate(cases):
        f = forced_opening(ctx, tool, think)
        s = SamplingOptions(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=160, forced=f.tokens,
                            forced_after=f.after, grammar=call_grammar(ctx, TOOLS, tool, f))
        reqs.append(Request(prompt + (eng.tokenizer.encode("<think>\n") if think else []), s))
    drive(eng, reqs)
    closer = {"glm5": "</tool_call>", "v4": f"</{D}tool_calls>", "v31": "<｜tool▁calls▁end｜>"}[name]
    for (tool, think), r in zip(cases, reqs):
        text = eng.tokenizer.decode(r.output_ids)
        p = OutputParser(in_reasoning=think, tools=True, fmt=fmt)
        _, content, calls = merge(p.feed(text) + p.finish())
        assert r.finish_reason == "stop" and len(calls) == 1 and not content.strip(), (r.finish_reason, text)
        assert calls[0].name == (tool or calls[0].name) and calls[0].name in SCHEMAS
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
        assert text.rstrip().endswith(closer), text

