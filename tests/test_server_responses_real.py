"""The official openai SDK's client.responses against a real `northcode serve` on the tiny checkpoint
(random weights: the text is noise, so the tests pin shapes, ids, usage and statuses, not words).

Greedy sampling (temperature 0) keeps every answer the same from run to run.
"""

from __future__ import annotations

import openai
import pytest
from northcode_serve_process import northcode_serve
from openai.types.responses import ResponseCompletedEvent, ResponseCreatedEvent, ResponseIncompleteEvent

TOOLS = [{"type": "function", "name": "read", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
FORCE_READ = {"type": "function", "name": "read"}


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    with northcode_serve(tiny_checkpoint) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def create(client, **kwargs):
    return client.responses.create(**{"model": "north-mini-code", "temperature": 0, "max_output_tokens": 12, **kwargs})


def test_plain_response(client):
    response = create(client, input="Say hi.", instructions="Be brief.")
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.id.startswith("resp") and response.instructions == "Be brief."
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 12
    usage = response.usage
    assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 <= usage.output_tokens_details.reasoning_tokens <= usage.output_tokens


def test_stream_parsed_by_the_sdk(client):
    events = list(create(client, input="Say hi.", stream=True))
    assert isinstance(events[0], ResponseCreatedEvent) and events[0].response.status == "in_progress"
    assert events[1].type == "response.in_progress"
    assert isinstance(events[-1], (ResponseCompletedEvent, ResponseIncompleteEvent))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == final.output_text
    assert reasoning == "".join(part.text for item in final.output if item.type == "reasoning" for part in item.content)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in final.output]
    assert final.usage.output_tokens > 0


def test_stream_helper_of_the_sdk(client):
    """The SDK's own accumulator; like OpenAI, a cut-off response ends in response.incomplete, which
    get_final_response (it wants response.completed) does not take."""
    with client.responses.stream(model="north-mini-code", input="Say hi.", temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        if events[-1].type == "response.completed":
            assert stream.get_final_response().output_text == events[-1].response.output_text
    assert events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.usage.output_tokens > 0
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_tool_call_round_trip(client):
    first = create(client, input="What is in a.txt?", tools=TOOLS, tool_choice=FORCE_READ, max_output_tokens=64,
                   reasoning={"effort": "none"})  # with reasoning on, the random weights would never end their thinking
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "read" and calls[0].call_id.startswith("call_")
    history = [{"role": "user", "content": "What is in a.txt?"}, *[item.model_dump(exclude_none=True) for item in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "hello from a.txt"}]
    second = create(client, input=history, tools=TOOLS)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    streamed = list(create(client, input=history, tools=TOOLS, stream=True))
    assert streamed[-1].response.usage.input_tokens == second.usage.input_tokens


def test_reasoning_on_and_off(client):
    on = create(client, input="Think about it.", reasoning={"effort": "high"})
    off = create(client, input="Think about it.", reasoning={"effort": "none"})
    assert off.usage.input_tokens == on.usage.input_tokens + 1  # the closed thinking block: <|END_THINKING|>
    assert on.reasoning.effort == "high" and off.reasoning.effort == "none"
    if on.output:
        assert on.output[0].type == "reasoning" and on.usage.output_tokens_details.reasoning_tokens > 0


def test_previous_response_id_chain(client):
    first = create(client, input="Remember 7.")
    second = create(client, input="What was it?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).id == first.id
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, input="And now?", previous_response_id=first.id)
    assert caught.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp-unknown")


def test_cached_tokens_rise_on_a_repeated_prompt(client):
    long_input = "Count the words in this sentence, slowly and with care. " * 12
    first = create(client, input=long_input, max_output_tokens=2)
    again = create(client, input=long_input, max_output_tokens=2)
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("kwargs", [{"max_output_tokens": 0}, {"input": [{"type": "function_call_output", "call_id": "x", "output": "y"}]},
                                    {"tool_choice": {"type": "function", "name": "missing"}}, {"input": "x" * 40000}])
def test_errors_are_4xx(client, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **{"input": "hi", **kwargs})
    assert caught.value.status_code == 400 and caught.value.body["param"]
