"""POST /tokenize and /detokenize, as vLLM serves them (with llama.cpp's field names too).

/tokenize takes `{"prompt": str}` (llama.cpp: `{"content": str}`) or chat `{"messages": [...]}`
(rendered with the chat template, `tools`, `chat_template_kwargs`, `add_generation_prompt` and
`continue_final_message` as chat completions would) and answers `{"tokens", "count", "max_model_len", "token_strs"}`:
the ids this server would prefill for that prompt. `return_token_strs` gives the vocabulary
pieces (vLLM); llama.cpp's `with_pieces` turns `tokens` into `[{"id", "piece"}]`.
/detokenize takes `{"tokens": [...]}` and answers `{"prompt": str}` (and llama.cpp's `content`).
"""
from __future__ import annotations

from starlette.responses import JSONResponse

from .common import ApiError, continuation, field, off_loop, render, template_kwargs, with_defaults
from .openai import normalize_messages, normalize_tools


def _check_model(ctx, body: dict) -> None:
    model = field(body, "model", "string")
    if model is not None and model not in ctx.model_names:
        raise ApiError(404, f"model '{model}' does not exist; this server serves {ctx.model_names[0]!r}",
                       param="model", code="model_not_found")


def _text(ctx, body: dict) -> str:
    if body.get("messages") is not None:
        messages = normalize_messages(body["messages"])
        tools = normalize_tools(body)
        cont, generation = continuation(body)
        return render(ctx, messages, tools, with_defaults(ctx, template_kwargs(body)), continue_final=cont,
                      generation=generation)
    prompt = body.get("prompt", body.get("content"))
    if not isinstance(prompt, str):
        raise ApiError(400, "give 'prompt' (or llama.cpp's 'content') as a string, or chat 'messages'",
                       param="prompt")
    return prompt


async def tokenize(ctx, body: dict, request):
    return JSONResponse(await off_loop(_tokenized, ctx, body))


def _tokenized(ctx, body: dict) -> dict:
    _check_model(ctx, body)
    # add_special_tokens / add_special are accepted: ids are encoded as this server encodes
    # prompts (no tokens added; the chat template writes any BOS itself)
    field(body, "add_special_tokens", "boolean")
    field(body, "add_special", "boolean")
    want_strs = field(body, "return_token_strs", "boolean", False)
    with_pieces = field(body, "with_pieces", "boolean", False)
    ids = ctx.tokenizer.encode(_text(ctx, body))
    out = {"tokens": ids, "count": len(ids), "max_model_len": ctx.serving.max_len, "token_strs": None}
    if want_strs:
        out["token_strs"] = [ctx.tokenizer.tk.id_to_token(i) for i in ids]
    if with_pieces:  # llama.cpp: the text of each token, or its bytes when it is part of a character
        pieces = []
        for i in ids:
            raw = ctx.token_text(i)[1]
            try:
                pieces.append({"id": i, "piece": raw.decode("utf-8")})
            except UnicodeDecodeError:
                pieces.append({"id": i, "piece": list(raw)})
        out["tokens"] = pieces
    return out


async def detokenize(ctx, body: dict, request):
    _check_model(ctx, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
    if any(not 0 <= t < ctx.vocab_size for t in tokens):
        raise ApiError(400, f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
    text = ctx.tokenizer.decode(tokens)
    return JSONResponse({"prompt": text, "content": text})
