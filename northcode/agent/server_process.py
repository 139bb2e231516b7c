"""Finds the `northcode serve` the app talks to, or starts one in the background, and waits for it.

One engine process owns the GPU, so the app never loads a model itself: it probes
http://127.0.0.1:8000/health (or the --endpoint given), and when nothing answers it starts
`northcode serve` as a detached process (its log in the data directory) that outlives the app,
the way `ollama run` starts `ollama serve`. While the server loads, /health answers 503 with
the loading phase; `wait_until_ready` reports each new phase through a callback.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from northcode import paths
from northcode.agent.client import EndpointError, split_endpoint

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_ENDPOINT = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
STARTUP_TIMEOUT_S = 1800.0  # loading 60 GB of weights can take minutes


@dataclass
class Health:
    reachable: bool
    ready: bool
    phase: str  # "ready", the loading phase the server reports, or why it cannot be reached
    failed: bool = False  # the server reports that loading failed: waiting longer will not help


async def probe(root: str, http: httpx.AsyncClient) -> Health:
    """One look at GET /health: 200 is ready, 503 is loading (with its phase), else not usable."""
    try:
        response = await http.get(root + "/health", timeout=2.0)
    except httpx.HTTPError as err:
        return Health(False, False, f"no server at {root} ({type(err).__name__})")
    if response.status_code == 200:
        return Health(True, True, "ready")
    if response.status_code == 404:  # an OpenAI-compatible server without /health: assume it serves
        return Health(True, True, "ready (no /health)")
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("status") == "error":
        return Health(True, False, f"loading failed ({body.get('phase')}): {body.get('error')}", failed=True)
    return Health(True, False, _phase_of(response))


def _phase_of(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    if isinstance(body, dict):
        error = body.get("error")
        for value in (body.get("phase"), body.get("message"), error.get("message") if isinstance(error, dict) else error,
                      body.get("status")):
            if isinstance(value, str) and value:
                progress = body.get("progress")
                return f"{value} ({progress:.0%})" if isinstance(progress, (int, float)) and progress <= 1 else value
    return f"HTTP {response.status_code}"


def serve_log_path() -> Path:
    return paths.data_dir() / "serve.log"


def _record_path(port: int) -> Path:
    return paths.data_dir() / f"serve-{port}.json"  # which model the server northcode started there loads


def _recorded_model(port: int) -> Path | None:
    """The model folder of the server northcode started on `port`, if that process still runs."""
    try:
        record = json.loads(_record_path(port).read_text())
        os.kill(int(record["pid"]), 0)
        return Path(record["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_server(model: Path | None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> subprocess.Popen:
    """Start `northcode serve` detached (its own session: it keeps running after the app exits)."""
    command = [sys.executable, "-m", "northcode.cli", "serve", "--host", host, "--port", str(port)]
    if model is not None:
        command += ["--model", str(model)]
    log = open(serve_log_path(), "ab")
    log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
    log.flush()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    model_dir = model if model is not None else paths.demo_checkpoint_dir()
    _record_path(port).write_text(json.dumps({"pid": process.pid, "model": str(model_dir)}))
    return process


def _log_tail(num_lines: int = 15) -> str:
    try:
        return "\n".join(serve_log_path().read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


async def connect(endpoint: str | None, model: Path | None, on_phase: Callable[[str], None],
                  timeout_s: float = STARTUP_TIMEOUT_S, address: str = DEFAULT_ENDPOINT) -> tuple[str, Path | None]:
    """The endpoint root to use, ready to serve (the given one, a running northcode serve, or a new
    one), and the checkpoint folder that server loads when northcode started it (now or earlier)."""
    root, _ = split_endpoint(endpoint or address)
    port = int(root.rsplit(":", 1)[-1]) if root.count(":") == 2 else 80
    async with httpx.AsyncClient() as http:
        health = await probe(root, http)
        process = None
        if not health.reachable:
            if endpoint is not None:
                raise EndpointError(f"--endpoint {endpoint}: {health.phase}")
            host = root.removeprefix("http://").split(":")[0]
            process = start_server(model, host, port)
            on_phase(f"started northcode serve on {root} (pid {process.pid}, log {serve_log_path()})")
        await wait_until_ready(root, http, on_phase, process, timeout_s)
    if endpoint is not None:
        return root, model
    recorded = _recorded_model(port)
    if model is not None and recorded is not None and recorded.resolve() != model.resolve():
        on_phase(f"the running server loads {recorded}, not {model}: stop it to switch models")
    return root, recorded or model


async def wait_until_ready(root: str, http: httpx.AsyncClient, on_phase: Callable[[str], None],
                           process: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last_phase = None
    while True:
        health = await probe(root, http)
        if health.ready:
            on_phase("ready")
            return
        if health.failed:
            raise EndpointError(f"{root}: {health.phase}")
        if process is not None and process.poll() is not None:
            raise EndpointError(f"northcode serve exited with code {process.returncode} while loading:\n{_log_tail()}")
        if health.phase != last_phase and (health.reachable or process is None):
            on_phase(health.phase)
            last_phase = health.phase
        if time.monotonic() > deadline:
            raise EndpointError(f"{root} was not ready after {timeout_s:.0f} s (last: {health.phase})")
        await asyncio.sleep(0.25)


def model_label(card: dict, model: Path | None) -> str:
    """The model's name as the app shows it: from the checkpoint folder when known (which says
    plainly when the weights are random), else the id the endpoint serves it under."""
    root = card.get("root")
    if isinstance(root, str) and (Path(root) / "config.json").is_file():  # vLLM's field: the model's path
        return paths.model_display_name(root)
    if model is not None:
        return paths.model_display_name(model)
    return str(card.get("id"))
