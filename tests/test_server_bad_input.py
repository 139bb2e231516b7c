"""No request can hurt another (issue 24): hostile or malformed input is a 4xx, never a 500.

Each case of a body that used to crash a handler (deep nesting, lone surrogates, numbers a float
cannot hold, NaN tokens, malformed response_format, template arguments in chat_template_kwargs,
a client hanging up mid-body, an oversized body) gets a 4xx in the OpenAI error shape; every body
and SSE event the server writes parses as strict JSON (no NaN, no Infinity); and a 4xx leaves the
connection usable, checked on a real uvicorn server with one pooled httpx client.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time

import httpx
import pytest
from starlette.testclient import TestClient
from northcode_serve_process import running_server
from test_server import TEXT_SCRIPT, ScriptedEngine, chat_body, encode_script

from northcode.engine.request import TokenLogprob
from northcode.server.app import create_app
from northcode.server.request_body import MAX_BODY_BYTES
from northcode.server.state import ServerOptions, ServerState

# --- strict JSON and the error shape ---


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_loads(text: str | bytes):
    """json.loads that refuses NaN, Infinity and -Infinity, as a browser's or Go's JSON parser does."""
    return json.loads(text, parse_constant=_no_constants)


def strict_events(text: str) -> list:
    """The SSE events of a stream, each parsed strictly; [DONE] stays a string."""
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else strict_loads(data))
    return events


def assert_openai_error(response, status: int | None = None) -> dict:
    """A 4xx with the OpenAI error body {"error": {message, type, param, code}}; returns the error."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, response.text[:500]
    error = strict_loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("authentication_error" if response.status_code == 401 else "invalid_request_error"), error
    return error


# --- the bodies ---


def nested_array(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


def nested_object(levels: int) -> dict:
    """A JSON schema whose objects nest `levels` deep (a schema level is two: the schema and its properties)."""
    value: dict = {"type": "string"}
    for _ in range(levels // 2):
        value = {"type": "object", "properties": {"a": value}}
    return value


def raw_chat(extra: str = "", content: str = '"hi"') -> bytes:
    """A chat body as JSON text, so that it can hold what json.dumps would never write."""
    return ('{"model": "x", "messages": [{"role": "user", "content": ' + content + "}]" + extra + "}").encode()


def with_tool_schema(schema_text: str) -> bytes:
    tool = '[{"type": "function", "function": {"name": "read", "parameters": ' + schema_text + "}}]"
    return raw_chat(', "tools": ' + tool)


def call_history(arguments) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": arguments}}
    return chat_body(messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "c1", "content": "ok"}])


DEEP = 600  # "hundreds deep": past what the template and its tojson could recurse through
BAD_BODIES = {  # name -> (raw body, the param the 400 names)
    "JSON nested 1,000 levels": (raw_chat(', "extra": ' + nested_array(1000)), None),
    "JSON nested 100,000 levels": (raw_chat(', "extra": ' + nested_array(100_000)), None),
    "lone surrogate in content": (raw_chat(content='"a\\ud800b"'), "messages[0].content"),
    "lone low surrogate in a tool name": (raw_chat(', "tools": [{"type": "function", "function": {"name": "r\\udc00"}}]'),
                                          "tools[0].function.name"),
    "lone surrogate in an object key": (raw_chat(', "chat_template_kwargs": {"\\ud83d": 1}'), "chat_template_kwargs"),
    "integer too large for a float: temperature": (raw_chat(', "temperature": 1' + "0" * 400), "temperature"),
    "integer too large for a float: top_p": (raw_chat(', "top_p": -1' + "0" * 400), "top_p"),
    "integer too large for a float: presence_penalty": (raw_chat(', "presence_penalty": 1' + "0" * 400), "presence_penalty"),
    "integer past 64 bits: seed": (raw_chat(', "seed": 1' + "0" * 40), "seed"),
    "integer past 64 bits: top_k": (raw_chat(', "top_k": 1' + "0" * 40), "top_k"),
    "bare NaN in a tool schema": (with_tool_schema('{"type": "object", "default": NaN}'), None),
    "bare Infinity in a tool schema": (with_tool_schema('{"type": "object", "maximum": Infinity}'), None),
    "bare -Infinity in temperature": (raw_chat(', "temperature": -Infinity'), None),
    "bare NaN in temperature": (raw_chat(', "temperature": NaN'), None),
    "a float literal past a double: 1e400": (with_tool_schema('{"type": "number", "maximum": 1e400}'), None),
    "response_format.json_schema a string": (raw_chat(', "response_format": {"type": "json_schema", "json_schema": "x"}'),
                                             "response_format.json_schema"),
    "response_format.json_schema an array": (raw_chat(', "response_format": {"type": "json_schema", "json_schema": ["x"]}'),
                                             "response_format.json_schema"),
    "response_format.json_schema.schema a number": (
        raw_chat(', "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 5}}'),
        "response_format.json_schema.schema"),
    "response_format.type an object": (raw_chat(', "response_format": {"type": {"a": 1}}'), "response_format.type"),
    **{f"chat_template_kwargs.{key}": (raw_chat(', "chat_template_kwargs": {"' + key + '": 1}'), f"chat_template_kwargs.{key}")
       for key in ("messages", "tools", "documents", "add_generation_prompt", "tokenizer")},
    f"a tool schema nested {DEEP} deep": (json.dumps(chat_body(tools=[{"type": "function", "function": {
        "name": "read", "parameters": nested_object(DEEP)}}])).encode(), "tools[0].function.parameters"),
    f"tool-call arguments (JSON text) nested {DEEP} deep": (json.dumps(call_history(json.dumps(nested_object(DEEP)))).encode(),
                                                            "messages[1].tool_calls[0].function.arguments"),
    f"tool-call arguments (an object) nested {DEEP} deep": (json.dumps(call_history(nested_object(DEEP))).encode(),
                                                            "messages[1].tool_calls[0].function.arguments"),
    f"a response_format schema nested {DEEP} deep": (json.dumps(chat_body(response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": nested_object(DEEP)}})).encode(),
        "response_format.json_schema.schema"),
    "min_tokens above max_tokens": (raw_chat(', "max_tokens": 4, "min_tokens": 5'), "min_tokens"),
    "min_tokens negative": (raw_chat(', "min_tokens": -1'), "min_tokens"),
    "ignore_eos a string": (raw_chat(', "ignore_eos": "yes"'), "ignore_eos"),
    f"chat_template_kwargs nested {DEEP} deep": (json.dumps(chat_body(chat_template_kwargs={
        "platform_instruction_override": nested_object(DEEP)})).encode(), "chat_template_kwargs.platform_instruction_override"),
}


@pytest.fixture(scope="module")
def app(tiny_checkpoint, tok):
    engine = ScriptedEngine(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))
    return create_app(ServerState(ServerOptions(), engine=engine))


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    from northcode.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, raise_server_exceptions=False)


def post_raw(client, path: str, body: bytes):
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_input_is_a_400_naming_the_parameter(client, name):
    body, param = BAD_BODIES[name]
    error = assert_openai_error(post_raw(client, "/v1/chat/completions", body), 400)
    if param is not None:
        assert error["param"] == param, error
    assert client.get("/health").status_code == 200


def test_min_tokens_and_ignore_eos_reach_the_engine(app, client):
    assert client.post("/v1/chat/completions", json=chat_body(min_tokens=3, ignore_eos=True)).status_code == 200
    sampling = app.state.server.engine.seen[-1][1]
    assert (sampling.min_tokens, sampling.ignore_eos) == (3, True)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 2**64 - 1])
def test_signed_and_unsigned_64_bit_seeds_are_accepted(client, seed):
    assert client.post("/v1/chat/completions", json=chat_body(seed=seed)).status_code == 200


@pytest.mark.parametrize("name", ["JSON nested 1,000 levels", "lone surrogate in content", "bare NaN in a tool schema",
                                  f"a tool schema nested {DEEP} deep", "chat_template_kwargs.tokenizer"])
def test_tokenize_refuses_the_same_bodies(client, name):
    assert_openai_error(post_raw(client, "/tokenize", BAD_BODIES[name][0]), 400)


@pytest.mark.parametrize("body", [
    b'{"prompt": "a\\udfffb"}',
    b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
    b'{"prompt": "x", "logit_bias": {"1": NaN}}',
    b'{"prompt": ' + nested_array(5000).encode() + b"}",
], ids=["surrogate", "huge temperature", "NaN", "deep prompt"])
def test_completions_refuse_them_too(client, body):
    assert_openai_error(post_raw(client, "/v1/completions", body), 400)


@pytest.mark.parametrize("declared", [False, True], ids=["streamed", "Content-Length"])
def test_an_oversized_body_is_refused_without_reading_it_all(declared):
    """An endless body is refused once it passes the limit; a declared one before a byte is read."""
    import asyncio

    from starlette.requests import Request

    from northcode.server.errors import RequestError
    from northcode.server.request_body import read_body

    chunk, reads = b"x" * (1 << 20), []

    async def receive():
        reads.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": True}

    headers = [(b"content-length", str(4 * MAX_BODY_BYTES).encode())] if declared else []
    with pytest.raises(RequestError) as refused:
        asyncio.run(read_body(Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)))
    assert refused.value.status == 413
    assert sum(reads) == (0 if declared else MAX_BODY_BYTES + len(chunk))


def test_a_body_over_the_limit_is_a_413_typed_invalid_request(client):
    body = raw_chat(', "pad": "' + "x" * (MAX_BODY_BYTES + 1) + '"')
    error = assert_openai_error(post_raw(client, "/v1/chat/completions", body), 413)
    assert str(MAX_BODY_BYTES) in error["message"]


# --- strict JSON out: logprobs of -inf (and NaN, from a broken distribution) ---


class NonFiniteLogprobEngine(ScriptedEngine):
    """Every token comes with logprob -inf and an alternative whose logprob is NaN."""

    async def generate(self, request_id, prompt_ids, sampling):
        async for out in super().generate(request_id, prompt_ids, sampling):
            out.logprobs = [TokenLogprob(t, -math.inf, [(t, -math.inf), (t + 1, math.nan)]) for t in out.token_ids]
            yield out


@pytest.fixture(scope="module")
def logprob_client(tiny_checkpoint, tok):
    engine = NonFiniteLogprobEngine(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))
    return TestClient(create_app(ServerState(ServerOptions(), engine=engine)))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_are_finite_strict_json(logprob_client, stream):
    response = logprob_client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, stream=stream))
    assert response.status_code == 200
    if stream:
        chunks = [e for e in strict_events(response.text)[:-1] if e["choices"] and e["choices"][0]["logprobs"]]
        entries = [entry for c in chunks for entry in c["choices"][0]["logprobs"]["content"]]
    else:
        entries = strict_loads(response.content)["choices"][0]["logprobs"]["content"]
    assert entries and all(e["logprob"] == -9999.0 for e in entries)
    assert all([t["logprob"] for t in e["top_logprobs"]] == [-9999.0, -9999.0] for e in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_finite_strict_json(logprob_client, stream):
    response = logprob_client.post("/v1/completions", json={"prompt": "x", "logprobs": 2, "stream": stream})
    assert response.status_code == 200
    if stream:
        events = strict_events(response.text)
        logprobs = [e["choices"][0]["logprobs"] for e in events[:-1] if e["choices"][0]["logprobs"]]
    else:
        logprobs = [strict_loads(response.content)["choices"][0]["logprobs"]]
    values = [v for lp in logprobs for v in lp["token_logprobs"]] + [v for lp in logprobs for top in lp["top_logprobs"]
                                                                      for v in top.values()]
    assert values and set(values) == {-9999.0}


LINE_BREAKS_TEXT = "a\u2028b\x85c\u2029d"  # line breaks to str.splitlines that JSON leaves raw, but not to SSE


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", chat_body(stream=True)),
                                        ("/v1/responses", {"input": "hi", "stream": True})])
def test_every_event_is_one_line_to_a_splitlines_reader(tiny_checkpoint, tok, path, body):
    """httpx's aiter_lines splits as str.splitlines does: each data line must still hold a whole JSON event."""
    script = encode_script(tok, "Hmm.", "END_THINKING", "START_TEXT", LINE_BREAKS_TEXT, "END_TEXT", "END_OF_TURN_TOKEN")
    client = TestClient(create_app(ServerState(ServerOptions(), engine=ScriptedEngine(tiny_checkpoint, script))))
    response = client.post(path, json=body)
    assert response.status_code == 200
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    events = [strict_loads(d) for d in data if d != "[DONE]"]
    text = "".join(json.dumps(e, ensure_ascii=False) for e in events)
    assert events and "\u2028" in text and "\x85" in text and "\u2029" in text  # the text arrived, as text


# --- a real server: keep-alive after a 4xx, a client that hangs up mid-body ---


@pytest.fixture(scope="module")
def server_url(app):
    with running_server(app) as url:
        yield url


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


KEEP_ALIVE_CASES = ["JSON nested 1,000 levels", "lone surrogate in content", "integer too large for a float: temperature",
                    "response_format.json_schema a string", "chat_template_kwargs.messages", f"a tool schema nested {DEEP} deep"]


@pytest.mark.parametrize("name", KEEP_ALIVE_CASES)
def test_the_connection_stays_usable_after_a_4xx(server_url, name):
    with httpx.Client(base_url=server_url, timeout=30) as http:
        bad = http.post("/v1/chat/completions", content=BAD_BODIES[name][0], headers={"content-type": "application/json"})
        assert_openai_error(bad, 400)
        good = http.post("/v1/chat/completions", json=chat_body())
        assert good.status_code == 200
        assert local_port(good) == local_port(bad), "the server closed the connection after the 4xx"


def test_the_connection_stays_usable_after_a_413(server_url):
    with httpx.Client(base_url=server_url, timeout=30) as http:
        bad = http.post("/v1/chat/completions", content=b"x" * (MAX_BODY_BYTES + 1), headers={"content-type": "application/json"})
        assert_openai_error(bad, 413)
        good = http.post("/v1/chat/completions", json=chat_body())
        assert good.status_code == 200 and local_port(good) == local_port(bad)


class FailingEngine(ScriptedEngine):
    """A bug in the engine for requests with seed 666: generate raises before its first output."""

    async def generate(self, request_id, prompt_ids, sampling):
        if sampling.seed == 666:
            raise RuntimeError("a bug")
        async for out in super().generate(request_id, prompt_ids, sampling):
            yield out


def test_an_unexpected_error_is_one_500_logged_once_and_the_connection_stays_usable(tiny_checkpoint, tok, caplog):
    engine = FailingEngine(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))
    with running_server(create_app(ServerState(ServerOptions(), engine=engine))) as url, \
            httpx.Client(base_url=url, timeout=30) as http, caplog.at_level(logging.WARNING):
        failed = http.post("/v1/chat/completions", json=chat_body(seed=666))
        assert failed.status_code == 500
        error = strict_loads(failed.content)["error"]
        assert error["type"] == "server_error" and "RuntimeError: a bug" in error["message"]
        good = http.post("/v1/chat/completions", json=chat_body())
        assert good.status_code == 200 and local_port(good) == local_port(failed)
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1  # ours, with the traceback


def request_count(server_url: str, path: str, status: int) -> float:
    pattern = f'northcode_requests_total{{endpoint="{path}",status="{status}"}} '
    lines = [line for line in httpx.get(server_url + "/metrics").text.splitlines() if line.startswith(pattern)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_a_client_hanging_up_mid_body_is_no_error(server_url, caplog):
    """No traceback in the log, no 500 in /metrics: the request is counted as 499 (client closed request)."""
    host, port = server_url.removeprefix("http://").split(":")
    before = request_count(server_url, "/v1/chat/completions", 499)
    with caplog.at_level(logging.WARNING), socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n" + b'{"model": "x", "messages": [{"role": "user", "content": "')
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while request_count(server_url, "/v1/chat/completions", 499) == before:
        assert time.monotonic() < deadline, "the hang-up was never counted as 499"
        time.sleep(0.05)
    assert request_count(server_url, "/v1/chat/completions", 500) == 0
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert httpx.get(server_url + "/health").status_code == 200
