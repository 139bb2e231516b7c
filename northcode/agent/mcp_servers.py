"""The agent's MCP servers, through the official `mcp` SDK: their connections, their tools, and calls to them.

Each enabled server (mcp_config.py) gets one asyncio task that holds its connection open (the SDK's Client is
entered and left in one task) until `aclose`; `start` starts them all at once and waits for each up to its time
limit. A stdio server runs in the workspace folder with its stderr in a log file (never the terminal the app
draws on). Its tools are offered as mcp__<server>__<tool> with the server's JSON schema as their parameters, listed
again when the server says they changed (subscriptions/listen, or a 2025-era server's notification). A
server that fails to start, exits or loses its connection becomes "failed" with the reason; `on_change` tells
the UI, its tools leave the next request, the others go on. A workspace's servers the user has not approved
(mcp_trust.py) stay "untrusted", never started, until `trust`. No call approvals here: tools.py wraps each call in
a PreparedCall of kind "mcp" and approvals.py decides on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from northcode.agent.mcp_config import ServerConfig, load_servers
from northcode.agent.mcp_trust import needing_approval, stored_decision

log = logging.getLogger(__name__)
PREFIX = "mcp__"
MAX_NAME_CHARS = 64  # OpenAI function names: ^[a-zA-Z0-9_-]{1,64}$
CALL_TIMEOUT_S = 600.0  # one tool call at most (Esc stops one sooner)
STOP_TIMEOUT_S = 5.0  # for all of them to shut down cleanly at exit, then they are cancelled
HTTP_TIMEOUT_S, HTTP_READ_TIMEOUT_S = 30.0, 300.0  # the SDK's own defaults for its HTTP client
LOG_TAIL_LINES = 3  # of a failed stdio server's stderr, quoted in its error


class McpCallError(Exception):
    """A call that did not give a result: the server is gone, the call failed or timed out, or the tool said
    isError (the message is its text)."""


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str  # as the server calls it
    qualified: str  # mcp__<server>__<tool>: what the model calls
    description: str
    parameters: dict  # the server's input JSON schema
    read_only: bool  # the server's readOnlyHint (a hint: plan mode lets it ask, nothing more)

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.qualified, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class McpServer:
    config: ServerConfig
    log_path: Path | None  # a stdio server's stderr
    state: str = "starting"  # "disabled" | "untrusted" | "starting" | "ready" | "failed" | "stopped"
    error: str = ""
    tools: list[McpTool] = field(default_factory=list)
    client: Any = None  # mcp.Client while ready
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set once ready or failed
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # the server's stream ended (it exited)
    tools_changed: asyncio.Event = field(default_factory=asyncio.Event)  # the server said its tool list changed
    task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def describe(self) -> str:
        """One line: name, transport, state, tool count or the error."""
        where = " ".join(self.config.command) if self.config.transport == "stdio" else self.config.url
        state = f"ready, {len(self.tools)} tools" if self.state == "ready" else self.state
        return f"{self.name} ({self.config.transport}: {where}): {state}{': ' + self.error if self.error else ''}"


class McpServers:
    """The MCP servers of one workspace; `on_change(server)` hears each one that becomes ready, changes its tools or
    fails."""

    def __init__(self, configs: list[ServerConfig], root: Path, log_dir: Path,
                 on_change: Callable[[McpServer], None] | None = None, untrusted: Collection[str] = ()) -> None:
        self.root, self.log_dir = root, log_dir
        self.on_change = on_change or (lambda server: None)
        self.servers = {config.name: McpServer(config, _log_path(log_dir, config)) for config in configs}
        for server in self.servers.values():
            if not server.config.enabled or server.name in untrusted:
                server.state = "disabled" if not server.config.enabled else "untrusted"
                server.started.set()

    def untrusted(self) -> list[ServerConfig]:
        """The servers waiting for the user's approval."""
        return [server.config for server in self.servers.values() if server.state == "untrusted"]

    def trust(self) -> None:
        """The user approved the untrusted servers: the next `start` starts them."""
        for server in self.servers.values():
            if server.state == "untrusted":
                server.state = "starting"
                server.started.clear()

    async def start(self) -> None:
        """Start every enabled, trusted server not started yet, at once; return when each is ready or failed (or past
        its time limit)."""
        waiting = [server for server in self.servers.values() if server.state == "starting" and server.task is None]
        for server in waiting:
            server.task = asyncio.create_task(self._hold(server), name=f"mcp {server.name}")
        await asyncio.gather(*(self._wait_started(server) for server in waiting))

    async def _wait_started(self, server: McpServer) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(server.started.wait()), server.config.start_timeout_s)
        except TimeoutError:
            self._fail(server, f"did not start within {server.config.start_timeout_s:g} s")
            server.task.cancel()

    async def wait_started(self) -> None:
        """Until every server being started is ready or failed (each within its time limit)."""
        for server in self.servers.values():
            if server.task is not None:
                await server.started.wait()

    async def aclose(self) -> None:
        """Shut every server down: stdio ones get their stdin closed (then are terminated), HTTP sessions ended."""
        tasks = [server.task for server in self.servers.values() if server.task and not server.task.done()]
        for server in self.servers.values():
            server.stop.set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # --- one server's connection ---

    async def _hold(self, server: McpServer) -> None:
        """The task that holds `server`'s connection open until it is stopped or lost."""
        try:
            await asyncio.to_thread(_import_sdk)  # seconds when cold: on the loop it stalled the model server's probe
            async with self._client(server) as client:
                server.tools = await _list_tools(client, server.name)
                server.client, server.state = client, "ready"
                server.started.set()
                self.on_change(server)
                listener = asyncio.create_task(_listen_for_tool_changes(client, server))
                try:
                    while await _until_set(server.stop, server.closed, server.tools_changed) is server.tools_changed:
                        server.tools_changed.clear()
                        server.tools = await _list_tools(client, server.name)
                        self.on_change(server)
                finally:
                    listener.cancel()
                server.client = None
                if not server.stop.is_set():
                    raise ConnectionError("the server exited")
        except Exception as err:  # ExceptionGroup included: the SDK's task groups raise them
            if not server.stop.is_set():
                self._fail(server, _reason(err, server))
        finally:
            server.client = None
            if server.state in ("starting", "ready"):  # stopped by aclose, or cancelled by it
                server.state = "stopped"
            server.started.set()

    def _fail(self, server: McpServer, reason: str) -> None:
        if server.state == "failed":
            return
        log.info("MCP server %s failed: %s", server.name, reason)
        server.state, server.error, server.tools, server.client = "failed", reason, [], None
        server.started.set()
        self.on_change(server)

    @asynccontextmanager
    async def _client(self, server: McpServer) -> AsyncIterator[Any]:
        from mcp import Client
        from mcp.types import ToolListChangedNotification

        async def on_message(message: Any) -> None:  # a 2025-era server says so unasked
            if isinstance(message, ToolListChangedNotification):
                server.tools_changed.set()

        async with Client(_watched(self._transport(server), server.closed), client_info=_client_info(),
                          message_handler=on_message) as client:
            yield client

    @asynccontextmanager
    async def _transport(self, server: McpServer) -> AsyncIterator[Any]:
        config = server.config
        if config.transport == "stdio":
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            params = StdioServerParameters(command=config.command[0], args=list(config.command[1:]),
                                           env={**os.environ, **config.env}, cwd=self.root)
            server.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(server.log_path, "a", encoding="utf-8") as errlog:
                errlog.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(config.command)}\n")
                errlog.flush()
                async with stdio_client(params, errlog=errlog) as streams:
                    yield streams
        else:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            timeout = httpx2.Timeout(HTTP_TIMEOUT_S, read=HTTP_READ_TIMEOUT_S)
            async with httpx2.AsyncClient(headers=dict(config.headers), timeout=timeout) as http:
                async with streamable_http_client(config.url, http_client=http) as streams:
                    yield streams

    # --- what the agent uses ---

    def tools(self) -> list[McpTool]:
        """The tools of the servers that are ready now, in configuration order."""
        return [tool for server in self.servers.values() if server.state == "ready" for tool in server.tools]

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools()]

    def find(self, qualified: str) -> McpTool | None:
        return next((tool for tool in self.tools() if tool.qualified == qualified), None)

    async def call(self, tool: McpTool, arguments: dict) -> str:
        """Run `tool`; its result as text for the model. McpCallError when there is none."""
        server = self.servers[tool.server]
        if server.state != "ready" or server.client is None:
            why = f": {server.error}" if server.error else ""
            raise McpCallError(f"MCP server {tool.server} is {server.state}{why}")
        from mcp import MCPError

        try:
            result = await asyncio.wait_for(server.client.call_tool(tool.name, arguments), CALL_TIMEOUT_S)
        except TimeoutError:
            raise McpCallError(f"{tool.qualified}: no result within {CALL_TIMEOUT_S:g} s") from None
        except (MCPError, ConnectionError, OSError) as err:
            if server.task is not None:  # a lost connection: let the server's task record why
                await asyncio.wait([server.task], timeout=1.0)
            if server.state == "failed":
                why = f"MCP server {tool.server} failed: {server.error}"
                raise McpCallError(f"{tool.qualified}: no result, {why}") from None
            raise McpCallError(f"{tool.qualified} failed: {err}") from None
        text = result_text(result)
        if result.is_error:
            raise McpCallError(text or f"{tool.qualified} failed (the server gave no message)")
        return text

    def summary(self) -> list[str]:
        return [server.describe() for server in self.servers.values()]


def result_text(result: Any) -> str:
    """A CallToolResult's content for the model: its text, a note for each block that is not text, the structured
    content as JSON when there is no text."""
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "?")
        if kind == "text":
            parts.append(block.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content ({block.mime_type}, {len(block.data) * 3 // 4} bytes): not shown to you]")
        elif kind == "resource_link":
            parts.append(f"[resource link: {block.uri}{' (' + block.name + ')' if block.name else ''}]")
        elif kind == "resource" and hasattr(block.resource, "text"):
            parts.append(f"[resource {block.resource.uri}]\n{block.resource.text}")
        elif kind == "resource":
            parts.append(f"[binary resource {block.resource.uri} ({block.resource.mime_type or 'unknown type'}): "
                         "not shown to you]")
        else:
            parts.append(f"[{kind} content: not shown to you]")
    if not any(getattr(block, "type", "") == "text" for block in result.content) and result.structured_content:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts) if parts else "(no content)"


def qualified_name(server: str, tool: str) -> str:
    """mcp__<server>__<tool>, with what an OpenAI function name cannot hold as _, cut to MAX_NAME_CHARS."""
    name = f"{PREFIX}{server}__{tool}"
    return "".join(c if c.isascii() and (c.isalnum() or c in "_-") else "_" for c in name)[:MAX_NAME_CHARS]


async def _list_tools(client: Any, server: str) -> list[McpTool]:
    tools: list[McpTool] = []
    seen: set[str] = set()
    cursor = None
    while True:
        page = await client.list_tools(cursor=cursor)
        for tool in page.tools:
            qualified = qualified_name(server, tool.name)
            if qualified in seen:
                log.warning("MCP server %s: tool %s left out (its name %s is taken)", server, tool.name, qualified)
                continue
            seen.add(qualified)
            parameters = dict(tool.input_schema or {})
            parameters.setdefault("type", "object")
            read_only = bool(tool.annotations and tool.annotations.read_only_hint)
            tools.append(McpTool(server, tool.name, qualified, tool.description or tool.title or tool.name,
                                 parameters, read_only))
        cursor = page.next_cursor
        if not cursor:
            return tools


async def _listen_for_tool_changes(client: Any, server: McpServer) -> None:
    """Set `server.tools_changed` at each change a 2026-era server reports through subscriptions/listen."""
    capability = client.server_capabilities.tools
    if capability is None or not capability.list_changed:
        return
    try:
        async with client.listen(tools_list_changed=True) as subscription:
            async for _ in subscription:
                server.tools_changed.set()
    except Exception as err:  # an older protocol (it notifies unasked), or the connection went (the holder sees it)
        log.debug("MCP server %s: no tool-change events (%s)", server.name, err)


async def _until_set(*events: asyncio.Event) -> asyncio.Event:
    """The first of `events` that is set (waiting for one when none is)."""
    waiters = {asyncio.create_task(event.wait()): event for event in events}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    return next(event for event in events if event.is_set())


def _import_sdk() -> None:
    import httpx2  # noqa: F401
    import mcp  # noqa: F401
    import mcp.client.stdio  # noqa: F401
    import mcp.client.streamable_http  # noqa: F401


def _client_info() -> Any:
    from importlib.metadata import version

    from mcp import Implementation

    return Implementation(name="northcode", version=version("northcode"))


def _log_path(log_dir: Path, config: ServerConfig) -> Path | None:
    return log_dir / f"mcp-{config.name}.log" if config.transport == "stdio" else None


def _reason(err: BaseException, server: McpServer) -> str:
    """What went wrong, in a line: the innermost error of an exception group, and a stdio server's last words."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    if isinstance(err, FileNotFoundError | PermissionError):
        text = f"cannot start {server.config.command[0]!r}: {err.strerror}"
    elif str(err) in ("the server exited", "Connection closed"):
        text = "the server exited" if server.config.transport == "stdio" else "the connection closed"
    else:
        text = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    tail = _log_tail(server.log_path)
    return f"{text}{f' (its stderr ends: {tail}; the whole in {server.log_path})' if tail else ''}"


def _log_tail(path: Path | None) -> str:
    """The last lines a stdio server wrote to its log since it was started."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace") if path else ""
    except OSError:
        return ""
    lines = [line.strip() for line in text.rpartition("\n--- ")[2].splitlines()[1:] if line.strip()]
    return " / ".join(lines[-LOG_TAIL_LINES:])[:300]


class _WatchedStream:
    """A transport's read stream that sets `closed` when it ends: how a stdio server's exit is noticed while idle."""

    def __init__(self, stream: Any, closed: asyncio.Event) -> None:
        self.stream, self.closed = stream, closed

    @property
    def last_context(self) -> Any:
        return getattr(self.stream, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self.stream.receive()
        except Exception:
            self.closed.set()
            raise

    async def aclose(self) -> None:
        await self.stream.aclose()

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            self.closed.set()
            raise

    async def __aenter__(self) -> _WatchedStream:
        await self.stream.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.stream.__aexit__(*exc)


@asynccontextmanager
async def _watched(transport: Any, closed: asyncio.Event) -> AsyncIterator[Any]:
    async with transport as (read_stream, write_stream):
        yield _WatchedStream(read_stream, closed), write_stream


def workspace_servers(root: Path, on_change: Callable[[McpServer], None] | None = None
                      ) -> tuple[McpServers, list[str]]:
    """The servers configured for workspace `root` (mcp_config.py; not started yet; the workspace's own "untrusted"
    unless the user approved them), their logs in northcode's data folder, and the configuration's errors."""
    from northcode import paths

    configs, errors = load_servers(root, paths.data_dir())
    pending = needing_approval(configs, paths.data_dir())
    untrusted = [] if stored_decision(root, pending, paths.data_dir()) else [config.name for config in pending]
    return McpServers(configs, root, paths.data_dir(), on_change, untrusted), errors
