"""POST /v1/responses (the OpenAI Responses API), GET / DELETE /v1/responses/{id}, /tokenize and
/detokenize.

Two halves. A real `ft serve` (the random demo model, its real chat format) driven by the
official `openai` SDK and raw HTTP: requests, prompts (checked against /tokenize of the same
conversation in chat form), streams event by event, the store, errors. And the same app in
this process over a scripted engine whose output is chosen text, so that what a random model
almost never writes (thinking, well-formed tool calls, a clean end) is exercised too, through
the real detokenizer, parser and adapter.
"""
import asyncio
import json
import threading
import time
import types

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from server_fixture import API_KEY, MODEL, Server

CTX = 2048
STORE = 6  # the server under test keeps this many stored responses


@pytest.fixture(scope="module")
def server():
    s = Server("--api-key", API_KEY, "--max-batch", "2", "--max-queue", "1", "--max-seq-len", str(CTX),
               "--responses-store", str(STORE))
    yield s
    s.stop()


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path, body, raw=None):
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body),
                      headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"},
                      timeout=120)


def count(server, **body) -> int:
    """Prompt tokens of a chat-form conversation, by /tokenize."""
    r = post(server, "/tokenize", {"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()["count"]


TOOLS = [{"type": "function", "name": "get_weather", "description": "weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


def sse_events(lines) -> list[tuple[str, dict]]:
    """(event name, data) of a raw SSE stream; comments (keep-alives) skipped."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
            name = None
    return out


def check_sequence(evs: list[tuple[str, dict]]) -> dict:
    """The documented order, event by event: created, in_progress, then per output item
    added -> (parts added -> deltas -> done texts -> parts done) -> item done, then completed /
    incomplete; sequence numbers 0, 1, 2...; deltas concatenate to the done texts and the
    items; the final response lists the items as they were done. -> the final response."""
    assert evs, "empty stream"
    assert all(name == d["type"] for name, d in evs), [n for n, _ in evs]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    kinds = [d["type"] for _, d in evs]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds[:3]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds[-3:]
    rid = evs[0][1]["response"]["id"]
    assert evs[0][1]["response"]["status"] == "in_progress" and evs[0][1]["response"]["output"] == []
    done_items, cur = [], None
    for _, d in evs[2:-1]:
        t = d["type"]
        assert t != "response.created" and "response" not in d, t
        if t == "response.output_item.added":
            assert cur is None, "an item was added while another was open"
            assert d["output_index"] == len(done_items)
            cur = {"item": d["item"], "parts": set(), "summary": set(), "text": "", "reasoning": "",
                   "summary_text": "", "args": "", "done": set()}
            assert d["item"]["status"] == "in_progress"
            continue
        assert cur is not None, f"{t} outside an item"
        assert d["output_index"] == len(done_items)
        item = cur["item"]
        if t == "response.output_item.done":
            final = d["item"]
            assert (final["id"], final["type"]) == (item["id"], item["type"])
            if final["type"] == "message":
                assert cur["done"] == {"text", "part"}
                assert [c["text"] for c in final["content"]] == [cur["text"]]
            elif final["type"] == "reasoning":
                assert cur["done"] == {"reasoning", "part", "summary", "summary_part"}
                assert [c["text"] for c in final["content"]] == [cur["reasoning"]]
                assert [c["text"] for c in final["summary"]] == [cur["summary_text"]] == [cur["reasoning"]]
            else:
                assert final["type"] == "function_call" and cur["done"] == {"args"}
                assert final["arguments"] == cur["args"] and (final["name"], final["call_id"]) == \
                    (item["name"], item["call_id"])
            done_items.append(final)
            cur = None
            continue
        assert d["item_id"] == item["id"], t
        if t == "response.content_part.added":
            assert d["content_index"] not in cur["parts"] and d["part"]["text"] == ""
            cur["parts"].add(d["content_index"])
        elif t == "response.reasoning_summary_part.added":
            cur["summary"].add(d["summary_index"])
        elif t == "response.output_text.delta":
            assert item["type"] == "message" and d["content_index"] in cur["parts"] and "text" not in cur["done"]
            assert d["delta"]
            cur["text"] += d["delta"]
        elif t == "response.output_text.done":
            assert d["text"] == cur["text"]
            cur["done"].add("text")
        elif t == "response.reasoning_text.delta":
            assert item["type"] == "reasoning" and d["content_index"] in cur["parts"]
            cur["reasoning"] += d["delta"]
        elif t == "response.reasoning_text.done":
            assert d["text"] == cur["reasoning"]
            cur["done"].add("reasoning")
        elif t == "response.reasoning_summary_text.delta":
            assert d["summary_index"] in cur["summary"]
            cur["summary_text"] += d["delta"]
        elif t == "response.reasoning_summary_text.done":
            assert d["text"] == cur["summary_text"]
            cur["done"].add("summary")
        elif t == "response.reasoning_summary_part.done":
            assert "summary" in cur["done"] and d["part"]["text"] == cur["summary_text"]
            cur["done"].add("summary_part")
        elif t == "response.content_part.done":
            text = cur["text"] if item["type"] == "message" else cur["reasoning"]
            assert d["part"]["text"] == text and ({"text", "reasoning"} & cur["done"])
            cur["done"].add("part")
        elif t == "response.function_call_arguments.delta":
            assert item["type"] == "function_call"
            cur["args"] += d["delta"]
        elif t == "response.function_call_arguments.done":
            assert d["arguments"] == cur["args"]
            cur["done"].add("args")
        else:
            raise AssertionError(f"unexpected event {t}")
    assert cur is None, "an item was left open"
    final = evs[-1][1]["response"]
    assert final["id"] == rid and final["output"] == done_items
    assert final["status"] == ("completed" if kinds[-1] == "response.completed" else "incomplete")
    return final


def raw_stream(server, body) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=120,
                      headers={"authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def opened_call(r, name: str) -> bool:
    """tool_choice forced a call to `name`: a function_call item (its arguments parse), or (the
    random model seldom finishes a call) the forced opening left as text."""
    calls = [i for i in r.output if i.type == "function_call"]
    if calls:
        assert all(c.call_id and c.id and c.status == "completed" for c in calls)
        assert all(isinstance(json.loads(c.arguments), dict | str | list | int | float | bool | None) for c in calls)
        return calls[0].name == name
    return r.output_text.startswith("<tool_call>") and name in r.output_text[:60]


# ---------------------------------------------------------------- a real server
def test_create_string_input(oai, server):
    r = oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    msg = [i for i in r.output if i.type == "message"]
    assert len(msg) == 1 and msg[0].role == "assistant" and msg[0].content[0].type == "output_text"
    assert msg[0].status == "incomplete" and r.output_text == msg[0].content[0].text
    u = r.usage
    assert u.output_tokens == 5 and u.total_tokens == u.input_tokens + 5
    assert u.input_tokens == count(server, messages=[{"role": "user", "content": "Say hello."}])
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    assert r.store is True and r.parallel_tool_calls is True and r.tool_choice == "auto" and r.tools == []
    assert r.max_output_tokens == 5 and r.temperature == 0
    # the same request again: the prompt comes from the prefix cache
    again = oai.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert again.output_text == r.output_text and again.id != r.id
    # without a cap the status says how it ended
    free = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=8, metadata={"k": "v"}, user="u1")
    assert (free.status == "completed") == (free.incomplete_details is None)
    assert free.metadata == {"k": "v"} and free.user == "u1"


def test_items_and_instructions(oai, server):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
             {"role": "user", "content": "How are you?"}]
    r = oai.responses.create(model=MODEL, input=items, instructions="Be terse.", max_output_tokens=2)
    assert r.instructions == "Be terse."
    # instructions and the opening developer message are one system message
    chat = [{"role": "system", "content": "Be terse.\n\nAnswer in French."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "How are you?"}]
    assert r.usage.input_tokens == count(server, messages=chat)


def test_stream_helper_and_raw_sequence(oai, server):
    body = dict(model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0)
    kinds, deltas = [], ""
    with oai.responses.stream(**body, extra_body={"ignore_eos": True}) as s:
        for ev in s:  # the helper parses (and accumulates) every event
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas += ev.delta
                assert ev.snapshot.endswith(ev.delta)
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_text.done" in kinds and deltas
    evs = raw_stream(server, {**body, "ignore_eos": True})
    final = check_sequence(evs)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 12
    text = "".join(d["delta"] for _, d in evs if d["type"] == "response.output_text.delta")
    assert text == deltas  # greedy: the same text twice
    plain = oai.responses.create(**body, extra_body={"ignore_eos": True})
    assert plain.output_text == text and plain.usage.input_tokens == final["usage"]["input_tokens"]
    # streamed responses are stored too
    assert oai.responses.retrieve(final["id"]).output_text == text


def test_tools_forced_call(oai, server):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=16,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert opened_call(named, "get_weather")
    assert named.tools[0].name == "get_weather" and named.tool_choice.name == "get_weather"
    # the flat Responses tools render as chat's nested ones do
    assert named.usage.input_tokens == count(server, messages=msgs, tools=CHAT_TOOLS)
    req = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                               max_output_tokens=8, temperature=0)
    assert opened_call(req, "get_weather") or req.output_text.startswith("<tool_call>")
    evs = raw_stream(server, {"model": MODEL, "input": "Weather in Paris?", "tools": TOOLS, "max_output_tokens": 8,
                              "tool_choice": "required", "temperature": 0})
    check_sequence(evs)
    # tool_choice none: the tools are not rendered
    none = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="none",
                                max_output_tokens=1)
    assert none.usage.input_tokens == count(server, messages=msgs)


def test_forced_call_arguments_follow_the_schema(oai):
    """A forced call's arguments are held to the tool's schema by the grammar (a bounded schema:
    the random model would not close an open string on its own)."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
              "required": ["unit", "days"], "additionalProperties": False}
    tools = [{"type": "function", "name": "forecast", "parameters": schema, "strict": True}]
    r = oai.responses.create(model=MODEL, input="Forecast?", tools=tools, tool_choice={"type": "function", "name": "forecast"},
                             max_output_tokens=64, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "forecast", r.output
    args = json.loads(calls[0].arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and args["days"] in (1, 2, 3) and set(args) == {"unit", "days"}


def test_function_call_output_round_trip(oai, server):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_7", "output": "sunny, 21C"}]
    r = oai.responses.create(model=MODEL, input=items, tools=TOOLS, max_output_tokens=3)
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_7", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21C"}]
    assert r.usage.input_tokens == count(server, messages=chat, tools=CHAT_TOOLS)


def test_previous_response_id(oai, server):
    first = oai.responses.create(model=MODEL, input="System check: " * 20 + "first question?", max_output_tokens=4,
                                 temperature=0, instructions="Be brief.")
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input="And the second?",
                                  max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    # the first's input and output come first (its instructions do not carry over)
    chat = [{"role": "user", "content": "System check: " * 20 + "first question?"},
            {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And the second?"}]
    assert second.usage.input_tokens == count(server, messages=chat)
    assert second.usage.input_tokens > first.usage.input_tokens
    got = oai.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage.input_tokens == \
        first.usage.input_tokens
    # a third turn chains through the second
    third = oai.responses.create(model=MODEL, previous_response_id=second.id, input="Third.", max_output_tokens=2)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 20


def test_store_false_delete_and_eviction(oai, server):
    gone = oai.responses.create(model=MODEL, input="not kept", max_output_tokens=1, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(gone.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, previous_response_id=gone.id, input="x", max_output_tokens=1)
    err = e.value.body
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
    assert err["type"] == "invalid_request_error" and gone.id in err["message"]
    # delete
    d = oai.responses.create(model=MODEL, input="delete me", max_output_tokens=1)
    r = httpx.delete(server.url + f"/v1/responses/{d.id}", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json() == {"id": d.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(d.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.delete(d.id)
    # least recently used first: `kept` is read after every new response, `old` is not
    kept = oai.responses.create(model=MODEL, input="keep me", max_output_tokens=1)
    old = oai.responses.create(model=MODEL, input="forget me", max_output_tokens=1)
    for i in range(STORE):
        oai.responses.create(model=MODEL, input=f"filler {i}", max_output_tokens=1)
        oai.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(old.id)
    r = post(server, "/v1/responses", {"model": MODEL, "previous_response_id": old.id, "input": "x"})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "evicted" in r.json()["error"]["message"]
    assert oai.responses.create(model=MODEL, previous_response_id=kept.id, input="still here",
                                max_output_tokens=1).previous_response_id == kept.id


def test_reasoning_effort_switches_thinking(oai, server):
    msgs = [{"role": "user", "content": "Think about it."}]
    off = oai.responses.create(model=MODEL, input="Think about it.", reasoning={"effort": "minimal"},
                               max_output_tokens=1)
    none = oai.responses.create(model=MODEL, input="Think about it.", reasoning={"effort": "none"},
                                max_output_tokens=1)
    on = oai.responses.create(model=MODEL, input="Think about it.", reasoning={"effort": "high"},
                              max_output_tokens=1)
    default = oai.responses.create(model=MODEL, input="Think about it.", max_output_tokens=1)
    disabled = count(server, messages=msgs, chat_template_kwargs={"enable_thinking": False})
    assert off.usage.input_tokens == none.usage.input_tokens == disabled
    assert on.usage.input_tokens == default.usage.input_tokens == count(server, messages=msgs) != disabled
    assert off.reasoning.effort == "minimal" and on.reasoning.effort == "high"


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search", "computer_use_preview",
                                  "code_interpreter", "image_generation", "mcp", "local_shell", "custom"])
def test_builtin_tools_refused(server, kind):
    r = post(server, "/v1/responses", {"model": MODEL, "input": "x", "tools": [{"type": kind}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert repr(kind) in r.json()["error"]["message"]


def _no_grammar() -> bool:
    from freetoken.server import common
    return not hasattr(common, "grammar_for")


SCHEMA = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}


@pytest.mark.parametrize("body,status,param,needle", [
    ({"model": MODEL}, 400, "input", "input"),
    ({"model": MODEL, "input": 5}, 400, "input", "string or a list"),
    ({"model": MODEL, "input": [{"role": "wizard", "content": "x"}]}, 400, "input", "role"),
    ({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input", "not supported by this text model"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, 400, "input", "item_reference"),
    ({"model": MODEL, "input": [{"type": "function_call", "name": "f"}]}, 400, "input", "call_id"),
    ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input", "output"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "flat"),
    ({"model": MODEL, "input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice", "not among the tools"),
    ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice", "needs tools"),
    ({"model": MODEL, "input": "x", "tools": TOOLS, "tool_choice": {"type": "web_search_preview"}},
     400, "tool_choice", "web_search_preview"),
    ({"model": MODEL, "input": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", "max_output_tokens"),
    ({"model": MODEL, "input": "x", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", "effort"),
    ({"model": MODEL, "input": "x", "truncation": "sometimes"}, 400, "truncation", "truncation"),
    ({"model": MODEL, "input": "x", "metadata": {"k": 1}}, 400, "metadata", "metadata"),
    ({"model": MODEL, "input": "x", "include": [1]}, 400, "include", "include"),
    ({"model": MODEL, "input": "x", "store": "yes"}, 400, "store", "store"),
    ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format", "yaml"),
    ({"model": MODEL, "input": "x", "background": True}, 400, "background", "background"),
    ({"model": MODEL, "input": "word " * (CTX + 10)}, 400, None, "too long"),
    ({"model": "gpt-5", "input": "x"}, 404, "model", "gpt-5"),
])
def test_errors(server, body, status, param, needle):
    r = post(server, "/v1/responses", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and needle in err["message"] and err["param"] == param


def test_structured_output_until_grammar(oai, server):
    for fmt in (SCHEMA, {"type": "json_object"}):
        r = post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 48,
                                           "text": {"format": fmt}, "temperature": 0})
        if _no_grammar():
            assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
            assert "not supported" in r.json()["error"]["message"] and fmt["type"] in r.json()["error"]["message"]
        else:  # constrained decoding: a finished answer is JSON
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["text"]["format"] == fmt
            if out["status"] == "completed":
                text = "".join(c["text"] for i in out["output"] if i["type"] == "message" for c in i["content"])
                assert isinstance(json.loads(text), dict)
    if not _no_grammar():  # a malformed schema names text.format
        bad = {"type": "json_schema", "name": "bad name!", "schema": {"type": "object"}}
        r = post(server, "/v1/responses", {"model": MODEL, "input": "x", "text": {"format": bad}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    r = oai.responses.create(model=MODEL, input="x", max_output_tokens=1, text={"format": {"type": "text"},
                                                                               "verbosity": "low"})
    assert r.text.format.type == "text"


def test_malformed_json_and_truncation(server, oai):
    for raw in (b"{not json", b"[1]", b""):
        r = post(server, "/v1/responses", None, raw=raw)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # truncation auto drops the oldest turns to fit; disabled refuses
    long = [{"role": "user", "content": "old words " * 700}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "older words " * 700}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Now?"}]
    r = post(server, "/v1/responses", {"model": MODEL, "input": long, "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = oai.responses.create(model=MODEL, input=long, truncation="auto", max_output_tokens=1)
    assert r.truncation == "auto" and r.usage.input_tokens < CTX
    assert r.usage.input_tokens == count(server, messages=long[2:])


def test_truncation_drops_the_fewest_turns(server, oai):
    """truncation auto keeps as many of the latest turns as fit (bisection over the turns, not
    a render per dropped turn: a long history held the event loop for seconds)."""
    long = []
    for i in range(24):
        long += [{"role": "user", "content": f"turn {i} " + "words " * 100}, {"role": "assistant", "content": "ok " * 20}]
    long.append({"role": "user", "content": "Now?"})
    counts = [count(server, messages=long[2 * k:]) for k in range(25)]
    k = next(k for k, c in enumerate(counts) if c < CTX)
    assert 2 <= k < 24 and counts[k - 1] >= CTX
    r = oai.responses.create(model=MODEL, input=long, truncation="auto", max_output_tokens=1)
    assert r.usage.input_tokens == counts[k]


def test_metrics_count_the_endpoint(server, oai):
    def n(status, endpoint="/v1/responses"):
        line = f'freetoken_requests_total{{api="openai",endpoint="{endpoint}",status="{status}"}}'
        for row in httpx.get(server.url + "/metrics").text.splitlines():
            if row.startswith(line):
                return float(row.rsplit(" ", 1)[1])
        return 0.0
    before, bad, got = n("200"), n("400"), n("200", "/v1/responses/{id}")
    r = oai.responses.create(model=MODEL, input="count me", max_output_tokens=1)
    oai.responses.retrieve(r.id)
    post(server, "/v1/responses", {"model": MODEL})
    assert n("200") == before + 1 and n("400") == bad + 1 and n("200", "/v1/responses/{id}") == got + 1


def test_disconnect_cancels_and_queue_full(server, oai):
    def cancelled():
        for row in httpx.get(server.url + "/metrics").text.splitlines():
            if row.startswith('freetoken_finished_total{reason="cancelled"}'):
                return float(row.rsplit(" ", 1)[1])
        return 0.0
    before = cancelled()
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, headers={"authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "input": "go on", "max_output_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    deadline = time.time() + 30
    while time.time() < deadline and cancelled() <= before:
        time.sleep(0.2)
    assert cancelled() == before + 1
    # 2 decode slots + 1 queue place: a burst of 5 long requests overflows
    codes = []

    def one():
        r = post(server, "/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 40, "ignore_eos": True})
        codes.append((r.status_code, r.headers.get("retry-after"), r.json()))
    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c for c, _, _ in codes].count(429) >= 1 and [c for c, _, _ in codes].count(200) >= 2, codes
    assert all(ra == "1" and body["error"]["type"] == "rate_limit_error" for c, ra, body in codes if c == 429)
    assert oai.responses.create(model=MODEL, input="still serving", max_output_tokens=1).output


def test_tokenize_detokenize(server):
    r = post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world, héllo!"}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == CTX and r["token_strs"] is None
    back = post(server, "/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json()
    assert back["prompt"] == back["content"] == "Hello world, héllo!"
    # llama.cpp's names: content in, pieces out
    lc = post(server, "/tokenize", {"content": "Hello world, héllo!", "with_pieces": True}).json()
    assert [p["id"] for p in lc["tokens"]] == r["tokens"]
    assert all(isinstance(p["piece"], (str, list)) for p in lc["tokens"])
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"])
    # chat messages are rendered with the template, with the generation prompt unless told
    msgs = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": msgs}).json()
    text = post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>user\nHi<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    bare = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"] and chat["tokens"][:bare["count"]] == bare["tokens"]
    for path, body in [("/tokenize", {}), ("/tokenize", {"prompt": 5}), ("/tokenize", {"messages": "x"}),
                       ("/detokenize", {"tokens": ["a"]}), ("/detokenize", {"tokens": [-1]}),
                       ("/detokenize", {"tokens": [10 ** 9]}), ("/detokenize", {}),
                       ("/tokenize", {"prompt": "x", "model": 3})]:
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, body, r.text)
    assert post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


# ---------------------------------------------------------------- a scripted engine in this process
class ScriptedServing:
    """Stands in for ServingEngine: each request's output is the next scripted text, tokenized
    and sent token by token, then ended ("stop" adds the EOS token; "length" ends at the last
    token; "error" fails)."""
    max_len = 4096

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.engine = types.SimpleNamespace(eos_ids=[tokenizer.token_id("<|im_end|>")])
        self.sched = types.SimpleNamespace(stats=lambda: {"waiting": 0, "running": 0})
        self.script: list[tuple[str, str]] = []
        self.seen = []

    def describe(self):
        return {"device": "scripted"}

    def submit(self, req):
        from freetoken.runtime.request import TokenEvent
        text, end = self.script.pop(0) if self.script else ("Hello.", "stop")
        ids = self.tok.encode(text)
        if len(ids) > req.sampling.max_tokens:
            ids, end = ids[:req.sampling.max_tokens], "length"
        q = asyncio.Queue()
        for i, t in enumerate(ids):
            q.put_nowait(TokenEvent(req.id, [t], [0.0], "length" if end == "length" and i == len(ids) - 1 else None))
        if end == "stop":
            ids = ids + self.engine.eos_ids
            q.put_nowait(TokenEvent(req.id, self.engine.eos_ids, [0.0], "stop"))
        elif end == "error":
            q.put_nowait(TokenEvent(req.id, [], [], "error", "scripted failure"))
        req.output_ids, req.finish_reason, req.finished_at = ids, end, time.monotonic()
        self.seen.append(req)
        return q

    def cancel(self, req, reason="cancelled"):
        req.finish_reason = req.finish_reason or reason


@pytest.fixture(scope="module")
def scripted(qwen_json):
    from freetoken.server.app import ServerContext, build_app
    from freetoken.server.template import ChatTemplate
    from freetoken.tokenizer import Tokenizer
    tok = Tokenizer(qwen_json.encode(), {"eos_token": "<|im_end|>"})
    serving = ScriptedServing(tok)
    ctx = ServerContext(serving, tok, ChatTemplate(None), ["scripted"], tok.vocab_size)
    http = TestClient(build_app(ctx))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
    return types.SimpleNamespace(serving=serving, tok=tok, template=ctx.template, http=http, client=client)


THOUGHT = "<think>\nThe user wants weather.\n</think>\n\n"
CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


def test_scripted_reasoning_text_and_calls(scripted):
    scripted.serving.script = [(THOUGHT + CALLS, "stop")]
    r = scripted.client.responses.create(model="scripted", input="Weather in Paris and Rome?", tools=TOOLS)
    assert r.status == "completed" and r.incomplete_details is None and r.completed_at
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call", "function_call"]
    rs = r.output[0]
    assert rs.id.startswith("rs_") and rs.content[0].type == "reasoning_text"
    assert rs.content[0].text == rs.summary[0].text == "The user wants weather."
    assert r.output[1].content[0].text == "Checking.\n" and r.output_text == "Checking.\n"
    calls = r.output[2:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Rome"})]
    assert all(c.id.startswith("fc_") and c.call_id.startswith("call_") for c in calls)
    assert len({c.call_id for c in calls}) == 2
    # reasoning tokens: <think> ... </think>, both tags counted
    assert r.usage.output_tokens_details.reasoning_tokens == len(scripted.tok.encode(THOUGHT.rstrip("\n")))
    assert r.usage.output_tokens == len(scripted.tok.encode(THOUGHT + CALLS)) + 1  # and the EOS token
    # parallel_tool_calls false: the first call only
    scripted.serving.script = [(THOUGHT + CALLS, "stop")]
    one = scripted.client.responses.create(model="scripted", input="Weather?", tools=TOOLS, parallel_tool_calls=False)
    assert [i.type for i in one.output] == ["reasoning", "message", "function_call"]


def test_scripted_stream_through_the_sdk_helper(scripted):
    scripted.serving.script = [(THOUGHT + CALLS, "stop")] * 2
    kinds = []
    with scripted.client.responses.stream(model="scripted", input="Weather?", tools=TOOLS) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    assert final.output_text == "Checking.\n" and final.status == "completed"
    assert json.loads(final.output[2].arguments) == {"city": "Paris"}
    for k in ("response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
              "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_text.delta",
              "response.function_call_arguments.delta", "response.function_call_arguments.done",
              "response.completed"):
        assert k in kinds, k
    with scripted.http.stream("POST", "/v1/responses", json={"model": "scripted", "input": "Weather?", "tools": TOOLS,
                                                             "stream": True}) as r:
        evs = sse_events(r.iter_lines())
    final = check_sequence(evs)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_scripted_incomplete_and_failed_streams(scripted):
    scripted.serving.script = [(THOUGHT + "A long answer that goes on.", "stop")]
    with scripted.http.stream("POST", "/v1/responses", json={"model": "scripted", "input": "x", "stream": True,
                                                             "max_output_tokens": 12}) as r:
        evs = sse_events(r.iter_lines())
    final = check_sequence(evs)
    assert evs[-1][0] == "response.incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][-1]["status"] == "incomplete" and final["usage"]["output_tokens"] == 12
    # thinking cut by the limit: the reasoning item alone, incomplete
    scripted.serving.script = [(THOUGHT, "stop")]
    r = scripted.client.responses.create(model="scripted", input="x", max_output_tokens=3)
    assert [(i.type, i.status) for i in r.output] == [("reasoning", "incomplete")] and r.status == "incomplete"
    # a failed generation: an error event, then response.failed
    scripted.serving.script = [("Partial", "error")]
    with scripted.http.stream("POST", "/v1/responses", json={"model": "scripted", "input": "x", "stream": True}) as r:
        evs = sse_events(r.iter_lines())
    kinds = [d["type"] for _, d in evs]
    assert kinds[-2:] == ["error", "response.failed"]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert "scripted failure" in evs[-2][1]["message"] and evs[-1][1]["response"]["status"] == "failed"
    assert evs[-1][1]["response"]["error"]["code"] == "server_error"
    scripted.serving.script = [("Partial", "error")]
    with pytest.raises(openai.InternalServerError):
        scripted.client.responses.create(model="scripted", input="x")
    # nothing at all: one empty message
    scripted.serving.script = [("", "stop")]
    r = scripted.client.responses.create(model="scripted", input="x")
    assert [(i.type, i.content[0].text) for i in r.output] == [("message", "")] and r.status == "completed"


def _prompt(scripted) -> list[int]:
    return scripted.serving.seen[-1].prompt_ids


def test_scripted_round_trip_renders_as_chat(scripted):
    """A turn's output items sent back (through previous_response_id, or replayed as input the
    way Codex does with store: false and the reasoning content stripped) render exactly as the
    same conversation in chat form."""
    scripted.serving.script = [(THOUGHT + CALLS, "stop")]
    first = scripted.client.responses.create(model="scripted", input="Weather in Paris and Rome?", tools=TOOLS,
                                             instructions="Use tools.")
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": out}
               for c, out in zip(first.output[2:], ("sunny", [{"type": "input_text", "text": "rain"}]))]
    chat = [{"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Checking.\n", "reasoning_content": "The user wants weather.",
             "tool_calls": [{"id": c.call_id, "type": "function",
                             "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                            for c in first.output[2:]]},
            {"role": "tool", "tool_call_id": first.output[2].call_id, "content": "sunny"},
            {"role": "tool", "tool_call_id": first.output[3].call_id, "content": "rain"}]
    expected = scripted.tok.encode(scripted.template.render(chat, CHAT_TOOLS, add_generation_prompt=True))
    assert "<think>\nThe user wants weather.\n</think>" in scripted.tok.decode(expected)
    scripted.client.responses.create(model="scripted", previous_response_id=first.id, input=outputs, tools=TOOLS,
                                     instructions="Use tools.")
    assert _prompt(scripted) == expected
    # Codex's replay: every item again, reasoning with its summary only
    replay = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Rome?"}]}]
    for item in first.output:
        d = item.to_dict()
        if d["type"] == "reasoning":
            d["content"] = None
        replay.append(d)
    scripted.client.responses.create(model="scripted", input=replay + outputs, tools=TOOLS, store=False,
                                     instructions="Use tools.", include=["reasoning.encrypted_content"])
    assert _prompt(scripted) == expected


def test_scripted_xml_call_values_follow_the_tools_schema(scripted):
    """A call in the XML form writes string arguments raw: "123" for a string parameter comes
    back as the string "123" on every endpoint (it came back as a number), an integer as one."""
    xml = ("<tool_call>\n<function=ship>\n<parameter=zip>\n123\n</parameter>\n<parameter=count>\n3\n</parameter>\n"
           "</function>\n</tool_call>")
    params = {"type": "object", "properties": {"zip": {"type": "string"}, "count": {"type": "integer"}}}
    want = {"zip": "123", "count": 3}
    scripted.serving.script = [(xml, "stop")] * 3
    chat = scripted.client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "Ship it"}],
        tools=[{"type": "function", "function": {"name": "ship", "parameters": params}}])
    assert json.loads(chat.choices[0].message.tool_calls[0].function.arguments) == want
    resp = scripted.client.responses.create(model="scripted", input="Ship it",
                                            tools=[{"type": "function", "name": "ship", "parameters": params}])
    assert json.loads([i for i in resp.output if i.type == "function_call"][0].arguments) == want
    msg = scripted.http.post("/v1/messages", json={
        "model": "scripted", "max_tokens": 64, "messages": [{"role": "user", "content": "Ship it"}],
        "tools": [{"name": "ship", "input_schema": params}]}).json()
    assert [b["input"] for b in msg["content"] if b["type"] == "tool_use"] == [want]


NS_TOOLS = [{"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn", "description": "Start one.",
                        "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]}] + TOOLS


def test_scripted_namespace_tools(scripted):
    """A namespace tool (Codex sends its sub-agent tools as one) reaches the model as NS.NAME; the
    call comes back as a function_call with name and namespace apart, and renders under NS.NAME
    again when the client sends it back."""
    call = '<tool_call>\n{"name": "agents.spawn", "arguments": {"task": "look"}}\n</tool_call>'
    scripted.serving.script = [(call, "stop")]
    r = scripted.http.post("/v1/responses", json={"model": "scripted", "input": "Go", "tools": NS_TOOLS}).json()
    fc = [i for i in r["output"] if i["type"] == "function_call"]
    assert [(c["name"], c.get("namespace"), json.loads(c["arguments"])) for c in fc] == [("spawn", "agents", {"task": "look"})]
    assert r["tools"][0]["type"] == "namespace" and r["tools"][0]["tools"][0]["name"] == "spawn"
    assert r["tools"][1]["name"] == "get_weather"
    text = scripted.tok.decode(_prompt(scripted))
    assert '"name": "agents.spawn"' in text and "[agents: Sub-agents.] Start one." in text
    # sent back as input: the assistant's call is rendered under its qualified name
    back = [{"role": "user", "content": "Go"}, fc[0],
            {"type": "function_call_output", "call_id": fc[0]["call_id"], "output": "done"}]
    scripted.http.post("/v1/responses", json={"model": "scripted", "input": back, "tools": NS_TOOLS})
    assert text.count("agents.spawn") < scripted.tok.decode(_prompt(scripted)).count("agents.spawn")
    # a forced call to a namespaced tool by name and namespace
    scripted.serving.script = [('{"name": "agents.spawn", "arguments": {"task": "x"}}\n</tool_call>', "stop")]
    r = scripted.http.post("/v1/responses", json={
        "model": "scripted", "input": "Go", "tools": NS_TOOLS,
        "tool_choice": {"type": "function", "name": "spawn", "namespace": "agents"}})
    assert r.status_code == 200, r.text
    for bad in ({"type": "namespace", "name": "x"}, {"type": "namespace", "tools": []},
                {"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]}):
        r = scripted.http.post("/v1/responses", json={"model": "scripted", "input": "Go", "tools": [bad]})
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
