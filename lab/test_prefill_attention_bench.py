"""The prefill attention bench's ways on the CPU: where a way runs here, it computes the reference's attention
(causal from the bottom right, the window), so that its GPU timings compare like with like; and the paged way
(lab/paged_prefill_flex.py) against fp32 attention for every kind of chunk, its page table scrambled."""

from __future__ import annotations

import shutil

import pytest
import torch

from paged_prefill_flex import dense_visible, paged_prefill_attention
from prefill_attention_bench import format_rows, measure, visible

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager: the reference


def test_the_mask_is_causal_from_the_bottom_right_and_inside_the_window():
    mask = visible(3, 6, None, "cpu")  # queries at positions 3, 4, 5
    assert mask.tolist()[0] == [True, True, True, True, False, False]
    assert mask[-1].all()
    windowed = visible(3, 6, 2, "cpu")
    assert windowed.tolist()[2] == [False, False, False, False, True, True]


def test_the_ways_that_run_on_the_cpu_agree_with_the_reference():
    shapes = ((8, 64, None), (8, 64, 32), (3, 70, None))
    rows = measure(shapes, ["flash-causal", "flex", "efficient-mask"], "cpu", torch.float32, repeats=1)
    ran = [r for r in rows if r["ms"] is not None]
    assert {r["way"] for r in ran} == {"flash-causal", "flex"}  # efficient: CUDA only
    assert all(r["max_diff"] < 1e-4 and r["first_ms"] is not None for r in ran), rows
    assert [r["note"] for r in rows if r["way"] == "flash-causal" and r["window"]] == ["full layers only"]
    assert {r["note"] for r in rows if r["way"] == "efficient-mask"} == {"no such kernel here"}
    table = format_rows(rows)
    assert table.splitlines()[0].split()[:4] == ["T", "S", "window", "way"] and len(table.splitlines()) == 10


# --- the paged way (lab/paged_prefill_flex.py): K/V read in place from a scrambled pool ---

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="inductor's CPU code needs a C++ compiler")
PAGE, KV_HEADS_TINY, HEADS_TINY, DIM = 16, 4, 32, 16  # North Mini Code's heads (group 8), small pages and head dim
WINDOW, NUM_KEYS = 48, 300  # a window of 3 pages; the row holds 300 keys (19 pages, the last partly filled)
# (start, T): chunk sizes 1, odd, page-crossing (mid-page to mid-page), window-crossing (several query blocks whose
# windows start on different pages), a chunk that ends before the row's last key (later slots hold stale keys),
# the whole prompt, and a prompt of less than a page
CHUNKS = ((299, 1), (262, 37), (87, 20), (100, 200), (130, 140), (0, 300), (0, 5))


def _scrambled_row(num_keys=NUM_KEYS, seed=0, evict_before=None, page=PAGE, dim=DIM, pool_pages=48, device="cpu",
                   dtype=torch.float32):
    """A pool of pool_pages pages (+ scratch) holding one row's K/V at random distinct pages: (pool, table int32
    [P + 2], keys, values [1, Hkv, S, D]). The table's last two entries are unmapped; with evict_before, the pages
    wholly before that position are unmapped too (a sliding layer's freed pages). Slots not written hold garbage."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-num_keys // page)
    pool = torch.randn(2, pool_pages + 1, page, KV_HEADS_TINY, dim, generator=gen) * 100
    table = torch.randperm(pool_pages, generator=gen)[:num_pages + 2].to(torch.int32)
    table[num_pages:] = -1
    keys, values = (torch.randn(1, KV_HEADS_TINY, num_keys, dim, generator=gen).to(dtype).float() for _ in range(2))
    slots = table[torch.arange(num_keys) // page].long() * page + torch.arange(num_keys) % page
    for half, kv in enumerate((keys, values)):
        pool[half].view(-1, KV_HEADS_TINY, dim)[slots] = kv[0].transpose(0, 1)
    if evict_before is not None:
        table[:evict_before // page] = -1
    return pool.to(device, dtype), table.to(device), keys.to(device), values.to(device)


def _reference(q, keys, values, start, window):
    """fp32 attention of q [1, Hq, T, D] at positions start.. over keys 0 .. start + T - 1 (model.attention_mask)."""
    end = start + q.shape[2]
    mask = visible(q.shape[2], end, window, q.device)
    rep = lambda t: t[:, :, :end].repeat_interleave(HEADS_TINY // KV_HEADS_TINY, dim=1)  # noqa: E731
    return torch.nn.functional.scaled_dot_product_attention(q, rep(keys), rep(values), attn_mask=mask)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("start, num_queries", CHUNKS)
def test_the_page_lists_are_the_reference_mask(start, num_queries, window):
    """What the GPU kernel reads (full pages whole, partial pages through mask_mod, nothing else) is the mask."""
    _, table, _, _ = _scrambled_row()
    seen = dense_visible(table, start, num_queries, window, PAGE)  # [T, (P + 2) * ps] logical key positions
    end = start + num_queries
    assert torch.equal(seen[:, :end], visible(num_queries, end, window, "cpu"))
    assert not seen[:, end:].any()


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("start, num_queries", CHUNKS)
def test_the_paged_way_equals_fp32_attention(start, num_queries, window):
    pool, table, keys, values = _scrambled_row(evict_before=None if window is None else max(0, start - WINDOW))
    q = torch.randn(1, HEADS_TINY, num_queries, DIM, generator=torch.Generator().manual_seed(1))
    got = paged_prefill_attention(q, pool, table, start, window)
    torch.testing.assert_close(got, _reference(q, keys, values, start, window), atol=1e-5, rtol=1e-5)


@needs_cxx
def test_compiled_on_the_cpu_it_reads_only_the_listed_pages_and_compiles_once_per_kind_of_chunk():
    """Inductor's CPU template reads the page lists as the GPU's does (a page left out of them changes the result),
    and new chunk lengths and contexts reuse the graphs: one for chunks that may take flex's decoding kernel
    (T <= 16), one for the other chunks of one query block, one for longer ones."""
    from torch._dynamo.utils import counters

    import paged_prefill_flex

    torch._dynamo.reset()
    counters.clear()
    pool, table, keys, values = _scrambled_row()
    gen = torch.Generator().manual_seed(2)
    for start, num_queries in ((100, 200), (130, 140), (0, 300), (262, 37), (87, 20), (0, 5)):
        for window in (None, WINDOW):
            q = torch.randn(1, HEADS_TINY, num_queries, DIM, generator=gen)
            got = paged_prefill_attention(q, pool, table, start, window, compile=True)
            torch.testing.assert_close(got, _reference(q, keys, values, start, window), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    q = torch.randn(1, HEADS_TINY, 200, DIM, generator=gen)
    logical_of = paged_prefill_flex.logical_pages(table, pool.shape[1])
    mask = paged_prefill_flex.paged_block_mask(table, logical_of, 100, 200, None, PAGE, pool.shape[1] * PAGE,
                                               pad_indices=True)
    keys_view, values_view = paged_prefill_flex.pool_keys_values(pool)
    with paged_prefill_flex.fx_config.patch(use_duck_shape=False):
        whole = paged_prefill_flex.compiled_flex()(q, keys_view, values_view, block_mask=mask, enable_gqa=True)
        mask.full_kv_num_blocks.zero_()  # the full pages left out: the kernel must not find them by itself
        without = paged_prefill_flex.compiled_flex()(q, keys_view, values_view, block_mask=mask, enable_gqa=True)
    assert (whole - without).abs().max() > 0.1


@needs_cxx
def test_one_map_and_one_set_of_lists_serve_every_layer_of_a_kind():
    """The prefill's sharing: two layers' K/V at disjoint pages of one pool, one physical->logical map for both and
    the chunk's logical lists built once; each layer attends to its own keys. Compiled: the eager math path scores
    every slot, so a map shared across layers is only for the kernels, which read the listed pages alone."""
    from paged_prefill_flex import chunk_block_lists, logical_pages

    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(2, 49, PAGE, KV_HEADS_TINY, DIM, generator=gen) * 100
    tables = torch.randperm(48, generator=gen)[:2 * 19].view(2, 19).to(torch.int32)  # layer 0, layer 1
    kv = torch.randn(2, 2, 1, KV_HEADS_TINY, NUM_KEYS, DIM, generator=gen)  # [layer, K/V, 1, Hkv, S, D]
    slots = torch.arange(NUM_KEYS)
    for layer in range(2):
        where = tables[layer][slots // PAGE].long() * PAGE + slots % PAGE
        for half in range(2):
            pool[half].view(-1, KV_HEADS_TINY, DIM)[where] = kv[layer, half, 0].transpose(0, 1)
    logical_of = torch.maximum(logical_pages(tables[0], 49), logical_pages(tables[1], 49))  # disjoint pages
    for window in (None, WINDOW):
        lists = chunk_block_lists(100, 200, window, PAGE, "cpu")
        q = torch.randn(1, HEADS_TINY, 200, DIM, generator=gen)
        for layer in range(2):
            got = paged_prefill_attention(q, pool, tables[layer], 100, window, logical_of=logical_of, lists=lists,
                                          compile=True)
            want = _reference(q, kv[layer, 0], kv[layer, 1], 100, window)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_bench_runs_the_paged_ways_on_the_cpu():
    rows = measure(((8, 64, None), (8, 64, 32), (3, 70, None)), ["flex-paged", "flex-paged-big"], "cpu",
                   torch.float32, repeats=1)
    assert all(r["max_diff"] < 1e-4 and r["first_ms"] is not None for r in rows), rows
    assert all(r["note"].startswith("mask: lists ") and "per layer" in r["note"] for r in rows), rows


def test_the_triton_way_is_for_short_chunks():
    rows = measure(((8, 64, None), (200, 300, None)), ["flex-paged-triton"], "cpu", torch.float32, repeats=1)
    assert rows[0]["max_diff"] < 1e-4 and rows[1]["note"] == "short chunks only", rows


def test_flex_may_take_its_decoding_kernel_only_where_a_kv_heads_queries_fit_one_query_block():
    from paged_prefill_flex import decoding_backend

    assert [decoding_backend(t, 8) for t in (1, 16, 17, 40, 2048)] == ["AUTO", "AUTO", "TRITON", "TRITON", "TRITON"]


GPU_PAGE, GPU_DIM, GPU_WINDOW, GPU_KEYS = 64, 128, 256, 1000  # the product's page and head dim; a window of 4 pages
# 2 before 8 and 16, as the engine's warm-up runs them: the decoding kernel's graph is compiled at T = 2 (its query
# tile sized from that hint), then serves 8 and 16 with several tiles
GPU_CHUNKS = ((999, 1), (998, 2), (992, 8), (500, 16), (900, 37), (100, 200), (300, 700), (600, 130), (0, 1000),
              (200, 40))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", [None, "TRITON"])
def test_on_the_gpu_the_compiled_paged_way_equals_fp32_attention(backend):
    """bf16 through the compiled Triton kernels (their page lists; the decoding kernel where decoding_backend lets flex
    take it, T <= 16, and the main kernel forced everywhere) against fp32
    attention on the same bf16 inputs, North Mini Code's heads, a scrambled pool of 64-token pages."""
    gen = torch.Generator().manual_seed(3)
    for window in (None, GPU_WINDOW):
        for start, num_queries in GPU_CHUNKS:
            evict = None if window is None else max(0, start - window)
            pool, table, keys, values = _scrambled_row(GPU_KEYS, evict_before=evict, page=GPU_PAGE, dim=GPU_DIM,
                                                       pool_pages=64, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(1, HEADS_TINY, num_queries, GPU_DIM, generator=gen).to("cuda", torch.bfloat16)
            got = paged_prefill_attention(q, pool, table, start, window, backend=backend).float()
            want = _reference(q.float(), keys, values, start, window)
            assert (got - want).abs().max().item() < 2e-2, (start, num_queries, window)
