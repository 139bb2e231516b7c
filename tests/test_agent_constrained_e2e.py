"""Forced tool calls end to end: tool_choice required and named at the endpoint, in the agent loop, in `northcode run`.

The engine's grammar makes a forced call's arguments valid, not short: on random weights a string can run to
max_tokens. So the 100% checks run on the tiny checkpoint over tests/closing_model.py's engine (random weights that
lean toward closing what they write, as a trained model does) behind the real app on a loopback port: 20 forced
requests through the `openai` package, then the agent loop forcing every call for several steps in a workspace,
the tools running for real (auto-edit: reads and edits run, bash and webfetch are refused without a question).
Then `northcode run --tool-choice` on a `northcode serve` subprocess of that checkpoint as it is (the demo's preset
and seed), where a forced first call is valid or cut off at the token limit (and not run), never text. Reasoning is
off throughout: random weights rarely end a thinking block, and a forced call starts after it.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply, tool_reply
from northcode_serve_process import northcode_serve, running_server

from northcode.agent.approvals import Approvals, Mode
from northcode.agent.client import ChatClient
from northcode.agent.loop import Agent, ToolEvent
from northcode.agent.sandbox import Workspace
from northcode.agent.tools import TOOL_SCHEMAS, ToolBox
from northcode.cli import main
from northcode.server.app import create_app
from northcode.server.state import ServerOptions, ServerState
from tests.closing_model import closing_engine

PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOL_SCHEMAS}
NO_THINKING = {"reasoning_effort": "none"}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def assert_valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@pytest.fixture(scope="module")
def closing_url(tiny_checkpoint):
    engine = closing_engine(tiny_checkpoint)
    try:
        with running_server(create_app(ServerState(ServerOptions(), engine=engine))) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "README.md").write_text("# demo\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("print('hi')\n")
    return tmp_path


def test_twenty_forced_requests_through_the_openai_package(closing_url):
    client = openai.OpenAI(base_url=closing_url + "/v1", api_key="unused", max_retries=0)
    choices = ["required", named("read"), named("list"), named("grep"), named("todowrite")]
    cases = [(choice, parallel, seed) for choice in choices for parallel in (True, False) for seed in (0, 1)]
    for choice, parallel, seed in cases:
        response = client.chat.completions.create(
            model="north-mini-code", messages=[{"role": "user", "content": f"Look at the code ({seed})."}],
            tools=TOOL_SCHEMAS, tool_choice=choice, parallel_tool_calls=parallel, max_tokens=300, temperature=1.0,
            seed=seed, extra_body=NO_THINKING)
        choice_0 = response.choices[0]
        assert choice_0.finish_reason == "tool_calls", (choice, parallel, seed, choice_0)
        calls = choice_0.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            assert_valid(call.function.name, call.function.arguments)
        if choice != "required":
            assert {call.function.name for call in calls} == {choice["function"]["name"]}


def run_forced_agent(url: str, workspace, tool_choice, max_steps: int) -> tuple[Agent, object, list[ToolEvent]]:
    """The agent on `workspace` with every model call forced by `tool_choice`; its turn's result and tool events."""
    events: list[ToolEvent] = []

    def on_event(event) -> None:
        if isinstance(event, ToolEvent) and event.output is not None:  # finished calls
            events.append(event)

    async def go():
        client = ChatClient(url)
        toolbox = ToolBox(Workspace(workspace), workspace / ".spill")
        agent = Agent(client, toolbox, Approvals(Mode.AUTO_EDIT, ask=None), max_steps=max_steps,
                      on_event=on_event,
                      request_params={"tool_choice": tool_choice, "max_tokens": 600, **NO_THINKING})
        try:
            return agent, await agent.run_turn("Explore this project and tidy it up.")
        finally:
            await client.aclose()

    agent, result = asyncio.run(go())
    return agent, result, events


def assert_every_step_called_and_was_answered(agent: Agent, num_steps: int) -> list[dict]:
    """Each assistant message carries calls valid against their tools; each call has its tool result after it."""
    messages = agent.messages
    replies = [m for m in messages if m["role"] == "assistant"]
    assert len(replies) == num_steps
    calls = [call for reply in replies for call in reply["tool_calls"]]  # KeyError: a reply without calls
    for call in calls:
        assert_valid(call["function"]["name"], call["function"]["arguments"])
    answered = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert answered == [call["id"] for call in calls]
    return calls


def test_the_agent_loop_with_every_call_required(closing_url, workspace):
    agent, result, events = run_forced_agent(closing_url, workspace, "required", max_steps=4)
    assert result.stop_reason == "step_limit" and result.num_steps == 4, agent.messages  # no answer in text
    calls = assert_every_step_called_and_was_answered(agent, 4)
    assert len(events) == len(calls)
    ran = [e for e in events if e.prepared is not None]  # valid calls the toolbox prepared (some paths are noise)
    assert ran and all(e.output for e in events)
    refused = [e for e in ran if e.prepared.kind in ("shell", "fetch")]
    assert all(not e.ok and "did not run this call" in e.output for e in refused)  # auto-edit, headless


@pytest.mark.parametrize("tool", ["list", "glob", "todowrite"])
def test_the_agent_loop_with_a_named_tool(closing_url, workspace, tool):
    agent, result, events = run_forced_agent(closing_url, workspace, named(tool), max_steps=3)
    assert result.stop_reason == "step_limit", agent.messages
    calls = assert_every_step_called_and_was_answered(agent, 3)
    assert {call["function"]["name"] for call in calls} == {tool}
    assert len(events) == len(calls) and all(e.prepared is None or e.prepared.name == tool for e in events)
    if tool == "todowrite":  # the list the model wrote, or the tool's own check of it (an item's empty content)
        assert all(e.ok or e.output.startswith("Error: todos[") for e in events), [e.output for e in events]


@pytest.mark.parametrize("choice, sent", [("list", named("list")), ("required", "required"), ("none", "none")])
def test_tool_choice_goes_with_the_first_request_only(workspace, capsys, choice, sent):
    replies = [tool_reply(("list", {})), text_reply("Two files.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "what is here?", "--tool-choice", choice, "--reasoning-effort", "none",
                     "--endpoint", endpoint.url, str(workspace)])
    assert code == 0 and capsys.readouterr().out == "Two files.\n"
    first, second = endpoint.requests
    assert first["tool_choice"] == sent and "tool_choice" not in second  # the second is the model's choice (auto)
    assert first["reasoning_effort"] == second["reasoning_effort"] == "none"


def test_a_tool_choice_that_names_no_tool_is_bad_input(workspace, capsys):
    assert main(["run", "-p", "x", "--tool-choice", "rm", "--endpoint", "http://127.0.0.1:9", str(workspace)]) == 2
    assert "--tool-choice 'rm': expected auto, required, none or a tool (read, list" in capsys.readouterr().err


def test_northcode_run_forces_the_first_call_only(closing_url, workspace, capsys):
    code = main(["run", "-p", "what is here?", "--tool-choice", "list", "--reasoning-effort", "none",
                 "--max-steps", "2", "--max-tokens", "300", "--json", "--endpoint", closing_url, str(workspace)])
    transcript = json.loads(capsys.readouterr().out)
    first = transcript["messages"][2]
    assert {call["function"]["name"] for call in first["tool_calls"]} == {"list"}
    for call in first["tool_calls"]:
        assert_valid("list", call["function"]["arguments"])
    results = transcript["messages"][3:3 + len(first["tool_calls"])]
    assert [m["tool_call_id"] for m in results] == [call["id"] for call in first["tool_calls"]]
    assert transcript["num_steps"] == 2 and code in (0, 3, 4)  # the second call was the model's choice (auto)


def test_northcode_run_on_a_northcode_serve_of_the_random_checkpoint(tiny_checkpoint, workspace, capsys):
    """Plain random weights: the forced first reply is a call (never text), valid, or cut off and not run."""
    with northcode_serve(tiny_checkpoint) as url:
        code = main(["run", "-p", "what is here?", "--tool-choice", "required", "--reasoning-effort", "none",
                     "--max-steps", "1", "--max-tokens", "400", "--json", "--endpoint", url, str(workspace)])
    out, err = capsys.readouterr()
    transcript = json.loads(out)
    assert len(transcript["messages"]) > 2, err
    first = transcript["messages"][2]
    assert first["role"] == "assistant" and first["tool_calls"] and transcript["num_steps"] == 1
    if code == 4:  # the token limit cut a call off: nothing ran
        assert transcript["stop_reason"] == "tool_call_truncated"
        assert transcript["messages"][3]["content"].startswith("Not run: your answer was cut off")
        return
    assert code == 3 and transcript["stop_reason"] == "step_limit"
    for call in first["tool_calls"]:
        assert_valid(call["function"]["name"], call["function"]["arguments"])
    assert [m["tool_call_id"] for m in transcript["messages"][3:]] == [call["id"] for call in first["tool_calls"]]
