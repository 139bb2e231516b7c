"""The sampler on known logits, and stop strings on text."""

from __future__ import annotations

import math

import pytest
import torch

from northcode.engine.request import SamplingParams
from northcode.engine.sampling import (Sampler, SamplingRow, StopStringFilter, apply_penalties, filter_probs,
                                      sampling_fault)


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


# --- numbers that stay numbers (issue 24): every validated parameter, at its extremes ---

EXTREME_PARAMS = [
    dict(temperature=1e-39), dict(temperature=5e-324, top_k=7), dict(temperature=100.0), dict(top_k=2**63),
    dict(top_k=2**31), dict(seed=0), dict(seed=2**64 - 1), dict(seed=-2**63), dict(top_p=1e-300),
    dict(top_p=5e-324), dict(min_p=1.0), dict(min_p=1.0, top_p=1e-300, top_k=2**40),
    dict(repetition_penalty=1e-300), dict(repetition_penalty=5e-324, temperature=0.0), dict(repetition_penalty=10.0),
    dict(presence_penalty=2.0, frequency_penalty=2.0), dict(presence_penalty=-2.0, frequency_penalty=-2.0),
]


def extreme_rows(vocab: int) -> list[SamplingRow]:
    """One row per extreme (validated, clamped as the engine does), with a history for the penalties."""
    rows = []
    for b, extra in enumerate(EXTREME_PARAMS):
        params = SamplingParams(**{"seed": b, "logprobs": 20, **extra})
        params.validate()
        rows.append(SamplingRow(params.clamped_to(vocab), params.seed, list(range(0, vocab, 3)), [1, 1, 2, 5]))
    return rows


def test_no_validated_parameter_makes_a_token_or_a_logprob_that_is_not_a_number():
    vocab = 64
    logits = torch.randn(len(EXTREME_PARAMS), vocab, generator=torch.Generator().manual_seed(0)) * 30
    logits[:, 10] = 1e4  # a large positive logit: divided by a repetition penalty of 1e-300 it is inf
    rows = extreme_rows(vocab)
    result = Sampler().sample(logits, rows)
    assert all(0 <= t < vocab for t in result.token_ids)
    for entry in result.logprobs:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0 and len(entry.top) == 20
        assert all(math.isfinite(value) for _, value in entry.top)
    greedy = logits.argmax(-1).tolist()
    for b, extra in enumerate(EXTREME_PARAMS):  # tiny temperatures, top_p and min_p 1 keep the best token
        if extra.get("temperature", 1.0) < 1e-5 and "repetition_penalty" not in extra or "top_p" in extra \
                or "min_p" in extra:
            assert result.token_ids[b] == greedy[b], extra


def test_the_device_sampler_draws_the_samplers_tokens_for_extreme_parameters():
    from northcode.engine.sampling import BatchSamplingArgs, sample_on_device

    vocab = 64
    logits = torch.randn(len(EXTREME_PARAMS), vocab, generator=torch.Generator().manual_seed(1)) * 30
    rows = [r for r in extreme_rows(vocab) if r.params.repetition_penalty == 1 and not r.params.presence_penalty]
    rows = [SamplingRow(r.params, r.seed, [], []) for r in rows]
    expected = Sampler().sample(logits[:len(rows)], rows).token_ids
    assert sample_on_device(logits[:len(rows)], BatchSamplingArgs.of_rows(rows)).tolist() == expected


def test_validation_names_the_field_and_accepts_what_the_engine_clamps():
    for bad, name in [(dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
                      (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
                      (dict(top_p=0.0), "top_p"), (dict(min_p=math.nan), "min_p"), (dict(seed=2**64), "seed"),
                      (dict(seed=-2**63 - 1), "seed"), (dict(seed=1.0), "seed"), (dict(max_tokens=True), "max_tokens"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logprobs=21), "logprobs"),
                      (dict(stop=[1]), "stop"), (dict(stop_token_ids=["a"]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"^{name} = "):
            SamplingParams(**bad).validate()
    huge = SamplingParams(top_k=2**63, temperature=1e-39, logprobs=20, seed=2**64 - 1, max_tokens=2**63)
    huge.validate()
    clamped = huge.clamped_to(16)
    assert (clamped.top_k, clamped.temperature, clamped.logprobs, clamped.seed) == (0, 0.0, 16, 2**64 - 1)
    assert clamped.is_greedy and SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=15).clamped_to(16).top_k == 15 and SamplingParams(top_k=16).clamped_to(16).top_k == 0


def test_sampling_fault_names_what_cannot_be_built():
    assert sampling_fault(row(seed=3, temperature=0.7, top_k=5, output=[1]), 32) is None
    assert sampling_fault(row(seed=3, top_k=2**63), 32) is None  # unclamped: the samplers cap it at the vocabulary
    assert "IndexError" in sampling_fault(row(repetition_penalty=1.5, prompt=[40]), 32)  # a token past the vocabulary
