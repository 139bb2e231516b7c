"""Property-based fuzzing of /v1/messages and /v1/messages/count_tokens: no body can hurt the server.

Bodies are drawn from the shape of Anthropic Messages requests (system blocks, text, thinking,
tool_use and tool_result blocks, tools, tool_choice, thinking, sampling), then mutated the way
test_server_fuzz.py mutates chat bodies. For every body: the status is below 500, a 4xx carries
Anthropic's error shape, every SSE event is strict JSON named by its type, /health still answers and
no admission slot leaks. The example budget is fixed and derandomized, so CI runs the same bodies.
"""

from __future__ import annotations

import json

from hypothesis import event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from test_server_bad_input import strict_loads
from test_server_fuzz import FUZZ, json_values, mutated, served, text  # noqa: F401 (served: the fixture, shared)

from northcode.server.state import ServerState

text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text},
                                   optional={"cache_control": st.just({"type": "ephemeral"})})
blocks_or_text = text | st.lists(text_block, max_size=2)
schema = st.fixed_dictionaries({"type": st.just("object")}, optional={"properties": st.dictionaries(text, json_values, max_size=2)})
tool = st.fixed_dictionaries({"name": st.sampled_from(["read", "bash"]), "input_schema": schema},
                             optional={"description": text, "type": st.just("custom")})


@st.composite
def conversations(draw) -> list[dict]:
    """A user turn, then round trips: tool_use blocks, their tool_result blocks (any order), answers, system turns."""
    messages = [{"role": "user", "content": draw(blocks_or_text)}]
    for turn in range(draw(st.integers(0, 2))):
        ids = draw(st.lists(st.sampled_from(["toolu_1", "toolu_2", f"t{turn}"]), min_size=1, max_size=2, unique=True))
        uses = [{"type": "tool_use", "id": i, "name": draw(st.sampled_from(["read", "bash"])),
                 "input": draw(st.dictionaries(text, json_values, max_size=2))} for i in ids]
        thinking = draw(st.lists(st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": text}), max_size=1))
        messages.append({"role": "assistant", "content": thinking + draw(st.lists(text_block, max_size=1)) + uses})
        results = [{"type": "tool_result", "tool_use_id": i, **draw(st.fixed_dictionaries({}, optional={
            "content": blocks_or_text, "is_error": st.booleans()}))} for i in draw(st.permutations(ids))]
        messages.append({"role": "user", "content": results + draw(st.lists(text_block, max_size=1))})
        messages += draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["assistant", "system"]), "content": blocks_or_text}),
                                  max_size=1))
    return messages


tool_choice = st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])},
                                    optional={"disable_parallel_tool_use": st.booleans()}) | st.just({"type": "tool", "name": "read"})
thinking = st.just({"type": "disabled"}) | st.just({"type": "adaptive"}) | st.fixed_dictionaries(
    {"type": st.just("enabled"), "budget_tokens": st.integers(1000, 2000)})
messages_body = st.fixed_dictionaries({"model": text, "max_tokens": st.integers(1, 40), "messages": conversations()}, optional={
    "system": blocks_or_text, "tools": st.lists(tool, max_size=2), "tool_choice": tool_choice, "thinking": thinking,
    "stop_sequences": st.lists(text, max_size=2), "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50), "metadata": st.fixed_dictionaries({}, optional={"user_id": text}), "stream": st.booleans()})


def check_response(client: TestClient, state: ServerState, path: str, raw: str) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json", "anthropic-version": "2023-06-01"})
    assert response.status_code < 500, (path, raw[:300], response.text[:500])
    if response.status_code >= 400:
        error = strict_loads(response.content)
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, response.text
        event(f"{response.status_code} {error['error']['type']}")
    elif response.headers["content-type"].startswith("text/event-stream"):
        frames = [f for f in response.text.split("\n\n") if f]
        names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
        datas = [strict_loads(f.split("\n")[1].removeprefix("data: ").encode()) for f in frames]
        assert [d["type"] for d in datas] == names and names[0] == "message_start" and names[-1] == "message_stop"
        event("200 stream")
    else:
        reply = strict_loads(response.content)
        assert set(reply) == ({"input_tokens"} if path.endswith("count_tokens") else
                              {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"})
        event("200")
    assert client.get("/health").status_code == 200
    assert state.in_flight == 0, "a request left its admission slot taken"


@settings(FUZZ, max_examples=600)
@given(raw=mutated(messages_body))
def test_messages_never_fail_on_input(served, raw):
    check_response(*served, "/v1/messages", raw)


@settings(FUZZ, max_examples=150)
@given(raw=mutated(messages_body))
def test_count_tokens_never_fails_on_input(served, raw):
    check_response(*served, "/v1/messages/count_tokens", raw)


def test_the_strategy_makes_valid_bodies(served):
    """Unmutated, the drawn bodies are mostly served (the fuzzing starts from requests that work)."""
    client, _ = served
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"name": "read", "input_schema": {"type": "object"}}], "tool_choice": {"type": "auto"}}
    assert client.post("/v1/messages", content=json.dumps(body)).status_code == 200
