"""A new user's first requests, sent with the official `openai` package to a running `northcode serve`.

    python lab/serve_client_check.py http://127.0.0.1:8123/v1 [--backend megakernel]

Checks what a client sees: /v1/models names the backend, a chat completion, a streamed one, a tool-calling
request, eight requests at once (the batch the engine decodes together), a bad request answered 400 with a
message, and /metrics. Prints one line per check and exits 1 on the first one that fails. The demo checkpoint's
weights are random, so the checks are about the protocol, not the words.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx
import openai

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
HELLO = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        sys.exit(1)


async def eight_at_once(client: openai.AsyncOpenAI, model: str) -> tuple[list[int], float]:
    """Eight chat completions sent together: (completion tokens of each, seconds for all)."""
    start = time.perf_counter()
    replies = await asyncio.gather(*(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Count to {n}."}], max_tokens=48, temperature=0.7, seed=n)
        for n in range(8)))
    return [reply.usage.completion_tokens for reply in replies], time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base_url")
    parser.add_argument("--backend", help="the backend /v1/models must name")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=120)

    model = client.models.list().data[0]
    backend = getattr(model, "backend", None)
    check("models", not args.backend or backend == args.backend, f"id {model.id}, backend {backend}")

    start = time.perf_counter()
    reply = client.chat.completions.create(model=model.id, messages=HELLO, max_tokens=64, temperature=0)
    seconds = time.perf_counter() - start
    check("chat", reply.usage.completion_tokens > 0 and reply.choices[0].finish_reason in ("stop", "length"),
          f"{reply.usage.completion_tokens} tokens in {seconds:.2f} s, finish {reply.choices[0].finish_reason}")
    again = client.chat.completions.create(model=model.id, messages=HELLO, max_tokens=64, temperature=0)
    check("greedy repeats", again.choices[0].message.content == reply.choices[0].message.content,
          "the same prompt at temperature 0 gives the same text")

    pieces, finish = [], None
    for chunk in client.chat.completions.create(model=model.id, messages=HELLO, max_tokens=64, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    check("stream", "".join(pieces) == reply.choices[0].message.content and finish is not None,
          f"{len(pieces)} chunks, the same text as the plain reply, finish {finish}")

    tooled = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Read setup.py"}],
                                            tools=TOOLS, max_tokens=64)
    choice = tooled.choices[0]
    check("tools", choice.finish_reason in ("stop", "length", "tool_calls"),
          f"finish {choice.finish_reason}, tool calls {len(choice.message.tool_calls or [])} (random weights)")

    counts, seconds = asyncio.run(eight_at_once(
        openai.AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=120), model.id))
    check("eight at once", all(count > 0 for count in counts),
          f"{sum(counts)} tokens in {seconds:.2f} s ({sum(counts) / seconds:.0f} tok/s all together)")

    try:
        client.chat.completions.create(model=model.id, messages=HELLO, max_tokens=-5)
        check("bad request", False, "max_tokens=-5 was accepted")
    except openai.BadRequestError as err:
        check("bad request", True, f"400: {str(err)[:100]}")

    metrics = httpx.get(args.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    wanted = ("northcode_generation_tokens_total", "northcode_prompt_tokens_total",
              "northcode_cached_prompt_tokens_total")
    lines = [line for line in metrics.splitlines() if line.startswith(wanted)]
    check("metrics", bool(lines), "; ".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
