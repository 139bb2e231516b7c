"""Page pool, block tables, sliding-window eviction and the prefix cache (pure bookkeeping, no model)."""

from __future__ import annotations

import pytest

from northcode.config import ModelConfig
from northcode.engine.kv_cache import KVCacheManager, PagePool, chain_block_hashes

PAGE = 4  # small pages keep the numbers readable


def hybrid_config(window: int | None = 8) -> ModelConfig:
    """4 layers: 0 and 2 full, 1 and 3 sliding (window tokens)."""
    kinds = ("full_attention", "sliding_attention") if window else ("full_attention",) * 2
    return ModelConfig(vocab_size=64, hidden_size=8, num_hidden_layers=4, num_attention_heads=1, head_dim=4,
                       layer_types=kinds * 2, sliding_window=window,
                       max_position_embeddings=1024)


def manager(num_pages: int = 64, window: int | None = 8, rows: int = 2) -> KVCacheManager:
    return KVCacheManager(hybrid_config(window), num_pages, PAGE, rows, 32)


def mapped(kv: KVCacheManager, layer: int, row: int) -> list[int]:
    """Logical page indices mapped in one layer of one row (from the tensor the backend reads)."""
    return [j for j, page in enumerate(kv.block_tables[layer, row].tolist()) if page >= 0]


def test_chained_hashes_name_the_whole_prefix():
    a = chain_block_hashes(list(range(10)), PAGE, [])
    assert len(a) == 2  # only full blocks
    b = chain_block_hashes([99] + list(range(1, 10)), PAGE, [])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix: different key
    assert chain_block_hashes(list(range(12)), PAGE, a) == chain_block_hashes(list(range(12)), PAGE, [])


def test_pool_refcounts_and_lru_eviction_of_unreferenced_blocks_only():
    pool = PagePool(3)
    pages = [pool.allocate() for _ in range(3)]
    assert pool.num_free == 0
    for i, page in enumerate(pages):
        pool.publish(page, (bytes([i]), 0))
    pool.incref(pages[0])  # shared by two sequences
    pool.decref(pages[0])
    assert pool.num_free == 0 and pool.lookup((b"\x00", 0)) == pages[0]
    pool.decref(pages[1])
    pool.decref(pages[0])
    assert pool.num_free == 2  # cached and unreferenced pages count as free
    again = pool.allocate()  # evicts the least recently freed cached block: pages[1]
    assert again == pages[1] and pool.lookup((b"\x01", 0)) is None
    assert pool.lookup((b"\x00", 0)) == pages[0] and pool.lookup((b"\x02", 0)) == pages[2]
    with pytest.raises(AssertionError):
        PagePool(1).decref(0)


def test_sliding_layers_free_pages_behind_the_window_and_full_layers_keep_all():
    kv = manager()
    for pos in range(40):  # decode one token at a time, as the scheduler does
        kv.evict_behind_window(0, pos)
        kv.allocate(0, pos + 1)
    assert mapped(kv, 0, 0) == list(range(10)) == mapped(kv, 2, 0)
    # next query at 40 sees 33..40: pages 8, 9, 10; one page of slack is kept before them
    kv.evict_behind_window(0, 40)
    assert mapped(kv, 1, 0) == [7, 8, 9] == mapped(kv, 3, 0)
    assert kv.num_used_pages == 2 * 10 + 2 * 3
    kv.free_row(0)
    assert kv.num_free_pages == 64 and kv.block_tables.eq(-1).all()


def test_attach_follows_the_hybrid_rule():
    kv = manager()
    tokens = list(range(40))
    hashes = chain_block_hashes(tokens, PAGE, [])
    kv.allocate(0, 40)
    kv.publish(0, hashes, 40)
    kv.free_row(0)
    assert kv.num_free_pages == 64
    cached = kv.attach_prefix(1, hashes, 41)
    assert cached == 40  # all ten blocks
    assert mapped(kv, 0, 1) == list(range(10))
    assert mapped(kv, 1, 1) == [8, 9]  # window ending at 40: positions 33..39 live in pages 8, 9
    assert kv.stats.hit_tokens == 40 and kv.stats.queried_tokens == 41
    # the last prompt token is never attached: a 40-token prompt reuses 36 tokens at most
    kv.free_row(1)
    assert kv.attach_prefix(1, hashes, 40) == 36


def test_attach_needs_sliding_pages_of_the_window_and_is_not_monotonic():
    kv = manager()
    tokens = list(range(48))
    hashes = chain_block_hashes(tokens, PAGE, [])
    for pos in range(48):  # a long sequence: its sliding layers freed their early pages
        kv.evict_behind_window(0, pos)
        kv.allocate(0, pos + 1)
    kv.publish(0, hashes, 48)
    kv.free_row(0)
    # sliding layers hold blocks 9..11 (published before being freed), full layers all 12
    assert kv.longest_attachable(hashes, 12) == 12
    assert kv.longest_attachable(hashes, 11) == 11  # window ending at 44 needs blocks 9, 10
    # a prefix of 10 blocks needs sliding blocks 8, 9: block 8 is gone, and so are all shorter ones
    assert kv.longest_attachable(hashes, 10) == 0


def test_two_sequences_share_cached_blocks_by_reference():
    kv = manager()
    hashes = chain_block_hashes(list(range(20)), PAGE, [])
    kv.allocate(0, 20)
    kv.publish(0, hashes, 20)
    used = kv.num_used_pages
    assert kv.attach_prefix(1, hashes, 21) == 20  # while row 0 still runs
    assert kv.num_used_pages == used  # shared, not copied
    assert kv.block_tables[0, 1, :5].tolist() == kv.block_tables[0, 0, :5].tolist()
    kv.free_row(0)
    kv.free_row(1)
    assert kv.num_free_pages == 64


def test_prefix_cache_can_be_turned_off():
    kv = KVCacheManager(hybrid_config(), 64, PAGE, 2, 32, enable_prefix_cache=False)
    hashes = chain_block_hashes(list(range(20)), PAGE, [])
    kv.allocate(0, 20)
    kv.publish(0, hashes, 20)
    kv.free_row(0)
    assert kv.attach_prefix(1, hashes, 21) == 0


def test_peak_pages_counts_windows_and_chunks():
    kv = manager(window=8)
    # 100 tokens: full layers 25 pages each; sliding at most window(2)+partial(1)+slack(1)+chunk(4/4=1)
    assert kv.peak_pages(100, 4) == 2 * 25 + 2 * 5
    assert manager(window=None).peak_pages(100, 4) == 4 * 25
