"""/v1/messages and /v1/messages/count_tokens with a scripted engine: the translated prompt (the same ids as
/v1/chat/completions), golden SSE event streams for fixed token sequences, non-streaming bodies, and every
bad input a 4xx in Anthropic's error shape."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from northcode.engine.request import RequestOutput, Usage
from northcode.server.app import create_app
from northcode.server.state import ServerOptions, ServerState
from northcode.model.tokenizer import Tokenizer
from tests.test_server import TEXT_SCRIPT, TOOL_SCRIPT, TOOLS, ScriptedEngine, encode_script

READ_TOOL = {"name": "read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
TWO_CALLS = ("Both.", "END_THINKING", "START_ACTION",
             '[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": {"path": "a"}},\n'
             '    {"tool_call_id": "1", "tool_name": "read", "parameters": {"path": "b"}}\n]', "END_ACTION", "END_OF_TURN_TOKEN")


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


class StoppingEngine(ScriptedEngine):
    """Ends every request as the engine does on a stop string: finish_reason stop, stop_reason the string."""

    async def generate(self, request_id, prompt_ids, sampling):
        self.seen.append((prompt_ids, sampling))
        for i, token_id in enumerate(self.script):
            last = i == len(self.script) - 1
            yield RequestOutput(request_id, [token_id], "", finished=last, finish_reason="stop" if last else None,
                                stop_reason=sampling.stop[0] if last else None, usage=Usage(len(prompt_ids), i + 1, 0))


def client_for(tiny_checkpoint, engine, **options) -> TestClient:
    state = ServerState(ServerOptions(**options), engine=engine)
    return TestClient(create_app(state), raise_server_exceptions=False)


def scripted(tiny_checkpoint, tok, *parts, **options) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(tiny_checkpoint, encode_script(tok, *parts))
    return client_for(tiny_checkpoint, engine, **options), engine


def body(**extra) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], **extra}


def events_of(response) -> list[tuple[str, dict]]:
    """The (event, data) pairs of an Anthropic SSE stream; every event name matches its data's type."""
    out = []
    for frame in response.text.split("\n\n"):
        if not frame.strip():
            continue
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


def shape(events: list[tuple[str, dict]]) -> list[str]:
    """A compact golden form: event names with the block type or delta type they carry, a run of equal deltas as one."""
    out = []
    for name, data in events:
        if name == "content_block_start":
            out.append(f"start:{data['index']}:{data['content_block']['type']}")
        elif name == "content_block_delta":
            entry = f"delta:{data['index']}:{data['delta']['type']}"
            if not out or out[-1] != entry:
                out.append(entry)
        elif name == "content_block_stop":
            out.append(f"stop:{data['index']}")
        elif name == "message_delta":
            out.append(f"message_delta:{data['delta']['stop_reason']}")
        else:
            out.append(name)
    return out


def joined(events, index: int, field: str) -> str:
    return "".join(d["delta"][field] for n, d in events if n == "content_block_delta" and d["index"] == index and field in d["delta"])


# --- golden event streams ---


def test_text_stream_golden(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    events = events_of(client.post("/v1/messages", json=body(stream=True)))
    assert shape(events) == ["message_start", "ping", "start:0:thinking", "delta:0:thinking_delta", "delta:0:signature_delta",
                             "stop:0", "start:1:text", "delta:1:text_delta", "stop:1", "message_delta:end_turn", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["model"] == "claude-sonnet-4-5" and start["id"].startswith("msg_")
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": ""}]
    assert joined(events, 0, "thinking") == "Hmm." and joined(events, 1, "text") == "Hello there."
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(encode_script(tok, *TEXT_SCRIPT))
    assert final["usage"]["cache_read_input_tokens"] == 3  # the scripted engine's cached_tokens


def test_one_tool_call_stream_golden(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TOOL_SCRIPT)
    events = events_of(client.post("/v1/messages", json=body(stream=True, tools=[READ_TOOL])))
    assert shape(events)[:6] == ["message_start", "ping", "start:0:thinking", "delta:0:thinking_delta", "delta:0:signature_delta", "stop:0"]
    assert shape(events)[6] == "start:1:tool_use" and shape(events)[-3:] == ["stop:1", "message_delta:tool_use", "message_stop"]
    assert shape(events)[7:-3] == ["delta:1:input_json_delta"]
    block = [d["content_block"] for n, d in events if n == "content_block_start"][1]
    assert block["type"] == "tool_use" and block["name"] == "read" and block["input"] == {} and block["id"].startswith("toolu_")
    assert json.loads(joined(events, 1, "partial_json")) == {"path": "README.md"}


def test_two_tool_calls_stream_golden(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TWO_CALLS)
    events = events_of(client.post("/v1/messages", json=body(stream=True, tools=[READ_TOOL])))
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "tool_use", "tool_use"] and starts[1]["id"] != starts[2]["id"]
    assert [json.loads(joined(events, i, "partial_json")) for i in (1, 2)] == [{"path": "a"}, {"path": "b"}]
    assert shape(events).index("stop:1") < shape(events).index("start:2:tool_use")  # one block open at a time
    assert shape(events)[-2] == "message_delta:tool_use"


def test_cut_off_stream_golden(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    events = events_of(client.post("/v1/messages", json=body(stream=True, max_tokens=3)))
    assert shape(events)[-2:] == ["message_delta:max_tokens", "message_stop"]
    assert events[-2][1]["usage"]["output_tokens"] == 3
    assert shape(events)[-3].startswith("stop:")  # the open block is closed before message_delta


def test_call_cut_off_inside_its_arguments_sends_no_json(tiny_checkpoint, tok):
    script = encode_script(tok, *TOOL_SCRIPT)
    cut = len(encode_script(tok, *TOOL_SCRIPT[:3])) + len(tok.encode('[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": {"pa'))
    client, _ = scripted(tiny_checkpoint, tok, *TOOL_SCRIPT)
    events = events_of(client.post("/v1/messages", json=body(stream=True, tools=[READ_TOOL], max_tokens=cut)))
    assert shape(events)[-5:] == ["stop:0", "start:1:tool_use", "stop:1", "message_delta:max_tokens", "message_stop"]
    assert cut < len(script)
    message = client.post("/v1/messages", json=body(tools=[READ_TOOL], max_tokens=cut)).json()
    assert message["content"][1]["input"] == {} and message["stop_reason"] == "max_tokens"


def test_thinking_off_streams_text_only(tiny_checkpoint, tok):
    client, engine = scripted(tiny_checkpoint, tok, "START_TEXT", "Plain.", "END_TEXT", "END_OF_TURN_TOKEN")
    events = events_of(client.post("/v1/messages", json=body(stream=True, thinking={"type": "disabled"})))
    assert shape(events) == ["message_start", "ping", "start:0:text", "delta:0:text_delta", "stop:0", "message_delta:end_turn", "message_stop"]
    end_thinking = tok.token_to_id("<|END_THINKING|>")
    assert engine.seen[0][0][-1] == end_thinking  # the generation prompt closed the thinking block


# --- non-streaming ---


def test_text_message(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    reply = client.post("/v1/messages", json=body(), headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 200
    message = reply.json()
    assert message["type"] == "message" and message["role"] == "assistant" and message["model"] == "claude-sonnet-4-5"
    assert message["content"] == [{"type": "thinking", "thinking": "Hmm.", "signature": "northcode"},
                                  {"type": "text", "text": "Hello there."}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    usage = message["usage"]
    assert usage["cache_read_input_tokens"] == 3 and usage["cache_creation_input_tokens"] == 0
    assert usage["output_tokens"] == len(encode_script(tok, *TEXT_SCRIPT))


def test_a_reply_cut_off_while_thinking_still_signs_its_thinking(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    message = client.post("/v1/messages", json=body(max_tokens=2)).json()
    assert [b["type"] for b in message["content"]] == ["thinking"] and message["content"][0]["signature"] == "northcode"
    assert message["stop_reason"] == "max_tokens"


def test_tool_use_message(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TWO_CALLS)
    message = client.post("/v1/messages", json=body(tools=[READ_TOOL])).json()
    calls = [b for b in message["content"] if b["type"] == "tool_use"]
    assert [c["input"] for c in calls] == [{"path": "a"}, {"path": "b"}] and message["stop_reason"] == "tool_use"


def test_disable_parallel_tool_use_keeps_one_call(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TWO_CALLS)
    message = client.post("/v1/messages", json=body(tools=[READ_TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True})).json()
    assert [b["input"] for b in message["content"] if b["type"] == "tool_use"] == [{"path": "a"}]


def test_stop_sequence(tiny_checkpoint, tok):
    engine = StoppingEngine(tiny_checkpoint, encode_script(tok, "START_TEXT", "one two"))
    message = client_for(tiny_checkpoint, engine).post("/v1/messages", json=body(stop_sequences=["three"])).json()
    assert message["stop_reason"] == "stop_sequence" and message["stop_sequence"] == "three"
    assert engine.seen[0][1].stop == ["three"]


def test_sampling_fields_reach_the_engine(tiny_checkpoint, tok):
    client, engine = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    reply = client.post("/v1/messages", json=body(temperature=0.5, top_p=0.9, top_k=40, max_tokens=7, metadata={"user_id": "u"}))
    assert reply.status_code == 200
    sampling = engine.seen[0][1]
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.5, 0.9, 40, 7)


# --- one engine path: the same prompt ids as /v1/chat/completions ---


CHAT_MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "What is in README.md?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "# Demo"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    {"role": "user", "content": "Thanks. Now summarize."},
    {"role": "assistant", "content": "It is a demo.", "reasoning_content": "Short."},
    {"role": "user", "content": "Again?"},
]
MESSAGES_BODY = {
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": "What is in README.md?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should read it.", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "README.md"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "# Demo"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
            {"type": "text", "text": "Thanks. Now summarize."}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Short.", "signature": "x"},
                                          {"type": "text", "text": "It is a demo."}]},
        {"role": "user", "content": "Again?"},
    ],
}


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 2048}, {"type": "disabled"}])
def test_the_same_conversation_renders_the_same_ids_on_both_apis(tiny_checkpoint, tok, thinking):
    client, engine = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    chat = {"model": "m", "messages": CHAT_MESSAGES, "tools": TOOLS, "max_tokens": 4096}
    anthropic = body(**MESSAGES_BODY, tools=[READ_TOOL])
    if thinking is not None:
        anthropic["thinking"] = thinking
        chat["chat_template_kwargs"] = {"reasoning": thinking["type"] == "enabled"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert client.post("/v1/messages", json=anthropic).status_code == 200
    assert engine.seen[0][0] == engine.seen[1][0]
    tokenized = client.post("/tokenize", json=chat).json()
    counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in anthropic.items() if k != "max_tokens"}).json()
    assert counted == {"input_tokens": tokenized["count"]} and tokenized["tokens"] == engine.seen[1][0]


def test_a_system_turn_inside_messages_renders_in_place(tiny_checkpoint, tok):
    """Claude Code sends system turns among the messages (a string or text blocks): the chat path renders them in place."""
    client, engine = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Agents: none."}]}
    client.post("/v1/chat/completions", json=chat)
    for content in ("Agents: none.", [{"type": "text", "text": "Agents: "}, {"type": "text", "text": "none."}]):
        client.post("/v1/messages", json=body(messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": content}]))
    assert engine.seen[0][0] == engine.seen[1][0] == engine.seen[2][0]


def test_forced_tool_choice_matches_chat_completions(tiny_checkpoint, tok):
    client, engine = scripted(tiny_checkpoint, tok, "START_ACTION", '[\n    {"tool_call_id": "0", "tool_name": "read", '
                              '"parameters": {"path": "x"}}\n]', "END_ACTION", "END_OF_TURN_TOKEN")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "read"}}}
    client.post("/v1/chat/completions", json=chat)
    message = client.post("/v1/messages", json=body(tools=[READ_TOOL], tool_choice={"type": "tool", "name": "read"})).json()
    assert engine.seen[0][0] == engine.seen[1][0] and engine.seen[0][1].grammar == engine.seen[1][1].grammar
    assert message["content"][0]["type"] == "tool_use" and message["content"][0]["input"] == {"path": "x"}
    assert message["stop_reason"] == "tool_use"


# --- errors: a 4xx in Anthropic's shape ---


BAD_BODIES = [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, "model"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    (body(max_tokens=0), "max_tokens"),
    (body(max_tokens=True), "max_tokens"),
    (body(messages=[]), "messages"),
    (body(messages="hi"), "messages"),
    (body(messages=[{"role": "tool", "content": "hi"}]), "role"),
    (body(messages=[{"role": "user", "content": 5}]), "content"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]), "tool_use_id"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "read", "input": "x"}]}]), "input"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "read", "input": {}}]}]), "id"),
    (body(system=5), "system"),
    (body(system=[{"type": "image"}]), "system"),
    (body(tools=[{"name": "read"}]), "input_schema"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "client tools"),
    (body(tools="x"), "tools"),
    (body(tool_choice={"type": "required"}), "tool_choice"),
    (body(tool_choice={"type": "any"}), "needs tools"),
    (body(tools=[READ_TOOL], tool_choice={"type": "tool", "name": "write"}), "tool_choice.name"),
    (body(thinking={"type": "enabled"}), "budget_tokens"),
    (body(thinking={"type": "enabled", "budget_tokens": 5000}), "less than max_tokens"),
    (body(thinking={"type": "on"}), "thinking"),
    (body(temperature=1.5), "temperature"),
    (body(temperature="hot"), "temperature"),
    (body(top_p=2), "top_p"),
    (body(top_k=-1), "top_k"),
    (body(stop_sequences="x"), "stop_sequences"),
    (body(stop_sequences=[""]), "stop_sequences"),
    (body(metadata="x"), "metadata"),
    (body(stream="yes"), "stream"),
    ([1, 2], "JSON object"),
]


@pytest.mark.parametrize(("payload", "named"), BAD_BODIES)
def test_bad_input_is_a_400_in_anthropic_shape(tiny_checkpoint, tok, payload, named):
    client, engine = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT)
    reply = client.post("/v1/messages", json=payload)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"] and not engine.seen


def test_transport_errors_in_anthropic_shape(tiny_checkpoint, tok):
    client, _ = scripted(tiny_checkpoint, tok, *TEXT_SCRIPT, api_key="k")
    headers = {"x-api-key": "k", "content-type": "application/json"}
    cases = [
        (client.post("/v1/messages", json=body()), 401, "authentication_error"),
        (client.post("/v1/messages", json=body(), headers={"x-api-key": "wrong"}), 401, "authentication_error"),
        (client.post("/v1/messages", content=b"{nope", headers=headers), 400, "invalid_request_error"),
        (client.post("/v1/messages", content=b"", headers=headers), 400, "invalid_request_error"),
        (client.post("/v1/messages", content=b"[" * 100 + b"]" * 100, headers=headers), 400, "invalid_request_error"),
        (client.post("/v1/messages", content=b"x" * ((8 << 20) + 1), headers=headers), 413, "request_too_large"),
        (client.get("/v1/messages", headers=headers), 405, "invalid_request_error"),
        (client.post("/v1/messages/nothing", json=body(), headers=headers), 404, "not_found_error"),
        (client.post("/v1/messages/count_tokens", json={"model": "m"}, headers=headers), 400, "invalid_request_error"),
    ]
    for reply, status, kind in cases:
        assert reply.status_code == status, reply.text
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == kind, reply.text
        assert reply.headers["x-should-retry"] == "false"  # Claude Code retries a 401 for minutes without it
    ok = client.post("/v1/messages", json=body(), headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert ok.status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": []}).json()["error"]["type"] == "authentication_error"


def test_busy_and_context_overflow(tiny_checkpoint, tok):
    engine = ScriptedEngine(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT), max_model_len=1024)
    client = client_for(tiny_checkpoint, engine, max_batch=1, max_queue=0)
    reply = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": "word " * 3000}]))
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("prompt is too long: ")
    assert "maximum context length" in reply.json()["error"]["message"]
    client.app.state.server.admit()  # the one slot is taken
    reply = client.post("/v1/messages", json=body(messages=[{"role": "user", "content": "x"}]))
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "overloaded_error" and reply.headers["retry-after"]
    assert "x-should-retry" not in reply.headers


# --- a Claude Code-shaped round trip (the request shape claude -p 2.1.197 sent) ---


CLAUDE_CODE_CALL = ("I will run it.", "END_THINKING", "START_ACTION",
                    '[\n    {"tool_call_id": "0", "tool_name": "Bash", "parameters": {"command": "echo hi", "description": "Greet"}}\n]',
                    "END_ACTION", "END_OF_TURN_TOKEN")  # written as the template writes a past call: the next prompt repeats it
BASH_TOOL = {"name": "Bash", "description": "Executes a bash command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
                              "required": ["command"], "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}}


def claude_code_body(messages: list[dict]) -> dict:
    return {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True, "messages": messages, "tools": [BASH_TOOL],
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
                       {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
            "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'}}


def test_a_claude_code_round_trip_reads_its_first_turn_from_the_prefix(tiny_checkpoint, tok):
    client, engine = scripted(tiny_checkpoint, tok, *CLAUDE_CODE_CALL)
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-api-key": "unused"}
    messages = [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>\nToday is a day.\n</system-reminder>\n\n"},
                                             {"type": "text", "text": "run echo", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Available agent types: none."}]
    first = events_of(client.post("/v1/messages", json=claude_code_body(messages), headers=headers))
    call = next(d["content_block"] for n, d in first if n == "content_block_start" and d["content_block"]["type"] == "tool_use")
    assert json.loads(joined(first, 1, "partial_json")) == {"command": "echo hi", "description": "Greet"}
    messages += [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": joined(first, 0, "thinking"), "signature": "northcode"},
                                          {"type": "tool_use", "id": call["id"], "name": "Bash",
                                           "input": {"command": "echo hi", "description": "Greet"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "hi", "is_error": False,
                                      "cache_control": {"type": "ephemeral"}}]},
    ]
    second = client.post("/v1/messages", json=claude_code_body(messages), headers=headers)
    assert second.status_code == 200 and events_of(second)[-2][1]["delta"]["stop_reason"] == "tool_use"
    (first_prompt, _), (second_prompt, _) = engine.seen
    generated = encode_script(tok, *CLAUDE_CODE_CALL)
    assert second_prompt[: len(first_prompt) + len(generated)] == first_prompt + generated  # a whole-prefix cache hit
