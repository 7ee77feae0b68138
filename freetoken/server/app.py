"""The HTTP app: route table, authentication, one error wrapper, /health and /metrics.

Each route parses the JSON body itself so that every malformed request gets an error in its
API's own shape (OpenAI or Anthropic) and status; nothing a client sends can stop the server.
"""
from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from . import anthropic, openai, responses, tokenize
from .common import ApiError, ClientGone, parse_body
from .logprobs import TokenText
from .metrics import Metrics
from .template import ChatTemplate

log = logging.getLogger("freetoken.server")


@dataclass
class ServerContext:
    serving: object  # runtime.serving.ServingEngine
    tokenizer: object
    template: ChatTemplate
    model_names: list[str]
    vocab_size: int
    api_keys: tuple[str, ...] = ()  # any of them authorizes a request; () serves without a key
    metrics: Metrics = field(default_factory=Metrics)
    started: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenText | None = None  # token spellings for logprobs (set by build_app)
    responses_store: int = 256  # Responses API: stored responses kept (LRU)
    # chat-template kwargs every request renders with, under its own (--default-chat-template-kwargs)
    default_template_kwargs: dict = field(default_factory=dict)


def _api_of(request: Request) -> str:
    """Which API's shape to answer in: the path says, except on the routes both APIs share
    (/v1/models), where Anthropic's SDK announces itself with an anthropic-version header."""
    path = request.url.path
    if path.startswith("/v1/messages") or (path.startswith("/v1/models") and "anthropic-version" in request.headers):
        return "anthropic"
    return "openai"


def _error_response(api: str, e: ApiError) -> JSONResponse:
    body = anthropic.error_body(e) if api == "anthropic" else openai.error_body(e)
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def build_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="FreeToken", docs_url=None, redoc_url=None, openapi_url=None)
    ctx.token_text = TokenText(ctx.tokenizer)
    engine_info = ctx.serving.describe()  # fixed for the server's life
    ctx.metrics.attach(ctx.serving, engine_info)
    app.state.ctx = ctx

    keys = [k.encode() for k in ctx.api_keys]  # a key's UTF-8 bytes: what a client sends for it

    def authorized(request: Request) -> bool:
        if not keys:
            return True
        auth = request.headers.get("authorization", "")
        # header values arrive decoded as latin-1: encoding them back gives the bytes that were sent
        sent = [t.encode("latin-1", "replace") for t in (auth[7:].strip() if auth.lower().startswith("bearer ")
                                                         else None, request.headers.get("x-api-key")) if t]
        # every key compared in constant time: the answer's timing tells nothing of a key's prefix
        return any([hmac.compare_digest(t, k) for t in sent for k in keys])

    def guarded(endpoint_name: str, handler):
        """Authentication, the API's error shape for every failure, and request counting.
        (A plain wrapper, not an HTTP middleware: those buffer streams and hide disconnects.)"""
        async def endpoint(request: Request):
            api = _api_of(request)
            try:
                if not authorized(request):
                    raise ApiError(401, "invalid or missing API key", kind="authentication_error",
                                   code="invalid_api_key")
                resp = await handler(request, api)
            except ApiError as e:
                resp = _error_response(api, e)
            except ClientGone:  # cancelled already; the status is for the log and /metrics only
                log.debug("client closed the connection on %s; request cancelled", request.url.path)
                resp = Response(status_code=499)
            except Exception:  # a bug: answer 500 in the API's shape, keep serving
                log.exception("unhandled error on %s", request.url.path)
                resp = _error_response(api, ApiError(500, "internal server error", kind="server_error"))
            ctx.metrics.requests.labels(api, endpoint_name, str(resp.status_code)).inc()
            return resp
        return endpoint

    def route(path: str, handler):
        async def call(request: Request, api: str):
            return await handler(ctx, parse_body(await request.body()), request)
        app.add_api_route(path, guarded(path, call), methods=["POST"])

    route("/v1/chat/completions", openai.chat_completions)
    route("/v1/completions", openai.completions)
    route("/v1/messages", anthropic.messages)
    route("/v1/messages/count_tokens", anthropic.count_tokens)
    route("/v1/responses", responses.create)
    for prefix in ("", "/v1"):  # vLLM and llama.cpp serve them at the root; clients with a /v1 base URL ask there
        route(prefix + "/tokenize", tokenize.tokenize)
        route(prefix + "/detokenize", tokenize.detokenize)

    async def stored_response(request: Request, api: str):
        return responses.stored(ctx, request.method, request.path_params["rid"])
    app.add_api_route("/v1/responses/{rid}", guarded("/v1/responses/{id}", stored_response), methods=["GET", "DELETE"])

    async def models(request: Request, api: str):
        return (anthropic if api == "anthropic" else openai).models(ctx)

    async def model(request: Request, api: str):
        return (anthropic if api == "anthropic" else openai).model(ctx, request.path_params["model"])
    app.add_api_route("/v1/models", guarded("/v1/models", models), methods=["GET"])
    # model ids may contain slashes (org/name)
    app.add_api_route("/v1/models/{model:path}", guarded("/v1/models/{model}", model), methods=["GET"])

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": ctx.model_names[0], **engine_info}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error_response(_api_of(request), ApiError(404, f"no route {request.url.path}", kind="not_found_error"))

    @app.exception_handler(405)
    async def bad_method(request: Request, exc):
        return _error_response(_api_of(request), ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    return app
