"""The samplers: the device draw both backends run, and the PyTorch Sampler (penalties, logprobs) the engine runs.

`BatchSamplingArgs.prepare` builds one step's sampling arguments once; every path reads them. The device draw
(`sample_on_device`: temperature, then top-k/top-p/min-p, a counter-seeded draw) runs wherever the logits
are, with no host read; the backends sample every row with it, and the megakernel the same rule in CUDA.
`Sampler.sample(logits, rows)` is the full sampler for rows that are not `SamplingParams.is_device_sampled`
(penalties, logprobs); on a row without them it draws the device draw's token bit for bit. A constrained row
(engine/grammar.py) comes with a token mask (`TokenMasks`); `apply_token_masks` puts the tokens it does not
allow at -inf before any of this, on whichever path samples the row. Randomness is
counter-based: a row's noise comes from a generator seeded by (request seed, draw number), so a request's
tokens depend only on its own seed and logits, never on what else is in the batch, and a preempted request
that recomputes draws the same noise again. Order of operations (vLLM's): penalties -> temperature ->
logprobs -> top-k -> top-p -> min-p -> draw. Numbers stay numbers for every validated parameter (issue 24):
scaled logits are clamped to +-SCALED_LIMIT (a repetition penalty of 1e-300 divides by fp32 zero), so no
softmax sees inf - inf and no logprob is NaN or infinite. `sampling_fault` says whether one row's sampling
can be built at all (the engine asks after a failed step). This file knows nothing of pages or scheduling;
`StopStringFilter` works on text only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from northcode.engine.device import to_device
from northcode.engine.request import SamplingParams, TokenLogprob

SCALED_LIMIT = 1e30  # |scaled logit| at most this: differences of two stay finite in fp32 (max 3.4e38)


ALWAYS = -1  # TokenMasks.triggers: the row's mask applies whatever token it feeds
NEVER = -2  # TokenMasks.triggers: the row's mask never applies (a dormant grammar: only its dormant rule may)
NO_DORMANT_RULE = -1  # TokenMasks.dormant: where the row's mask does not apply, the row is unconstrained


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """The constrained rows of a step and what each may sample next (engine/grammar.py computes them). Where a
    row's mask does not apply (its trigger is not the token it fed, or NEVER), its dormant rule does: a grammar
    that bans markers while dormant lets the row sample a text token (text_bits) or its trigger, nothing else."""

    rows: tuple[int, ...]  # the batch rows constrained, ascending
    bits: torch.Tensor  # host int32 [len(rows), ceil(V / 32)]: bit t % 32 of word t // 32 set = token t allowed
    triggers: tuple[int, ...]  # per row: ALWAYS, NEVER, or a token id: the mask applies only if the row feeds it
    dormant: tuple[int, ...] = ()  # per row: NO_DORMANT_RULE, or the trigger a dormant row may sample besides text
    text_bits: torch.Tensor | None = None  # host int32 [ceil(V / 32)]: the text tokens (every row's dormant rule)


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mask words int32 [N, W] -> bool [N, vocab_size] (on the words' device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


def token_words(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> mask words int32 [N, ceil(V / 32)] (allowed_tokens' inverse; bit 31 is the sign)."""
    num_words = -(-allowed.shape[1] // 32)
    padded = torch.zeros(allowed.shape[0], num_words * 32, dtype=torch.int64)
    padded[:, :allowed.shape[1]] = allowed
    words = (padded.view(-1, num_words, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_token_masks(logits: torch.Tensor, masks: TokenMasks | None, fed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp32 with the tokens each constrained row may not sample at -inf: a new tensor when any row is
    constrained (the masks go up without a sync), `logits` itself when none is. fed: device long [B], the tokens
    the rows fed this step (a mask with a trigger applies only where the row fed it; needed only then)."""
    if masks is None:
        return logits
    device = logits.device
    index = to_device(torch.tensor(masks.rows, dtype=torch.long), device)
    banned = ~allowed_tokens(to_device(masks.bits, device), logits.shape[1])  # [N, V]
    if any(t != ALWAYS for t in masks.triggers):
        triggers = to_device(torch.tensor(masks.triggers, dtype=torch.long), device)
        applies = triggers == ALWAYS
        if any(t >= 0 for t in masks.triggers):
            applies |= fed.index_select(0, index) == triggers
        banned = torch.where(applies[:, None], banned, _dormant_banned(masks, logits.shape[1], device))
    return logits.index_copy(0, index, logits.index_select(0, index).masked_fill(banned, -torch.inf))


def _dormant_banned(masks: TokenMasks, vocab_size: int, device: torch.device) -> torch.Tensor:
    """bool [N, V]: what each row's dormant rule bans (nothing for a row without one)."""
    if all(d == NO_DORMANT_RULE for d in masks.dormant):
        return torch.zeros(len(masks.rows), vocab_size, dtype=torch.bool, device=device)
    assert masks.text_bits is not None and len(masks.dormant) == len(masks.rows), "a dormant rule without text_bits"
    dormant = to_device(torch.tensor(masks.dormant, dtype=torch.long), device)  # [N]
    text = allowed_tokens(to_device(masks.text_bits[None], device), vocab_size)  # [1, V]
    trigger = torch.arange(vocab_size, device=device)[None, :] == dormant[:, None]  # [N, V]
    return ~(text | trigger) & (dormant != NO_DORMANT_RULE)[:, None]


@dataclass(slots=True)
class SamplingRow:
    """One sequence of the batch as the Sampler sees it: its sampling arguments and its token history."""

    params: SamplingParams
    seed: int  # the request's seed, drawn by the engine when the request gave none
    prompt_ids: list[int]
    output_ids: list[int]  # tokens sampled so far (penalties read them); len(output_ids) is this draw's number
    banned: tuple[int, ...] = ()  # ids this draw may not pick: a request's stop tokens below its min_tokens


@dataclass(frozen=True, slots=True)
class BatchSamplingArgs:
    """The sampling arguments of one step's rows, built once (`prepare`), read by every sampling path: the
    backends' device draw, the megakernel's row states, the Sampler. Host values; no token history."""

    params: tuple[SamplingParams, ...]  # [B] as the engine samples them (SamplingParams.clamped_to)
    seeds: tuple[int, ...]  # [B] the requests' seeds
    draws: tuple[int, ...]  # [B] draw number of each row's token: tokens sampled before it, one in flight included
    temperatures: tuple[float, ...]  # [B] what each row's logits are divided by: 1 for greedy rows
    random_rows: tuple[int, ...]  # the rows that draw (not greedy), ascending

    @classmethod
    def prepare(cls, params: Iterable[SamplingParams], seeds: Iterable[int], draws: Iterable[int]) -> BatchSamplingArgs:
        params = tuple(params)
        temperatures = tuple(1.0 if p.is_greedy else p.temperature for p in params)
        return cls(params, tuple(seeds), tuple(draws), temperatures,
                   tuple(b for b, p in enumerate(params) if not p.is_greedy))

    @classmethod
    def of_rows(cls, rows: list[SamplingRow]) -> BatchSamplingArgs:
        return cls.prepare([r.params for r in rows], [r.seed for r in rows], [len(r.output_ids) for r in rows])

    def select(self, index: Iterable[int]) -> BatchSamplingArgs:
        """The arguments of rows `index`, in that order."""
        index = tuple(index)
        return BatchSamplingArgs.prepare([self.params[b] for b in index], [self.seeds[b] for b in index],
                                         [self.draws[b] for b in index])

    def __len__(self) -> int:
        return len(self.params)


def noise_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for draw number `output_index` of a request (stateless, reproducible)."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [B, V] fp32. Repetition (prompt + output, HF/vLLM rule: divide positive logits, multiply
    negative ones), then frequency and presence (output only, OpenAI rule: minus f*count + p*[count>0])."""
    batch, vocab = logits.shape
    device = logits.device
    for b, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=device)
            if seen.numel():
                picked = logits[b, seen]
                logits[b, seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                              picked * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=device).index_add_(
                0, ids, torch.ones(len(row.output_ids), dtype=logits.dtype, device=device))
            logits[b] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [B, V] fp32 / temperature [B] (1 for greedy rows), clamped to +-SCALED_LIMIT (inf included)."""
    return (logits / temperature[:, None]).clamp_(-SCALED_LIMIT, SCALED_LIMIT)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """probs: [B, V]; top_k [B] (0: off), top_p [B], min_p [B]. Zeroes what each rule removes,
    renormalises, and always keeps the most likely token."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    sorted_probs = sorted_probs.masked_fill(ranks >= k, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # probability of the tokens ranked above
    sorted_probs = sorted_probs.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), 0.0)
    sorted_probs = sorted_probs.masked_fill(sorted_probs < min_p[:, None] * sorted_probs[:, :1], 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(-1, keepdim=True)


def _float32(x: float) -> float:
    """x rounded to fp32, as the filter's parameter tensors hold it (the test is made on the host)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def draw_tokens(scaled: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """scaled [B, V] fp32 -> tokens [B]: exponential race, argmax p / E, E ~ Exp(1) seeded by (seed, draw).
    Which filters apply is decided on the host from the parameters, so nothing waits for the device."""
    device = scaled.device
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_k > 0 or _float32(p.top_p) < 1 or _float32(p.min_p) > 0 for p in args.params):
        vocab = scaled.shape[-1]  # a top_k above it keeps every token (and would overflow int64 past 2^63)
        top_k = to_device(torch.tensor([min(p.top_k, vocab) for p in args.params]), device)
        top_p = to_device(torch.tensor([p.top_p for p in args.params], dtype=scaled.dtype), device)
        min_p = to_device(torch.tensor([p.min_p for p in args.params], dtype=scaled.dtype), device)
        probs = filter_probs(probs, top_k, top_p, min_p)
    noise = torch.empty_like(probs)
    for b, (seed, draw) in enumerate(zip(args.seeds, args.draws)):
        generator = torch.Generator(device=device).manual_seed(noise_seed(seed, draw))
        noise[b].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample_on_device(logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
    """Every row's token as a device long [B], with no host read: the Sampler's token for rows without
    penalties. logits [B, V] fp32 (after logit_scale)."""
    device = logits.device
    scaled = scale_logits(logits.float(), to_device(torch.tensor(args.temperatures), device))  # [B, V]
    tokens = scaled.argmax(dim=-1)
    if args.random_rows:
        index = to_device(torch.tensor(args.random_rows, dtype=torch.long), device)
        tokens.index_copy_(0, index, draw_tokens(scaled.index_select(0, index), args.select(args.random_rows)))
    return tokens


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


class Sampler:
    """Samples one token per row from fp32 logits on whatever device they live on, penalties and logprobs included."""

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """logits: [B, V], fp32, raw (after logit_scale). Rows may mix greedy and random requests."""
        assert logits.shape[0] == len(rows)
        args = BatchSamplingArgs.of_rows(rows)
        scaled = self._scaled(logits, rows, args)
        tokens = scaled.argmax(dim=-1)
        if args.random_rows:
            random_rows = list(args.random_rows)
            tokens[random_rows] = draw_tokens(scaled[random_rows], args.select(random_rows))
        token_ids = tokens.tolist()
        return SampleResult(token_ids, self._logprobs_of(scaled, rows, token_ids))

    @staticmethod
    def _scaled(logits: torch.Tensor, rows: list[SamplingRow], args: BatchSamplingArgs) -> torch.Tensor:
        """Penalties and banned tokens, then temperature (1 for greedy rows): [B, V] fp32. A logit at -inf (a token
        a constrained row's mask forbids) stays there: a repetition penalty of fp32 zero would make it NaN."""
        forbidden = logits == -torch.inf
        logits = apply_penalties(logits.float().clone(), rows).masked_fill_(forbidden, -torch.inf)
        for b, row in enumerate(rows):
            if row.banned:
                logits[b, list(row.banned)] = -torch.inf  # scale_logits keeps it finite: -SCALED_LIMIT
        return scale_logits(logits, torch.tensor(args.temperatures, device=logits.device))

    def _logprobs_of(self, scaled: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]) -> list[TokenLogprob | None]:
        logprobs = self._logprobs(scaled, rows)
        if logprobs is None:
            return [None] * len(rows)
        return [self._token_logprob(logprobs[b], token_ids[b], r.params.logprobs) if r.params.logprobs is not None
                else None for b, r in enumerate(rows)]

    @staticmethod
    def _logprobs(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
        if all(r.params.logprobs is None for r in rows):
            return None
        return torch.log_softmax(scaled, dim=-1)

    @staticmethod
    def _token_logprob(row_logprobs: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
        top: list[tuple[int, float]] = []
        if num_top:
            values, ids = row_logprobs.topk(min(num_top, row_logprobs.shape[-1]))
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprob(token_id, float(row_logprobs[token_id]), top)


def sampling_fault(row: SamplingRow, vocab_size: int) -> str | None:
    """Why one row's sampling cannot be built, or None: the Sampler's path (penalties, logprobs) and the device
    draw run for the row alone, on zero logits on the CPU."""
    logits = torch.zeros(1, vocab_size)
    try:
        Sampler().sample(logits, [row])
        sample_on_device(logits, BatchSamplingArgs.of_rows([row]))
    except Exception as err:  # whatever building its tensors raised: that is the answer
        return f"{type(err).__name__}: {err}"
    return None


class StopStringFilter:
    """Finds stop strings in streamed text, across token boundaries, and holds back any tail that
    could still begin one (so that text is never shown and then taken back)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string that matched or None). After a match, stop."""
        buffer = self.held + text
        if not self.stops:
            return buffer, None
        matches = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if matches:
            index, stop = min(matches)
            self.held = ""
            return buffer[:index], stop
        hold = 0
        for k in range(min(len(buffer), max(len(s) for s in self.stops) - 1), 0, -1):
            if any(s.startswith(buffer[-k:]) for s in self.stops):
                hold = k
                break
        self.held = buffer[len(buffer) - hold:]
        return buffer[:len(buffer) - hold], None

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason."""
        held, self.held = self.held, ""
        return held
