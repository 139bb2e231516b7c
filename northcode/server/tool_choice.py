"""Forcing a tool call for tool_choice "required" or a named function, by prefilling the answer.

The engine has no constrained decoding, so the server writes the start of the ACTION block into
the prompt itself: it closes the thinking block when the template opened it (a forced call skips
reasoning), adds <|START_ACTION|>, and for a named function also the JSON up to the arguments.
The model can then only continue a call; the parser starts inside the ACTION block with the same
text, so the call it completes is parsed exactly as if the model had written all of it.
"""

from __future__ import annotations

import json

from northcode.server.markers import Markers
from northcode.server.schemas import ChatRequest


def forced_action(chat: ChatRequest, prompt_ids: list[int], markers: Markers, tokenizer) -> tuple[list[int], str | None]:
    """(ids to append to the prompt, the action text they hold) or ([], None) when nothing is forced."""
    named = chat.tool_choice["function"]["name"] if isinstance(chat.tool_choice, dict) else None
    if chat.tool_choice != "required" and named is None:
        return [], None
    extra = [markers.end_thinking] if prompt_ids and prompt_ids[-1] == markers.start_thinking else []
    extra.append(markers.start_action)
    if named is None:
        return extra, ""
    number = sum(len(m.get("tool_calls") or []) for m in chat.messages)  # the template's next call number
    text = f'[\n    {{"tool_call_id": "{number}", "tool_name": {json.dumps(named, ensure_ascii=False)}, "parameters": '
    return extra + tokenizer.encode(text), text
