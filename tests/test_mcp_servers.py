"""MCP servers in the agent: a server written here with the SDK's MCPServer (FastMCP's v2 name), run over stdio (this
file as a subprocess) and streamable HTTP (uvicorn in a thread), its tools called by the agent loop against the
scripted endpoint, approvals per mode, servers that fail to start or die, and the clean shutdown."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from pathlib import Path

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError as ServerToolError
from mcp.types import ImageContent, TextContent, ToolAnnotations
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

TESTS = Path(__file__).resolve().parent


def build_server(notes: list[str]) -> MCPServer:
    """The test's server; write_note appends to `notes`."""
    server = MCPServer("calc", log_level="ERROR")

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def write_note(text: str) -> str:
        """Keep a note."""
        notes.append(text)
        return f"noted: {text}"

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def cwd() -> str:
        """The server's working folder."""
        return os.getcwd()

    @server.tool()
    def picture() -> list:
        """A caption and an image."""
        return [TextContent(type="text", text="a red dot"), ImageContent(type="image", data="AAAA", mimeType="image/png")]

    @server.tool()
    def fail() -> str:
        """Always fails."""
        raise ServerToolError("the disk is full")

    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    async def grow(ctx: Context) -> str:
        """Add a tool named extra, and say the tools changed."""
        def extra() -> str:
            """A tool that was not there at first."""
            return "extra!"

        server.add_tool(extra)
        await ctx.notify_tools_changed()  # to subscriptions/listen (2026-07-28 sessions)
        if ctx.request_context.session.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            await ctx.session.send_tool_list_changed()  # the notification older sessions get unasked
        return "grown"

    @server.tool()
    def die() -> str:
        """Exit at once, without an answer."""
        os._exit(3)

    return server


if __name__ == "__main__":  # the stdio server: python tests/test_mcp_servers.py
    build_server([]).run("stdio")
    sys.exit(0)

import pytest  # noqa: E402
from agent_scripted_endpoint import (RecordingAsker, ScriptedEndpoint, ThreadedServer, text_reply,  # noqa: E402
                                     tool_reply)

from northcode.agent.approvals import Approvals, Decision, Mode  # noqa: E402
from northcode.agent.client import ChatClient  # noqa: E402
from northcode.agent.loop import Agent  # noqa: E402
from northcode.agent.mcp_config import ServerConfig  # noqa: E402
from northcode.agent.mcp_servers import McpCallError, McpServers, qualified_name  # noqa: E402
from northcode.agent.sandbox import Workspace  # noqa: E402
from northcode.agent.tools import ToolBox, ToolError  # noqa: E402

STDIO_COMMAND = (sys.executable, str(Path(__file__).resolve()))


class HttpMcpServer:
    """build_server() over streamable HTTP on a free loopback port; `headers` keeps each request's headers, `notes`
    what write_note was given."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        app = build_server(self.notes).streamable_http_app()
        self.headers: list[dict[str, str]] = []

        async def recorded(scope, receive, send) -> None:
            if scope["type"] == "http":
                self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
            await app(scope, receive, send)

        self._server = ThreadedServer(recorded)
        self.url = f"http://127.0.0.1:{self._server.port}/mcp"

    def __enter__(self) -> HttpMcpServer:
        self._server.start("the MCP HTTP server")
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()


def stdio_config(name: str = "calc", command: tuple[str, ...] = STDIO_COMMAND, **kwargs) -> ServerConfig:
    return ServerConfig(name, "stdio", Path("test.json"), command, **kwargs)


@pytest.fixture(scope="module")
def http_server():
    with HttpMcpServer() as server:
        yield server


@pytest.fixture
async def web(http_server, workspace, tmp_path):
    """The HTTP server (it starts faster than a subprocess), as server "calc", in a toolbox; no notes yet."""
    http_server.notes.clear()
    servers = McpServers([ServerConfig("calc", "http", Path("t.json"), url=http_server.url)], workspace.root, tmp_path)
    await servers.start()
    toolbox = ToolBox(workspace, tmp_path / "spill")
    toolbox.mcp = servers
    yield toolbox
    await servers.aclose()


@pytest.fixture
def workspace(tmp_path) -> Workspace:
    root = tmp_path / "project"
    root.mkdir()
    return Workspace(root)


@pytest.fixture
async def calc(workspace, tmp_path):
    """The stdio server, started, in a toolbox."""
    servers = McpServers([stdio_config()], workspace.root, tmp_path / "logs")
    await servers.start()
    toolbox = ToolBox(workspace, tmp_path / "spill")
    toolbox.mcp = servers
    yield toolbox
    await servers.aclose()


def tool_outputs(request: dict) -> list[str]:
    return [m["content"] for m in request["messages"] if m["role"] == "tool"]


# --- connections and tools ---


async def test_stdio_tools_are_offered_under_the_prefix_with_their_schemas(calc):
    (server,) = calc.mcp.servers.values()
    assert server.state == "ready" and not server.error
    schemas = {s["function"]["name"]: s["function"] for s in calc.schemas()}
    assert {"read", "bash", "mcp__calc__add", "mcp__calc__die"} <= set(schemas)
    add = schemas["mcp__calc__add"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["properties"]["a"]["type"] == "integer" and add["parameters"]["required"] == ["a", "b"]
    assert calc.mcp.find("mcp__calc__add").read_only and not calc.mcp.find("mcp__calc__write_note").read_only


async def test_calls_give_text_a_note_for_images_and_errors(calc, workspace):
    assert await calc.prepare("mcp__calc__add", '{"a": 2, "b": 5}').execute() == "7"
    assert await calc.prepare("mcp__calc__picture", {}).execute() == (
        "a red dot\n[image content (image/png, 3 bytes): not shown to you]")
    with pytest.raises(ToolError, match="the disk is full"):
        await calc.prepare("mcp__calc__fail", {}).execute()
    assert await calc.prepare("mcp__calc__write_note", {"text": "hi"}).execute() == "noted: hi"
    assert await calc.prepare("mcp__calc__cwd", {}).execute() == str(workspace.root)  # stdio servers run there
    prepared = calc.prepare("mcp__calc__add", {"a": 1, "b": 2})
    assert prepared.kind == "mcp" and prepared.read_only and prepared.title == 'mcp calc: add {"a": 1, "b": 2}'
    assert '"a": 1' in prepared.preview
    with pytest.raises(ToolError, match="no MCP server offers it"):
        calc.prepare("mcp__calc__nope", {})


async def test_streamable_http_server_with_headers(workspace, tmp_path):
    with HttpMcpServer() as http_server:
        config = ServerConfig("web", "http", Path("t.json"), url=http_server.url, headers={"Authorization": "Bearer k"})
        servers = McpServers([config], workspace.root, tmp_path)
        await servers.start()
        try:
            assert servers.servers["web"].state == "ready", servers.summary()
            assert await servers.call(servers.find("mcp__web__add"), {"a": 20, "b": 22}) == "42"
        finally:
            await servers.aclose()
    assert servers.servers["web"].state == "stopped"
    assert http_server.headers and all(h.get("authorization") == "Bearer k" for h in http_server.headers)


def test_qualified_names_fit_openai_function_names():
    assert qualified_name("my.server", "get weather") == "mcp__my_server__get_weather"
    assert len(qualified_name("s", "x" * 100)) == 64


async def test_aclose_ends_a_stdio_server_process(calc):
    server_pid = int(await calc.prepare("mcp__calc__pid", {}).execute())
    await calc.mcp.aclose()
    assert calc.mcp.servers["calc"].state == "stopped" and calc.schemas()[-1]["function"]["name"] == "webfetch"
    await until_gone(server_pid)


async def until_gone(pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process {pid} still runs"
        await asyncio.sleep(0.05)


# --- failures ---


async def test_servers_that_fail_to_start_are_reported_and_the_others_work(workspace, tmp_path):
    changes = []
    exits = (sys.executable, "-c", "import sys; print('bad token', file=sys.stderr); sys.exit(2)")
    pid_file = tmp_path / "slow.pid"
    slow = (sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    configs = [stdio_config("missing", ("/nonexistent/mcp-server",)), stdio_config("exits", exits),
               stdio_config("slow", slow, start_timeout_s=0.5),
               ServerConfig("unreachable", "http", Path("t.json"), url="http://127.0.0.1:9/mcp"),
               stdio_config("off", enabled=False), stdio_config()]
    servers = McpServers(configs, workspace.root, tmp_path, on_change=lambda s: changes.append((s.name, s.state)))
    start = time.monotonic()
    await servers.start()
    try:
        assert time.monotonic() - start < 10  # concurrently, each within its limit
        states = {name: server.state for name, server in servers.servers.items()}
        assert states == {"missing": "failed", "exits": "failed", "slow": "failed", "unreachable": "failed",
                          "off": "disabled", "calc": "ready"}
        errors = {name: server.error for name, server in servers.servers.items()}
        assert "cannot start '/nonexistent/mcp-server'" in errors["missing"]
        assert "the server exited" in errors["exits"] and "bad token" in errors["exits"]
        assert "mcp-exits.log" in errors["exits"] and errors["slow"] == "did not start within 0.5 s"
        assert "ConnectError" in errors["unreachable"]
        assert sorted(changes) == sorted([(n, "failed") for n in ("missing", "exits", "slow", "unreachable")]
                                         + [("calc", "ready")])
        assert {tool.server for tool in servers.tools()} == {"calc"}
        assert any("calc (stdio" in line and "ready, 8 tools" in line for line in servers.summary())
    finally:
        await servers.aclose()
    await until_gone(int(pid_file.read_text()))  # the server past its time limit was ended


async def test_a_server_that_dies_mid_session_loses_its_tools_and_the_agent_goes_on(workspace, tmp_path, http_server):
    changes = []
    configs = [stdio_config(), ServerConfig("web", "http", Path("t.json"), url=http_server.url)]
    servers = McpServers(configs, workspace.root, tmp_path, on_change=lambda s: changes.append((s.name, s.state)))
    await servers.start()
    toolbox = ToolBox(workspace, tmp_path / "spill")
    toolbox.mcp = servers
    replies = [tool_reply(("mcp__calc__die", {})), tool_reply(("mcp__web__add", {"a": 1, "b": 1})),
               tool_reply(("mcp__calc__add", {"a": 1, "b": 1})), text_reply("Done.")]
    try:
        with ScriptedEndpoint(replies) as endpoint:
            agent = Agent(ChatClient(endpoint.url), toolbox, Approvals(Mode.FULL_AUTO, None))
            result = await agent.run_turn("add")
            await agent.client.aclose()
    finally:
        await servers.aclose()
    assert result.answer == "Done."
    died, web, gone = tool_outputs(endpoint.requests[3])
    assert died.startswith("Error: mcp__calc__die: no result, MCP server calc failed: the server exited")
    assert web == "2" and "no MCP server offers it now" in gone
    assert ("calc", "failed") in changes and servers.servers["calc"].state == "failed"
    names = [[t["function"]["name"] for t in request["tools"]] for request in endpoint.requests]
    assert "mcp__calc__add" in names[0] and "mcp__calc__add" not in names[1] and "mcp__web__add" in names[1]


# --- the agent loop and approvals ---


async def test_the_agent_calls_an_mcp_tool_and_reads_its_result(calc):
    with ScriptedEndpoint([tool_reply(("mcp__calc__add", {"a": 3, "b": 4})), text_reply("3 + 4 = 7")]) as endpoint:
        agent = Agent(ChatClient(endpoint.url), calc, Approvals(Mode.FULL_AUTO, None))
        result = await agent.run_turn("add 3 and 4")
        await agent.client.aclose()
    assert result.answer == "3 + 4 = 7" and tool_outputs(endpoint.requests[1]) == ["7"]
    tools = {t["function"]["name"]: t["function"] for t in endpoint.requests[0]["tools"]}
    assert tools["mcp__calc__add"]["parameters"]["required"] == ["a", "b"]


@pytest.mark.parametrize("mode, tool, num_asked, runs", [
    (Mode.PLAN, "write_note", 0, False),  # refused without a question
    (Mode.PLAN, "add", 1, True),  # readOnlyHint: plan mode asks
    (Mode.ASK, "add", 1, True), (Mode.AUTO_EDIT, "write_note", 1, True),
    (Mode.FULL_AUTO, "write_note", 0, True)])
async def test_approvals_per_mode(web, http_server, mode, tool, num_asked, runs):
    arguments = {"a": 1, "b": 2} if tool == "add" else {"text": "x"}
    calls = [tool_reply((f"mcp__calc__{tool}", arguments)), tool_reply((f"mcp__calc__{tool}", arguments)),
             text_reply("OK.")]
    asker = RecordingAsker(Decision.ALLOW_SESSION)
    with ScriptedEndpoint(calls) as endpoint:
        agent = Agent(ChatClient(endpoint.url), web, Approvals(mode, asker))
        await agent.run_turn("go")
        await agent.client.aclose()
    assert len(asker.asked) == num_asked  # the session approval covers that tool's second call
    if num_asked:
        assert asker.asked[0].kind == "mcp" and asker.asked[0].name == f"mcp__calc__{tool}"
    outputs = tool_outputs(endpoint.requests[2])
    if runs:
        assert outputs == (["3", "3"] if tool == "add" else ["noted: x", "noted: x"])
    else:
        assert "plan mode" in outputs[0] and "not marked read-only" in outputs[0]
    assert http_server.notes == (["x", "x"] if runs and tool == "write_note" else [])


async def test_a_denied_or_headless_mcp_call_does_not_run(web, http_server):
    for approvals, reason in [(Approvals(Mode.ASK, RecordingAsker(Decision.DENY)), "denied by the user"),
                              (Approvals(Mode.AUTO_EDIT, None), "no one can answer in a headless run")]:
        with ScriptedEndpoint([tool_reply(("mcp__calc__write_note", {"text": "x"})), text_reply("OK.")]) as endpoint:
            agent = Agent(ChatClient(endpoint.url), web, approvals)
            await agent.run_turn("note it")
            await agent.client.aclose()
        (output,) = tool_outputs(endpoint.requests[1])
        assert reason in output
    assert http_server.notes == []


async def test_an_http_server_that_goes_away_fails_at_the_next_call(workspace, tmp_path):
    changes = []
    with HttpMcpServer() as http_server:
        servers = McpServers([ServerConfig("web", "http", Path("t.json"), url=http_server.url)], workspace.root,
                             tmp_path, on_change=lambda s: changes.append((s.name, s.state)))
        await servers.start()
        assert await servers.call(servers.find("mcp__web__add"), {"a": 1, "b": 2}) == "3"
    try:
        with pytest.raises(McpCallError, match="no result, MCP server web failed: ConnectError"):
            await servers.call(servers.servers["web"].tools[0], {"a": 1, "b": 2})
        assert changes == [("web", "ready"), ("web", "failed")] and servers.tools() == []
    finally:
        await servers.aclose()


async def test_the_first_request_waits_for_the_servers_starting(workspace, tmp_path):
    servers = McpServers([stdio_config()], workspace.root, tmp_path)
    toolbox = ToolBox(workspace, tmp_path / "spill")
    toolbox.mcp = servers
    starting = asyncio.ensure_future(servers.start())  # as the app does, beside the model server's connection
    await asyncio.sleep(0)
    try:
        with ScriptedEndpoint([text_reply("Hi.")]) as endpoint:
            agent = Agent(ChatClient(endpoint.url), toolbox, Approvals(Mode.ASK, None))
            await agent.run_turn("hello")
            await agent.client.aclose()
        assert "mcp__calc__add" in [t["function"]["name"] for t in endpoint.requests[0]["tools"]]
    finally:
        await starting
        await servers.aclose()


async def test_starting_imports_the_sdk_off_the_event_loop(workspace, tmp_path, monkeypatch):
    """A cold import of the SDK takes seconds; on the loop it stalled the model server's 2 s health probe, which
    `northcode run` with a workspace's server then failed as "no server (ConnectTimeout)"."""
    import northcode.agent.mcp_servers as mcp_servers

    monkeypatch.setattr(mcp_servers, "_import_sdk", lambda: time.sleep(1.5))  # as slow as a cold import, or more
    servers = McpServers([stdio_config()], workspace.root, tmp_path)
    starting = asyncio.ensure_future(servers.start())
    gaps, last = [], time.monotonic()
    while not starting.done():
        await asyncio.sleep(0.01)
        gaps.append(time.monotonic() - last)
        last = time.monotonic()
    await servers.aclose()
    assert servers.servers["calc"].state == "stopped" and max(gaps) < 1.0  # the loop kept turning


@pytest.mark.parametrize("transport, mode", [("stdio", "auto"), ("http", "auto"), ("stdio", "legacy")])
async def test_tools_are_listed_again_when_the_server_says_they_changed(workspace, tmp_path, transport, mode,
                                                                         monkeypatch):
    import mcp

    monkeypatch.setattr(mcp, "Client", functools.partial(mcp.Client, mode=mode))  # legacy: a 2025-era handshake
    changes = []
    with HttpMcpServer() as http_server:
        config = stdio_config() if transport == "stdio" else ServerConfig("calc", "http", Path("t"), url=http_server.url)
        servers = McpServers([config], workspace.root, tmp_path, on_change=lambda s: changes.append(len(s.tools)))
        await servers.start()
        try:
            assert servers.find("mcp__calc__extra") is None
            assert (servers.servers["calc"].client.protocol_version in MODERN_PROTOCOL_VERSIONS) == (mode == "auto")
            assert await servers.call(servers.find("mcp__calc__grow"), {}) == "grown"
            deadline = time.monotonic() + 5
            while servers.find("mcp__calc__extra") is None:
                assert time.monotonic() < deadline, "the new tool was not listed"
                await asyncio.sleep(0.02)
            assert await servers.call(servers.find("mcp__calc__extra"), {}) == "extra!"
            assert changes == [8, 9]
        finally:
            await servers.aclose()
