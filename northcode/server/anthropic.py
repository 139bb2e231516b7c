"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat engine path.

A Messages body is translated into the OpenAI chat body that /v1/chat/completions takes (system and
text blocks, tool_use as tool_calls, tool_result as tool messages, thinking as reasoning_content,
tools, tool_choice, thinking on or off), then rendered, run and parsed by chat.py's build_prompt and
start_chat_run, so one conversation renders the same prompt ids on either API and hits the same
prefix cache. The parser's deltas become content blocks (thinking, text, tool_use), sent whole or as
Anthropic's SSE events. Errors on these paths leave in Anthropic's shape (app.py asks
`anthropic_error` for it). Validation names Anthropic's fields; nothing here renders or decodes.
"""

from __future__ import annotations

import json
from functools import partial

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from northcode.engine.request import RequestOutput, Usage
from northcode.server.chat import SSE_HEADERS, build_prompt, start_chat_run
from northcode.server.errors import RequestError
from northcode.server.generation import EngineRun, engine_error
from northcode.server.output_parser import OutputParser
from northcode.server.request_body import read_json

PATH = "/v1/messages"
THINKING_SIGNATURE = "northcode"  # thinking blocks need a signature; this server neither signs nor checks them
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error"}
_OVERLOAD_CODES = ("server_busy", "model_loading")  # 503s worth retrying: overloaded_error


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


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


# --- routes ---


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


# --- request: Messages body -> chat body ---


def translate_request(body, needs_max_tokens: bool = True) -> tuple[dict, str, bool]:
    """(the equivalent /v1/chat/completions body, the model name to report, stream); RequestError if malformed."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model: a non-empty string is required (any name: the server has one model)", "model")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None or needs_max_tokens:
        if not _is_int(max_tokens) or max_tokens < 1:
            raise RequestError("max_tokens: an integer >= 1 is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty array is required", "messages")
    tools = _tools(body.get("tools"))
    chat = {"model": model, "messages": _system(body.get("system")) + _messages(messages), "max_tokens": max_tokens}
    if tools:
        chat["tools"] = tools
    chat.update(_tool_choice(body.get("tool_choice"), tools))
    reasoning = _thinking(body.get("thinking"), max_tokens)
    if reasoning is not None:
        chat["chat_template_kwargs"] = {"reasoning": reasoning}
    chat.update(_sampling(body))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean", "stream")
    return chat, model, stream


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _text_of(blocks: list, param: str) -> list[dict]:
    """Text blocks -> OpenAI text parts (joined without a separator, as the template joins them)."""
    return [_text_part(block, f"{param}[{j}]") for j, block in enumerate(blocks)]


def _text_part(block, where: str) -> dict:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise RequestError(f"{where}: only text blocks are supported here (got {kind!r})", where)
    return {"type": "text", "text": block["text"]}


def _system(system) -> list[dict]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise RequestError("system must be a string or an array of text blocks", "system")
    return [{"role": "system", "content": _text_of(system, "system")}]


def _messages(messages: list) -> list[dict]:
    out, tool_ids = [], set()
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{param}.role must be user, assistant or system", f"{param}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{param}.content must be a string or an array of content blocks", f"{param}.content")
        if message["role"] == "system":  # a system turn in the conversation (Claude Code sends them): rendered in place
            out.append({"role": "system", "content": _text_of(content, f"{param}.content")})
        elif message["role"] == "assistant":
            out.append(_assistant(content, f"{param}.content", tool_ids))
        else:
            out += _user(content, f"{param}.content", tool_ids)
    return out


def _block_type(block) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _user(blocks: list, param: str, tool_ids: set[str]) -> list[dict]:
    """Runs of text blocks become user messages and tool_result blocks tool messages, in their order."""
    out = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        kind = _block_type(block)
        if kind == "tool_result":
            out.append(_tool_result(block, where, tool_ids))
        elif kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append(_text_part(block, where))
            else:
                out.append({"role": "user", "content": [_text_part(block, where)]})
        else:
            raise RequestError(f"{where}: a user turn may hold text and tool_result blocks (got {kind!r}; "
                               "this model reads text only)", where)
    return out or [{"role": "user", "content": ""}]


def _tool_result(block: dict, param: str, tool_ids: set[str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in tool_ids:
        raise RequestError(f"{param}.tool_use_id = {call_id!r} matches no tool_use block of an earlier assistant turn",
                           f"{param}.tool_use_id")
    if not isinstance(block.get("is_error", False), bool | None):
        raise RequestError(f"{param}.is_error must be a boolean", f"{param}.is_error")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = _text_of(content, f"{param}.content")
    elif not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string or an array of text blocks", f"{param}.content")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant(blocks: list, param: str, tool_ids: set[str]) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"{param}[{j}]", _block_type(block)
        if kind == "text":
            texts.append(_text_part(block, where)["text"])
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # encrypted by another server: nothing this model can read
        elif kind == "tool_use":
            calls.append(_tool_use(block, where, tool_ids))
        else:
            raise RequestError(f"{where}: an assistant turn may hold text, thinking and tool_use blocks (got {kind!r})", where)
    message = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict, param: str, tool_ids: set[str]) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{param}.id must be a non-empty string", f"{param}.id")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{param}.name must be a non-empty string", f"{param}.name")
    if not isinstance(arguments, dict):
        raise RequestError(f"{param}.input must be an object", f"{param}.input")
    tool_ids.add(call_id)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise RequestError(f"{param}: only client tools (name, description, input_schema) are supported, "
                               f"not {kind!r}", param)
        name, description, schema = tool.get("name"), tool.get("description") or "", tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{param}.name must be a non-empty string", f"{param}.name")
        if not isinstance(description, str):
            raise RequestError(f"{param}.description must be a string", f"{param}.description")
        if not isinstance(schema, dict):
            raise RequestError(f"{param}.input_schema must be a JSON schema object", f"{param}.input_schema")
        out.append({"type": "function", "function": {"name": name, "description": description, "parameters": schema}})
    return out


def _tool_choice(choice, tools: list[dict]) -> dict:
    """{auto | any | tool (name) | none, disable_parallel_tool_use} -> tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise RequestError('tool_choice must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice.type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use")
    out = {"parallel_tool_calls": not parallel}
    if kind in ("any", "tool") and not tools:
        raise RequestError(f"tool_choice.type = {kind!r} needs tools", "tool_choice")
    if kind == "tool":
        name = choice.get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise RequestError(f"tool_choice.name = {name!r} is not one of the tools", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return out


def _thinking(thinking, max_tokens: int | None) -> bool | None:
    """enabled / adaptive -> reasoning on, disabled -> off, absent -> the model's default (on)."""
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind == "adaptive":
        return True
    if kind != "enabled":
        raise RequestError('thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} or '
                           '{"type": "disabled"}', "thinking.type")
    budget = thinking.get("budget_tokens")
    if not _is_int(budget) or budget < 1024:
        raise RequestError("thinking.budget_tokens must be an integer >= 1024", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise RequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
                           "thinking.budget_tokens")
    return True


def _sampling(body: dict) -> dict:
    out = {}
    for name, low, high in (("temperature", 0.0, 1.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise RequestError(f"{name} must be a number in [{low:g}, {high:g}]", name)
        out[name] = value
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k) or top_k < 0:
            raise RequestError("top_k must be an integer >= 0", "top_k")
        out["top_k"] = top_k
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop_sequences must be an array of non-empty strings", "stop_sequences")
        out["stop"] = stop
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise RequestError("metadata must be an object", "metadata")
    return out


# --- response: parser deltas -> content blocks and events ---


def usage_of(usage: Usage) -> dict:
    """Anthropic counts input as uncached + cache_read (+ cache_creation, always 0: the prefix cache fills itself)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens, "output_tokens": usage.completion_tokens}


def stop_reason_of(final: RequestOutput, parser: OutputParser) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished request."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if parser.tool_calls:
        return "tool_use", None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


class ContentBlocks:
    """Turns OutputParser deltas into Anthropic content blocks: the stream events, and the blocks whole.

    Thinking and text stream as they come. A tool call's arguments are held until its block closes and
    then sent as one input_json_delta, only if they are a JSON object: the SDKs parse every partial_json
    and raise on JSON that cannot be completed, so a cut-off or malformed call keeps its empty input.
    """

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: str | None = None  # the type of the block being written (the last one), None between blocks
        self._arguments: dict[int, str] = {}  # tool_calls index -> the JSON text so far, for non-streaming input

    def push(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        """The (event name, data) pairs for these deltas."""
        events = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._write("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            elif delta.get("content"):
                events += self._write("text", {"type": "text_delta", "text": delta["content"]})
            for call in delta.get("tool_calls", ()):
                events += self._tool_call(call)
        return events

    def close(self) -> list[tuple[str, dict]]:
        """Close the open block (a thinking block gets its signature first)."""
        if self._open is None:
            return []
        index, events = len(self.blocks) - 1, []
        if self._open == "thinking":
            self.blocks[index]["signature"] = THINKING_SIGNATURE
            events.append(_delta(index, {"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        elif self._open == "tool_use":
            text = self._arguments[next(reversed(self._arguments))]
            if _parsed_input(text) or text.strip() == "{}":  # broken JSON is never sent: SDKs fail on it
                events.append(_delta(index, {"type": "input_json_delta", "partial_json": text}))
        self._open = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _write(self, kind: str, delta: dict) -> list[tuple[str, dict]]:
        events = [] if self._open == kind else self.close() + self._start({"type": kind, kind: ""} | (
            {"signature": ""} if kind == "thinking" else {}))
        self.blocks[-1][kind] += delta[kind]
        return events + [_delta(len(self.blocks) - 1, delta)]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        self.blocks.append(dict(block))
        self._open = block["type"]
        return [("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block})]

    def _tool_call(self, call: dict) -> list[tuple[str, dict]]:
        fragment = call["function"].get("arguments", "")
        if "id" in call:  # the first delta of a call: a new tool_use block
            block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
                     "input": {}}
            events = self.close() + self._start(block)
            self._arguments[call["index"]] = ""
        else:
            assert self._open == "tool_use", "a call's arguments follow its name"
            events = []
        self._arguments[call["index"]] += fragment  # sent whole, once checked, when the block closes
        return events

    def whole(self) -> list[dict]:
        """The blocks of a non-streaming reply: each tool_use with its input parsed ({} if the JSON is broken)."""
        calls = iter(self._arguments.values())
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                block = block | {"input": _parsed_input(next(calls))}
            out.append(block)
        return out


def _parsed_input(text: str) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def sse_event(name: str, data: dict) -> bytes:
    """One Anthropic SSE event: `event: <name>` and its JSON data."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"event: {name}\ndata: {text}\n\n".encode()


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
