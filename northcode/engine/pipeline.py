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
unpipelined until that request is gone. A constrained row (engine/grammar.py) is device-sampled too, but its
mask for step n+1 needs its token of step n: the launch of n+1 enqueues the model step first, then reads step
n (the `token_masks` it hands the backend), computes the masks while the device runs n+1, and enqueues the
sampling (the megakernel's sampling is enqueued with its step and waits on the device for the masks).
`DecodePipeline` holds the step in flight; the engine owns one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from northcode.engine.backend import DecodeBatch, ModelBackend, PendingDecode
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.sampling import BatchSamplingArgs, TokenMasks
from northcode.engine.scheduler import StepPlan
from northcode.engine.sequence import Sequence, SequenceStatus

IN_FLIGHT = -1  # the token id of a row fed from the device: the token it sampled is not yet on the host
# (sequences, read) -> the constrained rows' masks, or None; read() waits for the launch in flight and gives
# {id(sequence): the token it sampled} (the engine calls it only when an active grammar needs that token)
MaskFunction = Callable[[list[Sequence], Callable[[], dict[int, int]]], TokenMasks | None]


@dataclass(slots=True)
class LaunchedStep:
    sequences: list[Sequence]  # [B] in the launch's row order (what carry indexes)
    pending: PendingDecode
    read: list[tuple[Sequence, int]] | None = None  # what read_tokens returned: a step is read once


def can_pipeline(sequences: Iterable[Sequence]) -> bool:
    """True when no request needs the host's history to sample (the device draws all of them)."""
    return all(s.params.is_device_sampled for s in sequences)


def pipelined_batch(plan: StepPlan, previous: LaunchedStep | None, block_tables: torch.Tensor, tables_version: int,
                    tables_columns: int | None, masks_of: MaskFunction | None = None,
                    text_mask: torch.Tensor | None = None) -> tuple[DecodeBatch, list[int]]:
    """The decode batch of plan n+1 and its carry: the row of each sequence in launch n, or -1 when its
    input token is on the host (its prompt's first token came from a prefill, or it was read already). With
    masks_of (a constrained row), the batch's token_masks hands masks_of the reading of launch n; text_mask:
    the batch's (DecodeBatch.text_mask)."""
    slot = {id(seq): b for b, seq in enumerate(previous.sequences)} if previous else {}
    decodes = plan.decodes
    carry = [slot[id(s)] if s.in_flight else -1 for s in decodes]
    sampling = BatchSamplingArgs.prepare([s.params for s in decodes], [s.seed for s in decodes],
                                         [s.draw for s in decodes])
    token_ids = [IN_FLIGHT if s.in_flight else s.last_token for s in decodes]
    def token_masks() -> TokenMasks | None:
        return masks_of(decodes, lambda: {id(seq): token for seq, token in read_tokens(previous)})
    batch = DecodeBatch([s.row for s in decodes], token_ids, [s.num_computed for s in decodes], sampling,
                        sample=True, return_logits=False, block_tables=block_tables, tables_version=tables_version,
                        tables_columns=tables_columns, token_masks=token_masks if masks_of is not None else None,
                        text_mask=text_mask)
    return batch, carry


def read_tokens(step: LaunchedStep | None) -> list[tuple[Sequence, int]]:
    """Wait for a launched step; (sequence, token) of the rows whose sequence still wants the token (read once:
    a later call returns the same)."""
    if step is None:
        return []
    if step.read is not None:
        return step.read
    tokens = step.pending.result().token_ids
    assert tokens is not None and len(tokens) == len(step.sequences), "launch_decode returned no tokens"
    kept = []
    for seq, token in zip(step.sequences, tokens):
        seq.in_flight -= 1
        if seq.status is not SequenceStatus.FINISHED:
            kept.append((seq, token))
    step.read = kept
    return kept


class DecodePipeline:
    """The decode step launched and not yet read (`launched`), and the launch of the next one."""

    def __init__(self) -> None:
        self.launched: LaunchedStep | None = None

    @property
    def sequences(self) -> list[Sequence]:
        return self.launched.sequences if self.launched is not None else []

    def launch_and_read(self, plan: StepPlan, backend: ModelBackend, kv: KVCacheManager,
                        masks_of: MaskFunction | None = None, text_mask: torch.Tensor | None = None
                        ) -> tuple[list[tuple[Sequence, int]], LaunchedStep | None]:
        """Launch plan n+1's decode rows, then read step n: (its tokens, the new launch or None). Nothing
        changes here: `advance` takes the new launch once the whole step succeeded."""
        launched = None
        if plan.decodes:
            batch, carry = pipelined_batch(plan, self.launched, kv.block_tables, kv.version, kv.high_water, masks_of,
                                           text_mask)
            launched = LaunchedStep(list(plan.decodes), backend.launch_decode(batch, carry))
        return read_tokens(self.launched), launched

    def advance(self, launched: LaunchedStep | None) -> None:
        """`launched` is the step in flight now; each of its sequences holds one more token on the device."""
        self.launched = launched
        for seq in self.sequences:
            seq.in_flight += 1
