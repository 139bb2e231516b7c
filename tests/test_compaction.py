"""/compact's pieces without the app: the first request kept word for word (cut when very long), the short
conversation's shape, and a summary the model did not write."""

from __future__ import annotations

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, text_reply

from northcode.agent.client import ChatClient
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


async def test_an_empty_summary_is_an_error_and_no_tools_are_offered():
    with ScriptedEndpoint([text_reply("   ")]) as endpoint:
        client = ChatClient(endpoint.url + "/v1")
        with pytest.raises(CompactError, match="no summary"):
            await summarise(client, [{"role": "user", "content": "fix it"}])
        await client.aclose()
    assert "tools" not in endpoint.requests[0]
