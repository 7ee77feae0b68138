"""Structured output: grammar-constrained decoding (runtime.grammar, llguidance) on the demo
model (random weights, the real 248k-token Qwen tokenizer and chat template).

The in-process tests drive a ServingEngine step by step. The demo model is random: left alone
it never closes an unbounded string (nor an array, nor a number's digits), so every row's logits
get one fixed bias toward the tokens that hold a closing character (`"` most, `,` `}` `]`),
added to the forward's output before the engine masks it; constrained and unconstrained rows
alike, so the two runs compared below see the same model. The grammar alone decides what is
allowed; the bias only makes documents end within max_tokens.
"""
import json
import random
from types import SimpleNamespace

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from freetoken.demo import demo_path
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.grammar import GrammarError, GrammarRunner, check, grammar_text
from freetoken.runtime.request import CallSyntax, GrammarSpec, Request, SamplingOptions, ToolSchema
from freetoken.runtime.sampler import greedy_rows, sample, SamplingParams
from freetoken.runtime.serving import ServingEngine
from freetoken.server.common import ApiError, grammar_for
from freetoken.server.parser import OutputParser, merge
from freetoken.server.template import ChatTemplate, QWEN3_TEMPLATE
from freetoken.server.tool_choice import call_grammar, forced_opening, strict_grammar
from freetoken.tokenizer import load_json
from server_fixture import API_KEY, MODEL

# the Qwen3.5 / Qwen3-Coder call format, parameters included
XML_TEMPLATE = QWEN3_TEMPLATE.replace(
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>',
    '<tool_call>\n<function={{ tc.function.name }}>\n{% for k, v in tc.function.arguments.items() %}'
    '<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>')


# ---- random schemas ------------------------------------------------------------------------------
def gen_value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string"}
        if rng.random() < 0.5:
            s["maxLength"] = rng.randint(1, 12)
        return s
    if k == "integer":
        s = {"type": "integer"}
        if rng.random() < 0.4:
            s.update(minimum=-50, maximum=rng.randint(0, 1000))
        return s
    if k == "number":
        return {"type": "number"}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "1", "déjà vu"], rng.randint(1, 4))}
    if k == "array":
        s = {"type": "array", "items": gen_value(rng, depth + 1), "maxItems": rng.randint(1, 3)}
        if rng.random() < 0.3:
            s["minItems"] = 1
        return s
    return gen_object(rng, depth + 1)


def gen_object(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, required fields, numbers, booleans, strings with and
    without maxLength (arrays get maxItems: the random model would never end one)."""
    props = {f"f{i}_{rng.choice(['a', 'id', 'name', 'value'])}": gen_value(rng, depth)
             for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": [k for k in props if rng.random() < 0.7],
            "additionalProperties": False}


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eng():
    e = Engine(demo_path(), EngineConfig(device="cpu"))
    bias = torch.zeros(e.cfg.vocab_size)
    for text, i in e.tokenizer.tk.get_vocab().items():  # byte-level BPE: these characters appear as is
        if '"' in text:
            bias[i] = 12.0
        elif any(c in text for c in ",}]"):
            bias[i] = 8.0

    def biased(f):
        def g(*a, **k):
            out = f(*a, **k)
            if isinstance(out, tuple):
                return tuple(None if o is None else o + bias for o in out)
            return None if out is None else out + bias
        return g
    e.forward_mixed, e.prefill_batch = biased(e.forward_mixed), biased(e.prefill_batch)
    e.biased, e.bias = biased, bias
    return e


@pytest.fixture()
def closes_thinking(eng):
    """The random model thinks forever: here it closes its thinking at once (a bias on </think>)."""
    close = eng.tokenizer.token_id("</think>")
    eng.bias[close] = 40.0
    yield close
    eng.bias[close] = 0.0


def serving(eng, batch: int, **kw) -> ServingEngine:
    srv = ServingEngine(eng, max_batch=batch, max_queue=256, start=False, **kw)
    srv.decode = eng.biased(srv.decode)
    return srv


def drive(srv, reqs, limit=2000):
    for r in reqs:
        srv.sched.add(r)
    steps = 0
    while any(r.finished_at is None for r in reqs):
        srv.step()
        steps += 1
        assert steps < limit
    return reqs


@pytest.fixture(scope="module")
def template(eng):
    files = eng.files
    return ChatTemplate.from_files(files, load_json(files.get("tokenizer_config.json"), "tokenizer_config.json"))


def chat_prompt(eng, template, text: str, tools=None) -> list[int]:
    return eng.tokenizer.encode(template.render([{"role": "user", "content": text}], tools, add_generation_prompt=True))


# ---- the API contract -----------------------------------------------------------------------------
def test_grammar_for_validates_response_format():
    assert grammar_for(None) is None and grammar_for({"type": "text"}) is None
    assert grammar_for({"type": "json_object"}) == GrammarSpec("json_object")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = grammar_for({"type": "json_schema", "json_schema": {"name": "x-1", "schema": schema, "strict": True}})
    assert spec.kind == "json_schema" and spec.schema == schema and spec.strict and spec.after is None
    assert grammar_for({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).strict is False
    bad = [("json", "must be an object"), ({"type": "xml"}, "type must be"),
           ({"type": "json_schema"}, "json_schema must"),
           ({"type": "json_schema", "json_schema": {"schema": schema}}, "name"),
           ({"type": "json_schema", "json_schema": {"name": "a b", "schema": schema}}, "name"),
           ({"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}, "schema must"),
           ({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": "yes"}}, "strict"),
           ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strang"}}}, "cannot be enforced")]
    for fmt, needle in bad:
        with pytest.raises(ApiError) as e:
            grammar_for(fmt)
        assert e.value.status == 400 and e.value.param == "response_format" and needle in e.value.message, fmt
    with pytest.raises(ApiError) as e:  # the Responses API names its own field
        grammar_for({"type": "yaml"}, "text.format")
    assert e.value.param == "text.format" and "text.format.type" in e.value.message


def test_grammar_specs_compile_or_say_why():
    check(GrammarSpec("regex", pattern=r"[a-z]{3}\d"))
    with pytest.raises(GrammarError):
        check(GrammarSpec("regex", pattern="(unclosed"))
    with pytest.raises(GrammarError):
        check(GrammarSpec("nonsense"))
    # tool-call syntax names the tokenizer's special tokens as tokens (llguidance never matches them as text)
    xml = CallSyntax("xml", "<tool_call>\n<function=", ">", "\n</function>\n</tool_call>", param="\n<parameter=",
                     mid=">\n", end_param="\n</parameter>")
    tool = ToolSchema("f", {"type": "object", "properties": {"x": {"type": "string"}}})
    spec = GrammarSpec("tool_call", tools=(tool,), syntax=xml)
    text = grammar_text(spec, {"<tool_call>": 248058, "</tool_call>": 248059})
    assert "<[248058]>" in text and "<[248059]>" in text and "<parameter=x>" in text
    check(spec, {"<tool_call>": 248058, "</tool_call>": 248059})


# ---- the engine -----------------------------------------------------------------------------------
def test_masking_touches_only_constrained_rows_and_keeps_model_logprobs(eng):
    g = GrammarRunner(eng.tokenizer, eng.cfg.vocab_size, eng.eos_ids, torch.device("cpu"))
    req = Request([1, 2, 3], SamplingOptions(grammar=GrammarSpec("json_object")))
    g.begin(req)
    logits = torch.randn(4, eng.cfg.vocab_size)
    raw = logits.clone()
    lse = g.apply(logits, [(req.grammar, 2)])
    assert torch.equal(logits[[0, 1, 3]], raw[[0, 1, 3]])  # unconstrained rows: not a bit changed
    allowed = torch.isfinite(logits[2])
    assert 0 < int(allowed.sum()) < 1000 and torch.equal(logits[2][allowed], raw[2][allowed])
    brace = eng.tokenizer.encode("{")[0]
    assert allowed[brace] and not allowed[eng.tokenizer.encode("hello")[0]]
    assert float(lse[0]) == pytest.approx(float(torch.logsumexp(raw[2], -1)), abs=1e-4)
    # picks come from the masked row; their log-probabilities are the model's
    (t0, lp0, _), (t2, lp2, tops2) = greedy_rows(logits, [0, 2], 5, lse, [1])
    assert greedy_rows(logits, [2], 5, lse, [0])[0] == (t2, lp2, tops2)
    ref = torch.log_softmax(raw, -1)
    assert t0 == int(raw[0].argmax()) and lp0 == pytest.approx(float(ref[0, t0]), abs=1e-5)
    assert allowed[t2] and lp2 == pytest.approx(float(ref[2, t2]), abs=1e-5)
    assert all(allowed[i] and v == pytest.approx(float(ref[2, i]), abs=1e-5) for i, v in tops2)
    tok, lp, tops = sample(logits[2], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0), 3,
                           float(lse[0]))
    assert allowed[tok] and lp == pytest.approx(float(ref[2, tok]), abs=1e-5)
    assert g.accept(req, brace) is False  # '{' opens the object; the grammar goes on
    g.release(req)
    g.close()


def test_random_schemas_validate_and_free_rows_are_untouched(eng, template, monkeypatch):
    """48 random schemas (each kind of value, nested objects and arrays among them many times
    over), decoded in batches of 16 (continuous batching: three times more constrained requests
    than rows), greedy and sampled: every response parses and validates. Free greedy requests
    decoded in the same batches produce exactly the tokens they produce without constrained
    neighbours."""
    # batch composition is the subject: every forward on torch's GEMMs (alone, a free row's decode
    # GEMMs would take the CPU's C++ rows kernel, beside prompt chunks torch's; it has its own tests)
    from freetoken.experts import cpu
    monkeypatch.setattr(cpu, "DECODE_KERNELS", False)
    rng = random.Random(1234)
    schemas = [gen_object(rng) for _ in range(48)]
    prompt = chat_prompt(eng, template, "Answer in JSON.")
    free_prompts = [chat_prompt(eng, template, t) for t in ("Hello", "Tell me a story", "Why?")]

    def free():
        return [Request(p, SamplingOptions(temperature=0, max_tokens=24, ignore_eos=True, top_logprobs=2))
                for p in free_prompts]
    alone = drive(serving(eng, 16), free())
    srv = serving(eng, 16)
    cons = [Request(prompt, SamplingOptions(temperature=0 if i % 3 else 0.7, seed=i, max_tokens=256,
                                            grammar=GrammarSpec("json_schema", schema=s, strict=True)))
            for i, s in enumerate(schemas)]
    cons += [Request(prompt, SamplingOptions(temperature=0.7, seed=i, max_tokens=256,
                                             grammar=GrammarSpec("json_object"))) for i in range(4)]
    mixed = free()
    drive(srv, mixed[:2] + cons[:30] + mixed[2:] + cons[30:])
    for a, b in zip(alone, mixed):
        assert b.output_ids == a.output_ids and b.finish_reason == "length"
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        assert [[i for i, _ in t] for t in b.top_logprobs] == [[i for i, _ in t] for t in a.top_logprobs]
    for r, s in zip(cons, schemas + [{"type": "object"}] * 4):
        text = eng.tokenizer.decode(r.output_ids)
        assert r.finish_reason == "stop" and r.error is None, (r.finish_reason, r.error, text)
        jsonschema.validate(json.loads(text), s)
        assert all(lp <= 0 and lp > float("-inf") for lp in r.logprobs)
    stats = srv.grammar.stats
    tokens = sum(len(r.output_ids) for r in cons)  # each one picked from a mask
    assert stats["compiles"] >= len(schemas) and stats["masks"] >= tokens > 500
    assert stats["sync_masks"] == 0  # all prefetched


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 8},
                                         "exact": {"type": "boolean"},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["query", "exact"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def calls_of(eng, req, in_reasoning=False):
    parser = OutputParser(in_reasoning=in_reasoning, tools=True)
    events = parser.feed(eng.tokenizer.decode(req.output_ids)) + parser.finish()
    return merge(events)


@pytest.mark.parametrize("tpl", [None, XML_TEMPLATE], ids=["json-calls", "xml-calls"])
def test_forced_tool_calls_follow_strict_schemas(eng, tpl, closes_thinking):
    ctx = SimpleNamespace(template=ChatTemplate(tpl), tokenizer=eng.tokenizer)
    prompt = eng.tokenizer.encode(ctx.template.render([{"role": "user", "content": "Weather in Paris?"}], TOOLS,
                                                      add_generation_prompt=True))
    cases = [("get_weather", False), ("search", False), (None, False), ("get_weather", True), (None, True)]
    reqs = []
    for i, (name, think) in enumerate(cases):
        f = forced_opening(ctx, name, think)  # thinking: the forcing and the grammar wait for </think>
        assert (f.after == closes_thinking) == think
        s = SamplingOptions(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=120, forced=f.tokens,
                            forced_after=f.after, grammar=call_grammar(ctx, TOOLS, name, f))
        reqs.append(Request(prompt + (eng.tokenizer.encode("<think>\n") if think else []), s))
    drive(serving(eng, 8), reqs)
    for (name, think), r in zip(cases, reqs):
        _, content, calls, = calls_of(eng, r, think)
        text = eng.tokenizer.decode(r.output_ids)
        assert r.finish_reason == "stop" and len(calls) == 1 and not content.strip(), text
        assert calls[0].name == (name or calls[0].name) and calls[0].name in SCHEMAS
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
        assert text.rstrip().endswith("</tool_call>")


def test_strict_tools_without_a_demanded_call(eng, template):
    """tool_choice auto with a strict tool: free text, and a call that opens follows its schema
    (here the call is opened by forced tokens, as the model might write it)."""
    ctx = SimpleNamespace(template=template, tokenizer=eng.tokenizer)
    spec = strict_grammar(ctx, TOOLS, in_reasoning=False)
    assert spec.kind == "tool_call" and spec.text and strict_grammar(ctx, [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}], False) is None
    prompt = chat_prompt(eng, template, "Weather?", TOOLS)
    opened = eng.tokenizer.encode('Sure.<tool_call>\n{"name": "search", "arguments": ')
    reqs = [Request(prompt, SamplingOptions(temperature=0, max_tokens=60, forced=opened, grammar=spec)),
            Request(prompt, SamplingOptions(temperature=0.8, seed=3, max_tokens=12, grammar=spec))]
    drive(serving(eng, 2), reqs)
    _, content, calls = calls_of(eng, reqs[0])
    assert content.startswith("Sure.") and calls and calls[0].name == "search"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["search"])
    assert reqs[1].finish_reason in ("length", "stop") and reqs[1].error is None


def test_the_format_holds_after_thinking(eng, template, closes_thinking):
    """A prompt that leaves the model thinking: the format applies from </think> on."""
    from freetoken.server.common import constrain
    ctx = SimpleNamespace(tokenizer=eng.tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    s = SamplingOptions(temperature=0, max_tokens=40)
    constrain(ctx, s, grammar_for({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}), True)
    assert s.grammar.after == closes_thinking
    r = drive(serving(eng, 1), [Request(chat_prompt(eng, template, "Think, then answer.") +
                                        eng.tokenizer.encode("<think>\n"), s)])[0]
    reasoning, content, _ = calls_of(eng, r, True)
    assert r.finish_reason == "stop" and r.output_ids[0] == closes_thinking
    jsonschema.validate(json.loads(content), schema)


def test_a_forced_token_outside_the_grammar_fails_the_request_only(eng, template):
    prompt = chat_prompt(eng, template, "JSON")
    bad = Request(prompt, SamplingOptions(temperature=0, max_tokens=8, forced=eng.tokenizer.encode("nope"),
                                          grammar=GrammarSpec("json_object")))
    ok = Request(prompt, SamplingOptions(temperature=0, max_tokens=4, ignore_eos=True))
    drive(serving(eng, 2), [bad, ok])
    assert bad.finish_reason == "error" and "does not fit the grammar" in bad.error
    assert ok.finish_reason == "length" and len(ok.output_ids) == 4


# ---- over HTTP, with the SDKs ------------------------------------------------------------------------
# schemas whose every value is bounded: the demo model (no bias over HTTP) ends them within max_tokens
BOUNDED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
           "required": ["ok", "color", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(api_server):
    """conftest's server, shared with test_server: --api-key API_KEY, --max-batch 4,
    --max-seq-len 2048 as these tests want (its --max-queue 4 is more than they queue)."""
    return api_server


def test_http_structured_output(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Describe the sky."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "sky", "schema": BOUNDED, "strict": True}}
    r = oai.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, max_tokens=80, temperature=0.9,
                                    seed=1, logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), BOUNDED)
    assert all(e.logprob <= 0 for e in c.logprobs.content)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=msgs, response_format=fmt, max_tokens=80,
                                              temperature=0, stream=True))
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)), BOUNDED)
    done = oai.completions.create(model=MODEL, prompt="JSON:", max_tokens=80, temperature=0,
                                  extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), BOUNDED)
    # a forced call with a strict schema: arguments that validate, and the call closes
    tool = {"type": "function", "function": {"name": "paint", "strict": True, "parameters": BOUNDED}}
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[tool], max_tokens=80, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "paint"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "paint"
    jsonschema.validate(json.loads(call.function.arguments), BOUNDED)
    for bad in ({"type": "json_schema"}, {"type": "yaml"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, response_format=bad, max_tokens=4)
        assert "response_format" in str(e.value)
    bad_tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, tools=[bad_tool], max_tokens=4)
    assert "cannot be enforced" in str(e.value)


def test_http_anthropic_structured_output(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Paint it."}]
    tools = [{"name": "paint", "description": "paint", "input_schema": BOUNDED}]
    a = claude.messages.create(model=MODEL, max_tokens=80, messages=msgs, tools=tools,
                               tool_choice={"type": "tool", "name": "paint"})
    uses = [b for b in a.content if b.type == "tool_use"]
    assert a.stop_reason == "tool_use" and uses and uses[0].name == "paint"
    jsonschema.validate(uses[0].input, BOUNDED)
    a = claude.messages.create(model=MODEL, max_tokens=80, messages=msgs,
                               output_config={"format": {"type": "json_schema", "schema": BOUNDED}})
    jsonschema.validate(json.loads("".join(b.text for b in a.content if b.type == "text")), BOUNDED)
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": msgs, "output_config": {"format": {"type": "json_object"}}})
    assert r.status_code == 400 and "output_config.format" in r.json()["error"]["message"]
