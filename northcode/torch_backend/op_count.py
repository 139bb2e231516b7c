"""Count the device kernels of one decode step on the CPU: the structure of the step, not its widths.

A CUDA-graph decode step of a small batch is bound by how many kernels it launches (about 0.5 us per
graph node plus a tail each, shared/docs/perf_anchors.md), and that count depends on the model's
structure (layers, kinds, experts, heads), not on its widths. So it is measured on the CPU, on
`structural_config()`: the full North Mini Code layer plan with tiny widths.

What counts: every aten op that reaches a backend kernel, seen by a TorchDispatchMode. That is the
dispatcher's own view: ops that are compositions of others (CompositeImplicitAutograd: `linear`,
`einsum`, a `to` that converts) are decomposed and counted as their parts, and what a real kernel
calls inside it is not seen. Ops that only make views or allocate (VIEW_OPS) launch nothing. One
correction makes the CPU count CUDA's: rms_norm is a composition on the CPU but one fused kernel on
CUDA (torch >= 2.9), so it is counted once. (The first version of this counter read torch.profiler's
op tree instead; it cannot tell which overload ran, so it misjudged ops such as `where`.) On CUDA a
sort, a top-k or a cumsum can take 2-3 kernels where it counts one here, a grouped GEMM two
(argument setup, GEMM), and a bf16 GEMM a split-K reduction more. Ops that make the host wait for the
device (`item`, `nonzero`, ...) cannot be in a CUDA graph: they are reported as host syncs.
Kernels are attributed to the step's parts: prepare, each layer kind (decode_step.layer_kind), lm_head.

    python -m northcode.torch_backend.op_count [--batch 1] [--context 8192] [--ops]
    python -m northcode.torch_backend.op_count --cuda     # on a GPU: the CUDA kernels torch.profiler sees
    python -m northcode.torch_backend.op_count --time     # on a GPU, real widths: where the step's time goes
    python -m northcode.torch_backend.op_count --time --compiled   # the same for the torch.compile'd step
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "reshape", "expand", "unsqueeze", "squeeze", "slice", "select",
    "transpose", "t", "permute", "detach", "alias", "unflatten", "flatten", "empty", "empty_strided",
    "empty_like", "split", "split_with_sizes", "unbind", "narrow", "diagonal", "lift_fresh", "_reshape_alias",
    "new_empty", "new_empty_strided", "set_", "unfold", "view_as", "expand_as", "resize_", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_record_function_enter_new", "_record_function_exit",  # profiler ranges: host only
})
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "item", "unique", "_unique2", "masked_select",
                      "bincount", "repeat_interleave"})  # repeat_interleave of a tensor count syncs


class KernelCounter(TorchDispatchMode):
    """Records (op, part of the step) for every kernel-launching aten op run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "other"
        self.kernels: list[tuple[str, str]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # the handler runs with the mode off: put it back so the parts are seen
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        name = func.overloadpacket.__name__
        repeats = args[1] if len(args) > 1 else None
        if name in SYNC_OPS and not (name == "repeat_interleave" and isinstance(repeats, int)):
            self.syncs.append(f"{name} in {self.part}")
        if name not in VIEW_OPS:
            self.kernels.append((name, self.part))
        return func(*args, **kwargs)

    def one_kernel(self, name: str, fn):
        """Run fn uncounted and count it as one kernel (an op CUDA fuses and the CPU decomposes)."""
        def run(*args, **kwargs):
            self.kernels.append((name, self.part))
            with _suspended(self):
                return fn(*args, **kwargs)
        return run

    @contextlib.contextmanager
    def within(self, part: str):
        outer, self.part = self.part, part
        try:
            yield
        finally:
            self.part = outer


@contextlib.contextmanager
def _suspended(mode: TorchDispatchMode):
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield


def structural_config():
    """North Mini Code's structure (49 layers and their kinds, 128 experts top-8, 32/4 heads, window
    4096) at tiny widths: hidden 64, head_dim 16, expert width 16, dense width 32, vocab 512."""
    from northcode.model.synthetic import preset_config

    full = preset_config("north-mini-code")
    return dataclasses.replace(full, hidden_size=64, head_dim=16, intermediate_size=16,
                               prefix_dense_intermediate_size=32, vocab_size=512, eos_token_id=3,
                               pad_token_id=0, bos_token_id=2, layer_types=full.layer_types,
                               mlp_layer_types=full.mlp_layer_types)


def count_step(step, config) -> KernelCounter:
    """Run one decode_step.DecodeStep call (step(...) with its arguments bound) under the counter."""
    from northcode.torch_backend.decode_step import layer_kind

    counter = KernelCounter()
    decoder = step.func.__self__ if hasattr(step, "func") else None
    assert decoder is not None, "count_step takes functools.partial(DecodeStep.__call__ bound, ...)"
    original = decoder.prepare, decoder.layer, decoder.backend.logits, F.rms_norm

    def prepare(*args, **kwargs):
        with counter.within("prepare"):
            return original[0](*args, **kwargs)

    def layer(layer_idx, *args, **kwargs):
        with counter.within(f"layer.{layer_kind(config, layer_idx)}"):
            return original[1](layer_idx, *args, **kwargs)

    def logits(*args, **kwargs):
        with counter.within("lm_head"):
            return original[2](*args, **kwargs)

    decoder.prepare, decoder.layer, decoder.backend.logits = prepare, layer, logits
    F.rms_norm = counter.one_kernel("_fused_rms_norm", original[3])
    try:
        with counter:
            step()
    finally:
        del decoder.prepare, decoder.layer, decoder.backend.logits  # back to the class's methods
        F.rms_norm = original[3]
    return counter


def decode_step_at(batch: int, context: int, config=None, device: str = "cpu", dtype=torch.float32,
                   page_size: int = 64, compiled: bool = False):
    """A TorchBackend (no graphs) with `batch` rows of `context` tokens mapped, and its decode step with
    the arguments bound (functools.partial), on `config` (default: the structural config); `compiled`: the
    torch.compile'd step (compiled_step.py, compiled here for this batch) instead of the eager one."""
    import functools

    from northcode.engine.backend import context_bucket
    from northcode.engine.kv_cache import KVCacheManager
    from northcode.model.synthetic import random_weights
    from northcode.torch_backend.backend import TorchBackend

    config = config or structural_config()
    weights = random_weights(config, device=device, dtype=dtype)
    pages_per_seq = -(-(context + 1) // page_size)
    num_pages = batch * pages_per_seq * config.num_hidden_layers
    kv = KVCacheManager(config, num_pages, page_size, batch, pages_per_seq)
    backend = TorchBackend(config, weights, num_pages, page_size, batch, pages_per_seq, cuda_graphs=False,
                           compile=compiled)
    for row in range(batch):
        kv.allocate(row, context + 1)
        kv.evict_behind_window(row, context)
    backend.device_tables.upload(kv.block_tables, kv.version)
    token_ids = torch.zeros(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    pages = context_bucket(-(-(context + 1) // page_size), pages_per_seq)  # what the graph would read
    if compiled:
        backend.compiled.compile_bucket(batch)
    step = backend.compiled if compiled else backend.decoder.__call__
    call = functools.partial(step, token_ids, positions, rows, pages)
    call.backend = backend  # the step holds its backend weakly: the call keeps it alive
    return call


def count_decode(batch: int = 1, context: int = 8192, config=None) -> KernelCounter:
    """Kernels of one TorchBackend decode step (the part a CUDA graph captures), fp32 on the CPU."""
    step = decode_step_at(batch, context, config)
    with torch.inference_mode():
        step()  # warm-up (lazy inits)
        return count_step(step, config or structural_config())


def count_cuda_kernels(batch: int = 1, context: int = 8192, config=None) -> tuple[int, Counter]:
    """The real thing on a GPU: CUDA kernels (and memcpy/memset) of one eager bf16 decode step, counted by
    torch.profiler -> (total: the device events; kernels per part of the step, by the record_function
    range of the op that launched them: a guide, as the profiler may attach a kernel to nested ops)."""
    from torch.profiler import ProfilerActivity, profile

    step = decode_step_at(batch, context, config, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    events = prof.events()
    device_events = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    by_part: Counter = Counter()
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or not getattr(event, "kernels", None):
            continue
        part, parent = "other", event
        while parent is not None:
            if parent.name.startswith(("layer.", "step.")):
                part = parent.name
                break
            parent = parent.cpu_parent
        by_part[part] += len(event.kernels)
    return device_events or sum(by_part.values()), by_part


def time_cuda_step(batch: int = 1, context: int = 8192, repeats: int = 20, compiled: bool = False) -> dict:
    """North Mini Code at its real widths (random bf16 weights) on the GPU: ms per decode step replayed in a
    CUDA graph (what the bench measures), and from one eager step under torch.profiler the device time of
    every kernel, by part of the step and by kernel name. The graph's time minus the kernels' is what the
    launches and the gaps between kernels cost. `compiled`: the torch.compile'd step (its kernels carry no
    part ranges: they count under "other")."""
    from torch.profiler import ProfilerActivity, profile

    from northcode.model.synthetic import preset_config

    step = decode_step_at(batch, context, preset_config("north-mini-code"), device="cuda", dtype=torch.bfloat16,
                          compiled=compiled)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up before the capture, on a side stream
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        begin.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
    by_part: Counter = Counter()  # part -> us of kernel time
    by_name: Counter = Counter()  # kernel name -> us
    calls: Counter = Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not getattr(event, "kernels", None):
            continue
        part, parent = "other", event
        while parent is not None and part == "other":
            part = parent.name if parent.name.startswith(("layer.", "step.")) else "other"
            parent = parent.cpu_parent
        for kernel in event.kernels:
            by_part[part] += kernel.duration
            by_name[kernel.name[:70]] += kernel.duration
            calls[kernel.name[:70]] += 1
    return dict(graph_ms=begin.elapsed_time(end) / repeats, kernels=sum(calls.values()),
                kernel_ms=sum(by_name.values()) / 1e3, by_part=by_part, by_name=by_name, calls=calls)


def print_timing(batch: int, context: int, top: int = 25, compiled: bool = False) -> None:
    t = time_cuda_step(batch, context, compiled=compiled)
    what = "compiled decode step" if compiled else "decode step"
    print(f"{what}, North Mini Code widths, batch {batch}, context {context}: {t['graph_ms']:.3f} ms in a "
          f"CUDA graph; eager under the profiler {t['kernels']} kernels, {t['kernel_ms']:.3f} ms of kernel time")
    for part, us in sorted(t["by_part"].items()):
        print(f"  {part:28s} {us / 1e3:8.3f} ms")
    print(f"  top {top} kernels by device time (calls, ms):")
    for name, us in t["by_name"].most_common(top):
        print(f"    {t['calls'][name]:5d} {us / 1e3:8.3f}  {name}")


def main(argv: list[str] | None = None) -> int:
    from northcode.torch_backend.decode_step import layer_kind

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--ops", action="store_true", help="also list the kernels by op")
    parser.add_argument("--cuda", action="store_true", help="count real CUDA kernels with torch.profiler instead")
    parser.add_argument("--time", action="store_true",
                        help="on a GPU at North Mini Code's widths: graph ms per step and kernel time by part and name")
    parser.add_argument("--compiled", action="store_true", help="with --time: the torch.compile'd step")
    args = parser.parse_args(argv)
    if args.time:
        print_timing(args.batch, args.context, compiled=args.compiled)
        return 0
    if args.cuda:
        total, by_part = count_cuda_kernels(args.batch, args.context)
        print(f"decode step on CUDA, batch {args.batch}, context {args.context}: {total} kernels")
        for part, n in sorted(by_part.items()):
            print(f"  {part:28s} {n:6d}")
        return 0
    torch.set_num_threads(1)
    counter = count_decode(args.batch, args.context)
    config = structural_config()
    layers = Counter(layer_kind(config, i) for i in range(config.num_hidden_layers))
    by_part = Counter(part for _, part in counter.kernels)
    print(f"decode step, batch {args.batch}, context {args.context}: {len(counter.kernels)} kernels, "
          f"{len(counter.syncs)} host syncs {counter.syncs[:3]}")
    for part, n in sorted(by_part.items()):
        kind = part.removeprefix("layer.")
        per = f"  ({n / layers[kind]:.1f} per layer x {layers[kind]})" if kind in layers else ""
        print(f"  {part:28s} {n:6d}{per}")
    if args.ops:
        for (name, part), n in sorted(Counter(counter.kernels).items(), key=lambda item: item[0][1]):
            print(f"    {part:28s} {name:24s} {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
