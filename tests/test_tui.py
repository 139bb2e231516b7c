"""The terminal app driven by Textual's Pilot against the scripted OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, error_reply, prompt_tokens, text_reply, tool_reply

from northcode.agent.approvals import Mode
from northcode.tui.app import NorthcodeApp
from northcode.tui.screens import ApprovalScreen, HelpScreen, SessionsScreen
from northcode.tui.widgets import AssistantMessage, Notice, PromptInput, StatusLine, ToolCallView, UserMessage


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    (root / "app.py").write_text("x = 1\n")
    return root


async def until(pilot, condition, timeout_s: float = 30.0) -> None:  # a loaded 2-core CI machine is slow
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.02)


async def send(app, pilot, text: str) -> None:
    app.query_one(PromptInput).text = text
    await pilot.press("enter")


def notices(app) -> list[str]:
    return [str(n.render()) for n in app.query(Notice)]


async def test_prompt_streams_text_and_updates_the_status_line(workspace, store):
    reply = text_reply("Here is **bold** and code:\n\n```python\nprint(1)\n```", reasoning="thinking hard",
                       cached_tokens=40)
    with ScriptedEndpoint([reply]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            status = app.query_one(StatusLine)
            assert "scripted-model" in status.render_text() and "KV 25%" in status.render_text()
            await send(app, pilot, "hello there")
            await until(pilot, lambda: not app.is_busy and app.query(AssistantMessage))
            await pilot.pause(0.1)
            message = app.query_one(AssistantMessage)
            assert "print(1)" in message.body.source and message.fold.collapsed
            assert message.reasoning_view.source == "thinking hard"
            assert [str(u.render()) for u in app.query(UserMessage)] == ["hello there"]
            stats = status.stats
            assert stats.ttft_s is not None and stats.tokens_per_s is not None and stats.context_used > 0
            assert stats.cache_share == pytest.approx(40 / prompt_tokens(endpoint.requests[0]["messages"]))
            assert "cache 40%" in status.render_text()
            assert stats.context_window == 4096 and "ctx " in status.render_text() and "tok/s" in status.render_text()
            assert app.query_one(PromptInput).prompt_history == ["hello there"]
    body = endpoint.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in body["messages"]] == ["system", "user"]


@pytest.mark.parametrize("key", ["escape", "ctrl+c"])
async def test_escape_cancels_the_request_on_the_server(workspace, store, key):
    with ScriptedEndpoint([text_reply("slow " * 500, delay_s=0.02), text_reply("after")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "talk a lot")
            await until(pilot, lambda: app.query(AssistantMessage) and "slow slow" in app.query_one(AssistantMessage).body.source)
            await send(app, pilot, "typed while busy")
            assert app.query_one(PromptInput).text == "typed while busy"  # not lost: sent once the answer ends
            await pilot.press(key)
            await until(pilot, lambda: not app.is_busy and endpoint.disconnects == 1)
            assert "interrupted" in notices(app) and endpoint.finished == 0
            await pilot.press("ctrl+c")  # idle: not a stop, and the app stays open
            await pilot.pause(0.1)
            assert app.is_running and notices(app).count("interrupted") == 1
            await send(app, pilot, "again")  # the next turn works and continues the same conversation
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
    messages = endpoint.requests[1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"].startswith("slow slow")


@pytest.mark.parametrize("keys, changed, told", [
    (("y",), True, "updated app.py"), (("n",), False, "denied by the user"), (("escape",), False, "denied by the user"),
    # t: deny and say why; y, a, n and t are typed into the note, not taken as answers
    (("t", *"use y not an n", "enter"), False, "denied by the user, who says: use y not an n")])
async def test_edit_asks_with_a_diff_and_obeys_the_answer(workspace, store, keys, changed, told):
    edit = ("edit", {"filePath": "app.py", "oldString": "x = 1", "newString": "x = 2"})
    with ScriptedEndpoint([tool_reply(edit), text_reply("ok")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "bump x")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            assert "+x = 2" in app.screen.call.preview
            await pilot.press(*keys)
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 2)
            assert app.query(ToolCallView)
    assert (workspace / "app.py").read_text() == ("x = 2\n" if changed else "x = 1\n")
    tool_message = endpoint.requests[1]["messages"][-1]
    assert tool_message["role"] == "tool" and told in tool_message["content"]


async def test_compact_goes_on_from_the_first_request_and_a_summary_in_a_new_session(workspace, store):
    replies = [text_reply("looked"), text_reply("changed"), text_reply("Goal: tidy app.py. Done: read it."),
               text_reply("next")]
    with ScriptedEndpoint(replies) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "/compact")
            await pilot.pause(0.1)
            assert any("nothing to compact" in n for n in notices(app)) and endpoint.finished == 0
            for number, text in enumerate(["tidy app.py", "go on"], start=1):
                await send(app, pilot, text)
                await until(pilot, lambda: not app.is_busy and endpoint.finished == number)
            long_session = app.session_id
            await send(app, pilot, "/compact")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 3)
            assert any(n.startswith("compacted 5 messages") and long_session in n for n in notices(app))
            await send(app, pilot, "and now?")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 4)
            assert app.session_id != long_session and len(store.messages(long_session)) == 5
    summary_request = endpoint.requests[2]
    assert summary_request["tools"] == endpoint.requests[1]["tools"]  # the agent's own: a prefix-cache hit
    assert summary_request["messages"][-1]["content"].startswith("[northcode: the conversation is being compacted")
    after = endpoint.requests[3]["messages"]
    assert [m["role"] for m in after] == ["system", "user", "assistant", "user"]
    assert after[1]["content"].endswith("My first request was:\n\ntidy app.py")
    assert after[2]["content"] == "Summary of the work so far:\n\nGoal: tidy app.py. Done: read it."
    assert store.messages(app.session_id)[:3] == after[:3]


async def test_undo_takes_back_the_last_turns_edit_and_tells_the_model(workspace, store):
    edit = ("edit", {"filePath": "app.py", "oldString": "x = 1", "newString": "x = 2"})
    with ScriptedEndpoint([tool_reply(edit), text_reply("done"), text_reply("ok")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.FULL_AUTO)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "/undo")
            await pilot.pause(0.1)
            assert any("nothing to undo" in n for n in notices(app))
            await send(app, pilot, "bump x")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 2)
            assert (workspace / "app.py").read_text() == "x = 2\n"
            await send(app, pilot, "/undo")
            await pilot.pause(0.1)
            assert (workspace / "app.py").read_text() == "x = 1\n" and "undone: restored app.py" in notices(app)
            await send(app, pilot, "and now?")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 3)
    told = endpoint.requests[2]["messages"][-1]["content"]
    assert told.startswith("[northcode: the user undid the file changes of one of your turns (restored app.py)")
    assert told.endswith("\n\nand now?")


async def test_slash_commands_and_mentions(workspace, store):
    with ScriptedEndpoint([text_reply("hello"), text_reply("seen it")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await pilot.press("h", "i", "ctrl+j", "y", "o")
            assert app.query_one(PromptInput).text == "hi\nyo"
            await pilot.press("enter")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            assert app.query_one(PromptInput).text == ""
            await pilot.press("up")
            assert app.query_one(PromptInput).text == "hi\nyo"
            await send(app, pilot, "/mode full-auto")
            assert app.approvals.mode is Mode.FULL_AUTO and "mode full-auto" in app.query_one(StatusLine).render_text()
            await pilot.press("shift+tab")
            assert app.approvals.mode is Mode.PLAN
            await pilot.press("shift+tab")
            assert app.approvals.mode is Mode.ASK
            await send(app, pilot, "/mode bogus")
            await send(app, pilot, "/frob")
            await pilot.pause(0.1)
            assert any("mode 'bogus'" in n for n in notices(app)) and any("unknown command /frob" in n for n in notices(app))
            await send(app, pilot, "/help")
            await until(pilot, lambda: isinstance(app.screen, HelpScreen))
            await pilot.press("escape")
            await send(app, pilot, "/model")
            await pilot.pause(0.1)
            assert any("scripted-model" in n and app.client.base_url in n for n in notices(app))
            await send(app, pilot, "look at @app.py please")
            await until(pilot, lambda: endpoint.finished == 2 and not app.is_busy)
            await send(app, pilot, "/clear")
            await pilot.pause(0.1)
            assert not app.query(UserMessage)
    assert endpoint.requests[0]["messages"][-1]["content"] == "hi\nyo"
    user_text = endpoint.requests[1]["messages"][-1]["content"]
    assert user_text.startswith("look at @app.py please") and "Contents of app.py:\n```\nx = 1\n```" in user_text


async def test_sessions_are_saved_listed_resumed_and_deleted(workspace, store):
    with ScriptedEndpoint([text_reply("first answer"), text_reply("second answer")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            assert store.list() == []  # nothing saved before the first prompt
            await send(app, pilot, "remember this")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            first_id = app.session_id
            assert [m["role"] for m in store.messages(first_id)] == ["system", "user", "assistant"]
            await send(app, pilot, "/new")
            await pilot.pause(0.1)
            assert app.session_id is None and not app.query(UserMessage)
            await send(app, pilot, "/sessions")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen))
            await pilot.press("enter")
            await until(pilot, lambda: app.session_id == first_id and app.query(UserMessage))
            assert "first answer" in app.query_one(AssistantMessage).body.source
            await send(app, pilot, "and more")
            await until(pilot, lambda: endpoint.finished == 2 and not app.is_busy)
            await send(app, pilot, "/sessions")
            await until(pilot, lambda: isinstance(app.screen, SessionsScreen))
            await pilot.press("d")
            await pilot.pause(0.1)
            assert store.list() == []
    resumed = endpoint.requests[1]["messages"]
    assert [m["role"] for m in resumed] == ["system", "user", "assistant", "user"]
    assert resumed[:3] == endpoint.requests[0]["messages"] + [{"role": "assistant", "content": "first answer"}]


async def test_unreachable_endpoint_is_a_notice_not_a_crash(workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        url = endpoint.url
    app = NorthcodeApp(workspace, endpoint=url, store=store)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.query(Notice) and "Cannot connect" in notices(app)[0])
        assert app.query_one(Notice).has_class("error") and "offline" in app.query_one(StatusLine).render_text()
        await send(app, pilot, "hello")
        await pilot.pause(0.1)
        assert app.is_running


async def test_endpoint_error_mid_session_restores_the_prompt(workspace, store):
    with ScriptedEndpoint([]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "will fail")
            await until(pilot, lambda: any("no more replies" in n for n in notices(app)))
            await until(pilot, lambda: not app.is_busy)
            assert app.query_one(PromptInput).text == "will fail"
    await asyncio.sleep(0)


async def test_loading_progress_is_shown_until_the_server_is_ready(workspace, store):
    with ScriptedEndpoint([], loading_polls=6) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.query(Notice) and notices(app)[0] == "model server: loading weights")
            assert app.agent is None and "loading…" in app.query_one(StatusLine).render_text()
            await until(pilot, lambda: app.agent is not None)
            assert notices(app)[0].startswith("scripted-model · workspace project")
            assert "loading" not in app.query_one(StatusLine).render_text()


async def test_escape_kills_a_running_shell_command_with_its_children(workspace, store):
    from test_sandbox import _alive

    command = ("bash", {"command": "sleep 60 & echo $! > child.pid; wait"})
    with ScriptedEndpoint([tool_reply(command)]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.FULL_AUTO)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "sleep")
            pid_file = workspace / "child.pid"
            await until(pilot, lambda: pid_file.exists() and pid_file.read_text().strip())
            child_pid = int(pid_file.read_text())
            assert _alive(child_pid)
            await pilot.press("escape")
            await until(pilot, lambda: not app.is_busy and "interrupted" in notices(app))
            await until(pilot, lambda: not _alive(child_pid), timeout_s=3)
    assert app.agent.messages[-1] == {"role": "tool", "tool_call_id": app.agent.messages[-2]["tool_calls"][0]["id"],
                                      "content": "cancelled by the user"}


def test_tui_command_rejects_bad_input_before_opening(tmp_path, capsys):
    from northcode.cli import main

    assert main(["--resume", "no-such-id", str(tmp_path)]) == 2
    assert "session 'no-such-id': no such session" in capsys.readouterr().err
    assert main(["-c", str(tmp_path)]) == 2
    assert "--continue: no saved session" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["--endpoint", "ftp://x", str(tmp_path)]) == 2


async def test_random_weights_are_said_plainly(workspace, store):
    """The server's /v1/models says so (a server northcode did not start, on another machine)."""
    card = {"root": "/models/far-away/demo-tiny-seed0", "random_weights": True,
            "display_name": "demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise)"}
    with ScriptedEndpoint([], model_card=card) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(140, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            assert notices(app)[0].startswith("demo-tiny-seed0 (tiny preset, RANDOM WEIGHTS: output is noise) · ")
            warning = app.query(Notice)[1]
            assert warning.has_class("warning") and "weights are random" in str(warning.render())
            assert app.query_one(StatusLine).render_text().startswith("demo-tiny-seed0 (RANDOM WEIGHTS) │")


async def test_real_weights_get_no_warning(workspace, store):
    with ScriptedEndpoint([], model_card={"random_weights": False, "display_name": "North-Mini-Code-1.0"}) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(140, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            assert not any("random" in n for n in notices(app))
            assert app.query_one(StatusLine).render_text().startswith("North-Mini-Code-1.0 │")


async def test_a_failed_prompt_sent_again_is_not_doubled(workspace, store):
    with ScriptedEndpoint([error_reply("the server is busy"), text_reply("hello")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "hi there")
            await until(pilot, lambda: not app.is_busy and any("the server is busy" in n for n in notices(app)))
            assert app.query_one(PromptInput).text == "hi there"
            await pilot.press("enter")  # send it again as it came back
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            session_id = app.session_id
    assert [m["role"] for m in endpoint.requests[1]["messages"]] == ["system", "user"]
    assert [m["role"] for m in store.messages(session_id)] == ["system", "user", "assistant"]


async def test_escape_before_any_reply_gives_the_prompt_back(workspace, store):
    with ScriptedEndpoint([text_reply("late " * 20, delay_s=1.0), text_reply("ok")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test() as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "hello")
            await until(pilot, lambda: endpoint.requests)
            await pilot.press("escape")
            await until(pilot, lambda: not app.is_busy and any("back in the prompt" in n for n in notices(app)))
            assert app.query_one(PromptInput).text == "hello" and [m["role"] for m in app.agent.messages] == ["system"]


async def test_a_tool_call_cut_off_by_the_token_limit_is_shown_and_not_run(workspace, store):
    cut = tool_reply(("write", '{"filePath": "new.py", "content": "import o'), finish_reason="length")
    with ScriptedEndpoint([cut]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.FULL_AUTO)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "write new.py")
            await until(pilot, lambda: not app.is_busy and endpoint.finished == 1)
            await pilot.pause(0.1)
            assert any("cut off at the token limit while the model was writing a call (write): nothing was run" in n
                       for n in notices(app))
            view = app.query_one(ToolCallView)
            assert view.has_class("failed") and "Not run" in str(view.result.render())
    assert not (workspace / "new.py").exists()


async def test_a_call_is_shown_while_its_arguments_stream(workspace, store):
    write = ("write", {"filePath": "notes.txt", "content": "x" * 300})
    with ScriptedEndpoint([tool_reply(write, fragment_chars=10, delay_s=0.02), text_reply("Wrote it.")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store, mode=Mode.FULL_AUTO)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)

            def titles() -> list[str]:
                return [str(view.title_line.render()) for view in app.query(ToolCallView)]

            seen: list[list[str]] = []
            # Pilot's press and pause wait for a quiet screen, that is for the stream's end: poll with asyncio
            app.query_one(PromptInput).post_message(PromptInput.Submitted("write notes"))
            deadline = time.monotonic() + 10
            while endpoint.finished < 2 or app.is_busy:
                assert time.monotonic() < deadline, "timed out waiting for the app"
                seen.append(titles())
                await asyncio.sleep(0.01)
            progress = [t[0] for t in seen if t and "characters of arguments so far" in t[0]]
            assert progress and progress[0].startswith("→ write … (") and len(set(progress)) > 2  # it counts up
            await pilot.pause(0.1)
            assert titles() == ["→ write notes.txt"]  # the progress line gave way to the whole call
    assert (workspace / "notes.txt").read_text() == "x" * 300


async def test_quitting_while_an_approval_is_open_ends_cleanly(workspace, store):
    edit = ("edit", {"filePath": "app.py", "oldString": "x = 1", "newString": "x = 2"})
    with ScriptedEndpoint([tool_reply(edit), text_reply("ok")]) as endpoint:
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "bump x")
            await until(pilot, lambda: isinstance(app.screen, ApprovalScreen))
            app.exit()
            await pilot.pause(0.2)
    assert app.return_code in (0, None) and app._exception is None  # the cancelled turn raised nothing
    assert (workspace / "app.py").read_text() == "x = 1\n"
