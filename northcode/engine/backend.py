"""The model backend interface: what the engine asks of the code that runs the model on the paged cache.

Two implementations: `TorchBackend` (torch_backend/backend.py: prefill and decode in PyTorch, CUDA graphs
on a GPU) and `MegakernelBackend` (megakernel/backend.py: decode in one persistent kernel, megakernel/kernel.py;
prefill in a TorchBackend sharing its pools). A backend owns the device KV pools
(`k_pool, v_pool: [num_pages + 1, page_size, num_kv_heads, head_dim]`, the last page scratch for padded
rows, layout in kv_cache.py) and a device copy of the block tables; the engine owns the host block tables
(`int32 [num_layers, max_batch, max_pages_per_seq]`, -1 unmapped) and passes them with a version number
that changes whenever they do, so a backend uploads only when `tables_version` moved.

Protocol of one step (the engine calls these from its step thread, never concurrently):
  1. `prefill(PrefillBatch)`: each chunk writes K/V of positions start..start+len-1 of its row into the
     pool (pages already mapped by the engine) and attends to the row's earlier pages; returns fp32 logits
     [num_chunks, V] of each chunk's last token (the engine samples only from chunks that end a prompt).
  2. `decode(DecodeBatch)`: row b feeds token_ids[b] at positions[b] (= tokens already cached), writes its
     K/V and returns a DecodeResult. When `batch.sample` is true the backend samples on the device and
     returns token_ids for every row (asked when `can_sample` said yes for at least one row; the engine
     keeps the tokens of those rows); when `batch.return_logits` is true it also returns the logits [B, V]
     fp32 (after logit_scale, before any penalty), which the engine uses for logprobs and to sample in
     PyTorch (sampling.Sampler) the rows `can_sample` refused.
Seeded sampling must be reproducible per request whatever the batch: draw number n of a request uses
noise derived from (seed, n) only (see sampling.noise_seed).
Optional: `warm_up()`, called once before the first request (graph capture, kernel builds).
Construction (backend_choice.build_backend, which also decides auto): `Backend(config, weights, num_pages,
page_size, max_batch, max_pages_per_seq, cuda_graphs=...)`; the weights are the canonical dict on the
target device. After a step that hung or raised (unless one request's sampling was to blame: recovery.py),
the engine drops its backend and builds a new one the same way (the old one is garbage-collected first: its
pools may be most of the GPU), so a backend must not hold state that outlives it (a process-wide CUDA graph
pool, a global kernel handle that a second instance re-inits) nor be referenced from anything global.
Each call returns only when its results are on the host; the engine's watchdog (watchdog.py) relies on
those waits releasing the GIL (torch's synchronising copies and ctypes calls do).
Optional, for the pipelined step (pipeline.py): `launch_decode(batch, carry) -> PendingDecode` enqueues one
decode step and returns without waiting. carry[b] >= 0: row b feeds the token that row carry[b] of the
previous launch sampled, read from device memory (batch.token_ids[b] is then -1); -1: batch.token_ids[b].
batch.sample is true and return_logits false; `len(sampling[b].output_ids)` is the draw number (it counts
the token in flight, whose id is -1). `PendingDecode.result()` waits (releasing the GIL) and returns the
DecodeResult. Kernels of later calls must run after it (one stream): the engine frees pages at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from northcode.engine.request import SamplingParams
from northcode.engine.sampling import SamplingRow


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
    sampling: list[SamplingRow]  # [B] parameters, seed and history of each row
    sample: bool  # the backend must return token_ids
    return_logits: bool  # the backend must return logits
    block_tables: torch.Tensor  # host int32 [num_layers, max_batch, max_pages_per_seq]
    tables_version: int
    tables_columns: int | None = None  # columns ever mapped (the rest are all -1); None: all


@dataclass(slots=True)
class DecodeResult:
    token_ids: list[int] | None  # [B], when batch.sample
    logits: torch.Tensor | None  # [B, V] fp32, when batch.return_logits


class ModelBackend(Protocol):
    name: str
    k_pool: torch.Tensor
    v_pool: torch.Tensor

    def can_sample(self, params: SamplingParams) -> bool:
        """True when the backend can sample this request on the device (decode.sample)."""
        ...

    def prefill(self, batch: PrefillBatch) -> torch.Tensor: ...

    def decode(self, batch: DecodeBatch) -> DecodeResult: ...
