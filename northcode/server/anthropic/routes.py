"""The /v1/messages and /v1/messages/count_tokens handlers, and the Anthropic error shape.

A request is translated (request.py), then rendered, run and parsed by chat.py's build_prompt and
start_chat_run; its reply is sent whole or as Anthropic's events (content.py). Errors on these paths
leave as {"type": "error", "error": {type, message}}: app.py asks `anthropic_error` for the body.
"""

from __future__ import annotations

from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from northcode.server.anthropic.content import ContentBlocks, sse_event, stop_reason_of, usage_of
from northcode.server.anthropic.request import translate_request
from northcode.server.chat import SSE_HEADERS, build_prompt, start_chat_run
from northcode.server.generation import EngineRun, engine_error
from northcode.server.output_parser import OutputParser
from northcode.server.request_body import read_json

PATH = "/v1/messages"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error"}
_OVERLOAD_CODES = ("server_busy", "model_loading")  # 503s worth retrying: overloaded_error


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def retry_header(status: int) -> dict:
    """x-should-retry, which Anthropic's SDKs and Claude Code obey: no retry for a request that cannot succeed
    as it is (Claude Code retries even a 401 a dozen times, for minutes, without it)."""
    return {"x-should-retry": "false"} if 400 <= status < 500 and status not in (408, 409, 429) else {}


def anthropic_error(status: int, body: dict) -> dict:
    """The OpenAI error body the server builds -> Anthropic's {"type": "error", "error": {type, message}}."""
    error = body.get("error") or {}
    kind = _ERROR_TYPES.get(status)
    if kind is None:
        kind = "overloaded_error" if status == 503 and error.get("code") in _OVERLOAD_CODES else "api_error"
    message = error.get("message", "")
    if error.get("code") == "context_length_exceeded":  # Anthropic's words, which Claude Code reads to compact
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


async def messages(request: Request):
    state = request.app.state.server
    state.require_ready()
    body = await read_json(request)
    chat_body, model, stream = await run_in_threadpool(translate_request, body)
    chat, prompt_ids = await run_in_threadpool(partial(build_prompt, fits_context=True), state, chat_body)
    run, parser = await start_chat_run(state, request, chat, prompt_ids, "msg")
    reply = _Reply(run, model, len(prompt_ids))
    if stream:
        return StreamingResponse(_stream(state, run, parser, reply), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await _complete(state, run, parser, reply))


async def count_tokens(request: Request) -> JSONResponse:
    """{"input_tokens": N}: the prompt a /v1/messages request with this body would render."""
    state = request.app.state.server
    state.require_ready()
    body = await read_json(request)
    chat_body, _, _ = await run_in_threadpool(partial(translate_request, needs_max_tokens=False), body)
    _, prompt_ids = await run_in_threadpool(build_prompt, state, chat_body)
    return JSONResponse({"input_tokens": len(prompt_ids)})


class _Reply:
    """What a reply's envelope needs: its id, the model name the client sent, the prompt's length."""

    def __init__(self, run: EngineRun, model: str, num_prompt_tokens: int) -> None:
        self.id = "msg_" + run.request_id.removeprefix("msg-")
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens

    def message(self, content: list[dict], usage: dict, stop: tuple[str | None, str | None] = (None, None)) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


async def _complete(state, run: EngineRun, parser: OutputParser, reply: _Reply) -> dict:
    blocks, final = ContentBlocks(), None
    async for out in run.outputs():
        blocks.push(parser.feed(out.token_ids))
        final = out
    blocks.push(parser.finish())
    blocks.close()  # a last thinking block gets its signature
    if final is not None and final.finish_reason == "error":
        raise engine_error(state, final)
    state.metrics.record_finished(final)
    return reply.message(blocks.whole(), usage_of(final.usage), stop_reason_of(final, parser))


async def _stream(state, run: EngineRun, parser: OutputParser, reply: _Reply):
    start_usage = {"input_tokens": reply.num_prompt_tokens, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0, "output_tokens": 0}
    yield sse_event("message_start", {"type": "message_start", "message": reply.message([], start_usage)})
    yield sse_event("ping", {"type": "ping"})
    blocks, final = ContentBlocks(), None
    async for out in run.outputs():
        final = out
        for name, data in blocks.push(parser.feed(out.token_ids)):
            yield sse_event(name, data)
    for name, data in blocks.push(parser.finish()) + blocks.close():
        yield sse_event(name, data)
    if final is not None and final.finish_reason == "error":
        err = engine_error(state, final)
        yield sse_event("error", anthropic_error(err.status, err.body()))
        return
    state.metrics.record_finished(final)
    stop_reason, stop_sequence = stop_reason_of(final, parser)
    yield sse_event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": usage_of(final.usage)})
    yield sse_event("message_stop", {"type": "message_stop"})
