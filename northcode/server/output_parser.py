"""OutputParser: the model's generated token ids -> OpenAI chat deltas (reasoning, content, tool calls).

It is a state machine on token ids, the shape of cmd4's grammar:
    [reasoning] <|END_THINKING|> ( <|START_TEXT|> content <|END_TEXT|> | <|START_ACTION|> [calls] <|END_ACTION|> )* <|END_OF_TURN_TOKEN|>
Marker ids switch the channel and are never shown; ordinary ids are decoded incrementally (never
half a UTF-8 character) and streamed at once, reasoning and content alike. ACTION text goes
through ActionScanner: a call's first delta (index, id, type, name) goes out as soon as its name
is known, then its arguments stream as fragments that join to exactly the JSON the model wrote.
An announced call is never taken back: if its JSON turns out cut off or malformed, it keeps the
text the model wrote as its arguments (OpenAI's behaviour; the client validates them) and is
counted in `broken_calls`. Lenient like Melody: blocks may come in any order, text outside blocks
is content, and action text that names no tool becomes content verbatim. The same object serves
streaming and non-streaming responses (it accumulates both).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from northcode.server.action_scanner import ActionScanner, ArgumentsText, CallEnd, CallName, Event, Rejected
from northcode.server.markers import Markers
from northcode.server.text_guard import TextGuard

log = logging.getLogger(__name__)

REASONING, CONTENT, ACTION, DONE = "reasoning", "content", "action", "done"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    def __init__(
        self,
        tokenizer,
        markers: Markers,
        *,
        start_in_reasoning: bool,
        stop: list[str] | None = None,
        tools_enabled: bool = True,
        parallel_tool_calls: bool = True,
        reasoning_alias: bool = True,  # also send reasoning as `reasoning` (newer vLLM, Cohere's server)
        new_call_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._tokenizer = tokenizer
        self._markers = markers
        self._tools_enabled = tools_enabled
        self._parallel = parallel_tool_calls
        self._reasoning_alias = reasoning_alias
        self._new_call_id = new_call_id
        drop = markers.marker_strings()
        self._guards = {REASONING: TextGuard(stop or [], drop), CONTENT: TextGuard(stop or [], drop)}
        self.channel = REASONING if start_in_reasoning else CONTENT
        self._segment_ids: list[int] = []  # ids of the current channel not yet decoded
        self._detok = self._new_detokenizer()
        self._scanner = ActionScanner()
        self._block_calls: dict[int, int | None] = {}  # call_idx in the ACTION block -> index in tool_calls (None: dropped)
        self._deltas: list[dict] = []
        # accumulated turn, for non-streaming responses and usage
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict] = []  # [{"id", "type": "function", "function": {"name", "arguments"}}]
        self.reasoning_tokens = 0
        self.dropped_calls = 0  # calls beyond the first when parallel_tool_calls is false
        self.broken_calls = 0  # announced calls whose JSON was cut off or malformed

    @property
    def stopped(self) -> bool:
        """A stop string or the end-of-turn marker was reached: later tokens are ignored."""
        return self.channel == DONE

    def feed(self, token_ids: list[int]) -> list[dict]:
        """Consume new token ids; return the deltas they produce (possibly none)."""
        for token_id in token_ids:
            if self.channel == DONE:
                break
            if token_id in self._markers.special_ids:
                self._on_special(token_id)
            else:
                self._segment_ids.append(token_id)
                self.reasoning_tokens += self.channel == REASONING
        self._decode_segment()
        return self._take_deltas()

    def finish(self) -> list[dict]:
        """The request ended (end of turn, stop, max_tokens, abort): flush everything held back."""
        self._close_channel()
        self.channel = DONE
        return self._take_deltas()

    # --- channels ---

    def _on_special(self, token_id: int) -> None:
        m = self._markers
        self._decode_segment()
        if self.channel == ACTION and self._scanner.in_string and token_id != m.end_of_turn:
            self._on_action_text(m.special_text[token_id])  # marker text inside a JSON string is data
            return
        switch = {
            m.start_thinking: REASONING,
            m.end_thinking: CONTENT,
            m.start_text: CONTENT,
            m.end_text: CONTENT,
            m.start_action: ACTION if self._tools_enabled else CONTENT,
            m.end_action: CONTENT,
            m.end_of_turn: DONE,
            m.start_of_turn: DONE,  # the model began another turn: never follow it
        }
        if token_id in switch:
            self._close_channel()
            self.channel = DONE if self.channel == DONE else switch[token_id]

    def _close_channel(self) -> None:
        self._decode_segment()
        flush = getattr(self._detok, "flush", None)
        if flush is not None:
            self._on_text(flush())
        if self.channel == ACTION:
            self._on_action_events(self._scanner.finish())
            self._scanner, self._block_calls = ActionScanner(), {}
        for name, guard in self._guards.items():
            self._emit_raw(name, guard.flush())
        self._detok = self._new_detokenizer()

    def _decode_segment(self) -> None:
        if self._segment_ids:
            ids, self._segment_ids = self._segment_ids, []
            self._on_text(self._detok.push(ids))

    def _on_text(self, text: str) -> None:
        if not text or self.channel == DONE:
            return
        if self.channel == ACTION:
            self._on_action_text(text)
        else:
            self._emit_text(self.channel, text)

    def _on_action_text(self, text: str) -> None:
        self._on_action_events(self._scanner.push(text))

    def _on_action_events(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, CallName):
                self._start_call(event.call_idx, event.name)
            elif isinstance(event, ArgumentsText):
                self._add_arguments(event.call_idx, event.text)
            elif isinstance(event, CallEnd):
                self._end_call(event)
            else:
                assert isinstance(event, Rejected)
                self._emit_text(CONTENT, event.text)

    # --- deltas ---

    def _emit_text(self, channel: str, text: str) -> None:
        if not text:
            return
        guard = self._guards[channel]
        self._emit_raw(channel, guard.push(text))
        if guard.stopped:
            self.channel = DONE

    def _emit_raw(self, channel: str, text: str) -> None:
        if not text:
            return
        if channel == REASONING:
            self.reasoning += text
            delta = {"reasoning_content": text}
            if self._reasoning_alias:
                delta["reasoning"] = text
        else:
            self.content += text
            delta = {"content": text}
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.keys() == delta.keys():  # merge with the previous delta of its kind
            for key in delta:
                last[key] += text
        else:
            self._deltas.append(delta)

    def _start_call(self, call_idx: int, name: str) -> None:
        """The first delta of a call: index, id, type and name, with empty arguments."""
        if self.tool_calls and not self._parallel:
            self._block_calls[call_idx] = None
            self.dropped_calls += 1
            return
        index, call_id = len(self.tool_calls), self._new_call_id()
        self._block_calls[call_idx] = index
        self.tool_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        self._deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                             "function": {"name": name, "arguments": ""}}]})

    def _add_arguments(self, call_idx: int, text: str) -> None:
        """An arguments fragment; merged into the previous delta when that is a fragment of the same call."""
        index = self._block_calls.get(call_idx)
        if index is None or not text:
            return
        self.tool_calls[index]["function"]["arguments"] += text
        last = self._deltas[-1]["tool_calls"][0] if self._deltas and "tool_calls" in self._deltas[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += text
        else:
            self._deltas.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def _end_call(self, end: CallEnd) -> None:
        if not end.named:  # never a call: the model's text is shown, not lost
            self._emit_text(CONTENT, end.raw)
            return
        index = self._block_calls[end.call_idx]
        if index is not None and not end.valid:
            self.broken_calls += 1
            state = "cut off" if not end.complete else "malformed"
            log.warning("tool call %d (%s) was %s; its arguments are sent as the model wrote them: %.200r",
                        index, self.tool_calls[index]["function"]["name"], state, end.raw)

    def _take_deltas(self) -> list[dict]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _new_detokenizer(self):
        from northcode.model.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self._tokenizer, skip_special_tokens=True)
