"""Where a cold prefill's time goes: one prefill under torch.profiler, split into attention, expert GEMMs, other
GEMMs, copies and elementwise, other work, and gaps (`bench engine --profile-prefill`).

On CUDA the items are the GPU's kernels, memcpys and memsets inside the prefill's window, each classified by its
name and the CPU ops it was launched under (the profiler's correlation: a kernel under aten::_grouped_mm is an
expert GEMM, one under scaled_dot_product_attention is attention); gaps are the window minus the union of the
kernels' busy intervals (idle GPU). On the CPU the items are the ops' self times, by the same classifier on the
op's name and its parents; gaps are the window minus the union of the ops' intervals (Python, the scheduler).
The engine is not touched: its thread is profiled from outside (profile_all_threads). The profiler slows the
host (the tiny CPU prefill takes ~1.8x as long under it), so the split is of the profiled run, whose wall time
is printed beside it: kernel times hold, gaps of a host-bound prefill grow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WINDOW = "northcode.bench.prefill"  # the record_function range around the profiled request
CATEGORIES = ("attention", "expert GEMMs", "other GEMMs", "copies and elementwise", "other", "gaps")

# substrings of lower-cased kernel or op names; a name or any of its parent ops matching is enough for the first two
ATTENTION = ("scaled_dot_product", "attention", "fmha", "flash", "cudnn", "sdpa", "triton_tem_fused_flex")
EXPERT_GEMM = ("grouped_mm", "grouped_gemm", "groupproblemshape")
GEMM = ("gemm", "gemv", "nvjet", "xmma", "cublas", "cutlass", "splitkreduce", "triton_tem_fused_mm",
        "triton_tem_fused_addmm", "triton_tem_fused_bmm")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::mv",
            "aten::addmv", "aten::dot", "aten::einsum", "aten::_scaled_mm"}
ROUTING = ("sort", "topk", "searchsorted", "radix", "cub::")  # the router's bookkeeping: "other"
COPY_ELEMENTWISE = ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter", "elementwise", "reduce", "norm",
                    "softmax", "fill", "embedding", "triton_poi", "triton_red", "triton_per", "vectorized")
# CPU ops that move no data: views, allocation, host syncs ("other"); every other aten:: op is a copy or elementwise
METADATA_OPS = {"aten::view", "aten::as_strided", "aten::select", "aten::slice", "aten::transpose", "aten::t",
                "aten::unsqueeze", "aten::squeeze", "aten::flatten", "aten::unflatten", "aten::reshape",
                "aten::expand", "aten::expand_as", "aten::alias", "aten::permute", "aten::detach", "aten::detach_",
                "aten::lift_fresh", "aten::_unsafe_view", "aten::split", "aten::chunk", "aten::narrow",
                "aten::unbind", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
                "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::to", "aten::result_type"}


def classify(name: str, parents: Sequence[str] = ()) -> str:
    """The category of one kernel (CUDA) or one op's self time (CPU), from its name and the CPU ops it ran under
    (innermost first). Attention and expert GEMMs go by the name or any parent; the rest by the name alone."""
    own = name.lower()
    lowered = [own, *(parent.lower() for parent in parents)]
    if any(pattern in n for n in lowered for pattern in ATTENTION):
        return "attention"
    if any(pattern in n for n in lowered for pattern in EXPERT_GEMM):
        return "expert GEMMs"
    if own in GEMM_OPS or any(pattern in own for pattern in GEMM):
        return "other GEMMs"
    if own in METADATA_OPS or any(pattern in own for pattern in ROUTING):
        return "other"
    if own.startswith("aten::") or any(pattern in own for pattern in COPY_ELEMENTWISE):
        return "copies and elementwise"
    return "other"


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: overlapping ones are counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass(frozen=True)
class Item:
    """One piece of the prefill's time: a kernel, or an op's self time."""
    name: str
    parents: tuple[str, ...]  # CPU ops it ran under, innermost first
    busy_us: float  # kernel duration, or the op's self time
    interval: tuple[float, float]  # us on the profiler's clock: the kernel, or the op's whole span


@dataclass
class PrefillSplit:
    source: str  # "CUDA kernels" or "CPU ops"
    prompt_len: int
    wall_ms: float  # the profiled request, from submission to its first token
    categories_ms: dict[str, float] = field(default_factory=dict)  # CATEGORIES, summing to wall_ms (one stream)
    top: list[dict] = field(default_factory=list)  # the largest (name, category) sums: {name, category, ms, count}


def split(items: Sequence[Item], window: tuple[float, float], source: str, prompt_len: int,
          top: int = 6) -> PrefillSplit:
    """The window's time by category; gaps: the window minus the union of the items' intervals."""
    wall_us = window[1] - window[0]
    totals = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[tuple[str, str], list[float]] = {}  # (name, category) -> [us, count]
    for item in items:
        category = classify(item.name, item.parents)
        totals[category] += item.busy_us
        entry = by_name.setdefault((item.name, category), [0.0, 0])
        entry[0] += item.busy_us
        entry[1] += 1
    totals["gaps"] = max(0.0, wall_us - union_us(item.interval for item in items))
    largest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return PrefillSplit(source, prompt_len, wall_us / 1e3, {k: v / 1e3 for k, v in totals.items()},
                        [{"name": name, "category": c, "ms": us / 1e3, "count": n} for (name, c), (us, n) in largest])


def _parents(op) -> tuple[str, ...]:
    names = []
    while op is not None:
        names.append(op.name)
        op = op.cpu_parent
    return tuple(names)


def _clip(start: float, end: float, window: tuple[float, float]) -> tuple[float, float]:
    return max(start, window[0]), min(end, window[1])


def device_items(events, window: tuple[float, float]) -> list[Item]:
    """The CUDA kernels, memcpys and memsets in the window, with the CPU ops that launched them."""
    from torch.autograd import DeviceType

    ops = {e.id: e for e in events  # the ops' own ids (runtime calls' ids are CUPTI's, another space)
           if e.device_type == DeviceType.CPU and not e.is_async and e.linked_correlation_id == 0}
    items = []
    for e in events:
        if e.device_type != DeviceType.CUDA or e.is_user_annotation:
            continue
        start, end = _clip(e.time_range.start, e.time_range.end, window)
        if end > start:
            launcher = ops.get(e.linked_correlation_id) if e.linked_correlation_id > 0 else None
            items.append(Item(e.name, _parents(launcher), end - start, (start, end)))
    return items


def cpu_items(events, window: tuple[float, float]) -> list[Item]:
    """The CPU ops that started in the window (any thread: the engine's), with their self times."""
    from torch.autograd import DeviceType

    items = []
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_user_annotation or e.is_async:
            continue
        if window[0] <= e.time_range.start < window[1]:
            start, end = _clip(e.time_range.start, e.time_range.end, window)
            items.append(Item(e.name, _parents(e.cpu_parent), e.self_cpu_time_total, (start, end)))
    return items


def profile_prefill(engine, prompt: list[int], on_gpu: bool, top: int = 6) -> PrefillSplit:
    """One request of `prompt` (one token out) under torch.profiler, split (module docstring)."""
    import torch
    from torch.profiler import ProfilerActivity

    from northcode.bench.engine_bench import generate_one

    try:
        threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the engine's own thread
    except TypeError:
        raise ValueError(f"--profile-prefill needs torch >= 2.7 (profile_all_threads); this is {torch.__version__}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    if on_gpu:
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities, experimental_config=threads) as prof:
        with torch.profiler.record_function(WINDOW):
            final = asyncio.run(generate_one(engine, "profiled-prefill", prompt, 1))
    if final.finish_reason == "error":
        raise RuntimeError(f"the profiled prefill failed: {final.error}")
    events = prof.events()
    marks = [e for e in events if e.name == WINDOW and e.device_type.name == "CPU"]
    assert len(marks) == 1, f"{len(marks)} {WINDOW} ranges in the profile"
    window = (marks[0].time_range.start, marks[0].time_range.end)
    items = device_items(events, window) if on_gpu else cpu_items(events, window)
    return split(items, window, "CUDA kernels" if on_gpu else "CPU ops", len(prompt), top)


def format_split(result: PrefillSplit) -> list[str]:
    lines = [f"  prefill profile ({result.prompt_len} tokens under torch.profiler, {result.source}): "
             f"{result.wall_ms:.1f} ms",
             "    category                     ms   % of prefill"]
    for category, ms in result.categories_ms.items():
        lines.append(f"    {category:24s} {ms:9.1f} {100 * ms / result.wall_ms:8.1f}")
    lines.append(f"    {'sum':24s} {sum(result.categories_ms.values()):9.1f}")
    lines.append("    largest:")
    lines += [f"      {row['ms']:9.2f} ms {row['count']:5d}x  {row['category']:22s} {row['name'][:90]}"
              for row in result.top]
    return lines
