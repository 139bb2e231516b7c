"""The official `anthropic` SDK against a real `northcode serve` on the tiny checkpoint (random weights: noise),
through /v1/messages: plain and streamed replies, thinking on and off, a tool_use / tool_result round trip,
usage from the prefix cache, count_tokens, and errors arriving as the SDK's typed exceptions."""

from __future__ import annotations

import uuid

import pytest
from northcode_serve_process import northcode_serve

anthropic = pytest.importorskip("anthropic")

KEY = "test-key"
MODEL = "claude-sonnet-4-5-20250929"  # what Claude Code might send: accepted and reported back
GREEDY = {"temperature": 0}  # sent as extra_body: recent SDKs dropped sampling parameters from their signature
READ_TOOL = {"name": "read", "description": "Read a file",
             "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}


@pytest.fixture(scope="module")
def server_url(tiny_checkpoint):
    with northcode_serve(tiny_checkpoint, "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    return anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0)


def unique_prompt() -> str:
    return f"Explain topic {uuid.uuid4().hex} in detail, please, with examples and caveats."


def test_plain_reply(client):
    message = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}])
    assert message.model == MODEL and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("end_turn", "max_tokens") and 1 <= message.usage.output_tokens <= 16
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 0


def test_stream_events_and_the_final_message(client):
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.model == MODEL and final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens >= 1
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)


def test_thinking_on_and_off(client):
    messages = [{"role": "user", "content": "think about it"}]
    on = client.messages.count_tokens(model=MODEL, messages=messages, thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model=MODEL, messages=messages, thinking={"type": "disabled"})
    assert on.input_tokens + 1 == off.input_tokens  # off closes the thinking block in the generation prompt
    thinking = client.messages.create(model=MODEL, max_tokens=2048, extra_body=GREEDY, messages=messages,
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    assert thinking.content and thinking.content[0].type in ("thinking", "text", "tool_use")
    if thinking.content[0].type == "thinking":
        assert thinking.content[0].signature
    plain = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=messages, thinking={"type": "disabled"})
    assert plain.stop_reason in ("end_turn", "max_tokens")


def test_cache_read_rises_on_a_repeated_prompt(client):
    messages = [{"role": "user", "content": unique_prompt()}]
    first = client.messages.create(model=MODEL, max_tokens=4, messages=messages)
    second = client.messages.create(model=MODEL, max_tokens=4, messages=messages)
    assert second.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total


def test_tool_use_round_trip(client):
    messages = [{"role": "user", "content": unique_prompt()}]
    first = client.messages.create(model=MODEL, max_tokens=96, messages=messages, tools=[READ_TOOL],
                                   tool_choice={"type": "tool", "name": "read"}, thinking={"type": "disabled"})
    call = first.content[0]
    assert call.type == "tool_use" and call.name == "read" and call.id.startswith("toolu_") and isinstance(call.input, dict)
    assert first.stop_reason in ("tool_use", "max_tokens")
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "# Demo"},
                                     {"type": "tool_result", "tool_use_id": call.id, "is_error": True,
                                      "content": [{"type": "text", "text": "no such file"}, {"type": "text", "text": "(ENOENT)"}]}]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[READ_TOOL])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt // 2  # the first turn's prompt came from the cache


def test_streamed_tool_call_parses_in_the_sdk(client):
    """Random weights write noise as arguments: the stream must still be one the SDK can accumulate."""
    with client.messages.stream(model=MODEL, max_tokens=96, messages=[{"role": "user", "content": "read it"}], tools=[READ_TOOL],
                                tool_choice={"type": "tool", "name": "read"}, thinking={"type": "disabled"}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and isinstance(final.content[0].input, dict)


def test_auth_token_is_a_bearer_key(server_url):
    bearer = anthropic.Anthropic(base_url=server_url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


def test_errors_are_the_sdks_typed_exceptions(server_url, client):
    wrong = anthropic.Anthropic(base_url=server_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 401 and err.value.body["error"]["type"] == "authentication_error"
    bad = [
        {"extra_body": {"temperature": 2.0}},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
        {"thinking": {"type": "enabled", "budget_tokens": 10}},
        {"max_tokens": 0},
        {"tools": [READ_TOOL], "tool_choice": {"type": "tool", "name": "write"}},
        {"messages": [{"role": "user", "content": "word " * 20_000}]},  # past the context
    ]
    for extra in bad:
        request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(**request)
        assert err.value.status_code == 400 and err.value.body == {"type": "error", "error": err.value.body["error"]}
        assert err.value.body["error"]["type"] == "invalid_request_error", extra
