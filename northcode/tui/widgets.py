"""The chat screen's widgets: the prompt editor, the status line, and one widget per transcript entry.

Assistant answers stream into a Markdown widget through MarkdownStream (it coalesces
fragments that come faster than it can render); reasoning streams into a folded Collapsible.
Nothing here talks to the endpoint: the app feeds these widgets (the status line's numbers and
text come from agent/session_stats.py).
"""

from __future__ import annotations

import re

from rich.syntax import Syntax
from textual import events
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Markdown, Static, TextArea

from northcode.agent.session_stats import SessionStats
from northcode.agent.todos import TodoList


MENTION_BEFORE_CURSOR = re.compile(r"(?<![\w@])@([\w./\-]*)$")  # an @path being typed, up to the cursor
PICKER_KEYS = ("up", "down", "tab", "enter", "escape")  # go to the @ picker while it is open


class PromptInput(TextArea):
    """Multi-line prompt: Enter sends, Ctrl+J (or Shift+Enter) adds a line, Up/Down walk the history; while the @
    picker is open, Up/Down move in it, Tab or Enter take its file and Esc closes it."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            self.text = text
            super().__init__()

    class PickerKey(Message):
        """A key meant for the @ picker."""

        def __init__(self, prompt: PromptInput, key: str) -> None:
            self.prompt, self.key = prompt, key
            super().__init__()

        @property
        def control(self) -> PromptInput:
            return self.prompt

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, compact=True, tab_behavior="indent",
                         placeholder="Ask, or /help for commands. @path attaches a file.", **kwargs)
        self.prompt_history: list[str] = []
        self.history_idx = 0  # == len(history) when editing a new prompt
        self.draft = ""  # the unsent prompt, kept while Up and Down walk the history
        self.picker_open = False  # set by the app while the @ picker shows

    def mention_query(self) -> str | None:
        """What follows the @ being typed at the cursor ("" just after it), or None when the cursor is not in one."""
        row, column = self.cursor_location
        match = MENTION_BEFORE_CURSOR.search(self.document.get_line(row)[:column])
        return match.group(1) if match else None

    def complete_mention(self, path: str) -> None:
        """Replace the @ being typed with `@path `."""
        row, column = self.cursor_location
        query = self.mention_query() or ""
        self.replace(f"{path} ", (row, column - len(query)), (row, column))

    async def _on_key(self, event: events.Key) -> None:
        if self.picker_open and event.key in PICKER_KEYS:
            event.stop()
            event.prevent_default()
            self.post_message(self.PickerKey(self, event.key))
            return
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.stash()
            if text:
                self.post_message(self.Submitted(text))
            return
        if event.key in ("ctrl+j", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key == "escape":  # TextArea would move the focus; the app's binding stops the answer
            event.prevent_default()
            return
        if event.key == "up" and self.cursor_location[0] == 0 and self.history_idx > 0:
            event.stop()
            event.prevent_default()
            self._show_history(self.history_idx - 1)
            return
        if event.key == "down" and self.cursor_location[0] == self.document.line_count - 1 \
                and self.history_idx < len(self.prompt_history):
            event.stop()
            event.prevent_default()
            self._show_history(self.history_idx + 1)
        # other keys: Textual goes on to TextArea._on_key (handlers run down the MRO)

    def load_history(self, prompts: list[str]) -> None:
        """Earlier prompts (oldest first), before any typed here."""
        self.prompt_history = [*prompts, *self.prompt_history]
        self.history_idx = len(self.prompt_history)

    def stash(self) -> str:
        """Empty the prompt into the history (Up brings it back); its text, stripped."""
        text = self.text.strip()
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self.history_idx = len(self.prompt_history)
        self.draft = ""
        self.clear()
        return text

    def _show_history(self, idx: int) -> None:
        if self.history_idx == len(self.prompt_history):
            self.draft = self.text
        self.history_idx = idx
        self.text = self.prompt_history[idx] if idx < len(self.prompt_history) else self.draft
        self.move_cursor(self.document.end)


class StatusLine(Static):
    """One line: model, mode, live tokens/s, TTFT, context used of the window, prefix-cache share, KV use."""

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.stats = SessionStats()

    def show(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.stats, key, value)
        self.update(self.render_text(), layout=False)

    def on_resize(self) -> None:
        self.update(self.render_text(), layout=False)

    def render_text(self) -> str:
        """The line as wide as the widget shows it (whole before the first layout)."""
        width = self.content_region.width
        return self.stats.line(width or None)


def highlighted(code: str, language: str) -> Syntax:
    """A diff or a command, highlighted alike in the transcript and the approval prompt."""
    return Syntax(code.rstrip("\n"), language, theme="ansi_dark", word_wrap=True)


class UserMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="user")


class Notice(Static):
    """An info, warning or error line in the transcript (severity: "info" | "warning" | "error")."""

    def __init__(self, text: str, severity: str = "info") -> None:
        super().__init__(text, markup=False, classes=f"notice {severity}")


class AssistantMessage(Vertical):
    """An assistant answer: folded reasoning on top, then the Markdown text, both streamed."""

    def __init__(self, content: str = "", reasoning: str = "") -> None:
        super().__init__(classes="assistant")
        self.reasoning_view = Markdown(reasoning, classes="reasoning-text")
        self.fold = Collapsible(self.reasoning_view, title="Reasoning", collapsed=True)
        self.fold.display = bool(reasoning)
        self.body = Markdown(content)
        self.streams: dict[str, object] = {}
        self.num_reasoning_fragments = 0

    def compose(self):
        yield self.fold
        yield self.body

    async def write(self, kind: str, text: str) -> None:
        """Append a streamed fragment (kind "content" or "reasoning")."""
        target = self.body if kind == "content" else self.reasoning_view
        if kind == "reasoning":  # folded: the title shows it is moving (fragments are about one token each)
            self.fold.display = True
            self.num_reasoning_fragments += 1
            self.fold.title = f"Reasoning… ({self.num_reasoning_fragments} tokens)"  # "Reasoning" once done
        stream = self.streams.get(kind)
        if stream is None:
            stream = self.streams[kind] = Markdown.get_stream(target)
        await stream.write(text)

    async def finish(self) -> None:
        """Stop the streams, then render the text once whole: a streamed code fence can keep a
        stale highlight otherwise (textual#6518)."""
        for stream in self.streams.values():
            await stream.stop()
        self.fold.title = "Reasoning"
        if "content" in self.streams:
            await self.body.update(self.body.source)
        self.streams.clear()


class ToolCallView(Vertical):
    """A tool call: its one-line title, the approval preview (diff or command), then its result."""

    MAX_OUTPUT_LINES = 12

    def __init__(self, title: str, preview: str = "", kind: str = "read") -> None:
        super().__init__(classes=f"tool {kind}")
        self.title_line = Static(f"→ {title}", markup=False, classes="tool-title")
        self.preview = preview
        self.kind = kind
        self.result = Static("", markup=False, classes="tool-result")

    def compose(self):
        yield self.title_line
        if self.preview and self.kind == "edit":
            yield Static(highlighted(self.preview, "diff"), classes="tool-preview")
        yield self.result

    def show_arguments_progress(self, name: str, num_chars: int) -> None:
        """While a call's arguments stream in (before it can be shown whole, approved and run)."""
        self.title_line.update(f"→ {name} … ({num_chars} characters of arguments so far)")

    def show_result(self, output: str, ok: bool) -> None:
        lines = output.rstrip().splitlines()
        if self.kind == "edit" and ok and lines:
            lines = lines[:1]  # the diff is already shown above
        if len(lines) > self.MAX_OUTPUT_LINES:
            cut = len(lines) - self.MAX_OUTPUT_LINES
            lines = lines[: self.MAX_OUTPUT_LINES // 2] + [f"… {cut} more lines …"] + lines[-self.MAX_OUTPUT_LINES // 2 :]
        self.result.update("\n".join(lines))
        self.set_class(not ok, "failed")


class TodoPanel(Static):
    """The session's todo list above the prompt, as the model last wrote it; hidden while the list is empty. A list
    longer than a third of the screen shows the items around the one in progress, with how many are above and below
    (the whole list is in the transcript)."""

    def show_todos(self, todos: TodoList) -> None:
        if todos.items:
            num_lines = max(3, min(10, self.app.size.height // 3 - 2))  # inside the border; the prompt keeps its room
            self.update(todo_lines(todos, num_lines))
        else:
            self.update("")
        self.display = bool(todos.items)


def todo_lines(todos: TodoList, num_lines: int) -> str:
    """The list's count line and its items, in at most `num_lines` lines (one each): those from just before the first
    item in progress (else pending), with "↑ N more" / "↓ N more" for those left out."""
    items = todos.items
    head = todos.summary().splitlines()[0]
    room = num_lines - 1
    if len(items) <= room:
        return "\n".join([head, *(todo.line() for todo in items)])
    focus = next((idx for idx, todo in enumerate(items) if todo.status == "in_progress"),
                 next((idx for idx, todo in enumerate(items) if todo.status == "pending"), 0))
    start = max(0, focus - 1)
    end = start + room - (1 if start == 0 else 2)  # the lines left after the "more" lines
    if end >= len(items):
        end, start = len(items), len(items) - (room - 1)
    lines = [head] + ([f"↑ {start} more"] if start else []) + [todo.line() for todo in items[start:end]]
    return "\n".join(lines + ([f"↓ {len(items) - end} more"] if end < len(items) else []))
