"""MCP servers from the workspace's files in `northcode run` (stderr) and in the app (notices, approvals, /mcp),
with the stdio server of test_mcp_servers.py beside one that cannot start; the trust a workspace's servers need
first (the app's McpTrustScreen, `northcode run`'s refusal and --trust-mcp)."""

from __future__ import annotations

import json
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from test_mcp_servers import STDIO_COMMAND

from northcode import paths
from northcode.agent.approvals import Mode
from northcode.agent.mcp_config import load_servers
from northcode.agent.mcp_trust import TRUST_FILE, needing_approval, store_decision
from northcode.cli import main
from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen, McpTrustScreen
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


def test_run_reports_the_servers_on_stderr_and_calls_the_tool(workspace, capsys):
    replies = [tool_reply(("mcp__calc__add", {"a": 2, "b": 3})), text_reply("It is 5.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "add 2 and 3", "--mode", "full-auto", "--output-format", "stream-json",
                     "--trust-mcp", "--endpoint", endpoint.url, str(workspace)])
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
            await until(pilot, lambda: isinstance(app.screen, McpTrustScreen))
            await pilot.press("left", "enter")  # to "Start them"
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


# --- trust: a workspace's servers start once the user has approved them ---


def approve(workspace, allowed: bool = True) -> None:
    """What the app's McpTrustScreen keeps when the user answers."""
    configs, _ = load_servers(workspace, paths.data_dir())
    store_decision(workspace, needing_approval(configs, paths.data_dir()), paths.data_dir(), allowed)


def test_run_does_not_start_unapproved_workspace_servers_and_says_how(workspace, capsys):
    with ScriptedEndpoint([text_reply("No tools.")]) as endpoint:
        code = main(["run", "-p", "add 2 and 3", "--mode", "full-auto", "--output-format", "stream-json",
                     "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    init = json.loads(out.splitlines()[0])
    assert code == 0 and not any(name.startswith("mcp__") for name in init["tools"])
    assert init["mcp_servers"] == [{"name": "calc", "status": "untrusted"}, {"name": "broken", "status": "untrusted"}]
    assert ("northcode run: MCP servers calc (.mcp.json), broken (.mcp.json) not started: this workspace's MCP "
            "servers are not approved") in err and "--trust-mcp" in err
    assert "MCP server calc: ready" not in err
    assert not any(t["function"]["name"].startswith("mcp__") for t in endpoint.requests[0]["tools"])


def test_run_starts_servers_approved_in_the_app_but_not_declined_or_changed_ones(workspace, capsys):
    approve(workspace)
    with ScriptedEndpoint([text_reply("Ready."), text_reply("Declined."), text_reply("Changed.")]) as endpoint:
        assert main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)]) == 0
        assert "MCP server calc: ready, 8 tools" in capsys.readouterr().err
        approve(workspace, allowed=False)
        assert main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)]) == 0
        assert "not started: this workspace's MCP servers are not approved" in capsys.readouterr().err
        approve(workspace)
        (workspace / ".mcp.json").write_text((workspace / ".mcp.json").read_text().replace("/nonexistent/", "/other/"))
        assert main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)]) == 0
        assert "broken (.mcp.json) not started" in capsys.readouterr().err
    assert "mcp__calc__add" in [t["function"]["name"] for t in endpoint.requests[0]["tools"]]
    assert not any(t["function"]["name"].startswith("mcp__") for t in endpoint.requests[2]["tools"])


async def test_the_app_asks_once_keeps_a_no_and_asks_again_when_the_file_changes(workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, McpTrustScreen))
            shown = "\n".join(str(widget.render()) for widget in app.screen.query("Static"))
            assert f"MCP servers of workspace {workspace.name}?" in shown
            assert "calc  [.mcp.json]" in shown and "broken  [.mcp.json]" in shown
            assert f"stdio: {' '.join(STDIO_COMMAND)}" in shown and "stdio: /nonexistent/mcp-server" in shown
            await pilot.press(*"yes", "enter")  # letters answer nothing; Enter: "Don't"
            await until(pilot, lambda: any("not started (/mcp trust asks again)" in n for n in notices(app)))
            app.query_one(PromptInput).text = "/mcp"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.startswith("MCP servers:") for n in notices(app)))
            listing = next(n for n in notices(app) if n.startswith("MCP servers:"))
            assert "calc (stdio: " in listing and "): untrusted  [.mcp.json]" in listing
            assert "you have not approved them, so they were not started; /mcp trust asks" in listing
            assert all(server.task is None for server in app.mcp.servers.servers.values())
        assert json.loads((paths.data_dir() / TRUST_FILE).read_text())[str(workspace)]["allowed"] is False

        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)  # the no is kept: a notice, no question
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: any("you declined this workspace's MCP servers" in n for n in notices(app)))
            assert not isinstance(app.screen, McpTrustScreen)
            app.query_one(PromptInput).text = "/mcp trust"  # asks again, and a yes starts them now
            await pilot.press("enter")
            await until(pilot, lambda: isinstance(app.screen, McpTrustScreen))
            await pilot.press("left", "enter")  # to "Start them"
            await until(pilot, lambda: any("calc: ready, 8 tools" in n for n in notices(app)))

        (workspace / ".mcp.json").write_text((workspace / ".mcp.json").read_text().replace("/nonexistent/", "/other/"))
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)  # a changed definition asks again
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, McpTrustScreen))
            assert "stdio: /other/mcp-server" in "\n".join(str(w.render()) for w in app.screen.query("Static"))
            await pilot.press("escape")
            await until(pilot, lambda: any("not started (/mcp trust asks again)" in n for n in notices(app)))


async def test_the_users_own_servers_start_without_asking(tmp_path, store, monkeypatch):
    monkeypatch.setenv("NORTHCODE_HOME", str(tmp_path / "home"))  # its own data folder: other tests run beside it
    root = tmp_path / "plain"
    root.mkdir()
    command, script = STDIO_COMMAND
    (paths.data_dir() / "mcp.json").write_text(json.dumps({"mcpServers": {"mine": {"command": command,
                                                                                    "args": [script]}}}))
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(root, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: any("MCP server mine: ready" in n for n in notices(app)))
            assert not isinstance(app.screen, McpTrustScreen) and not app.mcp.servers.untrusted()
