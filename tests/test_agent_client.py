"""The streaming client, the /metrics reader, @path mentions, approvals, and finding or starting a server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import httpx
import pytest
from agent_scripted_endpoint import ScriptedEndpoint, raw_reply

from northcode import paths
from northcode.agent.approvals import Answer, Approvals, Decision, Mode
from northcode.agent.client import ChatClient, Completion, EndpointError, split_endpoint
from northcode.agent.mentions import expand_mentions
from northcode.agent.metrics import kv_usage
from northcode.agent.sandbox import Workspace
from northcode.agent.tools import PreparedCall


def sse(*chunks: dict | str) -> str:
    lines = [c if isinstance(c, str) and c.startswith(":") else f"data: {c if isinstance(c, str) else json.dumps(c)}"
             for c in chunks]  # ": ..." is an SSE comment line, sent as is
    return "".join(line + "\n\n" for line in lines)


def delta(**fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


async def collect(endpoint, **params) -> tuple[list, Completion]:
    client = ChatClient(endpoint.url + "/v1/", model="m")
    events = [e async for e in client.stream_chat([{"role": "user", "content": "hi"}], **params)]
    await client.aclose()
    return events[:-1], events[-1]


async def test_parallel_tool_calls_are_assembled_by_index():
    stream = sse(delta(role="assistant", content=""), ": keep-alive comment",
                 delta(reasoning="let me look"),
                 delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function", "function": {"name": "read", "arguments": ""}}]),
                 delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function", "function": {"name": "grep", "arguments": "{\"pat"}}]),
                 delta(tool_calls=[{"index": 0, "function": {"arguments": "{\"filePath\": "}}]),
                 delta(tool_calls=[{"index": 0, "function": {"arguments": "\"x.py\"}"}}]),
                 delta(tool_calls=[{"index": 1, "function": {"arguments": "tern\": \"a\"}"}}]),
                 {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                 {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}, "[DONE]")
    with ScriptedEndpoint([raw_reply(stream)]) as endpoint:
        deltas, completion = await collect(endpoint)
    assert [(d.kind, d.text) for d in deltas] == [
        ("reasoning", "let me look"), ("tool_call", "read"), ("tool_call", "grep"), ("tool_arguments", '{"pat'),
        ("tool_arguments", '{"filePath": '), ("tool_arguments", '"x.py"}'), ("tool_arguments", 'tern": "a"}')]
    assert [d.num_chunks for d in deltas] == list(range(1, 8))  # argument fragments count for the live rate
    assert [(c.id, c.name, json.loads(c.arguments)) for c in completion.tool_calls] == [
        ("call_a", "read", {"filePath": "x.py"}), ("call_b", "grep", {"pattern": "a"})]
    assert completion.finish_reason == "tool_calls" and completion.usage["completion_tokens"] == 5
    assert completion.reasoning == "let me look" and completion.ttft_s is not None
    message = completion.to_message()
    assert message["content"] == "" and message["reasoning_content"] == "let me look" and len(message["tool_calls"]) == 2
    assert endpoint.requests[0]["model"] == "m" and endpoint.requests[0]["stream"] is True


async def test_fragments_without_index_continue_the_last_call():
    """Some servers leave out `index` after a call's first delta: a fragment with neither id nor
    name then belongs to the call before it, and a delta with a new id starts the next call."""
    stream = sse(delta(tool_calls=[{"id": "call_a", "function": {"name": "read", "arguments": "{\"file"}}]),
                 delta(tool_calls=[{"function": {"arguments": "Path\": \"a\"}"}}]),
                 delta(tool_calls=[{"id": "call_b", "function": {"name": "list", "arguments": ""}}]),
                 delta(tool_calls=[{"function": {"arguments": "{}"}}]), "[DONE]")
    with ScriptedEndpoint([raw_reply(stream)]) as endpoint:
        _, completion = await collect(endpoint)
    assert [(c.id, c.name, c.arguments) for c in completion.tool_calls] == [
        ("call_a", "read", '{"filePath": "a"}'), ("call_b", "list", "{}")]


async def test_a_call_without_id_gets_one():
    stream = sse(delta(tool_calls=[{"index": 0, "function": {"name": "list", "arguments": "{}"}}]), "[DONE]")
    with ScriptedEndpoint([raw_reply(stream)]) as endpoint:
        _, completion = await collect(endpoint)
    assert completion.tool_calls[0].id.startswith("call_") and completion.tool_calls[0].name == "list"


@pytest.mark.parametrize("reply, message", [
    (raw_reply(sse(delta(content="a"), {"error": {"message": "engine fell over"}}, "[DONE]")), "engine fell over"),
    (raw_reply(json.dumps({"error": {"message": "max_tokens: must be >= 1", "param": "max_tokens"}}), 400),
     "HTTP 400: max_tokens: must be >= 1"),
    (raw_reply("data: {not json\n\n"), "not JSON"),
])
async def test_errors_name_the_problem(reply, message):
    with ScriptedEndpoint([reply]) as endpoint:
        with pytest.raises(EndpointError, match=re.escape(message)):
            await collect(endpoint)


@pytest.mark.parametrize("line_end", ["\n", "\r\n", "\r"])
async def test_a_stream_splits_only_where_sse_ends_a_line(line_end):
    """U+2028, U+0085 and the other str.splitlines breaks are text inside an event (a server may write them raw in
    its JSON); CR, LF and CRLF end lines."""
    arguments = '{"path": "a\u2028b\x85c\u2029d\x0ce"}'
    stream = sse(delta(content="x\u2028y"), delta(tool_calls=[{"index": 0, "id": "c1", "function": {
        "name": "write", "arguments": arguments}}]), "[DONE]")
    stream = stream.replace("\\u2028", "\u2028").replace("\\u0085", "\x85").replace("\\u2029", "\u2029")
    with ScriptedEndpoint([raw_reply(stream.replace("\n", line_end))]) as endpoint:
        _, completion = await collect(endpoint)
    assert completion.content == "x\u2028y" and completion.tool_calls[0].arguments == arguments


async def test_model_comes_from_v1_models_when_not_given():
    with ScriptedEndpoint([]) as endpoint:
        client = ChatClient(endpoint.url)
        assert await client.resolve_model() == "scripted-model"
        assert kv_usage(await client.metrics_text()) == 0.25
        await client.aclose()


def test_split_endpoint():
    assert split_endpoint("http://h:1/v1/") == ("http://h:1", "http://h:1/v1")
    assert split_endpoint("https://h") == ("https://h", "https://h/v1")
    with pytest.raises(ValueError, match="expected an http"):
        split_endpoint("h:1")


def test_kv_usage_reads_either_shape():
    northcode = "# HELP x\nnorthcode_kv_pages_used 30.0\nnorthcode_kv_pages_total 120.0\n"
    vllm = 'vllm:kv_cache_usage_perc{model_name="m"} 0.4\n'
    assert kv_usage(northcode) == 0.25 and kv_usage(vllm) == 0.4 and kv_usage("other_metric 1\n") is None


def test_mentions_attach_workspace_files_only(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    text, attached = expand_mentions("see @src/a.py and @../etc/passwd, mail me@host.com, @missing.py", Workspace(tmp_path))
    assert attached == ["src/a.py"] and text.endswith("Contents of src/a.py:\n```\nx = 1\n```")
    assert text.startswith("see @src/a.py and @../etc/passwd, mail me@host.com, @missing.py\n\n")


async def test_approvals_by_mode_and_session():
    asked = []

    async def ask(call):
        asked.append(call.title)
        return Decision.ALLOW_SESSION

    async def noop():
        return ""

    edit = PreparedCall("edit", "edit", "edit a", "diff", noop)
    shell = PreparedCall("bash", "shell", "bash: ls", "ls", noop)
    other_shell = PreparedCall("bash", "shell", "bash: rm -rf x", "rm -rf x", noop)
    approvals = Approvals(Mode.ASK, ask)
    assert (await approvals.decide(PreparedCall("read", "read", "read a", "", noop)))[0] and asked == []
    assert (await approvals.decide(edit))[0] and (await approvals.decide(edit))[0] and asked == ["edit a"]
    assert (await approvals.decide(shell))[0] and (await approvals.decide(shell))[0]
    assert (await approvals.decide(other_shell))[0] and asked == ["edit a", "bash: ls", "bash: rm -rf x"]
    headless = Approvals(Mode.AUTO_EDIT, None)
    assert (await headless.decide(edit))[0] and not (await headless.decide(shell))[0]
    assert (await Approvals(Mode.FULL_AUTO, None).decide(shell))[0]
    approvals.mode = Mode.PLAN  # read-only: the session's approvals do not reach past it, and nothing is asked
    assert not (await approvals.decide(edit))[0] and not (await approvals.decide(shell))[0]
    assert (await approvals.decide(PreparedCall("todowrite", "todo", "todowrite", "", noop)))[0]
    assert len(asked) == 3
    assert Mode.ASK.next() is Mode.AUTO_EDIT and Mode.FULL_AUTO.next() is Mode.PLAN and Mode.PLAN.next() is Mode.ASK
    with pytest.raises(ValueError, match="expected one of plan, ask, auto-edit, full-auto"):
        Mode.parse("yolo")


async def test_a_denial_carries_the_users_note_to_the_model():
    answers = [Answer(Decision.DENY, "  use pathlib instead "), Answer(Decision.DENY), Decision.DENY,
               Answer(Decision.ALLOW_ONCE, "ignored")]

    async def ask(call):
        return answers.pop(0)

    async def noop():
        return ""

    approvals = Approvals(Mode.ASK, ask)
    edit = PreparedCall("edit", "edit", "edit a", "diff", noop)
    assert await approvals.decide(edit) == (False, "denied by the user, who says: use pathlib instead", None)
    assert await approvals.decide(edit) == (False, "denied by the user", None)
    assert await approvals.decide(edit) == (False, "denied by the user", None)
    assert await approvals.decide(edit) == (True, "allow once", None)


async def test_an_edit_allowed_with_some_of_its_hunks():
    from northcode.agent.hunks import diff_hunks

    answers = [Answer(Decision.ALLOW_ONCE, hunks=frozenset({1})), Answer(Decision.ALLOW_ONCE, hunks=frozenset({0, 1}))]

    async def ask(call):
        return answers.pop(0)

    async def noop():
        return ""

    before = "".join(f"{n}\n" for n in range(20))
    hunks = diff_hunks(before, before.replace("1\n", "one\n", 1).replace("18\n", "eighteen\n"))
    edit = PreparedCall("edit", "edit", "edit a", "diff", noop, hunks)
    assert await Approvals(Mode.ASK, ask).decide(edit) == (True, "some hunks allowed by the user", frozenset({1}))
    assert await Approvals(Mode.ASK, ask).decide(edit) == (True, "allow once", None)  # all of them: the whole call


async def test_connect_starts_a_background_server_and_reports_its_phases(tiny_checkpoint):
    from northcode_serve_process import free_port

    from northcode.agent import server_process

    phases: list[str] = []
    address = f"http://127.0.0.1:{free_port()}"
    try:
        root = await server_process.connect(None, tiny_checkpoint, phases.append, timeout_s=120, address=address)
        assert root == address
        assert phases[0].startswith(f"started northcode serve on {address}") and phases[-1] == "ready"
        again: list[str] = []  # a second app finds the running server instead of starting another
        assert await server_process.connect(None, None, again.append, address=address) == root
        assert await server_process.connect(None, tiny_checkpoint, again.append, address=address) == root
        assert again == ["ready", "ready"]
        other = tiny_checkpoint.parent / "other-model"  # asking for another checkpoint is an error, not a substitute
        with pytest.raises(EndpointError, match=re.escape(f"serves {tiny_checkpoint.name} (tiny preset, RANDOM WEIGHTS")
                           + ".*" + re.escape(f"not --model {other}")):
            await server_process.connect(None, other, again.append, address=address)
        card = httpx.get(root + "/v1/models").json()["data"][0]  # what a client that did not start it sees
        assert server_process.model_label(card).endswith("RANDOM WEIGHTS: output is noise)")
        assert server_process.has_random_weights(card)
        assert not list(paths.data_dir().glob("serve-*.json"))  # no private record: /v1/models says it all
    finally:  # the server outlives its starter by design: stop it whatever failed
        for match in filter(None, (re.search(r"\(pid (\d+)", phase) for phase in phases)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(match.group(1)), signal.SIGTERM)


def test_model_label_and_random_weights_from_other_servers(tiny_checkpoint, tmp_path):
    from northcode.agent.server_process import has_random_weights, model_label

    vllm = {"id": "qwen-coder", "root": "Qwen/Qwen2.5-Coder-7B-Instruct", "max_model_len": 32768}
    assert model_label(vllm) == "qwen-coder" and not has_random_weights(vllm)
    real = tmp_path / "North-Mini-Code-1.0"
    real.mkdir()
    (real / "config.json").write_text("{}")
    assert model_label({"id": "x", "root": str(real)}) == "North-Mini-Code-1.0" and not has_random_weights({"root": str(real)})
    assert has_random_weights({"id": "x", "root": str(tiny_checkpoint)})  # an older northcode serve: no flag
    assert has_random_weights({"id": "x", "random_weights": True, "display_name": "far away"})
    assert model_label({"id": "x", "display_name": "far away"}) == "far away"


async def test_connect_to_a_dead_endpoint_fails_clearly():
    from northcode_serve_process import free_port

    from northcode.agent import server_process

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EndpointError, match=f"--endpoint {url}: no server"):
        await server_process.connect(url, None, lambda phase: None)


@pytest.mark.parametrize("command", ["sudo apt install x", "ls && sudo rm x", "rm -rf /", "rm -rf ~/x", "rm -fr ../up",
                                     "rm -r -f $HOME", "git push --force origin main", "git push -f",
                                     "dd if=x of=/dev/sda", "mkfs.ext4 /dev/sdb1"])
async def test_dangerous_commands_ask_even_in_full_auto(command):
    from northcode.agent.approvals import is_dangerous

    asked = []

    async def ask(call):
        asked.append(call)
        return Decision.ALLOW_SESSION

    async def noop():
        return ""

    assert is_dangerous(command)
    approvals = Approvals(Mode.FULL_AUTO, ask)
    call = PreparedCall("bash", "shell", f"bash: {command}", command, noop)
    assert (await approvals.decide(call))[0] and (await approvals.decide(call))[0]
    assert len(asked) == 2  # "for this session" does not stick for these
    assert not (await Approvals(Mode.FULL_AUTO, None).decide(call))[0]


@pytest.mark.parametrize("command", ["rm -rf build", "rm -rf ./dist", "git push", "pytest -q", "sudoku --solve",
                                     "echo rm -rf", "dd if=a of=b"])
def test_ordinary_commands_are_not_dangerous(command):
    from northcode.agent.approvals import is_dangerous

    assert not is_dangerous(command)


async def test_a_server_that_is_not_openai_compatible_is_named():
    with ScriptedEndpoint([]) as endpoint:
        client = ChatClient(endpoint.url)
        client.base_url = endpoint.url + "/metrics?path="  # /models then lands on a 200 answer in plain text
        with pytest.raises(EndpointError, match="not JSON"):
            await client.list_models()
        await client.aclose()
