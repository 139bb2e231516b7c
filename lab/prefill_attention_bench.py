"""The prefill's attention alone, by kernel (`python lab/prefill_attention_bench.py`, a GPU).

Run 110 put the prefill's attention at ~57% of a 16K prompt. Run 111 then found short warm turns ~40 ms
slower when full layers attend causal without a mask (through CausalBias, which picks FlashAttention-2 there)
than with a mask on the memory-efficient kernel. The cause was not measured. This times each way of doing one
layer's attention for a chunk of T queries at the end of S keys (positions S - T .. S - 1 against 0 .. S - 1,
causal, and inside the window on sliding layers), with North Mini Code's heads (32 query and 4 KV heads of 128).
It prints each way's median time, its first call on a shape not seen before (cuDNN builds a plan per shape, a
compiled flex_attention may compile), and its largest difference from an fp32 reference:
  efficient-mask    SDPA's memory-efficient kernel with a bool mask (the prefill's sliding layers, short chunks)
  ...-gqa           the same with SDPA's enable_gqa instead of repeated K/V (where the kernel takes it)
  efficient-causal  the same kernel, causal from the bottom right without a mask (CausalBias, flash disabled)
  flash-causal      FlashAttention-2 causal from the bottom right (what CausalBias picks first; full layers only)
  cudnn-mask        cuDNN's attention with the bool mask (SDPA's own first choice; run 109's plan per shape)
  flex              flex_attention compiled once with dynamic shapes, a block mask of the same rule, GQA in the
                    kernel (no repeated K/V); the mask is made by create_block_mask in every call, in the time
                    (it evaluates the rule over all T x S pairs: ~1-3 ms at T = 2048 on 16-32K, a cost the paged
                    way's lists do not have)
  flex-paged        lab/paged_prefill_flex.py: the same kernel reading K/V in place from a paged pool of POOL_PAGES
                    pages of PAGE_SIZE (under 2^31 elements, as the compiled decode step's pool), the row's pages
                    scattered through it; the block mask is built from the page table in every call (in the time;
                    its own time is in the note: the page lists, built once per chunk and layer kind, and a
                    layer's share, the translation to its pages and the BlockMask)
  flex-paged-big    the same over a pool of BIG_POOL_PAGES (past 2^31 elements, as the eager engine's 68 GB pool):
                    does the template compile and run with 64-bit offsets (the decode template did not, run 29)?
  flex-paged-triton flex-paged with flex's main kernel forced (BACKEND "TRITON") for chunks of T <= 16, where
                    flex-paged lets flex take its decoding kernel (paged_prefill_flex.decoding_backend)
Every way but the flex ones and the -gqa ones repeats K/V to the query heads first, as the prefill does; that copy
is in the time. FlashInfer is not among them: its PyPI wheel (flashinfer-python 0.7.2.post1, 62 MB = 59 MiB,
py3-none-any) is sources that nvcc compiles on first use (minutes per kernel variant, against a 5-minute device
call), and it leaves ~5 MiB of the 64 MiB a device call carries (the device has no network) for its required
dependencies: apache-tvm-ffi, cuda-python, cuda-tile, nvidia-cutlass-dsl, nccl4py, nvidia-cudnn-frontend and more.
Its precompiled kernels are separate packages (flashinfer-cubin, flashinfer-jit-cache), not sized here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

WAYS = ("efficient-mask", "efficient-mask-gqa", "efficient-causal", "flash-causal", "flash-causal-gqa", "cudnn-mask",
        "flex", "flex-paged", "flex-paged-big", "flex-paged-triton")
# (queries, keys, window), most telling first (the rows print as they are done): a chunk of 2048 on a full layer
# at 16K, a warm turn of 40 tokens on 4K cached, +8 on 32K (where flex may take its decoding kernel), a chunk of
# 2048 on a sliding layer (keys from the window's start), then on full layers at 32K and 4K, issue 25's turns
# +2K on 20K cached and +32 on 32K, and the warm turn on a sliding layer
SHAPES = ((2048, 16384, None), (40, 4136, None), (8, 32776, None), (2048, 6144, 4096), (2048, 32768, None),
          (2048, 4096, None), (2048, 22528, None), (32, 32800, None), (40, 4136, 4096))
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
PAGE_SIZE = 64  # settings.PAGE_SIZE
POOL_PAGES = 30_000  # 2 x 30001 x 64 x 4 x 128 = 1.97e9 elements (3.9 GB bf16): under 2^31
BIG_POOL_PAGES = 70_000  # 4.6e9 elements (9.2 GB): past 2^31
PAGED_WAYS = {"flex-paged": POOL_PAGES, "flex-paged-big": BIG_POOL_PAGES, "flex-paged-triton": POOL_PAGES}


def visible(t: int, s: int, window: int | None, device) -> torch.Tensor:
    """bool [T, S]: query i at position s - t + i against keys 0 .. s - 1 (model.attention_mask's rule)."""
    from northcode.model.model import attention_mask

    return attention_mask(torch.arange(s - t, s, device=device), torch.arange(s, device=device), window)


def repeated(k: torch.Tensor) -> torch.Tensor:
    """[1, Hkv, S, D] -> [1, Hq, S, D]: query head h reads KV head h // group, as the prefill."""
    return k.repeat_interleave(HEADS // k.shape[1], dim=1)


def sdpa_with(backend, q, k, v, mask=None, causal_bias=False, gqa=False) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    with sdpa_kernel([backend]):
        if causal_bias:
            mask = causal_lower_right(q.shape[2], k.shape[2])
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, repeated(k), repeated(v), attn_mask=mask)


_FLEX = {}  # the compiled flex_attention, once per process


def flex_way(q, k, v, window: int | None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=True) if q.is_cuda else flex_attention
    t, s = q.shape[2], k.shape[2]
    # tensors, not ints: an int captured by the rule would be a constant of the compiled kernel (a compile per shape)
    offset = torch.tensor(s - t, device=q.device)
    limit = torch.tensor(window if window is not None else s + 1, device=q.device)

    def rule(b, h, qi, ki):
        distance = qi + offset - ki
        return (distance >= 0) & (distance < limit)

    block_mask = create_block_mask(rule, 1, 1, t, s, device=q.device)
    return _FLEX["fn"](q, k, v, block_mask=block_mask, enable_gqa=True)


SHORT_ONLY = "short chunks only"  # way_function's answer for flex-paged-triton; measure decides by T
SHORT_QUERIES = 16  # flex-paged-triton's chunks: those where flex-paged may take the decoding kernel
_POOLS = {}  # pages -> the paged ways' pool, allocated once per process


def paged_case(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool_pages: int, seed: int = 0) -> tuple:
    """k, v [1, Hkv, S, D] scattered into a pool [2, pool_pages + 1, PAGE_SIZE, Hkv, D] at random distinct pages ->
    the paged way's arguments (q, pool, page_table int32 [ceil(S / PAGE_SIZE)], start = S - T). On the CPU the
    pool is twice the pages the row needs."""
    s = k.shape[2]
    num_pages = -(-s // PAGE_SIZE)
    pool_pages = pool_pages if q.is_cuda else 2 * num_pages
    key = (pool_pages, q.device.type, q.dtype)
    if key not in _POOLS:
        _POOLS.clear()  # one pool at a time: the big one is 9 GB
        _POOLS[key] = torch.zeros(2, pool_pages + 1, PAGE_SIZE, KV_HEADS, HEAD_DIM, device=q.device, dtype=q.dtype)
    pool = _POOLS[key]
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(pool_pages, generator=gen)[:num_pages].to(torch.int32).to(q.device)
    padded = num_pages * PAGE_SIZE
    for half, kv in enumerate((k, v)):  # [1, Hkv, S, D] -> pages [P, ps, Hkv, D]
        rows = F.pad(kv[0].transpose(0, 1), (0, 0, 0, 0, 0, padded - s)).reshape(num_pages, PAGE_SIZE, KV_HEADS, -1)
        pool[half].index_copy_(0, table.long(), rows)
    return q, pool, table, s - q.shape[2]


def paged_function(window: int | None, backend: str | None = None) -> Callable:
    """(q, pool, page_table, start) -> [1, Hq, T, D]: lab/paged_prefill_flex.py's attention (the mask built too)."""
    from paged_prefill_flex import paged_prefill_attention

    return lambda q, pool, table, start: paged_prefill_attention(q, pool, table, start, window, backend=backend)


def mask_functions(window: int | None) -> tuple[Callable, Callable]:
    """(q, pool, page_table, start) -> the paged way's block mask in its two parts: the logical page lists (once per
    chunk and layer kind in a prefill) and a layer's share (the physical->logical map, the lists' translation and
    the BlockMask; a prefill would build the map once per chunk)."""
    from paged_prefill_flex import chunk_block_lists, logical_pages, paged_block_mask

    def lists(q, pool, table, start):
        return chunk_block_lists(start, q.shape[2], window, PAGE_SIZE, q.device)

    def per_layer(q, pool, table, start, built=None):
        logical_of = logical_pages(table, pool.shape[1])
        return paged_block_mask(table, logical_of, start, q.shape[2], window, PAGE_SIZE, pool.shape[1] * PAGE_SIZE,
                                lists=built)

    return lists, per_layer


def way_function(name: str, window: int | None) -> Callable | None:
    """q [1, Hq, T, D], k and v [1, Hkv, S, D] -> [1, Hq, T, D]; None where the way does not apply."""
    from torch.nn.attention import SDPBackend

    gqa = name.endswith("-gqa")
    if name.removesuffix("-gqa") == "efficient-mask":
        return lambda q, k, v: sdpa_with(SDPBackend.EFFICIENT_ATTENTION, q, k, v,
                                         visible(q.shape[2], k.shape[2], window, q.device), gqa=gqa)
    if name == "cudnn-mask":
        return lambda q, k, v: sdpa_with(SDPBackend.CUDNN_ATTENTION, q, k, v,
                                         visible(q.shape[2], k.shape[2], window, q.device))
    if name.removesuffix("-gqa") in ("efficient-causal", "flash-causal"):
        if window is not None:
            return None
        backend = SDPBackend.EFFICIENT_ATTENTION if name == "efficient-causal" else SDPBackend.FLASH_ATTENTION
        return lambda q, k, v: sdpa_with(backend, q, k, v, causal_bias=True, gqa=gqa)
    if name == "flex":
        return lambda q, k, v: flex_way(q, k, v, window)
    if name == "flex-paged-triton":
        return SHORT_ONLY
    if name in PAGED_WAYS:
        return paged_function(window)
    raise ValueError(f"unknown way {name!r}; choose from {', '.join(WAYS)}")


def reference(q, k, v, window: int | None) -> torch.Tensor:
    """fp32 math attention with the mask."""
    mask = visible(q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q.float(), repeated(k).float(), repeated(v).float(), attn_mask=mask)


def timed(fn: Callable, args: tuple, repeats: int) -> float:
    """Median seconds of fn(*args) (CUDA events on a GPU)."""
    times = []
    for _ in range(repeats):
        if args[0].is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def inputs(t: int, s: int, device, dtype, seed: int = 0) -> tuple:
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda heads, n: torch.randn(1, heads, n, HEAD_DIM, generator=gen, device=device, dtype=dtype)  # noqa
    return make(HEADS, t), make(KV_HEADS, s), make(KV_HEADS, s)


def measure(shapes, ways, device, dtype, repeats: int, report: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (shape, way): median ms, first call on a new shape ms, max |difference| from fp32. report: called
    with each row as it is done (a device phase cut at its time limit keeps the rows before)."""
    rows = []
    for t, s, window in shapes:
        q, k, v = inputs(t, s, device, dtype)
        want = reference(q, k, v, window)
        for name in ways:
            rows.append(measure_way(name, q, k, v, want, window, repeats))
            if report is not None:
                report(rows[-1])
    return rows


def measure_way(name: str, q, k, v, want, window: int | None, repeats: int) -> dict:
    t, s = q.shape[2], k.shape[2]
    fn = way_function(name, window)
    if fn is SHORT_ONLY:
        fn = paged_function(window, "TRITON") if t <= SHORT_QUERIES else None
    row = dict(queries=t, keys=s, window=window, way=name, ms=None, first_ms=None, max_diff=None, note="")
    if fn is None:
        row["note"] = "full layers only" if name != "flex-paged-triton" else SHORT_ONLY
        return row
    paged = PAGED_WAYS.get(name)
    args = (q, k, v) if paged is None else paged_case(q, k, v, paged)
    notes = []
    try:
        began = time.perf_counter()
        row["max_diff"] = (fn(*args).float() - want).abs().max().item()
        if time.perf_counter() - began > 1:  # a compile (flex: the first chunk of its kind) or a plan (cuDNN)
            notes.append(f"first call {time.perf_counter() - began:.1f} s")
        row["ms"] = 1e3 * timed(fn, args, repeats)
        fresh = inputs(t + 1, s + 64, q.device, q.dtype, seed=1)  # a shape this way has not seen
        row["first_ms"] = 1e3 * timed(fn, fresh if paged is None else paged_case(*fresh, paged, seed=1), 1)
        if paged is not None:
            lists, per_layer = mask_functions(window)
            built = lists(*args)
            notes.append(f"mask: lists {1e3 * timed(lists, args, repeats):.3f} ms, per layer "
                         f"{1e3 * timed(per_layer, (*args, built), repeats):.3f} ms")
    except Exception as err:  # a kernel that does not take this case (the CPU, no cuDNN, an old GPU), or
        # a compile that fails (inductor raises its own errors, not RuntimeError)
        first_line = (str(err).splitlines() or [type(err).__name__])[0]
        notes.append("no such kernel here" if "No viable backend" in first_line else first_line[:100])
    row["note"] = "; ".join(notes)
    return row


HEADER = f"{'T':>5} {'S':>6} {'window':>6}  {'way':<18}{'ms':>9}{'first ms':>10}{'max diff':>10}  note"


def format_row(r: dict) -> str:
    num = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
    return (f"{r['queries']:>5} {r['keys']:>6} {num(r['window'], 'd'):>6}  {r['way']:<18}"
            f"{num(r['ms'], '.3f'):>9}{num(r['first_ms'], '.2f'):>10}{num(r['max_diff'], '.4f'):>10}  {r['note']}")


def format_rows(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python lab/prefill_attention_bench.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    # every flex way's graphs share flex_attention's code object: room for them all, and an error past it rather
    # than dynamo's silent eager fallback (which would time the unfused path)
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    shapes = SHAPES if on_gpu else tuple((t // 16 or 4, s // 16, w // 16 if w else None) for t, s, w in SHAPES)
    print(HEADER, flush=True)
    measure(shapes, args.ways, device, dtype, args.repeats, report=lambda row: print(format_row(row), flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
