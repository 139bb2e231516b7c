"""The torch backend's pipelined decode (engine/backend.py's launch_decode): enqueue a step now, read its tokens later.

One launch, with no read of the device from the host anywhere before `result()`:
  host inputs go up through pinned memory (non-blocking); rows carried from the previous launch take the
  tokens it sampled (device long [B_prev]) with one gather on the device; the graphed step runs; the rows
  are sampled on the device (`sample_on_device`, tokens stay a device tensor); the tokens start a
  non-blocking copy into pinned host memory and a CUDA event marks its end. `LaunchedDecode.result()` waits
  on that event (releasing the GIL), so the GPU runs step n+1 while the host reads step n.
On the CPU the same code runs at once (no pinning, no event). The tokens equal sampling.Sampler's on the
same logits bit for bit: the same operations in the same order, for rows without penalties or logprobs.
"""

from __future__ import annotations

import struct

import torch

from northcode.engine.backend import DecodeBatch, DecodeResult
from northcode.engine.sampling import SamplingRow, filter_probs, noise_seed, scale_logits


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> None:
    """dst <- host without waiting for the device's queue: on a GPU through a pinned copy of host (the
    caching host allocator keeps that block until the copy has run), so host may change right after."""
    if dst.device.type != "cuda":
        dst.copy_(host)
        return
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)
    dst.copy_(pinned, non_blocking=True)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, enqueued without a sync (the CPU: host itself)."""
    if device.type != "cuda":
        return host.to(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    copy_from_host(out, host)
    return out


def check_launchable(batch: DecodeBatch, carry: list[int], previous_rows: int | None) -> None:
    """ValueError, naming the field, for a batch launch_decode cannot run (host values only)."""
    if not batch.sample or batch.return_logits:
        raise ValueError("launch_decode: the batch must have sample=True and return_logits=False")
    if len(carry) != len(batch.rows):
        raise ValueError(f"launch_decode: carry has {len(carry)} entries for {len(batch.rows)} rows")
    for b, (c, token, row) in enumerate(zip(carry, batch.token_ids, batch.sampling)):
        p = row.params
        if p.logprobs is not None or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1:
            raise ValueError(f"launch_decode: row {b} asks for penalties or logprobs (they need the host's "
                             "history; the engine decodes such requests with decode)")
        if c >= 0 and (previous_rows is None or c >= previous_rows):
            raise ValueError(f"launch_decode: carry[{b}] = {c}, but the previous launch had "
                             f"{previous_rows or 0} rows")
        if c < 0 and token < 0:
            raise ValueError(f"launch_decode: row {b} has neither a token id ({token}) nor a carried row")


def carried_tokens(token_ids: list[int], carry: list[int], previous: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor:
    """long [B] on the device: row b feeds previous[carry[b]] (a gather on the device) when carry[b] >= 0,
    else token_ids[b]. previous: the tokens the last launch sampled, device long [B_prev]."""
    tokens = to_device(torch.tensor(token_ids, dtype=torch.long), device)
    if all(c < 0 for c in carry):
        return tokens
    index = to_device(torch.tensor(carry, dtype=torch.long), device)
    return torch.where(index >= 0, previous[index.clamp(min=0)], tokens)


def _float32(x: float) -> float:
    """x rounded to fp32, as the sampler's parameter tensors hold it (the filter test is done on the host)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Sampler.sample's tokens as a device long [B], with no host read. logits [B, V] fp32 (after
    logit_scale); rows without penalties (temperature, then top-k/top-p/min-p, counter-seeded draws)."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature if not r.params.is_greedy else 1.0 for r in rows])
    scaled = scale_logits(logits.float(), to_device(temperature, device))  # [B, V]
    tokens = scaled.argmax(dim=-1)
    random_rows = [b for b, r in enumerate(rows) if not r.params.is_greedy]
    if random_rows:
        index = to_device(torch.tensor(random_rows, dtype=torch.long), device)
        tokens.index_copy_(0, index, draw_tokens(scaled.index_select(0, index), [rows[b] for b in random_rows]))
    return tokens


def draw_tokens(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """scaled [B, V] fp32 -> tokens [B]: exponential race, argmax p / E, E ~ Exp(1) seeded by (seed, draw).
    Which filters apply is decided on the host from the parameters, so nothing waits for the device."""
    device = scaled.device
    params = [r.params for r in rows]
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_k > 0 or _float32(p.top_p) < 1 or _float32(p.min_p) > 0 for p in params):
        vocab = scaled.shape[-1]  # a top_k above it keeps every token (and would overflow int64 past 2^63)
        top_k = to_device(torch.tensor([min(p.top_k, vocab) for p in params]), device)
        top_p = to_device(torch.tensor([p.top_p for p in params], dtype=scaled.dtype), device)
        min_p = to_device(torch.tensor([p.min_p for p in params], dtype=scaled.dtype), device)
        probs = filter_probs(probs, top_k, top_p, min_p)
    noise = torch.empty_like(probs)
    for b, row in enumerate(rows):
        generator = torch.Generator(device=device).manual_seed(noise_seed(row.seed, len(row.output_ids)))
        noise[b].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class LaunchedDecode:
    """engine/backend.py's PendingDecode for a TorchBackend launch: the tokens' copy to the host, under way."""

    def __init__(self, tokens: torch.Tensor) -> None:
        """tokens: device long [B], the step's sampled tokens (their kernels enqueued, maybe not run)."""
        self._done = None
        self._host = tokens
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()  # on the current stream, after the step and the copy

    def host_values(self) -> list[int]:
        """Wait for the copy (cudaEventSynchronize releases the GIL); the copied values."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()

    def result(self) -> DecodeResult:
        """The host token ids, once copied."""
        return DecodeResult(self.host_values(), None)
