"""`/compact`: a long conversation, summarised by the model, becomes a short one that goes on from the summary.

The model gets the whole conversation plus COMPACT_REQUEST (no tools) and writes a summary. The summary keeps the
goal, what was done and decided, the files touched and what is left. The new conversation is: the same system
prompt (with AGENTS.md), the user's first request word for word (the goal is not left to the summary), and the
summary as the assistant's reply. The next user message follows it, so user and assistant turns still alternate
as chat templates expect. The user asks for it and is told: nothing is summarised behind their back. The
conversation before compaction stays in its saved session.
"""

from __future__ import annotations

from northcode.agent.client import ChatClient, Completion

COMPACT_REQUEST = """[northcode: the conversation is being compacted to free the context.] Write a summary that \
lets you go on with this work without the conversation. Keep: the user's goal and every instruction or \
preference they gave; what was done, decided and ruled out, and why; every file read or changed, with what \
matters in it; commands run and their outcomes (tests that pass or fail); what is left to do, next step first. \
Be specific (names, paths, errors, numbers); leave out pleasantries and the tool output itself. Do not call tools."""
FIRST_REQUEST_MAX_CHARS = 8_000  # the first request is kept word for word up to this (attached files can be long)


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


async def summarise(client: ChatClient, messages: list[dict], **params) -> Completion:
    """The model's summary of `messages` (no tools offered)."""
    completion = None
    async for event in client.stream_chat([*messages, {"role": "user", "content": COMPACT_REQUEST}], None, **params):
        if isinstance(event, Completion):
            completion = event
    if completion is None or not completion.content.strip():
        raise CompactError("the model wrote no summary; the conversation is unchanged")
    return completion


def compacted(messages: list[dict], summary: str) -> list[dict]:
    """The short conversation that replaces `messages`: system prompt, first request, summary."""
    first = first_request(messages)
    system = [m for m in messages[:1] if m.get("role") == "system"]
    return [*system,
            {"role": "user", "content": f"[northcode: earlier turns were compacted into the summary below.] "
                                        f"My first request was:\n\n{first}"},
            {"role": "assistant", "content": f"Summary of the work so far:\n\n{summary.strip()}"}]
