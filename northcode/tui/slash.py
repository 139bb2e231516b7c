"""Slash commands typed in the prompt (or picked in the Ctrl+P palette): /new /sessions /model /mode /undo
/compact /mcp /clear /help /quit.

Each command is one method `cmd_<name>(argument)`; agent/slash_commands.py parses the line
(an unknown command gets a notice that lists the known ones) and holds their help lines.
Commands act on the app (NorthcodeApp) through its public methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

from textual.app import SystemCommand

from northcode import paths
from northcode.agent.approvals import Mode
from northcode.agent.custom_commands import CustomCommand, load_commands
from northcode.agent.edit_journal import UndoError
from northcode.agent.slash_commands import MODE_HELP, NAMES, SLASH_COMMANDS, mode_from_argument, parse_command
from northcode.tui.widgets import Notice

if TYPE_CHECKING:
    from northcode.tui.app import NorthcodeApp


class SlashCommands:
    def __init__(self, app: NorthcodeApp) -> None:
        self.app = app

    def custom_commands(self) -> dict[str, CustomCommand]:
        """The custom commands (agent/custom_commands.py), read afresh."""
        return load_commands(self.app.workspace.root, paths.data_dir(), reserved=NAMES)

    async def run(self, text: str) -> None:
        custom = self.custom_commands()
        try:
            name, argument = parse_command(text, custom)
        except ValueError as err:
            await self.app.add(Notice(str(err), "error"))
            return
        if name in custom:  # its text is the prompt; the screen shows the command as typed
            self.app.send(custom[name].expand(argument), typed=text.strip())
            return
        await getattr(self, f"cmd_{name}")(argument)

    def palette_commands(self) -> Iterator[SystemCommand]:
        """The commands for the Ctrl+P palette: each slash command, /mode with each mode, /model with each id served."""
        for name, _, does in SLASH_COMMANDS:
            yield SystemCommand(f"/{name}", does, partial(self.run, f"/{name}"))
        for mode in Mode:
            yield SystemCommand(f"/mode {mode.value}", MODE_HELP[mode], partial(self.run, f"/mode {mode.value}"))
        for model_id in self.app.served.served_ids if self.app.served else ():
            yield SystemCommand(f"/model {model_id}", "use this model", partial(self.run, f"/model {model_id}"))
        for name, command in self.custom_commands().items():
            yield SystemCommand(f"/{name}", f"{command.description} (custom)", partial(self.run, f"/{name}"))

    def require_connection(self) -> bool:
        """Whether a model server is connected; warns when not."""
        if self.app.client is None:
            self.app.notify("Not connected to a model yet.", severity="warning")
        return self.app.client is not None

    def idle(self) -> bool:
        """Whether no answer is running; warns when one is (the commands that change the conversation wait)."""
        if self.app.is_busy:
            self.app.notify("Still answering: Esc stops it first.", severity="warning")
        return not self.app.is_busy

    async def cmd_new(self, argument: str) -> None:
        if self.app.is_busy:
            self.app.action_stop()
        if not self.require_connection():
            return
        await self.app.clear_transcript()
        self.app.start_session()
        self.app.status.show(context_used=None, cache_share=None, tokens_per_s=None, ttft_s=None)
        await self.app.add(Notice(f"new session · {self.app.model_label}"))

    async def cmd_sessions(self, argument: str) -> None:
        if self.require_connection():
            self.app.show_sessions()

    async def cmd_model(self, argument: str) -> None:
        app = self.app
        if app.client is None:
            await app.add(Notice("not connected to a model", "error"))
            return
        served = app.served.served_ids if app.served else ()
        if argument:
            if argument not in served:
                await app.add(Notice(f"model {argument!r}: not served here; served: {', '.join(served)}", "error"))
                return
            app.client.model = argument
            app.model_label = argument
            app.status.show(model=argument)
        await app.add(Notice(f"model {app.model_label} (requests use id {app.client.model!r}) at {app.client.base_url}; "
                             f"served: {', '.join(served)}"))

    async def cmd_mode(self, argument: str) -> None:
        try:
            self.app.set_mode(mode_from_argument(argument, self.app.approvals.mode))
        except ValueError as err:
            await self.app.add(Notice(str(err), "error"))

    async def cmd_undo(self, argument: str) -> None:
        app = self.app
        if not self.idle():
            return
        try:
            done = app.toolbox.journal.undo_last_turn()
        except UndoError as err:
            await app.add(Notice(str(err), "error"))
            return
        except OSError as err:  # a file the journal could not write back (permissions, a full disk)
            await app.add(Notice(f"undo failed part way: {err}", "error"))
            return
        await app.add(Notice(f"undone: {', '.join(done)}"))
        if app.agent is not None:  # the model must not go on from files it thinks it changed
            app.agent.note(f"the user undid the file changes of one of your turns ({', '.join(done)}); "
                           "those files are as they were before that turn")

    async def cmd_compact(self, argument: str) -> None:
        if not self.idle():
            return
        if self.require_connection() and self.app.agent is not None:
            self.app.compact()

    async def cmd_mcp(self, argument: str) -> None:
        """/mcp lists the servers; /mcp trust asks whether the workspace's untrusted ones may start."""
        if argument == "trust":
            self.app.mcp.trust_again()
        elif argument:
            await self.app.add(Notice(f"/mcp {argument}: expected /mcp or /mcp trust", "error"))
        else:
            await self.app.add(Notice(self.app.mcp.listing()))

    async def cmd_clear(self, argument: str) -> None:
        if not self.idle():
            return
        await self.app.clear_transcript()

    async def cmd_help(self, argument: str) -> None:
        self.app.action_help()

    async def cmd_quit(self, argument: str) -> None:
        self.app.exit()
