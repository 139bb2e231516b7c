"""create_app: the starlette application: routes, the API-key check, and the error handlers.

Every failure leaves as the OpenAI error body {"error": {message, type, param, code}} with a
fitting status: RequestError carries its own, an unknown route is a 404, anything unexpected a
500 whose message names the exception (the traceback goes to the log once, never to the client).
A 4xx or 500 sent whole leaves the connection open for the client's next request; a client that
hung up before its body arrived is counted as 499 and logged nowhere. Work that grows with the
request (parsing, rendering, tokenizing) runs in worker threads, never on the event loop.
The handlers for the two generation endpoints live in chat.py and completions.py.
"""

from __future__ import annotations

import hmac
import logging
import os
import re

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from northcode.paths import model_display_name, synthetic_info
from northcode.server.anthropic import anthropic_error, count_tokens, is_anthropic_path, messages, retry_header
from northcode.server.chat import build_prompt, chat_completions
from northcode.server.completions import completions, prompt_ids_of
from northcode.server.errors import RequestError, error_body
from northcode.server.request_body import read_json
from northcode.server.responses_api import ResponseStore, create_response, delete_response, get_response
from northcode.server.state import ServerState

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (monitoring)
UNKNOWN_ROUTE = "unknown"  # /metrics' one label for every path no route serves (each its own would grow without end)


async def health(request: Request) -> JSONResponse:
    """200 when ready (with the backend that runs the model), 503 while loading, after a failed load or
    once the engine has failed for good; `pid` names the process to stop."""
    state = request.app.state.server
    pid = os.getpid()
    if state.engine_error is not None:
        return JSONResponse({"status": "error", "error": state.engine_error, "pid": pid}, status_code=503)
    if state.load_error is not None:
        return JSONResponse({"status": "error", "phase": state.phase, "error": state.load_error, "pid": pid}, status_code=503)
    if not state.ready:
        return JSONResponse({"status": "loading", "phase": state.phase, "pid": pid}, status_code=503)
    body = {"status": "ok", "model": state.options.model_name, "backend": state.engine.stats()["backend"], "pid": pid}
    if state.model_dir is not None:
        body["display_name"] = model_display_name(state.model_dir)  # says RANDOM WEIGHTS when they are
    return JSONResponse(body)


async def models(request: Request) -> JSONResponse:
    state = request.app.state.server
    state.require_ready()
    return JSONResponse({"object": "list", "data": [model_card(state)]})


def model_card(state: ServerState) -> dict:
    """The /v1/models entry: OpenAI's fields, vLLM's root/parent/max_model_len, and what the weights are.

    `root` is the checkpoint folder on the server's machine (vLLM's convention); `backend` is the engine's
    decode backend (torch or megakernel). `display_name` and
    `random_weights` let a client that did not start the server see that a demo or synthetic
    checkpoint answers with noise.
    """
    card = {"id": state.options.model_name, "object": "model", "created": state.created, "owned_by": "northcode",
            "root": state.options.model_name, "parent": None, "max_model_len": state.engine.max_model_len,
            "backend": state.engine.stats()["backend"]}
    if state.model_dir is not None:
        card["root"] = str(state.model_dir)
        card["display_name"] = model_display_name(state.model_dir)
        card["random_weights"] = synthetic_info(state.model_dir) is not None
    return card


async def metrics(request: Request) -> Response:
    from northcode.server.metrics import CONTENT_TYPE

    state = request.app.state.server
    stats = state.engine.stats() if state.ready else None
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> JSONResponse:
    """{"prompt": str} or a chat body ({"messages", "tools", ...}) -> {"tokens", "count", "max_model_len"}."""
    state = request.app.state.server
    state.require_ready()
    body = await read_json(request)
    ids = await run_in_threadpool(_tokenize, state, body)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.engine.max_model_len})


def _tokenize(state: ServerState, body) -> list[int]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if isinstance(body.get("prompt"), str):
        prompt = body["prompt"]
        with_bos = body.get("add_special_tokens", True) is not False
        return prompt_ids_of(state.engine.tokenizer, prompt, with_bos=with_bos)
    if "messages" in body:
        return build_prompt(state, body)[1]  # exactly what a chat request with this body would send
    raise RequestError("send either prompt (a string) or messages (an array)", "prompt")


async def detokenize(request: Request) -> JSONResponse:
    state = request.app.state.server
    state.require_ready()
    body = await read_json(request)
    return JSONResponse({"prompt": await run_in_threadpool(_detokenize, state.engine.tokenizer, body)})


def _detokenize(tokenizer, body) -> str:
    tokens = body.get("tokens") if isinstance(body, dict) else None
    vocab = tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
        raise RequestError(f"tokens must be an array of token ids in [0, {vocab})", "tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)


def _error_response(status: int, body: dict, headers: dict | None = None, path: str = "") -> JSONResponse:
    if is_anthropic_path(path):  # Anthropic's clients read their own error shape
        body, headers = anthropic_error(status, body), {**(headers or {}), **retry_header(status)}
    return JSONResponse(body, status_code=status, headers=headers)


async def _on_request_error(request: Request, exc: RequestError) -> JSONResponse:
    return _error_response(exc.status, exc.body(), exc.headers, request.url.path)


async def _on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _error_response(exc.status_code, error_body(message, kind), getattr(exc, "headers", None), request.url.path)


async def _on_client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """The client hung up before its body arrived: nobody is left to answer; 499 is what /metrics counts."""
    return Response(status_code=499)


def _unexpected_response(scope, exc: Exception) -> JSONResponse:
    log.exception("unexpected error in %s %s", scope.get("method"), scope["path"])
    return _error_response(500, error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), path=scope["path"])


class GuardMiddleware:
    """API-key check (Authorization: Bearer KEY, or x-api-key) and the per-endpoint request counter, whose
    label is the route's path ("/v1/responses/{id}" for every id), UNKNOWN_ROUTE where no route matches."""

    def __init__(self, app, state: ServerState, routes: list[Route]) -> None:
        self.app = app
        self.state = state
        self.labels = [(route.path_regex, re.sub(r"\{\w+\}", "{id}", route.path)) for route in routes]

    def endpoint_label(self, path: str) -> str:
        return next((label for regex, label in self.labels if regex.match(path)), UNKNOWN_ROUTE)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        key = self.state.options.api_key
        if key and path not in OPEN_PATHS and not _has_key(scope, key):
            body = RequestError("missing or wrong API key: send Authorization: Bearer <key> (or x-api-key: <key>)", status=401,
                                code="invalid_api_key")
            self.state.metrics.count_request(self.endpoint_label(path), 401)
            return await _error_response(401, body.body(), {"WWW-Authenticate": "Bearer"}, path)(scope, receive, send)
        status = {}

        async def send_recording(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_recording)
        except Exception as exc:  # a bug. Answered here rather than by starlette, which re-raises, so that
            if "code" in status:  # uvicorn would log it twice and close the connection; once the response
                raise  # has started only closing the connection can end it
            await _unexpected_response(scope, exc)(scope, receive, send_recording)
        finally:
            if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                self.state.metrics.count_request(self.endpoint_label(path), status.get("code", 500))


def _has_key(scope, key: str) -> bool:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    given = headers.get("authorization", "")
    given = given[7:].strip() if given.lower().startswith("bearer ") else headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), key.encode())


def create_app(state: ServerState) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    handlers = {RequestError: _on_request_error, HTTPException: _on_http_error, ClientDisconnect: _on_client_gone}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.server = state
    app.state.response_store = ResponseStore()  # /v1/responses kept for previous_response_id
    app.add_middleware(GuardMiddleware, state=state, routes=routes)
    if state.options.allowed_origins:  # outermost: a browser's preflight is answered before the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=list(state.options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
