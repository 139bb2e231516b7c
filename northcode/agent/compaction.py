"""Compaction (`/compact`, or the agent itself before the context fills): a long conversation, summarised by the
model, becomes a short one that goes on from the summary.

The model gets the whole conversation plus COMPACT_REQUEST, with the agent's tools still offered (the prompt is
then the last request's prompt extended, so the server's prefix cache serves all of it; without them the
rendered prompt differs from the tools' place on), and writes a summary. The summary keeps the goal, what was
done and decided, the files touched and what is left. The new conversation is: the same system prompt (with
AGENTS.md), the user's first request word for word (the goal is not left to the summary), and the summary as
the assistant's reply. The next user message follows it, so user and assistant turns still alternate as chat
templates expect. The user is always told, whoever started it. The conversation before compaction stays in
its saved session. When the conversation no longer fits the context, its oldest turns after the first request
are left out of the summary, half at a time, and the user is told how many messages were.
"""

from __future__ import annotations

import re

from northcode.agent.client import ChatClient, Completion, EndpointError

COMPACT_REQUEST = """[northcode: the conversation is being compacted to free the context.] Write a summary that \
lets you go on with this work without the conversation. Keep: the user's goal and every instruction or \
preference they gave; what was done, decided and ruled out, and why; every file read or changed, with what \
matters in it; commands run and their outcomes (tests that pass or fail); what is left to do, next step first. \
Be specific (names, paths, errors, numbers); leave out pleasantries and the tool output itself. Do not call tools."""
FIRST_REQUEST_MAX_CHARS = 8_000  # the first request is kept word for word up to this (attached files can be long)
MAX_SHORTENINGS = 6  # halvings of the turns after the first request before giving up
# northcode: "prompt of N tokens does not fit the context of M tokens"; vLLM: "maximum context length is";
# llama.cpp: "exceeds the available context size"
TOO_LONG = re.compile(r"does not fit the context|maximum context length|exceeds? the (available )?context", re.I)


class CompactError(RuntimeError):
    """Nothing to compact, or the model wrote no summary."""


def first_request(messages: list[dict]) -> str:
    """The first user message's text, cut to FIRST_REQUEST_MAX_CHARS."""
    for message in messages:
        if message.get("role") == "user":
            text = str(message.get("content") or "")
            if len(text) > FIRST_REQUEST_MAX_CHARS:
                text = text[:FIRST_REQUEST_MAX_CHARS] + f"\n[... {len(text) - FIRST_REQUEST_MAX_CHARS} characters cut]"
            return text
    raise CompactError("nothing to compact: the conversation has no request yet")


def without_oldest_turns(messages: list[dict]) -> list[dict] | None:
    """`messages` with the older half of the turns after the first request left out, and a line that says so in
    their place (an assistant line: the turns still alternate); None when one turn is all that is left."""
    starts = [i for i, m in enumerate(messages) if m.get("role") == "user"]  # a turn starts at a user message
    if len(starts) < 3:
        return None
    cut = starts[1 + (len(starts) - 1) // 2]  # keep the first request and the newer half of the other turns
    head = messages[:starts[0] + 1]
    dropped = [m for m in messages[starts[0] + 1:cut] if not str(m.get("content", "")).startswith("[northcode: ")]
    marker = {"role": "assistant", "content": "[northcode: earlier messages are left out here: the conversation "
                                              "did not fit the context]"}
    return [*head, marker, *messages[cut:]] if dropped else None


async def summarise(client: ChatClient, messages: list[dict], tools: list[dict] | None = None,
                    **params) -> tuple[Completion, int]:
    """The model's summary of `messages` and how many messages were left out of it to fit. `tools` are the
    conversation's own (offered, not meant to be called: they keep the prompt a prefix-cache hit)."""
    kept = messages
    for _ in range(MAX_SHORTENINGS + 1):
        completion = None
        try:
            request = [*kept, {"role": "user", "content": COMPACT_REQUEST}]
            async for event in client.stream_chat(request, tools, **params):
                if isinstance(event, Completion):
                    completion = event
        except EndpointError as err:
            shorter = without_oldest_turns(kept) if TOO_LONG.search(str(err)) else None
            if shorter is None:
                raise
            kept = shorter
            continue
        if completion is None or not completion.content.strip():
            called = " (it called a tool instead)" if completion is not None and completion.tool_calls else ""
            raise CompactError(f"the model wrote no summary{called}; the conversation is unchanged")
        left_out = len(messages) - len(kept) + (kept is not messages)  # the marker line is not a message of theirs
        return completion, left_out
    raise CompactError("the conversation does not fit the context even without its older turns; start afresh "
                       "with /new")


def context_share(context_used: int | None, context_window: int | None) -> float | None:
    """The share of the window in use, where both are known."""
    return context_used / context_window if context_used is not None and context_window else None


def compacted(messages: list[dict], summary: str) -> list[dict]:
    """The short conversation that replaces `messages`: system prompt, first request, summary."""
    first = first_request(messages)
    system = [m for m in messages[:1] if m.get("role") == "system"]
    return [*system,
            {"role": "user", "content": f"[northcode: earlier turns were compacted into the summary below.] "
                                        f"My first request was:\n\n{first}"},
            {"role": "assistant", "content": f"Summary of the work so far:\n\n{summary.strip()}"}]
