"""Property-based fuzzing of the HTTP boundary (issue 24, point 6): no body can hurt the server.

Hypothesis generates request bodies from the shape of the OpenAI requests (chat, completions,
tokenize, detokenize), then mutates them: a field replaced by any JSON value, a field dropped, the
JSON text cut short, a number turned into NaN/Infinity/1e400, a lone surrogate or deep nesting
slipped in. For every body: the status is below 500, a 4xx carries the OpenAI error shape, every
body and SSE event is strict JSON, /health still answers 200, and no admission slot leaks. The
engine is test_server's ScriptedEngine (the HTTP layer is what is fuzzed), replaying a tool call
with logprobs of -inf. The example budget is fixed and derandomized, so CI runs the same bodies.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from test_server import TOOL_SCRIPT, encode_script
from test_server_bad_input import NonFiniteLogprobEngine, assert_openai_error, strict_events, strict_loads

from northcode.server.app import create_app
from northcode.server.state import ServerOptions, ServerState

FUZZ = settings(max_examples=1500, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- values ---

text = st.text(max_size=12) | st.sampled_from(["", "read", "<|END_OF_TURN_TOKEN|>", "<|START_ACTION|>", "none", "auto"])
numbers = (st.integers(-3, 3) | st.floats(-5, 5) | st.sampled_from([0, 1, 1e-39, 1e-300, 2**63, -(2**63) - 1, 10**400, 1e308])
           | st.floats(allow_nan=False, allow_infinity=False))
scalars = st.none() | st.booleans() | numbers | text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                           max_leaves=8)

# --- request bodies as a client would send them (mostly valid; the mutations below break them) ---

content = text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2)
arguments = st.sampled_from(['{"path": "a"}', '{"path": "REA', "null", "", '{"a": NaN}', '{"a": "\\ud800"}']) | st.dictionaries(
    text, json_values, max_size=2)
schema = st.fixed_dictionaries({"type": st.just("object")}, optional={"properties": st.dictionaries(text, json_values, max_size=2)})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["read", "bash"])}, optional={"description": text | st.none(), "parameters": schema})})


@st.composite
def conversations(draw) -> list[dict]:
    """A system prompt or not, a user turn, then round trips: calls, their results (in any order), answers."""
    messages = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]), "content": content}),
                             max_size=1))
    messages.append({"role": "user", "content": draw(content)})
    for turn in range(draw(st.integers(0, 2))):
        ids = draw(st.lists(st.sampled_from(["c1", "c2", "call_x", f"t{turn}"]), min_size=1, max_size=2, unique=True))
        calls = [{"id": i, "type": "function", "function": {"name": draw(st.sampled_from(["read", "bash"])),
                                                             "arguments": draw(arguments)}} for i in ids]
        messages.append({"role": "assistant", "content": draw(st.none() | text), "tool_calls": calls,
                         **draw(st.fixed_dictionaries({}, optional={"reasoning_content": text}))})
        messages += [{"role": "tool", "tool_call_id": i, "content": draw(content)} for i in draw(st.permutations(ids))]
        messages += draw(st.lists(st.fixed_dictionaries({"role": st.just("assistant"), "content": text}), max_size=1))
    return messages


SAMPLING = {
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-39, 1e-300]), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "max_tokens": st.integers(1, 40), "stop": text | st.lists(text, max_size=3), "stream": st.booleans(), "user": text,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
response_format = st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": text}, optional={"schema": schema})}) | st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
template_kwargs = st.fixed_dictionaries({}, optional={
    "reasoning": st.booleans(), "enable_thinking": st.booleans(), "regen_tool_call_ids": st.booleans(),
    "skip_thinking": st.booleans(), "platform_instruction_override": text})
chat_body = st.fixed_dictionaries({"messages": conversations()}, optional={
    **SAMPLING, "model": text, "tools": st.lists(tool, max_size=2), "parallel_tool_calls": st.booleans(),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | st.just({"type": "function", "function": {"name": "read"}}),
    "response_format": response_format, "chat_template_kwargs": template_kwargs,
    "reasoning_effort": st.sampled_from(["none", "low", "high"]), "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3)})
completion_body = st.fixed_dictionaries({"prompt": text.filter(bool) | st.lists(st.integers(0, 1023), min_size=1, max_size=5)},
                                        optional={**SAMPLING, "echo": st.booleans(), "logprobs": st.integers(0, 3)})
tokenize_body = chat_body | st.fixed_dictionaries({"prompt": text}, optional={"add_special_tokens": st.booleans()})
detokenize_body = st.fixed_dictionaries({"tokens": st.lists(st.integers(0, 1023), max_size=6)})

# --- mutations of a body ---


def paths_of(value, path=()):
    """Every path into a parsed JSON value, the root included."""
    yield path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from paths_of(child, (*path, key))


def replaced(value, path: tuple, new):
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = replaced(value[path[0]], path[1:], new)
    return copy


def dropped(value, path: tuple):
    if len(path) == 1:
        copy = dict(value) if isinstance(value, dict) else list(value)
        del copy[path[0]]
        return copy
    return replaced(value, path[:1], dropped(value[path[0]], path[1:]))


NASTY_VALUES = st.sampled_from([[[[[[[[[[1]]]]]]]]], "a\ud800b", "\udfff", 10**400, -(10**400), 2**64, 1e-39, "", [], {},
                                {"type": "object", "properties": {"a": {"a": {"a": {"a": {"a": {"a": {}}}}}}}}])


@st.composite
def mutated(draw, bodies) -> bytes:
    """A body as JSON text, mutated one or two ways (or not at all)."""
    body = draw(bodies)
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        paths = list(paths_of(body))
        path = draw(st.sampled_from(paths))
        kind = draw(st.sampled_from(["replace", "nasty", "drop", "deep"]))
        if kind == "replace":
            body = replaced(body, path, draw(json_values))
        elif kind == "nasty":
            body = replaced(body, path, draw(NASTY_VALUES))
        elif kind == "drop" and path:
            body = dropped(body, path)
        elif kind == "deep":
            levels = draw(st.sampled_from([63, 64, 65, 300, 2000]))
            body = replaced(body, path, json.loads("[" * levels + "]" * levels) if levels < 900 else "DEEP")
    raw = json.dumps(body)  # ensure_ascii: a lone surrogate travels as a \\udXXX escape, as a client sends it
    raw = raw.replace('"DEEP"', "[" * 2000 + "]" * 2000)
    kind = draw(st.sampled_from(["as it is"] * 5 + ["cut short", "a constant", "trailing text"]))
    if kind == "cut short":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    return {"as it is": raw, "a constant": _with_constant(raw, draw), "trailing text": raw + " x"}[kind]


def _with_constant(raw: str, draw) -> str:
    """The first number-like spot (after a colon) turned into a token Python's json accepts and JSON does not."""
    constant = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999"]))
    return raw.replace(": 0", f": {constant}", 1).replace(": 1", f": {constant}", 1)


# --- the property ---


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    from northcode.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_checkpoint)
    engine = NonFiniteLogprobEngine(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    state = ServerState(ServerOptions(max_batch=2, max_queue=2), engine=engine)
    return TestClient(create_app(state), raise_server_exceptions=False), state


def check_response(client: TestClient, state: ServerState, path: str, raw: bytes | str) -> None:
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, (path, raw[:300], response.text[:500])
    if response.status_code >= 400:
        event(f"{response.status_code} {assert_openai_error(response)['param']}")  # --hypothesis-show-statistics
    elif response.headers["content-type"].startswith("text/event-stream"):
        event("200 stream")
        assert strict_events(response.text)[-1] == "[DONE]"
    else:
        event("200")
        strict_loads(response.content)
    assert client.get("/health").status_code == 200
    assert state.in_flight == 0, "a request left its admission slot taken"


@FUZZ
@given(raw=mutated(chat_body))
def test_chat_completions_never_fail_on_input(served, raw):
    check_response(*served, "/v1/chat/completions", raw)


@settings(FUZZ, max_examples=400)
@given(raw=mutated(completion_body))
def test_completions_never_fail_on_input(served, raw):
    check_response(*served, "/v1/completions", raw)


@settings(FUZZ, max_examples=300)
@given(raw=mutated(tokenize_body))
def test_tokenize_never_fails_on_input(served, raw):
    check_response(*served, "/tokenize", raw)


@settings(FUZZ, max_examples=150)
@given(raw=mutated(detokenize_body))
def test_detokenize_never_fails_on_input(served, raw):
    check_response(*served, "/detokenize", raw)
