"""CPU: lab/moe_prefill_bench.py's parts are the prefill's routed MLP taken apart (together they compute what
routed_experts.grouped_experts and model.run_experts compute), its FLOPs are North Mini Code's, and it runs
end to end at the tiny geometry."""

from __future__ import annotations

import pytest
import torch

import moe_prefill_bench as bench
from northcode.model.model import run_experts
from northcode.torch_backend.routed_experts import add_weighted, grouped_experts


@pytest.fixture
def case() -> dict:
    return bench.layer_case(24, bench.geometry(tiny=True), "cpu", torch.float32)


def test_the_timed_parts_compose_to_todays_path_and_the_reference(case):
    k = case["expert_ids"].shape[1]
    order, offsets = bench.sort_pairs(case)
    tokens = bench.gather_tokens(case, order)
    expert_out = bench.grouped_swiglu(tokens, case["gate_up"], case["down"], offsets)
    parts = add_weighted(case["x"].clone(), bench.unsort(expert_out, order, k), case["weights"])
    today = grouped_experts(case["x"].clone(), case["h"], case["gate_up"], case["down"], case["expert_ids"],
                            case["weights"], case["expert_range"])
    reference = case["x"] + run_experts(case["h"], case["gate_up"], case["down"], case["expert_ids"], case["weights"])
    torch.testing.assert_close(parts, today)
    torch.testing.assert_close(today, reference, atol=1e-5, rtol=1e-5)
    scattered = bench.scatter_add(case["x"].clone(), expert_out, order, case["weights"])
    torch.testing.assert_close(scattered, reference, atol=1e-5, rtol=1e-5)


def test_row_major_weights_give_the_same_products(case):
    order, offsets = bench.sort_pairs(case)
    tokens = bench.gather_tokens(case, order)
    want = bench.grouped_swiglu(tokens, case["gate_up"], case["down"], offsets)
    got = bench.grouped_swiglu(tokens, case["gate_up"].transpose(1, 2).contiguous(),
                               case["down"].transpose(1, 2).contiguous(), offsets, transposed=False)
    torch.testing.assert_close(got, want)


def test_flops_and_bytes_are_north_mini_codes():
    geo = bench.geometry(tiny=False)
    assert geo == dict(hidden_size=2048, intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    assert bench.moe_flops(2048, geo) == 6 * 2048 * 8 * 2048 * 768  # ~155 GFLOP a chunk of 2048
    assert bench.expert_bytes(geo, torch.bfloat16) == 128 * 3 * 2048 * 768 * 2  # ~1.2 GB a layer


def test_it_runs_on_the_cpu_and_prints_every_part(capsys):
    assert bench.main(["--tiny", "--tokens", "8", "40", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["T", "part", "ms"]
    parts = {line.split()[1] for line in lines[2:]}
    assert parts == {"today", "sort", "gather", "grouped-mm", "grouped-mm-gemms", "grouped-mm-rowB", "unsort",
                     "combine", "scatter-add", "dense-mm", "permutations", "floor"}
    assert len(lines) == 2 + 2 * len(parts)
    timed = [line.split() for line in lines[2:]]
    assert all(float(cells[2]) > 0 for cells in timed), lines  # every part ran here (ms, not "-")


def test_it_refuses_a_chunk_of_no_tokens():
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0"])
