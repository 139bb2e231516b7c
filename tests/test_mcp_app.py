"""MCP servers from the workspace's files in `northcode run` (stderr) and in the app (notices, approvals, /mcp),
with the stdio server of test_mcp_servers.py beside one that cannot start."""

from __future__ import annotations

import json
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from test_mcp_servers import STDIO_COMMAND

from northcode.agent.approvals import Mode
from northcode.agent.sessions import SessionStore
from northcode.cli import main
from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen
from northcode.tui.widgets import Notice, PromptInput, ToolCallView


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    command, script = STDIO_COMMAND
    (root / ".mcp.json").write_text(json.dumps({"mcpServers": {
        "calc": {"command": command, "args": [script]}, "broken": {"command": "/nonexistent/mcp-server"}}}))
    (root / "opencode.json").write_text('{"mcp": {"odd": {"type": "sse"}}}')
    return root


@pytest.fixture
def store(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    yield store
    store.close()


def test_run_reports_the_servers_on_stderr_and_calls_the_tool(workspace, capsys):
    replies = [tool_reply(("mcp__calc__add", {"a": 2, "b": 3})), text_reply("It is 5.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "add 2 and 3", "--mode", "full-auto", "--output-format", "stream-json",
                     "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and events[-1]["result"] == "It is 5."
    assert "mcp__calc__add" in events[0]["tools"] and "mcp__broken__add" not in json.dumps(events[0])
    assert events[0]["mcp_servers"] == [{"name": "calc", "status": "ready"}, {"name": "broken", "status": "failed"}]
    assert "northcode run: MCP server calc: ready, 8 tools" in err
    assert "northcode run: MCP server broken: failed: cannot start '/nonexistent/mcp-server'" in err
    assert f"northcode run: MCP configuration: {workspace / 'opencode.json'}: mcp.odd: type 'sse'" in err
    assert '→ mcp calc: add {"a": 2, "b": 3}' in err
    assert [m["content"] for m in endpoint.requests[1]["messages"] if m["role"] == "tool"] == ["5"]


async def until(pilot, condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)


def notices(app) -> list[str]:
    return [str(n.render()) for n in app.query(Notice)]


async def test_the_app_reports_the_servers_asks_before_a_call_and_lists_them(workspace, store):
    replies = [tool_reply(("mcp__calc__write_note", {"text": "from the app"})), text_reply("Noted."),
               tool_reply(("mcp__calc__die", {})), text_reply("It is gone.")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.AUTO_EDIT)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None and any("calc: ready" in n for n in notices(app)))
            shown = "\n".join(notices(app))
            assert "MCP server calc: ready, 8 tools (/mcp lists them)" in shown
            assert "MCP server broken failed to start: cannot start '/nonexistent/mcp-server'" in shown
            assert "MCP configuration: " in shown and "mcp.odd: type 'sse'" in shown
            app.query_one(PromptInput).text = "note it"
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            assert app.screen.call.kind == "mcp" and '"text": "from the app"' in app.screen.call.preview
            await pilot.press("y")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 2)
            assert [view.kind for view in app.query(ToolCallView)] == ["mcp"]
            app.query_one(PromptInput).text = "/mcp"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.startswith("MCP servers:") for n in notices(app)))
            listing = next(n for n in notices(app) if n.startswith("MCP servers:"))
            assert "calc (stdio: " in listing and "ready, 8 tools" in listing and "[.mcp.json]" in listing
            assert "mcp__calc__add (read-only)" in listing and "broken (stdio: /nonexistent/mcp-server): failed" in listing
            assert "Configuration errors:\n  " in listing and "mcp.odd: type 'sse'" in listing
            app.query_one(PromptInput).text = "stop the server"
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            await pilot.press("y")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 4)
            await until(pilot, lambda: any("calc failed: the server exited; its tools are gone" in n
                                           for n in notices(app)))
            servers = app.mcp.servers
    assert [m["content"] for m in endpoint.requests[1]["messages"] if m["role"] == "tool"] == ["noted: from the app"]
    assert all(server.state in ("stopped", "failed") for server in servers.servers.values())  # shut down on exit
    assert "mcp__calc__write_note" in [t["function"]["name"] for t in endpoint.requests[0]["tools"]]
    assert not any(t["function"]["name"].startswith("mcp__") for t in endpoint.requests[3]["tools"])


async def test_mcp_without_servers_says_where_they_go(tmp_path, store):
    (tmp_path / "empty").mkdir()
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(tmp_path / "empty", endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            app.query_one(PromptInput).text = "/mcp"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.startswith("No MCP servers configured") for n in notices(app)))
