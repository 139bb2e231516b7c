"""Snapshot tests (pytest-textual-snapshot) of the main screens, against the scripted endpoint.

Timings (TTFT, tokens/s) vary from run to run, so they are cleared before each screenshot;
the snapshots pin the layout and the text. Update them with `pytest --snapshot-update`.
"""

from __future__ import annotations

import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply

from northcode.agent.sessions import SessionStore
from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen, SessionsScreen
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


@pytest.fixture
def store(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    yield store
    store.close()


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


def test_hunk_review_screen(snap_compare, workspace, store):
    from northcode.tui.screens import HunkReviewScreen

    before = "def greet(name):\n    return 'hello ' + name\n" + "".join(f"# {n}\n" for n in range(10))
    (workspace / "app.py").write_text(before)
    after = before.replace("'hello ' + name", "f'hello {name}'").replace("# 9\n", "# nine\n")
    with ScriptedEndpoint([tool_reply(("write", {"filePath": "app.py", "content": after}))]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def run_before(pilot):
            await settle(pilot, lambda: app.agent is not None)
            await type_and_send(pilot, "use an f-string")
            await settle(pilot, lambda: isinstance(app.screen, ApprovalScreen))
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
