"""The event loop never waits on one request (issue 24, point 4), against servers in their own processes.

What is timed is the server's event loop, not this process's threads: /health is asked of a real
`northcode serve` (the tiny checkpoint on the CPU), and a running stream is read from a server whose
engine sends a token every 10 ms without using the CPU (PacedEngine, this file run as a script), so
that its gaps are the server's alone. While a 5 MB chat request is parsed, rendered and tokenized
(then refused: it is far longer than the tiny model's context), /health must answer within 100 ms
and the stream must never pause for 100 ms; a body over the limit sent without Content-Length is
refused with a 413 as it streams in.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from northcode_serve_process import free_port, northcode_serve, wait_ready
from test_server import ScriptedEngine

from northcode.server.request_body import MAX_BODY_BYTES

LATENCY_LIMIT_S = 0.1


def stall_limit(request_s: float) -> float:
    """The longest pause allowed while the 5 MB request took request_s: 100 ms, or a tenth of the request where a
    loaded machine made it slower. A loop that did the request's work itself would pause for most of request_s."""
    return max(LATENCY_LIMIT_S, request_s / 10)
BIG_BYTES = 5 << 20


def code_text(num_bytes: int) -> str:
    """Source-code-like text (what an agent conversation is full of) of about num_bytes."""
    lines, size, i = [], 0, 0
    while size < num_bytes:
        line = f"    value_{i} = compute({i * 7919 % 10007}, 'item {i % 97}', flag={i % 3 == 0})  # step {i}\n"
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines)


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    with northcode_serve(tiny_checkpoint) as url:
        yield url


class PacedEngine(ScriptedEngine):
    """Sends its script a token every 10 ms and uses no CPU for it."""

    async def generate(self, request_id, prompt_ids, sampling):
        async for out in super().generate(request_id, prompt_ids, sampling):
            await asyncio.sleep(0.01)
            yield out


def serve_paced(port: int, model_dir: str) -> None:
    import uvicorn

    from northcode.model.tokenizer import Tokenizer
    from northcode.server.app import create_app
    from northcode.server.state import ServerOptions, ServerState

    engine = PacedEngine(model_dir, Tokenizer.from_dir(model_dir).encode("word " * 3000))
    uvicorn.run(create_app(ServerState(ServerOptions(), engine=engine)), host="127.0.0.1", port=port, log_level="warning")


@pytest.fixture(scope="module")
def paced_url(tiny_checkpoint):
    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, str(port), str(tiny_checkpoint)], start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", process)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)


def in_background(function) -> tuple[threading.Thread, dict]:
    """Runs function() in a thread; the dict gets its "result" (or "error") and "seconds"."""
    out: dict = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            out["result"] = function()
        except Exception as err:  # reported by the test's asserts
            out["error"] = err
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def health_latencies_while(thread: threading.Thread, url: str) -> list[float]:
    """Seconds each GET /health took, polled every 20 ms on one connection until `thread` ends."""
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as http:
        http.get("/health")  # connected before the timing starts
        while thread.is_alive():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)
    return latencies


@pytest.fixture(scope="module")
def big_body() -> bytes:
    """A 5 MB chat body, encoded once: building it while the timing runs would slow this process, not the server."""
    return json.dumps({"model": "x", "messages": [{"role": "user", "content": code_text(BIG_BYTES)}], "max_tokens": 1}).encode()


def post_big_chat(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=300)


def test_health_answers_within_100_ms_while_a_5_mb_request_is_in_flight(url, big_body):
    thread, out = in_background(lambda: post_big_chat(url, big_body))
    latencies = health_latencies_while(thread, url)
    response = out["result"]
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert max(latencies) < stall_limit(out["seconds"]), \
        f"/health took up to {max(latencies) * 1000:.0f} ms of the request's {out['seconds']:.2f} s"
    assert len(latencies) >= 10, f"the 5 MB request took only {out['seconds']:.2f} s: nothing was timed"


def test_a_running_stream_keeps_flowing_while_a_5_mb_request_is_in_flight(paced_url, big_body):
    url = paced_url
    body = {"model": "x", "messages": [{"role": "user", "content": "Count."}], "stream": True}
    gaps = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as stream:
        events = (line for line in stream.iter_lines() if line.startswith("data: "))
        next(events)  # the role chunk: the stream is running
        thread, out = in_background(lambda: post_big_chat(url, big_body))
        last = time.perf_counter()
        for event in events:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if not thread.is_alive() or event == "data: [DONE]":
                break  # leaving the block hangs up: the engine aborts the rest of the stream
        assert not thread.is_alive(), "the stream ended before the 5 MB request did: nothing was timed"
    assert out["result"].status_code == 400
    assert max(gaps) < stall_limit(out["seconds"]), \
        f"the stream stalled for {max(gaps) * 1000:.0f} ms of the request's {out['seconds']:.2f} s"
    assert len(gaps) >= 10


def test_a_body_over_the_limit_without_content_length_is_refused_as_it_streams_in(url):
    def chunks():
        for _ in range(4 * MAX_BODY_BYTES >> 20):  # 1 MB at a time, up to four times the limit
            yield b"x" * (1 << 20)

    thread, out = in_background(lambda: httpx.post(url + "/v1/chat/completions", content=chunks(), timeout=60,
                                                   headers={"content-type": "application/json"}))
    latencies = health_latencies_while(thread, url)
    response = out["result"]
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert str(MAX_BODY_BYTES) in response.json()["error"]["message"]
    assert max(latencies, default=0) < stall_limit(out["seconds"])


if __name__ == "__main__":  # python tests/test_server_latency.py PORT MODEL_DIR: the paced server
    serve_paced(int(sys.argv[1]), sys.argv[2])
