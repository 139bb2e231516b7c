"""Soak a real `northcode serve` (issue 24, point 5): concurrent clients send random valid requests, some hang up.

    python -m tests.soak_server [--requests 1000 | --duration 300] [--clients 8] [--url URL] [--backend B] ...

Without --url it starts `northcode serve` on a free loopback port (the demo checkpoint unless --model; NORTHCODE_HOME
a temporary folder unless set; more serve options as --server-arg=--device=cpu). Every request is valid (drawn
from a seeded random.Random), so each must get a 200; every body and SSE event must be strict JSON; a stream ends
with [DONE] and holds no error event. Greedy references are sent alone, then under load: the same text. After
the soak no request may hold a page: /metrics' northcode_kv_pages_used counts pages with a reference (PagePool
counts cached-but-free pages as free), so it must be back at its idle value, with no request running, waiting or
held by the server; the server's VmRSS (/proc/PID/status, PID from /health) may grow by at most the RSS bound
after the warm-up. --extremes and --inject-step-failure run first (check_extremes, serve_with_fault_switch).
It prints a table and exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a script: the repository root on sys.path, for `tests.` and `northcode`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from tests.northcode_serve_process import free_port, metric, stop, wait_ready
from tests.soak_requests import SEED_MAX, WORDS, Outcome, coverage_of, draw_request, greedy_references, send

# Flat: allocator noise (glibc arenas, torch's caches for new batch and prefill shapes) was +2 to +11 MiB over
# 800-1000 requests on the tiny model (CPU, ~450 MiB); a leak of one request's state (its sequence, text, logprobs:
# 10-100 KB) over a thousand requests passes the bound. The relative part is for a big model's larger, noisier heap.
RSS_GROWTH_BYTES, RSS_GROWTH_SHARE = 64 << 20, 0.10
WARMUP_SHARE = 0.2  # of the requests (or of the time) before RSS's baseline
REFERENCE_EVERY = 20  # every 20th request of the soak is a greedy reference
IDLE_WAIT_S = 5.0  # an abort takes effect at the engine's next step; 4,096 tokens take longer (on a CPU)
END_RESERVE_S = 25.0  # of --budget-s, for the checks after the soak and the server's stop
IDLE_GAUGES = ("northcode_requests_running", "northcode_requests_waiting", "northcode_requests_in_server",
               "northcode_kv_pages_used")


# --- the server ---


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process on this machine, or None (another machine, or it has exited)."""
    try:
        found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def serve_with_fault_switch(serve_args: list[str]) -> int:
    """`northcode serve` in this process, where SIGUSR1 makes the next model step raise (once per signal).

    northcode has no fault-injection hook, so the failure is raised where tests/gpu/test_engine_recovery_gpu.py
    raises it, in the backends' model step (TorchBackend.decode_logits, which both of its decode paths call, and
    MegakernelBackend.launch_step, likewise): the engine gets what a failed launch gives it, an exception from
    the step, and all that follows (the request's error, the backend's rebuild, the next request) is the server's."""
    from northcode.cli import main
    from northcode.megakernel.backend import MegakernelBackend
    from northcode.torch_backend.backend import TorchBackend

    armed: list[bool] = []
    signal.signal(signal.SIGUSR1, lambda *_: armed.append(True))

    def failing(real):
        def step(self, *args, **kwargs):
            if armed:
                armed.clear()
                print("soak_server: injected step failure", file=sys.stderr, flush=True)
                raise RuntimeError("injected: the model step failed (tests/soak_server.py, SIGUSR1)")
            return real(self, *args, **kwargs)
        return step

    for cls, name in ((TorchBackend, "decode_logits"), (MegakernelBackend, "launch_step")):
        setattr(cls, name, failing(getattr(cls, name)))
    return main(["serve", *serve_args])


@contextlib.contextmanager
def started_server(args: argparse.Namespace):
    """Yields (url, log path) of a `northcode serve` on a free loopback port; stopped with its process group."""
    port = free_port()
    serve_args = ["--port", str(port), "--backend", args.backend, "--log-level", "warning", *args.server_arg]
    serve_args += ["--model", str(args.model)] if args.model else []
    launcher = [sys.executable, str(Path(__file__).resolve()), "serve-with-fault-switch"] if args.inject_step_failure \
        else [sys.executable, "-m", "northcode.cli", "serve"]
    log_path = Path(args.server_log or tempfile.mkstemp(prefix="northcode-soak-", suffix=".log")[1])
    temporary_home = contextlib.nullcontext(os.environ.get("NORTHCODE_HOME")) if os.environ.get("NORTHCODE_HOME") \
        else tempfile.TemporaryDirectory(prefix="northcode-soak-home-")
    with temporary_home as home, open(log_path, "wb") as log:  # a file: a pipe nobody reads would block the server
        process = subprocess.Popen(launcher + serve_args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "NORTHCODE_HOME": home, "PYTHONUNBUFFERED": "1"},
                                   cwd=Path(__file__).resolve().parents[1])
        url = f"http://127.0.0.1:{port}"
        print(f"soak: starting {' '.join(launcher[1:] + serve_args)} at {url}, log {log_path}", file=sys.stderr,
              flush=True)
        try:
            wait_ready(url, process, timeout_s=args.ready_timeout)
            yield url, log_path
        finally:
            stop(process)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name with labels: value}."""
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in lines if line and line[0] != "#"}


def server_count(values: dict[str, float], status: str) -> float:
    """Responses the server counted with a status that starts with `status` (all endpoints)."""
    return sum(v for k, v in values.items() if k.startswith("northcode_requests_total{") and f'status="{status}' in k)


def wait_idle(url: str, idle_pages: float) -> dict[str, float]:
    """The idle gauges once nothing is running and the pages are back at idle_pages, or after IDLE_WAIT_S."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while True:
        values = {name: metric(url, name) for name in IDLE_GAUGES}
        if is_idle(values, idle_pages) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def is_idle(values: dict[str, float], idle_pages: float) -> bool:
    return values["northcode_kv_pages_used"] == idle_pages and not any(values[name] for name in IDLE_GAUGES[:3])


# --- the checks ---


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    coverage: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)
    references: list[tuple[int, bool]] = field(default_factory=list)  # (reference, equal to alone)
    rss: dict[str, int] = field(default_factory=dict)  # warm (after the warm-up), peak, end
    after: dict[str, float] = field(default_factory=dict)
    extremes: list[tuple[str, int | None, bool]] = field(default_factory=list)  # (name, status, ok)
    fault: dict[str, object] = field(default_factory=dict)
    soak_s: float = 0.0
    backend: str | None = None


@dataclass
class Soak:
    client: httpx.AsyncClient
    url: str
    pid: int
    vocab_ids: list[int]
    references: list[tuple[str, dict]]
    alone: list[str] = field(default_factory=list)  # each reference's output, sent alone
    report: Report = field(default_factory=Report)
    ends_at: float | None = None  # time.monotonic() at which the clients stop (a --duration soak)


def extreme_bodies(vocab_ids: list[int]) -> list[tuple[str, str, dict, bool]]:
    """(name, path, body, valid) at the edges of every sampling field, with 20 logprobs; a valid one must get a
    200, another a 200 or a 4xx (top_k and max_tokens past 2^63: the server takes 64-bit integers)."""
    cases = {
        "top_k 2^63": ({"top_k": 2**63, "temperature": 1.0, "seed": 1}, False),
        "top_k 2^63-1": ({"top_k": 2**63 - 1, "temperature": 1.0, "seed": 1}, True),
        "seed 0": ({"seed": 0, "temperature": 1.0}, True),
        "seed 2^64-1": ({"seed": 2**64 - 1, "temperature": 1.0}, True),
        "seed -2^63": ({"seed": -2**63, "temperature": 0.7}, True),
        "temperature 1e-39": ({"temperature": 1e-39}, True),
        "temperature 5e-324 top_k 3": ({"temperature": 5e-324, "top_k": 3}, True),
        "temperature 100": ({"temperature": 100.0, "seed": 3}, True),
        "top_p 1e-300": ({"top_p": 1e-300, "seed": 4}, True),
        "min_p 1": ({"min_p": 1.0, "seed": 5}, True),
        "penalties high": ({"repetition_penalty": 10.0, "presence_penalty": 2.0, "frequency_penalty": 2.0}, True),
        "penalties low": ({"repetition_penalty": 1e-300, "presence_penalty": -2.0, "frequency_penalty": -2.0}, True),
        "max_tokens 2^63-1": ({"max_tokens": 2**63 - 1, "temperature": 0}, True),
        "max_tokens 10^30": ({"max_tokens": 10**30}, False),
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20}
    completion = {"prompt": vocab_ids[:8], "stream": True, "logprobs": 20}
    kinds = (("chat", "/v1/chat/completions", chat), ("completion-stream", "/v1/completions", completion))
    return [(f"{kind} {name}", path, {"max_tokens": 12, **base, **params}, valid)
            for name, (params, valid) in cases.items() for kind, path, base in kinds]


async def check_extremes(soak: Soak) -> None:
    """Each extreme request beside a greedy reference stream: no 5xx, a 200 where valid, /health 200 after it,
    and the reference's text as alone."""
    client, url, report = soak.client, soak.url, soak.report
    for name, path, body, valid in extreme_bodies(soak.vocab_ids):
        extreme, beside = await asyncio.gather(send(client, url, path, body), send(client, url, *soak.references[1]))
        health = (await client.get("/health")).status_code
        ok = extreme.status == 200 and not extreme.problems or (not valid and 400 <= (extreme.status or 0) < 500)
        report.extremes.append((name, extreme.status, ok and health == 200))
        if not ok or health != 200:
            report.failures.append(f"extreme {name}: HTTP {extreme.status} {extreme.problems[:2]}, /health {health}")
        if beside.problems or beside.output != soak.alone[1]:
            report.failures.append(f"extreme {name}: the greedy stream beside it changed {beside.problems[:2]}")


async def check_injected_failure(soak: Soak) -> None:
    """SIGUSR1 to the server (serve_with_fault_switch) fails its next step: that request gets a 500 naming it,
    /health stays 200, and the next request gets the text it got before."""
    client, url, report = soak.client, soak.url, soak.report
    os.kill(soak.pid, signal.SIGUSR1)
    await asyncio.sleep(0.2)  # the handler runs on the server's main thread
    start = time.perf_counter()
    probe = {"messages": [{"role": "user", "content": "count to ten"}], "temperature": 0, "max_tokens": 16}
    for _ in range(3):  # a probe that ends on its first token (an end of turn) runs no decode step: again
        failed = await send(client, url, "/v1/chat/completions", probe)
        if failed.status != 200:
            break
    health = (await client.get("/health")).status_code
    again = await send(client, url, *soak.references[0])
    report.fault = {"failed_status": failed.status, "health": health, "next_status": again.status,
                    "recovered_s": round(time.perf_counter() - start, 2)}
    if failed.status != 500 or not any("injected" in p for p in failed.problems) or health != 200:
        report.failures.append(f"injected failure: HTTP {failed.status} {failed.problems[:1]}, then /health {health}")
    if again.status != 200 or again.problems or again.output != soak.alone[0]:
        report.failures.append(f"after the injected failure: HTTP {again.status} {again.problems[:2]}, "
                               f"the text as before: {again.output == soak.alone[0]}")


async def references_alone(soak: Soak) -> None:
    """Each greedy reference alone, twice (the second from the prefix cache): the texts the soak compares to."""
    for _ in range(2):
        outputs = [await send(soak.client, soak.url, *reference) for reference in soak.references]
        soak.report.failures += [f"greedy reference {i} alone: HTTP {o.status} {o.problems[:2]}"
                                 for i, o in enumerate(outputs) if o.status != 200 or o.problems]
        if soak.alone and [o.output for o in outputs] != soak.alone:
            soak.report.failures.append("greedy references alone: the second time (prefix cache warm) gave other text")
        soak.alone = soak.alone or [o.output for o in outputs]


def record(soak: Soak, index: int, out: Outcome, reference: int | None) -> None:
    report = soak.report
    report.outcomes.append(out)
    if reference is not None:
        report.references.append((reference, out.output == soak.alone[reference] and not out.problems))
        if not report.references[-1][1]:
            report.failures.append(f"request {index}: greedy reference {reference} under load gave {out.output[:200]} "
                                   f"(alone: {soak.alone[reference][:200]}) {out.problems[:2]}")
        return
    if out.disconnected:
        report.disconnects[out.disconnected] += 1
    if out.problems or (out.status is None and not out.disconnected):
        report.failures.append(f"request {index} ({out.label}, HTTP {out.status}): {'; '.join(out.problems)[:400]}")


async def clients(soak: Soak, args: argparse.Namespace) -> None:
    """args.clients workers send the drawn requests, one at a time each, until the count or the time is up."""
    rng, indices = random.Random(args.seed), iter(range(2**62))

    def next_request():
        index = next(indices)
        if soak.report.outcomes and soak.report.outcomes[-1].refused:  # the server is gone: stop
            return None
        if (soak.ends_at is None and index >= args.requests) or (soak.ends_at and time.monotonic() >= soak.ends_at):
            return None
        if index % REFERENCE_EVERY == REFERENCE_EVERY - 1:
            reference = index // REFERENCE_EVERY % len(soak.references)
            return index, reference, soak.references[reference]
        path, body, disconnect = draw_request(rng, soak.vocab_ids, args.max_seed, args.disconnect_share)
        soak.report.coverage.update(coverage_of(body))
        return index, None, (path, body, disconnect)

    async def worker() -> None:
        while (item := next_request()) is not None:
            index, reference, request = item
            record(soak, index, await send(soak.client, soak.url, *request), reference)

    await asyncio.gather(*[worker() for _ in range(args.clients)])


async def sample_rss(soak: Soak, args: argparse.Namespace) -> None:
    """RSS once the warm-up (the first WARMUP_SHARE of the requests or the time) is over, and its peak."""
    started = time.monotonic()
    while True:
        value = rss_bytes(soak.pid)
        warm = (time.monotonic() - started >= WARMUP_SHARE * (soak.ends_at - started)) if soak.ends_at \
            else len(soak.report.outcomes) >= WARMUP_SHARE * args.requests
        if value is not None and warm:
            soak.report.rss.setdefault("warm", value)
            soak.report.rss["peak"] = max(soak.report.rss.get("peak", 0), value)
        await asyncio.sleep(0.5)


async def run_checks(url: str, args: argparse.Namespace, log_path: Path | None) -> Report:
    """The references alone, the optional first checks, the soak and the checks after it; a server that stops
    answering is a failure in the report (so that the table still shows what ran)."""
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        health = (await client.get("/health")).json()
        tokens = (await client.post("/tokenize", json={"prompt": " ".join(WORDS)})).json()["tokens"]
        vocab_ids = sorted(set(tokens[1:]))
        soak = Soak(client, url, health["pid"], vocab_ids, greedy_references(vocab_ids))
        soak.report.backend = health.get("backend")
        try:
            await soak_and_check(soak, args, log_path)
        except httpx.HTTPError as err:
            soak.report.failures.append(f"the server stopped answering: {type(err).__name__}: {err}")
    return soak.report


async def soak_and_check(soak: Soak, args: argparse.Namespace, log_path: Path | None) -> None:
    url, report = soak.url, soak.report
    idle_pages = await asyncio.to_thread(metric, url, "northcode_kv_pages_used")
    await references_alone(soak)
    if args.extremes:
        await check_extremes(soak)
    if args.inject_step_failure:
        await check_injected_failure(soak)
    before, log_offset = await asyncio.to_thread(scrape, url), log_path.stat().st_size if log_path else 0
    started = time.monotonic()
    if args.duration:
        soak.ends_at = min(started + args.duration, args.end_by or math.inf)
    sampler = asyncio.create_task(sample_rss(soak, args))
    await clients(soak, args)
    sampler.cancel()
    report.soak_s = time.monotonic() - started
    report.after = await asyncio.to_thread(wait_idle, url, idle_pages)
    report.rss["end"] = rss_bytes(soak.pid) or 0
    after = await asyncio.to_thread(scrape, url)
    report.after |= {"idle_pages": idle_pages, "server_5xx": server_count(after, "5") - server_count(before, "5"),
                     "server_499": server_count(after, "499") - server_count(before, "499"),
                     "health": (await soak.client.get("/health")).status_code}
    check_after(report, log_path, log_offset)


def check_after(report: Report, log_path: Path | None, log_offset: int) -> None:
    after, rss, fail = report.after, report.rss, report.failures.append
    if not is_idle(after, after["idle_pages"]):
        fail(f"not idle after the soak: {after}")
    if after["server_5xx"] or after["health"] != 200:
        fail(f"the server counted {after['server_5xx']:.0f} responses >= 500; /health {after['health']}")
    bound = max(RSS_GROWTH_BYTES, RSS_GROWTH_SHARE * rss.get("warm", 0))
    if "warm" in rss and rss["end"] and rss["end"] - rss["warm"] > bound:
        fail(f"RSS grew by {(rss['end'] - rss['warm']) / 2**20:.1f} MiB after the warm-up "
             f"(bound {bound / 2**20:.0f} MiB)")
    if log_path:
        with open(log_path, "rb") as log:
            log.seek(log_offset)
            tracebacks = log.read().count(b"Traceback")
        if tracebacks:
            fail(f"{tracebacks} tracebacks in the server's log during the soak ({log_path})")


# --- the table and the command ---


def table(report: Report, args: argparse.Namespace) -> str:
    def percentile(values: list[float], share: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[round(share * 100) - 1] if len(values) > 1 \
            else math.nan

    done = [o.latency_s for o in report.outcomes if o.status == 200 and not o.disconnected]
    statuses = Counter("none" if o.status is None else str(o.status) for o in report.outcomes)
    mib, after = {k: v / 2**20 for k, v in report.rss.items()}, report.after
    lines = [
        f"soak: {len(report.outcomes)} requests in {report.soak_s:.1f} s, {args.clients} clients, seed {args.seed}, "
        f"backend {report.backend}",
        f"  by status        {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))} (none: hung up first)",
        f"  disconnects      {sum(report.disconnects.values())} "
        f"({', '.join(f'{k} {v}' for k, v in sorted(report.disconnects.items()))})",
        f"  greedy checks    {sum(ok for _, ok in report.references)}/{len(report.references)} equal to alone",
        f"  after            running {after.get('northcode_requests_running')}, waiting "
        f"{after.get('northcode_requests_waiting')}, in server {after.get('northcode_requests_in_server')}, pages used "
        f"{after.get('northcode_kv_pages_used')} (idle {after.get('idle_pages')}), "
        f"server 5xx {after.get('server_5xx')}, 499 {after.get('server_499')}",
        f"  RSS (MiB)        after warm-up {mib.get('warm', math.nan):.1f}, peak {mib.get('peak', math.nan):.1f}, "
        f"end {mib.get('end', math.nan):.1f}",
        f"  latency (s)      p50 {percentile(done, 0.5):.3f}, p99 {percentile(done, 0.99):.3f} ({len(done)} completed)",
    ]
    if report.extremes:
        lines.append(f"  extremes         {sum(ok for *_, ok in report.extremes)}/{len(report.extremes)} ok: "
                     + ", ".join(f"{name} {status}" for name, status, _ in report.extremes))
    if report.fault:
        lines.append(f"  injected failure {report.fault}")
    lines.append(f"  result           {'FAILED' if report.failures else 'ok'} ({len(report.failures)} failures)")
    return "\n".join(lines + [f"    - {f}" for f in report.failures[:30]])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.soak_server", description=__doc__.split("\n")[0])
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    budget.add_argument("--duration", type=float, help="seconds of soak instead of a request count")
    p.add_argument("--budget-s", type=float, help="with --duration: the whole run (server start included) ends "
                   "by then, the soak shortened to fit")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--disconnect-share", type=float, default=0.2, help="share of requests that hang up (default 0.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seed", type=int, default=SEED_MAX, help="largest request seed drawn (default 2^64-1)")
    p.add_argument("--url", help="soak a running server instead of starting one")
    p.add_argument("--model", help="checkpoint for the started server (default: the demo checkpoint)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "megakernel"))
    p.add_argument("--server-arg", action="append", default=[], help="a serve option, as --server-arg=--device=cpu")
    p.add_argument("--server-log", help="the started server's output (default: a temporary file)")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the started server to load")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--extremes", action="store_true", help="first, the extreme-value requests")
    p.add_argument("--inject-step-failure", action="store_true", help="first, a failed step (a started server only)")
    args = p.parse_args(argv)
    if args.inject_step_failure and args.url:
        p.error("--inject-step-failure needs the server this harness starts (it is started with a fault switch)")
    args.end_by = time.monotonic() + args.budget_s - END_RESERVE_S if args.budget_s else None
    return args


def run_soak(args: argparse.Namespace) -> Report:
    if args.url:
        return asyncio.run(run_checks(args.url.rstrip("/"), args, None))
    with started_server(args) as (url, log_path):
        return asyncio.run(run_checks(url, args, log_path))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve-with-fault-switch"]:
        return serve_with_fault_switch(argv[1:])
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit's SIGTERM still stops the server
    report = run_soak(args)
    print(table(report, args), flush=True)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
