"""What crosses the engine's boundary: sampling parameters in, request outputs out.

The server and the benchmarks build `SamplingParams` and read `RequestOutput`s; the engine
(engine.py) owns everything in between. `SamplingParams.validate` raises ValueError naming the
parameter, so the server can turn it into a 400; whatever it accepts, the engine and both backends
can sample (issue 24): the engine then samples `clamped_to(vocab_size)` (vLLM's rules: top_k above the
vocabulary is the vocabulary, a temperature below SAMPLING_EPS is greedy). A `GrammarSpec` constrains what a
request may write (engine/grammar.py compiles it). Nothing here touches tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's): 1/T of a smaller one overflows fp32 (1e-39)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # a signed or unsigned 64-bit seed; the kernel takes it modulo 2^64
MAX_TOP_LOGPROBS = 20


def is_greedy_temperature(temperature: float) -> bool:
    """The greedy rule's temperature half: below SAMPLING_EPS the logits are not divided, the argmax is taken."""
    return temperature < SAMPLING_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id_or_none(value: object) -> bool:
    return value is None or (_is_int(value) and value >= 0)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """Constrained decoding: the output must match `grammar` (llguidance's: its Lark dialect, with special tokens
    by name and `%json {schema}` inline, or what llguidance.LLMatcher.grammar_from_* returns). With trigger_id
    the output is free until that token is sampled, and the token is the grammar's first (a thinking block,
    then the answer the grammar holds); with ban_while_dormant, free means text: until its trigger the request
    may sample no special token but the trigger (a forced answer's thinking cannot end the turn or open a block
    of its own). A grammar that is complete ends the request ("stop")."""

    grammar: str
    trigger_id: int | None = None  # None: the grammar holds from the first token
    ban_while_dormant: bool = False  # before the trigger: text tokens and the trigger only (needs a trigger_id)


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # below SAMPLING_EPS (0): greedy
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
    min_tokens: int = 0  # the model's EOS and stop_token_ids cannot be sampled before this many tokens (vLLM's rule)
    skip_special_tokens: bool = True  # text_delta omits special tokens (their ids are still reported)
    grammar: GrammarSpec | None = None  # None: unconstrained

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. NaN and infinities fail every range."""
        checks = [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", _is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
             "must be a number in [0, 100]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "must be an integer >= 0 (0 turns it off)"),
            ("top_p", _is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "must be a number in (0, 1]"),
            ("min_p", _is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "must be a number in [0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
             "must be a 64-bit integer, signed or unsigned"),
            ("presence_penalty", _is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
             "must be a number in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
             "must be a number in [-2, 2]"),
            ("repetition_penalty", _is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
             "must be a number in (0, 10]"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
             f"must be an integer in [0, {MAX_TOP_LOGPROBS}]"),
            ("stop", isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop),
             "must be a list of strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, (list, tuple))
             and all(_is_int(t) for t in self.stop_token_ids), "must be a list of integers"),
            ("min_tokens", _is_int(self.min_tokens) and self.min_tokens >= 0, "must be an integer >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be a boolean"),
            ("grammar", self.grammar is None or (isinstance(self.grammar, GrammarSpec)
                                                 and isinstance(self.grammar.grammar, str)
                                                 and _is_token_id_or_none(self.grammar.trigger_id)
                                                 and isinstance(self.grammar.ban_while_dormant, bool)
                                                 and not (self.grammar.ban_while_dormant
                                                          and self.grammar.trigger_id is None)),
             "must be None or a GrammarSpec (grammar text, trigger token id or None, ban_while_dormant only "
             "with a trigger)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} = {getattr(self, name)!r}: {why}")

    def clamped_to(self, vocab_size: int) -> SamplingParams:
        """These (validated) parameters as the engine samples them: top_k at or above the vocabulary off (0),
        a temperature below SAMPLING_EPS greedy (0), at most vocab_size alternatives' logprobs."""
        return dataclasses.replace(
            self, top_k=self.top_k if self.top_k < vocab_size else 0,
            temperature=0.0 if is_greedy_temperature(self.temperature) else self.temperature,
            logprobs=None if self.logprobs is None else min(self.logprobs, vocab_size))

    @property
    def is_greedy(self) -> bool:
        """The argmax, no draw: the only place this rule is written (every sampler asks here)."""
        return is_greedy_temperature(self.temperature) or self.top_k == 1

    @property
    def is_device_sampled(self) -> bool:
        """No penalties, no logprobs and no min_tokens: the next token needs only the logits, the seed and the draw
        number, so a backend samples it on the device (and the engine may pipeline it); otherwise the engine's
        Sampler does (it masks the stop tokens of a request below its min_tokens)."""
        return (self.logprobs is None and self.presence_penalty == 0 and self.frequency_penalty == 0
                and self.repetition_penalty == 1 and self.min_tokens == 0)

    def stop_ids(self, eos_ids: Iterable[int]) -> set[int]:
        """The token ids that end this request: its stop_token_ids, and the model's EOS unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))


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
