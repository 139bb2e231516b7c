"""Modal screens: the approval prompt (with the diff or command), its hunk-by-hunk review, the question whether a
workspace's MCP servers may start, the session list, the help page.

Each is dismissed with its answer: ApprovalScreen with a Decision (Esc denies) or an Answer (a denial
with the user's note for the model, or an edit with only the hunks HunkReviewScreen took); HunkReviewScreen
with the indices of the hunks taken (None: back); McpTrustScreen with True (start them) or False (Esc);
SessionsScreen with the id of the session to resume (or None), HelpScreen with nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Markdown, Static

from northcode.agent.approvals import Answer, Decision
from northcode.agent.instructions import shown_path
from northcode.agent.mcp_config import ServerConfig
from northcode.agent.mcp_trust import describe_config
from northcode.agent.sessions import SessionInfo, SessionStore
from northcode.agent.slash_commands import commands_table
from northcode.agent.tools import PreparedCall
from northcode.tui.widgets import highlighted

# Below 44 rows the modals' scrolling parts get a share of the height instead of their fixed limit (app.tcss), so the
# buttons stay on screen at 80x24.
MODAL_BREAKPOINTS = [(0, "-short"), (44, "-tall")]


class ApprovalScreen(ModalScreen[Decision | Answer]):
    """Asks whether one tool call may run: y allow once, a allow for this session, n or Esc deny, t deny and
    say why (a line for the model: what to do instead; Enter sends it, the diff stays in view to quote),
    h review an edit of several hunks one by one."""

    VERTICAL_BREAKPOINTS = MODAL_BREAKPOINTS
    BINDINGS = [Binding("y", "decide('allow_once')", "allow once"),
                Binding("a", "decide('allow_session')", "allow for this session"),
                Binding("n,escape", "decide('deny')", "deny"),
                Binding("t", "deny_with_note", "deny and say why"),
                Binding("h", "review_hunks", "hunk by hunk")]

    def __init__(self, call: PreparedCall) -> None:
        super().__init__()
        self.call = call

    def compose(self) -> ComposeResult:
        language = {"edit": "diff", "mcp": "json"}.get(self.call.kind, "bash")
        with Vertical(id="approval"):
            hunks = f"; h: hunk by hunk ({len(self.call.hunks)})" if len(self.call.hunks) > 1 else ""
            yield Static(f"Allow this {self.call.kind} call?  (t: deny and tell the model why{hunks})",
                         classes="modal-title")
            if self.call.kind != "shell":  # a command is shown once, highlighted, below
                yield Static(self.call.title, markup=False, classes="approval-call")
            with VerticalScroll(id="approval-preview"):
                yield Static(highlighted(self.call.preview or self.call.title, language))
            with Horizontal(classes="buttons"):  # a fourth button would overflow an 80-column terminal
                yield Button("Allow once (y)", id="allow_once", variant="primary")
                yield Button("Allow for this session (a)", id="allow_session")
                yield Button("Deny (n, Esc)", id="deny", variant="error")
            yield Input(placeholder="What should the model do instead? Enter sends, Esc denies", id="deny-note")

    def on_mount(self) -> None:
        self.query_one("#deny-note", Input).display = False

    def action_decide(self, answer: str) -> None:
        self.dismiss(Decision[answer.upper()])

    def action_deny_with_note(self) -> None:
        """The note's line takes the buttons' place (the screen keeps its height; the diff stays to quote)."""
        self.query_one(".buttons").display = False
        note = self.query_one("#deny-note", Input)
        note.display = True
        note.focus()

    def action_review_hunks(self) -> None:
        if len(self.call.hunks) < 2:
            return

        def reviewed(taken: frozenset[int] | None) -> None:
            if taken is None:
                return  # back to this prompt
            if not taken:
                self.dismiss(Decision.DENY)
            else:
                self.dismiss(Answer(Decision.ALLOW_ONCE, hunks=taken))

        self.app.push_screen(HunkReviewScreen(self.call), reviewed)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_decide(event.button.id or "deny")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(Answer(Decision.DENY, event.value.strip()))


class HunkReviewScreen(ModalScreen[frozenset[int] | None]):
    """An edit's hunks one at a time: y takes the current one and n leaves it (both move on), Up/Down move,
    Space flips it, Enter applies the hunks taken (none: the edit is denied), Esc goes back. All start taken."""

    VERTICAL_BREAKPOINTS = MODAL_BREAKPOINTS
    BINDINGS = [Binding("y", "mark(True)", "take"), Binding("n", "mark(False)", "leave"),
                Binding("space", "flip", "flip"), Binding("up,k", "move(-1)", "previous"),
                Binding("down,j", "move(1)", "next"), Binding("enter", "apply", "apply"),
                Binding("escape", "dismiss_none", "back")]

    def __init__(self, call: PreparedCall) -> None:
        super().__init__()
        self.call = call
        self.taken = [True] * len(call.hunks)
        self.current = 0

    def compose(self) -> ComposeResult:
        with Vertical(id="hunks"):
            yield Static(f"{self.call.title}: y take · n leave · Space flip · Up/Down move · Enter apply · Esc back",
                         markup=False, classes="modal-title")
            with VerticalScroll(id="hunk-list", can_focus=False):
                for idx, hunk in enumerate(self.call.hunks):
                    yield Static("", markup=False, id=f"hunk-label-{idx}", classes="hunk-label")
                    yield Static(highlighted(hunk.text, "diff"), classes="hunk")

    def on_mount(self) -> None:
        self.show()

    def show(self) -> None:
        for idx, taken in enumerate(self.taken):
            label = self.query_one(f"#hunk-label-{idx}", Static)
            marker = "▶" if idx == self.current else " "
            label.update(f"{marker} hunk {idx + 1} of {len(self.taken)}: {'taken' if taken else 'left out'}")
            label.set_class(idx == self.current, "current")
            label.set_class(not taken, "left-out")
        self.query_one(f"#hunk-label-{self.current}").scroll_visible(top=True)  # its hunk below it in view

    def action_move(self, step: int) -> None:
        self.current = min(max(self.current + step, 0), len(self.taken) - 1)
        self.show()

    def action_mark(self, taken: bool) -> None:
        self.taken[self.current] = taken
        self.action_move(1)

    def action_flip(self) -> None:
        self.taken[self.current] = not self.taken[self.current]
        self.show()

    def action_apply(self) -> None:
        self.dismiss(frozenset(idx for idx, taken in enumerate(self.taken) if taken))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class McpTrustScreen(ModalScreen[bool]):
    """Asks once whether the MCP servers a workspace's files configure may start, naming each one and what it runs.
    Enter presses the focused button ("Don't start them" at first; Left/Right or Tab move), Esc does not start them:
    no letter answers, since the screen opens with the app and a prompt typed at once must not say yes. The app
    keeps the answer until those definitions change."""

    VERTICAL_BREAKPOINTS = MODAL_BREAKPOINTS
    BINDINGS = [Binding("escape", "decide(False)", "don't start them"),
                Binding("left", "app.focus_previous", show=False), Binding("right", "app.focus_next", show=False)]

    def __init__(self, root: Path, configs: list[ServerConfig]) -> None:
        super().__init__()
        self.root, self.configs = root, configs

    def compose(self) -> ComposeResult:
        with Vertical(id="mcp-trust"):
            yield Static(f"Start the MCP servers of workspace {self.root.name}?", markup=False, classes="modal-title")
            yield Static("Its files configure them. A stdio server is a command run on your machine as you; an HTTP "
                         "server gets the headers named. Their tools join the agent's.", markup=False)
            with VerticalScroll(id="mcp-trust-list"):
                for config in self.configs:
                    yield Static(f"{config.name}  [{shown_path(config.source, self.root)}]", markup=False,
                                 classes="approval-call")
                    yield Static(describe_config(config), markup=False, classes="mcp-trust-what")
            yield Static("Left/Right choose, Enter answers. Kept until these definitions change; /mcp trust asks "
                         "again.", markup=False, classes="mcp-trust-note")
            with Horizontal(classes="buttons"):
                yield Button("Start them", id="start", variant="primary")
                yield Button("Don't start them (Esc)", id="refuse", variant="error")

    def on_mount(self) -> None:
        self.query_one("#refuse", Button).focus()  # Enter on a screen that just opened starts nothing

    def action_decide(self, allowed: bool) -> None:
        self.dismiss(allowed)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "start")


def _age(timestamp: float) -> str:
    seconds = max(time.time() - timestamp, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f} {unit} ago"
    return "just now"


class SessionsScreen(ModalScreen[str | None]):
    """The saved sessions of this workspace: Enter resumes, d deletes, Esc closes."""

    BINDINGS = [Binding("escape", "dismiss_none", "close"), Binding("d", "delete", "delete")]

    def __init__(self, store: SessionStore, sessions: list[SessionInfo]) -> None:
        super().__init__()
        self.store = store
        self.sessions = sessions

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions"):
            yield Static("Sessions  (Enter resume · d delete · Esc close)", classes="modal-title")
            yield DataTable(id="session-table", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("title", "messages", "updated", "model")
        for info in self.sessions:
            table.add_row(info.title, str(info.num_messages), _age(info.updated_at), info.model, key=info.id)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.dismiss(event.row_key.value)

    def action_dismiss_none(self) -> None:
        self.dismiss(None)

    def action_delete(self) -> None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return
        row_key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        self.store.delete(row_key.value)
        table.remove_row(row_key)
        self.notify(f"deleted session {row_key.value}")


HELP_TEXT = """\
# northcode

*Esc closes this page; Up, Down and Page Up/Down scroll it.*

**Keys**

| key | does |
| --- | --- |
| Enter | send the prompt |
| Ctrl+J | new line in the prompt |
| Up / Down | previous / next prompt (on the first / last line) |
| Esc, Ctrl+C | stop the answer now (the server stops generating); Esc also denies an approval |
| Ctrl+C (idle) | copy the selection, else clear the prompt (Up brings it back); on an empty prompt, twice: quit |
| Shift+Tab | next mode: plan → ask → auto-edit → full-auto → plan |
| Ctrl+N | new session |
| Ctrl+S | sessions |
| Ctrl+P | command palette: the app's commands, searchable |
| F1 | this page (F1 or Esc closes it) |
| Ctrl+Q | quit |

**Commands**

{commands}

Custom commands: `NAME.md` in `.northcode/commands/` (or `.claude/commands/`, `.opencode/command/`)
or in `commands/` of northcode's data folder makes `/NAME`; its text is the prompt, `$ARGUMENTS`
what follows the name.

**Modes**: *plan* is read-only: reads and the todo list run, edits and commands are
refused (the model plans); *ask* runs reads and asks before edits and commands; *auto-edit* also
makes edits without asking; *full-auto* runs everything but commands that reach beyond the
workspace (sudo, `rm -rf /…`, force pushes). Paths never leave the workspace, and `.git` is
never written, in any mode.

`@path` in a prompt attaches that file. `AGENTS.md` and `CLAUDE.md` join the system prompt:
the workspace's, its parent folders' and those in northcode's data folder.
"""


class HelpScreen(ModalScreen[None]):
    """Keys, commands (the custom ones too: (name, description) pairs), modes."""

    BINDINGS = [Binding("escape,q,f1", "dismiss_none", "close")]

    def __init__(self, custom: list[tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.custom = custom or []

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Markdown(HELP_TEXT.format(commands=commands_table(self.custom)))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
