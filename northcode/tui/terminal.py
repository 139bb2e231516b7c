"""Where the app draws: the terminal, even when stderr is redirected (`northcode 2>log`).

Textual's Linux driver writes the screen to stderr. When stderr is a file or a pipe, the app
draws on stdout if that is a terminal, else on the controlling terminal (/dev/tty), so the log
gets log lines and the user gets the screen. Windows keeps Textual's own driver.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


class NoTerminalError(ValueError):
    """Neither stderr, stdout nor /dev/tty is a terminal to draw on."""


def drawing_stream(stderr: TextIO, stdout: TextIO, open_tty=lambda: open("/dev/tty", "w")) -> TextIO | None:
    """The stream to draw on: None for stderr (Textual's default), else stdout or the controlling terminal."""
    if stderr.isatty():
        return None
    if stdout.isatty():
        return stdout
    try:
        return open_tty()
    except OSError:
        raise NoTerminalError("no terminal to draw on: stderr and stdout are redirected and there is no "
                              "/dev/tty (use `northcode run` for scripts)") from None


def driver_class():
    """Textual's driver class that draws where drawing_stream says, or None for Textual's default."""
    if sys.platform == "win32":
        return None
    stream = drawing_stream(sys.__stderr__, sys.__stdout__)
    if stream is None:
        return None
    from textual.drivers.linux_driver import LinuxDriver

    class TerminalDriver(LinuxDriver):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._file = stream

        def _get_terminal_size(self) -> tuple[int, int]:
            try:
                return tuple(os.get_terminal_size(stream.fileno()))
            except OSError:
                return super()._get_terminal_size()

    return TerminalDriver
