"""Who decides whether a tool call runs: the mode, the session's standing approvals, or the user.

Modes: `plan` (read-only: reads run; edits and shell commands are refused without a question), `ask`
(reads run; edits and shell commands ask), `auto-edit` (reads and edits run; shell asks), `full-auto`
(everything runs). The todo list touches no file and runs in every mode. webfetch (fetch kind) reads, so plan
mode asks for it as ask and auto-edit do; full-auto runs it. An MCP server's tool (mcp kind) asks in ask and
auto-edit and runs in full-auto; plan mode refuses it, or asks when its server marks it readOnlyHint. The answer to
a question is allow once, allow for this session (every edit from then on; for shell, that exact command again; for
a fetch, that URL's host; for an MCP tool, that tool) or deny, with or without a note that tells the model what to
do instead; for an edit, also some of its hunks only. With no one to ask (headless), a call that needs a question
is denied with a reason the model can read. The sandbox's path checks hold in every mode; approvals never widen
them. Shell commands that can do damage beyond the workspace (sudo, recursive deletes of absolute, home or parent paths,
force pushes, disk writes) ask even in full-auto, and are never allowed for the whole session.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from northcode.agent.tools import PreparedCall


class Mode(str, enum.Enum):
    """In cycling order (Shift+Tab): from the most careful to the least, and back to plan."""

    PLAN = "plan"
    ASK = "ask"
    AUTO_EDIT = "auto-edit"
    FULL_AUTO = "full-auto"

    @classmethod
    def parse(cls, value: str) -> Mode:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"mode {value!r}: expected one of {', '.join(m.value for m in cls)}") from None

    def next(self) -> Mode:
        modes = list(Mode)
        return modes[(modes.index(self) + 1) % len(modes)]


class Decision(str, enum.Enum):
    ALLOW_ONCE = "allow once"
    ALLOW_SESSION = "allow for this session"
    DENY = "deny"


DANGEROUS_COMMAND = re.compile(
    r"(^|[;&|(`]\s*|\s)(sudo|doas|mkfs(\.\w+)?|shutdown|reboot)\b"  # privileges, disks, the machine
    r"|\brm\s+(-\w+\s+)*-\w*[rR]\w*\s+(-\w+\s+)*(/|~|\$HOME|\.\.)"  # recursive delete outside
    r"|\bgit\s+push\b.*\s(--force\b|-f\b)"  # rewriting a shared history
    r"|\bdd\b.*\bof=/dev/|>\s*/dev/sd"  # raw disk writes
)


def is_dangerous(command: str) -> bool:
    """Whether a shell command can do damage beyond the workspace, so it must always ask."""
    return DANGEROUS_COMMAND.search(command) is not None


@dataclass(frozen=True, slots=True)
class Answer:
    """A decision with the user's words for the model (a denial that says what to do instead), or, allowing an
    edit, the indices of the hunks to apply (None: all)."""

    decision: Decision
    note: str = ""
    hunks: frozenset[int] | None = None


AUTO_KINDS = {Mode.PLAN: {"read", "todo"}, Mode.ASK: {"read", "todo"}, Mode.AUTO_EDIT: {"read", "todo", "edit"},
              Mode.FULL_AUTO: {"read", "todo", "edit", "shell", "fetch", "mcp"}}
PLAN_KINDS = {"read", "todo", "fetch"}  # fetching reads: plan mode asks for it, as ask mode does
PLAN_REFUSAL = ("refused without asking: the session is in plan mode, which is read-only (read, list, glob, grep, "
                "the todo list and, with the user's approval, webfetch and MCP tools marked read-only). Finish the plan "
                "and present it; the user leaves plan mode to let you {kind}")
PLAN_VERBS = {"edit": "edit files", "shell": "run commands", "mcp": "call MCP tools not marked read-only"}
Asker = Callable[[PreparedCall], Awaitable[Decision | Answer]]


class Approvals:
    """The approval state of one session: its mode (changeable at any time) and standing approvals."""

    def __init__(self, mode: Mode, ask: Asker | None) -> None:
        self.mode = mode
        self.ask = ask  # None: headless, questions are denied
        # ("edit", ""), ("shell", command), ("fetch", host) or ("mcp", mcp__<server>__<tool>)
        self.session_allowed: set[tuple[str, str]] = set()

    def _session_key(self, call: PreparedCall) -> tuple[str, str]:
        if call.kind == "fetch":
            return (call.kind, httpx.URL(call.preview).host)
        if call.kind == "mcp":
            return (call.kind, call.name)
        return (call.kind, call.preview if call.kind == "shell" else "")

    async def decide(self, call: PreparedCall) -> tuple[bool, str, frozenset[int] | None]:
        """Whether `call` may run, why (the reason goes to the model when it is denied), and the hunks of an
        edit the user took (None: the whole call)."""
        dangerous = call.kind == "shell" and is_dangerous(call.preview)
        planned = call.kind in PLAN_KINDS or (call.kind == "mcp" and call.read_only)
        if self.mode is Mode.PLAN and not planned:  # before the session's approvals
            return False, PLAN_REFUSAL.format(kind=PLAN_VERBS.get(call.kind, f"run {call.kind} calls")), None
        if call.kind in AUTO_KINDS[self.mode] and not dangerous:
            return True, f"allowed by mode {self.mode.value}", None
        if self._session_key(call) in self.session_allowed and not dangerous:
            return True, "allowed for this session", None
        if self.ask is None:
            return False, (f"denied: mode {self.mode.value} needs the user's approval for {call.kind} calls "
                           "and no one can answer in a headless run"), None
        answer = await self.ask(call)
        if not isinstance(answer, Answer):
            answer = Answer(answer)
        decision, note = answer.decision, answer.note.strip()
        if decision is Decision.ALLOW_SESSION and not dangerous:
            self.session_allowed.add(self._session_key(call))
        if decision is Decision.DENY:
            return False, f"denied by the user, who says: {note}" if note else "denied by the user", None
        if answer.hunks is not None and len(answer.hunks) < len(call.hunks):
            return True, "some hunks allowed by the user", answer.hunks
        return True, decision.value, None
