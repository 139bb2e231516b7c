"""Prefill attention read from the paged KV pool in place: flex_attention with a block mask built from the page table.

A chunk of T queries at positions start .. start + T - 1 attends to its row's keys where they lie in the pool
(`kv_pool [2, num_pages + 1, page_size, Hkv, D]`, the layout of northcode/torch_backend/backend.py): no gather,
no K/V repeated to the query heads (flex's enable_gqa: query head h reads KV head h // group, the prefill's
order). One sparse block is one page (KV) by Q_BLOCK queries. Per query block the mask lists the pages it
sees: *full* pages (every key visible to every query of the block: no mask evaluated) and *partial* ones (the
diagonal, and on sliding layers the window's first pages), where `mask_mod` decides per key from the key's
logical position. Pages outside the window or after the chunk are not listed: never read. The lists are built
in logical pages once per chunk and layer kind (chunk_block_lists) and mapped per layer (to_physical: a gather).
The kernel sees physical slots, so mask_mod maps a slot's page back to its logical page through `logical_of`
(physical page -> logical page of this row; every physical page holds one (layer, logical block), shared
prefixes at the same logical index, so one map serves every layer and row of a chunk).
On a GPU flex_attention is compiled once with dynamic shapes (a new chunk length or context is not a new
kernel; graphs per kind of chunk: T = 1, T <= 16 (decoding_backend), T <= Q_BLOCK, longer). On the CPU it runs
eagerly by default, the math path, which evaluates mask_mod over every slot and ignores the page lists; the
tests check the lists through `dense_visible` (what the GPU kernel computes from them) and through inductor's
CPU template (compile=True), which reads them as the GPU's does.
This is the lab's form; northcode/torch_backend/paged_prefill.py does not use it yet (lab/README.md's plan).
"""

from __future__ import annotations

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128  # queries per sparse block: the H100/H200 default tile (BLOCK_M 128, BLOCK_N 64 for bf16, D 128)

RECOMPILE_LIMIT = 32  # graphs of the compiled flex_attention per process (chunk kinds x backends x pools x tests)
_COMPILED = {}  # "flex" -> flex_attention compiled with dynamic shapes, once per process


def compiled_flex():
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["flex"]


def logical_pages(page_table: torch.Tensor, num_pool_pages: int) -> torch.Tensor:
    """page_table int [P] (physical page of logical page p, -1 unmapped) -> int32 [num_pool_pages]: the logical
    page of each physical page of this row, -1 for the pool's other pages. No host sync: unmapped entries are
    scattered into one extra element, dropped."""
    logical_of = torch.full((num_pool_pages + 1,), -1, dtype=torch.int32, device=page_table.device)
    targets = torch.where(page_table >= 0, page_table.long(), num_pool_pages)
    logical_of[targets] = torch.arange(page_table.shape[0], dtype=torch.int32, device=page_table.device)
    return logical_of[:num_pool_pages]


def chunk_block_lists(start: int, num_queries: int, window: int | None, page_size: int, device,
                      q_block: int = Q_BLOCK) -> tuple[torch.Tensor, ...]:
    """The block mask's lists for a chunk in *logical* pages: (kv_num_blocks int32 [Qb], kv_indices int32 [Qb, W],
    full_kv_num_blocks, full_kv_indices), Qb = ceil(T / q_block), W >= 2. They depend on the positions and the
    layer kind only, so the prefill builds them once per chunk and kind; to_physical maps them per layer. Built on
    the device with no host sync (W comes from the ints start, T, window)."""
    ps, end = page_size, start + num_queries
    block_idx = torch.arange(-(-num_queries // q_block), device=device)
    q_lo = start + block_idx * q_block  # [Qb] each block's first and last query position
    q_hi = (q_lo + q_block).clamp(max=end) - 1
    hi_page, full_hi = q_hi // ps, (q_lo + 1) // ps - 1  # full pages end where a key passes the block's first query
    end_page = -(-end // ps)
    if window is None:
        lo_page = full_lo = torch.zeros_like(q_lo)
        span = end_page
    else:  # keys of query q: q - window + 1 .. q
        lo_page = (q_lo - window + 1).clamp(min=0) // ps
        full_lo = -(-(q_hi - window + 1).clamp(min=0) // ps)  # full pages start where every key is in every window
        span = min(end_page, (q_block + window - 2) // ps + 2)  # pages a block can see at most
    span = max(span, 2)  # a width of 1 (a prompt of one page) would be specialised by dynamo: a compile of its own
    candidate = lo_page[:, None] + torch.arange(span, device=device)  # [Qb, span] logical pages
    seen = candidate <= hi_page[:, None]
    full = seen & (candidate >= full_lo[:, None]) & (candidate <= full_hi[:, None])
    return (*_compacted(candidate, seen & ~full), *_compacted(candidate, full))


def _compacted(pages: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count int32 [Qb], the chosen pages first in each row int32 [Qb, W], 0 after them)."""
    order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
    pages = torch.where(chosen.gather(1, order), pages.gather(1, order), 0)
    return chosen.sum(1, dtype=torch.int32), pages.to(torch.int32)


def to_physical(lists: tuple[torch.Tensor, ...], page_table: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """chunk_block_lists' logical lists -> the same with this layer's physical pages (two gathers). Every page a
    list names must be mapped in page_table: kv_cache keeps a sliding layer's pages from its window's first
    (evict_behind_window, with slack) and maps every page before a chunk's end on full layers; an unmapped one
    would read page 0 (counts bound what the kernel reads, so the padding after them is never read)."""
    num_blocks, indices, full_num_blocks, full_indices = lists
    table = page_table.clamp(min=0).to(torch.int32)
    return num_blocks, table[indices.long()], full_num_blocks, table[full_indices.long()]


def chunk_page_lists(page_table: torch.Tensor, start: int, num_queries: int, window: int | None,
                     page_size: int) -> tuple[torch.Tensor, ...]:
    """chunk_block_lists then to_physical: the lists of one layer with physical pages."""
    return to_physical(chunk_block_lists(start, num_queries, window, page_size, page_table.device), page_table)


def paged_block_mask(page_table: torch.Tensor, logical_of: torch.Tensor, start: int, num_queries: int,
                     window: int | None, page_size: int, num_slots: int, pad_indices: bool = False,
                     lists: tuple[torch.Tensor, ...] | None = None) -> BlockMask:
    """The BlockMask of a chunk over the pool's slots (module docstring); lists: chunk_block_lists', when the
    caller shares them across the layers of a kind. start and window are passed to mask_mod as tensors: a captured
    int would be a constant of the compiled kernel, a compile per chunk. pad_indices: the index lists padded to the
    pool's pages (inductor's CPU template asks for it, as in compiled_step.py)."""
    device = page_table.device
    if lists is None:
        lists = chunk_block_lists(start, num_queries, window, page_size, device)
    num_blocks, indices, full_num_blocks, full_indices = to_physical(lists, page_table)
    if pad_indices:
        width = num_slots // page_size
        indices, full_indices = (F.pad(t, (0, width - t.shape[1])) for t in (indices, full_indices))
    # int32 as the kernel's q_idx, kv_idx and logical_of: no int64/int32 mix in the generated code
    offset = torch.tensor(start, dtype=torch.int32, device=device)
    limit = torch.tensor(window if window is not None else start + num_queries + 1, dtype=torch.int32, device=device)

    def visible(b, h, q_idx, kv_idx):
        logical = logical_of[kv_idx // page_size]
        distance = q_idx + offset - (logical * page_size + kv_idx % page_size)
        return (logical >= 0) & (distance >= 0) & (distance < limit)

    as_bhq = lambda t: t[None, None]  # noqa: E731  [1, 1, Qb(, W)]: one batch, every head alike
    return BlockMask.from_kv_blocks(as_bhq(num_blocks), as_bhq(indices), as_bhq(full_num_blocks),
                                    as_bhq(full_indices), BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=visible,
                                    seq_lengths=(num_queries, num_slots), compute_q_blocks=False)


def pool_keys_values(kv_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_pool [2, pages, ps, Hkv, D] -> keys, values [1, Hkv, pages * ps, D]: views of the pool, no copy."""
    _, pages, ps, kv_heads, head_dim = kv_pool.shape
    as_bhsd = lambda half: half.view(1, pages * ps, kv_heads, head_dim).transpose(1, 2)  # noqa: E731
    return as_bhsd(kv_pool[0]), as_bhsd(kv_pool[1])


def paged_prefill_attention(q: torch.Tensor, kv_pool: torch.Tensor, page_table: torch.Tensor, start: int,
                            window: int | None, logical_of: torch.Tensor | None = None,
                            compile: bool | None = None, backend: str | None = None,
                            lists: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """q [1, Hq, T, D] at positions start .. start + T - 1; kv_pool [2, pages, ps, Hkv, D] holding the row's keys
    0 .. start + T - 1 (this chunk's written); page_table int [P] of this row and layer -> [1, Hq, T, D].
    logical_of: logical_pages(page_table, pages), and lists: chunk_block_lists(...), when the caller shares them
    across layers (a chunk's map serves every layer, compiled only: the eager path scores every slot, so its map
    must be this layer's alone; the lists serve every layer of a kind). compile: default on
    a GPU; on the CPU (a test of the page lists through inductor's CPU template) the lists are padded.
    backend: flex's BACKEND; None: decoding_backend's choice."""
    pages, ps = kv_pool.shape[1], kv_pool.shape[2]
    compile = q.is_cuda if compile is None else compile
    if logical_of is None:
        logical_of = logical_pages(page_table, pages)
    keys, values = pool_keys_values(kv_pool)
    mask = paged_block_mask(page_table, logical_of, start, q.shape[2], window, ps, pages * ps,
                            pad_indices=compile and not q.is_cuda, lists=lists)
    scale = q.shape[-1] ** -0.5
    if not compile:
        return flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=True)
    # static heads and head dim (only lengths vary): the flex-decoding kernel, which splits the keys over the SMs,
    # is only chosen for short chunks (T < 128) when the heads are static
    for tensor, dims in ((q, (0, 1, 3)), (keys, (0, 1, 3)), (values, (0, 1, 3)), (kv_pool, (0, 2, 3, 4))):
        for dim in dims:
            torch._dynamo.mark_static(tensor, dim)
    options = {"BACKEND": backend or decoding_backend(q.shape[2], q.shape[1] // keys.shape[1])}
    if q.is_cuda and ps < 64:  # the kernel's key tile must divide a page (its default on sm_90 is 64)
        options["BLOCK_N"] = ps
    # no duck sizing: dynamo would give equal sizes one symbol (the query blocks and the KV heads, both 4 at a chunk
    # of 512), specialise it with the heads, and compile again for every chunk whose block count met another size.
    # Past the recompile limit an error, not dynamo's silent eager fallback (which scores every slot of the pool)
    with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(
            recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        return compiled_flex()(q, keys, values, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=options)


def decoding_backend(num_queries: int, group: int) -> str:
    """flex's BACKEND for a chunk: "AUTO" (which takes the flex-decoding kernel, keys split over the SMs, for
    T < 128 with static heads) only where that kernel can run: it packs the T x group query rows of a KV head into
    one tile of next_pow2(T * group) rows, which must divide the mask's Q_BLOCK (torch's flex_decoding.py skips
    every config otherwise, and the compile fails): T <= 16 at North Mini Code's group of 8. Else "TRITON", the
    main kernel (one query block of one head per program)."""
    return "AUTO" if num_queries * group <= Q_BLOCK else "TRITON"


def dense_visible(page_table: torch.Tensor, start: int, num_queries: int, window: int | None,
                  page_size: int) -> torch.Tensor:
    """bool [T, P * ps] over the row's logical key positions: what the GPU kernel computes from the lists (full pages
    whole, partial pages through the mask's rule, unlisted pages never). The tests hold it to the reference mask."""
    num_blocks, indices, full_num_blocks, full_indices = (t.cpu() for t in chunk_page_lists(
        page_table, start, num_queries, window, page_size))
    table = page_table.cpu().long()
    logical_of = {int(p): j for j, p in enumerate(table.tolist()) if p >= 0}
    key_pos = torch.arange(table.shape[0] * page_size)
    seen = torch.zeros(num_queries, key_pos.shape[0], dtype=torch.bool)
    for m in range(num_blocks.shape[0]):
        rows = slice(m * Q_BLOCK, min((m + 1) * Q_BLOCK, num_queries))
        q_pos = torch.arange(start, start + num_queries)[rows, None]
        for listed, count, whole in ((indices, num_blocks, False), (full_indices, full_num_blocks, True)):
            for page in listed[m, :count[m]].tolist():
                cols = slice(logical_of[page] * page_size, (logical_of[page] + 1) * page_size)
                assert not seen[rows, cols].any(), f"page {page} listed twice for query block {m}"
                if whole:
                    seen[rows, cols] = True
                else:
                    distance = q_pos - key_pos[None, cols]
                    seen[rows, cols] = (distance >= 0) & (distance < (window or start + num_queries + 1))
    return seen
