"""/compact's pieces without the app: the first request kept word for word (cut when very long), the short
conversation's shape, and a summary the model did not write."""

from __future__ import annotations

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, error_reply, text_reply

from northcode.agent.client import ChatClient, EndpointError
from northcode.agent.compaction import FIRST_REQUEST_MAX_CHARS, CompactError, compacted, first_request, summarise


def test_the_first_request_is_kept_and_cut_only_when_very_long():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "fix it"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and this"}]
    assert first_request(messages) == "fix it"
    long = "x" * (FIRST_REQUEST_MAX_CHARS + 10)
    assert first_request([{"role": "user", "content": long}]).endswith("x\n[... 10 characters cut]")
    with pytest.raises(CompactError, match="nothing to compact"):
        first_request(messages[:1])
    short = compacted(messages, "  did A; next B \n")
    assert [m["role"] for m in short] == ["system", "user", "assistant"] and short[0] == messages[0]
    assert short[1]["content"].endswith("My first request was:\n\nfix it")
    assert short[2]["content"] == "Summary of the work so far:\n\ndid A; next B"


async def test_an_empty_summary_or_a_tool_call_is_an_error_and_the_tools_are_offered():
    from agent_scripted_endpoint import tool_reply

    from northcode.agent.tools import TOOL_SCHEMAS

    with ScriptedEndpoint([text_reply("   "), tool_reply(("list", {}))]) as endpoint:
        client = ChatClient(endpoint.url + "/v1")
        with pytest.raises(CompactError, match="no summary"):
            await summarise(client, [{"role": "user", "content": "fix it"}], TOOL_SCHEMAS)
        with pytest.raises(CompactError, match=r"no summary \(it called a tool instead\)"):
            await summarise(client, [{"role": "user", "content": "fix it"}], TOOL_SCHEMAS)
        await client.aclose()
    assert endpoint.requests[0]["tools"] == TOOL_SCHEMAS  # the agent's own: the prompt stays a prefix-cache hit


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "s"}]
    for n in range(turns):
        messages += [{"role": "user", "content": f"ask {n}"}, {"role": "assistant", "content": f"answer {n}"}]
    return messages


async def test_a_conversation_too_long_to_summarise_loses_its_oldest_turns_first():
    too_long = error_reply("prompt of 9000 tokens does not fit the context of 4096 tokens", status=400)
    with ScriptedEndpoint([too_long, too_long, text_reply("summary")]) as endpoint:
        client = ChatClient(endpoint.url + "/v1")
        completion, left_out = await summarise(client, conversation(9))
        await client.aclose()
    assert completion.content == "summary"
    sent = [[m["content"] for m in request["messages"]] for request in endpoint.requests]
    assert len(sent[0]) == 20 and sent[0][1] == "ask 0"  # everything, then halves of the turns after the first
    assert sent[1][:3] == ["s", "ask 0", sent[1][2]] and sent[1][2].startswith("[northcode: earlier messages")
    assert sent[1][3] == "ask 5" and sent[2][3] == "ask 7"  # turns 1-4 left out, then 5-6
    assert left_out == 19 - (len(sent[2]) - 2)  # of 19 messages, the last request kept all but the marker and ask
    roles = [m["role"] for m in endpoint.requests[2]["messages"]]
    assert all(a != b for a, b in zip(roles[1:], roles[2:]))  # user and assistant still alternate


async def test_another_error_or_nothing_left_to_drop_is_raised():
    with ScriptedEndpoint([error_reply("server busy", status=503)]) as endpoint:
        client = ChatClient(endpoint.url + "/v1")
        with pytest.raises(EndpointError, match="server busy"):
            await summarise(client, conversation(5))
        await client.aclose()
    too_long = error_reply("This model's maximum context length is 4096 tokens", status=400)
    with ScriptedEndpoint([too_long, too_long]) as endpoint:
        client = ChatClient(endpoint.url + "/v1")
        with pytest.raises(EndpointError, match="maximum context length"):
            await summarise(client, conversation(2))  # one turn after the first request: nothing to leave out
        await client.aclose()
    assert len(endpoint.requests) == 1
