"""Offline reading of one profiled megakernel step (`python lab/profile_report.py FILE`; `northcode bench decode
--profile` saves profile-*.pt in --out).

The record holds every task (int32 [N, 16], megakernel/tasks.py's layout), each block's slice of it and three
timestamps per task (ns: started, dependencies met, done). This report answers, for one layer, what the
summary cannot: when each task type ran, how many SMs were busy over time, the chain of tasks that gated the
layer's end (each task's last dependency back to the layer's norm), and the time between one task and the next
on each block. Waits inside a task (a MoE down tile waiting for its slot) are not in the record; the chain
stops there and says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from northcode.megakernel.tasks import TaskType, layer_origin

TYPE, LAYER, WAIT0, WAIT1, TARGET0, TARGET1, SIGNAL = 0, 1, 8, 9, 10, 11, 12  # Task record columns


def load(path: Path) -> dict:
    raw = torch.load(path, map_location="cpu")
    return dict(tasks=raw["tasks"].tolist(), starts=raw["task_start"].tolist(), times=raw["times"].tolist())


def block_of(starts: list[int]) -> list[int]:
    """The block that ran each task."""
    owner = []
    for block in range(len(starts) - 1):
        owner += [block] * (starts[block + 1] - starts[block])
    return owner


def layer_tasks(record: dict, layer: int) -> tuple[list[int], float]:
    """Indices of the layer's tasks and its origin (ns: the first NORM's dependencies met)."""
    tasks, times = record["tasks"], record["times"]
    picked = [i for i, t in enumerate(tasks) if t[LAYER] == layer and t[TYPE] not in (TaskType.LM_HEAD, TaskType.SAMPLE)]
    if not picked:
        raise ValueError(f"layer {layer} has no task in this record")
    return picked, layer_origin(picked, [t[TYPE] for t in tasks], [t[1] for t in times])


def phases(record: dict, picked: list[int], origin: float) -> list[str]:
    """Per task type: count, first met .. last done, median and largest busy time (us from the origin)."""
    tasks, times = record["tasks"], record["times"]
    lines = [f"{'type':<11}{'tasks':>6}{'first met':>11}{'last done':>11}{'busy median':>13}{'busy max':>10}"]
    for kind in sorted({tasks[i][TYPE] for i in picked}):
        mine = [i for i in picked if tasks[i][TYPE] == kind]
        busy = sorted((times[i][2] - times[i][1]) / 1e3 for i in mine)
        first = (min(times[i][1] for i in mine) - origin) / 1e3
        last = (max(times[i][2] for i in mine) - origin) / 1e3
        lines.append(f"{TaskType(kind).name:<11}{len(mine):>6}{first:>11.1f}{last:>11.1f}{busy[len(busy) // 2]:>13.1f}{busy[-1]:>10.1f}")
    return lines


def occupancy(record: dict, picked: list[int], origin: float, bucket_us: float) -> list[str]:
    """Blocks busy (dependencies met, not done) per time bucket, by task type."""
    tasks, times = record["tasks"], record["times"]
    end = max(times[i][2] for i in picked)
    kinds = sorted({tasks[i][TYPE] for i in picked})
    lines = ["  us  " + "".join(f"{TaskType(k).name[:8]:>9}" for k in kinds) + "    total"]
    t = origin
    while t < end:
        counts = [sum(1 for i in picked if tasks[i][TYPE] == k and times[i][1] < t + bucket_us * 1e3 and times[i][2] > t)
                  for k in kinds]
        lines.append(f"{(t - origin) / 1e3:5.0f} " + "".join(f"{c:>9}" for c in counts) + f"{sum(counts):>9}")
        t += bucket_us * 1e3
    return lines


def critical_chain(record: dict, picked: list[int], origin: float) -> list[str]:
    """From the layer's last task to finish, back through the dependency met last, to the layer's norm; runs of
    one block's tasks of one type are shown as one line."""
    tasks, times = record["tasks"], record["times"]
    owner = block_of(record["starts"])
    signallers: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        if t[SIGNAL] >= 0:
            signallers.setdefault(t[SIGNAL], []).append(i)
    chain: list[tuple[int, str]] = []  # (task, how it was reached from the one after it)
    current, how = max(picked, key=lambda i: times[i][2]), "last to finish"
    while True:
        chain.append((current, how))
        t = tasks[current]
        start, met = times[current][0], times[current][1]
        if t[TYPE] == TaskType.NORM and t[LAYER] == tasks[picked[0]][LAYER]:
            break
        if t[LAYER] != tasks[picked[0]][LAYER]:  # the block's previous task was the previous layer's
            chain[-1] = (-1, "the previous layer's end")
            break
        waits = [c for c in (t[WAIT0], t[WAIT1]) if c >= 0]
        if not waits or met - start < 500:  # ready when it started: the block was busy with its previous task
            if current - 1 < record["starts"][owner[current]]:
                chain.append((-1, "first task of its block"))
                break
            current, how = current - 1, "block's previous task"
            continue
        feeding = [i for c in waits for i in signallers.get(c, [])]
        if not feeding:
            chain.append((-1, "waited on a counter signalled inside a task (MoE up slots): the chain stops here"))
            break
        current, how = max(feeding, key=lambda i: times[i][2]), "its last dependency"
    lines, k = [], 0
    while k < len(chain):
        i, how = chain[k]
        if i < 0:
            lines.append(f"  ({how})")
            break
        run = k
        while run + 1 < len(chain) and chain[run + 1][0] >= 0 and chain[run + 1][1] == "block's previous task" \
                and tasks[chain[run + 1][0]][TYPE] == tasks[i][TYPE]:
            run += 1
        first = chain[run][0]
        start, met = ((x - origin) / 1e3 for x in times[first][:2])
        done = (times[i][2] - origin) / 1e3
        count = f" x{run - k + 1}" if run > k else ""
        lines.append(f"{TaskType(tasks[i][TYPE]).name + count:<14} block {owner[i]:>3}  started {start:7.1f}  met {met:7.1f}  "
                     f"done {done:7.1f}   <- reached as: {how}")
        k = run + 1
    return lines


def switches(record: dict, picked: list[int]) -> list[str]:
    """Where the layer's SM time goes between tasks, per task type (us a task, means): the gap from the block's
    previous task's end to this one's start (its record's load), start to dependencies met (the prefetch's issue,
    the counter's and the status's round trips, or a real wait), and busy (met to done); then the layer's totals
    in SM-us (run 65: ~520 of gaps, ~1870 of waits, ~5170 busy in ~7520)."""
    tasks, times = record["tasks"], record["times"]
    starts = set(record["starts"])
    sums: dict[int, list[float]] = {}  # type -> [tasks, gap, tasks with a previous one, wait, busy]
    for i in picked:
        row = sums.setdefault(tasks[i][TYPE], [0, 0.0, 0, 0.0, 0.0])
        row[0] += 1
        if i not in starts:  # not its block's first task
            row[1] += (times[i][0] - times[i - 1][2]) / 1e3
            row[2] += 1
        row[3] += (times[i][1] - times[i][0]) / 1e3
        row[4] += (times[i][2] - times[i][1]) / 1e3
    lines = [f"{'type':<11}{'tasks':>6}{'gap before':>12}{'start->met':>12}{'busy':>9}"]
    for kind, (n, gap, with_prev, wait, busy) in sorted(sums.items()):
        gap_text = f"{gap / with_prev:12.2f}" if with_prev else f"{'-':>12}"
        lines.append(f"{TaskType(kind).name:<11}{n:>6}{gap_text}{wait / n:12.2f}{busy / n:9.2f}")
    total = [sum(row[j] for row in sums.values()) for j in (1, 3, 4)]
    lines.append(f"SM-us in the layer: gaps {total[0]:.0f}, start->met {total[1]:.0f}, busy {total[2]:.0f}")
    return lines


def busy_by_type(record: dict) -> dict[int, tuple[int, float, float]]:
    """The whole step per task type: (tasks, busy median us, busy total us over all blocks); busy is dependencies
    met to done, as the bench's profile line has it."""
    tasks, times = record["tasks"], record["times"]
    out = {}
    for kind in sorted({t[TYPE] for t in tasks}):
        busy = sorted((times[i][2] - times[i][1]) / 1e3 for i, t in enumerate(tasks) if t[TYPE] == kind)
        out[kind] = (len(busy), busy[len(busy) // 2], sum(busy))
    return out


def compare(path: Path, other: Path) -> str:
    """Two profiled steps side by side (two builds, same batch and context): the step's span and each
    task type's busy median and total, with the change; what found run 38's slow o_proj (notebook.md)."""
    a, b = load(path), load(other)
    span = [(max(t[2] for t in r["times"]) - min(t[0] for t in r["times"])) / 1e3 for r in (a, b)]
    out = [f"{path.name} (A) against {other.name} (B)", f"step span us: A {span[0]:.1f}  B {span[1]:.1f}  "
           f"({(span[0] - span[1]) / span[1]:+.1%})", "",
           f"{'type':<11}{'tasks A':>8}{'tasks B':>8}{'median A':>10}{'median B':>10}{'total A':>11}{'total B':>11}"
           f"{'total A-B':>11}"]
    busy_a, busy_b = busy_by_type(a), busy_by_type(b)
    for kind in sorted(set(busy_a) | set(busy_b)):
        na, ma, ta = busy_a.get(kind, (0, 0.0, 0.0))
        nb, mb, tb = busy_b.get(kind, (0, 0.0, 0.0))
        out.append(f"{TaskType(kind).name:<11}{na:>8}{nb:>8}{ma:>10.2f}{mb:>10.2f}{ta:>11.0f}{tb:>11.0f}"
                   f"{ta - tb:>+11.0f}")
    return "\n".join(out)


def report(path: Path, layer: int, bucket_us: float) -> str:
    record = load(path)
    picked, origin = layer_tasks(record, layer)
    out = [f"{path.name}: layer {layer}, times in us from its first NORM's dependencies met", ""]
    out += phases(record, picked, origin) + ["", "blocks busy per bucket:"] + occupancy(record, picked, origin, bucket_us)
    out += ["", "what gated the layer's end:"] + critical_chain(record, picked, origin)
    out += ["", "between tasks (us a task):"] + switches(record, picked)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="a profile-*.pt written by bench decode --profile")
    parser.add_argument("--layer", type=int, default=25, help="the layer to read (default 25: sliding, MoE)")
    parser.add_argument("--bucket-us", type=float, default=4.0, help="time bucket of the occupancy table")
    parser.add_argument("--against", type=Path, default=None, metavar="OTHER",
                        help="another profile-*.pt: print the two steps' busy times per task type side by side")
    args = parser.parse_args()
    print(compare(args.profile, args.against) if args.against else report(args.profile, args.layer, args.bucket_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
