"""NorthcodeApp: the terminal app for chat and agent sessions, a client of an OpenAI-compatible endpoint.

On start it finds or starts `northcode serve` (showing the loading phase), then runs one agent
turn per prompt in an exclusive worker. Esc cancels that worker: the HTTP stream is closed,
so the server aborts the request, and a running shell command's process group is killed.
Messages are saved to the session store as they are appended (a session row is created with
the first prompt). The status line shows model, mode, live tokens/s, TTFT, context, cache, KV
(agent/session_stats.py computes and words them; agent/served_model.py describes the model). The
todo panel above the prompt shows the model's todo list (todowrite) as it changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer

from northcode import paths
from northcode.agent import server_process
from northcode.agent.approvals import Answer, Approvals, Decision, Mode
from northcode.agent.client import ChatClient, Completion, Delta, EndpointError
from northcode.agent.compaction import CompactError
from northcode.agent.instructions import find_instructions, shown_path
from northcode.agent.loop import Agent, CompactEvent, ToolEvent, TurnResult
from northcode.agent.mentions import expand_mentions
from northcode.agent.metrics import kv_usage
from northcode.agent.sandbox import Workspace
from northcode.agent.served_model import ServedModel, describe_served_model
from northcode.agent.session_stats import StreamRate, usage_changes
from northcode.agent.sessions import SessionRecorder, SessionStore
from northcode.agent.tools import PreparedCall, ToolBox
from northcode.tui.screens import ApprovalScreen, HelpScreen, SessionsScreen
from northcode.tui.slash import SlashCommands
from northcode.tui.file_picker import FilePicker
from northcode.tui.mcp import AppMcpServers
from northcode.tui.widgets import (AssistantMessage, Notice, PromptInput, StatusLine, TodoPanel, ToolCallView,
                                   UserMessage)

log = logging.getLogger(__name__)
RANDOM_WEIGHTS_NOTICE = ("This model's weights are random (a demo or synthetic checkpoint): its answers are noise, "
                         "and it will rarely call a tool. Start northcode with --model DIR for a real model.")
QUIT_PRESS_S = 2.0  # a second Ctrl+C at an idle, empty prompt within this quits


class NorthcodeApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "northcode"
    BINDINGS = [
        Binding("escape", "stop", "stop", show=False),
        # Ctrl+C stops an answer, as in other terminal agents; idle: copy, clear the prompt, or quit (twice)
        Binding("ctrl+c", "interrupt", "stop", show=False, priority=True),
        Binding("shift+tab", "cycle_mode", "mode", priority=True),
        Binding("ctrl+n", "new_session", "new"),
        Binding("ctrl+s", "sessions", "sessions"),
        Binding("f1", "help", "help"),
        Binding("ctrl+q", "quit", "quit"),
    ]

    def __init__(self, workspace: Path, endpoint: str | None = None, model: Path | None = None,
                 mode: Mode = Mode.ASK, resume: str | None = None, store: SessionStore | None = None,
                 request_params: dict | None = None, driver_class=None) -> None:
        super().__init__(driver_class=driver_class)  # None: Textual's; tui/terminal.py's when stderr is redirected
        self.workspace = Workspace(workspace)
        self.endpoint, self.model_dir, self.resume_id = endpoint, model, resume
        self.store = store or SessionStore()
        self.approvals = Approvals(mode, self.ask_approval)
        self.toolbox = ToolBox(self.workspace, paths.data_dir() / "tool-output")
        self.request_params = request_params or {}
        self.client: ChatClient | None = None
        self.agent: Agent | None = None
        self.recorder: SessionRecorder | None = None
        self.served: ServedModel | None = None
        self.model_label = ""
        self.current: AssistantMessage | None = None
        self.last_answer: AssistantMessage | None = None  # the latest answer whose stream has ended
        self.tool_running = False  # between a tool call's start and its result: no request is open
        self.quit_armed_at: float | None = None  # when an idle Ctrl+C said that another one quits
        self.compacting_session: str | None = None  # the session a compaction leaves behind
        self.tool_views: dict[str, ToolCallView] = {}
        self.pending_calls: dict[int, tuple[ToolCallView, str, int]] = {}  # call index -> (view, name, characters)
        self.stream_rate = StreamRate()
        self.slash = SlashCommands(self)
        self.started_server: str | None = None  # "started northcode serve on URL (pid N, log FILE)"
        self.mcp = AppMcpServers(self)

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="chat")
        yield FilePicker(self.workspace, id="picker")
        yield TodoPanel("", markup=False, id="todos")
        yield PromptInput(id="prompt")
        yield StatusLine(id="status")
        yield Footer()

    @property
    def chat(self) -> VerticalScroll:
        return self.query_one("#chat", VerticalScroll)

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    @property
    def is_busy(self) -> bool:
        return any(w.group == "turn" and w.is_running for w in self.workers)

    def on_mount(self) -> None:
        self.chat.anchor()
        self.status.show(mode=self.approvals.mode.value, workspace=self.workspace.root.name)
        prompt = self.query_one(PromptInput)
        prompt.load_history(self.store.prompts(self.workspace.root))  # Up finds the last run's prompts
        prompt.focus()
        self.connect()
        self.mcp.start()

    async def on_unmount(self) -> None:
        await self.mcp.aclose()
        if self.client is not None:
            await self.client.aclose()

    async def add(self, widget) -> None:
        await self.chat.mount(widget)

    # --- connection ---

    @work(exclusive=True, group="connect", exit_on_error=False)
    async def connect(self) -> None:
        progress = Notice("connecting to the model server…")  # updated in place with each loading phase
        await self.add(progress)

        kept: list[str] = []  # "started northcode serve on URL (pid N, log FILE)" and warnings stay on screen

        def on_phase(phase: str) -> None:
            if phase.startswith("started"):
                self.started_server = phase
                kept.append(phase)
            progress.update(f"model server: {phase}")
            self.status.show(busy="" if phase.startswith("ready") else "loading…")

        try:
            root = await server_process.connect(self.endpoint, self.model_dir, on_phase)
            self.client = ChatClient(root)
            self.served = served = await describe_served_model(self.client)
        except (EndpointError, OSError, ValueError) as err:  # OSError: the server could not be started
            self.status.show(model="offline", busy="")
            progress.update(f"Cannot connect: {err}")
            progress.set_classes("notice error")
            return
        self.model_label = served.label  # the welcome line has the whole name; the status line the short one
        self.status.show(model=served.short_label, context_window=served.context_window, busy="")
        progress.update(f"{self.model_label} · workspace {self.workspace.root.name} · /help for keys and commands")
        for note in kept:
            await self.add(Notice(note + "; it keeps running after you quit"))
        if found := find_instructions(self.workspace.root, paths.data_dir()):
            names = ", ".join(shown_path(item.path, self.workspace.root) for item in found)
            await self.add(Notice(f"instructions from {names} join the system prompt"))
        if served.random_weights:
            await self.add(Notice(RANDOM_WEIGHTS_NOTICE, "warning"))
        await self.refresh_metrics()
        if self.resume_id:
            await self.resume(self.resume_id)
        else:
            self.start_session()

    async def refresh_metrics(self) -> None:
        text = await self.client.metrics_text() if self.client else None
        if text is not None:
            self.status.show(kv_usage=kv_usage(text))

    # --- sessions ---

    @property
    def session_id(self) -> str | None:
        return self.recorder.session_id if self.recorder else None

    def start_session(self, messages: list[dict] | None = None, session_id: str | None = None) -> None:
        """A new conversation (or a resumed one); a turn still running keeps saving to its own session."""
        assert self.client is not None
        self.recorder = recorder = SessionRecorder(self.store, self.workspace.root, self.client.model or "", session_id)
        self.agent = Agent(self.client, self.toolbox, self.approvals, messages=messages, on_message=recorder.save,
                           on_retract=recorder.retract, on_event=self.on_agent_event,
                           request_params=self.request_params, on_compacted=recorder.restart,
                           context_window=self.served.context_window if self.served else None)
        self.query_one(TodoPanel).show_todos(self.toolbox.todos)  # the resumed conversation's list, or none

    async def resume(self, session_id: str) -> None:
        try:
            messages = self.store.messages(session_id)
        except ValueError as err:
            await self.add(Notice(str(err), "error"))
            return
        await self.clear_transcript()
        self.start_session(messages, session_id)
        for message in messages:
            await self.show_saved(message)
        await self.add(Notice(f"resumed session {session_id} ({len(messages)} messages) · {self.model_label}"))

    async def clear_transcript(self) -> None:
        await self.chat.remove_children()
        self.tool_views.clear()
        self.pending_calls.clear()

    async def add_tool_view(self, call_id: str, view: ToolCallView) -> ToolCallView:
        self.tool_views[call_id] = view
        await self.add(view)
        return view

    async def show_saved(self, message: dict) -> None:
        role = message.get("role")
        if role == "user":
            await self.add(UserMessage(str(message.get("content", ""))))
        elif role == "assistant":
            if message.get("content") or message.get("reasoning_content"):
                await self.add(AssistantMessage(message.get("content") or "", message.get("reasoning_content") or ""))
            for call in message.get("tool_calls") or []:
                function = call["function"]
                await self.add_tool_view(call["id"], ToolCallView(f"{function['name']} {function['arguments'][:80]}"))
        elif role == "tool" and message.get("tool_call_id") in self.tool_views:
            self.tool_views[message["tool_call_id"]].show_result(str(message.get("content", "")), True)

    # --- the @ file picker ---

    def on_text_area_changed(self, event) -> None:
        event.text_area.screen.query_one(FilePicker).follow()

    def on_text_area_selection_changed(self, event) -> None:
        event.text_area.screen.query_one(FilePicker).follow()

    def on_prompt_input_picker_key(self, event: PromptInput.PickerKey) -> None:
        event.control.screen.query_one(FilePicker).press(event.key)

    # --- a turn ---

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        self.store.add_prompt(self.workspace.root, event.text)
        if event.text.startswith("/"):
            await self.slash.run(event.text)
        else:
            self.send(event.text)

    def send(self, text: str, typed: str | None = None) -> None:
        """Start a turn on `text`; `typed` is what the user wrote, when not that (a custom command)."""
        if self.agent is None:
            self.restore_prompt(typed or text)  # kept for when the server is ready
            self.notify("Not connected to a model yet.", severity="warning")
        elif self.is_busy:
            self.restore_prompt(typed or text)
            self.notify("Still answering: Esc stops it.", severity="warning")
        else:
            self.run_turn(text, typed or text)

    @work(exclusive=True, group="turn", exit_on_error=False)
    async def run_turn(self, text: str, typed: str) -> None:
        """One turn on `text`; `typed` is what the screen shows, and what a failed turn gives back to the prompt."""
        assert self.agent is not None
        agent = self.agent
        expanded, attached = expand_mentions(text, self.workspace)
        await self.add(UserMessage(typed))
        if attached:
            await self.add(Notice(f"attached {', '.join(attached)}"))
        self.status.show(busy="generating…")
        self.set_timer(1.0, self.poll_metrics_while_busy)
        num_before = len(agent.messages)
        try:
            result = await agent.run_turn(expanded)
            await self.show_stop_reason(result)
        except asyncio.CancelledError:
            await self.end_stream()
            if not self.tool_running:  # a request was open: its cache share will never be known
                self.status.show(cache_share=None)
            self.refresh_metrics_soon()  # the server frees the request's KV pages
            taken_back = len(agent.messages) == num_before
            await self.add(Notice("interrupted before any answer: your message is back in the prompt" if taken_back
                                  and self.restore_prompt(typed) else "interrupted"))
            raise
        except EndpointError as err:
            await self.end_stream()
            await self.add(Notice(str(err), "error"))
            if len(agent.messages) == num_before and self.restore_prompt(typed):
                await self.add(Notice("your message was not sent: it is back in the prompt, Enter sends it again"))
        except Exception as err:  # a bug must not leave the app silently stuck: say what broke
            log.exception("agent turn failed")
            await self.end_stream()
            await self.add(Notice(f"internal error: {type(err).__name__}: {err}", "error"))
        finally:
            self.status.show(busy="")
            self.tool_running = False
        await self.refresh_metrics()

    @work(exclusive=True, group="turn", exit_on_error=False)
    async def compact(self) -> None:
        """/compact: the model summarises the conversation, which goes on, shorter, in a new session (the long
        one stays saved); Esc cancels it and changes nothing. The agent does the same when the context fills."""
        assert self.agent is not None
        try:
            await self.agent.compact("manual")
        except (CompactError, EndpointError) as err:
            await self.add(Notice(str(err), "error"))
        finally:
            self.status.show(busy="")

    async def on_compact_event(self, event: CompactEvent) -> None:
        """Tell the user about a compaction, theirs (/compact) or the agent's (the context is filling)."""
        if event.summary is None and event.error is None:
            self.compacting_session = self.session_id
            self.status.show(busy="compacting…")
            if event.trigger == "auto":
                share = f"{event.context_used / self.agent.context_window:.0%}" if self.agent.context_window else "?"
                await self.add(Notice(f"The context is about {share} full: compacting the conversation (as /compact "
                                      "does) before going on…", "warning"))
        elif event.error is not None:
            if event.trigger == "auto":  # /compact's worker says it
                await self.add(Notice(f"compacting failed, going on without it: {event.error}", "error"))
                self.status.show(busy="generating…")
        else:
            tokens = (event.summary.usage or {}).get("completion_tokens")
            missing = f" (the oldest {event.left_out} did not fit the context: left out of it)" if event.left_out else ""
            await self.add(Notice(f"compacted {event.num_messages} messages into the first request and a summary"
                                  f"{f' of {tokens} tokens' if tokens else ''}{missing}; the whole conversation "
                                  f"stays in session {self.compacting_session} (/sessions)"))
            await self.add(AssistantMessage(f"Summary of the work so far:\n\n{event.summary.content.strip()}"))
            self.status.show(context_used=None, cache_share=None, busy="generating…" if event.trigger == "auto" else "")

    def restore_prompt(self, text: str) -> bool:
        """Put a prompt that got no answer back into the input, unless the user is typing another."""
        prompt = self.query_one(PromptInput)
        if prompt.text.strip():
            return False
        prompt.text = text
        prompt.move_cursor(prompt.document.end)
        return True

    async def show_stop_reason(self, result: TurnResult) -> None:
        last = result.last
        if last is not None and not last.content.strip() and not last.tool_calls:
            if last.reasoning.strip() and self.last_answer is not None:
                self.last_answer.fold.collapsed = False  # the reasoning is all there is
                await self.add(Notice("The model only reasoned and gave no answer (its reasoning is above). "
                                      "Ask again, or ask it to answer.", "warning"))
            elif not last.reasoning.strip():
                await self.add(Notice("The model's answer was empty.", "warning"))
        if result.stop_reason == "step_limit":
            await self.add(Notice(f"Stopped after {result.num_steps} model calls (the step limit).", "error"))
        elif result.stop_reason == "length":
            await self.add(Notice("The answer was cut off at the token limit.", "error"))
        elif result.stop_reason == "tool_call_truncated":
            names = ", ".join(call.name or "?" for call in result.truncated_calls)
            await self.add(Notice(f"The answer was cut off at the token limit while the model was writing a call "
                                  f"({names}): nothing was run. Ask again, perhaps for a smaller step.", "error"))

    def refresh_metrics_soon(self) -> None:
        """After an interrupted request: at once, and again once the server has had time to free its pages."""
        self.call_later(self.refresh_metrics)
        self.set_timer(1.0, self.refresh_metrics)

    async def poll_metrics_while_busy(self) -> None:
        if self.is_busy:
            await self.refresh_metrics()
            self.set_timer(1.0, self.poll_metrics_while_busy)

    async def end_stream(self) -> None:
        await self.end_text()
        self.stream_rate.reset()
        for view, _, _ in self.pending_calls.values():  # the calls get their own views once whole
            await view.remove()
        self.pending_calls.clear()

    async def on_agent_event(self, event: Delta | Completion | ToolEvent | CompactEvent) -> None:
        if isinstance(event, Delta):
            await self.on_delta(event)
        elif isinstance(event, CompactEvent):
            await self.on_compact_event(event)
        elif isinstance(event, Completion):
            await self.end_stream()
            self.status.show(**usage_changes(event))
        elif event.output is None:
            self.tool_running = True
            self.status.show(busy=f"running {event.call.name}…")
            prepared = event.prepared
            view = ToolCallView(prepared.title, prepared.preview, prepared.kind) if prepared else ToolCallView(event.call.name)
            await self.add_tool_view(event.call.id, view)
        else:
            self.tool_running = False
            view = self.tool_views.get(event.call.id)
            if view is None:  # a call that never announced its start
                view = await self.add_tool_view(event.call.id, ToolCallView(event.call.name))
            view.show_result(event.output, event.ok)
            if event.prepared is not None and event.prepared.kind == "todo":
                self.query_one(TodoPanel).show_todos(self.toolbox.todos)
            self.status.show(busy="generating…")

    async def end_text(self) -> None:
        """The streamed text ends (a tool call starts): render it whole."""
        if self.current is not None:
            await self.current.finish()
            self.last_answer, self.current = self.current, None

    async def on_delta(self, delta: Delta) -> None:
        if changes := self.stream_rate.changes(delta):  # TTFT at the first fragment, then the live rate
            self.status.show(**changes)
        if delta.kind == "tool_call":
            await self.end_text()
            view = ToolCallView(f"{delta.text} …")
            self.pending_calls[delta.call_idx or 0] = (view, delta.text, 0)
            await self.add(view)
            return
        if delta.kind == "tool_arguments":  # a running count: the call is shown whole once it is complete
            pending = self.pending_calls.get(delta.call_idx or 0)
            if pending is not None:
                view, name, num_chars = pending
                self.pending_calls[delta.call_idx or 0] = (view, name, num_chars + len(delta.text))
                view.show_arguments_progress(name, num_chars + len(delta.text))
            return
        if self.current is None:
            self.current = AssistantMessage()
            await self.add(self.current)
        await self.current.write(delta.kind, delta.text)

    async def ask_approval(self, call: PreparedCall) -> Decision | Answer:
        self.status.show(busy="waiting for your answer…")
        try:
            return await self.push_screen_wait(ApprovalScreen(call))
        except asyncio.CancelledError:
            screens = self.screen_stack  # empty while the app quits: self.screen would raise
            if screens and isinstance(screens[-1], ApprovalScreen):
                screens[-1].dismiss(Decision.DENY)
            raise
        finally:
            self.status.show(busy=f"running {call.name}…")

    # --- actions ---

    def action_stop(self) -> None:
        if self.is_busy:
            self.workers.cancel_group(self, "turn")

    def action_interrupt(self) -> None:
        """Ctrl+C: stop the answer; idle, copy the prompt's selection, else clear the prompt (Up brings it back),
        else say that another Ctrl+C quits, and quit on one within QUIT_PRESS_S."""
        if self.is_busy:
            self.action_stop()
            return
        prompt = self.query_one(PromptInput)
        on_prompt = self.screen is self.screen_stack[0]
        if on_prompt and prompt.selected_text:
            prompt.action_copy()
            self.notify("copied to the clipboard")
        elif on_prompt and prompt.text.strip():
            prompt.stash()
            self.notify("prompt cleared: Up brings it back")
        elif self.quit_armed_at is not None and time.monotonic() - self.quit_armed_at < QUIT_PRESS_S:
            self.exit()
        else:
            self.quit_armed_at = time.monotonic()
            self.notify("Nothing to stop. Press Ctrl+C again to quit (or Ctrl+Q).", timeout=QUIT_PRESS_S)

    def action_cycle_mode(self) -> None:
        self.set_mode(self.approvals.mode.next())

    def set_mode(self, mode: Mode) -> None:
        self.approvals.mode = mode
        self.status.show(mode=mode.value)
        self.notify(f"mode: {mode.value}")

    async def action_new_session(self) -> None:
        await self.slash.run("/new")

    async def action_sessions(self) -> None:
        await self.slash.run("/sessions")

    def action_help(self) -> None:
        custom = self.slash.custom_commands()
        self.push_screen(HelpScreen([(name, command.description) for name, command in custom.items()]))

    def get_system_commands(self, screen) -> Iterator[SystemCommand]:
        """The Ctrl+P palette: the app's own commands, then Textual's (theme, keys, screenshot, quit)."""
        yield from self.slash.palette_commands()
        yield from super().get_system_commands(screen)

    def show_sessions(self) -> None:
        sessions = self.store.list(self.workspace.root)

        async def on_pick(session_id: str | None) -> None:
            if session_id:
                self.action_stop()
                await self.resume(session_id)

        self.push_screen(SessionsScreen(self.store, sessions), on_pick)
