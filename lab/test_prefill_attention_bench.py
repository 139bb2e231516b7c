"""The prefill attention bench's ways on the CPU: where a way runs here, it computes the reference's attention
(causal from the bottom right, the window), so that its GPU timings compare like with like."""

from __future__ import annotations

import torch

from prefill_attention_bench import format_rows, measure, visible


def test_the_mask_is_causal_from_the_bottom_right_and_inside_the_window():
    mask = visible(3, 6, None, "cpu")  # queries at positions 3, 4, 5
    assert mask.tolist()[0] == [True, True, True, True, False, False]
    assert mask[-1].all()
    windowed = visible(3, 6, 2, "cpu")
    assert windowed.tolist()[2] == [False, False, False, False, True, True]


def test_the_ways_that_run_on_the_cpu_agree_with_the_reference():
    shapes = ((8, 64, None), (8, 64, 32), (3, 70, None))
    rows = measure(shapes, ["flash-causal", "flex", "efficient-mask"], "cpu", torch.float32, repeats=1)
    ran = [r for r in rows if r["ms"] is not None]
    assert {r["way"] for r in ran} == {"flash-causal", "flex"}  # efficient: CUDA only
    assert all(r["max_diff"] < 1e-4 and r["first_ms"] is not None for r in ran), rows
    assert [r["note"] for r in rows if r["way"] == "flash-causal" and r["window"]] == ["full layers only"]
    assert {r["note"] for r in rows if r["way"] == "efficient-mask"} == {"no such kernel here"}
    table = format_rows(rows)
    assert table.splitlines()[0].split()[:4] == ["T", "S", "window", "way"] and len(table.splitlines()) == 10
