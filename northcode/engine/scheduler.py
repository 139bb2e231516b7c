"""Scheduler: admission, continuous batching, chunked prefill and preemption, over the KV cache manager.

How prefill and decode share the GPU: every step runs each decoding sequence once (one token per row)
plus at most `chunk_size` prompt tokens, taken FIFO from the sequences still prefilling, so several short
prompts can start in the same step. While sequences decode, prompts get the GPU's time by turns: after a
step that carried a chunk of a prompt that arrived after a decoding row was admitted, decode-only steps
run until they have had DECODE_SHARE of the time (the engine reports each step's wall time through
`record`), so a decoding request keeps about that share of its tokens/s beside a long prompt instead of
waiting one chunk per token. Prompts that arrived before a row was admitted (a burst that came together)
are not held by it: they reach their first tokens as if it were not there. Whole chunks, not smaller ones,
because a chunk's time has a large fixed part (every expert's weights are read once per chunk): turns of
full chunks give the prompt the most tokens for the time it gets. With nothing decoding, prompts run
every step. A sequence "decodes" when exactly one of its tokens has no KV yet
(its last sampled token, or the only token of a one-token prompt, counting a token still in flight on the
device when the engine pipelines: pipeline.py); until then it prefills.
When pages run out the sequence that arrived last is preempted by recompute: its pages are published
to the prefix cache and freed, its output so far is kept, and it waits again at its arrival place.
The scheduler never touches tensors; the engine runs the plan and reports back with `commit`.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from northcode.engine.kv_cache import KVCacheManager, chain_block_hashes
from northcode.engine.sequence import Sequence, SequenceStatus

DECODE_SHARE = 0.55  # of the wall time that decoding rows keep while prompts prefill beside them: above half,
# so that a decoding request keeps at least half its tokens/s alone (issue 25) after the mixed steps' overhead
DECODE_STEP_SMOOTHING = 0.2  # weight of the newest decode-only step in the estimate of one


@dataclass(slots=True)
class ScheduledChunk:
    sequence: Sequence
    start: int  # first position computed by this chunk
    end: int  # one past the last; end == sequence.num_tokens means a token is sampled after it

    @property
    def samples(self) -> bool:
        return self.end == self.sequence.num_tokens


@dataclass(slots=True)
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)  # one token each, at position num_computed
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    turns: bool = False  # a chunk of a prompt that arrived after one of the decoding rows was admitted

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_batch: int, chunk_size: int, max_model_len: int) -> None:
        self.kv = kv
        self.max_batch = max_batch
        self.chunk_size = chunk_size
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by arrival
        self.running: list[Sequence] = []  # sorted by arrival
        self.free_rows = list(range(max_batch - 1, -1, -1))
        self.num_preemptions = 0  # since start
        self.prefill_debt_s = 0.0  # decode-only time owed to the decoding rows before the next chunk
        self.decode_step_s: float | None = None  # a decode-only step's wall time, smoothed
        self._last_arrival = 0

    # --- requests in and out ---

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ValueError, with the numbers, for a request that could never run."""
        if num_prompt_tokens < 1:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens does not fit the context of "
                             f"{self.max_model_len} tokens (at least one token must be generated)")
        total = min(num_prompt_tokens + max_new_tokens, self.max_model_len)
        need = self.kv.peak_pages(total, self.chunk_size)
        if need > self.kv.pool.num_pages:
            raise ValueError(f"request of {num_prompt_tokens} prompt + {total - num_prompt_tokens} new tokens needs "
                             f"{need} KV pages at its peak; the pool holds {self.kv.pool.num_pages}")

    def add(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.max_new_tokens)
        self._last_arrival = max(self._last_arrival, seq.arrival)
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def finish(self, seq: Sequence) -> None:
        """Release a running or waiting sequence; a running one publishes its blocks first."""
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq, publish=True)
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def take_back(self, seq: Sequence) -> None:
        """A sequence of an engine whose backend was restarted (its KV is gone with the old pools): it
        waits again at its arrival place and recomputes its prompt and output so far, like a preemption."""
        if seq.status is SequenceStatus.RUNNING:
            seq.num_preemptions += 1  # keeps num_cached_tokens from the first admission
        seq.status, seq.row, seq.num_computed, seq.in_flight = SequenceStatus.WAITING, None, 0, 0
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def _release(self, seq: Sequence, publish: bool) -> None:
        assert seq.row is not None
        if publish:
            seq.block_hashes = chain_block_hashes(seq.tokens, self.kv.page_size, seq.block_hashes)
            self.kv.publish(seq.row, seq.block_hashes, seq.num_computed)
        self.kv.free_row(seq.row)
        self.free_rows.append(seq.row)
        seq.row = None
        seq.num_computed = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step ---

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._admit()
        for seq in [s for s in self.running if s.is_decoding]:
            if len(seq.output_ids) + seq.in_flight >= seq.max_new_tokens:
                continue  # its last token is in flight (pipelined): it finishes when that is read
            if seq.status is SequenceStatus.RUNNING and self._make_room(seq, seq.num_computed + 1, plan):
                plan.decodes.append(seq)
        budget = self.chunk_size
        for seq in [s for s in self.running if not s.is_decoding]:
            if budget == 0:
                break
            turns = any(d.admitted_after < seq.arrival for d in plan.decodes)
            if turns and self.prefill_debt_s > 0:
                continue  # the decoding rows' turn
            end = min(seq.num_tokens, seq.num_computed + budget)
            if seq.status is SequenceStatus.RUNNING and self._make_room(seq, end, plan):
                plan.prefills.append(ScheduledChunk(seq, seq.num_computed, end))
                plan.turns |= turns
                budget -= end - seq.num_computed
        now = time.perf_counter()
        for seq in plan.decodes + [c.sequence for c in plan.prefills]:
            seq.first_scheduled_at = seq.first_scheduled_at or now
        return plan

    def record(self, plan: StepPlan, duration_s: float) -> None:
        """The wall time of the step that ran `plan`: what the chunks of later prompts took beside decoding rows
        is owed to those rows (DECODE_SHARE), and decode-only steps pay it back."""
        if not plan.decodes:
            self.prefill_debt_s = 0.0  # nothing was decoding: the prompts had the GPU to themselves
        elif not plan.prefills:
            self.prefill_debt_s = max(0.0, self.prefill_debt_s - duration_s)
            previous = self.decode_step_s
            self.decode_step_s = duration_s if previous is None else (
                previous + DECODE_STEP_SMOOTHING * (duration_s - previous))
        elif plan.turns:
            prefill_s = max(0.0, duration_s - (self.decode_step_s or 0.0))
            self.prefill_debt_s += prefill_s * DECODE_SHARE / (1 - DECODE_SHARE)

    def _admit(self) -> None:
        """FIFO: admit the oldest waiting sequences while a row is free and their prefill peak fits."""
        while self.waiting and self.free_rows:
            seq = self.waiting[0]
            if self.kv.peak_pages(seq.num_tokens, self.chunk_size) > self.kv.num_free_pages:
                break
            self.waiting.pop(0)
            seq.row = self.free_rows.pop()
            seq.admitted_after = self._last_arrival
            seq.block_hashes = chain_block_hashes(seq.tokens, self.kv.page_size, seq.block_hashes)
            seq.num_computed = self.kv.attach_prefix(seq.row, seq.block_hashes, seq.num_tokens)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def _make_room(self, seq: Sequence, end: int, plan: StepPlan) -> bool:
        """Evict behind the window and map pages up to `end`, preempting later arrivals if needed.
        False when `seq` itself had to be preempted (or no room could be made)."""
        assert seq.row is not None
        self.kv.evict_behind_window(seq.row, seq.num_computed)
        planned = set(plan.decodes) | {c.sequence for c in plan.prefills}
        while self.kv.pages_needed(seq.row, end) > self.kv.num_free_pages:
            victims = [s for s in self.running if s not in planned]
            if not victims:
                return False
            victim = victims[-1]  # the latest arrival (possibly seq itself)
            self.preempt(victim, plan)
            if victim is seq:
                return False
        self.kv.allocate(seq.row, end)
        return True

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute later: publish and free its pages, keep its output, wait again in arrival order."""
        self._release(seq, publish=True)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)
        plan.preempted.append(seq)

    def commit(self, plan: StepPlan) -> None:
        """After the model ran the plan: the planned positions now hold KV. Every prefill chunk publishes
        its full blocks, so a repeated prompt finds them while this request still runs, and the sliding
        pages a later chunk frees stay findable: a prompt that shares only the first part of this one
        (same system prompt, other files) still finds the window ending where they part."""
        for seq in plan.decodes:
            seq.num_computed += 1
        for chunk in plan.prefills:
            seq = chunk.sequence
            seq.num_computed = chunk.end
            assert seq.row is not None
            self.kv.publish(seq.row, seq.block_hashes, seq.num_computed)
