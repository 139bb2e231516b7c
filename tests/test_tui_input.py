"""Input and review in the app (issue 23, point 4): the prompt history across runs, the command palette, custom
slash commands, the @ file picker, per-hunk review; Pilot against the scripted endpoint."""

from __future__ import annotations

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply
from test_tui import notices, send, until

from northcode.agent.sessions import SessionStore
from northcode.tui.app import NorthcodeApp
from northcode.tui.widgets import PromptInput


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    return root


@pytest.fixture
def store(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    yield store
    store.close()


async def test_the_prompt_history_is_kept_across_runs(workspace, store):
    with ScriptedEndpoint([text_reply("one")]) as endpoint:
        first = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with first.run_test() as pilot:
            await until(pilot, lambda: first.agent is not None)
            await send(first, pilot, "from the first run")
            await until(pilot, lambda: endpoint.finished == 1 and not first.is_busy)
        second = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with second.run_test() as pilot:
            await until(pilot, lambda: second.agent is not None)
            await pilot.press("up")
            assert second.query_one(PromptInput).text == "from the first run"
