"""`ft serve` driven by the official openai and anthropic SDKs (and raw HTTP for bad input)."""
import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from server_fixture import API_KEY, API_SERVER_ARGS, MODEL, Server

CTX = 2048


@pytest.fixture(scope="module")
def server(api_server):
    """`ft serve --api-key API_KEY --max-batch 4 --max-queue 4 --max-seq-len 2048`: conftest's,
    shared with test_structured_output (this module, first in the run, sees it fresh)."""
    assert API_SERVER_ARGS == ("--api-key", API_KEY, "--max-batch", "4", "--max-queue", "4", "--max-seq-len", str(CTX))
    return api_server


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path, body, key=API_KEY, raw=None, **headers):
    h = {"authorization": f"Bearer {key}"} if key else {}
    h.update(headers)
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body),
                      headers={"content-type": "application/json", **h}, timeout=120)


USER = [{"role": "user", "content": "Say hello."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def reference():
    """The demo model in this process: the reference the server's answers are checked against
    (Engine.generate and one all-logits prefill, apart from the serving loop)."""
    from freetoken.demo import demo_path
    from freetoken.runtime.engine import Engine, EngineConfig
    return Engine(demo_path(), EngineConfig(device="cpu", dtype="float32", verify=False))


def render_ids(eng, messages, tools=None) -> list[int]:
    """Prompt ids as the model's own chat template renders messages (already in the
    template's shape: arguments as dicts, content as strings)."""
    from freetoken.server.template import ChatTemplate
    from freetoken.tokenizer import load_json
    tpl = ChatTemplate.from_files(eng.files, load_json(eng.files.get("tokenizer_config.json"), "tokenizer_config.json"))
    return eng.tokenizer.encode(tpl.render(messages, tools, add_generation_prompt=True))


def reference_logprobs(eng, prompt: list[int], n: int):
    """Greedy continuation of prompt by the reference: (ids, their logprobs, [n, V] log-softmax
    of every output position from one prefill of prompt + ids)."""
    from freetoken.runtime.sampler import SamplingParams
    gen = eng.generate(prompt, n, SamplingParams(temperature=0), stop_at_eos=False)
    st = eng.new_state(len(prompt) + n)
    logits = eng.prefill(prompt + gen.token_ids[:-1], st, all_logits=True)[len(prompt) - 1:]
    return gen.token_ids, gen.logprobs, torch.log_softmax(logits.float(), -1)


def spelled(eng, tid: int, token: str) -> bool:
    """token is how OpenAI spells tid: its text, or bytes:\\xNN.. for part of a character."""
    text = eng.tokenizer.decode([tid])
    return token == text if "\ufffd" not in text else token.startswith("bytes:\\x")


# ---------------------------------------------------------------- OpenAI
def test_startup_prints_url_and_model(server):
    out = server.output()
    assert f"http://127.0.0.1:{server.port}/v1" in out and MODEL in out


def test_models(oai, claude):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    # the Anthropic SDK (anthropic-version header) gets its own shape on the same routes
    page = claude.models.list()
    assert [(m.type, m.id) for m in page.data] == [("model", MODEL)] and page.has_more is False
    assert page.first_id == page.last_id == MODEL
    m = claude.models.retrieve(MODEL)
    assert m.display_name == MODEL and m.created_at.year >= 2025
    with pytest.raises(anthropic.NotFoundError):
        claude.models.retrieve("claude-opus-4")


def test_chat_non_streaming(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 5 and r.usage.prompt_tokens_details.cached_tokens == 0  # first chat request


def test_template_kwargs_the_renderer_owns_are_dropped(oai):
    """chat_template_kwargs may not override what the renderer sets itself (it was a 500)."""
    plain = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0)
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0,
                                    extra_body={"chat_template_kwargs": {"add_generation_prompt": False,
                                                                         "bos_token": "x", "eos_token": "y"}})
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens


def test_chat_streaming_with_usage(oai):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=USER, max_completion_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # the same request without streaming gives the same text (greedy)
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    assert r.choices[0].message.content == text


def test_tools_and_tool_call_history(oai, reference):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_2", "type": "function",
                                                                "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "cloudy"}]},
            {"role": "user", "content": "And tomorrow?"}, {"role": "user", "content": "Be brief."}]
    # the same history as the template takes it: arguments parsed, content parts joined
    as_template = [msgs[0], msgs[1],
                   {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   msgs[3],
                   {"role": "assistant", "content": "", "tool_calls": [{"id": "call_2", "type": "function",
                                                                       "function": {"name": "get_weather", "arguments": {}}}]},
                   {"role": "tool", "tool_call_id": "call_2", "content": "cloudy"}, msgs[6], msgs[7]]
    with_tools = render_ids(reference, as_template, TOOLS)
    text = reference.tokenizer.decode(with_tools)
    assert text.count("<tool_response>") == 2 and "sunny, 21C" in text and "cloudy" in text
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in text
    for choice in ("auto", "none", "required"):
        r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=4,
                                        temperature=0, logprobs=True)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        # 'none' renders without the tools; the others with them
        expected = render_ids(reference, as_template) if choice == "none" else with_tools
        assert r.usage.prompt_tokens == len(expected), choice
        if choice == "auto":
            # the same ids sent raw continue exactly alike: the server rendered what the template renders
            raw = oai.completions.create(model=MODEL, prompt=expected, max_tokens=4, temperature=0, logprobs=0)
            chat = r.choices[0].logprobs.content
            assert [e.token for e in chat] == raw.choices[0].logprobs.tokens
            assert [e.logprob for e in chat] == pytest.approx(raw.choices[0].logprobs.token_logprobs, abs=1e-3)


def test_seeded_sampling_is_reproducible(oai):
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=0.9, top_p=0.95, seed=1234)
    a = oai.chat.completions.create(**kw).choices[0].message.content
    b = oai.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_stop_strings(oai):
    full = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full[:full.find(stop)]
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    s = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == cut


def test_completions(oai):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 5
    ids = oai.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_streamed_choices(oai, server):
    """stream with n > 1 (and /v1/completions with a list of prompts): every choice's chunks as
    they come, each tagged with its index (prompt * n + choice); joined per index, each equals
    the same request without stream; a role chunk and one finish chunk per choice; the usage
    chunk counts the prompt once per prompt; then [DONE]."""
    kw = dict(model=MODEL, messages=USER, max_tokens=6, temperature=1.0, seed=5, n=3)
    whole = oai.chat.completions.create(**kw)
    texts, finishes, usage = {}, {}, None
    for c in oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason is not None:
                finishes[ch.index] = finishes.get(ch.index, []) + [ch.finish_reason]
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert len(set(texts.values())) > 1  # seeds 5, 6, 7: the choices differ, so each index is checked
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    raw = post(server, "/v1/chat/completions", {**kw, "stream": True}).text  # the wire: a role chunk a choice, [DONE]
    chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1, 2] and raw.rstrip().endswith("data: [DONE]")
    prompts = ["Once upon a time", "The weather"]
    ckw = dict(model=MODEL, prompt=prompts, max_tokens=4, temperature=1.0, seed=9, n=2, echo=True)
    batch = oai.completions.create(**ckw)
    got, usage = {}, None
    for c in oai.completions.create(**ckw, stream=True, stream_options={"include_usage": True}):
        usage = c.usage or usage
        for ch in c.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert got == {c.index: c.text for c in batch.choices} and len(got) == 4
    assert all(got[i].startswith(prompts[i // 2]) for i in range(4)) and got[0] != got[1]  # seeds 9, 10
    assert (usage.prompt_tokens, usage.completion_tokens) == (batch.usage.prompt_tokens, batch.usage.completion_tokens)


def test_n_choices_and_prompt_lists(oai, server):
    """n > 1: choices sampled from one prompt, each its own request (greedy: n equal texts;
    seeded: choice i takes seed + i, so each equals a single request with that seed); the prompt
    is counted once in usage. /v1/completions takes a list of prompts: index = prompt * n +
    choice, each equal to that prompt alone."""
    one = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0)
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.message.content for c in r.choices} == {one.choices[0].message.content}
    assert r.usage.prompt_tokens == one.usage.prompt_tokens and r.usage.completion_tokens == 15
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0)
    seeded = oai.chat.completions.create(**kw, seed=77, n=2)
    alone = [oai.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (77, 78)]
    assert [c.message.content for c in seeded.choices] == alone and alone[0] != alone[1]
    prompts = ["Once upon a time", "The weather"]
    batch = oai.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    single = [oai.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0).choices[0].text
              for p in prompts]
    assert [(c.index, c.text) for c in batch.choices] == [(0, single[0]), (1, single[0]), (2, single[1]),
                                                          (3, single[1])]
    assert batch.usage.completion_tokens == 16
    ids = oai.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    for body, needle in [({"prompt": ["x"] * 17}, "at most 16 prompts"), ({"prompt": [["x"]]}, "each prompt"),
                         ({"prompt": []}, "prompt must be")]:
        bad = post(server, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
        assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text
    # more choices than the server admits (--max-batch 4, --max-queue 4): a 429, the choices
    # already started are cancelled, and the server keeps serving
    full = post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 50, "n": 16})
    assert full.status_code == 429, full.text
    for _ in range(50):  # the cancelled choices leave the batch at the engine's next step
        after = post(server, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 5,
                                                      "temperature": 0, "n": 4})
        if after.status_code != 429:
            break
        time.sleep(0.2)
    assert after.status_code == 200, after.text
    assert [c["message"]["content"] for c in after.json()["choices"]] == [one.choices[0].message.content] * 4


def test_chat_logprobs_match_the_model(oai, reference):
    """logprobs.content: one entry per output token, spelled and valued as the reference model
    has them, with the N most likely alternatives, most likely first; greedy picks the top one."""
    n, k = 8, 5
    kw = dict(model=MODEL, messages=USER, max_tokens=n, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    r = oai.chat.completions.create(top_logprobs=k, **kw)
    entries = r.choices[0].logprobs.content
    prompt = render_ids(reference, USER)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(entries) == n
    ids, lps, ref = reference_logprobs(reference, prompt, n)
    for e, tid, lp, row in zip(entries, ids, lps, ref):
        assert spelled(reference, tid, e.token), (tid, e.token)
        assert e.logprob <= 0 and e.logprob == pytest.approx(lp, abs=1e-3)
        assert len(e.top_logprobs) == k
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)  # greedy
        best = row.topk(k)
        assert all(spelled(reference, i, t.token) for i, t in zip(best.indices.tolist(), e.top_logprobs))
        assert values == pytest.approx(best.values.tolist(), abs=1e-3)
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)
    message = r.choices[0].message
    assert bytes(b for e in entries for b in e.bytes).decode() == (getattr(message, "reasoning_content", None) or "") + message.content
    # without top_logprobs: the same tokens and values, no alternatives
    plain = oai.chat.completions.create(**kw).choices[0].logprobs.content
    assert [(e.token, e.top_logprobs) for e in plain] == [(e.token, []) for e in entries]
    assert [e.logprob for e in plain] == pytest.approx([e.logprob for e in entries], abs=1e-3)
    # streamed: every token comes with the chunk that carries its text (or a later one)
    chunks = list(oai.chat.completions.create(top_logprobs=k, stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, len(e.top_logprobs)) for e in streamed] == [(e.token, k) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-3)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content


def test_completions_logprobs_match_the_model(oai, reference):
    """Legacy logprobs: tokens, token_logprobs, top_logprobs (the N most likely and the chosen
    one, token -> logprob) and text_offset, against the reference model."""
    n, k = 8, 3
    prompt = reference.tokenizer.encode("The capital of France is")
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=n, temperature=0, logprobs=k,
              extra_body={"ignore_eos": True})
    r = oai.completions.create(**kw)
    lp = r.choices[0].logprobs
    ids, lps, ref = reference_logprobs(reference, prompt, n)
    assert r.choices[0].text == reference.tokenizer.decode(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for i, (tok, value, top, tid, ref_lp, row) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                                ids, lps, ref)):
        assert spelled(reference, tid, tok) and value <= 0 and value == pytest.approx(ref_lp, abs=1e-3)
        best = row.topk(k)
        assert len(top) == k and all(spelled(reference, j, t) for j, t in zip(best.indices.tolist(), top))
        assert list(top.values()) == pytest.approx(best.values.tolist(), abs=1e-3)
        assert top[tok] == value  # greedy: the chosen token is the most likely one
        before = reference.tokenizer.decode(ids[:i])
        if "\ufffd" not in before:
            assert lp.text_offset[i] == len(before)
    streamed = [c.choices[0].logprobs for c in oai.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-3)


def test_response_format_shapes(oai, server):
    """json_object / json_schema are constrained (tests/test_structured_output.py); malformed
    formats are a 400 naming response_format."""
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, response_format={"type": "json_object"})
    assert (r.choices[0].message.content or "").startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, response_format={"type": "xml"})
    assert "response_format" in str(e.value) and "xml" in str(e.value)
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}  # no name
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "response_format": schema})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, response_format={"type": "text"}).choices


def test_model_may_be_left_out(server):
    """Without a "model" field the OpenAI endpoints serve the first served id (vLLM's rule;
    llama.cpp's server ignores the field); a wrong one is still a 404 (test_openai_errors)."""
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


@pytest.mark.parametrize("body,status,needle", [
    ({"model": MODEL, "messages": USER, "temperature": "hot"}, 400, "temperature"),
    ({"model": "gpt-4o", "messages": USER}, 404, "gpt-4o"),
    ({"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "n": 0}, 400, "n must be from 1 to 16"),
    ({"model": MODEL, "messages": USER, "n": 17}, 400, "n must be from 1 to 16"),
    ({"model": MODEL, "messages": USER, "top_logprobs": 3}, 400, "logprobs: true"),
    ({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": "3"}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": USER, "response_format": {"type": "regex"}}, 400, "response_format"),
    ({"model": MODEL, "messages": USER, "seed": 10 ** 30}, 400, "seed must be a 64-bit integer"),
    ({"model": MODEL, "messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty must be in [-2, 2]"),
    ({"model": MODEL, "messages": USER, "frequency_penalty": "x"}, 400, "frequency_penalty"),
    ({"model": MODEL, "messages": USER, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": MODEL, "messages": USER, "repetition_penalty": 1e-50}, 400, "repetition_penalty must be in [0.01"),
    ({"model": MODEL, "messages": USER, "min_p": 1.5}, 400, "min_p must be in [0, 1]"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"abc": 1}}, 400, "logit_bias keys must be token ids"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"99999999": 1}}, 400, "logit_bias keys must be token ids"),
    ({"model": MODEL, "messages": USER, "logit_bias": {"5": 101}}, 400, "logit_bias values"),
    ({"model": MODEL, "messages": USER, "logit_bias": [5]}, 400, "logit_bias"),
    ({"model": MODEL, "messages": USER, "stop_token_ids": [-1]}, 400, "stop_token_ids must be token ids"),
    ({"model": MODEL, "messages": USER, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens must be from 0"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 4}, 400, "messages[0]: a user message needs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * (CTX + 10)}]}, 400, "too long"),
])
def test_openai_errors(server, body, status, needle):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_logit_bias_and_penalties_reach_the_pick(server, oai):
    """logit_bias through both OpenAI endpoints: a +100 bias on a token makes every output
    token that token (also sampled); with penalties at their limits the request still serves."""
    tok = 42
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0.7, seed=3,
                                    logit_bias={str(tok): 100}, logprobs=True)
    assert [t.token for t in r.choices[0].logprobs.content] == [r.choices[0].logprobs.content[0].token] * 4
    c = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                         "logit_bias": {str(tok): 100}, "logprobs": 1}).json()
    assert c["choices"][0]["logprobs"]["tokens"] == [c["choices"][0]["logprobs"]["tokens"][0]] * 3
    assert c["choices"][0]["logprobs"]["tokens"][0] == r.choices[0].logprobs.content[0].token
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, presence_penalty=2, frequency_penalty=-2,
                                    extra_body={"repetition_penalty": 1.3, "min_p": 0.1})
    assert r.choices[0].finish_reason in ("length", "stop")
    # vLLM's stop_token_ids and min_tokens: the biased token ends the output after two others
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, logit_bias={str(tok): 100},
                                    extra_body={"stop_token_ids": [tok], "min_tokens": 2})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    # a stop string ends no output shorter than min_tokens (vLLM's): the biased token's own text
    text = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, logit_bias={str(tok): 100},
                                       logprobs=True).choices[0].logprobs.content[0].token
    assert text.strip()
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, logit_bias={str(tok): 100}, stop=[text])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, logit_bias={str(tok): 100}, stop=[text],
                                    extra_body={"min_tokens": 3})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text * 2


def test_malformed_json_and_the_server_keeps_serving(server, oai):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = post(server, "/v1/chat/completions", None, raw=raw)
        assert r.status_code == 400 and "error" in r.json()
    r = post(server, "/v1/messages", None, raw=b"{oops")
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices


def test_prompt_too_long_code(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a " * 3000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("n", [2, 8])
def test_concurrent_streams(server, n):
    async def one(client, i):
        text = ""
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Request number {i}"}], max_tokens=10,
            temperature=0, stream=True)
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
        return text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[one(client, i) for i in range(n)])
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert len(texts) == n and all(texts)
    # batching does not change results: each equals the same request served alone
    alone = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Request number 1"}], max_tokens=10, temperature=0)
    assert alone.choices[0].message.content == texts[1]


def test_queue_bound_gives_429(server):
    """4 decode slots + 4 queue places: a burst of 14 long requests overflows."""
    results = []

    def one():
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0})
        results.append((r.status_code, r.headers.get("retry-after")))

    threads = [threading.Thread(target=one) for _ in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = [c for c, _ in results]
    assert codes.count(429) >= 1 and codes.count(200) >= 8, codes
    assert all(ra == "1" for c, ra in results if c == 429)


def metric(server, name):
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(server) -> dict:
    """Every sample of /metrics: {(name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def sample(snapshot: dict, name: str, **labels) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def test_disconnect_cancels(server, oai):
    before = metric(server, 'freetoken_finished_total{reason="cancelled"}')
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "messages": USER, "max_tokens": 1500, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # drop the connection mid-stream
    deadline = time.time() + 30
    while time.time() < deadline and metric(server, 'freetoken_finished_total{reason="cancelled"}') <= before:
        time.sleep(0.2)
    assert metric(server, 'freetoken_finished_total{reason="cancelled"}') == before + 1
    while time.time() < deadline and metric(server, "freetoken_running_requests") > 0:
        time.sleep(0.2)
    assert metric(server, "freetoken_running_requests") == 0
    assert oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices  # slot reusable


def test_auth(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 1}
    assert post(server, "/v1/chat/completions", body, key=None).status_code == 401
    assert post(server, "/v1/chat/completions", body, key="wrong").status_code == 401
    r = post(server, "/v1/messages", body, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert post(server, "/v1/messages", body, key=None, **{"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


def test_prefix_reuse_is_reported(oai, claude, server):
    """A second turn that extends the first reports the reused prompt tokens in both APIs."""
    history = [{"role": "system", "content": "You are a helpful agent. " * 30},
               {"role": "user", "content": "First question about the repository layout?"}]
    first = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    again = oai.chat.completions.create(model=MODEL, messages=history + [
        {"role": "assistant", "content": "It has src and tests."}, {"role": "user", "content": "And docs?"}],
        max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 20 and cached < again.usage.prompt_tokens
    r = claude.messages.create(model=MODEL, max_tokens=2, system="You are a helpful agent. " * 30,
                               messages=[{"role": "user", "content": "First question about the repository layout?"}])
    assert r.usage.cache_read_input_tokens >= first.usage.prompt_tokens - 20
    assert metric(server, "freetoken_prefix_reused_tokens_total") >= cached


def test_metrics(server, oai):
    """Each counter moves by what one request did, and endpoints are counted apart."""
    before = scrape(server)
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count me in the metrics."}],
                                    max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    oai.models.list()
    after = scrape(server)

    def grew(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)
    prompt, cached = r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens
    assert grew("freetoken_requests_total", api="openai", endpoint="/v1/chat/completions", status="200") == 1
    assert grew("freetoken_requests_total", api="openai", endpoint="/v1/models", status="200") == 1
    assert sum(v - sample(before, n, **dict(l)) for (n, l), v in after.items() if n == "freetoken_requests_total") == 2
    assert grew("freetoken_generation_tokens_total") == 5
    assert grew("freetoken_prompt_tokens_total") == prompt
    assert grew("freetoken_prefix_reused_tokens_total") == cached
    assert grew("freetoken_prefill_tokens_total") == prompt - cached and grew("freetoken_prefill_seconds_total") > 0
    assert grew("freetoken_time_to_first_token_seconds_count") == 1
    assert grew("freetoken_decode_tokens_per_second_count") == 1
    assert grew("freetoken_decode_step_seconds_count", batch="1") == 4  # the first token comes from the prefill
    assert grew("freetoken_finished_total", reason="length") == 1
    assert sample(after, "freetoken_running_requests") == 0 and sample(after, "freetoken_queue_depth") == 0


def test_health_and_metrics_name_the_engine(server):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["device"] == "cpu" and health["experts"] == "cpu" and health["expert_backend"] in ("cpp", "torch")
    assert health["expert_threads"] >= 1 and health["decode_path"] == "eager" and health["max_batch"] == 4
    info = [dict(l) for (n, l) in scrape(server) if n == "freetoken_engine_info"]
    assert len(info) == 1
    described = {k: "none" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                 for k, v in health.items() if k not in ("status", "model") and not isinstance(v, dict)}
    assert info[0] == described
    plan = health["memory_plan"]  # the memory plan, in bytes per part, and the KV pool it sized
    assert plan["budget"] >= plan["weights"] + plan["work"] + plan["state"] + plan["checkpoints"] + plan["kv"]
    snap = scrape(server)
    assert sample(snap, "freetoken_memory_plan_bytes", part="kv") == plan["kv"] > 0
    assert sample(snap, "freetoken_kv_pages_total") == plan["kv_pages"] - 1
    # the start-up objects (torch, the model, the tokenizer) frozen out of the collector's walks
    assert sample(snap, "freetoken_gc_frozen_objects") > 50_000
    assert sample(snap, "freetoken_gc_collections", generation="0") >= 0


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 1500, "ignore_eos": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True}),
    ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 1500, "ignore_eos": True}),
])
def test_non_streaming_disconnect_is_quiet(server, path, body):
    """A client that leaves before its answer: the request is cancelled, counted as 499
    (client closed request), and nothing is logged as an error."""
    logged = len(server.output())
    before = scrape(server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + path, json=body, headers={"authorization": f"Bearer {API_KEY}"}, timeout=1.5)
    api = "anthropic" if path == "/v1/messages" else "openai"
    deadline = time.time() + 30
    while time.time() < deadline:
        now = scrape(server)
        if sample(now, "freetoken_requests_total", api=api, endpoint=path, status="499") > \
                sample(before, "freetoken_requests_total", api=api, endpoint=path, status="499") \
                and sample(now, "freetoken_running_requests") == 0:
            break
        time.sleep(0.2)
    after = scrape(server)
    assert sample(after, "freetoken_requests_total", api=api, endpoint=path, status="499") == \
        sample(before, "freetoken_requests_total", api=api, endpoint=path, status="499") + 1
    assert sample(after, "freetoken_finished_total", reason="cancelled") == \
        sample(before, "freetoken_finished_total", reason="cancelled") + 1
    assert sample(after, "freetoken_running_requests") == 0
    fivehundreds = [k for k, v in after.items() if k[0] == "freetoken_requests_total" and ("status", "500") in k[1]
                    and v != before.get(k, 0)]
    assert not fivehundreds
    log = server.output()[logged:]
    assert "Traceback" not in log and "StopIteration" not in log and "ERROR" not in log, log


# ---------------------------------------------------------------- Anthropic
def test_messages_non_streaming(claude):
    r = claude.messages.create(model=MODEL, max_tokens=6, system="Be terse.", messages=USER, extra_body={"temperature": 0})
    assert r.role == "assistant" and r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 6
    # input_tokens excludes what was read from the cache; together they are the whole prompt
    total = claude.messages.count_tokens(model=MODEL, system="Be terse.", messages=USER).input_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == total


def test_messages_full_history_and_ignored_fields(claude, server):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": "sig=="},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                         {"type": "text", "text": "thanks"}]},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": "again"}]
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}]
    r = claude.beta.messages.create(  # the beta client sends ?beta=true and anthropic-beta headers
        model=MODEL, max_tokens=4, messages=msgs, tools=tools, tool_choice={"type": "auto"},
        system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "u"},
        betas=["interleaved-thinking-2025-05-14"],
        extra_body={"context_management": {"edits": []}, "output_config": {"effort": "low"}})
    assert r.content and r.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_messages_stream_event_sequence(claude):
    kinds = []
    with claude.messages.stream(model=MODEL, max_tokens=5, messages=USER) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    core = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in core
    assert final.usage.output_tokens == 5 and final.stop_reason == "max_tokens"


def raw_stream(server, body) -> list[tuple[str, dict]]:
    """(event name, data) of one raw Anthropic stream."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", timeout=60, json=body,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def test_raw_stream_has_ping_and_usage(server, claude):
    """message_start and message_delta report the same usage, in Anthropic's meaning
    (input_tokens excludes cache reads), also when the prefix cache served the prompt."""
    system = "You are checking stream usage figures. " * 12
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "system": system, "messages": USER}
    total = claude.messages.count_tokens(model=MODEL, system=system, messages=USER).input_tokens
    cached = []
    for _ in range(2):  # the second time, most of the prompt comes from the cache
        evs = raw_stream(server, body)
        names = [n for n, _ in evs]
        assert "ping" in names
        assert names[0] == "message_start" and names[-1] == "message_stop"
        start = evs[0][1]["message"]["usage"]
        delta = next(d for n, d in evs if n == "message_delta")["usage"]
        assert start["input_tokens"] + start["cache_read_input_tokens"] == total
        assert (delta["input_tokens"], delta["cache_read_input_tokens"]) == \
            (start["input_tokens"], start["cache_read_input_tokens"])
        assert start["output_tokens"] == 0 and delta["output_tokens"] == 3
        cached.append(start["cache_read_input_tokens"])
    assert cached[1] > cached[0] and cached[1] > total // 2


def test_stop_sequences(claude):
    full = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body={"temperature": 0}).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body={"temperature": 0}, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.find(stop)]


def test_count_tokens(claude):
    a = claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    b = claude.messages.count_tokens(model=MODEL, messages=USER, system="A much longer system prompt here.").input_tokens
    assert 0 < a < b
    r = claude.messages.create(model=MODEL, max_tokens=1, messages=USER)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == a


@pytest.mark.parametrize("body,status,kind", [
    ({"model": MODEL, "messages": USER}, 400, "invalid_request_error"),  # max_tokens required
    ({"model": "claude-opus-4", "max_tokens": 5, "messages": USER}, 404, "not_found_error"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "w " * (CTX + 5)}]},
     400, "invalid_request_error"),
    ({"model": MODEL, "max_tokens": -1, "messages": USER}, 400, "invalid_request_error"),
])
def test_anthropic_errors(server, body, status, kind):
    r = post(server, "/v1/messages", body)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind


def test_server_side_token_cap_and_no_prefix_cache():
    s = Server("--max-new-tokens", "3", "--no-prefix-cache", "--max-seq-len", "1024")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "A long shared system prompt. " * 20}, *USER]
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
        again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=50)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # --no-prefix-cache
        assert "max_tokens" in post(s, "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 0},
                                    key=None).json()["error"]["message"]
    finally:
        s.stop()


def _opened_call(content: str | None, calls, name: str) -> bool:
    """The forced opening is there: a parsed call to `name`, or (the random model rarely
    finishes the arguments) the unterminated call left as text."""
    if calls:
        return calls[0] == name
    return bool(content) and content.startswith("<tool_call>") and name in content[:40]


def test_tool_choice_forces_a_call(oai, claude, server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=12,
                                    temperature=0)
    m = r.choices[0].message
    assert _opened_call(m.content, [c.function.name for c in m.tool_calls or []], "get_weather")
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=6,
                                    temperature=0)
    m = r.choices[0].message
    assert m.tool_calls or (m.content or "").startswith("<tool_call>")
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object"}}]
    a = claude.messages.create(model=MODEL, max_tokens=12, messages=msgs, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    calls = [b.name for b in a.content if b.type == "tool_use"]
    text = "".join(b.text for b in a.content if b.type == "text")
    assert _opened_call(text, calls, "get_weather")
    bad = post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "not among the tools" in bad.json()["error"]["message"]


def test_allowed_tools_choice_keeps_only_the_named_tools(server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    other = {"type": "function", "function": {"name": "get_time", "description": "time",
                                              "parameters": {"type": "object", "properties": {}}}}
    choice = {"type": "allowed_tools",
              "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": [other, *TOOLS],
                                               "tool_choice": choice, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    assert _opened_call(m["content"], [c["function"]["name"] for c in m.get("tool_calls") or []], "get_weather")
    choice["allowed_tools"]["tools"][0]["function"]["name"] = "nope"
    bad = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "tools": TOOLS, "tool_choice": choice})
    assert bad.status_code == 400 and "not among the tools" in bad.json()["error"]["message"]


def _template(eng):
    from freetoken.server.template import ChatTemplate
    from freetoken.tokenizer import load_json
    return ChatTemplate.from_files(eng.files, load_json(eng.files.get("tokenizer_config.json"), "tokenizer_config.json"))


@pytest.mark.parametrize("prefill", ['{"answer": "', "<", ">", "end"])
def test_messages_final_assistant_message_is_continued(claude, reference, prefill):
    """Anthropic's prefill: a final assistant message is continued, not closed and answered. The
    demo's template opens an assistant turn as its generation prompt does, so the continued prompt
    is that prompt plus the prefill (and no more: "<" and "end" also occur in the turn's closing
    text, where a search for the message's text would cut)."""
    msgs = [{"role": "user", "content": "Reply in JSON."}, {"role": "assistant", "content": prefill}]
    r = claude.messages.create(model=MODEL, max_tokens=6, messages=msgs, extra_body={"temperature": 0})
    tpl = _template(reference)
    text = tpl.render(msgs, continue_final=True)
    assert text == tpl.render(msgs[:1], add_generation_prompt=True) + prefill
    ids = reference.tokenizer.encode(text)
    # a closed turn plus a new one would be longer (Anthropic's input_tokens leave out cache reads)
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == len(ids)
    from freetoken.runtime.sampler import SamplingParams
    gen = reference.generate(ids, 6, SamplingParams(temperature=0), stop_at_eos=False).token_ids
    eos = set(reference.eos_ids)
    shown = gen[:next((i for i, t in enumerate(gen) if t in eos), len(gen))]
    assert "".join(b.text for b in r.content if b.type == "text") == reference.tokenizer.decode(shown)


def test_a_continued_message_refuses_a_grammar(server):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": '{"a": '}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                               "add_generation_prompt": False, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "prefilled" in r.json()["error"]["message"]
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": msgs,
                                      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                                      "tool_choice": {"type": "tool", "name": "f"}})
    assert r.status_code == 400 and "prefilled" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs[:1], "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}})
    assert r.status_code == 400 and "allowed_tools" in r.json()["error"]["message"]


def test_continue_final_message_and_its_errors(server):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    ids = post(server, "/tokenize", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                     "add_generation_prompt": False}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nHello, I")
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                               "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    both = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True,
                                                  "add_generation_prompt": True})
    assert both.status_code == 400 and "cannot both be true" in both.json()["error"]["message"]
    user_last = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs[:1], "continue_final_message": True})
    assert user_last.status_code == 400 and "assistant message" in user_last.json()["error"]["message"]


def test_usage_counts_tokens_up_to_the_stop_string(oai):
    full = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0,
                                       logprobs=True).choices[0]
    toks = [t.token for t in full.logprobs.content]
    if len(toks) < 4 or any(t.startswith("bytes:") for t in toks[:4]):
        pytest.skip("the greedy answer's first tokens are not whole characters")
    # a stop string inside the 4th token's text: the answer ends there, usage counts 4 tokens
    at = sum(len(t) for t in toks[:3])
    stop = next((full.message.content[at + i:at + i + 1] for i in range(len(toks[3]))
                 if full.message.content[at + i:at + i + 1].strip() and full.message.content.find(
                     full.message.content[at + i:at + i + 1]) >= at), None)
    if stop is None:
        pytest.skip("no stop character first seen in the 4th token of this greedy answer")
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0, stop=[stop], logprobs=True)
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens == len(c.logprobs.content) == 4


def test_completions_echo_and_fill_in_the_middle(oai, server, reference):
    r = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, echo=True)
    plain = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert r.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    fim = oai.completions.create(model=MODEL, prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n",
                                 max_tokens=3, temperature=0)
    want = reference.tokenizer.encode("<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>")
    assert fim.usage.prompt_tokens == len(want)
    from freetoken.runtime.sampler import SamplingParams
    gen = reference.generate(want, 3, SamplingParams(temperature=0), stop_at_eos=False).token_ids
    if not set(gen) & set(reference.eos_ids):  # the same prompt: the same greedy answer
        assert fim.choices[0].text == reference.tokenizer.decode(gen)
    bad = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 2})
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]


def test_deprecated_functions_api(server):
    """`functions` / `function_call` (OpenAI's deprecated function calling): served as tools, the
    call answered as one `function_call` (finish_reason "function_call"), history with the old
    shapes accepted."""
    # strict, with an enum: the grammar completes the forced call, so the answer always has one
    fns = [{"name": "get_weather", "description": "weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "functions": fns,
                                               "function_call": {"name": "get_weather"}, "max_tokens": 24,
                                               "temperature": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert "tool_calls" not in c["message"] and c["message"]["content"] is None
    call = c["message"]["function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["city"] in ("Paris", "Rome")
    assert c["finish_reason"] == "function_call"
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "messages": msgs, "functions": fns, "function_call": {"name": "get_weather"},
                            "max_tokens": 24, "temperature": 0, "stream": True}, timeout=120) as s:
        chunks = [json.loads(l[6:]) for l in s.iter_lines() if l.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert not any("tool_calls" in d for d in deltas)
    assert [d["function_call"] for d in deltas if "function_call" in d] == [call]  # the same greedy call
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "function_call"
    history = msgs + [{"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                               "arguments": '{"city": "Paris"}'}},
                      {"role": "function", "name": "get_weather", "content": "sunny"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": history, "functions": fns, "max_tokens": 2})
    assert r.status_code == 200, r.text
    bad = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "functions": fns,
                                                 "function_call": "always"})
    assert bad.status_code == 400 and "function_call" in bad.json()["error"]["message"]
