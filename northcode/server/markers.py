"""The cmd4 marker tokens the server switches on, looked up by string in the checkpoint's tokenizer.

Ids are never hard-coded (they differ between the real vocabulary and the synthetic one): a
tokenizer without one of the required markers is not a cmd4 model and is refused with a message
that names the missing token. Nothing here decodes or parses text.
"""

from __future__ import annotations

from dataclasses import dataclass

MARKER_STRINGS = {
    "start_of_turn": "<|START_OF_TURN_TOKEN|>",
    "end_of_turn": "<|END_OF_TURN_TOKEN|>",
    "start_thinking": "<|START_THINKING|>",
    "end_thinking": "<|END_THINKING|>",
    "start_text": "<|START_TEXT|>",
    "end_text": "<|END_TEXT|>",
    "start_action": "<|START_ACTION|>",
    "end_action": "<|END_ACTION|>",
}


@dataclass(frozen=True, slots=True)
class Markers:
    start_of_turn: int
    end_of_turn: int
    start_thinking: int
    end_thinking: int
    start_text: int
    end_text: int
    start_action: int
    end_action: int
    special_ids: frozenset[int]  # every special/added token: never shown to a client as text
    special_text: dict[int, str]  # id -> its marker string, for markers that stand inside JSON strings

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Markers:
        ids: dict[str, int] = {}
        for field_name, text in MARKER_STRINGS.items():
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise ValueError(f"tokenizer: no {text} token (not a cmd4 chat model: the server needs it)")
            ids[field_name] = token_id
        special_ids = frozenset(tokenizer.special_ids) | frozenset(ids.values())
        special_text = {i: tokenizer.decode([i], skip_special_tokens=False) for i in special_ids}
        return cls(**ids, special_ids=special_ids, special_text=special_text)

    def marker_strings(self) -> list[str]:
        """The text of every special token that looks like a marker (`<|...|>` or `<...>`)."""
        return sorted({t for t in self.special_text.values() if t.startswith("<") and t.endswith(">") and len(t) > 2})
