"""Sequence (one request's tokens and where they stand in the cache) and RequestState (its engine-side record).

A Sequence is what the scheduler and the KV cache see: prompt and output ids, its block-table row while it
runs, how many of its tokens have KV, and a token in flight on the device when the engine pipelines
(pipeline.py). A RequestState is what the step thread keeps besides: where the outputs go (an asyncio queue
read on its event loop), its detokenizer, stop strings and grammar, and its timings. `sampling_rows` is what the
Sampler reads of a batch's sequences. Pure Python: no tensors here.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from northcode.engine.request import FinishReason, RequestOutput, SamplingParams, Timings, TokenLogprob, Usage
from northcode.engine.sampling import SamplingRow, StopStringFilter

if TYPE_CHECKING:
    from northcode.engine.grammar import RequestGrammar
    from northcode.model.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # max_tokens capped by the context left after the prompt
    arrival: int  # submission order: FIFO admission and the preemption victim follow it
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    row: int | None = None  # block-table row while running
    num_computed: int = 0  # tokens whose KV is in the cache (this admission)
    in_flight: int = 0  # tokens sampled on the device and not yet read by the host (pipeline.py), 0 or 1
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    admitted_after: int = 0  # the last arrival when it was admitted: later prompts take turns with it
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks of tokens
    submitted_at: float = field(default_factory=time.perf_counter)
    first_scheduled_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == self.num_tokens + self.in_flight - 1

    @property
    def draw(self) -> int:
        """The draw number of its next token: every token sampled before it, one in flight included."""
        return len(self.output_ids) + self.in_flight


@dataclass(eq=False)
class RequestState:
    """A request's engine-side record: its sequence, where its outputs go, its text filters and timings."""

    sequence: Sequence
    queue: asyncio.Queue  # of RequestOutput, read by generate() on `loop`
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer | None  # None: an engine without a tokenizer (benchmarks) emits no text
    stops: StopStringFilter
    last_token_at: float | None = None
    latencies: list[float] = field(default_factory=list)
    time_to_first_token: float | None = None
    ended: bool = False  # its final output was sent by the watchdog or a fatal error (the step thread drops it)
    grammar: RequestGrammar | None = None  # a constrained request's matcher (engine/grammar.py)

    def emit(self, output: RequestOutput) -> None:
        """Hand an output to the request's event loop (called from the step thread)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def take_token(self, token: int, now: float) -> tuple[str, str | None]:
        """Append a sampled token and time it: (its text safe to show, the stop string it completed or None)."""
        seq = self.sequence
        seq.output_ids.append(token)
        if self.last_token_at is None:
            self.time_to_first_token = now - seq.submitted_at
        else:
            self.latencies.append(now - self.last_token_at)
        self.last_token_at = now
        return self.stops.push(self.detokenizer.push(token) if self.detokenizer else "")

    def flush_text(self) -> tuple[str, str | None]:
        """At the end: the text held back (half characters, a possible stop string's start), and a stop it makes."""
        tail, matched = self.stops.push(self.detokenizer.flush() if self.detokenizer else "")
        return (tail, matched) if matched is not None else (tail + self.stops.flush(), None)

    def final_output(self, reason: FinishReason, error: str | None = None, stop_reason: str | int | None = None,
                     token_ids: list[int] | None = None, text: str = "",
                     logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        seq = self.sequence
        timings = Timings(queued_s=(seq.first_scheduled_at or time.perf_counter()) - seq.submitted_at,
                          time_to_first_token_s=self.time_to_first_token, token_latencies_s=list(self.latencies))
        usage = Usage(len(seq.prompt_ids), len(seq.output_ids), seq.num_cached_tokens)
        return RequestOutput(seq.request_id, token_ids or [], text, logprobs, finished=True, finish_reason=reason,
                             stop_reason=stop_reason, error=error, usage=usage, timings=timings)


def sampling_rows(sequences: list[Sequence], eos_ids: tuple) -> list[SamplingRow]:
    """What the Sampler needs of each sequence; below its min_tokens, its stop tokens are banned from the draw
    (not a constrained request's: its grammar says when it may end)."""
    return [SamplingRow(s.params, s.seed, s.prompt_ids, s.output_ids,
                        tuple(sorted(s.params.stop_ids(eos_ids))) if s.params.grammar is None
                        and len(s.output_ids) < min(s.params.min_tokens, s.max_new_tokens) else ())
            for s in sequences]
