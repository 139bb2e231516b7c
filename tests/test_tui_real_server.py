"""The terminal app against a real `northcode serve` on the tiny checkpoint (random weights: noise)."""

from __future__ import annotations

import time

import pytest
from northcode_serve_process import metric, northcode_serve
from test_tui import notices, send, until

from northcode.agent.sessions import SessionStore
from northcode.tui.app import NorthcodeApp
from northcode.tui.widgets import AssistantMessage, StatusLine


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint):
    with northcode_serve(tiny_checkpoint) as url:
        yield url


@pytest.fixture
def app_factory(tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    workspace = tmp_path / "project"
    workspace.mkdir()

    def make(url: str, max_tokens: int) -> NorthcodeApp:
        return NorthcodeApp(workspace, endpoint=url + "/v1", store=store, request_params={"max_tokens": max_tokens})

    yield make
    store.close()


async def test_prompt_streams_and_the_status_line_fills_in(server_url, app_factory, tiny_checkpoint):
    app = app_factory(server_url, 40)
    async with app.run_test(size=(140, 40)) as pilot:
        await until(pilot, lambda: app.agent is not None, timeout_s=30)
        await send(app, pilot, "write a haiku")
        await until(pilot, lambda: app.query(AssistantMessage), timeout_s=30)
        await until(pilot, lambda: not app.is_busy, timeout_s=60)
        message = app.query_one(AssistantMessage)
        assert message.body.source or message.reasoning_view.source  # noise, but streamed noise
        stats = app.query_one(StatusLine).stats
        assert stats.model == f"{tiny_checkpoint.name} (RANDOM WEIGHTS)" and stats.context_window > 0
        assert stats.ttft_s > 0 and stats.tokens_per_s > 0 and 0 < stats.context_used <= stats.context_window
        assert stats.cache_share is not None and stats.kv_usage is not None
        text = app.query_one(StatusLine).render_text()
        assert "tok/s" in text and "TTFT" in text and f"/{stats.context_window} (" in text and "KV " in text
        first_prompt = stats.context_used
        await send(app, pilot, "again")  # the second turn repeats the first as a prefix: the cache serves it
        await until(pilot, lambda: not app.is_busy and len(app.query(AssistantMessage)) == 2, timeout_s=60)
        assert stats.context_used > first_prompt and stats.cache_share > 0


async def test_escape_stops_the_generation_on_the_server(server_url, app_factory):
    app = app_factory(server_url, 3000)  # about half a minute of noise on a CPU
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.agent is not None, timeout_s=30)
        for attempt in range(5):  # random weights sample the end-of-turn token early now and then: ask again
            await send(app, pilot, "write a long essay")
            await until(pilot, lambda: len(app.query(AssistantMessage)) > attempt, timeout_s=30)
            if metric(server_url, "northcode_requests_running") == 1:
                break
            await until(pilot, lambda: not app.is_busy, timeout_s=60)
        assert metric(server_url, "northcode_requests_running") == 1
        start = time.monotonic()
        await pilot.press("escape")
        await until(pilot, lambda: not app.is_busy and "interrupted" in notices(app))
        await until(pilot, lambda: metric(server_url, "northcode_requests_running") == 0, timeout_s=5)
        assert time.monotonic() - start < 5  # freed long before 3000 tokens could finish
        tokens_after_cancel = metric(server_url, "northcode_generation_tokens_total")
        await pilot.pause(1.0)
        assert metric(server_url, "northcode_generation_tokens_total") == tokens_after_cancel  # nothing more is generated


async def test_a_forced_call_cut_off_by_max_tokens_is_not_run_and_the_history_stays_valid(server_url, tmp_path):
    """The real server streams a named call's arguments in fragments and ends with finish_reason
    "length" inside them: nothing runs, and the next request (with that call in its history,
    which northcode serve checks) is accepted."""
    from northcode.agent.approvals import Mode

    store = SessionStore(tmp_path / "sessions.sqlite3")
    workspace = tmp_path / "project"
    workspace.mkdir()
    forced = {"max_tokens": 56, "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "write"}},
              "reasoning_effort": "none"}  # the call's head (about 35 tokens), then its arguments cut off
    app = NorthcodeApp(workspace, endpoint=server_url, store=store, mode=Mode.FULL_AUTO, request_params=forced)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.agent is not None, timeout_s=30)
        for attempt in (1, 2):
            before = len(notices(app))
            await send(app, pilot, "write notes.txt")
            await until(pilot, lambda: not app.is_busy and len(notices(app)) > before, timeout_s=60)
            assert sum("nothing was run" in n for n in notices(app)) == attempt, notices(app)[before:]
        assert not any("HTTP 400" in n for n in notices(app))
        roles = [m["role"] for m in app.agent.messages]
        assert roles == ["system", "user", "assistant", "tool", "user", "assistant", "tool"]
        assert app.agent.messages[2]["tool_calls"][0]["function"]["name"] == "write"
    assert list(workspace.iterdir()) == []
    store.close()
