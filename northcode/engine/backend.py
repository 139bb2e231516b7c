"""The model backend interface: what the engine asks of the code that runs the model on the paged cache.

Two implementations, neither imported by the engine: `TorchBackend` (torch_backend/backend.py: prefill and
decode in PyTorch, CUDA graphs on a GPU) and `MegakernelBackend` (megakernel/backend.py: torch prefill plus
decode in one persistent kernel, over one set of pools and block tables). northcode/runtime.py chooses one
and hands the Engine a `BackendFactory`. A backend owns the device KV pools
(`k_pool, v_pool: [num_pages + 1, page_size, num_kv_heads, head_dim]`, the last page scratch for padded
rows, layout in kv_cache.py) and a device copy of the block tables (device.DeviceBlockTables); the engine owns
the host block tables (`int32 [num_layers, max_batch, max_pages_per_seq]`, -1 unmapped) and passes them with
a version number that changes whenever they do, so a backend uploads only when `tables_version` moved.

Protocol (the engine calls these from its step thread, never concurrently):
  0. `warm_up()`, once before the first request and after every rebuild (graph capture, kernel builds).
  1. `prefill(PrefillBatch)`: each chunk writes K/V of positions start..start+len-1 of its row into the
     pool (pages already mapped by the engine) and attends to the row's earlier pages; returns fp32 logits
     [num_chunks, V] of each chunk's last token (the engine samples only from chunks that end a prompt).
  2. `decode(DecodeBatch)`: row b feeds token_ids[b] at positions[b] (= tokens already cached), writes its
     K/V and returns a DecodeResult: with `batch.sample`, a token for every row drawn on the device from
     `batch.sampling` (sampling.sample_on_device's draw; the engine keeps the tokens of the rows that are
     `is_device_sampled`); with `batch.return_logits`, the logits [B, V] fp32 (after logit_scale, before any
     penalty), from which the engine's Sampler samples the other rows (penalties, logprobs). With
     `batch.token_masks` (constrained rows, engine/grammar.py) the backend calls `batch.masks()` once, after it
     has enqueued the model step and before it samples (the host computes the masks while the device runs
     the step; the megakernel enqueues its sampling too, which waits on the device for them), and applies
     them (sampling.apply_token_masks) to every row it samples and to the logits it returns. Only a row whose
     SamplingParams.grammar is set gets a mask (the megakernel points just those at a mask slot). A row whose
     grammar bans markers while dormant may need `batch.text_mask` (static, the tokenizer's text tokens): the
     engine hands it before the masks, so that a backend can put it on the device once, before its launches.
  3. `launch_decode(batch, carry) -> PendingDecode` (the pipelined step, pipeline.py): enqueue one decode
     step and return without waiting. carry[b] >= 0: row b feeds the token that row carry[b] of the previous
     launch sampled, read from device memory (batch.token_ids[b] is then -1); -1: batch.token_ids[b].
     batch.sample is true, return_logits false, every row device-sampled (`check_launch`). Masks as in 2;
     the engine's `token_masks` may wait for the previous launch's tokens (a constrained row's mask needs them).
     `PendingDecode.result()` waits (releasing the GIL) and returns the DecodeResult. Kernels of later calls
     must run after it (one stream): the engine frees pages at once.
Seeded sampling must be reproducible per request whatever the batch: draw number n of a request uses
noise derived from (seed, n) only (see sampling.noise_seed).
Construction: `BackendFactory(config, weights, settings, num_pages, max_pages_per_seq)`; the weights are the
canonical dict on the target device. After a step that hung or raised (unless one request's sampling was to
blame: recovery.py), the engine drops its backend and builds a new one the same way (the old one is
garbage-collected first: its pools may be most of the GPU), so a backend must not hold state that outlives it
(a process-wide CUDA graph pool, a global kernel handle that a second instance re-inits) nor be referenced
from anything global. Each call returns only when its results are on the host; the engine's watchdog
(watchdog.py) relies on those waits releasing the GIL (torch's synchronising copies and ctypes calls do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from northcode.config import ModelConfig
from northcode.engine.sampling import BatchSamplingArgs, TokenMasks
from northcode.engine.settings import EngineSettings

MIN_CONTEXT_PAGES = 4  # smallest context bucket of a decode step (pages of full layers)
BUCKET_STEPS_PER_OCTAVE = 8  # context buckets: 16, 18, 20, ..., 30, 32, 36, ... pages


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # "torch" or "megakernel"
    reason: str  # why, in words: shown by stats() and the server's start-up lines


@dataclass(slots=True)
class PrefillChunk:
    row: int  # block-table row of the sequence
    token_ids: list[int]  # the chunk's tokens
    start: int  # position of token_ids[0]; positions 0..start-1 are already in the cache


@dataclass(slots=True)
class PrefillBatch:
    chunks: list[PrefillChunk]
    block_tables: torch.Tensor  # host int32 [num_layers, max_batch, max_pages_per_seq]
    tables_version: int
    tables_columns: int | None = None  # columns ever mapped (the rest are all -1); None: all


@dataclass(slots=True)
class DecodeBatch:
    rows: list[int]  # [B] block-table rows
    token_ids: list[int]  # [B] the token each row feeds
    positions: list[int]  # [B] its position
    sampling: BatchSamplingArgs  # [B] how each row's next token is drawn (read when `sample`)
    sample: bool  # the backend must return token_ids
    return_logits: bool  # the backend must return logits
    block_tables: torch.Tensor  # host int32 [num_layers, max_batch, max_pages_per_seq]
    tables_version: int
    tables_columns: int | None = None  # columns ever mapped (the rest are all -1); None: all
    token_masks: Callable[[], TokenMasks | None] | None = None  # the constrained rows' masks (None: no row is)
    text_mask: torch.Tensor | None = None  # host int32 [ceil(V / 32)]: TokenMasks.text_bits, when a row may need it

    def masks(self) -> TokenMasks | None:
        """The constrained rows' token masks (computed now, on the host), or None."""
        return self.token_masks() if self.token_masks is not None else None


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int] | None  # [B], when batch.sample
    logits: torch.Tensor | None  # [B, V] fp32, when batch.return_logits


class PendingDecode(Protocol):
    def result(self) -> DecodeResult:
        """Wait for the step (releasing the GIL) and return its host token ids."""
        ...


class ModelBackend(Protocol):
    name: str
    k_pool: torch.Tensor
    v_pool: torch.Tensor

    def warm_up(self) -> None: ...

    def prefill(self, batch: PrefillBatch) -> torch.Tensor: ...

    def decode(self, batch: DecodeBatch) -> DecodeResult: ...

    def launch_decode(self, batch: DecodeBatch, carry: list[int]) -> PendingDecode: ...


BackendFactory = Callable[[ModelConfig, dict[str, torch.Tensor], EngineSettings, int, int], ModelBackend]
# (config, weights, settings, num_pages, max_pages_per_seq) -> a new backend: what the engine builds at start
# and again after a hung or failed step. A factory may say why it built what it built in a `reason`
# attribute, read after each build (runtime.py's says so when auto fell back from the megakernel to torch).


def check_launch(batch: DecodeBatch, carry: list[int], previous_rows: int | None) -> None:
    """ValueError, naming the field, for a batch launch_decode cannot run (host values only)."""
    if not batch.sample or batch.return_logits:
        raise ValueError("launch_decode: the batch must have sample=True and return_logits=False")
    if len(carry) != len(batch.rows):
        raise ValueError(f"launch_decode: carry has {len(carry)} entries for {len(batch.rows)} rows")
    for b, (c, token, params) in enumerate(zip(carry, batch.token_ids, batch.sampling.params)):
        if not params.is_device_sampled:
            raise ValueError(f"launch_decode: row {b} asks for penalties or logprobs (they need the host's "
                             "history; the engine decodes such requests with decode)")
        if c >= 0 and (previous_rows is None or c >= previous_rows):
            raise ValueError(f"launch_decode: carry[{b}] = {c}, but the previous launch had "
                             f"{previous_rows or 0} rows")
        if c < 0 and token < 0:
            raise ValueError(f"launch_decode: row {b} has neither a token id ({token}) nor a carried row")


# --- decode step shapes: a first run of one may capture a graph, compile or build task lists ---


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def context_bucket(num_pages: int, max_pages: int) -> int:
    """The pages a decode graph reads for a context of num_pages: rounded up to a step of 1/8 octave."""
    if num_pages <= 2 * BUCKET_STEPS_PER_OCTAVE:
        bucket = max(MIN_CONTEXT_PAGES, next_power_of_two(num_pages))
    else:
        step = next_power_of_two(num_pages + 1) // (2 * BUCKET_STEPS_PER_OCTAVE)
        bucket = -(-num_pages // step) * step
    return min(bucket, max_pages)
