"""ActionScanner: the text of a cmd4 ACTION block, as it streams in -> tool-call events, in order.

The block is a JSON array `[{"tool_call_id": "0", "tool_name": "read", "parameters": {...}}, ...]`
(a bare object counts as a one-element array). The scanner tracks JSON strings, escapes and bracket
depth, so a `]`, `}` or marker text inside a string never ends anything, and it reads the keys of
each call object: CallName the moment the name's string closes, then ArgumentsText slices of the
parameters object as its characters arrive (the slices of a call join to exactly the text the
model wrote), then CallEnd (closed or cut off, valid or not). An object that never names a tool,
and stray characters, come back verbatim as Rejected. It knows nothing of tokens or OpenAI chunks.

Slicing the model's own text, rather than re-serialising a partial parse (partial-json-parser,
jiter's partial mode), keeps the fragments append-only: a re-serialised prefix closes strings and
brackets that are still open, and diffing successive dumps is how vLLM's parsers came to stream
broken or doubled arguments (vllm-project/vllm #10395, #51697).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEYS = ("tool_name", "name")
ARGUMENT_KEYS = ("parameters", "arguments")


@dataclass(slots=True)
class CallName:
    """A call's name is known (its JSON string just closed)."""

    call_idx: int  # the call's position in this block: 0, 1, ...
    name: str


@dataclass(slots=True)
class ArgumentsText:
    """The next slice of a named call's arguments JSON."""

    call_idx: int
    text: str


@dataclass(slots=True)
class CallEnd:
    """A call's object closed, or the block ended inside it."""

    call_idx: int
    named: bool  # False: no usable tool name, so this was no call: `raw` is the model's text
    complete: bool  # False: the block ended inside the object (max_tokens, end of turn)
    valid: bool  # complete, named, and its arguments are a JSON object
    raw: str  # the whole object's text, verbatim


@dataclass(slots=True)
class Rejected:
    """Action text that is no call (characters outside any object), verbatim."""

    text: str


Event = CallName | ArgumentsText | CallEnd | Rejected


@dataclass(slots=True)
class _Call:
    """What the scanner knows of the call object being read; indices are into the block text."""

    idx: int
    start: int  # its `{`
    level: int  # bracket depth inside it: its keys and values start at this depth
    expect: str = "key"  # at its own level: key, colon, value, scalar, nested, next
    key: str | None = None  # the key whose value comes next
    token_start: int = 0  # where the current key or value began
    name: str | None = None
    args_start: int | None = None  # the arguments object's `{`: streamed as it arrives
    args_end: int | None = None  # just past its matching `}`
    args_text: str | None = None  # arguments written some other way, sent whole (see _arguments_value)
    reported: int = 0  # streamed arguments: text before this index was reported
    args_sent: bool = False  # args_text was reported


class ActionScanner:
    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # next character to scan
        self._depth = 0  # open [ and { outside strings
        self._in_string = False
        self._escaped = False
        self._array_open = False  # saw the outer `[`
        self._call: _Call | None = None
        self._num_calls = 0
        self._after_junk = False  # the last top-level character was rejected
        self._gap = ""  # whitespace or commas after rejected text: kept if more rejected text follows
        self._events: list[Event] = []

    @property
    def in_string(self) -> bool:
        return self._in_string

    def push(self, text: str) -> list[Event]:
        self._text += text
        while self._pos < len(self._text):
            ch = self._text[self._pos]
            if self._in_string:
                self._step_string(ch)
            elif self._call is not None:
                self._step_call(self._call, ch)
            else:
                self._step_top_level(ch)
            self._pos += 1
        self._report_arguments(self._call, len(self._text))
        return self._take_events()

    def finish(self) -> list[Event]:
        """The block ended (END_ACTION, end of turn, max_tokens): a call still open ends cut off."""
        if self._call is not None:
            self._end_call(self._call, complete=False)
        return self._take_events()

    # --- characters ---

    def _step_string(self, ch: str) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False
            call = self._call
            if call is not None and self._depth == call.level:
                self._on_call_string(call)

    def _step_call(self, call: _Call, ch: str) -> None:
        at_call_level = self._depth == call.level
        if ch == '"':
            self._in_string = True
            if at_call_level:
                call.token_start = self._pos
        elif ch in "{[":
            if at_call_level and call.expect == "value":
                self._open_value(call, ch)
            self._depth += 1
        elif ch in "}]":
            if at_call_level and call.expect == "scalar":
                self._on_value(call, self._text[call.token_start : self._pos])
            self._depth -= 1
            if self._depth == call.level:
                self._close_value(call)
            elif self._depth < call.level:  # the call's own `}` (a `]` here is malformed: same end)
                self._end_call(call, complete=True)
        elif at_call_level:
            self._step_call_punctuation(call, ch)

    def _step_call_punctuation(self, call: _Call, ch: str) -> None:
        """A character outside strings and brackets at the call object's own level."""
        if ch == ":" and call.expect == "colon":
            call.expect = "value"
        elif (ch == "," or ch.isspace()) and call.expect == "scalar":
            self._on_value(call, self._text[call.token_start : self._pos])
            call.expect = "key" if ch == "," else "next"
        elif ch == ",":
            call.expect = "key"
        elif not ch.isspace() and call.expect == "value":  # a number, true, false or null begins
            call.token_start, call.expect = self._pos, "scalar"

    def _step_top_level(self, ch: str) -> None:
        if ch == "{":
            self._depth += 1
            self._call = _Call(idx=self._num_calls, start=self._pos, level=self._depth)
            self._num_calls += 1
        elif ch == "[" and not self._array_open and self._depth == 0:
            self._array_open, self._depth = True, 1
        elif ch == "]" and self._array_open and self._depth == 1:
            self._array_open, self._depth = False, 0
        elif ch.isspace() or ch == ",":
            self._gap += ch if self._after_junk else ""
            return
        else:
            self._reject(self._gap + ch)
            self._gap, self._after_junk = "", True
            return
        self._gap, self._after_junk = "", False

    # --- keys and values of a call object ---

    def _on_call_string(self, call: _Call) -> None:
        """A string at the call's own level closed: a key, or a string value."""
        raw = self._text[call.token_start : self._pos + 1]
        if call.expect in ("key", "next"):
            key = _loads(raw)
            call.key, call.expect = (key if isinstance(key, str) else None), "colon"
        elif call.expect == "value":
            self._on_value(call, raw)

    def _open_value(self, call: _Call, bracket: str) -> None:
        call.token_start, call.expect = self._pos, "nested"
        if bracket == "{" and call.key in ARGUMENT_KEYS and not self._has_arguments(call):
            call.args_start = call.reported = self._pos

    def _close_value(self, call: _Call) -> None:
        """A nested value of the call (at its own level) closed."""
        if call.expect != "nested":
            return
        if call.args_start == call.token_start and call.args_end is None:
            call.args_end = self._pos + 1
            call.expect = "next"
        else:
            self._on_value(call, self._text[call.token_start : self._pos + 1])

    def _on_value(self, call: _Call, raw: str) -> None:
        """A value other than the streamed arguments object is complete (raw: its text)."""
        call.expect = "next"
        value = _loads(raw.strip())
        if call.key in NAME_KEYS and call.name is None and isinstance(value, str) and value.strip():
            call.name = value.strip()
            self._events.append(CallName(call.idx, call.name))
            self._report_arguments(call, self._pos + 1)  # arguments written before the name
        elif call.key in ARGUMENT_KEYS and not self._has_arguments(call):
            call.args_text = _arguments_value(raw.strip(), value)

    @staticmethod
    def _has_arguments(call: _Call) -> bool:
        return call.args_start is not None or call.args_text is not None

    def _end_call(self, call: _Call, *, complete: bool) -> None:
        self._call = None
        end = self._pos + 1 if complete else len(self._text)
        if complete and call.name is not None and not self._has_arguments(call):
            call.args_text = "{}"  # a call without parameters
        self._report_arguments(call, end)
        arguments = self._text[call.args_start : call.args_end] if call.args_end is not None else call.args_text
        valid = complete and call.name is not None and isinstance(_loads(arguments or ""), dict)
        self._events.append(CallEnd(call.idx, call.name is not None, complete, valid, self._text[call.start : end]))

    # --- events ---

    def _report_arguments(self, call: _Call | None, upto: int) -> None:
        """Report a named call's arguments text not yet reported, up to index `upto` of the block."""
        if call is None or call.name is None:
            return
        if call.args_start is not None:
            end = call.args_end if call.args_end is not None else upto
            if end > call.reported:
                self._events.append(ArgumentsText(call.idx, self._text[call.reported : end]))
                call.reported = end
        elif call.args_text is not None and not call.args_sent:
            call.args_sent = True
            self._events.append(ArgumentsText(call.idx, call.args_text))

    def _reject(self, text: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, Rejected):
            last.text += text
        else:
            self._events.append(Rejected(text))

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events


def _loads(text: str):
    """json.loads, or None when the text is not JSON (the scanner never raises on model output)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _arguments_value(raw: str, value) -> str:
    """Arguments not written as an object: a JSON string holding an object (some models
    double-encode) gives that object's text; anything else is kept verbatim (an invalid call)."""
    if isinstance(value, str) and isinstance(_loads(value), dict):
        return value
    return raw
