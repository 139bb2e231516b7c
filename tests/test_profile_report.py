"""CPU: bench/profile_report.py reads a profiled step. The record is made here from a real schedule (tiny
geometry, 6 blocks) run through a small timing simulation (every task 1 us once its counters are reached), so
the report's phases, occupancy and gating chain can be checked against what the simulation did."""

from __future__ import annotations

import torch

from northcode.bench.profile_report import load, report
from northcode.megakernel.tasks import TaskType, attention_splits, build_schedule
from northcode.model.synthetic import preset_config


def simulated_profile(schedule, slow_kind: int, slow_ns: int) -> torch.Tensor:
    """[N, 3] ns per task: started, met, done; drains (MOE_UP/MOE_DOWN) signal as one task here."""
    tasks, starts = schedule.tasks.tolist(), schedule.task_start.tolist()
    times = [[0, 0, 0] for _ in tasks]
    cursor, clock = list(starts[:-1]), [0] * (len(starts) - 1)
    done_at: dict[int, list[int]] = {}
    progressed = True
    while progressed:
        progressed = False
        for block in range(len(clock)):
            while cursor[block] < starts[block + 1]:
                i = cursor[block]
                t = tasks[i]
                waits = [(t[8], t[10]), (t[9], t[11])]
                if any(c >= 0 and len(done_at.get(c, [])) < target for c, target in waits):
                    break
                reached = [sorted(done_at[c])[target - 1] for c, target in waits if c >= 0 and target > 0]
                start = clock[block]
                met = max([start] + reached)
                done = met + (slow_ns if t[0] == slow_kind else 1000)
                times[i] = [start, met, done]
                if t[12] >= 0:
                    done_at.setdefault(t[12], []).append(done)
                clock[block], cursor[block] = done, i + 1
                progressed = True
    return torch.tensor(times, dtype=torch.int64)


def test_the_report_shows_phases_occupancy_and_the_gating_chain(tmp_path) -> None:
    config = preset_config("tiny")
    schedule = build_schedule(config, 1, 6, attention_splits(config, 1, 6, 300))
    times = simulated_profile(schedule, TaskType.OPROJ, 9000)  # a slow o_proj must gate the layer
    path = tmp_path / "profile-megakernel-b1-c300.pt"
    torch.save(dict(tasks=schedule.tasks, task_start=schedule.task_start, times=times), path)
    assert len(load(path)["tasks"]) == schedule.tasks.shape[0]
    text = report(path, 1, 2.0)
    assert "first met" in text and "blocks busy per bucket" in text
    chain = text.split("what gated the layer's end:")[1].strip().splitlines()
    assert chain[0].startswith("OPROJ"), chain[0]  # the slow task finishes the layer
    assert chain[-1].startswith("NORM") or "first task" in chain[-1] or "stops here" in chain[-1]
    phases = {line.split()[0]: line.split() for line in text.splitlines()[3:12] if line and line.split()[0].isupper()}
    assert float(phases["OPROJ"][-1]) == 9.0  # busy max, us
