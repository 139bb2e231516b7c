"""Runs one shell command for the `bash` tool: own process group, timeout, capped output.

The command runs in a new session (its own process group), so a timeout or a cancel (Esc)
kills the whole group, children included, not just the shell. Output (stdout and stderr
merged) streams to a file; the model gets the head and the larger tail of it when it is
longer than the cap, plus the file's path so it can page through the rest.
This module does not decide whether a command may run (approvals.py does).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

MAX_OUTPUT_BYTES = 30_000  # what the model sees at most: head third + tail two thirds
MAX_OUTPUT_LINES = 2_000


@dataclass
class ShellResult:
    exit_code: int | None  # None when killed (timeout or cancel)
    output: str  # capped text for the model
    timed_out: bool
    duration_s: float
    full_output_path: Path | None  # set when the output was cut


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # pgid == pid: started with start_new_session
    except ProcessLookupError:
        pass


def _capped_text(path: Path) -> tuple[str, bool]:
    """The output file as text for the model (head + tail when too long) and whether it was cut."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > MAX_OUTPUT_BYTES:
            head = f.read(MAX_OUTPUT_BYTES // 3).decode("utf-8", errors="replace")
            f.seek(size - 2 * MAX_OUTPUT_BYTES // 3)
            tail = f.read().decode("utf-8", errors="replace")
            num_cut = size - MAX_OUTPUT_BYTES // 3 - 2 * MAX_OUTPUT_BYTES // 3
            return f"{head}\n... [{num_cut} bytes cut; full output in {path}] ...\n{tail}", True
        text = f.read().decode("utf-8", errors="replace")
    lines = text.splitlines(keepends=True)
    if len(lines) <= MAX_OUTPUT_LINES:
        return text, False
    head_lines, tail_lines = lines[: MAX_OUTPUT_LINES // 3], lines[-(2 * MAX_OUTPUT_LINES // 3) :]
    num_cut = len(lines) - len(head_lines) - len(tail_lines)
    cut_note = f"... [{num_cut} lines cut; full output in {path}] ...\n"
    return "".join(head_lines) + cut_note + "".join(tail_lines), True


async def run_shell(command: str, cwd: Path, timeout_s: float, spill_dir: Path) -> ShellResult:
    """Run `command` with bash in `cwd`; on timeout or cancellation the process group dies."""
    spill_dir.mkdir(parents=True, exist_ok=True)
    out_path = spill_dir / f"bash-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.log"
    start = time.monotonic()
    timed_out = False
    with open(out_path, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            await proc.wait()
            raise
        finally:
            _kill_group(proc.pid)  # also reaps background children left by a finished shell
        await proc.wait()
    text, was_cut = _capped_text(out_path)
    if not was_cut:
        out_path.unlink()
    exit_code = None if timed_out else proc.returncode
    return ShellResult(exit_code, text, timed_out, time.monotonic() - start, out_path if was_cut else None)
