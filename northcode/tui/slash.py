"""Slash commands typed in the prompt: /new /sessions /model /mode /clear /help /quit.

Each command is one method `cmd_<name>(argument)`; unknown commands get a notice that lists
the known ones. Commands act on the app (NorthcodeApp) through its public methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from northcode.agent.approvals import Mode
from northcode.tui.screens import HelpScreen
from northcode.tui.widgets import Notice

if TYPE_CHECKING:
    from northcode.tui.app import NorthcodeApp


class SlashCommands:
    NAMES = ("new", "sessions", "model", "mode", "clear", "help", "quit")

    def __init__(self, app: NorthcodeApp) -> None:
        self.app = app

    async def run(self, text: str) -> None:
        name, _, argument = text[1:].strip().partition(" ")
        if name not in self.NAMES:
            known = " ".join(f"/{n}" for n in self.NAMES)
            await self.app.add(Notice(f"unknown command /{name}; the commands are {known}", "error"))
            return
        await getattr(self, f"cmd_{name}")(argument.strip())

    async def cmd_new(self, argument: str) -> None:
        if self.app.is_busy:
            self.app.action_stop()
        if self.app.client is None:
            self.app.notify("Not connected to a model yet.", severity="warning")
            return
        await self.app.chat.remove_children()
        self.app.tool_views.clear()
        self.app.pending_calls.clear()
        self.app.start_session()
        self.app.status.show(context_used=None, cache_share=None, tokens_per_s=None, ttft_s=None)
        await self.app.add(Notice(f"new session · {self.app.model_label}"))

    async def cmd_sessions(self, argument: str) -> None:
        if self.app.client is None:
            self.app.notify("Not connected to a model yet.", severity="warning")
            return
        self.app.show_sessions()

    async def cmd_model(self, argument: str) -> None:
        app = self.app
        if app.client is None:
            await app.add(Notice("not connected to a model", "error"))
            return
        served = [str(m.get("id")) for m in app.models]
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
        if not argument:
            self.app.set_mode(self.app.approvals.mode.next())
            return
        try:
            self.app.set_mode(Mode.parse(argument))
        except ValueError as err:
            await self.app.add(Notice(str(err), "error"))

    async def cmd_clear(self, argument: str) -> None:
        if self.app.is_busy:
            self.app.notify("Still answering: Esc stops it first.", severity="warning")
            return
        await self.app.chat.remove_children()
        self.app.tool_views.clear()
        self.app.pending_calls.clear()

    async def cmd_help(self, argument: str) -> None:
        self.app.push_screen(HelpScreen())

    async def cmd_quit(self, argument: str) -> None:
        self.app.exit()
