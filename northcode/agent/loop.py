"""The agent loop: model call, tool calls, tool results back as tool messages, until done.

One `Agent` holds one conversation. Its message list is append-only across turns (the system
prompt, with the instruction files read once at the start (instructions.py), never changes), so every request repeats the
previous one as a prefix and the server's prefix cache serves it. A turn ends when the model
answers without tool calls, or after `max_steps` model calls. A cancelled turn (Esc) still
leaves a valid history: the partial answer is kept and unanswered tool calls get a
"cancelled" result; a turn that got no reply at all takes its user message back. Tool calls
cut off by the token limit are never run. Every appended message goes to `on_message` (the
session store), every take-back to `on_retract`. Before a request that would fill more than
AUTO_COMPACT_SHARE of the context window, the agent compacts the conversation as /compact does
(compaction.py), says so through `on_event`, and hands the short conversation to `on_compacted`.
Entering and leaving plan mode is told to the model as a note on the next user message (the system
prompt stays as it was); the toolbox's todo list is the one this conversation's todowrite calls left.
A request waits until the MCP servers starting have started or failed, so that the tools offered (which lead the
prompt) change only when a server is lost. `first_tool_choice` forces each turn's first model call (a tool_choice:
required, none or a tool's name); the turn's later calls are the model's choice again, as the OpenAI Agents SDK's
reset_tool_choice does, so a forced call cannot repeat until the step limit (a tool_choice in `request_params`
holds for every call).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from northcode.agent.approvals import Approvals, Mode
from northcode.agent.client import ChatClient, Completion, Delta, EndpointError, ToolCall
from northcode import paths
from northcode.agent.compaction import CompactError, compacted, first_request, summarise
from northcode.agent.instructions import find_instructions, instructions_prompt
from northcode.agent.sessions import session_title
from northcode.agent.todos import TodoList
from northcode.agent.tools import PreparedCall, ToolBox, ToolError

DEFAULT_MAX_STEPS = 25
AUTO_COMPACT_SHARE = 0.85  # of the context window: a request estimated past it is preceded by a compaction
CHARS_PER_TOKEN = 3  # a cautious estimate for the messages since the last usage (code runs at about 3.5-4)
CONTINUE_AFTER_COMPACTION = ("[northcode: the conversation was compacted to free the context; the summary above is "
                             "what is left of it. Go on with the task from where you left off.]")
SYSTEM_PROMPT = """You are northcode, a coding assistant working in the folder {root}.
Use the tools to look at the code before you change it: read, list, glob and grep to explore, \
edit for exact string replacements, write for new files, bash for commands (tests, builds, git). \
Paths are relative to {root}; nothing outside it can be read or written. \
Make the smallest change that does the job, check it when you can, and answer briefly. \
For a task of several steps, keep a todo list with todowrite and update it as you go."""
PLAN_NOTE = ("plan mode: the user wants a plan before any change. You may read, list, glob, grep, keep the todo "
             "list, webfetch and call the MCP tools their servers mark read-only (the user approves each fetch and "
             "MCP call); edit, write, bash and the other MCP tools are refused. Explore, then "
             "answer with the plan (and write it with todowrite); the user switches modes to let you carry it out.")
LEFT_PLAN_NOTE = "plan mode is over (mode {mode}): you may now edit files and run commands as the mode allows."


def system_prompt(root: Path) -> str:
    """The system prompt for a workspace, with the AGENTS.md and CLAUDE.md files that apply to it (the user's,
    the parent folders', the workspace's) appended, the nearest last."""
    prompt = SYSTEM_PROMPT.format(root=root)
    found = find_instructions(root, paths.data_dir())
    if found:
        prompt += ("\n\nProject instructions follow, the most general first; where they disagree, the later ones "
                   "win.\n\n" + instructions_prompt(found, root))
    return prompt


@dataclass
class ToolEvent:
    """A tool call's progress, for the UI: started (output None) or finished."""

    call: ToolCall
    prepared: PreparedCall | None  # None when the call was invalid
    output: str | None = None
    ok: bool = True


@dataclass
class CompactEvent:
    """A compaction, for the UI: started (summary and error None), done (summary set) or failed (error set)."""

    trigger: str  # "auto" (the context is filling) | "manual" (/compact)
    context_used: int | None  # tokens, the agent's estimate for the conversation before it
    num_messages: int  # messages compacted
    summary: Completion | None = None
    left_out: int = 0  # of them, the oldest that did not fit the summary request
    error: str | None = None


@dataclass
class TurnResult:
    answer: str  # the last assistant text
    num_steps: int  # model calls in this turn
    stop_reason: str  # "done" | "step_limit" | "length" | "tool_call_truncated" (see run_turn)
    last: Completion | None
    usage: dict | None = None  # token counts summed over the turn's model calls

    @property
    def truncated_calls(self) -> list[ToolCall]:
        """The calls cut off by the token limit (not run), when stop_reason is "tool_call_truncated"."""
        return self.last.tool_calls if self.last and self.stop_reason == "tool_call_truncated" else []


TRUNCATED_CALL_RESULT = ("Not run: your answer was cut off at the token limit (finish_reason \"length\") while you "
                         "were writing the tool calls, so their arguments may be incomplete. Nothing was changed.")


def sum_usage(total: dict | None, usage: dict | None) -> dict | None:
    """OpenAI usage dicts added up (the token counts and their cached/reasoning details)."""
    if not usage:
        return total
    total = dict(total or {})
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(usage.get(key), int):
            total[key] = total.get(key, 0) + usage[key]
    for group, key in (("prompt_tokens_details", "cached_tokens"), ("completion_tokens_details", "reasoning_tokens")):
        value = (usage.get(group) or {}).get(key)
        if isinstance(value, int):
            total[group] = {key: (total.get(group) or {}).get(key, 0) + value}
    return total


def history_message(completion: Completion) -> dict:
    """The assistant message to keep. A call whose arguments are not a JSON object (cut off, or
    malformed) is kept with `{}`: OpenAI-compatible servers, northcode serve among them, refuse
    such arguments in a request's history, and one bad call must not break every later request.
    The tool result quotes what the model wrote instead."""
    message = completion.to_message()
    for call in message.get("tool_calls") or []:
        if not arguments_are_an_object(call["function"]["arguments"]):
            call["function"]["arguments"] = "{}"
    return message


def arguments_are_an_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class Agent:
    """A conversation with the model, with tools (or without: `use_tools=False` is plain chat)."""

    def __init__(self, client: ChatClient, toolbox: ToolBox, approvals: Approvals,
                 messages: list[dict] | None = None, max_steps: int = DEFAULT_MAX_STEPS,
                 use_tools: bool = True, on_message: Callable[[dict], None] | None = None,
                 on_retract: Callable[[int], None] | None = None,
                 on_event: Callable[[Delta | Completion | ToolEvent | CompactEvent], None | Awaitable[None]] | None = None,
                 request_params: dict | None = None, context_window: int | None = None,
                 on_compacted: Callable[[list[dict], str], None] | None = None,
                 first_tool_choice: str | dict | None = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps {max_steps}: expected at least 1")
        self.client, self.toolbox, self.approvals = client, toolbox, approvals
        self.max_steps, self.use_tools = max_steps, use_tools
        self.on_message = on_message or (lambda message: None)
        self.on_retract = on_retract or (lambda num_messages: None)  # messages from this index on were taken back
        self.on_event = on_event or (lambda event: None)
        self.request_params = request_params or {}
        self.first_tool_choice = first_tool_choice  # OpenAI's tool_choice for each turn's first call; None: default
        self.context_window = context_window  # tokens; None: unknown, never compacted automatically
        self.on_compacted = on_compacted or (lambda messages, title: None)  # the new conversation and its title
        self.messages: list[dict] = list(messages or [])
        self.notes: list[str] = []  # for the model, sent ahead of the next user message (note())
        self.context_used: int | None = None  # tokens: prompt + reply of the last request (its usage)
        self.num_measured = 0  # messages that context_used counts
        self.num_compacted: int | None = None  # messages right after the last compaction
        self.told_planning = False  # whether the model was last told that it is in plan mode
        toolbox.todos = TodoList.from_messages(self.messages)
        if not self.messages:
            self._append({"role": "system", "content": system_prompt(toolbox.workspace.root)})

    async def _emit(self, event: Delta | Completion | ToolEvent | CompactEvent) -> None:
        """Tell the UI; `on_event` may be a plain function or a coroutine function."""
        result = self.on_event(event)
        if inspect.isawaitable(result):
            await result

    def _append(self, message: dict) -> None:
        self.messages.append(message)
        self.on_message(message)

    def note(self, text: str) -> None:
        """Something the model should know that happened outside the conversation (the user's /undo): it goes
        at the head of the next user message, so the history stays append-only (the prefix cache keeps it)."""
        self.notes.append(text)

    async def run_turn(self, user_text: str) -> TurnResult:
        """Send one user message and work until the model stops calling tools (or the step limit).

        If the request fails or is cancelled before anything comes back, the user message is taken
        back out of the history (and the session), so sending it again does not repeat it.
        A reply cut off by the token limit while it calls tools ends the turn with stop_reason
        "tool_call_truncated": the calls are not run (their arguments may be partial) and each
        gets a tool result that says so, which keeps the history valid for the next turn.
        """
        if self.should_compact(len(user_text)):  # before the request is appended: it stays word for word
            await self._auto_compact()
        planning = self.approvals.mode is Mode.PLAN
        if planning != self.told_planning:
            self.told_planning = planning
            self.note(PLAN_NOTE if planning else LEFT_PLAN_NOTE.format(mode=self.approvals.mode.value))
        num_before, notes, compacted_before = len(self.messages), self.notes, self.num_compacted
        self.notes = []
        self._append({"role": "user", "content": "\n\n".join([*(f"[northcode: {n}]" for n in notes), user_text])})
        self.toolbox.journal.begin_turn()  # what /undo takes back: this turn's file changes
        try:
            return await self._work()
        except (asyncio.CancelledError, EndpointError):
            if len(self.messages) == num_before + 1 and self.num_compacted == compacted_before:  # no reply at all
                del self.messages[num_before:]
                self.on_retract(num_before)
                self.notes = notes + self.notes  # and its notes go with the next one
            raise

    async def _work(self) -> TurnResult:
        completion: Completion | None = None
        usage: dict | None = None
        for step_idx in range(self.max_steps):
            if step_idx and self.should_compact() and await self._auto_compact():
                self._append({"role": "user", "content": CONTINUE_AFTER_COMPACTION})
            completion = await self._model_step(forced=step_idx == 0)
            usage = sum_usage(usage, completion.usage)
            if not completion.tool_calls:
                reason = "length" if completion.finish_reason == "length" else "done"
                return TurnResult(completion.content, step_idx + 1, reason, completion, usage)
            if completion.finish_reason == "length":
                await self._refuse_truncated(completion.tool_calls)
                return TurnResult(completion.content, step_idx + 1, "tool_call_truncated", completion, usage)
            await self._run_tools(completion.tool_calls)
        return TurnResult(completion.content if completion else "", self.max_steps, "step_limit", completion, usage)

    async def _refuse_truncated(self, calls: list[ToolCall]) -> None:
        outputs = [TRUNCATED_CALL_RESULT + _quote_arguments(call.arguments) for call in calls]
        for call, output in zip(calls, outputs):  # all answered before any await: an Esc cannot split them
            self._append({"role": "tool", "tool_call_id": call.id, "content": output})
        for call, output in zip(calls, outputs):
            await self._emit(ToolEvent(call, None))
            await self._emit(ToolEvent(call, None, output, ok=False))

    async def _model_step(self, forced: bool = False) -> Completion:
        if self.use_tools and self.toolbox.mcp is not None:  # the MCP tools of the first request stay in the next
            await self.toolbox.mcp.wait_started()
        tools = self.toolbox.schemas() if self.use_tools else None
        params = self.request_params
        if forced and self.use_tools and self.first_tool_choice is not None:
            params = {**params, "tool_choice": self.first_tool_choice}
        partial = Completion()
        try:
            async for event in self.client.stream_chat(self.messages, tools, **params):
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
        self._append(history_message(partial))
        usage = partial.usage or {}
        if isinstance(usage.get("prompt_tokens"), int):
            self.context_used = usage["prompt_tokens"] + (usage.get("completion_tokens") or 0)
            self.num_measured = len(self.messages)
        return partial

    # --- compaction ---

    def estimated_context(self, extra_chars: int = 0) -> int | None:
        """Tokens the next request would take: the last one's prompt and reply, and a cautious estimate for the
        messages since (plus `extra_chars` about to join them); None before any usage."""
        if self.context_used is None:
            return None
        chars = sum(len(json.dumps(m, ensure_ascii=False)) for m in self.messages[self.num_measured:]) + extra_chars
        return self.context_used + chars // CHARS_PER_TOKEN

    def should_compact(self, extra_chars: int = 0) -> bool:
        """Whether the next request would pass AUTO_COMPACT_SHARE of the window and a compaction can shorten it
        (an answer since the start or since the last compaction)."""
        estimate = self.estimated_context(extra_chars)
        if estimate is None or not self.context_window or estimate < AUTO_COMPACT_SHARE * self.context_window:
            return False
        since = self.messages[self.num_compacted or 0:]
        return any(m.get("role") == "assistant" for m in since) and any(m.get("role") == "user" for m in self.messages)

    async def _auto_compact(self) -> bool:
        """Compact before the context fills; a failure (told through on_event) leaves the conversation as it was."""
        try:
            await self.compact("auto")
        except (CompactError, EndpointError):
            return False
        return True

    async def compact(self, trigger: str = "manual") -> CompactEvent:
        """Summarise the conversation and go on from the summary, as compaction.py says; the agent's tools stay
        offered so the request is a prefix-cache hit. CompactError or EndpointError: nothing changed."""
        first_request(self.messages)  # CompactError when there is nothing to compact, before any request
        started = CompactEvent(trigger, self.estimated_context(), len(self.messages))
        await self._emit(started)
        params = {k: v for k, v in self.request_params.items() if k != "tool_choice"}  # a forced call is no summary
        tools = self.toolbox.schemas() if self.use_tools else None
        try:
            summary, left_out = await summarise(self.client, self.messages, tools, **params)
        except (CompactError, EndpointError) as err:
            await self._emit(replace(started, error=str(err)))
            raise
        before, self.messages = self.messages, compacted(self.messages, summary.content)
        self.context_used, self.num_measured, self.num_compacted = None, 0, len(self.messages)
        self.on_compacted(self.messages, session_title(first_request(before)))
        done = replace(started, summary=summary, left_out=left_out)
        await self._emit(done)
        return done

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
            output = f"Error: {err}"
            if not arguments_are_an_object(call.arguments):  # the history keeps `{}`: show what was written
                output += _quote_arguments(call.arguments)
            await self._emit(ToolEvent(call, None, output, ok=False))
            return output
        await self._emit(ToolEvent(call, prepared))
        allowed, reason, hunks = await self.approvals.decide(prepared)
        if not allowed:
            output, ok = f"The user did not run this call ({reason}). Nothing was changed.", False
        else:
            try:
                run = prepared.execute if hunks is None else lambda: prepared.execute_hunks(hunks)
                output, ok = await run(), True
            except (ToolError, OSError) as err:
                output, ok = f"Error: {err}", False
        await self._emit(ToolEvent(call, prepared, output, ok))
        return output


def _quote_arguments(arguments: str, max_chars: int = 300) -> str:
    shown = arguments if len(arguments) <= max_chars else arguments[:max_chars] + "…"
    return f"\nThe arguments as written: {shown}"
