"""Runs a real `northcode serve` on a free loopback port for the TUI and `northcode run` tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen | None, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process is None or process.poll() is None, f"northcode serve exited with {process.returncode}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"northcode serve at {url} was not ready after {timeout_s} s")


@contextlib.contextmanager
def northcode_serve(model_dir, *extra_args: str):
    """Yields the server's root URL; the server (and its process group) is stopped afterwards. Its log goes to a
    temporary file, not a pipe: a pipe nobody reads blocks a server that logs more than its buffer."""
    port = free_port()
    command = [sys.executable, "-m", "northcode.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--device", "cpu", "--num-pages", "512", "--log-level", "warning", *extra_args]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, process)
            yield url
        finally:
            stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL 8 s later (within `timeout -k 10`, which device scripts use)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=8)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")
