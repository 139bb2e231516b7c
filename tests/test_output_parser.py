"""OutputParser on fixed token sequences: the exact OpenAI deltas the server streams.

Sequences are built from the tiny checkpoint's real tokenizer: marker ids where the model would
emit a marker token, ordinary text encoded with special parsing off. Each case is fed one token
at a time (as the engine streams) and all at once; both must give the same text and calls.
"""

from __future__ import annotations

import itertools
import json

import pytest

from northcode.model.tokenizer import Tokenizer
from northcode.server.action_scanner import ActionScanner, ArgumentsText, CallEnd, CallName, Rejected
from northcode.server.markers import Markers
from northcode.server.output_parser import OutputParser
from northcode.server.text_guard import TextGuard


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="module")
def markers(tok):
    return Markers.from_tokenizer(tok)


def seq(tok, *parts) -> list[int]:
    """Marker names (e.g. "END_THINKING") become their ids; other strings are encoded as plain text."""
    ids = []
    for part in parts:
        marker = f"<|{part}|>" if part.isupper() or part.endswith("_TOKEN") else None
        ids += [tok.token_to_id(marker)] if marker and tok.token_to_id(marker) is not None else tok.encode(part)
    return ids


def make_parser(tok, markers, **kwargs) -> OutputParser:
    counter = itertools.count()
    kwargs.setdefault("start_in_reasoning", True)
    return OutputParser(tok, markers, new_call_id=lambda: f"call_{next(counter)}", **kwargs)


def run(tok, markers, ids, one_by_one=True, **kwargs):
    parser = make_parser(tok, markers, **kwargs)
    deltas = []
    if one_by_one:
        for token_id in ids:
            deltas += parser.feed([token_id])
    else:
        deltas += parser.feed(ids)
    deltas += parser.finish()
    return parser, deltas


def merged(deltas: list[dict]) -> list[dict]:
    """Join consecutive text deltas of the same kind, and consecutive argument fragments of the
    same call (token-by-token streaming splits both); a call's first delta is never merged."""
    out = []
    for d in deltas:
        if out and "tool_calls" not in d and out[-1].keys() == d.keys():
            out[-1] = {k: out[-1][k] + d[k] for k in d}
        elif out and is_fragment(d) and is_fragment(out[-1]) and d["tool_calls"][0]["index"] == out[-1]["tool_calls"][0]["index"]:
            text = out[-1]["tool_calls"][0]["function"]["arguments"] + d["tool_calls"][0]["function"]["arguments"]
            out[-1] = {"tool_calls": [{"index": d["tool_calls"][0]["index"], "function": {"arguments": text}}]}
        else:
            out.append(dict(d))
    return out


def is_fragment(delta: dict) -> bool:
    """An arguments-only tool-call delta: exactly {"index", "function": {"arguments"}}."""
    calls = delta.get("tool_calls")
    return calls is not None and calls[0].keys() == {"index", "function"} and calls[0]["function"].keys() == {"arguments"}


def head(index: int, name: str) -> dict:
    return {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": ""}}]}


def fragment(index: int, text: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def test_thinking_then_text(tok, markers):
    ids = seq(tok, "Let me think.", "END_THINKING", "START_TEXT", "Hello, world!", "END_TEXT", "END_OF_TURN_TOKEN")
    for one_by_one in (True, False):
        parser, deltas = run(tok, markers, ids, one_by_one)
        assert merged(deltas) == [
            {"reasoning_content": "Let me think.", "reasoning": "Let me think."},
            {"content": "Hello, world!"},
        ]
        assert (parser.reasoning, parser.content, parser.tool_calls) == ("Let me think.", "Hello, world!", [])
        assert parser.reasoning_tokens == len(tok.encode("Let me think."))


def test_reasoning_streams_before_the_turn_ends(tok, markers):
    parser = make_parser(tok, markers)
    first = parser.feed(tok.encode("Step one"))
    assert first == [{"reasoning_content": "Step one", "reasoning": "Step one"}]


def test_reasoning_off_starts_in_content_and_alias_can_be_off(tok, markers):
    ids = seq(tok, "START_TEXT", "Just text", "END_TEXT", "END_OF_TURN_TOKEN")
    _, deltas = run(tok, markers, ids, start_in_reasoning=False, reasoning_alias=False)
    assert merged(deltas) == [{"content": "Just text"}]
    ids = seq(tok, "plan", "END_THINKING", "START_TEXT", "x")
    _, deltas = run(tok, markers, ids, reasoning_alias=False)
    assert merged(deltas) == [{"reasoning_content": "plan"}, {"content": "x"}]


def test_one_tool_call(tok, markers):
    action = '[\n    {"tool_call_id": "0", "tool_name": "read", "parameters": {"path": "README.md"}}\n]'
    ids = seq(tok, "I should read it.", "END_THINKING", "START_ACTION", action, "END_ACTION", "END_OF_TURN_TOKEN")
    for one_by_one in (True, False):
        parser, deltas = run(tok, markers, ids, one_by_one)
        assert merged(deltas) == [
            {"reasoning_content": "I should read it.", "reasoning": "I should read it."},
            head(0, "read"),
            fragment(0, '{"path": "README.md"}'),
        ]
        assert parser.tool_calls == [{"id": "call_0", "type": "function", "function": {"name": "read", "arguments": '{"path": "README.md"}'}}]
        assert parser.content == "" and parser.broken_calls == 0


def test_arguments_stream_as_their_tokens_arrive(tok, markers):
    """The exact chunks: the name goes out when its string closes, then each group of tokens
    inside the parameters object gives one fragment holding exactly its text (the wrapper's
    keys, closing brace and bracket never do)."""
    parser = make_parser(tok, markers, start_in_reasoning=False)
    steps = [
        (seq(tok, "START_ACTION", '[\n    {"tool_call_id": "0", "tool_name": "re'), []),
        (tok.encode('ad"'), [head(0, "read")]),
        (tok.encode(', "parameters": '), []),
        (tok.encode('{"path": "src/'), [fragment(0, '{"path": "src/')]),
        (tok.encode('main.py", "limit": 20'), [fragment(0, 'main.py", "limit": 20')]),
        (tok.encode('}}'), [fragment(0, "}")]),
        (tok.encode(",\n    "), []),
        (tok.encode('{"tool_call_id": "1", "tool_name": "bash", "parameters": {"command": "ls"}}'),
         [head(1, "bash"), fragment(1, '{"command": "ls"}')]),
        (seq(tok, "\n]", "END_ACTION", "END_OF_TURN_TOKEN"), []),
    ]
    for ids, expected in steps:
        assert parser.feed(ids) == expected
    assert parser.finish() == []
    assert [c["function"] for c in parser.tool_calls] == [
        {"name": "read", "arguments": '{"path": "src/main.py", "limit": 20}'}, {"name": "bash", "arguments": '{"command": "ls"}'}]


def test_token_by_token_fragments_join_to_the_parameters_json(tok, markers):
    params = '{"path": "a b/ü.py", "content": "x = {\\"k\\": [1, 2]}\\n", "n": -1.5e3, "ok": true, "none": null}'
    action = '[{"tool_call_id": "0", "tool_name": "write", "parameters": ' + params + "}]"
    ids = seq(tok, "END_THINKING", "START_ACTION", action, "END_ACTION")
    parser, deltas = run(tok, markers, ids)
    tool_deltas = [d for d in deltas if "tool_calls" in d]
    assert tool_deltas[0] == head(0, "write")
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in tool_deltas[1:]]
    assert all(is_fragment(d) for d in tool_deltas[1:]) and len(fragments) > 5 and all(fragments)
    assert "".join(fragments) == params and json.loads(params)["content"] == 'x = {"k": [1, 2]}\n'


def test_several_tool_calls_get_distinct_indices_and_ids(tok, markers):
    action = ('[\n    {"tool_call_id": "1", "tool_name": "read", "parameters": {"path": "a.md"}},\n'
              '    {"tool_call_id": "2", "tool_name": "bash", "parameters": {"command": "ls -la", "timeout": 5}}\n]')
    ids = seq(tok, "Need more.", "END_THINKING", "START_ACTION", action, "END_ACTION", "END_OF_TURN_TOKEN")
    parser, deltas = run(tok, markers, ids)
    assert [d for d in merged(deltas) if "tool_calls" in d] == [
        head(0, "read"), fragment(0, '{"path": "a.md"}'),
        head(1, "bash"), fragment(1, '{"command": "ls -la", "timeout": 5}'),
    ]
    assert [json.loads(c["function"]["arguments"]) for c in parser.tool_calls] == [{"path": "a.md"}, {"command": "ls -la", "timeout": 5}]


def test_name_after_parameters_and_other_argument_forms(tok, markers):
    # Keys in another order: the call is announced when the name arrives, with the arguments at once.
    # A call without parameters gets "{}"; double-encoded parameters are decoded once.
    action = ('[{"parameters": {"q": "x"}, "tool_name": "search"}, {"tool_name": "list"}, '
              '{"tool_name": "read", "arguments": "{\\"path\\": \\"a\\"}"}]')
    ids = seq(tok, "END_THINKING", "START_ACTION", action, "END_ACTION")
    for one_by_one in (True, False):
        parser, deltas = run(tok, markers, ids, one_by_one)
        assert [d for d in merged(deltas) if "tool_calls" in d] == [
            head(0, "search"), fragment(0, '{"q": "x"}'), head(1, "list"), fragment(1, "{}"),
            head(2, "read"), fragment(2, '{"path": "a"}'),
        ]
        assert parser.broken_calls == 0 and parser.content == ""


def test_parallel_tool_calls_false_keeps_the_first(tok, markers):
    action = '[{"tool_name": "a", "parameters": {}}, {"tool_name": "b", "parameters": {"x": 1}}]'
    ids = seq(tok, "END_THINKING", "START_ACTION", action, "END_ACTION")
    parser, deltas = run(tok, markers, ids, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in parser.tool_calls] == ["a"]
    assert [d for d in merged(deltas) if "tool_calls" in d] == [head(0, "a"), fragment(0, "{}")]
    assert parser.dropped_calls == 1


def test_text_then_action_and_bare_object(tok, markers):
    ids = seq(tok, "END_THINKING", "START_TEXT", "Reading.", "END_TEXT", "START_ACTION",
              '{"tool_call_id": "0", "tool_name": "read", "parameters": {"path": "x"}}', "END_ACTION")
    parser, deltas = run(tok, markers, ids)
    assert merged(deltas) == [{"content": "Reading."}, head(0, "read"), fragment(0, '{"path": "x"}')]
    assert parser.content == "Reading."
    assert parser.tool_calls[0]["function"] == {"name": "read", "arguments": '{"path": "x"}'}


def test_cut_off_after_the_name_keeps_the_partial_arguments(tok, markers):
    # max_tokens hits inside the arguments: the announced call keeps what the model wrote (the
    # server's finish_reason is then "length", as OpenAI's); nothing is moved to content.
    action = '[\n    {"tool_call_id": "0", "tool_name": "write", "parameters": {"path": "a.py", "content": "print('
    ids = seq(tok, "plan", "END_THINKING", "START_ACTION", action)  # no END_ACTION
    for one_by_one in (True, False):
        parser, deltas = run(tok, markers, ids, one_by_one)
        assert [d for d in merged(deltas) if "tool_calls" in d] == [head(0, "write"), fragment(0, '{"path": "a.py", "content": "print(')]
        assert parser.tool_calls[0]["function"]["arguments"] == '{"path": "a.py", "content": "print('
        assert parser.broken_calls == 1 and parser.content == ""


def test_cut_off_before_the_name_is_content(tok, markers):
    action = '[\n    {"tool_call_id": "0", "tool_na'
    parser, deltas = run(tok, markers, seq(tok, "plan", "END_THINKING", "START_ACTION", action))
    assert parser.tool_calls == [] and not any("tool_calls" in d for d in deltas)
    assert parser.content == action[action.index("{"):]  # nothing lost, nothing invented


def test_malformed_action_json(tok, markers):
    # An announced call with malformed arguments keeps the model's text (the client's JSON check
    # reports it); an object that names no tool is not a call and is shown as content.
    good = '{"tool_name": "read", "parameters": {"path": "ok"}}'
    bad = '{"tool_name": "read", "parameters": {"path": "oops",}}'
    nameless = '{"tool": "read", "parameters": {}}'
    ids = seq(tok, "END_THINKING", "START_ACTION", f"[{good}, {bad}, {nameless}]", "END_ACTION", "END_OF_TURN_TOKEN")
    parser, deltas = run(tok, markers, ids)
    assert [d for d in merged(deltas) if "tool_calls" in d] == [
        head(0, "read"), fragment(0, '{"path": "ok"}'), head(1, "read"), fragment(1, '{"path": "oops",}')]
    assert parser.broken_calls == 1 and parser.content == nameless
    non_object = seq(tok, "END_THINKING", "START_ACTION", '[{"tool_name": "x", "parameters": "not an object"}]', "END_ACTION")
    parser, _ = run(tok, markers, non_object)
    assert parser.tool_calls[0]["function"] == {"name": "x", "arguments": '"not an object"'} and parser.broken_calls == 1


def test_marker_text_inside_arguments(tok, markers):
    # The file being written contains marker strings, once spelled as text and once as the special id.
    head = '[{"tool_name": "write", "parameters": {"content": "a <|END_ACTION|> b ] } '
    ids = seq(tok, "END_THINKING", "START_ACTION", head) + [markers.end_action] + seq(tok, ' c"}}]', "END_ACTION", "END_OF_TURN_TOKEN")
    parser, deltas = run(tok, markers, ids)
    assert len(parser.tool_calls) == 1
    assert json.loads(parser.tool_calls[0]["function"]["arguments"]) == {"content": "a <|END_ACTION|> b ] } <|END_ACTION|> c"}
    assert parser.content == ""


def test_marker_strings_never_reach_content(tok, markers):
    # The model spells a marker with ordinary tokens inside its answer: it is dropped, the rest kept.
    ids = seq(tok, "END_THINKING", "START_TEXT", "before <|END_TEXT|> after", "END_OF_TURN_TOKEN")
    for one_by_one in (True, False):
        parser, deltas = run(tok, markers, ids, one_by_one)
        assert parser.content == "before  after"
        assert "<|" not in "".join(d.get("content", "") for d in deltas)


def test_stray_special_ids_are_hidden_and_end_of_turn_stops(tok, markers):
    system = tok.token_to_id("<|SYSTEM_TOKEN|>")
    ids = seq(tok, "END_THINKING", "START_TEXT", "ok") + [system] + seq(tok, "!", "END_OF_TURN_TOKEN", "START_TEXT", "ignored")
    parser, _ = run(tok, markers, ids)
    assert parser.content == "ok!"
    assert parser.stopped


def test_stop_string_cuts_and_holds_back(tok, markers):
    parser = make_parser(tok, markers, start_in_reasoning=False, stop=["STOP"])
    out = parser.feed(seq(tok, "START_TEXT", "abc ST"))
    assert "".join(d.get("content", "") for d in out) == "abc "  # "ST" may begin "STOP": held back
    out = parser.feed(tok.encode("OP tail"))
    assert out == [] and parser.stopped and parser.content == "abc "


def test_multibyte_text_split_across_tokens(tok, markers):
    text = "héllo 世界 🙂"
    ids = seq(tok, "END_THINKING", "START_TEXT", text, "END_TEXT")
    parser, deltas = run(tok, markers, ids)
    assert parser.content == text
    assert all("\ufffd" not in d.get("content", "") for d in deltas)


def test_tools_disabled_shows_action_as_text(tok, markers):
    ids = seq(tok, "END_THINKING", "START_ACTION", '[{"tool_name": "x", "parameters": {}}]', "END_ACTION")
    parser, _ = run(tok, markers, ids, tools_enabled=False)
    assert parser.tool_calls == [] and parser.content == '[{"tool_name": "x", "parameters": {}}]'


def test_action_scanner_handles_escapes_and_nesting():
    scanner = ActionScanner()
    params = '{"s": "q\\"}]{", "n": [1, {"a": 2}]}'
    text = '[{"tool_name": "t", "parameters": ' + params + '}] stray'
    events = []
    for ch in text:  # one character at a time
        events += scanner.push(ch)
    events += scanner.finish()
    assert events[0] == CallName(0, "t")
    arguments = [e.text for e in events if isinstance(e, ArgumentsText)]
    assert "".join(arguments) == params and json.loads(params) == {"s": 'q"}]{', "n": [1, {"a": 2}]}
    end = next(e for e in events if isinstance(e, CallEnd))
    assert end.valid and end.complete and end.raw == text[1:text.index("] stray")]
    assert "".join(e.text for e in events if isinstance(e, Rejected)) == "stray"


def test_text_guard_drops_markers_and_cuts_stop():
    guard = TextGuard(stop=["\n\nUser:"], drop=["<|END_TEXT|>"])
    pieces = [guard.push(p) for p in ["Hi <|END", "_TEXT|> there", "\n\nUs", "er: more"]]
    assert "".join(pieces) == "Hi  there" and guard.stopped
    guard = TextGuard(stop=["xyz"], drop=[])
    assert guard.push("abcx") == "abc" and guard.flush() == "x"
