"""Finds the `northcode serve` the app talks to, or starts one in the background, and waits for it.

One engine process owns the GPU, so the app never loads a model itself: it probes
http://127.0.0.1:8000/health (or the --endpoint given), and when nothing answers it starts
`northcode serve` as a detached process (its log in the data directory) that outlives the app,
the way `ollama run` starts `ollama serve`. While the server loads, /health answers 503 with
the loading phase; `wait_until_ready` reports each new phase through a callback. What the
server serves comes from its /v1/models entry (`root`, `display_name`, `random_weights`), so a
server northcode did not start is described as well as one it did.
"""

from __future__ import annotations

import asyncio
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


def start_server(model: Path | None, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> subprocess.Popen:
    """Start `northcode serve` detached (its own session: it keeps running after the app exits)."""
    command = [sys.executable, "-m", "northcode.cli", "serve", "--host", host, "--port", str(port),
               "--log-level", "warning"]  # not every /health and /metrics poll of the app
    if model is not None:
        command += ["--model", str(model)]
    log = open(serve_log_path(), "ab")
    log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
    log.flush()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()  # the child has its own copy of the descriptor
    return process


def _log_tail(num_lines: int = 15) -> str:
    try:
        return "\n".join(serve_log_path().read_text(errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


async def connect(endpoint: str | None, model: Path | None, on_phase: Callable[[str], None],
                  timeout_s: float = STARTUP_TIMEOUT_S, address: str = DEFAULT_ENDPOINT) -> str:
    """The endpoint root to use, ready to serve: the given one, the northcode serve running at
    `address`, or a new one started there. When `model` is asked for (and no endpoint), a
    running server that serves another checkpoint is an error, not a silent substitute."""
    root, _ = split_endpoint(endpoint or address)
    port = int(root.rsplit(":", 1)[-1]) if root.count(":") == 2 else 80
    async with httpx.AsyncClient() as http:
        health = await probe(root, http)
        process = None
        if not health.reachable:
            if endpoint is not None:
                raise EndpointError(f"--endpoint {endpoint}: {health.phase}")
            host = root.removeprefix("http://").split(":")[0]
            creates_demo = model is None and not (paths.demo_checkpoint_dir() / "config.json").is_file()
            process = start_server(model, host, port)
            on_phase(f"started northcode serve on {root} (pid {process.pid}, log {serve_log_path()})")
            if creates_demo:  # the server makes it before it listens: say what the wait is for
                on_phase(f"creating the demo checkpoint (random weights) in {paths.demo_checkpoint_dir()}…")
        await wait_until_ready(root, http, on_phase, process, timeout_s)
        if endpoint is None and model is not None:
            await check_served_model(root, http, model, port)
    return root


async def check_served_model(root: str, http: httpx.AsyncClient, model: Path, port: int) -> None:
    """EndpointError when the server at `root` says (vLLM's `root` field of /v1/models) that it
    serves a checkpoint folder other than `model`; silent when it does not say."""
    try:
        response = await http.get(root + "/v1/models", timeout=5.0)
        cards = response.json().get("data") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return
    folders = [card["root"] for card in cards or [] if isinstance(card, dict) and isinstance(card.get("root"), str)]
    if not folders or any(_same_folder(folder, model) for folder in folders):
        return
    card = next(card for card in cards if card.get("root") == folders[0])
    raise EndpointError(
        f"the server running at {root} serves {model_label(card)} from {folders[0]}, not --model {model}. "
        f"One server owns the GPU: stop that one to load {model.name} (it is the process listening on port {port}: "
        f"`lsof -ti tcp:{port} -s tcp:listen` prints its pid), or leave out --model to use it.")


def _same_folder(served: str, model: Path) -> bool:
    try:
        return Path(served).resolve() == model.expanduser().resolve()
    except OSError:
        return False


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


def model_label(card: dict) -> str:
    """The model's name as the app shows it, from its /v1/models entry: the server's
    `display_name` (northcode serve's says plainly when the weights are random), else the name of
    the checkpoint folder in `root` when it is on this machine, else the id it is served under."""
    display_name = card.get("display_name")
    if isinstance(display_name, str) and display_name.strip():
        return display_name.strip()
    root = card.get("root")
    if isinstance(root, str) and (Path(root) / "config.json").is_file():  # vLLM's field: the model's path
        return paths.model_display_name(root)
    return str(card.get("id"))


def has_random_weights(card: dict) -> bool:
    """Whether the served checkpoint is a demo or synthetic one (its answers are noise)."""
    if card.get("random_weights") is True:
        return True
    root = card.get("root")
    return isinstance(root, str) and (Path(root) / "config.json").is_file() and paths.synthetic_info(root) is not None
