"""Automatic compaction before the context fills: between turns and mid-turn, told to the user, the same as
/compact, and a compaction request whose prompt extends the last one (checked with the server's /tokenize)."""

from __future__ import annotations

import json

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from test_tui import notices, send, until

from northcode.agent.approvals import Approvals, Mode
from northcode.agent.client import ChatClient
from northcode.agent.compaction import COMPACT_REQUEST
from northcode.agent.loop import CONTINUE_AFTER_COMPACTION, Agent, CompactEvent
from northcode.agent.sandbox import Workspace
from northcode.agent.sessions import SessionRecorder
from northcode.agent.tools import ToolBox
from northcode.cli import main
from northcode.tui.app import NorthcodeApp
from northcode.tui.widgets import AssistantMessage

READ = ("read", {"filePath": "hello.txt"})


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "project"
    root.mkdir()
    (root / "hello.txt").write_text("hello world\n")
    return root


def make_agent(endpoint, workspace, store, events, context_window=None) -> tuple[Agent, SessionRecorder]:
    client = ChatClient(endpoint.url)
    recorder = SessionRecorder(store, workspace, "scripted-model")
    agent = Agent(client, ToolBox(Workspace(workspace), workspace.parent / "spill"), Approvals(Mode.AUTO_EDIT, None),
                  on_message=recorder.save, on_retract=recorder.retract, on_event=events.append,
                  context_window=context_window, on_compacted=recorder.restart)
    return agent, recorder


async def test_between_turns_the_agent_compacts_first_and_keeps_the_new_request_word_for_word(workspace, store):
    replies = [tool_reply(READ), text_reply("It says hello world."), text_reply("Goal: read hello.txt. Done."),
               text_reply("ok")]
    events: list = []
    with ScriptedEndpoint(replies) as endpoint:
        agent, recorder = make_agent(endpoint, workspace, store, events)
        await agent.run_turn("what is in hello.txt?")
        first_session = recorder.session_id
        agent.context_window = agent.context_used + 10  # the next request would fill it
        result = await agent.run_turn("now shout it")
        await agent.client.aclose()
    assert result.answer == "ok" and len(endpoint.requests) == 4
    summary_request, after = endpoint.requests[2], endpoint.requests[3]
    assert summary_request["messages"][:-1] == endpoint.requests[1]["messages"] + [
        {"role": "assistant", "content": "It says hello world."}]  # the whole conversation, then the request
    assert summary_request["messages"][-1] == {"role": "user", "content": COMPACT_REQUEST}
    assert summary_request["tools"] == endpoint.requests[1]["tools"]
    assert [m["role"] for m in after["messages"]] == ["system", "user", "assistant", "user"]
    assert after["messages"][-1] == {"role": "user", "content": "now shout it"}
    compactions = [e for e in events if isinstance(e, CompactEvent)]
    assert [(e.trigger, e.summary is not None) for e in compactions] == [("auto", False), ("auto", True)]
    assert compactions[0].num_messages == 5 and compactions[0].context_used >= 0.85 * agent.context_window
    assert recorder.session_id != first_session and len(store.messages(first_session)) == 5  # the long one is kept
    assert store.messages(recorder.session_id) == after["messages"] + [{"role": "assistant", "content": "ok"}]
    assert store.info(recorder.session_id).title == "what is in hello.txt?"


async def test_mid_turn_the_agent_compacts_and_goes_on_with_the_task(workspace, store):
    replies = [tool_reply(READ), text_reply("Goal: read hello.txt. Read it: hello world."), text_reply("Done.")]
    events: list = []
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, store, events, context_window=120)  # the tool's result fills it
        result = await agent.run_turn("what is in hello.txt?")
        await agent.client.aclose()
    assert result.answer == "Done." and result.stop_reason == "done"
    summary_request, after = endpoint.requests[1], endpoint.requests[2]
    assert summary_request["messages"][-2]["role"] == "tool" and "hello world" in summary_request["messages"][-2]["content"]
    assert [m["role"] for m in after["messages"]] == ["system", "user", "assistant", "user"]
    assert after["messages"][-1]["content"] == CONTINUE_AFTER_COMPACTION


async def test_a_failed_compaction_is_told_and_the_turn_goes_on(workspace, store):
    replies = [text_reply("one"), text_reply("   "), text_reply("two")]  # the second: no summary
    events: list = []
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, store, events)
        await agent.run_turn("first")
        agent.context_window = agent.context_used
        result = await agent.run_turn("second")
        await agent.client.aclose()
    assert result.answer == "two" and [m["role"] for m in endpoint.requests[2]["messages"]] == [
        "system", "user", "assistant", "user"]  # uncompacted
    failed = [e for e in events if isinstance(e, CompactEvent) and e.error]
    assert len(failed) == 1 and "no summary" in failed[0].error


async def test_the_compaction_prompt_extends_the_last_request_as_the_server_renders_it(workspace, store,
                                                                                        tiny_checkpoint):
    """Through northcode serve's /tokenize (the tiny checkpoint's chat template and tokenizer): the compaction
    request's ids start with every id of the previous request, so the prefix cache serves them all; without
    the tools they part where the tools are rendered, near the start (token 259 of 1993 here)."""
    from test_server import make_client

    replies = [tool_reply(READ), text_reply("It says hello world."), text_reply("Summary."), text_reply("ok")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, store, [])
        await agent.run_turn("what is in hello.txt?")
        agent.context_window = agent.context_used + 10
        await agent.run_turn("again")
        await agent.client.aclose()
    server, _, _ = make_client(tiny_checkpoint, [])

    def ids(body: dict) -> list[int]:
        response = server.post("/tokenize", json={key: body[key] for key in ("messages", "tools") if key in body})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    def shared(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    last, summary_request = ids(endpoint.requests[1]), endpoint.requests[2]
    with_tools, without_tools = ids(summary_request), ids({"messages": summary_request["messages"]})
    assert with_tools[:len(last)] == last and len(with_tools) > len(last)
    assert shared(last, without_tools) < len(last) // 4  # what compaction cost before: nearly the whole prompt again


async def test_the_app_tells_the_user_and_goes_on_in_a_new_session(workspace, store):
    replies = [text_reply("first answer"), text_reply("Goal: greet. Done: said hello."), text_reply("second answer")]
    with ScriptedEndpoint(replies, context_len=120) as endpoint:  # 50 tokens a message: the second turn fills it
        app = NorthcodeApp(workspace, endpoint=endpoint.url, store=store)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.agent is not None)
            await send(app, pilot, "say hello")
            await until(pilot, lambda: endpoint.finished == 1 and not app.is_busy)
            first_session = app.session_id
            await send(app, pilot, "and again")
            await until(pilot, lambda: endpoint.finished == 3 and not app.is_busy)
            told = notices(app)
            assert any(n.startswith("The context is about") and "compacting the conversation" in n for n in told)
            assert any(n.startswith("compacted 3 messages") and first_session in n for n in told)
            assert any("Goal: greet." in m.body.source for m in app.query(AssistantMessage))
            assert app.session_id != first_session and store.info(app.session_id).title == "say hello"
    assert endpoint.requests[2]["messages"][-1] == {"role": "user", "content": "and again"}


def test_a_headless_run_compacts_and_says_so(workspace, capsys):
    replies = [tool_reply(READ), text_reply("Goal: read it. Read: hello world."), text_reply("It says hello world.")]
    with ScriptedEndpoint(replies, context_len=120) as endpoint:
        code = main(["run", "-p", "what is in hello.txt?", "--output-format", "stream-json", "--endpoint",
                     endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and "compacting the conversation" in err and "compacted 4 messages" in err
    boundary = next(e for e in events if e.get("subtype") == "compact_boundary")
    assert boundary["compact_metadata"]["trigger"] == "auto" and boundary["summary"].startswith("Goal: read it.")
    assert boundary["session_id"] != events[0]["session_id"] == events[1]["session_id"]  # a new session from here
    assert events[-1]["session_id"] == boundary["session_id"] and events[-1]["result"] == "It says hello world."
