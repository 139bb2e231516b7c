"""The HTTP layer on its own: validation (400s naming the parameter), auth, health, admission,
SSE framing and chunk order, with a ScriptedEngine that replays fixed token ids.

ScriptedEngine is not the engine and these tests claim nothing about generation: they pin what
the server does with a given token stream. tests/test_server_openai.py runs the real engine.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from starlette.testclient import TestClient

from northcode.cli import main
from northcode.engine.request import RequestOutput, Timings, Usage
from northcode.model.tokenizer import Tokenizer
from northcode.server.app import create_app
from northcode.server.state import ServerOptions, ServerState


class ScriptedEngine:
    """Engine API stand-in: each request gets `script` (token ids), one output per token."""

    def __init__(self, model_dir, script: list[int], max_model_len: int = 4096, hold: asyncio.Event | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.max_model_len = max_model_len
        self.script = script
        self.hold = hold  # when set, generation waits for it before each token
        self.aborted: list[str] = []
        self.seen: list[tuple[list[int], object]] = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.seen.append((prompt_ids, sampling))
        ids = self.script[: sampling.max_tokens]
        for i, token_id in enumerate(ids):
            if self.hold is not None:
                await self.hold.wait()
            if request_id in self.aborted:
                yield RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
                return
            last = i == len(ids) - 1
            reason = ("length" if len(ids) < len(self.script) else "stop") if last else None
            yield RequestOutput(request_id, [token_id], "", finished=last, finish_reason=reason,
                                usage=Usage(len(prompt_ids), i + 1, 3), timings=Timings(0.0, 0.01, [0.001] * i) if last else None)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self):
        return {"pages_used": 0, "pages_total": 10, "prefix_cache_hit_rate": 0.5, "requests_running": 0, "requests_waiting": 0,
                "backend": "torch", "backend_reason": "scripted", "status": "ok", "fatal_error": None}


def encode_script(tok, *parts):
    ids = []
    for part in parts:
        special = tok.token_to_id(f"<|{part}|>") if part.isupper() else None
        ids += [special] if special is not None else tok.encode(part)
    return ids


TOOL_SCRIPT = ("Need the file.", "END_THINKING", "START_ACTION",
               '[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": {"path": "README.md"}}\n]', "END_ACTION", "END_OF_TURN_TOKEN")
TEXT_SCRIPT = ("Hmm.", "END_THINKING", "START_TEXT", "Hello there.", "END_TEXT", "END_OF_TURN_TOKEN")
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def make_client(tiny_checkpoint, script, **options):
    engine = ScriptedEngine(tiny_checkpoint, script)
    state = ServerState(ServerOptions(**options), engine=engine)
    return TestClient(create_app(state), raise_server_exceptions=False), engine, state


def chat_body(**extra):
    return {"model": "x", "messages": [{"role": "user", "content": "hi"}], **extra}


def sse_events(response) -> list:
    events = []
    for block in response.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streamed_tool_call_chunks(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    response = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True, stream_options={"include_usage": True}))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the file."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "read", "arguments": ""}
    fragments = calls[1:]  # one per token here: the scripted engine yields one token per output
    assert len(fragments) > 1 and all(f.keys() == {"index", "function"} and f["index"] == 0 for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"path": "README.md"}'
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "tool_calls"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == len(engine.script)
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    assert usage_chunk["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(tok.encode("Need the file."))}
    assert "<|" not in response.text


def test_openai_stream_accumulator_rebuilds_the_call(tiny_checkpoint, tok):
    """The official SDK's stream helper state (what `client.chat.completions.stream()` runs) sees
    growing partial arguments and ends with the same call the non-streaming response holds."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    client, _, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    events = sse_events(client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True)))
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]  # the SDK parses only strict tools
    state = ChatCompletionStreamState(input_tools=strict)
    seen = [e for chunk in events[:-1] for e in state.handle_chunk(ChatCompletionChunk.model_validate(chunk))]
    deltas = [e for e in seen if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) > 1 and deltas[-1].arguments == '{"path": "README.md"}'
    assert deltas[0].arguments == "" and all(isinstance(e.parsed_arguments, dict) for e in deltas[1:])  # each prefix is partial JSON
    assert deltas[-1].parsed_arguments == {"path": "README.md"}
    done = [e for e in seen if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [("read", '{"path": "README.md"}')]
    streamed_call = state.get_final_completion().choices[0].message.tool_calls[0]
    full_call = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS)).json()["choices"][0]["message"]["tool_calls"][0]
    assert streamed_call.function.model_dump(include={"name", "arguments"}) == full_call["function"]


def test_non_streaming_message(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT))
    body = client.post("/v1/chat/completions", json=chat_body()).json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello there.", "reasoning_content": "Hmm.", "reasoning": "Hmm."}
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_default_system_prompt_and_reasoning_off(tiny_checkpoint, tok):
    client, engine, state = make_client(tiny_checkpoint, encode_script(tok, "START_TEXT", "ok", "END_OF_TURN_TOKEN"))
    body = client.post("/v1/chat/completions", json=chat_body(reasoning_effort="none")).json()
    prompt = tok.decode(engine.seen[-1][0], skip_special_tokens=False)
    assert state.options.default_system_prompt in prompt
    assert prompt.endswith("<|START_THINKING|><|END_THINKING|>")
    assert body["choices"][0]["message"]["content"] == "ok" and "reasoning_content" not in body["choices"][0]["message"]
    client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "x"}]})
    assert state.options.default_system_prompt not in tok.decode(engine.seen[-1][0], skip_special_tokens=False)


def test_max_tokens_cut_gives_length(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    body = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, max_tokens=8)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert "tool_calls" not in body["choices"][0]["message"]
    assert engine.seen[-1][1].max_tokens == 8


def test_call_cut_off_by_max_tokens_keeps_partial_arguments(tiny_checkpoint, tok):
    script = encode_script(tok, *TOOL_SCRIPT)
    cut = next(n for n in range(len(script)) if '"parameters": {"pa' in tok.decode(script[:n]))
    client, engine, _ = make_client(tiny_checkpoint, script)
    body = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, max_tokens=cut)).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert arguments.startswith('{"pa') and '{"path": "README.md"}'.startswith(arguments)
    events = sse_events(client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, max_tokens=cut, stream=True)))
    streamed = "".join(c["function"].get("arguments", "") for e in events[:-1] for d in [e["choices"][0]["delta"]]
                       for c in d.get("tool_calls", []))
    assert streamed == arguments and events[-2]["choices"][0]["finish_reason"] == "length"


def model_call_script(parameters: str) -> tuple[str, ...]:
    return ("Need the file.", "END_THINKING", "START_ACTION",
            '[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": ' + parameters + '}\n]', "END_ACTION", "END_OF_TURN_TOKEN")


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def cut_inside_the_arguments(tok, script):
    return next(n for n in range(len(script)) if '"parameters": {"pa' in tok.decode(script[:n]))


@pytest.mark.parametrize("case", ["valid", "valid, re-serialized compactly", "cut off by max_tokens", "malformed", "null"])
def test_the_models_own_call_sent_back_repeats_its_tokens(tiny_checkpoint, tok, case):
    """A client sends the model's call back (OpenCode does, verbatim): accepted even when its arguments
    are not a JSON object, and the next prompt is the last prompt followed by every token the model wrote."""
    parameters = {"malformed": '{"path": "a",}', "null": "null"}.get(case, '{"path": "README.md"}')
    script = encode_script(tok, *model_call_script(parameters))
    cut = cut_inside_the_arguments(tok, script) if case == "cut off by max_tokens" else len(script)
    client, engine, _ = make_client(tiny_checkpoint, script)
    first = chat_body(tools=TOOLS, max_tokens=cut)
    message = client.post("/v1/chat/completions", json=first).json()["choices"][0]["message"]
    first_prompt = engine.seen[-1][0]
    call = message["tool_calls"][0]
    if case == "valid, re-serialized compactly":  # the AI SDK sends JSON.stringify(input)
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
    elif case != "valid":
        arguments = call["function"]["arguments"]
        assert arguments == parameters if case != "cut off by max_tokens" else parameters.startswith(arguments)
        assert not is_json_object(arguments)
    history = first["messages"] + [message, {"role": "tool", "tool_call_id": call["id"], "content": "# Demo"}]
    response = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, messages=history))
    assert response.status_code == 200, response.text
    prompt = engine.seen[-1][0]
    assert prompt[: len(first_prompt) + cut] == first_prompt + script[:cut]


def test_completions_stream_and_usage(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, tok.encode("abc"))
    response = client.post("/v1/completions", json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(response)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-3]["choices"][0]["finish_reason"] == "stop"
    assert engine.seen[-1][0][0] == tok.bos_id


BAD_REQUESTS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_nope", "content": "r"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": 5}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": ["x"]}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(temperature=-1), "temperature"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_tokens=True), "max_tokens"),
    (chat_body(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),
    (chat_body(n=2), "n"),
    (chat_body(stop=[1]), "stop"),
    (chat_body(top_logprobs=50, logprobs=True), "top_logprobs"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(presence_penalty=3), "presence_penalty"),
    (chat_body(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    (chat_body(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "write"}}), "tool_choice"),
    (chat_body(response_format={"type": "yaml"}), "response_format.type"),
]


@pytest.mark.parametrize("body,param", BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_bad_requests_are_400_naming_the_parameter(tiny_checkpoint, tok, body, param):
    client, engine, _ = make_client(tiny_checkpoint, tok.encode("x"))
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert engine.seen == []


def test_malformed_json_unknown_fields_and_routes(tiny_checkpoint, tok):
    client, _, _ = make_client(tiny_checkpoint, tok.encode("x"))
    response = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=[1, 2]).status_code == 400
    assert client.post("/v1/chat/completions", json=chat_body(some_vendor_option={"a": 1}, user="me")).status_code == 200
    assert client.get("/v1/nothing").json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/chat/completions").status_code == 405
    assert client.post("/v1/completions", json={"prompt": "x", "suffix": "y"}).json()["error"]["param"] == "suffix"
    assert client.post("/v1/completions", json={"prompt": ["a", "b"]}).json()["error"]["param"] == "prompt"


def test_prompt_longer_than_context_names_both_numbers(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, tok.encode("x"))
    engine.max_model_len = 50
    response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    prompt_len = len(client.post("/tokenize", json={"messages": chat_body()["messages"]}).json()["tokens"])
    assert "50 tokens" in message and f"{prompt_len} tokens" in message
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_api_key(tiny_checkpoint, tok):
    client, _, _ = make_client(tiny_checkpoint, tok.encode("x"), api_key="s3cret")
    response = client.get("/v1/models")
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/health").status_code == 200  # monitoring stays open


def test_serve_prints_how_opencode_claude_code_and_codex_reach_it():
    import tomllib

    from northcode.commands.serve import agent_cli_setup, opencode_snippet

    opencode = json.loads(opencode_snippet("http://127.0.0.1:8123", "m", 8192, None))
    assert opencode["provider"]["northcode"]["options"]["baseURL"] == "http://127.0.0.1:8123/v1"
    claude, codex = agent_cli_setup("http://127.0.0.1:8123", "m", 8192, "k").split("\nCodex CLI: in ~/.codex/config.toml\n")
    assert claude == "Claude Code: ANTHROPIC_BASE_URL=http://127.0.0.1:8123 ANTHROPIC_AUTH_TOKEN=k claude --model m"
    config = tomllib.loads(codex.rsplit("\nthen ", 1)[0].replace("\n  ", "\n").strip())
    assert config["model"] == "m" and config["model_context_window"] == 8192
    assert config["model_providers"]["northcode"] == {"name": "northcode", "base_url": "http://127.0.0.1:8123/v1",
                                                     "env_key": "NORTHCODE_API_KEY", "wire_api": "responses"}


def test_serve_warns_when_an_agents_own_prompt_does_not_fit_the_context():
    from northcode.commands.serve import client_setup

    small = client_setup("http://127.0.0.1:8123", "m", 4096, None).splitlines()  # the demo checkpoint's context
    assert small[0].startswith("warning: OpenCode's own system prompt and tools take about 10,000 tokens and this "
                               "server's context is 4,096: its first request will not fit.")
    assert small[1] == "OpenCode: put this in opencode.json (or ~/.config/opencode/opencode.json):"
    assert [line.split("'")[0] for line in small if line.startswith("warning: ")] == [
        "warning: OpenCode", "warning: Claude Code", "warning: Codex CLI"]
    assert [line for line in client_setup("http://x", "m", 32768, None).splitlines() if "warning" in line] == [
        "warning: Claude Code's own system prompt and tools take about 40,000 tokens and this server's context is "
        "32,768: its first request will not fit. Serve a model with a longer context (--model DIR; the context is "
        "the model's, capped by the KV pool: --num-pages, --gpu-memory-fraction)."]
    assert "warning" not in client_setup("http://x", "m", 262144, None)


def test_unknown_routes_share_one_metrics_label(tiny_checkpoint, tok):
    client, _, _ = make_client(tiny_checkpoint, tok.encode("x"), api_key="k")
    for path in ("/v1/nothing", "/v1/a/b/c", "/v1/chat/completion", "/nothing"):
        client.get(path, headers={"Authorization": "Bearer k"})
        client.get(path)  # without the key: a 401, counted under the same label
    client.get("/v1/responses/resp_abc", headers={"Authorization": "Bearer k"})
    labels = {line.split('endpoint="')[1].split('"')[0] for line in client.get("/metrics").text.splitlines()
              if line.startswith("northcode_requests_total{")}
    assert labels == {"unknown", "/v1/responses/{id}"}


def test_cors_only_for_the_allowed_origins(tiny_checkpoint, tok):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    plain, _, _ = make_client(tiny_checkpoint, tok.encode("x"))
    assert "access-control-allow-origin" not in plain.get("/v1/models", headers={"Origin": "http://evil.example"}).headers
    client, _, _ = make_client(tiny_checkpoint, tok.encode("x"), api_key="s3cret",
                               allowed_origins=("http://localhost:3000",))
    answer = client.options("/v1/chat/completions", headers=preflight)  # a preflight carries no key
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
    allowed = client.get("/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer s3cret"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = client.get("/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer s3cret"})
    assert "access-control-allow-origin" not in other.headers


def test_health_while_loading_then_ready(tiny_checkpoint, tok):
    state = ServerState(ServerOptions())
    client = TestClient(create_app(state), raise_server_exceptions=False)
    state.phase = "reading weights 2/3"
    response = client.get("/health")
    assert response.status_code == 503 and response.json() == {"status": "loading", "phase": "reading weights 2/3", "pid": os.getpid()}
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 503
    state.attach(ScriptedEngine(tiny_checkpoint, tok.encode("x")), tiny_checkpoint)
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["pid"] == os.getpid()  # the process a user would stop


def test_busy_server_answers_503_with_retry_after(tiny_checkpoint, tok):
    client, _, state = make_client(tiny_checkpoint, tok.encode("x"), max_batch=1, max_queue=0)
    state.admit()  # one request already holds the only slot
    response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "server_busy"
    state.release()
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_models_tokenize_detokenize_metrics(tiny_checkpoint, tok):
    client, _, _ = make_client(tiny_checkpoint, encode_script(tok, *TEXT_SCRIPT), model_name="north-mini-code")
    models = client.get("/v1/models").json()
    card = models["data"][0]
    assert models["object"] == "list" and card["id"] == "north-mini-code" and card["max_model_len"] == 4096
    assert card["root"] == str(tiny_checkpoint.resolve()) and card["parent"] is None  # vLLM's fields
    assert card["random_weights"] is True and "RANDOM WEIGHTS" in card["display_name"]  # a synthetic checkpoint
    assert card["backend"] == "torch"  # the engine's stats()["backend"]
    health = client.get("/health").json()
    assert health["display_name"] == card["display_name"] and health["backend"] == "torch"
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert ids[0] == tok.bos_id
    assert client.post("/detokenize", json={"tokens": ids[1:]}).json()["prompt"] == "hello world"
    assert client.post("/detokenize", json={"tokens": [-1]}).json()["error"]["param"] == "tokens"
    client.post("/v1/chat/completions", json=chat_body())
    text = client.get("/metrics").text
    assert 'northcode_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert "northcode_time_to_first_token_seconds_count 1.0" in text
    assert "northcode_prefix_cache_hit_rate 0.5" in text and "northcode_kv_pages_total 10.0" in text


def test_logprobs_leave_out_marker_tokens(tiny_checkpoint, tok):
    from northcode.engine.request import TokenLogprob

    script = encode_script(tok, "END_THINKING", "START_TEXT", "ab")
    engine = ScriptedEngine(tiny_checkpoint, script)
    original = engine.generate

    async def with_logprobs(request_id, prompt_ids, sampling):
        async for out in original(request_id, prompt_ids, sampling):
            out.logprobs = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in out.token_ids]
            yield out

    engine.generate = with_logprobs
    client = TestClient(create_app(ServerState(ServerOptions(), engine=engine)))
    body = client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=1)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == "ab"
    assert all(e["logprob"] == -0.5 and len(e["top_logprobs"]) == 1 for e in content)


def test_named_tool_choice_is_a_grammar_after_the_thinking_block(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, *TOOL_SCRIPT))
    body = client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "read"}})).json()
    prompt_ids, sampling = engine.seen[-1]
    assert tok.decode(prompt_ids, skip_special_tokens=False).endswith("<|CHATBOT_TOKEN|><|START_THINKING|>")  # thinks first
    assert sampling.grammar.trigger_id == tok.token_to_id("<|END_THINKING|>") and '\\"read\\"' in sampling.grammar.grammar
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "read", "arguments": '{"path": "README.md"}'}


def test_tool_choice_none_hides_tools_and_required_holds_the_turn_to_an_action(tiny_checkpoint, tok):
    client, engine, _ = make_client(tiny_checkpoint, encode_script(tok, "START_TEXT", "ok", "END_OF_TURN_TOKEN"))
    client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice="none"))
    assert '"name": "read"' not in tok.decode(engine.seen[-1][0], skip_special_tokens=False)
    assert engine.seen[-1][1].grammar is None
    client.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice="required", reasoning_effort="none"))
    prompt, grammar = tok.decode(engine.seen[-1][0], skip_special_tokens=False), engine.seen[-1][1].grammar
    assert '"name": "read"' in prompt and prompt.endswith("<|START_THINKING|><|END_THINKING|>")
    assert grammar.trigger_id is None and "start: action\n" in grammar.grammar


def test_failed_load_is_reported_by_health_and_requests(tiny_checkpoint, tmp_path):
    import shutil

    from northcode.engine.settings import EngineSettings

    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")  # no weights, no tokenizer
    state = ServerState(ServerOptions())
    state.load_in_background(tmp_path, EngineSettings()).join()
    client = TestClient(create_app(state), raise_server_exceptions=False)
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "error" and str(tmp_path) in health.json()["error"]
    response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503 and response.json()["error"]["code"] == "model_load_failed"


def test_serve_refuses_a_taken_port_before_loading():
    from northcode.commands.serve import bind_listener

    first = bind_listener("127.0.0.1", 0)
    port = first.getsockname()[1]
    first.listen()
    try:
        with pytest.raises(ValueError, match=rf"--port {port}: 127.0.0.1:{port} is already in use"):
            bind_listener("127.0.0.1", port)
    finally:
        first.close()


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["bench", "engine"]])
def test_a_megakernel_that_cannot_run_is_a_one_line_error_and_exit_2(tiny_checkpoint, capsys, command):
    """--device cpu: the megakernel needs a CUDA GPU; refused before anything is loaded or served."""
    code = main([*command, "--model", str(tiny_checkpoint), "--device", "cpu", "--backend", "megakernel"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"northcode {command[0]}: error: engine setting backend = 'megakernel'")
    assert "the megakernel needs a CUDA GPU" in err
