"""Snapshot tests (pytest-textual-snapshot) of the main screens, against the scripted endpoint.

Timings (TTFT, tokens/s) vary from run to run, so they are cleared before each screenshot;
the snapshots pin the layout and the text. Update them with `pytest --snapshot-update`.
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply

from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen, McpTrustScreen, SessionsScreen
from northcode.tui.widgets import PromptInput, StatusLine

SIZE = (100, 30)
ANSWER = """Here is the fix:

```python
def greet(name: str) -> str:
    return f"hello {name}"
```

It uses an **f-string**."""


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "demo-project"
    root.mkdir()
    (root / "app.py").write_text("def greet(name):\n    return 'hello ' + name\n")
    return root


async def settle(pilot, condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)
    pilot.app.query_one(PromptInput).cursor_blink = False
    pilot.app.query_one(StatusLine).show(ttft_s=None, tokens_per_s=None)
    await pilot.pause(0.2)


async def type_and_send(pilot, text: str) -> None:
    pilot.app.query_one(PromptInput).text = text
    await pilot.press("enter")


def test_start_screen(snap_compare, workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_start_screen_on_random_weights(snap_compare, workspace, store):
    """What a new user sees first: the demo checkpoint, which the server says is random."""
    card = {"root": "/data/northcode/models/demo-tiny-seed0", "random_weights": True,
            "display_name": "demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise)"}
    with ScriptedEndpoint([], model_card=card) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None and len(app.query("Notice")) == 2)

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_chat_with_reasoning_and_code(snap_compare, workspace, store):
    with ScriptedEndpoint([text_reply(ANSWER, reasoning="The user wants an f-string.", cached_tokens=60)]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "make greet use an f-string")
            await settle(pilot, lambda: endpoint.finished == 1 and not app.is_busy)

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_approval_with_diff(snap_compare, workspace, store):
    edit = ("edit", {"filePath": "app.py", "oldString": "'hello ' + name", "newString": "f'hello {name}'"})
    with ScriptedEndpoint([tool_reply(edit)]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "make greet use an f-string")
            await settle(pilot, lambda: isinstance(app.screen, ApprovalScreen))

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare, workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await pilot.press("f1")
            await pilot.pause(0.3)

        assert snap_compare(app, terminal_size=(100, 44), run_before=run_before)


def test_sessions_screen(snap_compare, workspace, store):
    for title in ("fix the failing test", "add a --json flag"):
        session_id = store.create(workspace, "scripted-model")
        store.append(session_id, {"role": "system", "content": "s"})
        store.append(session_id, {"role": "user", "content": title})
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "/sessions")
            await settle(pilot, lambda: isinstance(app.screen, SessionsScreen))

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_agent_turn_with_tools(snap_compare, workspace, store):
    from northcode.agent.approvals import Mode

    replies = [tool_reply(("grep", {"pattern": "hello"}), ("read", {"filePath": "app.py", "limit": 1})),
               tool_reply(("edit", {"filePath": "app.py", "oldString": "'hello ' + name", "newString": "f'hello {name}'"}),
                          ("read", {"filePath": "missing.py"})),
               text_reply("Done: `greet` now uses an f-string.")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.AUTO_EDIT)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "make greet use an f-string")
            await settle(pilot, lambda: endpoint.finished == 3 and not app.is_busy)

        assert snap_compare(app, terminal_size=(100, 40), run_before=run_before)


@contextlib.contextmanager
def two_hunk_write(workspace, store):
    """An app whose model writes app.py with two hunks, and the pilot's steps to that write's approval."""
    before = "def greet(name):\n    return 'hello ' + name\n" + "".join(f"# {n}\n" for n in range(10))
    (workspace / "app.py").write_text(before)
    after = before.replace("'hello ' + name", "f'hello {name}'").replace("# 9\n", "# nine\n")
    with ScriptedEndpoint([tool_reply(("write", {"filePath": "app.py", "content": after}))]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def to_approval(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "use an f-string")
            await settle(pilot, lambda: isinstance(app.screen, ApprovalScreen))

        yield app, to_approval


def test_hunk_review_screen(snap_compare, workspace, store):
    from northcode.tui.screens import HunkReviewScreen

    with two_hunk_write(workspace, store) as (app, to_approval):
        async def run_before(pilot):
            await to_approval(pilot)
            await pilot.press("h", "n")
            await settle(pilot, lambda: isinstance(app.screen, HunkReviewScreen))

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_file_picker(snap_compare, workspace, store):
    for rel in ("src/northcode/app.py", "src/northcode/server.py", "docs/app.md", "tests/test_app.py"):
        (workspace / rel).parent.mkdir(parents=True, exist_ok=True)
        (workspace / rel).write_text("x\n")
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await pilot.press(*"explain @app")
            await settle(pilot, lambda: app.query_one("#picker").display and app.query_one("#picker").option_count == 4)

        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_todo_panel(snap_compare, workspace, store):
    """The todo list above the prompt, an item in each state, at 80x24."""
    todos = [{"content": "read app.py", "status": "completed", "priority": "high", "id": "1"},
             {"content": "make greet use an f-string", "status": "in_progress", "priority": "high", "id": "2"},
             {"content": "add a test for greet", "status": "pending", "priority": "medium", "id": "3"},
             {"content": "rename greet to hello", "status": "cancelled", "priority": "low", "id": "4"}]
    replies = [tool_reply(("todowrite", {"todos": todos})), text_reply("The plan is in the list.")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "plan the change")
            await settle(pilot, lambda: endpoint.finished == 2 and not app.is_busy)

        assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_hunk_review_with_a_hunk_left_out(snap_compare, workspace, store):
    """The hunk review at 80x24 after `n` left the first hunk out (struck through) and moved to the second."""
    from northcode.tui.screens import HunkReviewScreen

    with two_hunk_write(workspace, store) as (app, to_approval):
        async def run_before(pilot):
            await to_approval(pilot)
            await pilot.press("h")
            await settle(pilot, lambda: isinstance(app.screen, HunkReviewScreen))
            await pilot.press("n")
            await settle(pilot, lambda: app.screen.current == 1)

        assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_mcp_trust_screen(snap_compare, workspace, store):
    """The question before a workspace's MCP servers start (nothing is started while it is open), at 80x24."""
    (workspace / ".mcp.json").write_text(json.dumps({"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "."],
                  "env": {"LOG_LEVEL": "debug"}},
        "docs": {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "Bearer x"}}}}))
    (workspace / "opencode.json").write_text(json.dumps({"mcp": {"git": {"type": "local",
                                                                     "command": ["uvx", "mcp-server-git"]}}}))
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None and isinstance(app.screen, McpTrustScreen))

        assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
