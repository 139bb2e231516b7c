"""The agent loop: model call, tool calls, tool results back as tool messages, until done.

One `Agent` holds one conversation. Its message list is append-only across turns (the system
prompt, with AGENTS.md read once at the start, never changes), so every request repeats the
previous one as a prefix and the server's prefix cache serves it. A turn ends when the model
answers without tool calls, or after `max_steps` model calls. A cancelled turn (Esc) still
leaves a valid history: the partial answer is kept and unanswered tool calls get a
"cancelled" result. Every appended message goes to `on_message` (the session store).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from northcode.agent.approvals import Approvals
from northcode.agent.client import ChatClient, Completion, Delta, EndpointError, ToolCall
from northcode.agent.tools import TOOL_SCHEMAS, PreparedCall, ToolBox, ToolError

DEFAULT_MAX_STEPS = 25
AGENTS_FILE = "AGENTS.md"
MAX_AGENTS_CHARS = 32_000
SYSTEM_PROMPT = """You are northcode, a coding assistant working in the folder {root}.
Use the tools to look at the code before you change it: read, list, glob and grep to explore, \
edit for exact string replacements, write for new files, bash for commands (tests, builds, git). \
Paths are relative to {root}; nothing outside it can be read or written. \
Make the smallest change that does the job, check it when you can, and answer briefly."""


def system_prompt(root: Path) -> str:
    """The system prompt for a workspace, with its AGENTS.md (if any) appended."""
    prompt = SYSTEM_PROMPT.format(root=root)
    agents_path = root / AGENTS_FILE
    if agents_path.is_file():
        text = agents_path.read_text(encoding="utf-8", errors="replace")[:MAX_AGENTS_CHARS]
        prompt += f"\n\nProject instructions from {AGENTS_FILE}:\n\n{text.strip()}"
    return prompt


@dataclass
class ToolEvent:
    """A tool call's progress, for the UI: started (output None) or finished."""

    call: ToolCall
    prepared: PreparedCall | None  # None when the call was invalid
    output: str | None = None
    ok: bool = True


@dataclass
class TurnResult:
    answer: str  # the last assistant text
    num_steps: int  # model calls in this turn
    stop_reason: str  # "done" | "step_limit" | "length"
    last: Completion | None


class Agent:
    """A conversation with the model, with tools (or without: `use_tools=False` is plain chat)."""

    def __init__(self, client: ChatClient, toolbox: ToolBox, approvals: Approvals,
                 messages: list[dict] | None = None, max_steps: int = DEFAULT_MAX_STEPS,
                 use_tools: bool = True, on_message: Callable[[dict], None] | None = None,
                 on_event: Callable[[Delta | Completion | ToolEvent], None | Awaitable[None]] | None = None,
                 request_params: dict | None = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps {max_steps}: expected at least 1")
        self.client, self.toolbox, self.approvals = client, toolbox, approvals
        self.max_steps, self.use_tools = max_steps, use_tools
        self.on_message = on_message or (lambda message: None)
        self.on_event = on_event or (lambda event: None)
        self.request_params = request_params or {}
        self.messages: list[dict] = list(messages or [])
        if not self.messages:
            self._append({"role": "system", "content": system_prompt(toolbox.workspace.root)})

    async def _emit(self, event: Delta | Completion | ToolEvent) -> None:
        """Tell the UI; `on_event` may be a plain function or a coroutine function."""
        result = self.on_event(event)
        if inspect.isawaitable(result):
            await result

    def _append(self, message: dict) -> None:
        self.messages.append(message)
        self.on_message(message)

    async def run_turn(self, user_text: str) -> TurnResult:
        """Send one user message and work until the model stops calling tools (or the step limit)."""
        self._append({"role": "user", "content": user_text})
        completion: Completion | None = None
        for step_idx in range(self.max_steps):
            completion = await self._model_step()
            if not completion.tool_calls:
                reason = "length" if completion.finish_reason == "length" else "done"
                return TurnResult(completion.content, step_idx + 1, reason, completion)
            await self._run_tools(completion.tool_calls)
        return TurnResult(completion.content if completion else "", self.max_steps, "step_limit", completion)

    async def _model_step(self) -> Completion:
        tools = TOOL_SCHEMAS if self.use_tools else None
        partial = Completion()
        try:
            async for event in self.client.stream_chat(self.messages, tools, **self.request_params):
                if isinstance(event, Completion):
                    partial = event
                else:
                    partial.content += event.text if event.kind == "content" else ""
                    partial.reasoning += event.text if event.kind == "reasoning" else ""
                await self._emit(event)
        except (asyncio.CancelledError, EndpointError):
            if partial.content or partial.reasoning:  # keep what the user saw; the history stays valid
                self._append(Completion(partial.content, partial.reasoning).to_message())
            raise
        self._append(partial.to_message())
        return partial

    async def _run_tools(self, calls: list[ToolCall]) -> None:
        answered: set[str] = set()
        try:
            for call in calls:
                output = await self._run_tool(call)
                self._append({"role": "tool", "tool_call_id": call.id, "content": output})
                answered.add(call.id)
        except asyncio.CancelledError:
            for call in calls:
                if call.id not in answered:
                    self._append({"role": "tool", "tool_call_id": call.id, "content": "cancelled by the user"})
            raise

    async def _run_tool(self, call: ToolCall) -> str:
        try:
            prepared = self.toolbox.prepare(call.name, call.arguments)
        except ToolError as err:
            await self._emit(ToolEvent(call, None, f"Error: {err}", ok=False))
            return f"Error: {err}"
        await self._emit(ToolEvent(call, prepared))
        allowed, reason = await self.approvals.decide(prepared)
        if not allowed:
            output, ok = f"The user did not run this call ({reason}). Nothing was changed.", False
        else:
            try:
                output, ok = await prepared.execute(), True
            except (ToolError, OSError) as err:
                output, ok = f"Error: {err}", False
        await self._emit(ToolEvent(call, prepared, output, ok))
        return output
