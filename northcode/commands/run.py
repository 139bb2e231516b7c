"""`northcode run -p "task"`: the agent loop without the UI, for scripts.

The final answer goes to stdout (or, with --json, one JSON transcript: the messages, the
answer, why the run stopped, token usage; with --output-format stream-json, one JSON event per
line as it happens, agent/stream_json.py); progress (server start-up, the MCP servers, tool calls) goes to stderr.
The workspace's MCP servers (agent/mcp_servers.py) start beside the model server's connection; one that fails is
said on stderr and the run goes on without it; a workspace's own servers start only once approved in the app
(agent/mcp_trust.py) or with --trust-mcp. No one can answer approval questions here, so calls that would ask
are denied and the model is told why: pick --mode auto-edit or full-auto to let it edit, or full-auto to run
commands and MCP tools. --tool-choice forces the run's first model call (a tool, or none); the calls after it are the
model's choice, so a forced call cannot repeat until the step limit.
Exit codes: 0 done, 1 the endpoint failed, 2 bad input, 3 step limit reached, 4 the answer was
cut off by the token limit inside a tool call (which was not run), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

HELP = "run the agent headless on a task: northcode run -p 'task'"
EXIT_OK, EXIT_ENDPOINT, EXIT_STEP_LIMIT, EXIT_TRUNCATED_CALL = 0, 1, 3, 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-p", "--prompt", required=True, help="the task (use - to read it from stdin)")
    parser.add_argument("--mode", default="auto-edit", choices=["plan", "ask", "auto-edit", "full-auto"],
                        help="plan: read-only, edits and commands refused; ask: only reads run; auto-edit (default): "
                             "reads and edits; full-auto: also shell commands and MCP tools")
    parser.add_argument("--json", action="store_true", help="print a JSON transcript instead of the answer "
                                                            "(--output-format json)")
    parser.add_argument("--output-format", choices=["text", "json", "stream-json"],
                        help="text (default): the answer; json: the transcript; stream-json: one JSON event per "
                             "line as it happens (Claude Code's shape)")
    parser.add_argument("--endpoint", help="an OpenAI-compatible server (default: northcode serve on 127.0.0.1:8000, "
                                           "started in the background if needed)")
    parser.add_argument("--model", type=Path, help="checkpoint folder for the server northcode starts")
    parser.add_argument("--max-steps", type=int, default=25, help="model calls at most (default 25)")
    parser.add_argument("--trust-mcp", action="store_true", help="start the MCP servers the workspace's files "
                                                                 "configure even if not approved in the app (this run)")
    parser.add_argument("--max-tokens", type=int, help="tokens per model answer at most (default: the server's)")
    parser.add_argument("--tool-choice", metavar="CHOICE",
                        help="the first model call's tool_choice: auto (default), required (it must call a tool), none, "
                             "or a tool's name (it must call that tool); the later calls are the model's choice")
    parser.add_argument("--reasoning-effort", choices=["none", "low", "medium", "high"],
                        help="sent as reasoning_effort (default: the server's, thinking on); none turns thinking off")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("-s", "--session", metavar="ID", help="continue a saved session (its id is in the --json output)")
    resume.add_argument("-c", "--continue", dest="continue_last", action="store_true",
                        help="continue this workspace's most recent session")
    parser.add_argument("path", nargs="?", default=".", type=Path, help="the workspace (default: this folder)")


CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but \t and \n, and DEL


def _for_terminal(text: str, stream) -> str:
    """Model and tool text with its control characters (ESC sequences could drive the terminal)
    shown as U+FFFD when `stream` is a terminal; piped output stays byte-exact."""
    return CONTROL_CHARS.sub("\ufffd", text) if stream.isatty() else text


def _progress(text: str) -> None:
    print(_for_terminal(text, sys.stderr), file=sys.stderr, flush=True)


def _print_line(line: str) -> None:
    print(line, flush=True)  # flushed: a reader of the pipe sees each event as it happens


def _on_event(event) -> None:
    from northcode.agent.client import Completion
    from northcode.agent.loop import CompactEvent, ToolEvent

    if isinstance(event, CompactEvent):
        if event.summary is None and event.error is None:
            _progress(f"northcode run: the context is filling (about {event.context_used} tokens): compacting "
                      "the conversation before going on")
        elif event.error is not None:
            _progress(f"northcode run: compacting failed, going on without it: {event.error}")
        else:
            _progress(f"northcode run: compacted {event.num_messages} messages into the first request and a summary")
    elif isinstance(event, ToolEvent):
        if event.output is None:
            _progress(f"→ {event.prepared.title if event.prepared else event.call.name}")
        elif event.ok and event.prepared is not None and event.prepared.name == "todowrite":  # the whole new list
            _progress("\n".join(f"  {line}" for line in event.output.splitlines()))
        else:
            first_line = event.output.strip().splitlines()[0][:120] if event.output.strip() else ""
            _progress(f"  {'✓' if event.ok else '✗'} {first_line}")
    elif isinstance(event, Completion) and event.usage:
        usage = event.usage
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        _progress(f"  [{usage.get('prompt_tokens')} prompt tokens ({cached} cached), "
                  f"{usage.get('completion_tokens')} generated]")


def _on_mcp_change(server) -> None:
    state = f"ready, {len(server.tools)} tools" if server.state == "ready" else f"{server.state}: {server.error}"
    _progress(f"northcode run: MCP server {server.name}: {state}")


def _output_format(args: argparse.Namespace) -> str:
    if args.json and args.output_format not in (None, "json"):
        raise ValueError(f"--json and --output-format {args.output_format}: choose one")
    return "json" if args.json else args.output_format or "text"


def _check(args: argparse.Namespace) -> str:
    _output_format(args)
    if args.max_steps < 1:
        raise ValueError(f"--max-steps {args.max_steps}: expected at least 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: expected at least 1")
    _tool_choice(args.tool_choice)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("--prompt: the task is empty")
    return prompt


def _tool_choice(choice: str | None) -> str | dict | None:
    """--tool-choice as OpenAI's tool_choice (a tool's name becomes a named function); ValueError."""
    from northcode.agent.mcp_servers import PREFIX as MCP_PREFIX
    from northcode.agent.tools import TOOL_KINDS

    if choice is None or choice in ("auto", "required", "none"):
        return choice
    if choice not in TOOL_KINDS and not choice.startswith(MCP_PREFIX):  # an MCP tool is checked by the server
        raise ValueError(f"--tool-choice {choice!r}: expected auto, required, none or a tool "
                         f"({', '.join(TOOL_KINDS)}, or {MCP_PREFIX}SERVER__TOOL)")
    return {"type": "function", "function": {"name": choice}}


async def _run(args: argparse.Namespace, prompt: str, stream) -> tuple[int, dict]:
    """The run, and its transcript; `stream` (a StreamJsonWriter, or None) gets every event as it happens."""
    from northcode import paths
    from northcode.agent.mcp_servers import workspace_servers
    from northcode.agent.mcp_trust import headless_refusal
    from northcode.agent.sandbox import Workspace
    from northcode.agent.sessions import SessionStore
    from northcode.agent.tools import ToolBox

    workspace = Workspace(args.path)
    model_dir = paths.resolve_model(args.model) if args.model is not None else None
    store = SessionStore()
    session_id = _session_to_continue(args, store, workspace.root)  # bad ids fail before any server starts
    mcp, mcp_errors = workspace_servers(workspace.root, _on_mcp_change)
    for error in mcp_errors:
        _progress(f"northcode run: MCP configuration: {error}")
    if untrusted := mcp.untrusted():
        if args.trust_mcp:
            mcp.trust()
        else:
            _progress(f"northcode run: {headless_refusal(untrusted, workspace.root)}")
    mcp_started = asyncio.ensure_future(mcp.start())  # beside the model server's connection
    toolbox = ToolBox(workspace, paths.data_dir() / "tool-output")
    toolbox.mcp = mcp
    try:
        return await _run_agent(args, prompt, stream, store, session_id, model_dir, toolbox, mcp_started)
    finally:
        mcp_started.cancel()
        await mcp.aclose()


async def _run_agent(args: argparse.Namespace, prompt: str, stream, store, session_id: str | None,
                     model_dir: Path | None, toolbox, mcp_started: asyncio.Future) -> tuple[int, dict]:
    """The run once the session and the workspace's MCP servers (starting in `mcp_started`) are known."""
    from northcode.agent.approvals import Approvals, Mode
    from northcode.agent.client import ChatClient, EndpointError
    from northcode.agent.loop import Agent
    from northcode.agent.served_model import describe_served_model
    from northcode.agent.server_process import connect
    from northcode.agent.sessions import SessionRecorder

    workspace = toolbox.workspace
    transcript: dict = {"workspace": str(workspace.root), "mode": args.mode, "ok": False, "error": None}
    client = None
    try:
        root = await connect(args.endpoint, model_dir, lambda phase: _progress(f"northcode run: server {phase}"))
        client = ChatClient(root)
        model = await describe_served_model(client)
    except EndpointError as err:
        transcript["error"] = str(err)
        store.close()
        if client is not None:
            await client.aclose()
        return EXIT_ENDPOINT, transcript
    served, label = model.model_id, model.label
    _progress(f"northcode run: {label} at {root}, workspace {workspace.root}, mode {args.mode}")
    if model.random_weights:
        _progress("northcode run: the model's weights are random: expect noise, not an answer (use --model DIR)")
    history = store.messages(session_id) if session_id else None
    recorder = SessionRecorder(store, workspace.root, served, session_id)
    params = {"max_tokens": args.max_tokens} if args.max_tokens else {}
    if args.reasoning_effort:
        params["reasoning_effort"] = args.reasoning_effort
    await mcp_started  # each MCP server is ready or failed (and said so) before the first request

    def on_message(message: dict) -> None:
        recorder.save(message)
        if stream is not None and stream.session_id is None and message.get("role") == "user":  # the session exists
            tools = [schema["function"]["name"] for schema in toolbox.schemas()]
            servers = [{"name": server.name, "status": server.state} for server in toolbox.mcp.servers.values()]
            stream.init(recorder.session_id, served, str(workspace.root), tools, args.mode, servers)

    def on_event(event) -> None:
        _on_event(event)
        if stream is not None:
            if stream.session_id is not None:  # after a compaction the run goes on in a new session
                stream.session_id = recorder.session_id
            stream.on_event(event)

    agent = Agent(client, toolbox, Approvals(Mode.parse(args.mode), ask=None), messages=history, max_steps=args.max_steps,
                  on_message=on_message, on_retract=recorder.retract, on_event=on_event, request_params=params,
                  context_window=model.context_window, on_compacted=recorder.restart,
                  first_tool_choice=_tool_choice(args.tool_choice))
    transcript.update(model=served, model_label=label, endpoint=root)
    try:
        result = await agent.run_turn(prompt)
    except EndpointError as err:
        transcript.update(error=str(err), messages=agent.messages, session_id=recorder.session_id)
        return EXIT_ENDPOINT, transcript
    finally:
        await client.aclose()
        store.close()
    transcript.update(session_id=recorder.session_id, messages=agent.messages)
    return _outcome(args, result, transcript), transcript


def _outcome(args: argparse.Namespace, result, transcript: dict) -> int:
    """Fill the transcript from the TurnResult; the exit code."""
    transcript.update(ok=result.stop_reason in ("done", "length"), answer=result.answer,
                      stop_reason=result.stop_reason, num_steps=result.num_steps, usage=result.usage)
    limit = "" if args.max_tokens is None else f" (--max-tokens {args.max_tokens})"
    if result.stop_reason == "length":
        _progress(f"northcode run: the answer was cut off at the token limit{limit}")
    last = result.last
    if result.stop_reason in ("done", "length") and last is not None and not last.content.strip():
        _progress("northcode run: the model only reasoned and gave no answer (its reasoning is in --json's messages)"
                  if last.reasoning.strip() else "northcode run: the model's answer was empty")
    if result.stop_reason == "step_limit":
        transcript["error"] = f"stopped at the step limit ({args.max_steps} model calls) before an answer"
        return EXIT_STEP_LIMIT
    if result.stop_reason == "tool_call_truncated":
        names = ", ".join(call.name or "?" for call in result.truncated_calls)
        transcript["error"] = (f"the answer was cut off at the token limit while the model was writing a tool call "
                               f"({names}); nothing was run{limit}")
        return EXIT_TRUNCATED_CALL
    return EXIT_OK


def _session_to_continue(args: argparse.Namespace, store, workspace_root: Path) -> str | None:
    if args.session:
        store.info(args.session)  # ValueError naming the id when there is no such session
        return args.session
    if args.continue_last:
        sessions = store.list(workspace_root)
        if not sessions:
            raise ValueError(f"--continue: no saved session for {workspace_root}")
        return sessions[0].id
    return None


def run(args: argparse.Namespace) -> int:
    from northcode.agent.stream_json import StreamJsonWriter

    prompt = _check(args)
    output = _output_format(args)
    stream = StreamJsonWriter(_print_line) if output == "stream-json" else None
    start = time.monotonic()
    code, transcript = asyncio.run(_run(args, prompt, stream))
    if stream is not None:
        stream.result(transcript, time.monotonic() - start)
    elif output == "json":
        print(json.dumps(transcript, indent=2, ensure_ascii=False))
    elif transcript.get("answer") is not None:
        print(_for_terminal(transcript["answer"], sys.stdout))
    if transcript["error"]:
        _progress(f"northcode run: error: {transcript['error']}")
    return code
