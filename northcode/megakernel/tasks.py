"""The megakernel's task lists: one Task record per unit of work, per-block lists built in dependency waves.

A task only waits on counters that tasks of strictly earlier waves signal, and every block runs its list
in wave order, so no list can deadlock; targets are exact counts of the signalling tasks (tests simulate
this on the CPU). TaskType mirrors csrc/megakernel.cu; the .cu only decodes the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from northcode.config import ModelConfig

MAX_SPLITS = 32  # NC_MAX_SPLITS: attention splits per (row, KV head)
PAGE_SIZE = 64
TASK_WORDS = 16
# Where a sparse layer's MoE drains sit relative to attention and its tail (COMBINE, OPROJ) in every list:
# attention-first: ATTN, UP, COMBINE, DOWN, OPROJ; moe-first: UP, ATTN, DOWN, COMBINE, OPROJ;
# tail-early: ATTN, COMBINE, UP, OPROJ, DOWN (o_proj streams between the up and down phases, not after);
# oproj-before-down: ATTN, UP, COMBINE, OPROJ, DOWN.
WAVE_ORDERS = ("attention-first", "moe-first", "tail-early", "oproj-before-down")


class TaskType(IntEnum):  # mirrors TaskType in csrc/megakernel.cu
    STOP = 0
    NORM = 1
    QKV = 2
    ATTN = 3
    COMBINE = 4
    OPROJ = 5
    ROUTER = 6
    TOPK = 7
    MOE_UP = 8
    MOE_DOWN = 9
    DENSE_UP = 10
    DENSE_DOWN = 11
    LM_HEAD = 12
    SAMPLE = 13


def make_task(kind: TaskType, layer: int = 0, args: tuple[int, ...] = (), waits: tuple[tuple[int, int], ...] = (),
              signal: int = -1) -> list[int]:
    """One Task record: [type, layer, arg0..5, wait0, wait1, target0, target1, signal, pad x3]."""
    assert len(args) <= 6 and len(waits) <= 2
    padded = list(waits) + [(-1, 0)] * (2 - len(waits))
    return [int(kind), layer, *args, *[0] * (6 - len(args)), padded[0][0], padded[1][0], padded[0][1],
            padded[1][1], signal, 0, 0, 0]


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-block task lists of one decode step, flattened for the device."""

    tasks: torch.Tensor  # int32 [num_tasks, 16]
    task_start: torch.Tensor  # int32 [num_blocks + 1]
    num_counters: int
    num_lm_tasks: int


class _Counters:
    def __init__(self) -> None:
        self.count = 0

    def alloc(self, n: int = 1) -> int:
        self.count += n
        return self.count - n


def place_waves(waves: list, num_blocks: int) -> list[list[list[int]]]:
    """Round-robin each wave's tasks over the blocks, the cursor carried across waves; a ("each", task)
    wave puts one copy on every block (the drains); an ("apart", tasks) wave is placed like a plain one, and
    the next plain wave skips the blocks it used while other blocks remain (the router's and top-k's blocks
    get no QKV tile: the MoE chain runs through them)."""
    lists: list[list[list[int]]] = [[] for _ in range(num_blocks)]
    cursor, avoid = 0, set()
    for wave in waves:
        if isinstance(wave, tuple) and wave[0] == "each":
            for block_tasks in lists:
                block_tasks.append(list(wave[1]))
            continue
        apart = isinstance(wave, tuple)
        tasks = wave[1] if apart else wave
        skip = avoid if len(avoid) < num_blocks else set()
        used = set()
        for task in tasks:
            while cursor in skip:
                cursor = (cursor + 1) % num_blocks
            lists[cursor].append(task)
            used.add(cursor)
            cursor = (cursor + 1) % num_blocks
        avoid = avoid | used if apart else set()
    return lists


def attention_splits(config: ModelConfig, batch: int, num_blocks: int, context: int) -> tuple[int, ...]:
    """KV splits per layer: as many (row, head, split) tasks as fit on the SMs in one round (a second round
    would double the attention phase for a few blocks), and for short contexts about as many as pages,
    rounded up to a power of two: the task lists are cached per split tuple and take 0.1-0.2 s of Python
    to build, so a context that grows by a page must not ask for new ones (empty splits cost nothing)."""
    wanted = min(MAX_SPLITS, max(1, num_blocks // (batch * config.num_key_value_heads)))
    splits = []
    for layer in range(config.num_hidden_layers):
        window = config.window(layer)
        tokens = min(context + 1, window) if window else context + 1
        pages = math.ceil(tokens / PAGE_SIZE) + 1
        splits.append(max(1, min(wanted, 1 << (pages - 1).bit_length())))
    return tuple(splits)


def build_schedule(config: ModelConfig, batch: int, num_blocks: int, splits: tuple[int, ...],
                   order: str = "attention-first", qkv_tiles: int = 1) -> Schedule:
    """The whole step's task lists (waves per layer, then final norm, LM head and sampling).

    order: WAVE_ORDERS (dense layers keep one order). Every wait points to an earlier wave. qkv_tiles: 16-row
    tiles per QKV task (2: the kernel multiplies them together, twice the loads in flight).
    """
    assert order in WAVE_ORDERS, order
    c = config
    counters = _Counters()
    kvh, group, d = c.num_key_value_heads, c.num_attention_heads // c.num_key_value_heads, c.head_dim
    waves: list = []
    previous: tuple[tuple[int, int], ...] = ()  # what a layer's norm waits on: the last layer's o_proj and MLP
    for layer in range(c.num_hidden_layers):
        norm_done = counters.alloc()
        waves.append([make_task(TaskType.NORM, layer, (b,), previous, norm_done) for b in range(batch)])
        qkv_done = counters.alloc(kvh)
        qkv, per_group = [], [0] * kvh
        for g in range(kvh):  # a task's tiles never straddle a KV group, so attention waits per group
            for first, count in ((g * group * d // 16, group * d // 16), ((c.q_size + g * d) // 16, d // 16),
                                 ((c.q_size + c.kv_size + g * d) // 16, d // 16)):
                for tile in range(first, first + count, qkv_tiles):
                    qkv.append(make_task(TaskType.QKV, layer, (tile, min(qkv_tiles, first + count - tile),
                                                               int(c.uses_rope(layer))), ((norm_done, batch),), qkv_done + g))
                    per_group[g] += 1
        qkv_wave = len(waves)
        waves.append(qkv)
        attn_done, combine_done, oproj_done, mlp_done = counters.alloc(batch * kvh), counters.alloc(), counters.alloc(), counters.alloc()
        window = c.window(layer) or 0
        attn = [make_task(TaskType.ATTN, layer, (b, g, s, splits[layer], window), ((qkv_done + g, per_group[g]),),
                          attn_done + b * kvh + g) for b in range(batch) for s in range(splits[layer]) for g in range(kvh)]
        combine = [make_task(TaskType.COMBINE, layer, (b, g, splits[layer]), ((attn_done + b * kvh + g, splits[layer]),),
                             combine_done) for b in range(batch) for g in range(kvh)]
        combine_target = batch * kvh
        if c.is_dense(layer):
            up_done = counters.alloc()
            up_tiles = c.dense_intermediate_size // 16
            waves.append([make_task(TaskType.DENSE_UP, layer, (t, 1), ((norm_done, batch),), up_done) for t in range(up_tiles)])
            down_tiles = c.hidden_size // 32
            waves += [attn, [make_task(TaskType.DENSE_DOWN, layer, (t, 1), ((up_done, up_tiles),), mlp_done)
                             for t in range(down_tiles)], combine]
            mlp_target = down_tiles
        else:
            router_done, topk_done = counters.alloc(), counters.alloc()
            slot_done = counters.alloc(c.num_experts)
            router_tiles = math.ceil(c.num_experts / 16)
            # the router goes before QKV: the MoE chain (router -> top-k -> up -> down) is the layer's longest
            waves[qkv_wave:qkv_wave] = [("apart", [make_task(TaskType.ROUTER, layer, (t, 1), ((norm_done, batch),), router_done)
                                                   for t in range(router_tiles)]),
                                        ("apart", [make_task(TaskType.TOPK, layer, (), ((router_done, router_tiles),), topk_done)])]
            # arg0 unused; arg1: the first "slot done" counter (static shares: claims measured no faster, run 10)
            up = ("each", make_task(TaskType.MOE_UP, layer, (0, slot_done), ((topk_done, 1),)))
            down = ("each", make_task(TaskType.MOE_DOWN, layer, (0, slot_done), ((topk_done, 1),), mlp_done))
            mlp_target = num_blocks
        oproj_tiles = c.hidden_size // 16
        oproj = [make_task(TaskType.OPROJ, layer, (t, 1), ((combine_done, combine_target),), oproj_done)
                 for t in range(oproj_tiles)]
        oproj_target = len(oproj)
        if c.is_dense(layer):
            waves.append(oproj)
        else:
            waves += {"attention-first": [attn, up, combine, down, oproj], "moe-first": [up, attn, down, combine, oproj],
                      "tail-early": [attn, combine, up, oproj, down],
                      "oproj-before-down": [attn, up, combine, oproj, down]}[order]
        previous = ((oproj_done, oproj_target), (mlp_done, mlp_target))
    final_done, lm_done = counters.alloc(), counters.alloc()
    waves.append([make_task(TaskType.NORM, c.num_hidden_layers, (b, 1), previous, final_done) for b in range(batch)])
    lm_tiles = math.ceil(c.vocab_size / 32)
    per_task = max(1, math.ceil(lm_tiles / (2 * num_blocks)))
    starts = list(range(0, lm_tiles, per_task))
    waves.append([make_task(TaskType.LM_HEAD, 0, (t, min(per_task, lm_tiles - t), j), ((final_done, batch),), lm_done)
                  for j, t in enumerate(starts)])
    waves.append([make_task(TaskType.SAMPLE, 0, (b, len(starts)), ((lm_done, len(starts)),)) for b in range(batch)])
    return flatten(place_waves(waves, num_blocks), counters.count, len(starts))


def flatten(lists: list[list[list[int]]], num_counters: int, num_lm_tasks: int) -> Schedule:
    offsets = [0]
    for block_tasks in lists:
        offsets.append(offsets[-1] + len(block_tasks))
    rows = [task for block_tasks in lists for task in block_tasks] or [make_task(TaskType.STOP)]
    return Schedule(torch.tensor(rows, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
                    max(num_counters, 1), num_lm_tasks)


def summarize_profile(tasks: torch.Tensor, task_start: torch.Tensor, times: torch.Tensor) -> dict:
    """Where one profiled step's time went. tasks: int32 [N, 16]; task_start: [blocks + 1];
    times: int64 [N, 3] ns (start, dependencies met, done) from Params.profile.

    Per task type: count, summed wait (start -> met) and busy (met -> done) in us; per layer, the time
    from the previous layer's last o_proj to its own (the critical path's share); the blocks' busy
    fraction of the step."""
    kinds, layers = tasks[:, 0].tolist(), tasks[:, 1].tolist()
    start, met, done = (times[:, k].double() for k in range(3))
    origin = start.min()
    span_us = float(done.max() - origin) / 1e3
    by_type: dict[str, dict] = {}
    for kind in sorted(set(kinds)):
        mask = torch.tensor([k == kind for k in kinds])
        by_type[TaskType(kind).name] = dict(count=int(mask.sum()), wait_us=round(float((met - start)[mask].sum()) / 1e3, 1),
                                            busy_us=round(float((done - met)[mask].sum()) / 1e3, 1))
    layer_end: dict[int, float] = {}
    for i, (kind, layer) in enumerate(zip(kinds, layers)):
        if kind == TaskType.OPROJ:
            layer_end[layer] = max(layer_end.get(layer, 0.0), float(done[i] - origin) / 1e3)
    ends = [layer_end[k] for k in sorted(layer_end)]
    layer_us = [round(b - a, 1) for a, b in zip([0.0] + ends, ends)]
    blocks = task_start.numel() - 1
    return dict(span_us=round(span_us, 1), by_type=by_type, layer_us=layer_us,
                busy_fraction=round(float((done - met).sum()) / 1e3 / (span_us * blocks), 3),
                timelines={layer: layer_timeline(kinds, layers, met, done, layer) for layer in (24, 25) if layer in layer_end})


def layer_timeline(kinds: list[int], layers: list[int], met: torch.Tensor, done: torch.Tensor, layer: int) -> str:
    """One layer's critical path: per task type, when its first task's dependencies were met and when its
    last task finished, in us from the layer's first NORM start; e.g. "NORM 0.0-1.1 QKV 1.3-8.2 ..."."""
    picked = [i for i, (k, l) in enumerate(zip(kinds, layers)) if l == layer and k not in (TaskType.LM_HEAD, TaskType.SAMPLE)]
    origin = min(float(met[i]) for i in picked if kinds[i] == TaskType.NORM)
    parts = []
    for kind in sorted({kinds[i] for i in picked}):
        mine = [i for i in picked if kinds[i] == kind]
        first, last = min(float(met[i]) for i in mine), max(float(done[i]) for i in mine)
        parts.append(f"{TaskType(kind).name} {(first - origin) / 1e3:.1f}-{(last - origin) / 1e3:.1f}")
    return " ".join(parts)
