"""The PyTorch sampler (penalties, temperature, top-k/top-p/min-p, seeds, logprobs) and stop strings.

`Sampler.sample(logits, batch)` turns one step's logits [B, V] into one token per row. Randomness is
counter-based: row b's noise comes from a generator seeded by (request seed, output index), so a
request's tokens depend only on its own seed and logits, never on what else is in the batch, and a
preempted request that recomputes draws the same noise again. Order of operations (vLLM's):
penalties -> temperature -> logprobs -> top-k -> top-p -> min-p -> draw. Numbers stay numbers for every
validated parameter (issue 24): scaled logits are clamped to +-SCALED_LIMIT (a repetition penalty of
1e-300 divides by fp32 zero), so no softmax sees inf - inf and no logprob is NaN or infinite.
`sampling_fault` says whether one row's sampling can be built at all (the engine asks after a failed
step). This file knows nothing of pages or scheduling; `StopStringFilter` works on text only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from northcode.engine.request import SamplingParams, TokenLogprob

SCALED_LIMIT = 1e30  # |scaled logit| at most this: differences of two stay finite in fp32 (max 3.4e38)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one sequence of the batch."""

    params: SamplingParams
    seed: int  # the request's seed, drawn by the engine when the request gave none
    prompt_ids: list[int]
    output_ids: list[int]  # tokens sampled so far; len(output_ids) is this draw's counter


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


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


class Sampler:
    """Samples one token per row from fp32 logits on whatever device they live on."""

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """logits: [B, V], fp32, raw (after logit_scale). Rows may mix greedy and random requests."""
        assert logits.shape[0] == len(rows)
        scaled = self._scaled(logits, rows)
        tokens = scaled.argmax(dim=-1)
        random_rows = [b for b, r in enumerate(rows) if not r.params.is_greedy]
        if random_rows:
            tokens[random_rows] = self._draw(scaled[random_rows], [rows[b] for b in random_rows])
        token_ids = tokens.tolist()
        return SampleResult(token_ids, self._logprobs_of(scaled, rows, token_ids))

    def logprobs(self, logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]) -> list[TokenLogprob | None]:
        """The logprobs `sample` would report for tokens chosen elsewhere (a backend that samples on the device)."""
        return self._logprobs_of(self._scaled(logits, rows), rows, token_ids)

    @staticmethod
    def _scaled(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Penalties, then temperature (1 for greedy rows): [B, V] fp32."""
        logits = apply_penalties(logits.float().clone(), rows)
        temperature = torch.tensor([r.params.temperature if not r.params.is_greedy else 1.0 for r in rows],
                                   device=logits.device)
        return scale_logits(logits, temperature)

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

    @staticmethod
    def _draw(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential-race sampling (argmax p / E, E ~ Exp(1)), each row with its own counter-seeded noise:
        the same draw as the torch backend's device sampler (torch_backend.launch.draw_tokens)."""
        from northcode.torch_backend.launch import draw_tokens  # launch.py imports this module

        return draw_tokens(scaled, rows)


def sampling_fault(row: SamplingRow, vocab_size: int) -> str | None:
    """Why one row's sampling cannot be built, or None: the Sampler's path (penalties, logprobs) and the device
    sampler's (launch.sample_on_device) run for the row alone, on zero logits on the CPU."""
    from northcode.torch_backend.launch import sample_on_device  # launch.py imports this module

    logits = torch.zeros(1, vocab_size)
    try:
        Sampler().sample(logits, [row])
        sample_on_device(logits, [row])
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
