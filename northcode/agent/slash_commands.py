"""The slash commands typed in the app's prompt: their names and help lines, and parsing what was typed.

One table (SLASH_COMMANDS) feeds the parser, the unknown-command notice and the help page, so
a new command is one row here and one `cmd_<name>` method in tui/slash.py, which runs it.
No UI here.
"""

from __future__ import annotations

from collections.abc import Collection

from northcode.agent.approvals import Mode

SLASH_COMMANDS = (  # (name, its argument as the help page writes it (Markdown), what it does)
    ("new", "", "start a new session"),
    ("sessions", "", "list, resume or delete saved sessions"),
    ("model", "[ID]", "show the model and endpoint; switch to another served model"),
    ("mode", "[plan\\|ask\\|auto-edit\\|full-auto]", "show or set when tools ask first"),
    ("undo", "", "take back the file changes of the agent's last turn that made any (not shell commands)"),
    ("compact", "", "summarise the conversation so far and go on from the summary (frees the context; "
                    "the agent does it itself before the context fills)"),
    ("mcp", "[trust]", "list the MCP servers: their state, tools and errors; /mcp trust asks again whether this "
                       "workspace's servers may start"),
    ("clear", "", "clear the screen (the conversation goes on)"),
    ("help", "", "this page"),
    ("quit", "", "leave"),
)
NAMES = tuple(name for name, _, _ in SLASH_COMMANDS)
MODE_HELP = {Mode.PLAN: "read-only: reads and the todo list run; edits and shell commands are refused",
             Mode.ASK: "reads run; edits and shell commands ask first",
             Mode.AUTO_EDIT: "reads and edits run; shell commands ask first",
             Mode.FULL_AUTO: "everything runs, but commands that reach beyond the workspace ask"}


def parse_command(text: str, custom: Collection[str] = ()) -> tuple[str, str]:
    """"/mode  ask " -> ("mode", "ask"); a ValueError that lists the commands (`custom` ones after the built-in
    ones) for an unknown name."""
    name, _, argument = text[1:].strip().partition(" ")
    if name not in NAMES and name not in custom:
        known = " ".join(f"/{n}" for n in (*NAMES, *custom))
        raise ValueError(f"unknown command /{name}; the commands are {known}")
    return name, argument.strip()


def mode_from_argument(argument: str, current: Mode) -> Mode:
    """/mode's argument: a mode by name (ValueError for another word), or, without one, the next mode."""
    return Mode.parse(argument) if argument else current.next()


def commands_table(custom: Collection[tuple[str, str]] = ()) -> str:
    """The commands as a Markdown table, for the help page; `custom`: (name, description) of the custom ones."""
    rows = [f"| /{name}{' ' + argument if argument else ''} | {does} |" for name, argument, does in SLASH_COMMANDS]
    rows += [f"| /{name} | {_escaped(does)} (custom) |" for name, does in custom]
    return "\n".join(["| command | does |", "| --- | --- |", *rows])


def _escaped(text: str) -> str:
    return text.replace("|", "\\|")
