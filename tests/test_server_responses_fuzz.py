"""Property-based fuzzing of POST /v1/responses, with test_server_fuzz's mutations: no body can hurt the server.

Bodies are drawn from the shape of Responses requests (input as a string or items: messages, reasoning,
function calls and their outputs, in any order; function, namespace and other tools; tool_choice,
reasoning, text.format, max_output_tokens, store, previous_response_id), then mutated. For every body:
the status is below 500, a 4xx carries the OpenAI error shape, a stream is `event:`/`data:` pairs of
strict JSON ending in a terminal event, /health still answers 200, and no admission slot leaks.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_server_bad_input import assert_openai_error, strict_loads
from test_server_fuzz import FUZZ, json_values, mutated, schema, served, text  # noqa: F401 (served: a fixture)

TERMINAL = ("response.completed", "response.incomplete", "response.failed")

parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": text}), max_size=2)
arguments_text = st.sampled_from(['{"path": "a"}', '{"path": "REA', "null", "", '{"a": NaN}', '{"a": "\\ud800"}', "[1]"])
call_id = st.sampled_from(["c1", "c2", "call_x"])
item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]), "content": text | parts},
                          optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.just([])},
                          optional={"content": st.lists(st.fixed_dictionaries({"type": st.just("reasoning_text"), "text": text}),
                                                        max_size=1), "encrypted_content": st.none()}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": call_id, "name": st.sampled_from(["read", "spawn"]),
                           "arguments": arguments_text}, optional={"status": st.just("completed")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": call_id, "output": text | parts}),
)
function_tool = st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["read", "bash"])},
                                      optional={"description": text, "parameters": schema, "strict": st.booleans()})
tools = st.lists(function_tool | st.fixed_dictionaries({"type": st.just("namespace"), "name": text,
                                                        "tools": st.lists(function_tool, max_size=2)})
                 | st.fixed_dictionaries({"type": st.sampled_from(["web_search", "custom", "local_shell"])}), max_size=3)
text_formats = st.sampled_from([{"type": "text"}, {"type": "json_object"},
                                {"type": "json_schema", "name": "x", "schema": {"type": "object"}}])
responses_without_previous = st.fixed_dictionaries({"input": text | st.lists(item, max_size=5), "stream": st.booleans()},
                                                   optional={
    "model": text, "instructions": text, "tools": tools, "parallel_tool_calls": st.booleans(),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.just({"type": "function", "name": "read"}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "high"]),
                                                     "summary": st.sampled_from(["auto", None])}),
    "text": st.fixed_dictionaries({"format": text_formats}),
    "max_output_tokens": st.integers(1, 40), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "store": st.booleans(), "include": json_values, "metadata": json_values, "prompt_cache_key": text})
responses_body = st.tuples(responses_without_previous, st.sampled_from([False] * 7 + [True])).map(  # 1 in 8: an unknown
    lambda drawn: {**drawn[0], "previous_response_id": "resp-gone"} if drawn[1] else drawn[0])  # previous_response_id


def stream_types(body: str) -> list[str]:
    types = []
    for block in body.split("\n\n"):
        if block.strip():
            event_line, data_line = block.split("\n")
            data = strict_loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {data['type']}" and data["sequence_number"] == len(types)
            types.append(data["type"])
    return types


@settings(FUZZ, max_examples=600)
@given(raw=mutated(responses_body))
def test_responses_never_fail_on_input(served, raw):
    client, state = served
    response = client.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (raw[:300], response.text[:500])
    if response.status_code >= 400:
        event(f"{response.status_code} {assert_openai_error(response)['param']}")  # --hypothesis-show-statistics
    elif response.headers["content-type"].startswith("text/event-stream"):
        event("200 stream")
        assert stream_types(response.text)[-1] in TERMINAL
    else:
        event("200")
        assert strict_loads(response.content)["status"] in ("completed", "incomplete")
    assert client.get("/health").status_code == 200
    assert state.in_flight == 0, "a request left its admission slot taken"
