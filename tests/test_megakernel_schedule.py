"""CPU: the megakernel's task lists. Simulating the per-block lists in order (a task runs once its
counters reach their targets) must finish every list, for every batch size and split count: no deadlock,
every target reachable and exactly reached, every decode-step task type present. build_schedule's tensor
path must give exactly what the list-based reference (make_task per task, place_waves, flatten; the
implementation it replaced) gives, for every configuration."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from northcode.config import ModelConfig
from northcode.megakernel.kernel import (TASK_WORDS, Schedule, TaskType, attention_splits, build_schedule, flatten,
                                         make_task, place_waves)
from northcode.megakernel.tasks import _Counters
from northcode.model.synthetic import preset_config


def simulate(schedule, duration_ns=lambda task: 1000) -> tuple[dict[int, int], list[list[int]]]:
    """Run the lists like the device would, drains as one step: a task starts when its block is free, its
    dependencies are met when the target-th signal of each waited counter is done, and it takes
    duration_ns(task). Returns the final counter values and [started, met, done] ns per task."""
    tasks, starts = schedule.tasks.tolist(), schedule.task_start.tolist()
    cursor, clock = list(starts[:-1]), [0] * (len(starts) - 1)
    done_at: dict[int, list[int]] = {}  # counter -> done times of its signals
    times = [[0, 0, 0] for _ in tasks]
    progressed = True
    while progressed:
        progressed = False
        for block in range(len(cursor)):
            while cursor[block] < starts[block + 1]:
                i = cursor[block]
                t = tasks[i]
                waits = [(c, target) for c, target in ((t[8], t[10]), (t[9], t[11])) if c >= 0 and target > 0]
                if any(len(done_at.get(c, [])) < target for c, target in waits):
                    break
                met = max([clock[block]] + [sorted(done_at[c])[target - 1] for c, target in waits])
                times[i] = [clock[block], met, met + duration_ns(t)]
                if t[12] >= 0:
                    done_at.setdefault(t[12], []).append(times[i][2])
                clock[block], cursor[block] = times[i][2], i + 1
                progressed = True
    stuck = [b for b in range(len(cursor)) if cursor[b] < starts[b + 1]]
    assert not stuck, f"deadlock: blocks {stuck[:5]} cannot proceed"
    return {c: len(signals) for c, signals in done_at.items()}, times


@pytest.mark.parametrize("preset", ["tiny", "north-mini-code"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_schedules_complete_and_targets_are_exact(preset: str, batch: int) -> None:
    """The lists finish in the simulation with exact targets, at 132 blocks over 8K context and 7 blocks over
    100 tokens."""
    config = preset_config(preset, 1003 if preset == "tiny" else None)
    for blocks, context in ((132, 8192), (7, 100)):
        splits = attention_splits(config, batch, blocks, context)
        schedule = build_schedule(config, batch, blocks, splits)
        assert schedule.tasks.shape[1] == TASK_WORDS
        counters, _ = simulate(schedule)
        tasks = schedule.tasks.tolist()
        for t in tasks:
            for idx, target in ((t[8], t[10]), (t[9], t[11])):
                if idx >= 0:
                    assert counters.get(idx, 0) == target, f"{TaskType(t[0]).name} waits for {target}, gets {counters.get(idx, 0)}"
        assert {TaskType(t[0]) for t in tasks} == set(TaskType) - {TaskType.STOP}
        assert max(max(t[8], t[9], t[12]) for t in tasks) < schedule.num_counters


def test_splits_cover_half_the_sms_up_to_8k_but_never_exceed_pages() -> None:
    config = preset_config("north-mini-code")
    full = next(layer for layer in range(config.num_hidden_layers) if not config.window(layer))
    assert attention_splits(config, 1, 132, 8192)[full] == 16  # 64 tasks: half the 132 SMs
    assert attention_splits(config, 8, 132, 8192)[full] == 2
    assert attention_splits(config, 1, 132, 32768)[full] == 32  # a longer span: all of them
    assert set(attention_splits(config, 1, 132, 32768)) == {16, 32}  # the sliding layers' spans stay short
    assert attention_splits(config, 1, 528, 8192)[0] == 32  # never past the kernel's MAX_SPLITS
    assert max(attention_splits(config, 1, 132, 10)) == 2


def test_place_waves_round_robin_and_each() -> None:
    task = make_task(TaskType.NORM, 0, (0,))
    lists = place_waves([[task] * 3, ("each", task), [task] * 2], 2)
    assert [len(x) for x in lists] == [4, 3]
    assert torch.tensor(make_task(TaskType.QKV, 2, (1, 2, 3), ((4, 5),), 6)).tolist()[:13] == \
        [2, 2, 1, 2, 3, 0, 0, 0, 4, -1, 5, 0, 6]


def test_last_wave_takes_the_last_blocks_and_leaves_the_cursor() -> None:
    """COMBINE_APART_MAX's placement: a "last" wave's tasks go to the last blocks in order; the next plain wave
    goes on from where the one before the "last" wave stopped."""
    a, b, c = (make_task(TaskType.NORM, 0, (i,)) for i in range(3))
    lists = place_waves([[a] * 2, ("last", [b, c]), [a]], 5)
    assert lists == [[a], [a], [a], [b], [c]]
    config = preset_config("north-mini-code")
    schedule = build_schedule(config, 1, 132, attention_splits(config, 1, 132, 8192))
    tasks, starts = schedule.tasks.tolist(), schedule.task_start.tolist()
    owner = [blk for blk in range(132) for _ in range(starts[blk], starts[blk + 1])]
    combine_blocks = {owner[i] for i, t in enumerate(tasks) if t[0] == TaskType.COMBINE and t[1] > 0}
    assert combine_blocks == {128, 129, 130, 131}
    assert {t[2] for t in tasks if t[0] == TaskType.MOE_UP} == {4}  # 4 blocks take no up tile
    assert min(t[4] for t in tasks if t[0] == TaskType.MOE_UP) >= 0  # up tiles are claimed from a counter
    eight = build_schedule(config, 8, 132, attention_splits(config, 8, 132, 8192))
    assert {t[2] for t in eight.tasks.tolist() if t[0] == TaskType.MOE_UP} == {0}  # 32 combines: round-robin


def test_backend_refuses_a_machine_without_hopper() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has a Hopper GPU")
    from northcode.megakernel.backend import MegakernelBackend

    config = preset_config("tiny", 1003)
    with pytest.raises(ValueError, match="backend = 'megakernel'.*(Hopper|page_size)"):
        MegakernelBackend(config, {}, 16, 64, 2, 4)
    with pytest.raises(ValueError, match="page_size is 16"):
        MegakernelBackend(config, {}, 16, 16, 2, 4)


def test_profile_summary_accounts_waits_busy_time_and_layers() -> None:
    from northcode.megakernel.kernel import summarize_profile

    tasks = torch.tensor([make_task(TaskType.NORM, 0, (0,)), make_task(TaskType.OPROJ, 0, (0, 1)),
                          make_task(TaskType.OPROJ, 1, (0, 1))], dtype=torch.int32)
    times = torch.tensor([[1000, 1000, 3000], [3000, 5000, 9000], [2000, 9000, 12000]], dtype=torch.int64)
    summary = summarize_profile(tasks, torch.tensor([0, 2, 3]), times)
    assert summary["span_us"] == 11.0
    assert summary["by_type"]["OPROJ"] == dict(count=2, wait_us=9.0, busy_us=7.0)
    assert summary["layer_us"] == [8.0, 3.0]
    assert summary["busy_fraction"] == round(9.0 / (11.0 * 2), 3)


def test_a_growing_context_asks_for_few_task_lists() -> None:
    """Task lists are cached per split tuple and cost about 10 ms of Python and an upload each: a sequence
    growing from 1 to 5,000 tokens must need only a handful (split counts are powers of two until they reach the SMs' share)."""
    config = preset_config("north-mini-code")
    for batch in (1, 3, 8):
        seen = {attention_splits(config, batch, 132, context) for context in range(1, 5000)}
        assert len(seen) <= 7, f"batch {batch}: {len(seen)} different task lists"


def _reference_layer(c: ModelConfig, layer: int, batch: int, num_blocks: int, num_splits: int, counters: _Counters,
                     previous: tuple, waves: list) -> tuple:
    """One layer of the reference: appends its waves (lists of make_task records) and returns what the next
    norm waits on."""
    kvh, group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    norm_done = counters.alloc()
    waves.append([make_task(TaskType.NORM, layer, (b,), previous, norm_done) for b in range(batch)])
    qkv_done = counters.alloc(kvh)
    qkv, per_group = [], [0] * kvh
    for g in range(kvh):
        for first, count in ((g * group * d // 16, group * d // 16), ((c.q_size + g * d) // 16, d // 16),
                             ((c.q_size + c.kv_size + g * d) // 16, d // 16)):
            for tile in range(first, first + count, 2):  # two tiles a task
                qkv.append(make_task(TaskType.QKV, layer, (tile, min(2, first + count - tile), int(c.uses_rope(layer))),
                                     ((norm_done, batch),), qkv_done + g))
                per_group[g] += 1
    qkv_wave = len(waves)
    waves.append(qkv)
    attn_done, combine_done = counters.alloc(batch * kvh), counters.alloc()
    oproj_done, mlp_done = counters.alloc(), counters.alloc()
    window = c.window(layer) or 0
    attn = [make_task(TaskType.ATTN, layer, (b, g, s, num_splits, window), ((qkv_done + g, per_group[g]),),
                      attn_done + b * kvh + g) for b in range(batch) for s in range(num_splits) for g in range(kvh)]
    combine = [make_task(TaskType.COMBINE, layer, (b, g, num_splits), ((attn_done + b * kvh + g, num_splits),),
                         combine_done) for b in range(batch) for g in range(kvh)]
    oproj = [make_task(TaskType.OPROJ, layer, (t, 1), ((combine_done, batch * kvh),), oproj_done)
             for t in range(c.hidden_size // 16)]
    if c.is_dense(layer):
        up_done = counters.alloc()
        up_tiles, down_tiles = c.dense_intermediate_size // 16, c.hidden_size // 32
        waves.append([make_task(TaskType.DENSE_UP, layer, (t, 1), ((norm_done, batch),), up_done) for t in range(up_tiles)])
        waves += [attn, [make_task(TaskType.DENSE_DOWN, layer, (t, 1), ((up_done, up_tiles),), mlp_done)
                         for t in range(down_tiles)], combine, oproj]
        return (oproj_done, len(oproj)), (mlp_done, down_tiles)
    router_done, topk_done = counters.alloc(), counters.alloc()
    slot_done = counters.alloc(c.num_experts)
    claim = counters.alloc()
    router_tiles = math.ceil(c.num_experts / 16)
    moe_waits = ((topk_done, 1),)
    waves[qkv_wave:qkv_wave] = [("apart", [make_task(TaskType.ROUTER, layer, (t,), ((norm_done, batch),), router_done)
                                           for t in range(router_tiles)]),
                                ("apart", [make_task(TaskType.TOPK, layer, (), ((router_done, router_tiles),),
                                                     topk_done)])]
    apart = batch * kvh if batch * kvh <= 8 and 2 * batch * kvh <= num_blocks else 0
    if apart:
        combine = ("last", combine)
    up = ("each", make_task(TaskType.MOE_UP, layer, (apart, slot_done, claim), moe_waits))
    down = ("each", make_task(TaskType.MOE_DOWN, layer, (0, slot_done), moe_waits, mlp_done))
    waves += [attn, up, combine, down, oproj]
    return (oproj_done, len(oproj)), (mlp_done, num_blocks)


def _build_schedule_reference(c: ModelConfig, batch: int, num_blocks: int, splits: tuple[int, ...]) -> Schedule:
    """build_schedule as it was before the tensor path: make_task per task, place_waves, flatten."""
    counters, waves, previous = _Counters(), [], ()
    for layer in range(c.num_hidden_layers):
        previous = _reference_layer(c, layer, batch, num_blocks, splits[layer], counters, previous, waves)
    final_done, lm_done = counters.alloc(), counters.alloc()
    waves.append([make_task(TaskType.NORM, c.num_hidden_layers, (b, 1), previous, final_done) for b in range(batch)])
    lm_tiles = math.ceil(c.vocab_size / 32)
    per_task = max(1, math.ceil(lm_tiles / (2 * num_blocks)))
    starts = list(range(0, lm_tiles, per_task))
    waves.append([make_task(TaskType.LM_HEAD, 0, (t, min(per_task, lm_tiles - t), j), ((final_done, batch),), lm_done)
                  for j, t in enumerate(starts)])
    waves.append([make_task(TaskType.SAMPLE, 0, (b, len(starts)), ((lm_done, len(starts)),)) for b in range(batch)])
    return flatten(place_waves(waves, num_blocks), counters.count, len(starts))


def _preset(name: str) -> ModelConfig:
    if name == "tiny":
        return preset_config("tiny", 1003)  # an LM head whose last task is short
    config = preset_config("north-mini-code")
    if name == "north-mini-code-5":  # layer_types and mlp_layer_types re-derived for 5 layers
        return dataclasses.replace(config, num_hidden_layers=5, layer_types=None, mlp_layer_types=None)
    return config


def _assert_same(got: Schedule, want: Schedule, where: str) -> None:
    assert got.tasks.dtype == want.tasks.dtype == torch.int32 and got.task_start.dtype == torch.int32, where
    assert got.tasks.shape == want.tasks.shape, f"{where}: {list(got.tasks.shape)} vs {list(want.tasks.shape)}"
    assert torch.equal(got.tasks, want.tasks), f"{where}: first differing row {(got.tasks != want.tasks).any(1).nonzero()[0].item()}"
    assert torch.equal(got.task_start, want.task_start), where
    assert (got.num_counters, got.num_lm_tasks) == (want.num_counters, want.num_lm_tasks), where


@pytest.mark.parametrize("preset", ["tiny", "north-mini-code", "north-mini-code-5"])
def test_build_schedule_equals_the_list_reference(preset: str) -> None:
    """Same tasks, task_start, counters and LM tasks as the reference for batch 1, 2, 3, 8, 132 and 7 blocks,
    contexts 10 to 8192 (contexts giving the same splits are built once)."""
    config = _preset(preset)
    seen = set()
    for batch in (1, 2, 3, 8):
        for blocks in (132, 7):
            for context in (10, 100, 300, 8192):
                splits = attention_splits(config, batch, blocks, context)
                if (batch, blocks, splits) in seen:
                    continue
                seen.add((batch, blocks, splits))
                _assert_same(build_schedule(config, batch, blocks, splits),
                             _build_schedule_reference(config, batch, blocks, splits),
                             f"{preset} batch {batch}, {blocks} blocks, context {context}")


def test_split_contexts_cover_every_task_list_a_sequence_can_need() -> None:
    """MegakernelBackend.warm_up builds one task list per context split_contexts names: together they must give
    every split tuple any context up to the longest can ask for (checked by brute force), and few of them."""
    from northcode.megakernel.tasks import split_contexts

    for preset, longest in (("north-mini-code", 20_000), ("tiny", 3_000)):
        config = preset_config(preset, 1003 if preset == "tiny" else None)
        for batch in (1, 3, 8):
            contexts = split_contexts(config, batch, 132, longest)
            wanted = {attention_splits(config, batch, 132, c) for c in range(longest + 1)}
            assert {attention_splits(config, batch, 132, c) for c in contexts} == wanted
            assert len(contexts) == len(wanted) <= 8
