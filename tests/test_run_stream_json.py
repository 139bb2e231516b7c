"""`northcode run --output-format stream-json`: one strict JSON event per line, as it happens, Claude Code's shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, error_reply, text_reply, tool_reply

from northcode.cli import main


def strict_events(out: str) -> list[dict]:
    """Every line parsed as strict JSON (no NaN or Infinity), each an object with a type."""

    def refuse(constant: str):
        raise AssertionError(f"not strict JSON: {constant}")

    assert out.endswith("\n")
    events = [json.loads(line, parse_constant=refuse) for line in out.splitlines()]
    assert all(isinstance(event, dict) and isinstance(event.get("type"), str) for event in events)
    return events


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "hello.txt").write_text("hello world\n")
    return tmp_path


def test_events_for_reasoning_text_a_tool_call_its_result_and_the_end(workspace, capsys):
    replies = [tool_reply(("read", {"filePath": "hello.txt"}), content="Let me look."),
               text_reply("It says hello world.", reasoning="the file is short", cached_tokens=60)]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "what is in hello.txt?", "--output-format", "stream-json", "--endpoint",
                     endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    events = strict_events(out)
    assert code == 0 and "→ read hello.txt" in err  # progress stays on stderr
    init, result = events[0], events[-1]
    assert init["type"] == "system" and init["subtype"] == "init" and init["model"] == "scripted-model"
    assert init["cwd"] == str(workspace) and "read" in init["tools"] and init["mode"] == "auto-edit"
    assert {event["session_id"] for event in events} == {init["session_id"]} and init["session_id"]
    assert [e["type"] for e in events if e["type"] != "stream_event"] == ["system", "assistant", "user", "assistant",
                                                                          "result"]
    first, tool_result, second = (e["message"] for e in events if e["type"] in ("assistant", "user"))
    call = first["content"][1]
    assert first["content"][0] == {"type": "text", "text": "Let me look."} and first["stop_reason"] == "tool_use"
    assert call["type"] == "tool_use" and call["name"] == "read" and call["input"] == {"filePath": "hello.txt"}
    assert tool_result["content"] == [{"type": "tool_result", "tool_use_id": call["id"], "content": "     1\thello world",
                                       "is_error": False}]
    assert second["content"] == [{"type": "thinking", "thinking": "the file is short"},
                                 {"type": "text", "text": "It says hello world."}]
    assert second["usage"] == {"input_tokens": 200 - 60, "cache_read_input_tokens": 60, "output_tokens": 8}

    streamed = [e["event"] for e in events if e["type"] == "stream_event"]
    kinds = [s["type"] for s in streamed]
    assert kinds.count("message_start") == kinds.count("message_stop") == 2
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4  # text, tool_use; thinking, text
    deltas = [s["delta"] for s in streamed if s["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "Let me look.It says hello world."
    assert "".join(d.get("thinking", "") for d in deltas) == "the file is short"
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"filePath": "hello.txt"}

    assert result["subtype"] == "success" and result["is_error"] is False and result["error"] is None
    assert result["result"] == "It says hello world." and result["num_turns"] == 2 and result["stop_reason"] == "done"
    assert result["usage"]["cache_read_input_tokens"] == 60 and result["usage"]["output_tokens"] == 11 + 8
    assert result["duration_ms"] >= 0


def test_events_are_written_as_they_happen(workspace):
    slow = text_reply("one two three four five six seven eight", delay_s=0.25)
    with ScriptedEndpoint([slow]) as endpoint:
        command = [sys.executable, "-m", "northcode.cli", "run", "-p", "count", "--output-format", "stream-json",
                   "--endpoint", endpoint.url, str(workspace)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        arrivals = [(time.monotonic(), json.loads(line)) for line in process.stdout]
        assert process.wait(timeout=30) == 0
    first_text = next(t for t, e in arrivals if e["type"] == "stream_event" and e["event"]["type"] == "content_block_delta")
    end = next(t for t, e in arrivals if e["type"] == "result")
    assert end - first_text > 1.0  # eight fragments 0.25 s apart: the first was read long before the end


def test_a_failed_endpoint_ends_with_an_error_result(workspace, capsys):
    with ScriptedEndpoint([error_reply("the server is busy")]) as endpoint:
        code = main(["run", "-p", "hi", "--output-format", "stream-json", "--endpoint", endpoint.url, str(workspace)])
    events = strict_events(capsys.readouterr().out)
    assert code == 1 and [e["type"] for e in events] == ["system", "result"]
    result = events[-1]
    assert result["is_error"] is True and result["subtype"] == "error_during_execution"
    assert "the server is busy" in result["error"] and result["session_id"] is None  # the task was taken back


def test_the_step_limit_is_error_max_turns(workspace, capsys):
    with ScriptedEndpoint([tool_reply(("list", {}))]) as endpoint:
        code = main(["run", "-p", "loop", "--max-steps", "1", "--output-format", "stream-json", "--endpoint",
                     endpoint.url, str(workspace)])
    result = strict_events(capsys.readouterr().out)[-1]
    assert code == 3 and result["subtype"] == "error_max_turns" and result["is_error"] is True


def test_json_and_another_format_are_refused(workspace, capsys):
    assert main(["run", "-p", "x", "--json", "--output-format", "stream-json", str(workspace)]) == 2
    assert "--json and --output-format stream-json: choose one" in capsys.readouterr().err
