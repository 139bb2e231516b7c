"""The sampler on known logits, and stop strings on text."""

from __future__ import annotations

import math

import pytest
import torch

from northcode.engine.request import SamplingParams
from northcode.engine.sampling import Sampler, SamplingRow, StopStringFilter, apply_penalties, filter_probs


def row(seed: int = 0, prompt: list[int] | None = None, output: list[int] | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, prompt or [], output or [])


def probs_of(*values: float) -> torch.Tensor:
    return torch.tensor([values])


def test_greedy_takes_the_argmax_and_ties_go_to_the_lower_id():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    result = Sampler().sample(logits, [row(temperature=0), row(top_k=1)])
    assert result.token_ids == [1, 0]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = probs_of(0.5, 0.3, 0.15, 0.05)
    keep = lambda p: filter_probs(probs, torch.tensor([0]), torch.tensor([p]), torch.tensor([0.0]))  # noqa: E731
    assert torch.allclose(keep(0.5), probs_of(1.0, 0, 0, 0))
    assert torch.allclose(keep(0.6), probs_of(0.625, 0.375, 0, 0))  # 0.5 < 0.6: the second is needed
    assert torch.allclose(keep(0.8), probs_of(0.625, 0.375, 0, 0))  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(keep(0.81), probs_of(0.5, 0.3, 0.15, 0) / 0.95)
    assert torch.allclose(keep(1.0), probs)


def test_top_k_and_min_p():
    probs = probs_of(0.1, 0.5, 0.3, 0.1)
    top2 = filter_probs(probs, torch.tensor([2]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.allclose(top2, probs_of(0, 0.625, 0.375, 0))
    min_p = filter_probs(probs, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.5]))  # keep p >= 0.25
    assert torch.allclose(min_p, probs_of(0, 0.625, 0.375, 0))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    # repetition 2 on tokens seen in prompt (0) or output (1): positive logits halve, negative double
    out = apply_penalties(logits.clone(), [row(prompt=[0], output=[1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # frequency 0.5 and presence 0.25 on output counts (token 2 twice, token 3 once); the prompt is not counted
    out = apply_penalties(logits.clone(), [row(prompt=[0], output=[2, 2, 3], frequency_penalty=0.5,
                                               presence_penalty=0.25)])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25]]


def test_temperature_and_penalties_shape_the_logprobs():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    result = Sampler().sample(logits, [row(temperature=0.5, logprobs=2, seed=3)])
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0]
    lp = result.logprobs[0]
    assert lp.logprob == pytest.approx(float(expected[lp.token_id]), abs=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]
    assert lp.top[0][1] == pytest.approx(float(expected[2]), abs=1e-6)
    assert Sampler().sample(logits, [row()]).logprobs == [None]


def test_sampling_frequencies_match_the_filtered_distribution():
    """2000 seeded draws from a known distribution with top_p: empirical frequencies within 3 sigma."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, -1).contiguous()
    rows = [row(seed=seed, top_p=0.8) for seed in range(2000)]
    tokens = torch.tensor(Sampler().sample(logits, rows).token_ids)
    counts = torch.bincount(tokens, minlength=4).float() / 2000
    assert counts[2] == 0 and counts[3] == 0  # cut by top_p
    assert abs(float(counts[0]) - 0.625) < 3 * math.sqrt(0.625 * 0.375 / 2000)


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    alone = Sampler().sample(logits[2:3], [row(seed=42, output=[1, 2, 3])]).token_ids
    rows = [row(seed=s, output=[1, 2, 3]) for s in (1, 2, 42, 4, 5)]
    assert Sampler().sample(logits, rows).token_ids[2] == alone[0]
    assert Sampler().sample(logits, rows).token_ids == Sampler().sample(logits, rows).token_ids
    flat = torch.zeros(20, 50)  # uniform: different seeds (or draw counters) must give different tokens
    assert len(set(Sampler().sample(flat, [row(seed=s) for s in range(20)]).token_ids)) > 5
    assert len(set(Sampler().sample(flat, [row(seed=1, output=[0] * n) for n in range(20)]).token_ids)) > 5


def test_stop_strings_are_caught_across_pieces_and_text_that_may_start_one_is_held_back():
    stops = StopStringFilter(["</end>", "STOP"])
    assert stops.push("hello </") == ("hello ", None)  # "</" could begin "</end>"
    assert stops.push("e") == ("", None)
    assert stops.push("nd> tail") == ("", "</end>")
    other = StopStringFilter(["STOP"])
    assert other.push("ST") == ("", None)
    assert other.push("ART") == ("START", None)  # not a stop after all: released
    assert other.push("S") == ("", None)
    assert other.flush() == "S"
    assert StopStringFilter([]).push("abc") == ("abc", None)
