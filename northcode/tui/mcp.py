"""The app's side of the MCP servers: started with the app, a notice as each gets ready or fails, /mcp's listing.

A workspace's own servers start only once the user has approved them: the app asks (McpTrustScreen) when no
answer is kept for their definitions (agent/mcp_trust.py), and `/mcp trust` asks again. The servers themselves
(connections, tools, calls) are agent/mcp_servers.py's; this only asks and tells the user.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from northcode import paths
from northcode.agent.instructions import shown_path
from northcode.agent.mcp_config import USER_FILE
from northcode.agent.mcp_servers import McpServer, workspace_servers
from northcode.agent.mcp_trust import servers_named, store_decision, stored_decision
from northcode.tui.screens import McpTrustScreen
from northcode.tui.widgets import Notice

if TYPE_CHECKING:
    from northcode.tui.app import NorthcodeApp


class AppMcpServers:
    def __init__(self, app: NorthcodeApp) -> None:
        self.app = app
        self.ready_once: set[str] = set()  # the servers that were ready at some point (a later failure lost tools)
        self.servers, self.errors = workspace_servers(app.workspace.root, self.on_change)
        app.toolbox.mcp = self.servers  # their tools join the agent's as each server gets ready

    def start(self) -> None:
        """Start the servers in a worker, beside the model server's connection."""
        if self.errors or self.servers.servers:
            self.app.run_worker(self._start(), group="mcp", exit_on_error=False)

    async def _start(self) -> None:
        for error in self.errors:
            await self.app.add(Notice(f"MCP configuration: {error}", "error"))
        untrusted = self.servers.untrusted()
        if untrusted and stored_decision(self.app.workspace.root, untrusted, paths.data_dir()) is None:
            await self.ask_trust()
        elif untrusted:
            await self.app.add(Notice(f"{self.names(untrusted)} not started: you declined this "
                                      "workspace's MCP servers (/mcp trust asks again)", "warning"))
        await self.servers.start()

    def names(self, configs) -> str:
        return servers_named(configs, self.app.workspace.root)

    async def ask_trust(self) -> None:
        """Ask whether the untrusted servers may start (in a worker) and keep the answer; start them on a yes."""
        untrusted = self.servers.untrusted()
        root = self.app.workspace.root
        allowed = await self.app.push_screen_wait(McpTrustScreen(root, untrusted))
        store_decision(root, untrusted, paths.data_dir(), allowed)
        if allowed:
            self.servers.trust()
        else:
            await self.app.add(Notice(f"{self.names(untrusted)} not started (/mcp trust asks again)"))

    def trust_again(self) -> None:
        """/mcp trust: ask about the untrusted servers now, and start them on a yes."""
        if not self.servers.untrusted():
            self.app.notify("No MCP server is waiting for approval (/mcp lists them).")
            return

        async def ask_and_start() -> None:
            await self.ask_trust()
            await self.servers.start()

        self.app.run_worker(ask_and_start(), group="mcp", exit_on_error=False)

    async def aclose(self) -> None:
        await self.servers.aclose()

    def on_change(self, server: McpServer) -> None:
        if server.state == "ready" and server.name in self.ready_once:
            notice = Notice(f"MCP server {server.name} changed its tools: {len(server.tools)} now (/mcp lists them)")
        elif server.state == "ready":
            self.ready_once.add(server.name)
            notice = Notice(f"MCP server {server.name}: ready, {len(server.tools)} tools (/mcp lists them)")
        elif server.name in self.ready_once:
            notice = Notice(f"MCP server {server.name} failed: {server.error}; its tools are gone, the agent goes "
                            "on without them", "error")
        else:
            notice = Notice(f"MCP server {server.name} failed to start: {server.error}; the agent goes on without "
                            "it", "error")
        self.app.call_later(self.app.add, notice)

    def listing(self) -> str:
        """/mcp's text: each server, where it is configured, its state and its tools."""
        root = self.app.workspace.root
        errors = ["Configuration errors:", *(f"  {error}" for error in self.errors)] if self.errors else []
        if not self.servers.servers:
            return "\n".join([f"No MCP servers configured. Add them to .mcp.json or opencode.json in the workspace, or "
                              f"to {paths.data_dir() / USER_FILE} for every workspace (docs/tui.md has the format).",
                              *errors])
        lines = ["MCP servers:"]
        for server in self.servers.servers.values():
            lines.append(f"  {server.describe()}  [{shown_path(server.config.source, root)}]")
            lines += [f"    {tool.qualified}{' (read-only)' if tool.read_only else ''}" for tool in server.tools]
        if self.servers.untrusted():
            lines.append("Untrusted: this workspace's files configure them and you have not approved them, so they "
                         "were not started; /mcp trust asks.")
        return "\n".join(lines + errors)
