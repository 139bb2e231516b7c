"""What crosses the engine's boundary: sampling parameters in, request outputs out.

The server and the benchmarks build `SamplingParams` and read `RequestOutput`s; the engine
(engine.py) owns everything in between. `SamplingParams.validate` raises ValueError naming the
parameter, so the server can turn it into a 400. Nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: no logprobs; N >= 0: the sampled token's plus N alternatives
    stop: list[str] = field(default_factory=list)  # stop strings, matched on detokenised text
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS
    ignore_eos: bool = False  # for benchmarks: run to max_tokens
    skip_special_tokens: bool = True  # text_delta omits special tokens (their ids are still reported)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 turns it off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r}: {why}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, of the distribution after penalties and temperature
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass(slots=True)
class Timings:
    queued_s: float = 0.0  # submit -> first scheduled
    time_to_first_token_s: float | None = None  # submit -> first token
    token_latencies_s: list[float] = field(default_factory=list)  # gaps between later tokens


@dataclass(slots=True)
class RequestOutput:
    """One increment of a request's output. The last one has `finished` set, with usage and timings."""

    request_id: str
    token_ids: list[int]  # new tokens since the previous output (all of them, specials included)
    text_delta: str  # new text safe to show (no half UTF-8 characters, no text that may begin a stop string)
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the request
    error: str | None = None  # set with finish_reason "error"
    usage: Usage = field(default_factory=Usage)
    timings: Timings | None = None
