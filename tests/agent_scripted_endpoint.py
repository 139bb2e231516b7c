"""A real OpenAI-compatible HTTP endpoint that replays scripted answers, for agent and TUI tests.

`ScriptedEndpoint` runs starlette + uvicorn in a thread on a free loopback port. Each POST to
/v1/chat/completions takes the next scripted reply and streams it exactly as OpenAI does
(role chunk, reasoning/content fragments, tool-call deltas with index/id/name first and
argument fragments after, finish_reason, a usage chunk with `choices: []`, `[DONE]`). It
records every request body, and whether a stream was cut by the client (disconnects).
`RecordingAsker` answers the agent's approval questions from a script and keeps the calls it was asked about.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

MODEL_ID = "scripted-model"


class RecordingAsker:
    def __init__(self, *decisions) -> None:  # approvals.Decision values, in the order they are asked
        self.decisions = list(decisions)
        self.asked = []

    async def __call__(self, call):
        self.asked.append(call)
        return self.decisions.pop(0)


def text_reply(content: str, reasoning: str = "", delay_s: float = 0.0, cached_tokens: int = 0) -> dict:
    return {"content": content, "reasoning": reasoning, "tool_calls": [], "delay_s": delay_s,
            "cached_tokens": cached_tokens}


def tool_reply(*calls: tuple[str, dict | str], content: str = "", finish_reason: str = "tool_calls",
               fragment_chars: int = 7, delay_s: float = 0.0) -> dict:
    """A reply that calls tools: (name, arguments as a dict or a raw string) per call. The arguments
    stream in fragments of `fragment_chars`, `delay_s` apart; finish_reason "length" plays a reply
    cut off by max_tokens."""
    return {"content": content, "reasoning": "", "delay_s": delay_s, "cached_tokens": 0, "finish_reason": finish_reason,
            "fragment_chars": fragment_chars,
            "tool_calls": [(name, args if isinstance(args, str) else json.dumps(args)) for name, args in calls]}


def error_reply(message: str, status: int = 503) -> dict:
    """An OpenAI-shaped error answer, before any streamed byte."""
    return {"error": message, "status": status}


def prompt_tokens(messages: list[dict]) -> int:
    """What the fake reports as the prompt's length: 50 per message (independent of temp paths)."""
    return 50 * len(messages)


def raw_reply(sse_text: str, status: int = 200) -> dict:
    """A reply streamed byte for byte as given (for malformed or unusual streams), with `status`."""
    return {"raw": sse_text, "status": status}


def _chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> str:
    body: dict = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": MODEL_ID,
                  "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _invalid_history_arguments(messages: list[dict]) -> str | None:
    """What northcode serve says of an assistant tool call whose arguments are not a JSON object."""
    for message_idx, message in enumerate(messages):
        for call_idx, call in enumerate(message.get("tool_calls") or []):
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                return f"messages[{message_idx}].tool_calls[{call_idx}].function.arguments is not a JSON object"
    return None


class _KeyCheck:
    """Plain ASGI middleware (it leaves streams and client disconnects alone): 401 without the key."""

    def __init__(self, app, endpoint: ScriptedEndpoint) -> None:
        self.app, self.endpoint = app, endpoint

    async def __call__(self, scope, receive, send) -> None:
        key = self.endpoint.api_key
        if key and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"").decode()
            if given != f"Bearer {key}":
                body = {"error": {"message": "invalid or missing API key", "type": "authentication_error"}}
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ThreadedServer:
    """An ASGI app served by uvicorn on a free loopback port in a daemon thread: start() returns once it listens."""

    def __init__(self, app, lifespan: str = "auto") -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan=lifespan))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, what: str) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def _fragments(text: str) -> list[str]:
    words = text.split(" ")
    return [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words) if w or i < len(words) - 1]


class ScriptedEndpoint:
    def __init__(self, replies: list[dict] | None = None, context_len: int = 4096, loading_polls: int = 0,
                 model_card: dict | None = None, api_key: str | None = None) -> None:
        self.replies = list(replies or [])
        self.api_key = api_key  # when set, /v1/* wants `Authorization: Bearer <key>`, as northcode serve --api-key
        self.model_card = model_card or {}  # extra /v1/models fields: northcode serve's root, display_name...
        self.requests: list[dict] = []
        self.disconnects = 0  # streams the client closed before the end
        self.finished = 0  # streams sent to the end
        self.context_len = context_len
        self.loading_polls = loading_polls  # /health answers 503 "loading weights" this many times first
        self.kv_pages_used = 12  # of 48: what /metrics reports (a test changes it to see the status line follow)
        app = Starlette(middleware=[Middleware(_KeyCheck, endpoint=self)], routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models), Route("/health", self._health), Route("/metrics", self._metrics),
        ])
        self._server = ThreadedServer(app, lifespan="off")
        self.port = self._server.port
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedEndpoint:
        self._server.start("scripted endpoint")
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    async def _models(self, request: Request) -> JSONResponse:
        card = {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "tests", "max_model_len": self.context_len}
        return JSONResponse({"object": "list", "data": [{**card, **self.model_card}]})

    async def _health(self, request: Request) -> JSONResponse:
        if self.loading_polls > 0:
            self.loading_polls -= 1
            return JSONResponse({"status": "loading", "phase": "loading weights"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"# TYPE northcode_kv_pages_used gauge\nnorthcode_kv_pages_used {self.kv_pages_used}\n"
                                 "# TYPE northcode_kv_pages_total gauge\nnorthcode_kv_pages_total 48\n")

    async def _chat(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        self.requests.append(body)
        invalid = _invalid_history_arguments(body["messages"])
        if invalid:  # northcode serve (and OpenAI) refuse these: the agent must never send them
            return JSONResponse({"error": {"message": invalid, "type": "invalid_request_error"}}, 400)
        if not self.replies:
            return JSONResponse({"error": {"message": "the script has no more replies", "type": "test"}}, 500)
        reply = self.replies.pop(0)
        if "error" in reply:
            return JSONResponse({"error": {"message": reply["error"], "type": "test"}}, reply["status"])
        if "raw" in reply:
            return StreamingResponse(iter([reply["raw"]]), status_code=reply["status"], media_type="text/event-stream")
        return StreamingResponse(self._stream(reply, prompt_tokens(body["messages"])),
                                 media_type="text/event-stream")

    async def _stream(self, reply: dict, prompt_tokens: int):
        num_tokens = 0
        try:
            yield _chunk({"role": "assistant", "content": ""})
            for kind, text in [("reasoning_content", reply["reasoning"]), ("content", reply["content"])]:
                for fragment in _fragments(text):
                    await asyncio.sleep(reply["delay_s"])
                    num_tokens += 1
                    yield _chunk({kind: fragment})
            for call_idx, (name, arguments) in enumerate(reply["tool_calls"]):
                yield _chunk({"tool_calls": [{"index": call_idx, "id": f"call_{call_idx}_{len(self.requests)}",
                                              "type": "function", "function": {"name": name, "arguments": ""}}]})
                size = reply.get("fragment_chars", 7)
                for start in range(0, len(arguments), size):  # argument fragments, as a model streams them
                    await asyncio.sleep(reply["delay_s"])
                    yield _chunk({"tool_calls": [{"index": call_idx, "function": {"arguments": arguments[start:start + size]}}]})
                num_tokens += len(arguments) // 4 + 2
            yield _chunk({}, finish=reply.get("finish_reason") or ("tool_calls" if reply["tool_calls"] else "stop"))
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens,
                     "total_tokens": prompt_tokens + num_tokens,
                     "prompt_tokens_details": {"cached_tokens": reply["cached_tokens"]}}
            yield _chunk(None, usage=usage)
            yield "data: [DONE]\n\n"
            self.finished += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnects += 1
            raise
