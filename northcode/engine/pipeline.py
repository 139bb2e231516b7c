"""The pipelined step: the host launches decode step n+1 before it reads step n's tokens (issue 5, point 4).

Used when the backend offers `launch_decode(batch, carry) -> PendingDecode` (backend.py) and every
running request can be sampled on the device from its seed and draw number alone (no penalties, no
logprobs): then a row's next input is the token it sampled last step, still in device memory
(`carry[b]` = its row in the previous launch), and the host's history lags one token behind. One step:

    schedule n+1 -> prefill chunks (sampled on the host) -> launch decode n+1 -> read decode n
    -> commit n+1 -> append the tokens: stops, EOS, max_tokens and aborts finish sequences

A sequence holds `in_flight` tokens sampled on the device and not yet read (scheduler.py); it is not
scheduled past max_tokens counting them. A sequence that finishes (or is aborted or preempted) while
a step it is in is still running has that step's token dropped when read. Its pages may be freed and
reused at once: every kernel runs on one stream, so whatever reuses them runs after that step. When a
request that needs the host's history arrives, the pending step is read first (`drain`) and the engine
runs unpipelined until it is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from northcode.engine.backend import DecodeBatch, DecodeResult
from northcode.engine.request import SamplingParams, TokenLogprob
from northcode.engine.sampling import SamplingRow
from northcode.engine.scheduler import Sequence, SequenceStatus, StepPlan

IN_FLIGHT = -1  # placeholder output id of a token sampled on the device and not yet read


class PendingDecode(Protocol):
    def result(self) -> DecodeResult:
        """Wait for the step (releasing the GIL) and return its host token ids."""
        ...


@dataclass(slots=True)
class LaunchedStep:
    sequences: list[Sequence]  # [B] in the launch's row order (what carry indexes)
    pending: PendingDecode


def device_sampled(params: SamplingParams, backend) -> bool:
    """True when a request's next token needs nothing but its seed and draw number on the device."""
    return (backend.can_sample(params) and params.logprobs is None and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1)


def pipelined_batch(plan: StepPlan, previous: LaunchedStep | None, block_tables, tables_version: int,
                    tables_columns: int | None) -> tuple[DecodeBatch, list[int]]:
    """The decode batch of plan n+1 and its carry: the row of each sequence in launch n, or -1 when its
    input token is on the host (its prompt's first token came from a prefill, or it was read already)."""
    slot = {id(seq): b for b, seq in enumerate(previous.sequences)} if previous else {}
    carry = [slot[id(s)] if s.in_flight else -1 for s in plan.decodes]
    rows = [SamplingRow(s.params, s.seed, s.prompt_ids, s.output_ids + [IN_FLIGHT] * s.in_flight)
            for s in plan.decodes]  # len(output_ids) is the draw number; the ids are never read (no penalties)
    token_ids = [IN_FLIGHT if s.in_flight else s.last_token for s in plan.decodes]
    batch = DecodeBatch([s.row for s in plan.decodes], token_ids, [s.num_computed for s in plan.decodes], rows,
                        sample=True, return_logits=False,
                        block_tables=block_tables, tables_version=tables_version, tables_columns=tables_columns)
    return batch, carry


def read_tokens(step: LaunchedStep | None) -> list[tuple[Sequence, int]]:
    """Wait for a launched step; (sequence, token) of the rows whose sequence still wants the token."""
    if step is None:
        return []
    tokens = step.pending.result().token_ids
    assert tokens is not None and len(tokens) == len(step.sequences), "launch_decode returned no tokens"
    kept = []
    for seq, token in zip(step.sequences, tokens):
        seq.in_flight -= 1
        if seq.status is not SequenceStatus.FINISHED:
            kept.append((seq, token))
    return kept


class PipelinedSteps:
    """Engine methods for the pipelined step (engine.py owns every attribute they use)."""

    def _pipelined(self) -> bool:
        """The backend can launch without waiting, and no request needs the host's history to sample."""
        if getattr(self.backend, "launch_decode", None) is None:
            return False
        return all(device_sampled(s.params, self.backend) for s in self.scheduler.running + self.scheduler.waiting)

    def _pipelined_model_step(self, plan: StepPlan) -> tuple[list[tuple[Sequence, int, TokenLogprob | None]],
                                                             LaunchedStep | None]:
        """Prefill chunks, launch decode n+1, read decode n: (the tokens to append, the new launch)."""
        sampled = self._prefill(plan)
        launched = None
        if plan.decodes:
            kv = self.kv
            batch, carry = pipelined_batch(plan, self._launched, kv.block_tables, kv.version, kv.high_water)
            launched = LaunchedStep(list(plan.decodes), self.backend.launch_decode(batch, carry))
        return sampled + [(seq, token, None) for seq, token in read_tokens(self._launched)], launched

    def _drain(self) -> None:
        """Read the step in flight and append its tokens; the engine then runs unpipelined."""
        step = self._launched
        self._in_step = list(step.sequences)
        read = self._guarded(lambda: read_tokens(step), set(), None)
        self._launched, self._in_step = None, []
        now = time.perf_counter()
        for seq, token in read:
            self._append(self._requests[seq.request_id], token, None, now)
