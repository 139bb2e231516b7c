"""The megakernel's task lists: one Task record per unit of work, per-block lists built in dependency waves.

A task only waits on counters that tasks of strictly earlier waves signal, and every block runs its list
in wave order, so no list can deadlock; targets are exact counts of the signalling tasks (tests simulate
this on the CPU). TaskType mirrors csrc/megakernel.cu; the .cu only decodes the records. build_schedule
makes each wave one record plus a shared int32 pattern and places all waves at once with tensor ops (~10 ms
for North Mini Code); make_task, place_waves and flatten apply the same rules to Python lists, for small
hand-made lists (tests) and as the reference the tests compare build_schedule with.
"""

from __future__ import annotations

import array
import bisect
import itertools
import math
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch

from northcode.config import ModelConfig
from northcode.engine.settings import PAGE_SIZE  # the kernel's page: 64 tokens

MAX_SPLITS = 32  # NC_MAX_SPLITS: attention splits per (row, KV head)
HALF_SM_SPLIT_TOKENS = 8192 + 64  # a layer's span up to which its attention splits fill half the SMs (8K measured)
TASK_WORDS = 16
QKV_TILES = 2  # 16-row tiles per QKV task, multiplied together (twice the loads in flight: 3% faster at B = 1)
# A sparse layer's COMBINE tasks go to the last blocks, which take no MoE up tiles, so the combine runs as soon as
# attention is done instead of after an up share (it started 5.6 us late at B = 1). Only while the COMBINE tasks
# are few (batch x KV heads): every excluded block lengthens the others' up shares.
COMBINE_APART_MAX = 8


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
    get no QKV tile: the MoE chain runs through them); a ("last", tasks) wave puts its n tasks on the last n
    blocks, in order, and moves no cursor (COMBINE_APART_MAX)."""
    lists: list[list[list[int]]] = [[] for _ in range(num_blocks)]
    cursor, avoid = 0, set()
    for wave in waves:
        if isinstance(wave, tuple) and wave[0] == "each":
            for block_tasks in lists:
                block_tasks.append(list(wave[1]))
            continue
        if isinstance(wave, tuple) and wave[0] == "last":
            assert len(wave[1]) <= num_blocks
            for i, task in enumerate(wave[1]):
                lists[num_blocks - len(wave[1]) + i].append(task)
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
    """KV splits per layer: as many (row, head, split) tasks as fit on the SMs in one round, on half of them for
    a layer whose span is at most HALF_SM_SPLIT_TOKENS (at 8K, 1.9-2.8% faster at batch 1/2/4/8 than all of them:
    the other half streams the MoE experts sooner and the combine merges fewer partials; a quarter was slower;
    longer spans, where attention's bytes grow, keep all the SMs: not measured), and for short contexts about as
    many as pages, rounded up to a power of two: the task lists are cached per split tuple (about 10 ms of Python
    and an upload each), so a context that grows by a page must not ask for new ones (empty splits cost nothing)."""
    all_sms = min(MAX_SPLITS, max(1, num_blocks // (batch * config.num_key_value_heads)))
    half_sms = min(MAX_SPLITS, max(1, num_blocks // (2 * batch * config.num_key_value_heads)))
    splits = []
    for layer in range(config.num_hidden_layers):
        window = config.window(layer)
        tokens = min(context + 1, window) if window else context + 1
        pages = math.ceil(tokens / PAGE_SIZE) + 1
        wanted = half_sms if tokens <= HALF_SM_SPLIT_TOKENS else all_sms
        splits.append(max(1, min(wanted, 1 << (pages - 1).bit_length())))
    return tuple(splits)


class _WaveSpec(NamedTuple):
    """One wave for build_schedule: n tasks, task i = row + pattern[i]."""

    mode: str  # "plain" | "apart" | "each" | "last": place_waves' wave kinds ("each": n is 1, one copy per block)
    row: list[int]  # make_task record: the fixed fields, and the offsets of the varying ones
    n: int
    pattern: torch.Tensor  # int32 [n, 16], zero but in the varying fields; shared, e.g. by every layer's QKV wave


class _WaveMaker:
    """Makes one build's _WaveSpecs; holds the per-task index tensors (int64 [n]) and the patterns built from
    them, so that a wave costs a make_task call and a dictionary look-up."""

    def __init__(self, c: ModelConfig, batch: int) -> None:
        self.batch, self.kvh = batch, c.num_key_value_heads
        self.oproj_tiles = c.hidden_size // 16
        group, d = c.num_attention_heads // self.kvh, c.head_dim
        tiles, counts, groups = [], [], []
        for g in range(self.kvh):  # a task's tiles never straddle a KV group, so attention waits per group
            for first, count in ((g * group * d // 16, group * d // 16), ((c.q_size + g * d) // 16, d // 16),
                                 ((c.q_size + c.kv_size + g * d) // 16, d // 16)):
                for tile in range(first, first + count, QKV_TILES):
                    tiles.append(tile), counts.append(min(QKV_TILES, first + count - tile)), groups.append(g)
        self.qkv_tile, self.qkv_count, self.qkv_group = (torch.tensor(x) for x in (tiles, counts, groups))
        self.group_tasks = torch.bincount(self.qkv_group, minlength=self.kvh)  # [kvh]: QKV tasks per group
        self.heads = torch.arange(batch * self.kvh)  # (row, KV head) pairs: b * kvh + g
        self.head_row, self.head_group = self.heads // self.kvh, self.heads % self.kvh
        self._aranges: dict[int, torch.Tensor] = {}
        self._attention: dict[int, tuple] = {}
        self._patterns: dict[tuple, tuple] = {}  # (n, (column, id(values))...) -> (pattern, values kept alive)

    def arange(self, n: int) -> torch.Tensor:
        return self._aranges.setdefault(n, torch.arange(n))

    def attention(self, num_splits: int) -> tuple[torch.Tensor, ...]:
        """(b, g, s, b * kvh + g, QKV tasks of group g) per ATTN task, ordered b, s, g."""
        if num_splits not in self._attention:
            i = torch.arange(self.batch * num_splits * self.kvh)
            b, s, g = i // (num_splits * self.kvh), i // self.kvh % num_splits, i % self.kvh
            self._attention[num_splits] = (b, g, s, b * self.kvh + g, self.group_tasks[g])
        return self._attention[num_splits]

    def wave(self, mode: str, kind: TaskType, layer: int, n: int, args: tuple = (), waits: tuple = (),
             signal=-1) -> _WaveSpec:
        """make_task for a wave of n tasks: any arg, wait counter, target or signal may be a pair (offset,
        int tensor [n]) instead of an int, task i getting offset + tensor[i]."""
        values = [*args, *(w[0] for w in waits), *(w[1] for w in waits), signal]
        columns = [*range(2, 2 + len(args)), *range(8, 8 + len(waits)), *range(10, 10 + len(waits)), 12]
        fixed = [v if isinstance(v, int) else v[0] for v in values]
        k, w = len(args), len(waits)
        row = make_task(kind, layer, tuple(fixed[:k]), tuple(zip(fixed[k:k + w], fixed[k + w:k + 2 * w])), fixed[-1])
        varying = tuple((column, v[1]) for column, v in zip(columns, values) if not isinstance(v, int))
        key = (n, tuple((column, id(t)) for column, t in varying))
        if key not in self._patterns:
            pattern = torch.zeros(n, TASK_WORDS, dtype=torch.int32)
            for column, t in varying:
                pattern[:, column] = t
            self._patterns[key] = (pattern, varying)
        return _WaveSpec(mode, row, n, self._patterns[key][0])


def _attention_waves(c: ModelConfig, layer: int, m: _WaveMaker, counters: _Counters, qkv_waits: tuple,
                     num_splits: int, combine_mode: str) -> tuple[list, tuple[int, int]]:
    """One layer's QKV (waiting on qkv_waits), ATTN, COMBINE (placed as combine_mode says) and OPROJ waves; also
    allocates the layer's MLP counter (returned with the o_proj counter: (oproj_done, mlp_done)), in the counters'
    reference order."""
    batch, kvh = m.batch, m.kvh
    qkv_done = counters.alloc(kvh)
    qkv_args = ((0, m.qkv_tile), (0, m.qkv_count), int(c.uses_rope(layer)))
    qkv = m.wave("plain", TaskType.QKV, layer, len(m.qkv_tile), qkv_args, qkv_waits, (qkv_done, m.qkv_group))
    attn_done = counters.alloc(batch * kvh)
    combine_done, oproj_done, mlp_done = counters.alloc(), counters.alloc(), counters.alloc()
    b, g, s, head, group_tasks = m.attention(num_splits)
    attn = m.wave("plain", TaskType.ATTN, layer, len(b), ((0, b), (0, g), (0, s), num_splits, c.window(layer) or 0),
                  (((qkv_done, g), (0, group_tasks)),), (attn_done, head))
    combine = m.wave(combine_mode, TaskType.COMBINE, layer, batch * kvh, ((0, m.head_row), (0, m.head_group), num_splits),
                     (((attn_done, m.heads), num_splits),), combine_done)
    oproj = m.wave("plain", TaskType.OPROJ, layer, m.oproj_tiles, ((0, m.arange(m.oproj_tiles)), 1),
                   ((combine_done, batch * kvh),), oproj_done)
    return [qkv, attn, combine, oproj], (oproj_done, mlp_done)


def _layer_waves(c: ModelConfig, layer: int, m: _WaveMaker, counters: _Counters, previous: tuple, num_splits: int,
                 num_blocks: int) -> tuple[list, tuple]:
    """One layer's wave specs in list order (_WaveMaker.wave), and what the next layer's norm waits on."""
    norm_done = counters.alloc()
    norm = m.wave("plain", TaskType.NORM, layer, m.batch, ((0, m.arange(m.batch)),), previous, norm_done)
    norm_waits = ((norm_done, m.batch),)
    dense = c.is_dense(layer)
    apart = 0 if dense else combine_blocks_apart(c, m.batch, num_blocks)
    (qkv, attn, combine, oproj), (oproj_done, mlp_done) = _attention_waves(
        c, layer, m, counters, norm_waits, num_splits, "last" if apart else "plain")
    if dense:
        up_done = counters.alloc()
        up_tiles, down_tiles = c.dense_intermediate_size // 16, c.hidden_size // 32
        up = m.wave("plain", TaskType.DENSE_UP, layer, up_tiles, ((0, m.arange(up_tiles)), 1), norm_waits, up_done)
        down = m.wave("plain", TaskType.DENSE_DOWN, layer, down_tiles, ((0, m.arange(down_tiles)), 1),
                      ((up_done, up_tiles),), mlp_done)
        return [norm, qkv, up, attn, down, combine, oproj], ((oproj_done, oproj.n), (mlp_done, down_tiles))
    router_tiles = math.ceil(c.num_experts / 16)
    router_done, topk_done = counters.alloc(), counters.alloc()
    slot_done = counters.alloc(c.num_experts)
    claim = counters.alloc()
    # the router goes before QKV: the MoE chain (router -> top-k -> up -> down) is the layer's longest
    router = m.wave("apart", TaskType.ROUTER, layer, router_tiles, ((0, m.arange(router_tiles)),), norm_waits,
                    router_done)
    moe_waits = ((topk_done, 1),)  # the MoE tasks read the top-k's slots
    topk = m.wave("apart", TaskType.TOPK, layer, 1, (), ((router_done, router_tiles),), topk_done)
    # MOE_UP arg0: the last blocks, which take no up tile (they hold the COMBINE tasks); arg1: the first "slot done"
    # counter; arg2: the counter up tiles are claimed from
    up = m.wave("each", TaskType.MOE_UP, layer, 1, (apart, slot_done, claim), moe_waits)
    down = m.wave("each", TaskType.MOE_DOWN, layer, 1, (0, slot_done), moe_waits, mlp_done)
    return [norm, router, topk, qkv, attn, up, combine, down, oproj], ((oproj_done, oproj.n), (mlp_done, num_blocks))


def combine_blocks_apart(config: ModelConfig, batch: int, num_blocks: int) -> int:
    """How many last blocks hold a sparse layer's COMBINE tasks and no up tile: batch x KV heads where they are
    few (COMBINE_APART_MAX) next to the blocks, else 0 (the combine placed round-robin)."""
    n = batch * config.num_key_value_heads
    return n if n <= COMBINE_APART_MAX and 2 * n <= num_blocks else 0


def split_contexts(config: ModelConfig, batch: int, num_blocks: int, max_context: int) -> list[int]:
    """One context per distinct attention_splits tuple for contexts 0..max_context (the task lists a
    sequence can need; MegakernelBackend.warm_up builds them all). Split counts change only where a layer's
    page count crosses a power of two or the window: those places are the candidates."""
    candidates = {0, max_context}
    for k in range(0, max(1, max_context // PAGE_SIZE).bit_length() + 2):
        for pages in (2 ** k - 1, 2 ** k, 2 ** k + 1):
            candidates.update(PAGE_SIZE * pages + d for d in (-2, -1, 0, 1))
    for layer in range(config.num_hidden_layers):
        window = config.window(layer)
        if window:
            candidates.update(window + d for d in (-2, -1, 0, 1))
    contexts, seen = [], set()
    for context in sorted(c for c in candidates if 0 <= c <= max_context):
        splits = attention_splits(config, batch, num_blocks, context)
        if splits not in seen:
            seen.add(splits)
            contexts.append(context)
    return contexts


def build_schedule(config: ModelConfig, batch: int, num_blocks: int, splits: tuple[int, ...]) -> Schedule:
    """The whole step's task lists (waves per layer, then final norm, LM head and sampling); every wait points to
    an earlier wave. A sparse layer's lists run NORM, ROUTER, TOPK, QKV, ATTN, MOE_UP, COMBINE, MOE_DOWN, OPROJ;
    a dense layer's NORM, QKV, DENSE_UP, ATTN, DENSE_DOWN, COMBINE, OPROJ. Waves are _WaveSpecs placed in one go
    by place_waves' rule: about 10 ms for North Mini Code (make_task and place_waves per task took 0.1-0.2 s, a
    stall for every new batch size)."""
    c, m, counters = config, _WaveMaker(config, batch), _Counters()
    waves: list = []
    previous: tuple = ()  # what a layer's norm waits on: the last layer's o_proj and MLP
    for layer in range(c.num_hidden_layers):
        layer_waves, previous = _layer_waves(c, layer, m, counters, previous, splits[layer], num_blocks)
        waves += layer_waves
    final_done, lm_done = counters.alloc(), counters.alloc()
    rows = (0, m.arange(batch))
    waves.append(m.wave("plain", TaskType.NORM, c.num_hidden_layers, batch, (rows, 1), previous, final_done))
    lm_tiles = math.ceil(c.vocab_size / 32)
    per_task = max(1, math.ceil(lm_tiles / (2 * num_blocks)))
    starts = torch.arange(0, lm_tiles, per_task)
    num_lm = len(starts)
    waves.append(m.wave("plain", TaskType.LM_HEAD, 0, num_lm, ((0, starts), (0, (lm_tiles - starts).clamp(max=per_task)),
                                                             (0, m.arange(num_lm))), ((final_done, batch),), lm_done))
    waves.append(m.wave("plain", TaskType.SAMPLE, 0, batch, (rows, num_lm), ((lm_done, num_lm),)))
    tasks, task_start = _place_wave_specs(waves, num_blocks)
    return Schedule(tasks, task_start, max(counters.count, 1), num_lm)


def _wave_tables(waves: list, num_blocks: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """place_waves' cursor rule, per wave: task i of wave w goes to block table[start_w + (first_w + i) % m_w],
    where the table's m_w entries from start_w are the blocks the wave may use, in order (all blocks, or
    all but those the "apart" waves since the last plain one used). An "each" wave has num_blocks copies,
    copy i on block i, and moves no cursor; a "last" wave of n tasks puts task i on block num_blocks - n + i
    and moves no cursor either. Returns the flat table and first, m, start per wave."""
    every, all_blocks = list(range(num_blocks)), set(range(num_blocks))
    table, firsts, moduli, starts = list(every), [], [], []
    cursor, avoid = 0, set()
    for mode, _, n, _ in waves:  # _WaveSpec
        if mode in ("each", "last"):
            firsts.append(0 if mode == "each" else num_blocks - n), moduli.append(num_blocks), starts.append(0)
            continue
        skip = avoid if len(avoid) < num_blocks else set()
        allowed = sorted(all_blocks - skip) if skip else every
        first = bisect.bisect_left(allowed, cursor) % len(allowed)  # the first free block from the cursor on
        starts.append(len(table) if skip else 0)
        if skip:
            table += allowed
        firsts.append(first), moduli.append(len(allowed))
        if n:
            cursor = (allowed[(first + n - 1) % len(allowed)] + 1) % num_blocks
        if mode == "apart":
            avoid = avoid | {allowed[(first + i) % len(allowed)] for i in range(min(n, len(allowed)))}
        else:
            avoid = set()
    return table, firsts, moduli, starts


def _place_wave_specs(waves: list, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """place_waves + flatten for _WaveSpecs: (tasks int32 [N, 16], task_start int32 [num_blocks + 1])."""
    table, firsts, moduli, starts = _wave_tables(waves, num_blocks)
    sizes = torch.tensor([num_blocks if mode == "each" else n for mode, _, n, _ in waves])
    fixed = array.array("i", itertools.chain.from_iterable(row for _, row, _, _ in waves))  # torch.tensor: 10x slower
    rows = torch.frombuffer(fixed, dtype=torch.int32).view(-1, TASK_WORDS).repeat_interleave(sizes, 0)
    rows += torch.cat([pattern.expand(num_blocks, -1) if mode == "each" else pattern for mode, _, _, pattern in waves])
    shift = torch.tensor(firsts) - (torch.cumsum(sizes, 0) - sizes)  # first_w - index of the wave's first task
    slot = (torch.arange(len(rows)) + shift.repeat_interleave(sizes)) % torch.tensor(moduli).repeat_interleave(sizes)
    slot += torch.tensor(starts).repeat_interleave(sizes)
    block = torch.frombuffer(array.array("q", table), dtype=torch.int64)[slot]  # [N]
    order = torch.sort(block, stable=True).indices  # per block: wave order, then task order within a wave
    task_start = torch.zeros(num_blocks + 1, dtype=torch.int32)
    task_start[1:] = torch.cumsum(torch.bincount(block, minlength=num_blocks), 0)
    return rows[order], task_start


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


def layer_origin(picked: list[int], kinds, met) -> float:
    """When a profiled layer starts (ns): its first NORM's dependencies met. picked: the layer's task indices;
    kinds, met: per task."""
    return min(float(met[i]) for i in picked if kinds[i] == TaskType.NORM)


def layer_timeline(kinds: list[int], layers: list[int], met: torch.Tensor, done: torch.Tensor, layer: int) -> str:
    """One layer's critical path: per task type, when its first task's dependencies were met and when its
    last task finished, in us from the layer's first NORM start; e.g. "NORM 0.0-1.1 QKV 1.3-8.2 ..."."""
    picked = [i for i, (k, l) in enumerate(zip(kinds, layers)) if l == layer and k not in (TaskType.LM_HEAD, TaskType.SAMPLE)]
    origin = layer_origin(picked, kinds, met)
    parts = []
    for kind in sorted({kinds[i] for i in picked}):
        mine = [i for i in picked if kinds[i] == kind]
        first, last = min(float(met[i]) for i in mine), max(float(done[i]) for i in mine)
        parts.append(f"{TaskType(kind).name} {(first - origin) / 1e3:.1f}-{(last - origin) / 1e3:.1f}")
    return " ".join(parts)
