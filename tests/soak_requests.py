"""The soak's requests (tests/soak_server.py): random valid bodies over every sampling field, and one request's
trip with its checks (strict JSON, a stream that ends with [DONE] and holds no error event, a client that hangs up
in one of three ways). Nothing here starts or inspects a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx

SEED_MAX = 2**64 - 1  # SamplingParams takes signed and unsigned 64-bit seeds
LONG_MAX_TOKENS = 4096  # half the requests that hang up ask for this: an abort that is lost shows after the soak
WORDS = ("def class return import value list print sort file read write test loop the a of in for if else "
         "while async await yield lambda dict set tuple error raise try except with open path json").split()
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name in ("read_file", "write_file")]
FINISH_REASONS = {"stop", "length", "tool_calls"}
# every kind of parameter the soak draws; tests/test_soak.py checks that a run used each one
PARAMETER_KINDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "logprobs", "top_logprobs", "stop", "stream", "stream_options",
                   "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens", "echo",
                   "reasoning_effort", "response_format", "n", "user", "prompt_ids", "tool_history")
DISCONNECT_KINDS = ("close_stream", "cancel", "hang_up_in_body")


def _refuse(what):
    raise ValueError(f"not strict JSON: {what}")


def strict_loads(text: str | bytes):
    """json.loads that refuses NaN, Infinity and duplicate keys (ValueError)."""
    def unique(pairs: list) -> dict:
        return dict(pairs) if len({k for k, _ in pairs}) == len(pairs) else _refuse(f"duplicate keys {pairs}")
    return json.loads(text, parse_constant=_refuse, object_pairs_hook=unique)


# --- drawing requests ---


def draw_sampling(rng: random.Random, body: dict, chat: bool, max_seed: int) -> None:
    """Each sampling field present about half the time, at an edge of its range or inside it."""
    draws = {
        "temperature": lambda: rng.choice([0, 0.0, 1e-39, 5e-324, 1e-6, 0.3, 1.0, 2.0, 100.0, rng.uniform(0, 2)]),
        "top_p": lambda: rng.choice([1e-300, 0.05, 0.5, 0.95, 1.0, rng.uniform(1e-3, 1.0)]),
        "top_k": lambda: rng.choice([-1, 0, 1, 2, 40, 1000, 2**31, 2**63 - 1]),
        "min_p": lambda: rng.choice([0.0, 0.01, 0.2, 1.0]),
        "presence_penalty": lambda: rng.choice([-2.0, 0.0, 2.0, rng.uniform(-2, 2)]),
        "frequency_penalty": lambda: rng.choice([-2.0, 0.0, 2.0, rng.uniform(-2, 2)]),
        "repetition_penalty": lambda: rng.choice([1e-300, 0.5, 1.0, 1.3, 10.0]),
        "seed": lambda: rng.choice([0, 1, -2**63, 2**63 - 1, max_seed, rng.randint(-2**63, max_seed)]),
    }
    for name, draw in draws.items():
        if rng.random() < 0.5:
            body[name] = draw()
    if rng.random() < 0.3 and chat:
        body["logprobs"] = True
        if rng.random() < 0.5:
            body["top_logprobs"] = rng.randint(0, 20)
    elif rng.random() < 0.3 and not chat:
        body["logprobs"] = rng.randint(0, 20)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(["e", "\n", " the", "zz", ["a", "b"], ["", "zz"], ["ing", "x", ".", "q"]])
    if rng.random() < 0.1:
        body |= {"n": 1, "user": "soak"}
    limit = rng.choice([1, 2, rng.randint(1, 24), rng.randint(1, 24)])
    body["max_completion_tokens" if chat and rng.random() < 0.2 else "max_tokens"] = limit
    body["stream"] = rng.random() < 0.5
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": rng.random() < 0.7}


def draw_chat(rng: random.Random, text: str, body: dict) -> None:
    if rng.random() < 0.35:
        body["tools"] = TOOLS
        named = {"type": "function", "function": {"name": "write_file"}}
        choice = rng.choice([None, "auto", "none", "required", named])
        if choice is not None:
            body["tool_choice"] = choice
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = rng.random() < 0.5
    if rng.random() < 0.15:
        body["reasoning_effort"] = "none"
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_object"}
    messages = [{"role": "user", "content": text}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": "system", "content": "You are terse."})
    if "tools" in body and rng.random() < 0.3:  # a call and its result in the history
        call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
                     {"role": "user", "content": "and?"}]
    body["messages"] = messages


def draw_request(rng: random.Random, vocab_ids: list[int], max_seed: int, disconnect_share: float):
    """(path, body, disconnect) of one random valid request; disconnect is None or (kind, where): close a
    stream after `where` events, cancel after `where` seconds, or hang up halfway through the body."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    chat = rng.random() < 0.65
    body: dict = {"model": "north-mini-code"}
    draw_sampling(rng, body, chat, max_seed)
    if chat:
        draw_chat(rng, text, body)
    else:
        body["prompt"] = rng.sample(vocab_ids, rng.randint(1, min(30, len(vocab_ids)))) if rng.random() < 0.3 else text
        if rng.random() < 0.2:
            body["echo"] = True
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if rng.random() >= disconnect_share:
        return path, body, None
    kind = rng.choice(["close_stream", "close_stream", "cancel", "hang_up_in_body"] if body["stream"]
                      else ["cancel", "cancel", "hang_up_in_body"])
    if kind != "hang_up_in_body" and rng.random() < 0.5:
        body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = LONG_MAX_TOKENS
    return path, body, (kind, rng.randint(0, 6) if kind == "close_stream" else rng.uniform(0.0, 0.6))


def coverage_of(body: dict) -> set[str]:
    kinds = set(body) & set(PARAMETER_KINDS)
    if isinstance(body.get("prompt"), list):
        kinds.add("prompt_ids")
    if any(m.get("role") == "tool" for m in body.get("messages", [])):
        kinds.add("tool_history")
    return kinds


def greedy_references(vocab_ids: list[int]) -> list[tuple[str, dict]]:
    """Fixed greedy requests: a chat, a chat streamed with logprobs and tools, a completion streamed from ids."""
    common = {"model": "north-mini-code", "temperature": 0, "max_tokens": 16}
    return [
        ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "sort a list in python"}]}),
        ("/v1/chat/completions", {**common, "stream": True, "logprobs": True, "top_logprobs": 3, "tools": TOOLS,
                                  "messages": [{"role": "user", "content": "read a.py then fix it"}]}),
        ("/v1/completions", {**common, "stream": True, "stream_options": {"include_usage": True},
                             "prompt": vocab_ids[:12], "max_tokens": 24}),
    ]


# --- sending one request ---


@dataclass
class Outcome:
    label: str
    status: int | None = None  # None: the client hung up before a status line
    disconnected: str | None = None  # the disconnect kind, when it came before the response ended
    problems: list[str] = field(default_factory=list)
    latency_s: float = 0.0
    output: str = ""  # text, reasoning, calls (without their random ids) and finish_reason
    events: int = 0
    refused: bool = False  # the connection was refused: the server is gone


def check_choice(body: dict, data: dict, final: bool) -> list[str]:
    """Shape problems of a response body or stream event: an error, choices, usage and logprobs out of range."""
    if "error" in data:
        return [f"error: {data['error']}"]
    choices, usage, problems = data.get("choices"), data.get("usage"), []
    if not isinstance(choices, list) or len(choices) > 1 or (final and len(choices) != 1):
        return [f"choices = {choices!r}"]
    limit = body.get("max_tokens") or body.get("max_completion_tokens")
    if usage is not None and not (0 <= usage.get("completion_tokens", -1) <= limit and usage.get("prompt_tokens", 0)):
        problems.append(f"usage = {usage}")
    for choice in choices:
        if choice.get("finish_reason") not in FINISH_REASONS | {None}:
            problems.append(f"finish_reason = {choice['finish_reason']!r}")
        logprobs = choice.get("logprobs") or {}
        values = [e["logprob"] for e in logprobs.get("content") or []] + list(logprobs.get("token_logprobs") or [])
        if not all(isinstance(v, (int, float)) and v <= 0 for v in values):
            problems.append(f"logprobs = {values}")
    return problems


def add_output(data: dict, parts: dict) -> None:
    for choice in data.get("choices") or []:
        message = choice.get("message") or choice.get("delta") or {}
        parts["text"] += (choice.get("text") or "") + (message.get("content") or "")
        parts["reasoning"] += message.get("reasoning_content") or ""
        for call in message.get("tool_calls") or []:
            entry = parts["calls"].setdefault(str(call.get("index", len(parts["calls"]))), ["", ""])
            entry[0] += (call.get("function") or {}).get("name") or ""
            entry[1] += (call.get("function") or {}).get("arguments") or ""
        parts["finish"] = choice.get("finish_reason") or parts.get("finish")


async def read_stream(response: httpx.Response, body: dict, close_after: int | None, out: Outcome) -> None:
    parts, done, usage_seen = {"text": "", "reasoning": "", "calls": {}}, False, False
    async for line in response.aiter_lines():
        if close_after is not None and out.events >= close_after:
            out.disconnected = "close_stream"
            return
        if not line:
            continue
        if not line.startswith("data: ") or done:
            out.problems.append(f"SSE line {line[:80]!r}" + (" after [DONE]" if done else ""))
            continue
        out.events += 1
        if line == "data: [DONE]":
            done = True
            continue
        try:
            event = strict_loads(line[6:])
        except ValueError as err:
            out.problems.append(f"{err}: {line[:120]!r}")
            continue
        out.problems += check_choice(body, event, final=False)
        usage_seen |= event.get("usage") is not None and event.get("choices") == []
        add_output(event, parts)
    if not done or not parts.get("finish"):
        out.problems.append(f"the stream ended without {'[DONE]' if not done else 'a finish_reason'}")
    if (body.get("stream_options") or {}).get("include_usage") and not usage_seen:
        out.problems.append("include_usage: no usage chunk")
    out.output = json.dumps(parts, sort_keys=True)


async def exchange(client: httpx.AsyncClient, path: str, body: dict, close_after: int | None, out: Outcome) -> None:
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as response:
            out.status = response.status_code
            if response.status_code == 200:
                return await read_stream(response, body, close_after, out)
            content = await response.aread()
    else:
        response = await client.post(path, json=body)
        out.status, content = response.status_code, response.content
    try:
        data = strict_loads(content)
    except ValueError as err:
        out.problems.append(f"{err}: {content[:120]!r}")
        return
    if out.status != 200:
        out.problems.append(f"HTTP {out.status}: {str(data.get('error', data))[:300]}")
        return
    out.problems += check_choice(body, data, final=True)
    parts = {"text": "", "reasoning": "", "calls": {}}
    add_output(data, parts)
    out.output = json.dumps(parts, sort_keys=True)


async def hang_up_in_body(url: str, path: str, body: dict) -> None:
    """Send the headers and half the body, then close: the server must drop it quietly (its 499)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload[: len(payload) // 2])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def send(client: httpx.AsyncClient, url: str, path: str, body: dict, disconnect=None) -> Outcome:
    out = Outcome(("chat" if "messages" in body else "completion") + ("-stream" if body.get("stream") else ""))
    kind, where = disconnect or (None, None)
    start = time.perf_counter()
    try:
        if kind == "hang_up_in_body":
            await hang_up_in_body(url, path, body)
            out.disconnected = kind
        elif kind == "cancel":
            try:
                await asyncio.wait_for(exchange(client, path, body, None, out), timeout=where)
            except TimeoutError:
                out.disconnected = kind
        else:
            await exchange(client, path, body, where, out)
    except (httpx.HTTPError, OSError) as err:
        out.problems.append(f"{type(err).__name__}: {err}")
        out.refused = isinstance(err, (httpx.ConnectError, ConnectionRefusedError))
    out.latency_s = time.perf_counter() - start
    return out
