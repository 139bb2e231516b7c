"""A real server on a free loopback port: `northcode serve` in its own process (the TUI, `northcode run` and soak
tests), or an app under uvicorn in a thread of the test (running_server)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import uvicorn


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


@contextlib.contextmanager
def running_server(app):
    """uvicorn on a free loopback port in a thread; log_config=None lets caplog see its log records."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
