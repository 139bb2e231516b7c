"""The agent loop against a real HTTP endpoint that replays scripted tool calls, in a temporary workspace."""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_scripted_endpoint import (RecordingAsker, ScriptedEndpoint, error_reply, text_reply,
                                     tool_reply)

from northcode.agent.approvals import Approvals, Decision, Mode
from northcode.agent.client import ChatClient, Delta, EndpointError
from northcode.agent.loop import Agent, ToolEvent
from northcode.agent.sandbox import Workspace
from northcode.agent.sessions import SessionRecorder, SessionStore
from northcode.agent.tools import ToolBox

APP_PY = "def greet(name):\n    return 'hello ' + name\n\nprint(greet('world'))\n"


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "ws"
    (root / "src").mkdir(parents=True)
    (root / "src" / "app.py").write_text(APP_PY)
    (root / "README.md").write_text("# demo\nRun src/app.py to greet.\n")
    return Workspace(root)


def make_agent(endpoint, workspace, tmp_path, mode=Mode.ASK, asker=None, **kwargs):
    client = ChatClient(endpoint.url)
    events = []
    agent = Agent(client, ToolBox(workspace, tmp_path / "spill"), Approvals(mode, asker),
                  on_event=events.append, **kwargs)
    return agent, events


def tool_outputs(endpoint, request_idx):
    return [m["content"] for m in endpoint.requests[request_idx]["messages"] if m["role"] == "tool"]


async def test_read_and_grep_results_go_back_as_tool_messages(workspace, tmp_path):
    replies = [tool_reply(("read", {"filePath": "src/app.py", "offset": 2, "limit": 1}),
                          ("grep", {"pattern": "greet", "include": "*.md"})),
               text_reply("The function greet returns a greeting.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, events = make_agent(endpoint, workspace, tmp_path)
        result = await agent.run_turn("what does greet do?")
        await agent.client.aclose()
    assert result.answer == "The function greet returns a greeting." and result.stop_reason == "done"
    assert result.num_steps == 2
    second = endpoint.requests[1]["messages"]
    assert [m["role"] for m in second] == ["system", "user", "assistant", "tool", "tool"]
    assert second[2]["content"] == "" and [c["function"]["name"] for c in second[2]["tool_calls"]] == ["read", "grep"]
    assert [m["tool_call_id"] for m in second[3:]] == [c["id"] for c in second[2]["tool_calls"]]
    read_out, grep_out = tool_outputs(endpoint, 1)
    assert read_out.startswith("     2\t    return 'hello ' + name") and "lines 2-2 of 4" in read_out
    assert grep_out == "README.md:2: Run src/app.py to greet."
    assert endpoint.requests[0]["tools"][0]["function"]["name"] == "read"
    assert endpoint.requests[0]["stream_options"] == {"include_usage": True}
    assert [e.ok for e in events if isinstance(e, ToolEvent) and e.output is not None] == [True, True]


async def test_approved_edit_changes_exactly_the_string(workspace, tmp_path):
    edit = ("edit", {"filePath": "src/app.py", "oldString": "'hello ' + name", "newString": "f'hello {name}!'"})
    asker = RecordingAsker(Decision.ALLOW_ONCE)
    with ScriptedEndpoint([tool_reply(edit), text_reply("Done.")]) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, asker=asker)
        await agent.run_turn("use an f-string")
    assert (workspace.root / "src" / "app.py").read_text() == APP_PY.replace("'hello ' + name", "f'hello {name}!'")
    (asked,) = asker.asked
    assert asked.kind == "edit" and "-    return 'hello ' + name\n+    return f'hello {name}!'\n" in asked.preview
    assert tool_outputs(endpoint, 1)[0].startswith("updated src/app.py")


async def test_denied_calls_change_nothing(workspace, tmp_path):
    replies = [tool_reply(("edit", {"filePath": "src/app.py", "oldString": "hello", "newString": "bye"}),
                          ("write", {"filePath": "new.txt", "content": "x"}),
                          ("bash", {"command": "touch made_by_shell"})),
               text_reply("OK, I left it.")]
    asker = RecordingAsker(Decision.DENY, Decision.DENY, Decision.DENY)
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, asker=asker)
        result = await agent.run_turn("change things")
    assert (workspace.root / "src" / "app.py").read_text() == APP_PY
    assert sorted(p.name for p in workspace.root.iterdir()) == ["README.md", "src"]
    assert all("denied by the user" in out for out in tool_outputs(endpoint, 1))
    assert len(asker.asked) == 3 and result.answer == "OK, I left it."


async def test_shell_runs_in_the_workspace_and_session_approval_sticks(workspace, tmp_path):
    command = ("bash", {"command": "ls src && echo done > out.txt"})
    asker = RecordingAsker(Decision.ALLOW_SESSION)
    replies = [tool_reply(command), tool_reply(command), text_reply("Listed.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, asker=asker)
        await agent.run_turn("list src")
    assert len(asker.asked) == 1  # the second identical command was allowed for the session
    assert tool_outputs(endpoint, 1)[0].startswith("app.py\n[exit code 0")
    assert (workspace.root / "out.txt").read_text() == "done\n"


async def test_modes_decide_without_asking(workspace, tmp_path):
    replies = [tool_reply(("write", {"filePath": "notes/todo.md", "content": "- ship\n"}),
                          ("bash", {"command": "touch should_not_exist"})),
               text_reply("Wrote it.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, mode=Mode.AUTO_EDIT, asker=None)
        await agent.run_turn("write a todo")
    assert (workspace.root / "notes" / "todo.md").read_text() == "- ship\n"
    assert not (workspace.root / "should_not_exist").exists()
    assert "headless" in tool_outputs(endpoint, 1)[1]


async def test_prompt_is_append_only_across_turns_and_agents_md_joins_system(workspace, tmp_path):
    (workspace.root / "AGENTS.md").write_text("Always answer in French.\n")
    replies = [tool_reply(("list", {})), text_reply("Voilà."), text_reply("Encore.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path)
        await agent.run_turn("first")
        await agent.run_turn("second")
    first, second, third = (r["messages"] for r in endpoint.requests)
    assert "Always answer in French." in first[0]["content"]
    assert second[: len(first)] == first and third[: len(second)] == second
    assert third[len(second)] == {"role": "assistant", "content": "Voilà."}
    assert third[-1] == {"role": "user", "content": "second"}


async def test_step_limit_stops_the_loop(workspace, tmp_path):
    replies = [tool_reply(("list", {})) for _ in range(3)]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, max_steps=2)
        result = await agent.run_turn("loop forever")
    assert result.stop_reason == "step_limit" and result.num_steps == 2 and len(endpoint.requests) == 2
    assert agent.messages[-1]["role"] == "tool"  # the history stays valid for the next turn


async def test_bad_tool_calls_become_error_results(workspace, tmp_path):
    replies = [tool_reply(("read", "{not json"), ("frobnicate", {}), ("read", {"filePath": "../../etc/passwd"}),
                          ("edit", {"filePath": "src/app.py", "oldString": "nope", "newString": "x"})),
               text_reply("Sorry.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, mode=Mode.FULL_AUTO)
        await agent.run_turn("break things")
    outputs = tool_outputs(endpoint, 1)
    assert "not valid JSON" in outputs[0] and "unknown tool 'frobnicate'" in outputs[1]
    assert "outside the workspace" in outputs[2] and "oldString not found" in outputs[3]
    assert (workspace.root / "src" / "app.py").read_text() == APP_PY


async def test_cancel_closes_the_stream_and_keeps_history_valid(workspace, tmp_path):
    with ScriptedEndpoint([text_reply("word " * 400, delay_s=0.01)]) as endpoint:
        agent, events = make_agent(endpoint, workspace, tmp_path)
        task = asyncio.create_task(agent.run_turn("talk"))
        while len(events) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if endpoint.disconnects:
                break
            await asyncio.sleep(0.02)
    assert endpoint.disconnects == 1 and endpoint.finished == 0
    assert agent.messages[-1]["role"] == "assistant" and agent.messages[-1]["content"].startswith("word word")


async def test_endpoint_errors_are_clear(workspace, tmp_path):
    with ScriptedEndpoint([]) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path)
        with pytest.raises(EndpointError, match="the script has no more replies"):
            await agent.run_turn("hi")
    agent, _ = make_agent(endpoint, workspace, tmp_path)  # the server is gone now
    with pytest.raises(EndpointError, match="cannot reach"):
        await agent.run_turn("hi")


async def test_tool_calls_cut_off_by_the_token_limit_are_not_run(workspace, tmp_path):
    """finish_reason "length" with tool calls: the arguments may be partial, so nothing runs; the
    model is told, the turn stops with its own stop_reason, and the next turn's history is valid."""
    partial_write = ("write", '{"filePath": "notes.txt", "content": "first line\\nsecond')
    whole_but_cut = ("bash", {"command": "touch made_by_shell"})  # its JSON closed, but the reply was cut after it
    replies = [tool_reply(whole_but_cut, partial_write, finish_reason="length", fragment_chars=3),
               text_reply("I will write less at once.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, events = make_agent(endpoint, workspace, tmp_path, mode=Mode.FULL_AUTO)
        result = await agent.run_turn("write notes")
        assert result.stop_reason == "tool_call_truncated" and result.num_steps == 1
        assert [call.name for call in result.truncated_calls] == ["bash", "write"]
        assert len(endpoint.requests) == 1  # the turn stopped: no tool results were sent on their own
        answer = await agent.run_turn("try again")  # the server accepts the history (it checks the arguments)
        await agent.client.aclose()
    assert sorted(p.name for p in workspace.root.iterdir()) == ["README.md", "src"]
    assert answer.answer == "I will write less at once." and answer.stop_reason == "done"
    history = endpoint.requests[1]["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant", "tool", "tool", "user"]
    calls = history[2]["tool_calls"]
    assert calls[0]["function"]["arguments"] == '{"command": "touch made_by_shell"}'
    assert calls[1]["function"]["arguments"] == "{}"  # partial JSON is kept out of the history...
    for message in history[3:5]:
        assert message["content"].startswith("Not run: your answer was cut off at the token limit")
    assert history[4]["content"].endswith('The arguments as written: {"filePath": "notes.txt", "content": "first line\\nsecond')
    results = [e for e in events if isinstance(e, ToolEvent) and e.output is not None]
    assert [(e.call.name, e.ok) for e in results] == [("bash", False), ("write", False)]


async def test_arguments_streamed_in_many_small_fragments_are_joined_by_index(workspace, tmp_path):
    new_text = 'f"hello {name}, été \\ {{braces}} \\"quoted\\""'  # JSON escapes (\\\\, \\", \\u00e9) split across fragments
    edit = {"filePath": "src/app.py", "oldString": "'hello ' + name", "newString": new_text}
    read = {"filePath": "README.md"}
    replies = [tool_reply(("edit", edit), ("read", read), fragment_chars=1), text_reply("Done.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, events = make_agent(endpoint, workspace, tmp_path, mode=Mode.AUTO_EDIT)
        await agent.run_turn("rewrite the greeting")
        await agent.client.aclose()
    fragments = [e for e in events if isinstance(e, Delta) and e.kind == "tool_arguments"]
    assert len(fragments) == len(json.dumps(edit)) + len(json.dumps(read))  # one character each
    assert (workspace.root / "src" / "app.py").read_text() == APP_PY.replace("'hello ' + name", edit["newString"])
    calls = endpoint.requests[1]["messages"][2]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [edit, read]
    assert tool_outputs(endpoint, 1)[1].startswith("     1\t# demo")


async def test_a_failed_request_takes_the_prompt_back_so_a_retry_is_not_doubled(workspace, tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    recorder = SessionRecorder(store, workspace.root, "m")
    replies = [error_reply("the server is busy"), text_reply("Hello!")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, on_message=recorder.save, on_retract=recorder.retract)
        with pytest.raises(EndpointError, match="the server is busy"):
            await agent.run_turn("hi")
        assert [m["role"] for m in agent.messages] == ["system"] and store.list() == []
        result = await agent.run_turn("hi")  # the user sends it again
        await agent.client.aclose()
    assert result.answer == "Hello!"
    assert [m["role"] for m in endpoint.requests[1]["messages"]] == ["system", "user"]
    assert [m["role"] for m in store.messages(recorder.session_id)] == ["system", "user", "assistant"]
    store.close()


async def test_a_failed_second_turn_keeps_the_first_and_drops_only_its_prompt(workspace, tmp_path):
    store = SessionStore(tmp_path / "sessions.sqlite3")
    recorder = SessionRecorder(store, workspace.root, "m")
    replies = [text_reply("one"), error_reply("overloaded"), text_reply("two")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, on_message=recorder.save, on_retract=recorder.retract)
        await agent.run_turn("first")
        with pytest.raises(EndpointError):
            await agent.run_turn("second")
        await agent.run_turn("second")
        await agent.client.aclose()
    roles = ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in store.messages(recorder.session_id)] == roles
    assert [m["role"] for m in endpoint.requests[2]["messages"]] == roles[:4]
    assert store.list()[0].title == "first"
    store.close()


async def test_cancelled_before_any_reply_takes_the_prompt_back(workspace, tmp_path):
    with ScriptedEndpoint([text_reply("late " * 50, delay_s=0.5), text_reply("ok")]) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path)
        task = asyncio.create_task(agent.run_turn("hello"))
        while not endpoint.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [m["role"] for m in agent.messages] == ["system"]
        await agent.run_turn("hello")
        await agent.client.aclose()
    assert [m["role"] for m in endpoint.requests[1]["messages"]] == ["system", "user"]


async def test_plan_mode_refuses_changes_without_asking_and_tells_the_model(workspace, tmp_path):
    todos = [{"content": "make greet use an f-string", "status": "pending", "priority": "high", "id": "1"}]
    replies = [tool_reply(("read", {"filePath": "src/app.py"}), ("todowrite", {"todos": todos}),
                          ("edit", {"filePath": "src/app.py", "oldString": "'hello ' + name", "newString": "'hi'"}),
                          ("bash", {"command": "touch should_not_exist"})),
               text_reply("The plan: one step."), text_reply("Done.")]
    asker = RecordingAsker()  # no decisions: a question would fail the test
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, mode=Mode.PLAN, asker=asker)
        await agent.run_turn("plan the f-string change")
        agent.approvals.mode = Mode.AUTO_EDIT
        await agent.run_turn("go ahead")
        await agent.client.aclose()
    assert asker.asked == [] and (workspace.root / "src" / "app.py").read_text() == APP_PY
    assert not (workspace.root / "should_not_exist").exists()
    read_out, todo_out, edit_out, bash_out = tool_outputs(endpoint, 1)
    assert "greet" in read_out and todo_out == "1 todos (1 pending):\n[ ] make greet use an f-string (id 1, high)"
    assert "plan mode, which is read-only" in edit_out and "let you edit files" in edit_out
    assert "plan mode, which is read-only" in bash_out and "let you run commands" in bash_out
    first, second = [m["content"] for m in endpoint.requests[2]["messages"] if m["role"] == "user"]
    assert first.startswith("[northcode: plan mode: the user wants a plan") and first.endswith("plan the f-string change")
    assert second == "[northcode: plan mode is over (mode auto-edit): you may now edit files and run commands as the " \
                     "mode allows.]\n\ngo ahead"
    assert [t.content for t in agent.toolbox.todos.items] == ["make greet use an f-string"]


async def test_the_todo_list_belongs_to_the_conversation(workspace, tmp_path):
    todos = [{"content": "step one", "status": "in_progress", "priority": "medium", "id": "a"}]
    replies = [tool_reply(("todowrite", {"todos": todos}), ("todoread", {})), text_reply("Planned."),
               tool_reply(("todoread", {})), text_reply("Still planned.")]
    with ScriptedEndpoint(replies) as endpoint:
        agent, _ = make_agent(endpoint, workspace, tmp_path, mode=Mode.ASK)
        await agent.run_turn("plan")
        resumed, _ = make_agent(endpoint, workspace, tmp_path, mode=Mode.ASK, messages=agent.messages)
        await resumed.run_turn("where are we?")
        fresh, _ = make_agent(endpoint, workspace, tmp_path)
        await agent.client.aclose()
        await resumed.client.aclose()
        await fresh.client.aclose()
    listed = "1 todos (1 in progress):\n[~] step one (id a, medium)"
    assert tool_outputs(endpoint, 1) == [listed, listed] and tool_outputs(endpoint, 3)[-1] == listed
    assert fresh.toolbox.todos.items == [] and endpoint.requests[0]["tools"][7]["function"]["name"] == "todowrite"
