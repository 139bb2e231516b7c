"""POST /v1/responses (OpenAI's Responses API, the one Codex CLI speaks), and GET/DELETE of a stored response.

A request is translated into the chat body it means (responses_input.py) and runs build_prompt and
start_chat_run exactly as /v1/chat/completions does: the same template, tool markup, output parser and
prefix cache, so one conversation renders the same prompt ids through either API. OutputItems turns the
parser's deltas into output items (reasoning, message, function_call) and, for a stream, into the
Responses events in order (`event: <type>` lines; each event's data has its type and sequence_number),
ending in response.completed, response.incomplete (max_output_tokens) or response.failed. Responses
not sent with `store: false` are kept in memory (ResponseStore, bounded) for previous_response_id and
GET/DELETE /v1/responses/{id}; a restart forgets them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from northcode.engine.request import Usage
from northcode.server.chat import SSE_HEADERS, build_prompt, start_chat_run
from northcode.server.errors import RequestError
from northcode.server.generation import EngineRun, engine_error
from northcode.server.output_parser import OutputParser
from northcode.server.request_body import read_json
from northcode.server.responses import sse
from northcode.server.responses_input import chat_body, echoed_tools, in_responses_terms, input_items, tool_namespaces

MAX_STORED_RESPONSES = 256
MAX_STORED_BYTES = 64 << 20  # the JSON of the stored conversations, together


class ResponseStore:
    """The last responses created with `store` on, each with the whole conversation it ends (for
    previous_response_id), least recently used first out past MAX_STORED_RESPONSES or MAX_STORED_BYTES."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES) -> None:
        self._records: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()  # id -> (response, items, bytes)
        self._max_responses, self._max_bytes, self._bytes = max_responses, max_bytes, 0

    def put(self, response: dict, items: list[dict], size: int) -> None:
        """Keep `response` and the conversation it ends; `size` is stored_size(response, items)."""
        self._records[response["id"]] = (response, items, size)
        self._bytes += size
        while len(self._records) > self._max_responses or (self._bytes > self._max_bytes and len(self._records) > 1):
            self._bytes -= self._records.popitem(last=False)[1][2]

    @staticmethod
    def stored_size(response: dict, items: list[dict]) -> int:
        """The bytes a record counts for; it grows with the conversation: call it in a worker thread."""
        return len(json.dumps([response, items], ensure_ascii=False))

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        record = self._records.get(response_id)
        if record is None:
            return None
        self._records.move_to_end(response_id)
        return record[0], record[1]

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is not None:
            self._bytes -= record[2]
        return record is not None


# --- routes ---


async def create_response(request: Request):
    state = request.app.state.server
    state.require_ready()
    body = await read_json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    items = _conversation(request.app.state.response_store, body)
    chat, prompt_ids = await run_in_threadpool(_build, state, body, items)
    run, parser = await start_chat_run(state, request, chat, prompt_ids, "resp")
    turn = ResponseTurn(state, run, parser, body, items, request.app.state.response_store)
    if chat.options.stream:
        return StreamingResponse(turn.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await turn.complete())


async def get_response(request: Request) -> JSONResponse:
    return JSONResponse(_stored(request)[0])


async def delete_response(request: Request) -> JSONResponse:
    response_id = _stored(request)[0]["id"]
    request.app.state.response_store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _stored(request: Request) -> tuple[dict, list[dict]]:
    response_id = request.path_params["response_id"]
    record = request.app.state.response_store.get(response_id)
    if record is None:
        raise RequestError(f"no response with id {response_id!r} is held by this server (only responses created with "
                           f"store on, the last {MAX_STORED_RESPONSES}, since it started)", status=404)
    return record


def _conversation(store: ResponseStore, body: dict) -> list[tuple[str, dict]]:
    """The items the prompt is made of, each with the field it came from: the stored conversation of
    previous_response_id, then this request's input."""
    previous_id = body.get("previous_response_id")
    history: list[dict] = []
    if previous_id is not None:
        record = store.get(previous_id) if isinstance(previous_id, str) else None
        if record is None:
            raise RequestError(f"Previous response with id {previous_id!r} not found: this server holds only responses "
                               f"created with store on (the last {MAX_STORED_RESPONSES}, in memory, since it started); "
                               "send the whole conversation as input instead", "previous_response_id",
                               code="previous_response_not_found")
        history = record[1]
    items = [("previous_response_id", item) for item in history]
    return items + [(f"input[{i}]", item) for i, item in enumerate(input_items(body.get("input")))]


def _build(state, body: dict, items: list[tuple[str, dict]]):
    """The chat request and its prompt ids, as /v1/chat/completions builds them (a worker thread)."""
    chat, sources = chat_body(body, items)
    try:
        return build_prompt(state, chat, fits_context=True)
    except RequestError as err:
        raise in_responses_terms(err, sources) from None


# --- the turn: output items, events, the response object ---


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The parser's deltas -> output items in the order the model wrote them, and their stream events
    (type, data without sequence_number). An item stays open until another kind of output begins."""

    def __init__(self, namespaces: dict[str, str]) -> None:
        self._namespaces = namespaces  # function name -> its namespace, which its calls carry
        self.items: list[dict] = []
        self._open: dict | None = None
        self._calls: dict[int, dict] = {}  # the parser's tool_calls index -> its function_call item
        self._events: list[tuple[str, dict]] = []

    def add(self, delta: dict) -> None:
        if "reasoning_content" in delta:
            self._add_text("reasoning", delta["reasoning_content"])
        elif "content" in delta:
            self._add_text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            if "id" in call:
                name = call["function"]["name"]
                item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                        "name": name, "arguments": ""}
                if name in self._namespaces:
                    item["namespace"] = self._namespaces[name]
                self._open_item(item)
                self._calls[call["index"]] = item
            item = self._calls[call["index"]]
            if call["function"]["arguments"]:
                item["arguments"] += call["function"]["arguments"]
                self._emit("response.function_call_arguments.delta", item, delta=call["function"]["arguments"])

    def finish(self, status: str) -> None:
        """Close the item still open with `status` (completed, or incomplete when the output was cut off)."""
        if self._open is not None:
            self._close(status)

    def take(self) -> list[tuple[str, dict]]:
        events, self._events = self._events, []
        return events

    def _add_text(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            if kind == "reasoning":
                self._open_item({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                 "status": "in_progress"})
                part = {"type": "reasoning_text", "text": ""}
            else:
                self._open_item({"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                                 "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._emit("response.content_part.added", self._open, content_index=0, part=part)
            self._open["content"].append(dict(part))
        self._open["content"][0]["text"] += text
        if kind == "reasoning":
            self._emit("response.reasoning_text.delta", self._open, content_index=0, delta=text)
        else:
            self._emit("response.output_text.delta", self._open, content_index=0, delta=text, logprobs=[])

    def _open_item(self, item: dict) -> None:
        if self._open is not None:
            self._close("completed")
        self._open = item
        self.items.append(item)
        added = dict(item, content=[]) if "content" in item else dict(item)  # as it is now: its content comes later
        self._events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": added}))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        item["status"] = status
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", item, arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            self._emit(done, item, content_index=0, text=part["text"], **extra)
            self._emit("response.content_part.done", item, content_index=0, part=dict(part))
        self._events.append(("response.output_item.done", {"output_index": self.items.index(item), "item": item}))

    def _emit(self, kind: str, item: dict, **data) -> None:
        self._events.append((kind, {"item_id": item["id"], "output_index": self.items.index(item), **data}))


def response_usage(usage: Usage, reasoning_tokens: int) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class ResponseTurn:
    """One response's generation: the same OutputItems for a stream and a plain reply, then the store."""

    def __init__(self, state, run: EngineRun, parser: OutputParser, body: dict, items: list[tuple[str, dict]],
                 store: ResponseStore) -> None:
        self.state, self.run, self.parser, self.body, self.store = state, run, parser, body, store
        self.conversation = [item for _, item in items]
        self.output = OutputItems(tool_namespaces(body.get("tools")))
        self.created_at = int(time.time())

    def response(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        body, reasoning = self.body, self.body.get("reasoning") if isinstance(self.body.get("reasoning"), dict) else {}
        return {
            "id": self.run.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": self.state.options.model_name, "output": self.output.items,
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.get("store") is not False, "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice") or "auto",
            "tools": echoed_tools(body.get("tools")), "top_p": body.get("top_p"), "truncation": "disabled",
            "usage": usage, "user": body.get("user"), "metadata": body.get("metadata") or {},
        }

    async def complete(self) -> dict:
        final = None
        async for out in self.run.outputs():
            final = out
            self._add(self.parser.feed(out.token_ids))
            self.output.take()  # a plain reply sends no events
        self._add(self.parser.finish())
        if final.finish_reason == "error":
            raise engine_error(self.state, final)
        return await self._finished(final)

    async def stream(self):
        sequence_number = 0

        def event(kind: str, data: dict) -> bytes:
            nonlocal sequence_number
            sequence_number += 1
            return f"event: {kind}\n".encode() + sse({"type": kind, "sequence_number": sequence_number - 1, **data})

        in_progress = self.response("in_progress")
        yield event("response.created", {"response": in_progress})
        yield event("response.in_progress", {"response": in_progress})
        final = None
        async for out in self.run.outputs():
            final = out
            self._add(self.parser.feed(out.token_ids))
            for kind, data in self.output.take():
                yield event(kind, data)
        self._add(self.parser.finish())
        if final.finish_reason == "error":
            self.output.finish("incomplete")
            error = engine_error(self.state, final)
            for kind, data in self.output.take():
                yield event(kind, data)
            failed = self.response("failed", error={"code": "server_error", "message": error.message})
            yield event("response.failed", {"response": failed})
            return
        response = await self._finished(final)
        for kind, data in self.output.take():
            yield event(kind, data)
        last = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event(last, {"response": response})

    def _add(self, deltas: list[dict]) -> None:
        for delta in deltas:
            self.output.add(delta)

    async def _finished(self, final) -> dict:
        """The finished response (its items closed, metrics recorded, stored unless store is false)."""
        status = "incomplete" if final.finish_reason == "length" else "completed"
        self.output.finish(status)
        self.state.metrics.record_finished(final)
        response = self.response(status, response_usage(final.usage, self.parser.reasoning_tokens))
        if self.body.get("store") is not False:
            items = self.conversation + self.output.items
            self.store.put(response, items, await run_in_threadpool(ResponseStore.stored_size, response, items))
        return response
