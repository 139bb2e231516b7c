"""CPU: the megakernel's whole-step oracle (northcode/bench/decode_oracle.py) on the tiny geometry. In bf16
without following it must be NorthModel.decode bit for bit; in fp32, following the bf16 path's own experts,
it must be NorthModel in fp32 weights; and the routing/residual comparisons must measure what they say."""

from __future__ import annotations

import functools

import pytest
import torch

from northcode.bench.decode_oracle import (Oracle, compare_routing, first_jump, logit_errors, residual_errors,
                                           swap_margin)

PROMPT = [5, 17, 300, 41, 9, 77, 2, 650, 31, 12, 8, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110,
          111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123]  # 35 tokens: past the window of 32


@functools.cache
def tiny():
    from northcode.model.synthetic import preset_config, random_weights

    config = preset_config("tiny", 1003)
    return config, random_weights(config, dtype=torch.bfloat16, seed=4)


def prefilled(weights_dtype: torch.dtype):
    """The tiny model after PROMPT: (model, cache, next position, per-layer keys, per-layer values) of row 0."""
    from northcode.model.model import NorthModel

    config, weights = tiny()
    model = NorthModel(config, {n: t.to(weights_dtype) for n, t in weights.items()})
    cache = model.new_cache()
    model.prefill(PROMPT, cache)
    keys = [cache.keys[i][0] for i in range(config.num_hidden_layers)]
    values = [cache.values[i][0] for i in range(config.num_hidden_layers)]
    return model, cache, cache.seq_len, keys, values


def test_bf16_without_following_is_northmodel_decode_bit_for_bit() -> None:
    config, weights = tiny()
    model, cache, position, keys, values = prefilled(torch.bfloat16)
    got = Oracle(config, weights, torch.bfloat16).step(44, position, keys, values)
    ref = model.decode(44, cache).float()
    assert torch.equal(got.logits, ref)
    for i in range(config.num_hidden_layers):
        assert torch.equal(got.keys[i], cache.keys[i][0, position])
        assert torch.equal(got.values[i], cache.values[i][0, position])
    assert (got.own_experts[0] == -1).all() and (got.own_experts[1:] >= 0).all()  # layer 0 is dense


def test_fp32_following_its_own_choice_is_the_fp32_model() -> None:
    config, weights = tiny()
    model, cache, position, keys, values = prefilled(torch.float32)
    oracle = Oracle(config, weights, torch.float32)
    own = oracle.step(44, position, keys, values)
    follow = own.own_experts.clone()
    follow[0] = 0  # dense layer: ignored
    followed = oracle.step(44, position, keys, values, follow=follow)
    assert torch.equal(followed.logits, own.logits)
    ref = model.decode(44, cache).float()
    assert torch.allclose(own.logits, ref, atol=1e-4, rtol=1e-4)
    # following other experts changes the answer: the follow path is really taken
    other = follow.clone()
    other[1] = torch.tensor([e for e in range(config.num_experts) if e not in set(follow[1].tolist())][:4])
    assert not torch.allclose(oracle.step(44, position, keys, values, follow=other).logits, own.logits)


def test_comparisons_measure_what_they_say() -> None:
    config, weights = tiny()
    model, cache, position, keys, values = prefilled(torch.bfloat16)
    exact = Oracle(config, weights, torch.float32).step(44, position, keys, values)
    bf16 = Oracle(config, weights, torch.bfloat16).step(44, position, keys, values, follow=exact.own_experts)
    errors = logit_errors(bf16.logits, exact.logits)
    assert 1e-4 < errors["rel"] < 2e-2 and errors["one_minus_cos"] < 1e-3  # bf16 arithmetic, not zero
    per_layer = residual_errors(exact.residual, exact, bf16)  # the "kernel" here is fp32 itself: no error
    assert all(row["kernel"] == 0.0 for row in per_layer) and first_jump(per_layer, 2.0, 1e-3) is None
    shifted = exact.residual.clone()
    shifted[3:] *= 1.1
    assert first_jump(residual_errors(shifted, exact, bf16), 2.0, 1e-3) == 3
    routing = compare_routing(config, exact.own_experts, exact.router, exact, bf16)
    assert [r["layer"] for r in routing] == list(range(1, config.num_hidden_layers))
    assert all(r["kernel_margin"] == 0.0 and r["kernel_router_err"] == 0.0 and r["gap"] >= 0 for r in routing)


def test_swap_margin() -> None:
    z = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0])
    assert swap_margin({0, 1}, z, 2) == 0.0
    assert swap_margin({0, 2}, z, 2) == pytest.approx(0.5)  # took 1.5 in place of 2.0
    assert swap_margin({3, 4}, z, 2) == pytest.approx(3.0)  # missed 3.0, took 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_stepped_together_are_the_rows_stepped_alone(dtype: torch.dtype) -> None:
    """Oracle.steps (the teacher-forced checks' batch) against `step` row by row: two sequences at different
    positions (one past the sliding window, one before it), one following given experts, one its own."""
    config, weights = tiny()
    model, cache, position, keys, values = prefilled(torch.bfloat16)
    oracle = Oracle(config, weights, dtype)
    own = oracle.step(44, position, keys, values).own_experts
    follow = torch.stack([own, torch.roll(own, 1, dims=1)])  # row 1 follows the same experts, in another order
    together = oracle.steps([44, 9], [position, 20], [(keys, values), (keys, values)], follow)
    alone = [oracle.step(44, position, keys, values, follow=follow[0]),
             oracle.step(9, 20, keys, values, follow=follow[1])]
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    for got, ref in zip(together, alone):
        assert torch.allclose(got.logits, ref.logits, **tol)
        assert torch.allclose(got.residual, ref.residual, **tol)
        assert torch.equal(got.own_experts, ref.own_experts) or dtype == torch.bfloat16
        assert torch.allclose(got.keys.float(), ref.keys.float(), **tol)
    assert not torch.allclose(together[0].logits, together[1].logits)  # the rows are not one row twice


def test_row_errors_in_one_pass_are_rel_err_row_by_row() -> None:
    from northcode.bench.decode_oracle import rel_err, rel_errs

    got, ref = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)), torch.randn(5, 64)
    got[2, 3] = float("nan")
    assert rel_errs(got, ref) == [rel_err(got[i], ref[i]) for i in range(5)]
