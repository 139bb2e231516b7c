"""POST /v1/responses with a ScriptedEngine: the event stream for fixed token ids (golden), the plain
response, the translation of input items (the same prompt ids as /v1/chat/completions), the store
(previous_response_id, GET, DELETE, its bound) and the 4xx for bad input.

The events are parsed with the openai SDK's own types, the authority on the Responses API's shapes.
tests/test_server_responses_real.py runs the SDK against a real `northcode serve`.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from test_server import TEXT_SCRIPT, TOOL_SCRIPT, TOOLS, encode_script, make_client, tok  # noqa: F401 (tok: a fixture)

from northcode.engine.request import RequestOutput, Usage
from northcode.server.responses_api import ResponseStore

EVENT = TypeAdapter(ResponseStreamEvent)
FUNCTION_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
TWO_CALLS_SCRIPT = ("Two files.", "END_THINKING", "START_ACTION",
                    '[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": {"path": "a"}},\n'
                    '    {"tool_call_id": "1", "tool_name": "read", "parameters": {"path": "b"}}\n]', "END_ACTION", "END_OF_TURN_TOKEN")


def stream_events(response) -> list[dict]:
    """The SSE events, each checked: an `event:` line naming the type its data carries, then the data."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == event_line[len("event: "):]
        EVENT.validate_python(data)  # the SDK's type for it
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def shape(events: list[dict]) -> list[str]:
    """The event types, with runs of deltas folded into one `type*`."""
    out = []
    for e in events:
        kind = e["type"] + "*" if e["type"].endswith(".delta") else e["type"]
        if not out or out[-1] != kind or not kind.endswith("*"):
            out.append(kind)
    return out


def post(client, **body):
    return client.post("/v1/responses", json={"model": "x", "input": "hi", **body})


@pytest.fixture
def text_client(tiny_checkpoint, tok):
    return make_client(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))


def test_text_stream_golden(text_client):
    client, engine, _ = text_client
    events = stream_events(post(client, stream=True))
    assert shape(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta*",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta*",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    reasoning, message = events[-1]["response"]["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Hmm."}]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == "Hello there." == "".join(
        e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert all(e["item_id"] == message["id"] and e["output_index"] == 1 for e in events if e["type"] == "response.output_text.delta")
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed" and final.output_text == "Hello there."
    usage = final.usage
    assert usage.input_tokens == len(engine.seen[0][0]) and usage.input_tokens_details.cached_tokens == 3
    assert usage.output_tokens == len(engine.script) and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens > 0


def test_plain_response_has_the_streamed_items(text_client):
    client, _, _ = text_client
    body = post(client).json()
    response = Response.model_validate(body)
    assert response.status == "completed" and response.object == "response" and response.output_text == "Hello there."
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Hmm." and response.incomplete_details is None


@pytest.mark.parametrize("script, names", [(TOOL_SCRIPT, ["read"]), (TWO_CALLS_SCRIPT, ["read", "read"])])
def test_function_calls_stream_golden(tiny_checkpoint, tok, script, names):
    client, _, _ = make_client(tiny_checkpoint, encode_script(tok, *script))
    events = stream_events(post(client, tools=FUNCTION_TOOLS, stream=True))
    call_events = ["response.output_item.added", "response.function_call_arguments.delta*",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert shape(events)[8:] == call_events * len(names) + ["response.completed"]
    calls = events[-1]["response"]["output"][1:]
    assert [c["name"] for c in calls] == names and len({c["call_id"] for c in calls}) == len(names)
    for index, call in enumerate(calls, start=1):
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == index]
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done" and e["output_index"] == index)
        assert "".join(deltas) == done["arguments"] == call["arguments"] and json.loads(call["arguments"])["path"]
        assert call["status"] == "completed" and call["call_id"].startswith("call_")
        added = next(e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == index)
        assert added["item"]["arguments"] == "" and added["item"]["name"] == "read"


def test_cut_off_output_is_incomplete(text_client):
    client, _, _ = text_client
    events = stream_events(post(client, stream=True, max_output_tokens=6))
    assert events[-1]["type"] == "response.incomplete"
    response = Response.model_validate(events[-1]["response"])
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete" and response.usage.output_tokens == 6
    plain = post(client, max_output_tokens=6).json()
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}


def chat_turns():
    """One conversation with reasoning, a tool round trip and a second user turn, in both APIs' shapes."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Read a."},
            {"role": "assistant", "content": "", "reasoning_content": "Need it.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "A's text"},
            {"role": "assistant", "content": "It says A.", "reasoning_content": "Done."},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."}]}]
    items = [{"type": "message", "role": "user", "content": "Read a."},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "read", "arguments": '{"path":"a"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "A's text"},
             {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Done."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It says A."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]}]
    return chat, items


@pytest.mark.parametrize("effort", [None, "none", "high"])
def test_same_conversation_same_prompt_ids_as_chat(text_client, effort):
    client, engine, _ = text_client
    chat, items = chat_turns()
    extra = {} if effort is None else {"reasoning_effort": effort}
    assert client.post("/v1/chat/completions", json={"model": "x", "messages": chat, "tools": TOOLS, **extra}).status_code == 200
    extra = {} if effort is None else {"reasoning": {"effort": effort}}
    assert post(client, instructions="Be brief.", input=items, tools=FUNCTION_TOOLS, **extra).status_code == 200
    (chat_ids, chat_sampling), (resp_ids, resp_sampling) = engine.seen
    assert resp_ids == chat_ids and resp_sampling.max_tokens == chat_sampling.max_tokens


def test_tool_choice_and_limits_reach_the_engine(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    assert client.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                     "tool_choice": {"type": "function", "function": {"name": "read"}},
                                                     "max_tokens": 50, "temperature": 0.5}).status_code == 200
    body = post(client, tools=FUNCTION_TOOLS, tool_choice={"type": "function", "name": "read"}, max_output_tokens=50,
                temperature=0.5, parallel_tool_calls=False).json()
    (chat_ids, chat_sampling), (resp_ids, resp_sampling) = engine.seen
    assert resp_ids == chat_ids and resp_sampling.max_tokens == 50 and resp_sampling.temperature == 0.5
    assert body["output"][-1]["type"] == "function_call" and body["output"][-1]["name"] == "read"
    assert body["tool_choice"] == {"type": "function", "name": "read"} and body["parallel_tool_calls"] is False


def test_previous_response_id_continues_the_stored_conversation(text_client):
    client, engine, _ = text_client
    first = post(client, input="Read a.").json()
    second = post(client, input="And then?", previous_response_id=first["id"]).json()
    assert second["previous_response_id"] == first["id"] and second["status"] == "completed"
    whole = [{"role": "user", "content": "Read a."}, *first["output"], {"role": "user", "content": "And then?"}]
    post(client, input=whole)
    assert engine.seen[1][0] == engine.seen[2][0]  # the stored conversation, the same prompt as sent whole
    assert client.get(f"/v1/responses/{first['id']}").json() == first
    assert client.delete(f"/v1/responses/{first['id']}").json() == {"id": first["id"], "object": "response", "deleted": True}
    gone = post(client, input="x", previous_response_id=first["id"])
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "previous_response_not_found"
    assert gone.json()["error"]["param"] == "previous_response_id"
    assert client.get(f"/v1/responses/{first['id']}").status_code == 404
    unstored = post(client, store=False).json()
    assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404


def test_the_store_is_bounded():
    store = ResponseStore(max_responses=2, max_bytes=1000)
    for i in range(3):
        store.put({"id": f"r{i}"}, [], ResponseStore.stored_size({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    store.put({"id": "big"}, [], 2000)  # over the byte bound alone: it stays, the others go
    assert store.get("r1") is None and store.get("r2") is None and store.get("big") is not None


@pytest.mark.parametrize("body, param", [
    ({"input": 3}, "input"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].tool_call_id"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": [{"type": ["message"]}]}, "input[0].type"),
    ({"tools": [{"type": {"function": 1}}]}, "tools[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "read", "arguments": 5}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "read"}]}, "input[0].call_id"),
    ({"instructions": ["x"]}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": 3}]}, "tools[1].parameters"),
    ({"tool_choice": {"type": "function", "name": "missing"}, "tools": FUNCTION_TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"reasoning": "high"}, "reasoning"),
    ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"temperature": "hot"}, "temperature"),
    ({"background": True}, "background"),
    ({"previous_response_id": 7}, "previous_response_id"),
    ({"store": "yes"}, "store"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_input_is_a_400_naming_the_field(text_client, body, param):
    client, engine, _ = text_client
    response = client.post("/v1/responses", json={"model": "x", "input": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "messages" not in error["message"], error
    assert not engine.seen


def test_body_errors_are_4xx(text_client):
    client, _, _ = text_client
    assert client.post("/v1/responses", content=b"[1]").status_code == 400
    assert client.post("/v1/responses", content=b"{").status_code == 400
    assert client.post("/v1/responses", content=b'{"input": NaN}').status_code == 400
    too_long = client.post("/v1/responses", json={"input": "word " * 5000})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert too_long.json()["error"]["param"] == "input"


def codex_body(input_items: list[dict]) -> dict:
    """A request as Codex CLI 0.171 sends it (recorded against `northcode serve`), cut down."""
    return {"model": "north-mini-code", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "session-1",
            "client_metadata": {"turn_id": "t1"},
            "tools": [{"type": "function", "name": "exec_command", "description": "Run a command", "strict": False,
                       "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
                      {"type": "namespace", "name": "files", "description": "File tools", "tools": FUNCTION_TOOLS},
                      {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read README.md"}]},
                      *input_items]}


def test_codex_tool_round_trip_extends_the_cached_prompt(tiny_checkpoint, tok):
    """Codex replays the reasoning and the call as it got them, with the call's output: the second prompt
    is the first one followed by the tokens the model wrote, so the prefix cache serves all of it."""
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    events = stream_events(client.post("/v1/responses", json=codex_body([])))
    output = events[-1]["response"]["output"]
    call = output[-1]
    assert call["type"] == "function_call" and call["name"] == "read" and call["namespace"] == "files"
    assert next(e for e in events if e["type"] == "response.output_item.added" and e["output_index"] == 1)["item"]["namespace"] == "files"
    assert [t["type"] for t in events[-1]["response"]["tools"]] == ["function", "namespace"]
    replayed = [dict(output[0], encrypted_content=None), call,
                {"type": "function_call_output", "id": "fco_1", "call_id": call["call_id"], "output": "# northcode"}]
    stream_events(client.post("/v1/responses", json=codex_body(replayed)))
    (first, _), (second, _) = engine.seen
    assert second[:len(first) + len(engine.script)] == first + engine.script


def test_an_engine_error_mid_stream_is_response_failed(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))

    async def failing(request_id, prompt_ids, sampling):
        yield RequestOutput(request_id, engine.script[:3], "", finished=False, usage=Usage(len(prompt_ids), 3, 0))
        yield RequestOutput(request_id, [], "", finished=True, finish_reason="error", error="device lost",
                            usage=Usage(len(prompt_ids), 3, 0))

    engine.generate = failing
    events = stream_events(post(client, stream=True))
    assert events[-1]["type"] == "response.failed"
    response = Response.model_validate(events[-1]["response"])
    assert response.status == "failed" and response.error.code == "server_error" and "device lost" in response.error.message
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"
    plain = post(client)
    assert plain.status_code == 500 and "device lost" in plain.json()["error"]["message"]


def test_empty_input_names_input(text_client):
    client, _, _ = text_client
    response = client.post("/v1/responses", json={"model": "x", "input": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    assert "messages" not in response.json()["error"]["message"]


def test_previous_response_id_with_a_call_takes_its_output(tiny_checkpoint, tok):
    client, engine, state = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    first = post(client, tools=FUNCTION_TOOLS).json()
    call = first["output"][-1]
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "# northcode"}
    second = post(client, tools=FUNCTION_TOOLS, previous_response_id=first["id"], input=[output])
    assert second.status_code == 200, second.text
    (first_ids, _), (second_ids, _) = engine.seen
    assert second_ids[:len(first_ids) + len(engine.script)] == first_ids + engine.script
    for _ in range(2):
        client.get(f"/v1/responses/{first['id']}")
    metrics = client.get("/metrics").text
    assert 'endpoint="/v1/responses/{id}"' in metrics and first["id"] not in metrics
