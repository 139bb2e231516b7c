"""CPU: lab/profile_report.py reads a profiled step. The record is made here from a real schedule (tiny
geometry, 6 blocks) run through a small timing simulation (every task 1 us once its counters are reached), so
the report's phases, occupancy and gating chain can be checked against what the simulation did (the timing
simulation is the schedule tests' own, tests/test_megakernel_schedule.simulate)."""

from __future__ import annotations

import torch
from profile_report import load, report

from northcode.megakernel.tasks import TaskType, attention_splits, build_schedule
from northcode.model.synthetic import preset_config
from tests.test_megakernel_schedule import simulate


def test_the_report_shows_phases_occupancy_and_the_gating_chain(tmp_path) -> None:
    config = preset_config("tiny")
    schedule = build_schedule(config, 1, 6, attention_splits(config, 1, 6, 300))
    _, times = simulate(schedule, lambda t: 9000 if t[0] == TaskType.OPROJ else 1000)  # a slow o_proj gates the layer
    path = tmp_path / "profile-megakernel-b1-c300.pt"
    torch.save(dict(tasks=schedule.tasks, task_start=schedule.task_start, times=torch.tensor(times)), path)
    assert len(load(path)["tasks"]) == schedule.tasks.shape[0]
    text = report(path, 1, 2.0)
    assert "first met" in text and "blocks busy per bucket" in text
    chain = text.split("what gated the layer's end:")[1].split("between tasks")[0].strip().splitlines()
    assert chain[0].startswith("OPROJ"), chain[0]  # the slow task finishes the layer
    ends = ("first task", "stops here", "previous layer")
    assert chain[-1].startswith("NORM") or any(end in chain[-1] for end in ends)
    phases = {line.split()[0]: line.split() for line in text.splitlines()[3:12] if line and line.split()[0].isupper()}
    assert float(phases["OPROJ"][-1]) == 9.0  # busy max, us


def test_two_profiles_side_by_side_show_which_task_type_changed(tmp_path) -> None:
    """compare(): the same schedule with o_proj tasks of 2 us against 1 us: o_proj's busy median and total
    differ by what the simulation put in, every other type not at all."""
    from profile_report import compare

    config = preset_config("tiny")
    schedule = build_schedule(config, 1, 6, attention_splits(config, 1, 6, 300))
    paths = []
    for name, oproj_ns in (("slow", 2000), ("fast", 1000)):
        _, times = simulate(schedule, lambda t, ns=oproj_ns: ns if t[0] == TaskType.OPROJ else 1000)
        paths.append(tmp_path / f"profile-{name}.pt")
        torch.save(dict(tasks=schedule.tasks, task_start=schedule.task_start, times=torch.tensor(times)), paths[-1])
    text = compare(*paths)
    rows = {line.split()[0]: line.split() for line in text.splitlines()[4:]}
    n_oproj = int((schedule.tasks[:, 0] == TaskType.OPROJ).sum())
    assert rows["OPROJ"][3:5] == ["2.00", "1.00"] and float(rows["OPROJ"][-1]) == n_oproj * 1.0
    assert all(float(r[-1]) == 0 for k, r in rows.items() if k != "OPROJ")
    assert "step span us" in text


def test_the_report_splits_the_time_between_tasks(tmp_path) -> None:
    """switches(): with 300 ns put between every two tasks of a block (each task's stamps shifted by 300 ns per
    task before it on its block), every type that follows another shows a 0.30 us gap, and the busy column is the
    simulation's 1 us."""
    from profile_report import block_of

    config = preset_config("tiny")
    schedule = build_schedule(config, 1, 6, attention_splits(config, 1, 6, 300))
    _, times = simulate(schedule)
    owner, starts = block_of(schedule.task_start.tolist()), schedule.task_start.tolist()
    shifted = [[stamp + 300 * (i - starts[owner[i]]) for stamp in row] for i, row in enumerate(times)]
    path = tmp_path / "profile-megakernel-b1-c300.pt"
    torch.save(dict(tasks=schedule.tasks, task_start=schedule.task_start, times=torch.tensor(shifted)), path)
    section = report(path, 1, 2.0).split("between tasks (us a task):")[1].strip().splitlines()
    rows = {line.split()[0]: line.split() for line in section[1:-1]}
    assert rows and all(r[2] in ("0.30", "-") and r[4] == "1.00" for r in rows.values()), rows
    assert section[-1].startswith("SM-us in the layer: gaps ")
