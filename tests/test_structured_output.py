"""response_format and tool_choice held by the grammar (server/structured_output.py) through the three front ends.

The grammar's shape for each case (reasoning on and off, auto, required, named, parallel calls); a schema
llguidance cannot enforce is a 400 naming the construct (a tool's, under auto, is held to any object
instead); then end to end on the tiny random-weights checkpoint (tests/closing_model.py): JSON answers that
validate, streamed and not, and forced tool calls, 100% of them carrying arguments valid against their
tool's schema, through /v1/chat/completions, /v1/messages (tool_choice any and tool) and /v1/responses
(text.format json_schema, tool_choice). With reasoning on, on a model leaning to end its turn or open a text block
before it ends its thinking (THINKING_LEAN), in batches of 8: every forced call still comes, and auto still may
end the turn without one."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from northcode_serve_process import running_server
from starlette.testclient import TestClient

from northcode.server.app import create_app
from northcode.server.errors import RequestError
from northcode.server.schemas import parse_chat_request
from northcode.server.state import ServerOptions, ServerState
from northcode.server.structured_output import chat_grammar
from tests.closing_model import SCHEMAS, THINKING_LEAN, closing_engine
from tests.test_output_parser import markers, tok  # noqa: F401 (fixtures)

SCHEMA_OF = {e["name"]: e["schema"] for e in SCHEMAS}
TOOLS = [{"type": "function", "function": {"name": name.removeprefix("tool_"), "description": name,
                                            "parameters": SCHEMA_OF[name]}}
         for name in ("tool_read", "tool_edit", "tool_bash", "tool_get_weather", "tool_todo_write", "tool_no_arguments")]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"reasoning_effort": "none"}  # the random weights never end a thinking block
ANSWER_SCHEMAS = ["person", "sentiment", "order", "recursive_tree", "user_account", "multiple_of", "top_level_array",
                  "nullable_fields", "one_of_events", "server_config", "tool_calendar_event", "json_object_mode"]


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    engine = closing_engine(tiny_checkpoint)
    yield TestClient(create_app(ServerState(ServerOptions(), engine=engine)), raise_server_exceptions=False)
    engine.shutdown()


def grammar_of(markers, thinking: bool = False, **body):
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body}, default_system_prompt=None)
    end = [markers.start_thinking] if thinking else [markers.start_thinking, markers.end_thinking]
    return chat_grammar(chat, [1, 2, *end], markers)


def chat(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 160, **NO_THINKING, **body})
    assert response.status_code == 200, response.text
    return response.json()


def assert_calls_valid(calls: list[tuple[str, str]]) -> None:
    """(name, arguments JSON) of each call: at least one, each valid against its tool's parameters."""
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])


# --- the grammar ---


def test_what_each_request_is_held_to(markers):
    assert grammar_of(markers) is None and grammar_of(markers, tools=TOOLS, tool_choice="none") is None
    auto = grammar_of(markers, thinking=True, tools=TOOLS)  # free text, or calls once the model opens an action
    assert auto.trigger_id == markers.start_action and "start: action\n" in auto.grammar
    assert not auto.ban_while_dormant  # auto's free text may end the turn
    required = grammar_of(markers, thinking=True, tools=TOOLS, tool_choice="required")
    assert required.trigger_id == markers.end_thinking and f"start: <[{markers.end_thinking}]> (action)" in required.grammar
    assert required.ban_while_dormant  # its thinking may write no marker but <|END_THINKING|>
    answer_after_thinking = grammar_of(markers, thinking=True, response_format={"type": "json_object"})
    assert answer_after_thinking.trigger_id == markers.end_thinking and answer_after_thinking.ban_while_dormant
    assert 'call ("," call)*' in required.grammar
    single = grammar_of(markers, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert single.trigger_id is None and 'call ("," call)*' not in single.grammar
    named = grammar_of(markers, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "bash"}})
    assert '"\\"bash\\", \\"parameters\\": "' in named.grammar and '"\\"read\\"' not in named.grammar
    answer = grammar_of(markers, tools=TOOLS, response_format={"type": "json_object"})  # JSON text, or calls
    assert answer.trigger_id is None and "start: text | action\n" in answer.grammar
    strict = grammar_of(markers, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "strict": True, "schema": SCHEMA_OF["person"]}})
    assert "start: text\n" in strict.grammar and '"required":["name","age"]' in strict.grammar


def test_a_schema_that_cannot_be_enforced_is_a_400_naming_the_construct(markers, client, caplog):
    unsupported = {"type": "object", "properties": {"a": {"type": "string", "format": "iban"}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                 "type": "object", "propertyNames": {"pattern": "^a"}}}}}, "response_format", "propertyNames"),
             ({"tools": TOOLS + [{"type": "function", "function": {"name": "iban", "parameters": unsupported}}],
               "tool_choice": "required"}, "tools[6].function.parameters", "Unknown format: iban")]
    for body, param, construct in cases:
        with pytest.raises(RequestError) as err:
            grammar_of(markers, **body)
        assert err.value.param == param and construct in str(err.value)
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                             **body})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and construct in error["message"]
    # auto: a tool is held to what can be enforced of its schema (an unknown format left out), or to any object
    lenient = grammar_of(markers, tools=[{"type": "function", "function": {"name": "iban", "parameters": unsupported}}])
    assert '"format":"iban"' in lenient.grammar and '"lenient":true' in lenient.grammar
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)b"}}}
    anything = grammar_of(markers, tools=[{"type": "function", "function": {"name": "look", "parameters": lookahead}}])
    assert "(?=a)b" not in anything.grammar and "tools[0].function.parameters cannot be enforced" in caplog.text


# --- end to end ---


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_json_answers_validate(client, stream):
    for name in ANSWER_SCHEMAS:
        schema = SCHEMA_OF[name]
        response_format = {"type": "json_object"} if name == "json_object_mode" else \
            {"type": "json_schema", "json_schema": {"name": name, "strict": stream, "schema": schema}}
        body = {"model": "m", "messages": [{"role": "user", "content": f"A {name}, please."}], "max_tokens": 160,
                "response_format": response_format, "temperature": 1.0 if stream else 0.0, "seed": 7, "stream": stream,
                **NO_THINKING}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            content, finish = response.json()["choices"][0]["message"]["content"], response.json()["choices"][0]["finish_reason"]
        assert finish == "stop", (name, content)
        jsonschema.validate(json.loads(content), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_every_forced_call_carries_valid_arguments(client, stream):
    choices = ["required", {"type": "function", "function": {"name": "edit"}},
               {"type": "function", "function": {"name": "todo_write"}}, {"type": "function", "function": {"name": "bash"}}]
    for i, (choice, parallel) in enumerate((c, p) for c in choices for p in (True, False)):
        body = {"model": "m", "messages": [{"role": "user", "content": f"Task {i}."}], "tools": TOOLS, "tool_choice": choice,
                "parallel_tool_calls": parallel, "max_tokens": 200, "temperature": 1.0, "seed": i, "stream": stream,
                **NO_THINKING}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        finish, found = turn_of(response, stream)
        assert finish == "tool_calls"
        if not stream:
            assert response.json()["choices"][0]["message"]["content"] is None
        assert_calls_valid(found)
        assert parallel or len(found) == 1
        if isinstance(choice, dict):
            assert {name for name, _ in found} == {choice["function"]["name"]}


# --- a forced answer behind a thinking block ---


@pytest.fixture(scope="module")
def thinking_url(tiny_checkpoint):
    """The app on a loopback port (requests in parallel share the engine's steps) over the closing model leaning
    to escape its thinking block."""
    engine = closing_engine(tiny_checkpoint, THINKING_LEAN)
    try:
        with running_server(create_app(ServerState(ServerOptions(), engine=engine))) as url:
            yield url
    finally:
        engine.shutdown()


def turns(url: str, bodies: list[dict]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The bodies' chat completions, all at once: (finish_reason, (name, arguments) of each call) of each."""
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            return await asyncio.gather(*[http.post("/v1/chat/completions", json=body) for body in bodies])
    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return [turn_of(r, body.get("stream", False)) for r, body in zip(responses, bodies)]


def turn_of(response: httpx.Response, stream: bool) -> tuple[str, list[tuple[str, str]]]:
    if not stream:
        choice = response.json()["choices"][0]
        return choice["finish_reason"], [(c["function"]["name"], c["function"]["arguments"])
                                         for c in choice["message"].get("tool_calls") or []]
    calls: dict[int, list[str]] = {}
    finish = None
    for line in response.text.splitlines():
        if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
            for call in choices[0]["delta"].get("tool_calls") or []:
                calls.setdefault(call["index"], ["", ""])
                calls[call["index"]][0] += call["function"].get("name") or ""
                calls[call["index"]][1] += call["function"].get("arguments") or ""
            finish = choices[0]["finish_reason"] or finish
    return finish, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "streamed"])
def test_a_forced_call_behind_a_thinking_block_always_comes(thinking_url, stream):
    """Without the ban most of these end their turn in the thinking block (tests/test_engine_grammar.py)."""
    choices = ["required", {"type": "function", "function": {"name": "edit"}}, {"type": "function", "function": {
        "name": "bash"}}, {"type": "function", "function": {"name": "todo_write"}}]
    for batch in range(3):
        bodies = [{"model": "m", "messages": [{"role": "user", "content": f"Task {batch}.{k}."}], "tools": TOOLS,
                   "tool_choice": choices[k % 4], "parallel_tool_calls": k < 4, "max_tokens": 240,
                   "temperature": 0.0 if (batch + k) % 2 else 1.0, "seed": 8 * batch + k, "stream": stream}
                  for k in range(8)]
        for body, (finish, calls) in zip(bodies, turns(thinking_url, bodies)):
            assert finish == "tool_calls", (body, finish, calls)
            assert_calls_valid(calls)
            assert body["parallel_tool_calls"] or len(calls) == 1
            if isinstance(body["tool_choice"], dict):
                assert {name for name, _ in calls} == {body["tool_choice"]["function"]["name"]}


def test_auto_behind_a_thinking_block_may_still_end_the_turn_without_a_call(thinking_url):
    bodies = [{"model": "m", "messages": [{"role": "user", "content": f"Maybe {k}."}], "tools": TOOLS,
               "max_tokens": 240, "temperature": 1.0, "seed": k, "stream": k % 2 == 1} for k in range(8)]
    assert any(finish == "stop" and not calls for finish, calls in turns(thinking_url, bodies))


def test_anthropic_tool_choice_any_and_tool(client):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    choices = [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
    for i, choice in enumerate(choices):
        response = client.post("/v1/messages", json={
            "model": "claude", "max_tokens": 200, "messages": [{"role": "user", "content": f"Go {i}."}], "tools": tools,
            "tool_choice": choice, "thinking": {"type": "disabled"}, "temperature": 1.0})
        message = response.json()
        calls = [(b["name"], json.dumps(b["input"])) for b in message["content"] if b["type"] == "tool_use"]
        assert message["stop_reason"] == "tool_use" and all(b["type"] == "tool_use" for b in message["content"])
        assert_calls_valid(calls)
        assert choice["type"] != "tool" or {n for n, _ in calls} == {"get_weather"}


def test_responses_text_format_and_tool_choice(client):
    schema = SCHEMA_OF["invoice"]
    response = client.post("/v1/responses", json={
        "model": "m", "input": "An invoice.", "max_output_tokens": 160, "reasoning": {"effort": "none"},
        "text": {"format": {"type": "json_schema", "name": "invoice", "strict": True, "schema": schema}}}).json()
    message = next(item for item in response["output"] if item["type"] == "message")
    jsonschema.validate(json.loads(message["content"][0]["text"]), schema)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    response = client.post("/v1/responses", json={
        "model": "m", "input": "Read it.", "max_output_tokens": 200, "reasoning": {"effort": "none"}, "tools": tools,
        "tool_choice": {"type": "function", "name": "read"}}).json()
    assert_calls_valid([(item["name"], item["arguments"]) for item in response["output"] if item["type"] == "function_call"])
