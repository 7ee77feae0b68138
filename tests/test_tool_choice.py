"""tool_choice "required"/"any" and named tools: parsing, the opening probed from the chat
template (JSON and XML call formats, thinking kept), and the engine emitting forced tokens."""
from types import SimpleNamespace

import pytest
import torch

import hf_models
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.server.common import ApiError
from freetoken.server.template import QWEN3_TEMPLATE, ChatTemplate
from freetoken.server.tool_choice import forced_opening, wanted
from freetoken.tokenizer import Tokenizer
from freetoken.weights.convert import convert

# the Qwen3.5/3.6 call format, as their templates write it
XML_TEMPLATE = QWEN3_TEMPLATE.replace(
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>',
    '<tool_call>\n<function={{ tc.function.name }}>\n</function>\n</tool_call>')


@pytest.fixture(scope="module")
def tokenizer(qwen_json):
    return Tokenizer(qwen_json.encode())


def ctx_for(template, tokenizer):
    return SimpleNamespace(template=ChatTemplate(template), tokenizer=tokenizer)


def test_wanted_parses_both_apis():
    names = ["get_weather", "run"]
    assert wanted("auto", names, "openai") == (False, None)
    assert wanted("none", names, "openai") == (False, None)
    assert wanted("required", names, "openai") == (True, None)
    assert wanted({"type": "function", "function": {"name": "run"}}, names, "openai") == (True, "run")
    assert wanted({"type": "auto"}, names, "anthropic") == (False, None)
    assert wanted({"type": "any"}, names, "anthropic") == (True, None)
    assert wanted({"type": "tool", "name": "get_weather"}, names, "anthropic") == (True, "get_weather")
    with pytest.raises(ApiError, match="not among the tools"):
        wanted({"type": "function", "function": {"name": "nope"}}, names, "openai")
    with pytest.raises(ApiError, match="not among the tools"):
        wanted({"type": "tool", "name": "nope"}, names, "anthropic")
    with pytest.raises(ApiError):
        wanted("sometimes", names, "openai")


@pytest.mark.parametrize("template,name,opening", [
    (None, "get_weather", '<tool_call>\n{"name": "get_weather"'),
    (None, None, "<tool_call>"),
    (XML_TEMPLATE, "run", "<tool_call>\n<function=run>"),
])
def test_opening_follows_the_template(tokenizer, template, name, opening):
    f = forced_opening(ctx_for(template, tokenizer), name, in_reasoning=False)
    assert f.after is None
    assert tokenizer.decode(f.tokens) == opening


def test_opening_waits_for_the_end_of_thinking(tokenizer):
    f = forced_opening(ctx_for(None, tokenizer), "run", in_reasoning=True)
    assert f.after == tokenizer.token_id("</think>")
    assert tokenizer.decode(f.tokens) == '\n\n<tool_call>\n{"name": "run"'


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("tc")
    hf_models.save(hf_models.qwen3_5(41, num_hidden_layers=2, max_position_embeddings=256), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))


def generate(eng, prompt, n, **forced):
    srv = ServingEngine(eng, max_batch=1, max_queue=2, record_logits=True, start=False)
    req = Request(prompt, SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True, **forced))
    srv.sched.add(req)
    while req.finished_at is None:
        srv.step()
    return req


def test_engine_emits_forced_tokens_after_the_trigger(engine):
    prompt = torch.randint(5, engine.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    free = generate(engine, prompt, 6)
    forced = [7, 8, 9]
    now = generate(engine, prompt, 6, forced=forced)
    assert now.output_ids[:3] == forced
    later = generate(engine, prompt, 6, forced=forced, forced_after=free.output_ids[1])
    assert later.output_ids[:2] == free.output_ids[:2]  # sampled as before, up to the trigger
    assert later.output_ids[2:5] == forced
    for req in (now, later):  # forced tokens report their log-probability under the model
        for i, (tok, lp) in enumerate(zip(req.output_ids, req.logprobs)):
            assert abs(lp - float(torch.log_softmax(req.logits[i], -1)[tok])) < 1e-5
