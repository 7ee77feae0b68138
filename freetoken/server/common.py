"""What both API adapters share: request validation, errors, prompt building."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass

from ..errors import FreeTokenError
from ..runtime.grammar import GrammarError, check
from ..runtime.penalties import RANGES, out_of_range
from ..runtime.request import GrammarSpec, SamplingOptions


class ApiError(Exception):
    """An error answered to the client; each adapter formats it in its API's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


class ClientGone(Exception):
    """The client closed the connection before its answer was ready: the request has been
    cancelled and there is nobody to answer (counted as 499, nginx's "client closed request")."""


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def field(body: dict, name: str, kind: str, default=None, required: bool = False, nullable: bool = True):
    """Typed access with a clear error: kind is a JSON type name or 'a|b' alternatives."""
    if name not in body or (body[name] is None and nullable):
        if required:
            raise ApiError(400, f"missing required field '{name}'", param=name)
        return default
    v = body[name]
    kinds = kind.split("|")
    ok = any(isinstance(v, _TYPES[k]) and not (k in ("integer", "number") and isinstance(v, bool)) for k in kinds)
    if not ok:
        raise ApiError(400, f"field '{name}' must be {' or '.join(kinds)}, got {type(v).__name__}", param=name)
    return v


def sampling_from(body: dict, max_tokens: int | None, stop, default_max: int) -> SamplingOptions:
    temperature = field(body, "temperature", "number", 1.0)
    top_p = field(body, "top_p", "number", 1.0)
    top_k = field(body, "top_k", "integer", 0)
    seed = field(body, "seed", "integer")
    if seed is not None and not -(1 << 63) <= seed < (1 << 64):  # what a torch.Generator takes
        raise ApiError(400, f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {seed}", param="seed")
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if top_k < 0 and top_k != -1:
        raise ApiError(400, f"top_k must be >= 0, got {top_k}", param="top_k")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "stop must be a string or a list of strings", param="stop")
    return SamplingOptions(temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
                           max_tokens=max_tokens or default_max, stop=list(stop or []),
                           ignore_eos=field(body, "ignore_eos", "boolean", False))  # vLLM's extension


_TOKEN_ID = re.compile(r"0*[0-9]{1,12}")  # leading zeros allowed, no huge ints


def logit_options(body: dict, sampling: SamplingOptions, vocab_size: int) -> None:
    """The OpenAI APIs' logit adjustments and vLLM's sampling extensions, onto `sampling`:
    presence_penalty and frequency_penalty in [-2, 2], logit_bias {token id (a string of
    digits, as JSON keys are): bias in [-100, 100]} over the model's vocabulary,
    repetition_penalty in [0.01, 100] (1: none), min_p in [0, 1] (runtime/penalties.py, sampler.py),
    stop_token_ids (ids that end the output, besides the model's EOS) and min_tokens (no EOS or
    stop id before that many output tokens)."""
    for name, (_, _, off) in RANGES.items():
        v = field(body, name, "number", off)
        bad = out_of_range(name, v)
        if bad:
            raise ApiError(400, f"{name} must be {bad}, got {v}", param=name)
        setattr(sampling, name, float(v))
    min_p = field(body, "min_p", "number", 0.0)
    if not 0 <= min_p <= 1:
        raise ApiError(400, f"min_p must be in [0, 1], got {min_p}", param="min_p")
    sampling.min_p = float(min_p)
    bias = field(body, "logit_bias", "object", {})
    out = {}
    for key, v in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise ApiError(400, f"logit_bias keys must be token ids from 0 to {vocab_size - 1}, got {key!r}",
                           param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {key}",
                           param="logit_bias")
        out[int(key)] = float(v)
    sampling.logit_bias = out
    stops = field(body, "stop_token_ids", "array", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stops):
        raise ApiError(400, f"stop_token_ids must be token ids from 0 to {vocab_size - 1}", param="stop_token_ids")
    min_tokens = field(body, "min_tokens", "integer", 0)
    if not 0 <= min_tokens <= sampling.max_tokens:
        raise ApiError(400, f"min_tokens must be from 0 to max_tokens ({sampling.max_tokens}), got {min_tokens}",
                       param="min_tokens")
    sampling.stop_token_ids, sampling.min_tokens = sampling.stop_token_ids + list(stops), min_tokens


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def grammar_for(response_format, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format -> what constrained decoding must produce; None for plain text.
    {"type": "text"}, {"type": "json_object"} (any JSON object) or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}}; a malformed one, or a schema
    the engine cannot enforce (strict: any keyword it cannot; otherwise only errors), is a 400.
    param: the field named in errors (Responses' text.format calls this with the same shape)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ApiError(400, f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=param)
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        raise ApiError(400, f"{param}.json_schema must be an object with a name and a schema", param=param)
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ApiError(400, f"{param}.json_schema.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                       param=param)
    schema, strict = js.get("schema", {"type": "object"}), js.get("strict")
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}.json_schema.schema must be a JSON schema object", param=param)
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{param}.json_schema.strict must be a boolean", param=param)
    spec = GrammarSpec("json_schema", schema=schema, strict=bool(strict))
    try:
        check(spec)
    except GrammarError as e:
        raise ApiError(400, f"{param}.json_schema.schema cannot be enforced: {e}", param=param) from None
    return spec


def constrain(ctx, sampling: SamplingOptions, spec: GrammarSpec | None, in_reasoning: bool) -> None:
    """Set a response format's grammar; when the prompt leaves the model thinking, the format
    holds from the end of thinking (`</think>`) on."""
    if spec is None:
        return
    if in_reasoning:
        close = ctx.tokenizer.token_id("</think>")
        if close is not None:
            spec = dataclasses.replace(spec, after=close)
    sampling.grammar = spec


async def off_loop(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread: a request's CPU-heavy preparation (rendering a long
    history, tokenizing it, compiling a grammar) must not hold the event loop that every other
    stream, /health and /metrics run on: bench/loop_stall.py, benchmarks/README.md)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@dataclass
class Prompt:
    ids: list[int]
    in_reasoning: bool  # the rendered prompt already opened <think>


def continuation(body: dict) -> tuple[bool, bool]:
    """vLLM's chat extensions -> (continue_final, generation): `continue_final_message` leaves the
    last (assistant) message open for the model to continue; `add_generation_prompt` false
    renders the messages without opening the assistant's turn."""
    cont = field(body, "continue_final_message", "boolean", False)
    gen = field(body, "add_generation_prompt", "boolean", True)
    if cont and "add_generation_prompt" in body and gen:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true: the first "
                            "continues the last message, the second opens a new assistant turn",
                       param="continue_final_message")
    return cont, gen


def refuse_continued_grammar(sampling: SamplingOptions, param: str) -> None:
    """A continued assistant message has begun the answer already; a response format, a forced
    tool call or strict tools would start theirs from scratch after it (a second JSON object
    after a prefilled '{"a": '): refused rather than answered wrong."""
    if sampling.grammar is not None or sampling.forced:
        raise ApiError(400, "a continued (prefilled) final assistant message cannot be combined with a response "
                            "format, a forced tool call or strict tools: their output would start over after the "
                            "prefilled text", param=param)


def build_prompt(ctx, text: str, sampling: SamplingOptions) -> Prompt:
    ids = ctx.tokenizer.encode(text)
    fit_prompt(ctx, ids, sampling)
    tail = text.rstrip()
    return Prompt(ids, tail.endswith("<think>"))


def fit_prompt(ctx, ids: list[int], sampling: SamplingOptions) -> None:
    """Reject prompts that do not fit; clamp max_tokens to the context left (as llama.cpp)."""
    limit = ctx.serving.max_len
    if not ids:
        raise ApiError(400, "the prompt is empty")
    if len(ids) >= limit:
        raise ApiError(400, f"prompt is too long: {len(ids)} tokens, the context is {limit} tokens "
                            "(this leaves no room to generate)", code="context_length_exceeded")
    sampling.max_tokens = min(sampling.max_tokens, limit - len(ids))


RENDER_OWNS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "continue_final")


# reasoning efforts a client may ask for (OpenAI's chat `reasoning_effort`, the Responses API's
# `reasoning.effort`): none / minimal turn the template's thinking switch off, the others on
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_kwargs(effort: str | None) -> dict:
    """Chat-template kwargs for a reasoning effort (already checked against EFFORTS)."""
    if effort is None:
        return {}
    if effort in ("none", "minimal"):
        return {"enable_thinking": False}
    return {"enable_thinking": True, "reasoning_effort": "high" if effort == "xhigh" else effort}  # gpt-oss levels


def template_kwargs(body: dict) -> dict:
    """vLLM's `chat_template_kwargs`, less the keys the renderer sets itself (RENDER_OWNS): they
    go to the template and to the tool-call probes, so they are filtered once, here."""
    return {k: v for k, v in (field(body, "chat_template_kwargs", "object") or {}).items() if k not in RENDER_OWNS}


def with_defaults(ctx, kwargs: dict) -> dict:
    """A request's chat-template kwargs over the server's (ft serve --default-chat-template-kwargs),
    merged once where a request's kwargs are built, so the prompt and the tool-call probes
    (tool_choice.py) render with the same ones."""
    return {k: v for k, v in {**getattr(ctx, "default_template_kwargs", {}), **kwargs}.items() if k not in RENDER_OWNS}


def render(ctx, messages: list[dict], tools: list[dict] | None, kwargs: dict | None = None,
           continue_final: bool = False, generation: bool = True) -> str:
    """The prompt in the model's chat template. kwargs: chat_template_kwargs; the keys the
    renderer sets itself (RENDER_OWNS) are not the client's to pass and are dropped.
    continue_final: the last message is an assistant turn to continue (a prefill), not a turn
    to close and answer after (ChatTemplate.render). generation: whether the assistant's turn
    is opened after the last message (vLLM's add_generation_prompt; True unless a client says)."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if k not in RENDER_OWNS}
    try:
        return ctx.template.render(messages, tools, add_generation_prompt=generation and not continue_final,
                                   continue_final=continue_final, **kwargs)
    except FreeTokenError as e:
        raise ApiError(400, str(e)) from None


def text_of(content, where: str) -> str:
    """Message content -> plain text: a string, or a list of text parts / blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            elif isinstance(part, dict) and part.get("type") == "refusal":  # an assistant's earlier refusal
                out.append(str(part.get("refusal", "")))
            elif isinstance(part, dict) and part.get("type") in ("image", "image_url", "input_image", "document"):
                raise ApiError(400, f"{where}: {part['type']} content is not supported by this text model")
            elif isinstance(part, dict):
                raise ApiError(400, f"{where}: unsupported content part type {part.get('type')!r}")
            else:
                raise ApiError(400, f"{where}: content parts must be objects")
        return "".join(out)
    raise ApiError(400, f"{where}: content must be a string or a list of parts")


def json_args(args) -> dict | str:
    """Tool-call arguments for templates: a dict when the JSON parses (templates expect one)."""
    if isinstance(args, dict):
        return args
    if isinstance(args, str):
        try:
            v = json.loads(args) if args.strip() else {}
            return v if isinstance(v, dict) else args
        except ValueError:
            return args
    return {}
