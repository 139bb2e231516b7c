"""`northcode run`: answer on stdout, progress on stderr, --json transcript, exit codes."""

from __future__ import annotations

import json

import pytest
from agent_scripted_endpoint import ScriptedEndpoint, error_reply, text_reply, tool_reply

from northcode.cli import main


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "hello.txt").write_text("hello world\n")
    return tmp_path


def test_answer_on_stdout_progress_on_stderr(workspace, capsys):
    replies = [tool_reply(("read", {"filePath": "hello.txt"})), text_reply("It says hello world.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "what is in hello.txt?", "--endpoint", endpoint.url + "/v1", str(workspace)])
    out, err = capsys.readouterr()
    assert code == 0 and out == "It says hello world.\n"
    assert "→ read hello.txt" in err and "scripted-model" in err and "It says" not in err


def test_json_transcript(workspace, capsys):
    replies = [tool_reply(("edit", {"filePath": "hello.txt", "oldString": "world", "newString": "there"})),
               text_reply("Edited.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "edit it", "--json", "--endpoint", endpoint.url, str(workspace)])
    out, _ = capsys.readouterr()
    transcript = json.loads(out)
    assert code == 0 and transcript["ok"] and transcript["answer"] == "Edited."
    assert transcript["stop_reason"] == "done" and transcript["num_steps"] == 2 and transcript["mode"] == "auto-edit"
    assert [m["role"] for m in transcript["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert transcript["usage"]["completion_tokens"] >= 1 and transcript["session_id"]
    assert (workspace / "hello.txt").read_text() == "hello there\n"


def test_mode_ask_denies_edits_headless(workspace, capsys):
    replies = [tool_reply(("write", {"filePath": "x.txt", "content": "x"})), text_reply("Could not write.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "write", "--mode", "ask", "--endpoint", endpoint.url, str(workspace)])
    assert code == 0 and not (workspace / "x.txt").exists()
    assert "✗" in capsys.readouterr().err


def test_a_reply_that_only_reasoned_says_so(workspace, capsys):
    with ScriptedEndpoint([text_reply("", reasoning="hmm, let me think")]) as endpoint:
        code = main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    assert code == 0 and out == "\n" and "the model only reasoned and gave no answer" in err


def test_step_limit_is_a_failure(workspace, capsys):
    with ScriptedEndpoint([tool_reply(("list", {}))]) as endpoint:
        code = main(["run", "-p", "loop", "--max-steps", "1", "--json", "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    assert code == 3 and json.loads(out)["ok"] is False and "step limit" in err


def test_a_tool_call_cut_off_by_the_token_limit_stops_the_run(workspace, capsys):
    cut = tool_reply(("write", '{"filePath": "out.txt", "content": "par'), finish_reason="length")
    with ScriptedEndpoint([cut]) as endpoint:
        code = main(["run", "-p", "write out.txt", "--json", "--max-tokens", "16", "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    transcript = json.loads(out)
    assert code == 4 and transcript["stop_reason"] == "tool_call_truncated" and transcript["ok"] is False
    assert transcript["error"] == ("the answer was cut off at the token limit while the model was writing a tool call "
                                   "(write); nothing was run (--max-tokens 16)")
    assert transcript["messages"][-1]["content"].startswith("Not run: your answer was cut off at the token limit")
    assert not (workspace / "out.txt").exists() and "→ write" in err and "✗ Not run" in err


def test_a_failed_run_continued_does_not_repeat_the_prompt(workspace, capsys):
    with ScriptedEndpoint([text_reply("one"), error_reply("overloaded"), text_reply("two")]) as endpoint:
        assert main(["run", "-p", "first", "--endpoint", endpoint.url, str(workspace)]) == 0
        assert main(["run", "-p", "second", "-c", "--endpoint", endpoint.url, str(workspace)]) == 1
        assert "overloaded" in capsys.readouterr().err
        assert main(["run", "-p", "second", "-c", "--json", "--endpoint", endpoint.url, str(workspace)]) == 0
    transcript = json.loads(capsys.readouterr().out)
    assert [m["role"] for m in transcript["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in endpoint.requests[2]["messages"]][-2:] == ["assistant", "user"]


def test_unreachable_endpoint_fails_clearly(workspace, capsys):
    with ScriptedEndpoint([]) as endpoint:
        url = endpoint.url
    code = main(["run", "-p", "hi", "--endpoint", url, str(workspace)])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and f"--endpoint {url}" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "0"], "--max-steps 0"), (["-p", " "], "--prompt"), (["/no/such/dir"], "not a directory"),
    (["--endpoint", "localhost:8000"], "expected an http"),
])
def test_bad_input_is_a_clear_error(argv, message, capsys):
    base = ["run", "-p", "task"] if "-p" not in argv else ["run"]
    assert main(base + argv) == 2
    assert message in capsys.readouterr().err


def test_run_json_end_to_end_on_the_tiny_checkpoint(tiny_checkpoint, tmp_path):
    """The real server on random weights: the model emits noise, so this checks the plumbing."""
    import subprocess
    import sys

    from northcode_serve_process import northcode_serve

    (tmp_path / "notes.txt").write_text("hello\n")
    with northcode_serve(tiny_checkpoint) as url:
        command = [sys.executable, "-m", "northcode.cli", "run", "-p", "summarize notes.txt", "--json",
                   "--max-tokens", "24", "--max-steps", "3", "--endpoint", url + "/v1", str(tmp_path)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    # 3: noise that happened to parse as tool calls every step; 4: noise cut off inside a tool call
    assert done.returncode in (0, 3, 4), done.stderr
    transcript = json.loads(done.stdout)
    assert transcript["model"] == "north-mini-code" and transcript["endpoint"] == url
    assert transcript["messages"][:2] == [
        {"role": "system", "content": transcript["messages"][0]["content"]},
        {"role": "user", "content": "summarize notes.txt"}]
    assert transcript["messages"][2]["role"] == "assistant"
    usage = transcript["usage"]  # summed over the model calls
    assert usage["prompt_tokens"] > 0 and 1 <= usage["completion_tokens"] <= 24 * transcript["num_steps"]
    assert transcript["stop_reason"] in ("length", "done", "step_limit", "tool_call_truncated")
    assert transcript["num_steps"] >= 1 and transcript["ok"] == (done.returncode == 0)
    label = f"{tiny_checkpoint.name} (tiny preset, RANDOM WEIGHTS: output is noise)"  # from /v1/models
    assert transcript["model_label"] == label and f"northcode run: {label} at {url}" in done.stderr
    assert "weights are random" in done.stderr and "prompt tokens" in done.stderr
    assert (tmp_path / "notes.txt").read_text() == "hello\n" or transcript["num_steps"] > 1


def test_prompt_from_stdin(workspace, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("task from a pipe\n"))
    with ScriptedEndpoint([text_reply("ok")]) as endpoint:
        assert main(["run", "-p", "-", "--endpoint", endpoint.url, str(workspace)]) == 0
    assert endpoint.requests[0]["messages"][1] == {"role": "user", "content": "task from a pipe\n"}
    assert capsys.readouterr().out == "ok\n"


def test_continue_a_session(workspace, capsys):
    with ScriptedEndpoint([text_reply("first"), text_reply("second")]) as endpoint:
        assert main(["run", "-p", "one", "--json", "--endpoint", endpoint.url, str(workspace)]) == 0
        session_id = json.loads(capsys.readouterr().out)["session_id"]
        assert main(["run", "-p", "two", "-c", "--json", "--endpoint", endpoint.url, str(workspace)]) == 0
    transcript = json.loads(capsys.readouterr().out)
    assert transcript["session_id"] == session_id
    first, second = (r["messages"] for r in endpoint.requests)
    assert second[: len(first)] == first and second[len(first):] == [
        {"role": "assistant", "content": "first"}, {"role": "user", "content": "two"}]
    assert main(["run", "-p", "x", "--session", "nope", str(workspace)]) == 2
    assert "session 'nope': no such session" in capsys.readouterr().err


def test_control_characters_reach_a_terminal_defused_and_a_pipe_exact():
    import io

    from northcode.commands.run import _for_terminal

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    noise = "ok\x1b[2J\ttab\nline\x07"
    assert _for_terminal(noise, Terminal()) == "ok\ufffd[2J\ttab\nline\ufffd"
    assert _for_terminal(noise, io.StringIO()) == noise


def test_an_endpoint_with_an_api_key(workspace, capsys, monkeypatch):
    with ScriptedEndpoint([text_reply("ok")], api_key="sekrit") as endpoint:
        monkeypatch.delenv("NORTHCODE_API_KEY", raising=False)
        assert main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)]) == 1
        assert "HTTP 401: invalid or missing API key (set NORTHCODE_API_KEY" in capsys.readouterr().err
        monkeypatch.setenv("NORTHCODE_API_KEY", "sekrit")
        assert main(["run", "-p", "hi", "--endpoint", endpoint.url, str(workspace)]) == 0
    assert capsys.readouterr().out == "ok\n"


def test_mode_plan_prints_the_todo_list_and_refuses_changes(workspace, capsys):
    todos = [{"content": "greet in French", "status": "in_progress", "priority": "high", "id": "1"}]
    replies = [tool_reply(("todowrite", {"todos": todos}), ("write", {"filePath": "x.txt", "content": "x"}),
                          ("bash", {"command": "touch y.txt"})),
               text_reply("Plan: one step.")]
    with ScriptedEndpoint(replies) as endpoint:
        code = main(["run", "-p", "plan it", "--mode", "plan", "--json", "--endpoint", endpoint.url, str(workspace)])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["mode"] == "plan"
    assert not (workspace / "x.txt").exists() and not (workspace / "y.txt").exists()
    assert "→ todowrite: 1 todos\n  1 todos (1 in progress):\n  [~] greet in French (id 1, high)\n" in err
    assert err.count("plan mode, which is read-only") == 2
    assert endpoint.requests[0]["messages"][1]["content"].startswith("[northcode: plan mode:")
