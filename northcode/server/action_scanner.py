"""ActionScanner: finds the tool calls in the text of a cmd4 ACTION block as it streams in.

The block is a JSON array `[{"tool_call_id": "0", "tool_name": "read", "parameters": {...}}, ...]`
(a bare object is accepted as a one-element array). The scanner tracks JSON strings and bracket
depth, so a `]` or marker text inside an argument string never ends anything; each top-level
object is parsed the moment it closes. Text that is not a valid call (malformed JSON, a cut-off
object, stray characters) is returned verbatim as `rejected`, so the caller can show it instead
of losing it. It knows nothing of tokens, ids or OpenAI chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as a string (what OpenAI's function.arguments holds)


@dataclass(slots=True)
class ScanResult:
    calls: list[ParsedCall]
    rejected: str  # text that did not form a valid call, verbatim


class ActionScanner:
    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # next character to scan
        self._depth = 0  # open [ and { outside strings
        self._in_string = False
        self._escaped = False
        self._array_open = False  # saw the outer `[`
        self._object_start: int | None = None  # index of the `{` of the top-level object being read

    @property
    def in_string(self) -> bool:
        return self._in_string

    def push(self, text: str) -> ScanResult:
        self._text += text
        calls: list[ParsedCall] = []
        rejected: list[str] = []
        while self._pos < len(self._text):
            ch = self._text[self._pos]
            if self._in_string:
                self._step_string(ch)
            elif self._object_start is not None:
                self._step_object(ch, calls, rejected)
            else:
                self._step_top_level(ch, rejected)
            self._pos += 1
        return ScanResult(calls, "".join(rejected))

    def finish(self) -> str:
        """The block ended (END_ACTION, end of turn, or max_tokens): return any unfinished object's text."""
        if self._object_start is None:
            return ""
        tail, self._object_start = self._text[self._object_start :], None
        return tail

    def _step_string(self, ch: str) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False

    def _step_object(self, ch: str, calls: list[ParsedCall], rejected: list[str]) -> None:
        if ch == '"':
            self._in_string = True
        elif ch in "[{":
            self._depth += 1
        elif ch in "]}":
            self._depth -= 1
            if self._depth == (1 if self._array_open else 0):
                raw = self._text[self._object_start : self._pos + 1]
                self._object_start = None
                call = parse_call(raw)
                if call is None:
                    rejected.append(raw)
                else:
                    calls.append(call)

    def _step_top_level(self, ch: str, rejected: list[str]) -> None:
        if ch == "{":
            self._object_start = self._pos
            self._depth += 1
        elif ch == "[" and not self._array_open and self._depth == 0:
            self._array_open = True
            self._depth = 1
        elif ch == "]" and self._array_open and self._depth == 1:
            self._array_open = False
            self._depth = 0
        elif not (ch.isspace() or ch == ","):
            rejected.append(ch)


def parse_call(raw: str) -> ParsedCall | None:
    """One ACTION element -> (name, arguments JSON), or None when it is not a usable call."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("tool_name", obj.get("name"))
    params = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(params, str):  # some models double-encode; accept it when it holds an object
        try:
            params = json.loads(params)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(params, dict):
        return None
    return ParsedCall(name=name, arguments=json.dumps(params, ensure_ascii=False))
