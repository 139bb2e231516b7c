"""Synthetic decode set-ups shared by `northcode bench decode` and the megakernel GPU tests.

A paged KV cache (layout of docs/architecture.md) filled with random K/V for rows of given lengths,
block tables that leave the pages behind each sliding window unmapped (-1), room for `extra_steps`
decode steps, and, on request, the same K/V in model.py's contiguous caches so that NorthModel
decodes from exactly the state the kernel sees. Random KV, not a prefill: decode semantics do not
depend on where the cache came from, and a 128K-token prefill would not fit a benchmark run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from northcode.config import ModelConfig
from northcode.engine.settings import PAGE_SIZE


@dataclass
class PagedCache:
    k_pool: torch.Tensor  # [num_pages, 64, KVH, D] bf16
    v_pool: torch.Tensor
    block_tables: torch.Tensor  # int32 [L, B, max_pages] on the device, -1 unmapped
    lengths: list[int]  # tokens already cached per row


def first_needed_page(config: ModelConfig, layer: int, length: int) -> int:
    """The first page a decode step at position `length` can read in this layer."""
    window = config.window(layer)
    return max(0, length - window + 1) // PAGE_SIZE if window else 0


def paged_cache(config: ModelConfig, lengths: list[int], extra_steps: int, device: torch.device | str,
                seed: int = 0, kv_std: float = 1.0) -> PagedCache:
    """Pages for every row and layer from the first page its window needs to position length+extra-1,
    every pool entry random N(0, kv_std) in bf16 (pages are handed out in a shuffled order)."""
    layers, batch = config.num_hidden_layers, len(lengths)
    max_pages = math.ceil((max(lengths) + extra_steps) / PAGE_SIZE)
    tables = torch.full((layers, batch, max_pages), -1, dtype=torch.int32)
    count = 0
    for layer in range(layers):
        for row, length in enumerate(lengths):
            last = math.ceil((length + extra_steps) / PAGE_SIZE)
            first = first_needed_page(config, layer, length)
            tables[layer, row, first:last] = torch.arange(count, count + last - first, dtype=torch.int32)
            count += last - first
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shuffle = torch.randperm(count, generator=generator).to(torch.int32)
    mapped = tables >= 0
    tables[mapped] = shuffle[tables[mapped].long()]
    shape = (count, PAGE_SIZE, config.num_key_value_heads, config.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    # drawn in place in bf16: an fp32 temporary would double the pools (128K x 8 rows: 2 x 15 GB more)
    k_pool = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, kv_std, generator=gen)
    v_pool = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, kv_std, generator=gen)
    return PagedCache(k_pool, v_pool, tables.to(device), list(lengths))


def row_history(config: ModelConfig, cache: PagedCache, row: int, extra_steps: int) -> tuple[list, list]:
    """One row's K and V per layer, contiguous: [length + extra_steps, KVH, D] bf16 each, positions behind a
    window (never read) zero, positions >= length zero until a test writes them."""
    length = cache.lengths[row]
    needed = math.ceil(length / PAGE_SIZE)
    keys, values = [], []
    for layer in range(config.num_hidden_layers):
        page_ids = cache.block_tables[layer, row, :needed].long()
        mapped = (page_ids >= 0)[:, None, None, None]
        for pool, out in ((cache.k_pool, keys), (cache.v_pool, values)):
            full = torch.zeros((length + extra_steps, config.num_key_value_heads, config.head_dim),
                               dtype=pool.dtype, device=pool.device)
            gathered = torch.where(mapped, pool[page_ids.clamp(min=0)], 0)  # [needed, 64, KVH, D]
            full[:length] = gathered.flatten(0, 1)[:length]
            out.append(full)
    return keys, values


def write_kv(cache: PagedCache, row: int, position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Overwrite the row's K/V at `position` in every layer's page: keys, values [L, KVH, D]."""
    for layer in range(keys.shape[0]):
        page = int(cache.block_tables[layer, row, position // PAGE_SIZE])
        cache.k_pool[page, position % PAGE_SIZE] = keys[layer].to(cache.k_pool.dtype)
        cache.v_pool[page, position % PAGE_SIZE] = values[layer].to(cache.v_pool.dtype)


def contiguous_caches(model, cache: PagedCache, extra_steps: int) -> list:
    """One model.KVCache per row holding the paged K/V (positions behind a window, never read, are
    zero), with room for extra_steps appends so that decoding never reallocates."""
    config = model.config
    caches = []
    for row, length in enumerate(cache.lengths):
        kv = model.new_cache(1)
        for layer in range(config.num_hidden_layers):
            pages = cache.block_tables[layer, row]
            needed = math.ceil(length / PAGE_SIZE)
            keys = torch.zeros((1, length + extra_steps, config.num_key_value_heads, config.head_dim),
                               dtype=cache.k_pool.dtype, device=cache.k_pool.device)
            values = torch.zeros_like(keys)
            page_ids = pages[:needed].long()
            mapped = (page_ids >= 0)[:, None, None, None]
            for pool, out in ((cache.k_pool, keys), (cache.v_pool, values)):
                gathered = torch.where(mapped, pool[page_ids.clamp(min=0)], 0)  # [needed, 64, KVH, D]
                out[0, :length] = gathered.flatten(0, 1)[:length]
            kv.keys[layer], kv.values[layer] = keys, values
        kv.seq_len = length
        caches.append(kv)
    return caches
