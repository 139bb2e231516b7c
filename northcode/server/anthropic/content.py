"""Anthropic reply shapes: content blocks from the output parser's deltas, SSE events, usage, stop_reason.

Pure functions and one accumulator (ContentBlocks) that serves streaming (the events) and
non-streaming replies (the blocks whole) alike. Nothing here touches the engine or the request.
"""

from __future__ import annotations

import json

from northcode.engine.request import RequestOutput, Usage
from northcode.server.output_parser import OutputParser

THINKING_SIGNATURE = "northcode"  # thinking blocks need a signature; this server neither signs nor checks them


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
