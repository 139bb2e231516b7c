"""Where the app draws: on the terminal when stderr is redirected (`northcode 2>log`), in a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from agent_scripted_endpoint import ScriptedEndpoint

from northcode.tui.terminal import NoTerminalError, drawing_stream


class Stream(io.StringIO):
    def __init__(self, is_terminal: bool) -> None:
        super().__init__()
        self.is_terminal = is_terminal

    def isatty(self) -> bool:
        return self.is_terminal


def test_the_drawing_stream_is_stderr_then_stdout_then_the_controlling_terminal():
    tty = Stream(True)
    assert drawing_stream(Stream(True), Stream(True)) is None  # Textual's own: stderr
    stdout = Stream(True)
    assert drawing_stream(Stream(False), stdout) is stdout
    assert drawing_stream(Stream(False), Stream(False), open_tty=lambda: tty) is tty

    def no_tty():
        raise OSError("no controlling terminal")

    with pytest.raises(NoTerminalError, match="no terminal to draw on"):
        drawing_stream(Stream(False), Stream(False), open_tty=no_tty)


def read_until(fd: int, needle: bytes, timeout_s: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
    return seen


def test_northcode_2_to_a_log_still_draws_on_the_terminal(tmp_path):
    workspace = tmp_path / "project"
    workspace.mkdir()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    with ScriptedEndpoint([]) as endpoint, open(tmp_path / "log", "w") as log:
        command = [sys.executable, "-m", "northcode.cli", "--endpoint", endpoint.url, str(workspace)]
        process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=log, env=env, start_new_session=True)
        os.close(slave)
        try:
            screen = read_until(master, b"/help for keys", timeout_s=30)
            os.write(master, b"\x11")  # Ctrl+Q
            process.wait(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
            os.close(master)
    assert b"/help for keys" in screen and b"scripted-model" in screen
    assert "\x1b[" not in (tmp_path / "log").read_text()  # the log has no screen in it
