"""`northcode [--model DIR] [--endpoint URL] [PATH]`: the terminal app on the workspace PATH.

Without --endpoint it uses the `northcode serve` running on 127.0.0.1:8000, or starts one in
the background (which keeps running after the app exits, like `ollama serve`). Without
--model that server loads the demo checkpoint, whose weights are random: the app says so.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HELP = "the terminal app for chat and agent sessions (the default)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="checkpoint folder for the server northcode starts "
                                                   "(default: the demo checkpoint, random weights)")
    parser.add_argument("--endpoint", help="any OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--mode", default="ask", choices=["plan", "ask", "auto-edit", "full-auto"],
                        help="plan: read-only, edits and commands refused; ask (default): reads run, edits and "
                             "commands ask; auto-edit: edits run too; "
                             "full-auto: everything runs")
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument("-r", "--resume", metavar="SESSION", help="resume a saved session by id")
    resume.add_argument("-c", "--continue", dest="continue_last", action="store_true",
                        help="resume this workspace's most recent session")
    parser.add_argument("path", nargs="?", default=".", type=Path, help="the workspace (default: this folder)")


def run(args: argparse.Namespace) -> int:
    from northcode import paths
    from northcode.agent.approvals import Mode
    from northcode.agent.client import split_endpoint
    from northcode.agent.sandbox import Workspace
    from northcode.agent.sessions import SessionStore
    from northcode.tui.app import NorthcodeApp
    from northcode.tui.terminal import driver_class

    workspace = Workspace(args.path)  # ValueError (a clear message) when PATH is not a folder
    if args.endpoint is not None:
        split_endpoint(args.endpoint)
    model_dir = paths.resolve_model(args.model) if args.model is not None else None
    store = SessionStore()
    resume = args.resume
    if resume is not None:
        store.info(resume)  # ValueError for an unknown id, before the screen opens
    if args.continue_last:
        sessions = store.list(workspace.root)
        if not sessions:
            raise ValueError(f"--continue: no saved session for {workspace.root}")
        resume = sessions[0].id
    driver = driver_class()  # draws on stdout or /dev/tty when stderr is redirected; NoTerminalError without either
    app = NorthcodeApp(workspace.root, endpoint=args.endpoint, model=model_dir, mode=Mode.parse(args.mode),
                       resume=resume, store=store, driver_class=driver)
    app.run()
    if app.session_id is not None:
        print(f"northcode: session {app.session_id} saved; `northcode -c` resumes it")
    if app.started_server is not None:  # "started northcode serve on URL (pid N, log FILE)"
        pid = re.search(r"\(pid (\d+)", app.started_server)
        print(f"northcode: {app.started_server.removeprefix('started ')} keeps running"
              + (f"; `kill {pid.group(1)}` stops it" if pid else ""))
    return 0
