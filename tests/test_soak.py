"""The soak of issue 24, point 5, on the CPU: tests/soak_server.py against a real `northcode serve` (tiny checkpoint).

8 clients send SOAK_REQUESTS random valid requests (every sampling field, streams, tools, logprobs, stop
strings), a fifth of them hanging up, into a pool of 96 pages (so requests also wait in the engine); before them a
failed step is injected. No response is a 5xx or refused, everything is strict JSON, greedy references under load
give their text alone, and afterwards no page or request is held and the server's RSS is flat. 40-60 s on two
shared cores. The longer run: `python -m tests.soak_server --requests 1000`; on the H200, lab/device_soak.sh.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.soak_requests import DISCONNECT_KINDS, PARAMETER_KINDS, check_choice, strict_loads
from tests.soak_server import parse_args, run_checks, started_server, table

SOAK_REQUESTS = 800


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "serve.log"
    args = parse_args(["--requests", str(SOAK_REQUESTS), "--clients", "8", "--model", str(tiny_checkpoint),
                       "--server-log", str(log), "--inject-step-failure",
                       "--backend", "torch", "--server-arg=--device=cpu", "--server-arg=--num-pages=96",
                       "--ready-timeout", "120"])
    with started_server(args) as (url, log_path):
        yield args, url, log_path


@pytest.fixture(scope="module")
def report(server):
    args, url, log_path = server
    report = asyncio.run(run_checks(url, args, log_path))
    print(table(report, args))
    return report


def test_no_request_fails_or_leaks_and_the_server_stays_flat(report):
    assert not report.failures, "\n".join(report.failures[:20])
    assert len(report.outcomes) == SOAK_REQUESTS
    assert report.after["northcode_kv_pages_used"] == report.after["idle_pages"] == 0
    assert "warm" in report.rss and report.rss["end"] > 0  # RSS was read, and check_after bounded its growth


def test_the_soak_used_every_parameter_and_every_way_of_hanging_up(report):
    assert set(PARAMETER_KINDS) <= set(report.coverage), set(PARAMETER_KINDS) - set(report.coverage)
    assert all(report.disconnects[kind] >= 5 for kind in DISCONNECT_KINDS), report.disconnects
    assert sum(report.disconnects.values()) >= 0.1 * SOAK_REQUESTS
    assert report.after["server_499"] >= report.disconnects["hang_up_in_body"] > 0  # the server saw them go


def test_greedy_references_under_load_and_after_a_failed_step_are_as_alone(report):
    assert len(report.references) == SOAK_REQUESTS // 20 and all(ok for _, ok in report.references)
    assert report.fault["failed_status"] == 500 and report.fault["next_status"] == 200


def test_an_unsigned_64_bit_seed_is_accepted(server):
    _, url, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64 - 1, "max_tokens": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_the_harness_refuses_what_is_not_strict_json_and_error_events():
    for text in ('{"a": NaN}', '{"a": -Infinity}', '{"a": 1, "a": 2}', "{'a': 1}"):
        with pytest.raises(ValueError):
            strict_loads(text)
    assert strict_loads('{"a": [1.5e300, null]}') == {"a": [1.5e300, None]}
    body = {"max_tokens": 4}
    assert check_choice(body, {"error": {"message": "x"}}, final=False)
    assert check_choice(body, {"choices": [{"text": "", "finish_reason": "eos"}]}, final=True)
    good = {"choices": [{"text": "a", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert not check_choice(body, good, final=True)
