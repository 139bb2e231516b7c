"""The app's rough edges, mended (issue 23, point 6): each test failed before its fix."""

from __future__ import annotations

from agent_scripted_endpoint import ScriptedEndpoint, text_reply
from test_tui import notices, send, until, workspace  # noqa: F401 (workspace: a fixture)
from textual.widgets import Markdown

from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import HelpScreen
from northcode.tui.widgets import AssistantMessage, PromptInput, StatusLine


def toasts(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def test_a_draft_survives_a_walk_through_the_history(workspace, store):
    with ScriptedEndpoint([text_reply("one")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "first prompt")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            prompt = app.query_one(PromptInput)
            await pilot.press(*"half typed")
            await pilot.press("up")
            assert prompt.text == "first prompt"
            await pilot.press("down")
            assert prompt.text == "half typed"


async def test_kv_and_cache_figures_follow_an_interrupted_request(workspace, store):
    with ScriptedEndpoint([text_reply("one", cached_tokens=40), text_reply("slow " * 500, delay_s=0.02)]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)

        async def no_polling() -> None:  # the once-a-second poll while answering would hide the bug
            pass

        app.poll_metrics_while_busy = no_polling
        async with app.run_test(size=(140, 30)) as pilot:
            status = app.query_one(StatusLine)
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "first")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            assert "cache 40%" in status.render_text() and "KV 25%" in status.render_text()
            await send(app, pilot, "talk a lot")
            await until(pilot, lambda: len(app.query(AssistantMessage)) == 2)
            endpoint.kv_pages_used = 36  # the server's pool as it is now
            await pilot.press("escape")
            await until(pilot, lambda: not app.is_busy and endpoint.disconnects == 1)
            await until(pilot, lambda: "KV 75%" in status.render_text(), timeout_s=3)
            assert "cache –" in status.render_text()  # the interrupted request's share is not known


async def test_the_help_page_lists_f1_and_the_command_palette(workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 44)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await pilot.press("f1")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            rows = app.screen.query_one(Markdown).source.splitlines()
            assert any(row.startswith("| F1 |") for row in rows) and any(row.startswith("| Ctrl+P |") for row in rows)


async def test_a_compacted_session_is_titled_by_its_first_request(workspace, store):
    replies = [text_reply("looked"), text_reply("Goal: tidy app.py."), text_reply("next")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "tidy app.py\nand keep it short")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            await send(app, pilot, "/compact")
            await until(pilot, lambda: endpoint.finished == 2 and not app.is_busy)
            await send(app, pilot, "go on")
            await until(pilot, lambda: endpoint.finished == 3 and not app.is_busy)
            assert store.info(app.session_id).title == "tidy app.py"


async def test_ctrl_c_at_an_idle_prompt_clears_it_then_says_how_to_quit_then_quits(workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            prompt = app.query_one(PromptInput)
            await pilot.press(*"a long prompt")
            await pilot.press("ctrl+c")
            assert prompt.text == "" and any("prompt cleared" in t for t in toasts(app))
            await pilot.press("up")
            assert prompt.text == "a long prompt"  # Up brings it back
            prompt.text = ""
            await pilot.press("ctrl+c")
            assert any("Ctrl+C again" in t and "Ctrl+Q" in t for t in toasts(app)) and app.is_running
            await pilot.press("ctrl+c")
            await pilot.pause(0.1)
            assert app.return_code == 0


async def test_a_reply_that_only_reasoned_says_so(workspace, store):
    with ScriptedEndpoint([text_reply("", reasoning="I think, therefore I think")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "hello")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            await pilot.pause(0.1)
            assert any("only reasoned" in n and "no answer" in n for n in notices(app))
            assert not app.query_one(AssistantMessage).fold.collapsed  # the reasoning is all there is: shown
