"""CPU: the megakernel's task lists. Simulating the per-block lists in order (a task runs once its
counters reach their targets) must finish every list, for every batch size, split count and variant
(megakernel.VARIANTS): no deadlock, every target reachable and exactly reached, every decode-step task
type of the variant present."""

from __future__ import annotations

import pytest
import torch

from northcode.megakernel.kernel import (TASK_WORDS, VARIANTS, TaskType, attention_splits, build_schedule, make_task,
                                         place_waves)
from northcode.model.synthetic import preset_config


def simulate(schedule) -> dict[int, int]:
    """Run the lists like the device would, drains as one step; return the final counter values."""
    tasks, starts = schedule.tasks.tolist(), schedule.task_start.tolist()
    cursor = starts[:-1]
    counters: dict[int, int] = {}
    progressed = True
    while progressed:
        progressed = False
        for block in range(len(cursor)):
            while cursor[block] < starts[block + 1]:
                t = tasks[cursor[block]]
                waits = [(t[8], t[10]), (t[9], t[11])]
                if any(idx >= 0 and counters.get(idx, 0) < target for idx, target in waits):
                    break
                if t[12] >= 0:
                    counters[t[12]] = counters.get(t[12], 0) + 1
                cursor[block] += 1
                progressed = True
    stuck = [b for b in range(len(cursor)) if cursor[b] < starts[b + 1]]
    assert not stuck, f"deadlock: blocks {stuck[:5]} cannot proceed"
    return counters


@pytest.mark.parametrize("preset", ["tiny", "north-mini-code"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_schedules_complete_and_targets_are_exact(preset: str, batch: int, variant: str) -> None:
    """Every variant's lists (bench --variants) finish in the simulation with exact targets, at 132 blocks
    over 8K context and 7 blocks over 100 tokens."""
    config = preset_config(preset, 1003 if preset == "tiny" else None)
    v = VARIANTS[variant]
    for blocks, context in ((132, 8192), (7, 100)):
        splits = attention_splits(config, batch, blocks, context)
        schedule = build_schedule(config, batch, blocks, splits, v.wave_order, v.qkv_tiles)
        assert schedule.tasks.shape[1] == TASK_WORDS
        counters = simulate(schedule)
        tasks = schedule.tasks.tolist()
        for t in tasks:
            for idx, target in ((t[8], t[10]), (t[9], t[11])):
                if idx >= 0:
                    assert counters.get(idx, 0) == target, f"{TaskType(t[0]).name} waits for {target}, gets {counters.get(idx, 0)}"
        kinds = {TaskType(t[0]) for t in tasks}
        assert kinds == set(TaskType) - {TaskType.STOP}
        assert max(max(t[8], t[9], t[12]) for t in tasks) < schedule.num_counters


def test_splits_cover_the_sms_but_never_exceed_pages() -> None:
    config = preset_config("north-mini-code")
    assert attention_splits(config, 1, 132, 8192)[0] == 32
    assert attention_splits(config, 8, 132, 8192)[0] == 4  # 128 tasks: one round on 132 SMs
    assert max(attention_splits(config, 1, 132, 10)) == 2


def test_place_waves_round_robin_and_each() -> None:
    task = make_task(TaskType.NORM, 0, (0,))
    lists = place_waves([[task] * 3, ("each", task), [task] * 2], 2)
    assert [len(x) for x in lists] == [4, 3]
    assert torch.tensor(make_task(TaskType.QKV, 2, (1, 2, 3), ((4, 5),), 6)).tolist()[:13] == \
        [2, 2, 1, 2, 3, 0, 0, 0, 4, -1, 5, 0, 6]


def test_backend_refuses_a_machine_without_hopper() -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has a Hopper GPU")
    from northcode.megakernel.backend import MegakernelBackend

    config = preset_config("tiny", 1003)
    with pytest.raises(ValueError, match="backend = 'megakernel'.*(Hopper|page_size)"):
        MegakernelBackend(config, {}, 16, 64, 2, 4)
    with pytest.raises(ValueError, match="page_size 16"):
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


def test_variant_names_are_checked(monkeypatch) -> None:
    from northcode.megakernel.kernel import variant_from_env

    monkeypatch.setenv("NC_VARIANT", "no-kv-preload")
    assert variant_from_env() == "no-kv-preload"
    monkeypatch.setenv("NC_VARIANT", "fastest")
    with pytest.raises(ValueError, match="NC_VARIANT='fastest'.*no-kv-preload"):
        variant_from_env()


def test_a_growing_context_asks_for_few_task_lists() -> None:
    """Task lists are cached per split tuple and cost 0.1-0.2 s of Python each: a sequence growing from 1 to
    5,000 tokens must need only a handful (split counts are powers of two until they reach the SMs' share)."""
    config = preset_config("north-mini-code")
    for batch in (1, 3, 8):
        seen = {attention_splits(config, batch, 132, context) for context in range(1, 5000)}
        assert len(seen) <= 7, f"batch {batch}: {len(seen)} different task lists"
