"""Whole decode steps of the megakernel on synthetic paged caches: tiny geometry, North Mini Code's shapes
over its first 5 layers, and the full 49-layer model; batch 1/2/4/8 with ragged lengths, sliding-window
crossings, a 32K context. Teacher-forced through northcode/bench/decode_check.py: the kernel against an
fp32 path and the bf16 torch path that both follow the kernel's experts, so routing chaos (random weights
put the top-k boundary within bf16 rounding at every few layers) cannot hide or fake a kernel error; the
kernel must be within ERR_FACTOR of the bf16 torch path's own distance to fp32 (logits, every layer's
residual, router logits), choose fp32's experts wherever the gap allows, and the figures say how often
and at what gap its experts differ. NC_TEST_STEPS shortens the full runs. The free-running figure
compares with NorthModel.decode (bf16) with no help at all.
"""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

TINY_VOCAB = 1003  # not a multiple of 32: exercises the LM head's last, partial tile
STEPS = int(os.environ.get("NC_TINY_STEPS", "256"))
FULL_STEPS = int(os.environ.get("NC_TEST_STEPS", "256"))
ROUTER_GAP_TOL = 0.05  # FollowKernelRouting (the K/V-write test): near-ties the oracle may follow


def report(record: dict) -> None:
    """Append a figure to $NC_REPORT (JSON lines: lab/device_megakernel.sh prints them); print it as well."""
    print(json.dumps(record))
    path = os.environ.get("NC_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def model_and_weights(preset: str):
    from northcode.bench.decode_check import model
    from northcode.model.model import NorthModel

    config, weights, _, _ = model(preset)  # decode_check's cache: one model on the GPU at a time
    return config, weights, NorthModel(config, weights)


def setup(preset: str, lengths: list[int], steps: int, seed: int):
    from northcode.bench.decode_setup import contiguous_caches, paged_cache
    from northcode.megakernel.kernel import Megakernel

    config, weights, model = model_and_weights(preset)
    cache = paged_cache(config, lengths, steps, "cuda", seed=seed)
    kernel = Megakernel(config, weights, cache.k_pool, cache.v_pool, cache.block_tables, timeout_s=5.0)
    return config, model, kernel, contiguous_caches(model, cache, steps)


def rows_at(lengths: list[int], step: int):
    from northcode.megakernel.kernel import RowSpec

    return [RowSpec(position=length + step, seq=b) for b, length in enumerate(lengths)]


class FollowKernelRouting:
    """Replaces model.route while active: the reference picks the kernel's experts (`routed`, int
    [L, 8, k]) of row `row` where its own top-k boundary is a near-tie, and records a mismatch
    where it is not. Sparse layers are counted in call order within one row's decode."""

    def __init__(self, config) -> None:
        self.config, self.row, self.calls, self.routed = config, 0, 0, None
        self.sparse = [i for i in range(config.num_hidden_layers) if not config.is_dense(i)]
        self.mismatches: list[tuple] = []
        self.near_ties = 0

    def start_row(self, row: int, routed: torch.Tensor) -> None:
        self.row, self.calls, self.routed = row, 0, routed

    def route(self, h: torch.Tensor, router: torch.Tensor, config):
        layer = self.sparse[self.calls]
        self.calls += 1
        k = config.num_experts_per_tok
        logits = F.linear(h, router)  # [1, E] in the model dtype, as model.route
        top = torch.topk(logits.float(), k + 1, dim=-1)
        ids = top.indices[:, :k]
        mine = self.routed[layer, self.row].to(ids.device).long()[None]
        if set(mine[0].tolist()) != set(ids[0].tolist()):
            if float(top.values[0, k - 1] - top.values[0, k]) < ROUTER_GAP_TOL:
                self.near_ties += 1
                ids = mine
            else:
                self.mismatches.append((layer, self.row, ids[0].tolist(), mine[0].tolist()))
        from northcode.model.model import expert_weights

        return expert_weights(logits.gather(-1, ids), config).to(h.dtype), ids

    @contextlib.contextmanager
    def active(self):
        from northcode.model import model

        original = model.route
        model.route = self.route
        try:
            yield self
        finally:
            model.route = original


def reference_step(model, caches, tokens: list[int], follower: FollowKernelRouting | None, kernel) -> torch.Tensor:
    """The oracle's logits [B, V] for one step (following the kernel's near-tie routing when given)."""
    if follower is None:
        return torch.stack([model.decode(t, c) for t, c in zip(tokens, caches)]).float()
    routed = kernel.routed.cpu()
    out = []
    with follower.active():
        for b, (token, cache) in enumerate(zip(tokens, caches)):
            follower.start_row(b, routed)
            out.append(model.decode(token, cache))
    return torch.stack(out).float()


def copy_oracle_kv(kernel, caches, positions: list[int]) -> None:
    """Overwrite what the kernel appended with the oracle's K/V (same state for the next step)."""
    k_pool, v_pool, tables = kernel._cache
    for layer in range(kernel.config.num_hidden_layers):
        for b, pos in enumerate(positions):
            page = int(tables[layer, b, pos // 64])
            k_pool[page, pos % 64] = caches[b].keys[layer][0, pos]
            v_pool[page, pos % 64] = caches[b].values[layer][0, pos]


def teacher_forced(preset: str, lengths: list[int], steps: int, layers: int | None = None) -> dict:
    """decode_check's teacher-forced checks (its docstring states them); fails with the first few."""
    from northcode.bench.decode_check import report
    from northcode.bench.decode_check import teacher_forced as run

    figures = run(preset, lengths, steps, layers)
    report(figures)
    failures = figures["failures"]
    assert not failures, f"{len(failures)} checks failed, first: {failures[:6]}"
    return figures


TINY_LENGTHS = [5, 30, 64, 100, 17, 200, 31, 63]  # window 32: every row crosses it while decoding


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_tiny_teacher_forced(batch: int) -> None:
    teacher_forced("tiny", TINY_LENGTHS[:batch], STEPS)


FULL_LENGTHS = [4090, 100, 8000, 1000, 64, 3000, 4095, 2000]  # rows 0 and 6 cross the 4096 window


@pytest.mark.parametrize("batch", [1, 8])
def test_full_shapes_shallow_teacher_forced(batch: int) -> None:
    """North Mini Code's shapes (32 splits, head_dim 128, 128 experts top-8, vocab 262144) over its first
    5 layers (dense; sliding with RoPE; full NoPE): little depth for bf16 drift to grow in."""
    teacher_forced("north-mini-code", FULL_LENGTHS[:batch], min(FULL_STEPS, 16), layers=5)


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_full_teacher_forced(batch: int) -> None:
    teacher_forced("north-mini-code", FULL_LENGTHS[:batch], FULL_STEPS)


def test_full_32k_context() -> None:
    teacher_forced("north-mini-code", [32768 - 7], min(FULL_STEPS, 64))


@pytest.mark.parametrize("preset,batch", [("tiny", 4), ("north-mini-code", 1)])
def test_free_running_greedy_agreement(preset: str, batch: int) -> None:
    """Both decode greedily on their own (no routing help, no KV copy); the figure is the number of
    steps before each row's first divergence (random weights make near-ties common)."""
    lengths = (TINY_LENGTHS if preset == "tiny" else FULL_LENGTHS)[:batch]
    steps = STEPS if preset == "tiny" else FULL_STEPS
    config, model, kernel, caches = setup(preset, lengths, steps, seed=7)
    ref_tokens = kernel_tokens = [3] * batch
    agree = [None] * batch
    kernel.step(rows_at(lengths, 0), torch.tensor(kernel_tokens))
    for step in range(steps):
        ref_tokens = reference_step(model, caches, ref_tokens, None, kernel).argmax(-1).tolist()
        kernel.check()
        kernel_tokens = kernel.tokens[:batch].tolist()
        for b in range(batch):
            if agree[b] is None and ref_tokens[b] != kernel_tokens[b]:
                agree[b] = step
        if all(a is not None for a in agree):
            break
        if step + 1 < steps:
            kernel.step(rows_at(lengths, step + 1))  # feeds what it sampled, read on the device
    agree = [steps if a is None else a for a in agree]
    report(dict(test="free_running", preset=preset, lengths=lengths, steps=steps, agreeing_steps=agree))
