"""The status line's numbers and text: the line's wording, small percentages, usage, TTFT and live rate."""

from __future__ import annotations

import pytest

from northcode.agent.client import Completion, Delta
from northcode.agent.session_stats import SessionStats, StreamRate, percent, usage_changes


def test_the_line_before_anything_is_known():
    assert SessionStats().line() == "connecting… │ mode ask │ – tok/s │ TTFT – │ cache – │ KV –"


def test_the_line_with_everything_known():
    stats = SessionStats(model="m", mode="auto-edit", workspace="proj", tokens_per_s=12.34, ttft_s=0.25,
                         context_used=1000, context_window=4096, cache_share=0.4, kv_usage=0.003, busy="generating…")
    assert stats.line() == ("generating…  m │ mode auto-edit │ 12.3 tok/s │ TTFT 250 ms │ ctx 1000/4096 (24%) │ "
                            "cache 40% │ KV 0.3% │ proj")
    stats.context_used = 3300  # 81% of the window: the line suggests /compact
    assert "│ ctx 3300/4096 (81%) /compact │" in stats.line()
    stats.context_window = None  # an endpoint that does not state its context length
    assert "│ ctx 3300 │" in stats.line()


@pytest.mark.parametrize("fraction, text", [(0.0, "0%"), (0.0004, "<0.1%"), (0.003, "0.3%"), (0.094, "9.4%"),
                                            (0.25, "25%"), (1.0, "100%")])
def test_percent_keeps_small_shares_visible(fraction, text):
    assert percent(fraction) == text


def test_usage_sets_context_cache_share_and_decode_rate():
    usage = {"prompt_tokens": 100, "completion_tokens": 11, "prompt_tokens_details": {"cached_tokens": 40}}
    changes = usage_changes(Completion(usage=usage, ttft_s=0.5, total_s=1.5))
    assert changes == {"ttft_s": 0.5, "tokens_per_s": pytest.approx(10.0), "context_used": 111, "cache_share": 0.4}
    assert usage_changes(Completion(ttft_s=0.2)) == {"ttft_s": 0.2}  # a server that sends no usage


def test_stream_rate_gives_ttft_then_the_live_rate():
    rate = StreamRate()
    assert rate.changes(Delta("reasoning", "a", elapsed_s=0.5, num_chunks=1)) == {"ttft_s": 0.5}
    assert rate.changes(Delta("content", "b", elapsed_s=0.5, num_chunks=2)) == {}  # no time since the first
    assert rate.changes(Delta("tool_call", "read", elapsed_s=1.0, num_chunks=3, call_idx=0)) == {}
    assert rate.changes(Delta("tool_arguments", "{}", elapsed_s=1.5, num_chunks=21, call_idx=0)) == {"tokens_per_s": 20.0}
    rate.reset()  # the next request's first fragment is a new TTFT
    assert rate.changes(Delta("content", "c", elapsed_s=0.3, num_chunks=1)) == {"ttft_s": 0.3}


def test_a_narrow_line_leaves_out_the_least_needed_parts_first():
    stats = SessionStats(model="demo-tiny-seed0 (RANDOM WEIGHTS)", mode="ask", workspace="project", tokens_per_s=70.4,
                         ttft_s=0.917, context_used=1200, context_window=4096, cache_share=0.5, kv_usage=0.003)
    assert stats.line(200) == stats.line()
    assert stats.line(78) == "demo-tiny-seed0 (RANDOM WEIGHTS) │ mode ask │ 70.4 tok/s │ ctx 1200/4096 (29%)"  # 80 columns
    assert stats.line(40) == "demo-tiny-seed0 (RANDOM WEIGHTS) │ ctx 1200/4096 (29%)"  # what is left: model and ctx
