"""`northcode run --output-format stream-json`: the agent's events as JSON lines, shaped like Claude Code's.

One JSON object per line, written as it happens, each with a `type` and the `session_id`:
`system` (subtype `init`: model, cwd, tools, mode) once the session exists; `stream_event` per fragment
of a model call (Anthropic's streaming events: message_start, content_block_start/delta/stop for
thinking, text and tool_use blocks, message_delta with the stop reason and usage, message_stop);
`assistant` with each whole reply; `user` with each tool result; `system` (subtype `compact_boundary`)
after the agent compacted the conversation, in the new session; and last `result` (subtype
`success`, `error_max_turns` or `error_during_execution`, the answer, the summed usage). Usage is
Anthropic's: input_tokens leaves out cache_read_input_tokens. No terminal here: lines go to `write`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from northcode.agent.client import Completion, Delta
from northcode.agent.loop import CompactEvent, ToolEvent

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}  # OpenAI's -> Anthropic's
RESULT_SUBTYPES = {"done": "success", "length": "success", "step_limit": "error_max_turns"}  # else error_during_execution
BLOCKS = {"reasoning": ("thinking", "thinking_delta", "thinking"), "content": ("text", "text_delta", "text"),
          "tool_arguments": ("tool_use", "input_json_delta", "partial_json")}  # kind -> (block, delta, its field)


def anthropic_usage(usage: dict | None) -> dict:
    """OpenAI usage (prompt_tokens counts the cached ones) as Anthropic's (input_tokens does not)."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": max((usage.get("prompt_tokens") or 0) - cached, 0), "cache_read_input_tokens": cached,
            "output_tokens": usage.get("completion_tokens") or 0}


def content_blocks(completion: Completion) -> list[dict]:
    """A reply as Anthropic's content blocks: thinking, text, then one tool_use per call."""
    blocks: list[dict] = []
    if completion.reasoning:
        blocks.append({"type": "thinking", "thinking": completion.reasoning})
    if completion.content:
        blocks.append({"type": "text", "text": completion.content})
    for call in completion.tool_calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = None
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": arguments if isinstance(arguments, dict) else {}})
    return blocks


class StreamJsonWriter:
    """Turns the agent's events into stream-json lines; `write` gets each line (without its newline)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write_line = write
        self.model = ""  # the id requests use, known once connected (init)
        self.session_id: str | None = None
        self.message_id: str | None = None  # the model call being streamed
        self.block: tuple[str, int | None] | None = None  # the open content block: (kind, call index)
        self.num_blocks = 0  # content blocks of the current model call so far

    def emit(self, event: dict) -> None:
        self.write_line(json.dumps({**event, "session_id": self.session_id}, ensure_ascii=False, allow_nan=False))

    def init(self, session_id: str | None, model: str, cwd: str, tools: list[str], mode: str,
             mcp_servers: list[dict] | None = None) -> None:
        """The first line, once the run's session exists; `mcp_servers`: {"name", "status"} of each MCP server."""
        self.session_id, self.model = session_id, model
        self.emit({"type": "system", "subtype": "init", "model": self.model, "cwd": cwd, "tools": tools, "mode": mode,
                   "mcp_servers": mcp_servers or []})

    def on_event(self, event: Delta | Completion | ToolEvent | CompactEvent) -> None:
        if isinstance(event, Delta):
            self._delta(event)
        elif isinstance(event, Completion):
            self._completion(event)
        elif isinstance(event, CompactEvent):
            if event.summary is not None:
                metadata = {"trigger": event.trigger, "pre_tokens": event.context_used,
                            "num_messages": event.num_messages, "left_out": event.left_out}
                self.emit({"type": "system", "subtype": "compact_boundary", "compact_metadata": metadata,
                           "summary": event.summary.content})
        elif event.output is not None:
            result = {"type": "tool_result", "tool_use_id": event.call.id, "content": event.output,
                      "is_error": not event.ok}
            self.emit({"type": "user", "message": {"role": "user", "content": [result]}, "parent_tool_use_id": None})

    def _stream_event(self, event: dict) -> None:
        self.emit({"type": "stream_event", "event": event, "parent_tool_use_id": None})

    def _start_message(self) -> None:
        self.message_id, self.num_blocks = f"msg_{uuid.uuid4().hex[:24]}", 0
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": []}
        self._stream_event({"type": "message_start", "message": message})

    def _close_block(self) -> None:
        if self.block is not None:
            self._stream_event({"type": "content_block_stop", "index": self.num_blocks - 1})
            self.block = None

    def _delta(self, delta: Delta) -> None:
        if self.message_id is None:
            self._start_message()
        kind = "tool_arguments" if delta.kind == "tool_call" else delta.kind
        key = (kind, delta.call_idx)
        if self.block != key:
            self._close_block()
            block_type = BLOCKS[kind][0]
            block = {"type": block_type, block_type: ""} if kind != "tool_arguments" else {
                "type": "tool_use", "id": delta.call_id, "name": delta.text if delta.kind == "tool_call" else "",
                "input": {}}
            self._stream_event({"type": "content_block_start", "index": self.num_blocks, "content_block": block})
            self.block, self.num_blocks = key, self.num_blocks + 1
        if delta.kind != "tool_call":  # a call's start carries its name, not a fragment
            _, delta_type, field = BLOCKS[kind]
            self._stream_event({"type": "content_block_delta", "index": self.num_blocks - 1,
                                "delta": {"type": delta_type, field: delta.text}})

    def _completion(self, completion: Completion) -> None:
        if self.message_id is None:  # a reply with no fragment at all
            self._start_message()
        self._close_block()
        stop_reason = STOP_REASONS.get(completion.finish_reason or "", completion.finish_reason)
        usage = anthropic_usage(completion.usage)
        self._stream_event({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                            "usage": usage})
        self._stream_event({"type": "message_stop"})
        message = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": content_blocks(completion), "stop_reason": stop_reason, "usage": usage}
        self.emit({"type": "assistant", "message": message, "parent_tool_use_id": None})
        self.message_id = None

    def result(self, transcript: dict, duration_s: float) -> None:
        """The last line: how the run ended (northcode run's --json transcript, less its messages)."""
        self.session_id = transcript.get("session_id", self.session_id)
        stop_reason = transcript.get("stop_reason")
        self.emit({"type": "result", "subtype": RESULT_SUBTYPES.get(stop_reason or "", "error_during_execution"),
                   "is_error": not transcript["ok"], "result": transcript.get("answer") or "",
                   "stop_reason": stop_reason, "num_turns": transcript.get("num_steps", 0),
                   "duration_ms": round(duration_s * 1000), "usage": anthropic_usage(transcript.get("usage")),
                   "error": transcript["error"]})
