"""The pipelined step: the host launches decode step n+1 before it reads step n's tokens (issue 5, point 4).

Used while every running and waiting request is `SamplingParams.is_device_sampled` (no penalties, no
logprobs): then a row's next input is the token it sampled last step, still in device memory (`carry[b]` =
its row in the previous launch), and the host's history lags one token behind. One step:

    schedule n+1 -> prefill chunks (sampled on the host) -> launch decode n+1 -> read decode n
    -> commit n+1 -> append the tokens: stops, EOS, max_tokens and aborts finish sequences

A sequence holds `in_flight` tokens sampled on the device and not yet read (sequence.py); it is not
scheduled past max_tokens counting them. A sequence that finishes (or is aborted or preempted) while
a step it is in is still running has that step's token dropped when read. Its pages may be freed and
reused at once: every kernel runs on one stream, so whatever reuses them runs after that step. When a
request that needs the host's history arrives, the engine reads the pending step first (its drain) and runs
unpipelined until that request is gone. `DecodePipeline` holds the step in flight; the engine owns one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from northcode.engine.backend import DecodeBatch, ModelBackend, PendingDecode
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.sampling import BatchSamplingArgs
from northcode.engine.scheduler import StepPlan
from northcode.engine.sequence import Sequence, SequenceStatus

IN_FLIGHT = -1  # the token id of a row fed from the device: the token it sampled is not yet on the host


@dataclass(slots=True)
class LaunchedStep:
    sequences: list[Sequence]  # [B] in the launch's row order (what carry indexes)
    pending: PendingDecode


def can_pipeline(sequences: Iterable[Sequence]) -> bool:
    """True when no request needs the host's history to sample (the device draws all of them)."""
    return all(s.params.is_device_sampled for s in sequences)


def pipelined_batch(plan: StepPlan, previous: LaunchedStep | None, block_tables: torch.Tensor, tables_version: int,
                    tables_columns: int | None) -> tuple[DecodeBatch, list[int]]:
    """The decode batch of plan n+1 and its carry: the row of each sequence in launch n, or -1 when its
    input token is on the host (its prompt's first token came from a prefill, or it was read already)."""
    slot = {id(seq): b for b, seq in enumerate(previous.sequences)} if previous else {}
    decodes = plan.decodes
    carry = [slot[id(s)] if s.in_flight else -1 for s in decodes]
    sampling = BatchSamplingArgs.prepare([s.params for s in decodes], [s.seed for s in decodes],
                                         [s.draw for s in decodes])
    token_ids = [IN_FLIGHT if s.in_flight else s.last_token for s in decodes]
    batch = DecodeBatch([s.row for s in decodes], token_ids, [s.num_computed for s in decodes], sampling,
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


class DecodePipeline:
    """The decode step launched and not yet read (`launched`), and the launch of the next one."""

    def __init__(self) -> None:
        self.launched: LaunchedStep | None = None

    @property
    def sequences(self) -> list[Sequence]:
        return self.launched.sequences if self.launched is not None else []

    def launch_and_read(self, plan: StepPlan, backend: ModelBackend,
                        kv: KVCacheManager) -> tuple[list[tuple[Sequence, int]], LaunchedStep | None]:
        """Launch plan n+1's decode rows, then read step n: (its tokens, the new launch or None). Nothing
        changes here: `advance` takes the new launch once the whole step succeeded."""
        launched = None
        if plan.decodes:
            batch, carry = pipelined_batch(plan, self.launched, kv.block_tables, kv.version, kv.high_water)
            launched = LaunchedStep(list(plan.decodes), backend.launch_decode(batch, carry))
        return read_tokens(self.launched), launched

    def advance(self, launched: LaunchedStep | None) -> None:
        """`launched` is the step in flight now; each of its sequences holds one more token on the device."""
        self.launched = launched
        for seq in self.sequences:
            seq.in_flight += 1
