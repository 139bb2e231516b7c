"""A streaming client for any OpenAI-compatible chat endpoint, on httpx.

`stream_chat` posts one /v1/chat/completions request with `stream: true` and
`stream_options.include_usage`, and yields deltas (reasoning, content, tool-call starts and
argument fragments) as they arrive, then one `Completion` with the assembled message, usage
and timings. Cancelling the task that iterates closes the HTTP response, so the server sees
the disconnect and aborts the request (that is how Esc stops a generation for real). Tool-call deltas are assembled
by index, as OpenAI streams them: id/name on the first delta, argument fragments after.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from northcode.config import env_api_key


class EndpointError(RuntimeError):
    """The endpoint could not be reached or answered with an error; the message says which."""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as OpenAI sends it

    def to_message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    kind: str  # "reasoning" | "content" | "tool_call" (a call starts) | "tool_arguments" (a fragment of its arguments)
    text: str  # the fragment; for "tool_call" the tool's name
    elapsed_s: float  # since the request was sent
    num_chunks: int  # content-bearing chunks so far (a live proxy for generated tokens)
    call_idx: int | None = None  # for "tool_call" and "tool_arguments": the call's index in the reply
    call_id: str | None = None  # for "tool_call": the call's id, where the server sent it with the name


@dataclass
class Completion:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None  # OpenAI usage: prompt_tokens, completion_tokens, prompt_tokens_details...
    ttft_s: float | None = None  # time to the first generated fragment
    total_s: float = 0.0

    def to_message(self) -> dict:
        """The assistant message to append to the conversation (content "" when only tool calls)."""
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.to_message() for call in self.tool_calls]
        return message

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def decode_tokens_per_s(self) -> float | None:
        tokens = self.completion_tokens
        if not tokens or self.ttft_s is None or self.total_s <= self.ttft_s:
            return None
        return max(tokens - 1, 1) / (self.total_s - self.ttft_s)  # the first token is paid by TTFT


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(server root, OpenAI base URL) for 'http://host:port' or 'http://host:port/v1'."""
    url = endpoint.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--endpoint {endpoint!r}: expected an http:// or https:// URL")
    root = url[: -len("/v1")] if url.endswith("/v1") else url
    return root, root + "/v1"


API_KEY_ENV = "NORTHCODE_API_KEY"  # the key for an endpoint that wants one (`northcode serve --api-key`)
_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


def error_message(response_body: bytes, status: int) -> str:
    hint = f" (set {API_KEY_ENV} to the server's API key)" if status == 401 else ""
    try:
        error = json.loads(response_body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"HTTP {status}: {error['message']}{hint}"
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {response_body[:300].decode('utf-8', errors='replace')}{hint}"


class ChatClient:
    """One endpoint (root and /v1 base) and the model name to request."""

    def __init__(self, endpoint: str, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        """`api_key` defaults to $NORTHCODE_API_KEY (a key on the command line would show in `ps`)."""
        self.root, self.base_url = split_endpoint(endpoint)
        self.model = model
        api_key = api_key if api_key is not None else env_api_key()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def list_models(self) -> list[dict]:
        data = await self._get_json(self.base_url + "/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise EndpointError(f"{self.base_url}/models: no model list in the answer")
        return models

    async def resolve_model(self) -> str:
        """The model to request: the configured one, else the first the endpoint lists."""
        if self.model is None:
            models = await self.list_models()
            if not models:
                raise EndpointError(f"{self.base_url}/models: the endpoint serves no model")
            self.model = str(models[0].get("id"))
        return self.model

    async def metrics_text(self) -> str | None:
        """The Prometheus text of /metrics, or None where the endpoint has none (not northcode)."""
        try:
            response = await self.http.get(self.root + "/metrics", timeout=2.0)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def _get_json(self, url: str) -> dict:
        try:
            response = await self.http.get(url)
        except httpx.HTTPError as err:
            raise EndpointError(_transport_error(url, err)) from None
        if response.status_code != 200:
            raise EndpointError(f"{url}: {error_message(response.content, response.status_code)}")
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{url}: the answer is not JSON (is this an OpenAI-compatible server?)") from None

    async def stream_chat(self, messages: list[dict], tools: list[dict] | None = None,
                          **params) -> AsyncIterator[Delta | Completion]:
        """Deltas as they stream, then the Completion. Extra `params` join the request body."""
        body = {"model": await self.resolve_model(), "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **params}
        if tools:
            body["tools"] = tools
        start = time.monotonic()
        result = Completion()
        assembler = _ToolCallAssembler()
        num_chunks = 0
        url = self.base_url + "/chat/completions"
        try:
            async with self.http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    raise EndpointError(f"{url}: {error_message(await response.aread(), response.status_code)}")
                async for chunk in _sse_chunks(response):
                    if "error" in chunk:
                        raise EndpointError(f"{url}: {chunk['error'].get('message', chunk['error'])}")
                    if chunk.get("usage"):
                        result.usage = chunk["usage"]
                    for choice in chunk.get("choices") or []:
                        for kind, text, call_idx, call_id in _choice_fragments(choice, assembler):
                            num_chunks += 1
                            now = time.monotonic() - start
                            if result.ttft_s is None:
                                result.ttft_s = now
                            if kind == "content":
                                result.content += text
                            elif kind == "reasoning":
                                result.reasoning += text
                            yield Delta(kind, text, now, num_chunks, call_idx, call_id)
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as err:
            raise EndpointError(_transport_error(url, err)) from None
        result.tool_calls = assembler.calls()
        result.total_s = time.monotonic() - start
        yield result


def _transport_error(url: str, err: httpx.HTTPError) -> str:
    if isinstance(err, httpx.ConnectError):
        return f"cannot reach {url}: {err or 'connection refused'}"
    if isinstance(err, httpx.TimeoutException):
        return f"{url}: no answer in time ({type(err).__name__})"
    return f"{url}: the connection failed ({type(err).__name__}: {err})"


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """An SSE stream's lines, ended only at CR, LF or CRLF as the SSE spec says. httpx's aiter_lines also ends
    them at U+2028, U+0085 and the other str.splitlines breaks, which a server may leave raw inside its JSON."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = _SSE_LINE_END.split(rest + text)  # a CRLF split across two reads yields one blank line more
        for line in lines:
            yield line
    if rest:
        yield rest


async def _sse_chunks(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON payloads of an SSE stream's `data:` lines, up to `data: [DONE]`."""
    async for line in _sse_lines(response):
        if not line.startswith("data:"):
            continue  # blank separators, comments (": keep-alive"), event names
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            raise EndpointError(f"the stream sent a line that is not JSON: {payload[:200]!r}") from None
        if isinstance(chunk, dict):
            yield chunk


def _choice_fragments(choice: dict, assembler: _ToolCallAssembler) -> list[tuple[str, str, int | None, str | None]]:
    """(kind, text, call index, call id) for each fragment of one streamed choice."""
    delta = choice.get("delta") or {}
    fragments: list[tuple[str, str, int | None, str | None]] = []
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning:
        fragments.append(("reasoning", reasoning, None, None))
    if delta.get("content"):
        fragments.append(("content", delta["content"], None, None))
    for call_delta in delta.get("tool_calls") or []:
        if not isinstance(call_delta, dict):
            continue
        call_idx, name = assembler.add(call_delta)
        if name:
            fragments.append(("tool_call", name, call_idx, assembler.by_index[call_idx]["id"]))
        arguments = (call_delta.get("function") or {}).get("arguments")
        if arguments:
            fragments.append(("tool_arguments", arguments, call_idx, None))
    return fragments


class _ToolCallAssembler:
    """Joins streamed tool-call deltas by index into whole calls."""

    def __init__(self) -> None:
        self.by_index: dict[int, dict] = {}

    def add(self, call_delta: dict) -> tuple[int, str | None]:
        """Adds one delta; returns its call's index, and the tool's name when this delta starts the call."""
        function = call_delta.get("function") or {}
        index = call_delta.get("index")
        if not isinstance(index, int):  # servers that leave out `index`: a fragment continues the last call
            starts = call_delta.get("id") or function.get("name") or not self.by_index
            index = len(self.by_index) if starts else max(self.by_index)
        started = index not in self.by_index
        call = self.by_index.setdefault(index, {"id": None, "name": "", "arguments": ""})
        call["id"] = call["id"] or call_delta.get("id")
        if function.get("name") and not call["name"]:
            call["name"] = function["name"]
        call["arguments"] += function.get("arguments") or ""
        return index, (call["name"] if started and call["name"] else None)

    def calls(self) -> list[ToolCall]:
        return [ToolCall(c["id"] or f"call_{uuid.uuid4().hex[:24]}", c["name"], c["arguments"] or "{}")
                for _, c in sorted(self.by_index.items())]
