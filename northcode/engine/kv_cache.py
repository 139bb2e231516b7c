"""The paged KV cache: page pool, per-layer block tables, sliding-window eviction, prefix cache.

Glossary (the same words in Python and CUDA):
  block / page  `page_size` tokens (settings.PAGE_SIZE by default) of one layer's K and V for one sequence;
  slot          one token position in the pool, `page * page_size + offset`;
  sequence      one request's tokens; it holds one *row* of the block tables while it runs;
  batch         the sequences in one step; task: one unit of megakernel work.
Layout (docs/architecture.md): `k_pool, v_pool: [num_pages + 1, page_size, num_kv_heads, head_dim]`
(the last page is scratch that padded batch rows write into, never mapped) and host block tables
`int32 [num_layers, max_batch, max_pages_per_seq]`, -1 where nothing is mapped.
Invariant: a page is written only while exactly one sequence holds it and its block is not full;
full blocks are immutable, which is what lets the prefix cache share them by reference count.
This file does bookkeeping on the host only; it never runs the model. At start-up `kv_page_budget` sizes
the pool (settings, free memory, the backend's limit) and `context_limit` the longest sequence it can hold.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from northcode.config import ModelConfig
from northcode.engine.settings import EngineSettings

log = logging.getLogger(__name__)
HASH_SEED = b"northcode-prefix-v1"
# Sliding layers keep one page more than the window needs, so that a prefix which ends on the last
# block boundary before the sequence's end (what the next agent turn attaches) still has its window.
SLIDING_SLACK_PAGES = 1

BlockKey = tuple[bytes, int]  # (chained hash of the block, layer index)


def chain_block_hashes(token_ids: list[int], page_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (hashes of the first len(known) full blocks) to every full block of token_ids.

    Hash j = sha256(hash j-1 || the block's page_size token ids as int64 little-endian), so it names the whole prefix.
    """
    hashes = list(known)
    parent = hashes[-1] if hashes else HASH_SEED
    for j in range(len(hashes), len(token_ids) // page_size):
        block = array("q", token_ids[j * page_size:(j + 1) * page_size]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return hashes


class PagePool:
    """Reference-counted pages; unreferenced pages that hold a published block stay findable (LRU)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self.key_of_page: list[BlockKey | None] = [None] * num_pages
        self.page_of_key: dict[BlockKey, int] = {}
        self.free_plain = list(range(num_pages - 1, -1, -1))  # stack: pop() gives page 0 first
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # oldest first: evicted first

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def allocate(self) -> int:
        """A page with refcount 1: a plain free page, else the least recently used cached one."""
        if self.free_plain:
            page = self.free_plain.pop()
        else:
            assert self.free_cached, "page pool exhausted (the scheduler must check num_free first)"
            page, _ = self.free_cached.popitem(last=False)
            del self.page_of_key[self.key_of_page[page]]
            self.key_of_page[page] = None
        self.refcount[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self.refcount[page] == 0:
            del self.free_cached[page]  # a cached page coming back into use
        self.refcount[page] += 1

    def decref(self, page: int) -> None:
        assert self.refcount[page] > 0, f"page {page} freed twice"
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.key_of_page[page] is None:
                self.free_plain.append(page)
            else:
                self.free_cached[page] = None  # most recently used end

    def lookup(self, key: BlockKey) -> int | None:
        return self.page_of_key.get(key)

    def publish(self, page: int, key: BlockKey) -> None:
        """Tag a full, written page with its block key; a block already cached elsewhere is left alone."""
        if self.key_of_page[page] is not None or key in self.page_of_key:
            return
        self.key_of_page[page] = key
        self.page_of_key[key] = page

    def clear_cache(self) -> None:
        """Forget every published block (e.g. after the weights change)."""
        for page in list(self.free_cached):
            self.free_plain.append(page)
        self.free_cached.clear()
        self.page_of_key.clear()
        self.key_of_page = [None] * self.num_pages


@dataclass(slots=True)
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up at admission
    hit_tokens: int = 0  # of those, tokens whose KV came from the cache


class KVCacheManager:
    """Block tables for `max_batch` rows over one PagePool, following the layer kinds of a model."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, max_batch: int,
                 max_pages_per_seq: int, enable_prefix_cache: bool = True) -> None:
        self.num_layers = config.num_hidden_layers
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.window = config.sliding_window
        self.full_layers = [i for i in range(self.num_layers) if config.window(i) is None]
        self.sliding_layers = [i for i in range(self.num_layers) if config.window(i) is not None]
        self.pool = PagePool(num_pages)
        self.enable_prefix_cache = enable_prefix_cache
        self.block_tables = torch.full((self.num_layers, max_batch, max_pages_per_seq), -1, dtype=torch.int32)
        self.tables = [[[-1] * max_pages_per_seq for _ in range(max_batch)] for _ in range(self.num_layers)]
        self.num_mapped = [0] * max_batch  # logical pages allocated so far in every layer, per row
        self.evicted_below = [0] * max_batch  # sliding layers hold no page below this index
        self.published_below = [0] * max_batch  # blocks below this index are published
        self.version = 0  # bumped on every table change; the backend re-uploads when it moves
        self.high_water = 0  # columns of block_tables ever mapped: uploads need only these
        self.stats = PrefixStats()

    # --- sizes ---

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def sliding_pages_kept(self, extra_tokens: int = 0) -> int:
        """Pages a sliding layer holds at most: the window, a partial page, the slack, extra tokens."""
        assert self.window is not None
        return self.pages_for_tokens(self.window + extra_tokens) + 1 + SLIDING_SLACK_PAGES

    def peak_pages(self, num_tokens: int, chunk_size: int) -> int:
        """Pages one sequence of num_tokens holds at its peak (prefilled in chunks of chunk_size)."""
        full = self.pages_for_tokens(num_tokens)
        sliding = min(full, self.sliding_pages_kept(chunk_size)) if self.window else full
        return full * len(self.full_layers) + sliding * len(self.sliding_layers)

    def pages_needed(self, row: int, end: int) -> int:
        """Free pages needed to map positions up to `end` (exclusive) in every layer of a row."""
        return max(0, self.pages_for_tokens(end) - self.num_mapped[row]) * self.num_layers

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_used_pages(self) -> int:
        return self.pool.num_pages - self.pool.num_free

    # --- growth and eviction ---

    def _sync_columns(self, row: int, first: int, last: int) -> None:
        """Copy the Python tables of a row's pages first..last-1 into the block_tables tensor."""
        self.high_water = max(self.high_water, last)
        if last > first:
            columns = [self.tables[layer][row][first:last] for layer in range(self.num_layers)]
            self.block_tables[:, row, first:last] = torch.tensor(columns, dtype=torch.int32)
        self.version += 1

    def allocate(self, row: int, end: int) -> None:
        """Map fresh pages for positions num_mapped*page_size .. end-1 in every layer."""
        first, last = self.num_mapped[row], self.pages_for_tokens(end)
        assert last <= self.max_pages_per_seq, f"row {row}: {end} tokens exceed max_pages_per_seq"
        assert self.pool.num_free >= (last - first) * self.num_layers, "allocate without enough free pages"
        for j in range(first, last):
            for layer in range(self.num_layers):
                self.tables[layer][row][j] = self.pool.allocate()
        self.num_mapped[row] = max(first, last)
        self._sync_columns(row, first, last)

    def evict_behind_window(self, row: int, next_pos: int) -> None:
        """Free sliding-layer pages wholly behind the window of the query at `next_pos` (plus slack)."""
        if self.window is None:
            return
        keep_from = max(0, (next_pos - self.window + 1) // self.page_size - SLIDING_SLACK_PAGES)
        if keep_from <= self.evicted_below[row]:
            return
        for j in range(self.evicted_below[row], keep_from):
            for layer in self.sliding_layers:
                page = self.tables[layer][row][j]
                if page >= 0:
                    self.pool.decref(page)
                    self.tables[layer][row][j] = -1
        first, self.evicted_below[row] = self.evicted_below[row], keep_from
        self._sync_columns(row, first, keep_from)

    def free_row(self, row: int) -> None:
        """Drop every page of a row; later blocks are released first so earlier ones stay cached longer."""
        for j in range(self.num_mapped[row] - 1, -1, -1):
            for layer in range(self.num_layers):
                page = self.tables[layer][row][j]
                if page >= 0:
                    self.pool.decref(page)
                    self.tables[layer][row][j] = -1
        self._sync_columns(row, 0, self.num_mapped[row])
        self.num_mapped[row] = self.evicted_below[row] = self.published_below[row] = 0

    # --- prefix cache ---

    def publish(self, row: int, block_hashes: list[bytes], num_tokens_with_kv: int) -> None:
        """Tag the row's full, written blocks with their chained hashes so later requests find them."""
        if not self.enable_prefix_cache:
            return
        num_blocks = min(num_tokens_with_kv // self.page_size, len(block_hashes), self.num_mapped[row])
        for j in range(self.published_below[row], num_blocks):
            for layer in range(self.num_layers):
                page = self.tables[layer][row][j]
                if page >= 0:
                    self.pool.publish(page, (block_hashes[j], layer))
        self.published_below[row] = max(self.published_below[row], num_blocks)

    def _sliding_from(self, num_blocks: int) -> int:
        """First block a sliding layer needs for a prefix of num_blocks blocks (the window ending there)."""
        if self.window is None:
            return num_blocks
        return max(0, (num_blocks * self.page_size - self.window + 1) // self.page_size)

    def longest_attachable(self, block_hashes: list[bytes], max_blocks: int) -> int:
        """Blocks of the longest cached prefix: every full layer has all its blocks, every sliding layer
        the blocks of the window ending at the prefix's end. Not monotonic in the length (a longer prefix
        may pass where a shorter fails, its window lying elsewhere), so candidates are scanned downwards."""
        lookup = self.pool.lookup
        n_full = 0
        while n_full < max_blocks and all(lookup((block_hashes[n_full], l)) is not None for l in self.full_layers):
            n_full += 1
        if not self.sliding_layers:
            return n_full
        last_missing = -1
        missing_before: list[int] = []  # [j]: the last block index <= j that some sliding layer lacks
        for j in range(n_full):
            if any(lookup((block_hashes[j], l)) is None for l in self.sliding_layers):
                last_missing = j
            missing_before.append(last_missing)
        for n in range(n_full, 0, -1):
            if missing_before[n - 1] < self._sliding_from(n):
                return n
        return 0

    def attach_prefix(self, row: int, block_hashes: list[bytes], num_prompt_tokens: int) -> int:
        """Map the longest cached prefix into an empty row; returns its length in tokens. The last
        prompt token is never attached: it must run through the model to give the next token's logits."""
        assert self.num_mapped[row] == 0, f"row {row} is not empty"
        self.stats.queried_tokens += num_prompt_tokens
        if not self.enable_prefix_cache:
            return 0
        max_blocks = min((num_prompt_tokens - 1) // self.page_size, len(block_hashes))
        num_blocks = self.longest_attachable(block_hashes, max_blocks)
        sliding_from = self._sliding_from(num_blocks)
        sliding = set(self.sliding_layers)
        for j in range(num_blocks):
            for layer in range(self.num_layers):
                if layer in sliding and j < sliding_from:
                    continue
                page = self.pool.lookup((block_hashes[j], layer))
                assert page is not None
                self.pool.incref(page)
                self.tables[layer][row][j] = page
        self.num_mapped[row] = self.published_below[row] = num_blocks
        self.evicted_below[row] = sliding_from if self.sliding_layers else 0
        self.stats.hit_tokens += num_blocks * self.page_size
        self._sync_columns(row, 0, num_blocks)
        return num_blocks * self.page_size

    def clear_prefix_cache(self) -> None:
        self.pool.clear_cache()


# --- device pools ---


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page of K plus one page of V."""
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * page_size * config.num_key_value_heads * config.head_dim * element_bytes


def allocate_kv_pools(config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """k_pool, v_pool: [num_pages + 1, page_size, num_kv_heads, head_dim]; the last page is scratch."""
    shape = (num_pages + 1, page_size, config.num_key_value_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


# --- how large the pool is ---

GPU_WORKSPACE_BYTES = 3 << 30  # kept out of the pool: prefill activations and attention scores, graphs


def kv_page_budget(config: ModelConfig, settings: EngineSettings, dtype: torch.dtype, device: torch.device,
                   max_pages: int | None = None) -> int:
    """Pages of the pool: fixed, or (free GPU memory - workspace) x gpu_memory_fraction, or the CPU byte
    budget, at most `max_pages` (the backend's limit). The workspace also covers the torch backend's fused
    QKV copy of the attention weights."""
    if settings.num_pages is not None:
        return settings.num_pages
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        element_bytes = torch.empty((), dtype=dtype).element_size()
        qkv_bytes = config.num_hidden_layers * (config.q_size + 2 * config.kv_size) * config.hidden_size * element_bytes
        budget = int(max(0, free_bytes - GPU_WORKSPACE_BYTES - qkv_bytes) * settings.gpu_memory_fraction)
    else:
        budget = settings.cpu_kv_bytes
    pages = max(1, budget // page_bytes(config, settings.page_size, dtype))
    if max_pages is not None and pages > max_pages:
        log.info("KV pool: %d pages of the %d that fit: the backend's limit", max_pages, pages)
        return max_pages
    return pages


def context_limit(config: ModelConfig, settings: EngineSettings, kv: KVCacheManager) -> int:
    """The longest sequence one request may reach: the model's and the user's limits, and the pool."""
    limit = min(config.max_position_embeddings, settings.max_model_len or config.max_position_embeddings)
    low, high = 1, limit  # the largest length whose peak pages fit the whole pool
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if kv.peak_pages(middle, settings.chunk_size) <= kv.pool.num_pages else (low, middle - 1)
    return low
