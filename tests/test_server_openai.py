"""A real uvicorn server on loopback, the real engine on the tiny checkpoint, the official openai client.

Module fixture: the server loads the model the way `northcode serve` does (background thread),
then serves on a free port. Greedy requests make outputs comparable: streaming vs not, 8 at once
vs one by one. The weights are random, so the tests check structure, equalities and counts,
never the wording. One test runs `northcode serve` itself as a subprocess (health, key, snippet).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from northcode_serve_process import running_server

from northcode.engine.settings import EngineSettings
from northcode.server.app import create_app
from northcode.server.state import ServerOptions, ServerState

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    state = ServerState(ServerOptions(max_batch=8, max_queue=8))
    state.load_in_background(tiny_checkpoint, EngineSettings(max_batch=8, num_pages=512, seed=0)).join()
    assert state.ready, state.load_error
    with running_server(create_app(state)) as url:
        yield SimpleNamespace(url=url, state=state)
    state.engine.shutdown()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def collect_stream(stream) -> dict:
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            assert chunk.choices == []
            out["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = out["calls"].setdefault(call["index"], {"id": call["id"], "name": call["function"]["name"], "arguments": ""})
                entry["arguments"] += call["function"]["arguments"] or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_chat_non_streaming_and_streaming_agree(client):
    kwargs = dict(model="north-mini-code", messages=messages("Write a haiku about caches."), max_tokens=24, **GREEDY)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message.model_dump()
    assert full.object == "chat.completion" and full.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 0
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    assert full.usage.completion_tokens_details.reasoning_tokens <= full.usage.completion_tokens
    streamed = collect_stream(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert streamed["content"] == (message["content"] or "")
    assert streamed["reasoning"] == (message.get("reasoning_content") or "")
    assert streamed["finish"] == full.choices[0].finish_reason
    assert streamed["usage"].completion_tokens == full.usage.completion_tokens
    assert "<|" not in streamed["content"] + streamed["reasoning"]


def test_completions_non_streaming_and_streaming(client):
    kwargs = dict(model="north-mini-code", prompt="def fibonacci(n):", max_tokens=16, **GREEDY)
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion" and full.usage.completion_tokens <= 16
    text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert text == full.choices[0].text


def test_cached_tokens_rise_on_a_repeated_prompt(client):
    long_text = "Explain the following code in detail. " + " ".join(f"line {i}: x{i} = x{i - 1} + {i}" for i in range(60))
    first = client.chat.completions.create(model="m", messages=messages(long_text), max_tokens=2, **GREEDY)
    second = client.chat.completions.create(model="m", messages=messages(long_text), max_tokens=2, **GREEDY)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 64  # at least one whole page reused


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model="m", prompt="Once upon a time", max_tokens=20, temperature=1.0, seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(1), sample(2), sample(3)}) > 1  # the seed does steer sampling


def test_stop_string_cuts_the_output(client):
    base = client.completions.create(model="m", prompt="The list:", max_tokens=24, **GREEDY).choices[0].text
    assert len(base) > 8
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    cut = client.completions.create(model="m", prompt="The list:", max_tokens=24, stop=[stop], **GREEDY)
    assert cut.choices[0].text == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs(client):
    chat = client.chat.completions.create(model="m", messages=messages("hi"), max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert content and all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert all(entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4) for entry in content)  # greedy: the best one
    text = client.completions.create(model="m", prompt="x = ", max_tokens=5, logprobs=2, **GREEDY)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5 and all(len(t) <= 2 for t in logprobs.top_logprobs)


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": messages("hi"), "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"prompt": "x = ", "logprobs": 3}),
], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tiny_temperature_still_gives_strict_json(server, path, body, stream):
    """temperature 1e-39 once turned every logit into inf and the logprobs into NaN: a 500, or bare NaN in
    an SSE event. Every body and event must parse with a strict parser (no NaN, no Infinity)."""
    response = httpx.post(server.url + path, json={**body, "model": "m", "max_tokens": 6, "temperature": 1e-39,
                                                   "stream": stream}, timeout=60)
    assert response.status_code == 200, response.text
    blocks = [b.removeprefix("data: ") for b in response.text.split("\n\n") if b.strip()] if stream else [response.text]
    assert blocks and all(json.loads(b, parse_constant=_no_constants) for b in blocks if b != "[DONE]")


def test_eight_concurrent_streams_equal_sequential(server, client):
    prompts = [f"Task {i}: explain {word}" for i, word in enumerate("paging caching batching routing sampling tokens kernels graphs".split())]
    kwargs = dict(model="m", max_tokens=20, **GREEDY)
    sequential = [collect_stream(client.chat.completions.create(messages=messages(p), stream=True, **kwargs)) for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def one(prompt):
        out = {"content": "", "reasoning": "", "calls": {}}
        async for chunk in await aclient.chat.completions.create(messages=messages(prompt), stream=True, **kwargs):
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                out["content"] += delta.get("content") or ""
                out["reasoning"] += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = out["calls"].setdefault(call["index"], {"name": call["function"]["name"], "arguments": ""})
                    entry["arguments"] += call["function"]["arguments"] or ""
        return out

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    concurrent = asyncio.run(all_at_once())
    for seq, con in zip(sequential, concurrent):
        assert (con["content"], con["reasoning"]) == (seq["content"], seq["reasoning"])
        assert [(c["name"], c["arguments"]) for c in con["calls"].values()] == [(c["name"], c["arguments"]) for c in seq["calls"].values()]


def test_errors_through_the_openai_client(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages("x"), temperature=7000)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages("x") + [{"role": "tool", "tool_call_id": "call_x", "content": "r"}])
    assert "matches no tool call" in info.value.body["message"]
    too_long = " ".join(f"w{i}" for i in range(5000))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=messages(too_long), max_tokens=5)
    limit = server.state.engine.max_model_len
    assert f"{limit} tokens" in info.value.body["message"] and info.value.body["code"] == "context_length_exceeded"
    models = client.models.list()
    assert [m.id for m in models.data] == ["north-mini-code"]
    card = models.data[0].model_dump()  # the SDK keeps the extra fields
    assert card["root"] and card["random_weights"] is True and "RANDOM WEIGHTS" in card["display_name"]


def wait_for_idle(server, seconds: float = 10.0) -> dict:
    """Poll until no request runs, no page is held and no admission slot is taken; return the engine stats."""
    engine, deadline = server.state.engine, time.time() + seconds
    while time.time() < deadline:
        stats = engine.stats()
        if stats["pages_used"] == 0 and stats["requests_running"] == 0 and stats["requests_waiting"] == 0 and server.state.in_flight == 0:
            break
        time.sleep(0.05)
    assert server.state.in_flight == 0, "an admission slot was not released"
    return engine.stats()


def test_client_giving_up_on_a_non_streaming_request_frees_the_pages(server):
    body = {"model": "m", "messages": messages("Write a long essay."), "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.5)
    stats = wait_for_idle(server)  # 3000 tokens take far longer: only an abort frees the pages this soon
    assert stats["pages_used"] == 0 and stats["requests_running"] == 0, stats


def test_disconnect_mid_stream_frees_the_pages(server):
    engine = server.state.engine
    body = {"model": "m", "messages": messages("Tell me a very long story."), "max_tokens": 3000, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = 0
            for line in response.iter_lines():
                lines += line.startswith("data: ")
                if lines >= 5:
                    break
            assert engine.stats()["pages_used"] > 0  # the request holds pages while it streams
    stats = wait_for_idle(server)  # 3000 tokens would take far longer: only an abort frees them this soon
    assert stats["pages_used"] == 0 and stats["requests_running"] == 0, stats


def test_tool_calling_request_shape(client):
    tools = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    history = messages("read README.md") + [
        {"role": "assistant", "content": "", "reasoning_content": "read it",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "# Demo"},
    ]
    for choice in ("auto", "required", "none", {"type": "function", "function": {"name": "read"}}):
        response = client.chat.completions.create(model="m", messages=history, tools=tools, tool_choice=choice, max_tokens=8,
                                                  parallel_tool_calls=False, **GREEDY)
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def wait_until_ready(process: subprocess.Popen, timeout_s: float = 120) -> tuple[str, list[str]]:
    """Read a serve process's stderr until its "ready at URL/v1" line: (base URL, the lines read)."""
    log_lines, deadline = [], time.time() + timeout_s
    while time.time() < deadline:
        line = process.stderr.readline()
        assert line or process.poll() is None, "".join(log_lines)
        log_lines.append(line)
        if "ready at" in line:
            return line.split("ready at ")[1].split("/v1")[0], log_lines
    raise AssertionError("serve was not ready in time:\n" + "".join(log_lines))


def test_serve_command_end_to_end(tiny_checkpoint):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "northcode.cli", "serve", "--model", str(tiny_checkpoint), "--port", "0", "--api-key", "k3y",
           "--num-pages", "256", "--max-batch", "1", "--max-queue", "1", "--log-level", "warning"]
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, log_lines = wait_until_ready(process)
        snippet_lines, backend_line = [], None
        for line in process.stderr:
            if line.startswith("  backend: "):
                backend_line = line
            if line.startswith("{") or snippet_lines:
                snippet_lines.append(line)
            if line.startswith("}"):
                break
        snippet = json.loads("".join(snippet_lines))
        provider = snippet["provider"]["northcode"]
        assert provider["options"]["baseURL"] == url + "/v1" and provider["npm"] == "@ai-sdk/openai-compatible"
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["pid"] == process.pid  # the process to stop
        assert backend_line.startswith(f"  backend: {health['backend']} (auto: "), backend_line  # which runs, and why
        assert httpx.get(url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        assert client.models.list().data[0].model_dump()["backend"] == health["backend"]
        reply = client.chat.completions.create(model="north-mini-code", messages=messages("hi"), max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens <= 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        check_bounded_queue(url, {"Authorization": "Bearer k3y"})
    finally:
        process.terminate()
        process.wait(timeout=30)


def check_bounded_queue(url: str, headers: dict) -> None:
    """--max-batch 1 --max-queue 1: one request runs, one waits in the engine, the third gets 503."""
    body = {"model": "m", "messages": messages("A long story, please."), "max_tokens": 2000, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60, headers=headers) as http:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as running:
            assert running.status_code == 200
            waiting = threading.Thread(target=post_and_give_up, args=(http, url + "/v1/chat/completions", {**body, "stream": False}))
            waiting.start()
            deadline = time.time() + 10
            while "northcode_requests_waiting 1.0" not in http.get(url + "/metrics").text:
                assert time.time() < deadline, "the second request never queued"
                time.sleep(0.05)
            refused = http.post(url + "/v1/chat/completions", json=body)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "server_busy"
            waiting.join(timeout=10)  # gives up after 5 s: the server aborts it
    deadline = time.time() + 10
    while "northcode_kv_pages_used 0.0" not in httpx.get(url + "/metrics").text:  # /metrics needs no key
        assert time.time() < deadline, "pages were not freed after both clients left"
        time.sleep(0.05)


def post_and_give_up(http: httpx.Client, url: str, body: dict) -> None:
    with pytest.raises(httpx.ReadTimeout):
        http.post(url, json=body, timeout=5)



READ_TOOL = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def prompt_text(server, body: dict) -> str:
    ids = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_the_models_own_broken_calls_sent_back(client, server):
    """OpenCode sends the model's calls back verbatim: a call cut off by max_tokens or written malformed
    must not make the rest of the conversation fail, and the next prompt holds its arguments as written."""
    first = messages("Read README.md, please.")
    forced = {"type": "function", "function": {"name": "read"}}  # the random weights write a call only when forced
    reply = client.chat.completions.create(model="m", messages=first, tools=READ_TOOL, tool_choice=forced, max_tokens=64,
                                           reasoning_effort="none", **GREEDY)  # they would never end a thinking block
    call = reply.choices[0].message.tool_calls[0]
    history = first + [reply.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "error: the arguments are not a JSON object"}]
    handwritten = {'{"path": "REA': "cut off", '{"path": "a",}': "malformed", "null": "not an object", '{"path":"b"}': "valid, compact"}
    for j, arguments in enumerate(handwritten):
        history.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{j}", "type": "function", "function": {"name": "read", "arguments": arguments}}]})
        history.append({"role": "tool", "tool_call_id": f"call_{j}", "content": "error"})
    stream = client.chat.completions.create(model="m", messages=history, tools=READ_TOOL, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    out = collect_stream(stream)
    assert out["finish"] in ("stop", "length", "tool_calls") and out["usage"].prompt_tokens > reply.usage.prompt_tokens
    text = prompt_text(server, {"messages": history, "tools": READ_TOOL})
    written = call.function.arguments  # what the random weights wrote (noise); an object is rendered with tojson
    if is_json_object(written):
        written = json.dumps(json.loads(written), ensure_ascii=False)
    expected = [written, '{"path": "REA', '{"path": "a",}', "null", '{"path": "b"}']
    assert [f'"tool_name": "read", "parameters": {a}}}\n]<|END_ACTION|>' in text for a in expected] == [True] * 5, text
    with pytest.raises(openai.BadRequestError) as info:  # not a string nor an object: a malformed request
        client.chat.completions.create(model="m", messages=first + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read", "arguments": 5}}]}], max_tokens=1)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_fatal_engine_error_turns_health_and_new_requests_into_503s(tiny_checkpoint):
    """The real engine, whose decode really blocks (test_engine_watchdog's BlockingFactory), behind the real
    app: the hung request ends with a 500 naming the overrun; once the device is declared lost the fatal
    listener makes /health and every new request answer 503 with the engine's message."""
    from starlette.testclient import TestClient

    from tests.test_engine_watchdog import BlockingFactory, watched_engine

    factory = BlockingFactory(block_at=2)
    engine = watched_engine(tiny_checkpoint, factory, hang_grace_s=0.5)
    state = ServerState(ServerOptions())
    state.attach(engine, tiny_checkpoint)
    client = TestClient(create_app(state), raise_server_exceptions=False)
    chat = {"model": "m", "messages": messages("hi"), "max_tokens": 8, "temperature": 0}
    try:
        assert client.get("/health").json()["backend"] == "torch"
        hung = client.post("/v1/chat/completions", json=chat)  # its second decode blocks; ended after 0.3 s
        assert hung.status_code == 500 and "did not finish within 0.3 s" in hung.json()["error"]["message"]
        assert state.engine_failed.wait(10), "the fatal listener was not called"
        fatal = engine.stats()["fatal_error"]
        assert "device stopped responding" in fatal and state.engine_error == fatal
        health = client.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "error", "error": fatal, "pid": os.getpid()}
        for path, body in (("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 2})):
            refused = client.post(path, json=body)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "engine_failed"
            assert fatal in error["message"] and error["type"] == "server_error"
        assert client.get("/v1/models").status_code == 503
        assert state.in_flight == 0
    finally:
        factory.release.set()
        engine.shutdown()


def test_a_request_the_failed_engine_ends_at_once_is_a_503_not_a_200_stream(tiny_checkpoint):
    """A request that passed the ready check as the engine failed: the engine ends it at once with the
    fatal message (its own fatal routine is called here), and the server answers 503 before any stream."""
    from starlette.testclient import TestClient

    from tests.test_engine import make_engine

    engine = make_engine(tiny_checkpoint)
    state = ServerState(ServerOptions())
    state.attach(engine, tiny_checkpoint)
    client = TestClient(create_app(state), raise_server_exceptions=False)
    message = "the device stopped responding (declared by the test)"
    try:
        engine._declare_fatal(message)
        assert state.engine_error == message and state.engine_failed.is_set()
        state.require_ready = lambda: None  # the requests below passed the ready check just before the failure
        for path, body in (("/v1/chat/completions", {"messages": messages("hi"), "max_tokens": 4, "stream": True}),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True}),
                           ("/v1/chat/completions", {"messages": messages("hi"), "max_tokens": 4})):
            response = client.post(path, json=body)
            assert response.status_code == 503 and response.headers["content-type"] == "application/json", response.text
            assert response.json()["error"]["code"] == "engine_failed" and message in response.json()["error"]["message"]
        state.engine_error = None  # an engine error that is not fatal (say a step that raised): a 500, still no stream
        response = client.post("/v1/chat/completions", json={"messages": messages("hi"), "max_tokens": 4, "stream": True})
        assert response.status_code == 500 and f"the engine failed: {message}" == response.json()["error"]["message"]
        assert state.in_flight == 0
    finally:
        engine.shutdown()


def test_serve_prints_a_fatal_engine_error_and_exits_1(tiny_checkpoint):
    """The real `northcode serve` whose engine's decode hangs for good (tests/server_with_hanging_engine.py):
    it reports the lost device and exits 1 although its step thread never comes back."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "tests.server_with_hanging_engine", "--model", str(tiny_checkpoint), "--port", "0",
           "--device", "cpu", "--num-pages", "256", "--log-level", "warning"]
    process = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url, log_lines = wait_until_ready(process)
        body = {"model": "m", "messages": messages("hi"), "max_tokens": 8, "temperature": 0}
        hung = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)  # its third decode never returns
        assert hung.status_code == 500 and "did not finish within" in hung.json()["error"]["message"]
        assert process.wait(timeout=60) == 1
        rest = process.stderr.read()
        assert "error: the engine failed and cannot serve any more: the device stopped responding" in rest, rest
        assert "exiting (status 1)" in rest and "Traceback" not in rest, rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_the_device_client_check_passes_here(server):
    """lab/serve_client_check.py (a new user's requests, run on the H200 by lab/device_serve_check.sh) against
    this server: every check passes, and a wrong backend name fails the run."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "lab/serve_client_check.py", server.url + "/v1"]
    done = subprocess.run([*cmd, "--backend", "torch"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split(":")[0] for line in done.stdout.splitlines()] == [
        "ok   models", "ok   chat", "ok   greedy repeats", "ok   stream", "ok   tools", "ok   eight at once",
        "ok   bad request", "ok   metrics"]
    wrong = subprocess.run([*cmd, "--backend", "megakernel"], cwd=root, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and wrong.stdout.startswith("FAIL models"), wrong.stdout
