"""`ft serve` driven by the official openai and anthropic SDKs (and raw HTTP for bad input)."""
import asyncio
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from server_fixture import API_KEY, MODEL, Server

CTX = 2048


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", API_KEY, "--max-batch", "4", "--max-queue", "4", "--max-seq-len", str(CTX))
    yield s
    s.stop()


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


# ---------------------------------------------------------------- OpenAI
def test_startup_prints_url_and_model(server):
    out = server.output()
    assert f"http://127.0.0.1:{server.port}/v1" in out and MODEL in out


def test_models(oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL]


def test_chat_non_streaming(oai):
    r = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens > 5 and r.usage.prompt_tokens_details.cached_tokens == 0  # first chat request


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


def test_tools_and_tool_call_history(oai):
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
    for choice in ("auto", "none", "required"):
        r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


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


@pytest.mark.parametrize("body,status,needle", [
    ({"model": MODEL, "messages": USER, "temperature": "hot"}, 400, "temperature"),
    ({"model": "gpt-4o", "messages": USER}, 404, "gpt-4o"),
    ({"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": USER, "n": 2}, 400, "n=2"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "not supported"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * (CTX + 10)}]}, 400, "too long"),
])
def test_openai_errors(server, body, status, needle):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


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
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("freetoken_requests_total", "freetoken_prompt_tokens_total", "freetoken_generation_tokens_total",
                 "freetoken_time_to_first_token_seconds_bucket", "freetoken_decode_tokens_per_second_bucket",
                 "freetoken_queue_depth", "freetoken_prefix_reused_tokens_total", "freetoken_prefill_tokens_total",
                 "freetoken_checkpoint_hits", "freetoken_checkpoint_evictions", "freetoken_kv_pages_evicted"):
        assert name in text, name


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


def test_raw_stream_has_ping_and_usage(server):
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", timeout=60,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "max_tokens": 3, "stream": True, "messages": USER}) as r:
        lines = [l for l in r.iter_lines() if l.startswith("event: ")]
        data = []
    assert "event: ping" in lines
    assert lines[0] == "event: message_start" and lines[-1] == "event: message_stop"


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
