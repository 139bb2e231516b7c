"""`northcode bench decode`: decode throughput of the megakernel and the PyTorch path, same run, same weights.

Synthetic North Mini Code weights are drawn on the GPU (random_weights); each (batch, context) cell gets
a paged cache of random K/V (decode_setup.py). Per cell and backend: ms per step (CUDA events over
timed steps after warm-up), tokens/s, GB read per step (weights of the experts actually routed, from the
kernel's per-layer expert counts, plus the KV the rows attend to), and % of speed of light against
4.8 TB/s and against the read bandwidth measured at the start of the run. Writes a table, JSON and a
PNG plot. The torch baseline is the engine's TorchBackend (paged, CUDA graphs)
on a copy of the same pools, falling back to model.py's eager decode if it fails; it is skipped where the
copy would not fit. A torch cell notes what it timed when that is not the compiled, graphed step (northcode's
loggers print at INFO here: compile times, and a failed compile's traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

HELP = "decode throughput: megakernel vs PyTorch, batch x context grid, table + JSON + plot"
DATASHEET_TBPS = 4.8
TORCH_MAX_KV_TOKENS = 8 * 32768  # the baseline's copy of the pools beyond this many tokens does not fit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8], help="batch sizes (1..8)")
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 8192, 32768, 131072],
                        help="tokens already cached per row")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per cell")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--backends", nargs="+", default=["megakernel", "torch"], choices=["megakernel", "torch"])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 8K only, 10 steps")
    parser.add_argument("--profile", action="store_true",
                        help="one extra megakernel step per cell with per-task timestamps: where the time goes")
    parser.add_argument("--out", type=Path, default=Path("bench-decode"), help="folder for JSON and PNG")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("northcode bench decode: needs a CUDA GPU (the megakernel targets sm_90)")
        return 2
    if any(not 1 <= b <= 8 for b in args.batch):
        print(f"--batch {args.batch}: every batch size must be 1..8")
        return 2
    if args.quick:
        args.batch, args.context, args.steps = [1, 8], [8192], 10
    show_northcode_logs()
    from northcode.model.synthetic import preset_config, random_weights

    config = preset_config("north-mini-code")
    start = time.time()
    weights = random_weights(config, device="cuda", dtype=torch.bfloat16, seed=0)
    print(f"weights: {sum(t.numel() for t in weights.values()) * 2 / 1e9:.1f} GB in {time.time() - start:.0f} s")
    bandwidth = measure_bandwidth()
    print(f"bandwidth: read {bandwidth['read_tbps']:.2f} TB/s, copy {bandwidth['copy_tbps']:.2f} TB/s")
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    # every megakernel cell first, the torch baseline (graph captures, slower to set up) last: a run cut
    # short by a time limit keeps the kernel's figures (the JSON is rewritten after every cell)
    for backends in ([b for b in args.backends if b == "megakernel"], [b for b in args.backends if b == "torch"]):
        for context in args.context:
            for batch in args.batch:
                for backend in backends:
                    try:
                        cell = bench_cell(config, weights, backend, batch, context, args.steps, args.warmup, bandwidth,
                                          args.profile, args.out)
                    except torch.OutOfMemoryError:  # the cell's KV cache does not fit next to the weights
                        torch.cuda.empty_cache()
                        print(f"{backend} B={batch} ctx={context}: out of GPU memory, skipped", flush=True)
                        continue
                    if cell is not None:
                        results.append(cell)
                        print(format_row(cell), flush=True)
                        (args.out / "decode_bench.json").write_text(
                            json.dumps(dict(bandwidth=bandwidth, results=results), indent=1))
    add_speedups(results)
    (args.out / "decode_bench.json").write_text(json.dumps(dict(bandwidth=bandwidth, results=results), indent=1))
    plot(results, args.out / "decode_bench.png")
    print(table(results))
    return 0


def show_northcode_logs() -> None:
    """northcode's INFO lines on stderr (compile times, a failed torch.compile's traceback), once per process."""
    logger = logging.getLogger("northcode")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def measure_bandwidth() -> dict:
    """Read bandwidth (a 4 GiB sum) and copy bandwidth (read + write of 2 GiB), median of 5, TB/s."""
    import torch

    data = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)  # 4 GiB
    dst = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    read = median_ms(lambda: data.sum(dtype=torch.float32), 5)
    copy = median_ms(lambda: dst.copy_(data[: 1 << 30]), 5)
    out = dict(read_tbps=data.numel() * 2 / read / 1e9, copy_tbps=2 * dst.numel() * 2 / copy / 1e9)
    del data, dst
    torch.cuda.empty_cache()
    return out


def median_ms(fn, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def bytes_per_step(config, expert_counts: list[int], lengths: list[int]) -> float:
    """Weights read once per step (only the routed experts) plus each row's visible KV, in bytes."""
    c, two = config, 2
    attention = c.num_hidden_layers * ((c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size) * two
    sparse = [i for i in range(c.num_hidden_layers) if not c.is_dense(i)]
    router = len(sparse) * c.num_experts * c.hidden_size * two
    dense = (c.num_hidden_layers - len(sparse)) * 3 * c.hidden_size * c.dense_intermediate_size * two
    experts = sum(expert_counts[i] for i in sparse) * 3 * c.hidden_size * c.intermediate_size * two
    lm_head = c.vocab_size * c.hidden_size * two
    kv = sum(min(length + 1, c.window(i) or length + 1) * c.kv_size * 2 * two
             for i in range(c.num_hidden_layers) for length in lengths)
    return float(attention + router + dense + experts + lm_head + kv)


def bench_cell(config, weights, backend: str, batch: int, context: int, steps: int, warmup: int,
               bandwidth: dict, profile: bool = False, out: Path | None = None) -> dict | None:
    """One (backend, batch, context) cell; with `profile`, the raw per-task record goes to
    out/profile-<backend>-b<batch>-c<context>.pt (lab/profile_report.py reads it)."""
    import torch

    from northcode.bench.decode_setup import paged_cache

    if backend == "torch" and batch * context > TORCH_MAX_KV_TOKENS:
        return None
    lengths = [context] * batch
    cache = paged_cache(config, lengths, steps + warmup + 1, "cuda", seed=batch)  # +1: the profiled step
    breakdown, note = None, None
    if backend == "megakernel":
        ms, counts, breakdown = time_megakernel(config, weights, cache, steps, warmup, profile)
    else:
        ms, counts, note = time_torch(config, weights, cache, steps, warmup)
        if ms is None:
            return None
    del cache
    torch.cuda.empty_cache()
    nbytes = bytes_per_step(config, counts, [context + warmup + steps // 2] * batch)
    if breakdown:
        raw = breakdown.pop("raw", None)
        if raw is not None and out is not None:
            torch.save(raw, out / f"profile-{backend}-b{batch}-c{context}.pt")
        print(f"  profile {backend} B={batch}: span {breakdown['span_us']} us, busy {breakdown['busy_fraction']:.0%}, median layer "
              f"{sorted(breakdown['layer_us'])[len(breakdown['layer_us']) // 2]} us; "
              + ", ".join(f"{k} wait {v['wait_us']} busy {v['busy_us']}" for k, v in breakdown["by_type"].items()))
        for layer, line in breakdown.get("timelines", {}).items():
            print(f"  timeline {backend} B={batch} layer {layer}: {line}")
    return dict(backend=backend, batch=batch, context=context, ms_per_step=ms, tokens_per_s=batch * 1000 / ms, profile=breakdown, note=note,
                gb_per_step=nbytes / 1e9, experts_per_layer=sum(counts) / max(1, sum(1 for c in counts if c)),
                sol_datasheet=nbytes / (DATASHEET_TBPS * 1e12) * 1e3 / ms,
                sol_measured=nbytes / (bandwidth["read_tbps"] * 1e12) * 1e3 / ms)


def time_megakernel(config, weights, cache, steps: int, warmup: int,
                    profile: bool = False) -> tuple[float, list[int], dict | None]:
    import torch

    from northcode.megakernel.kernel import Megakernel, RowSpec

    kernel = Megakernel(config, weights, cache.k_pool, cache.v_pool, cache.block_tables, timeout_s=5.0)
    tokens = torch.arange(len(cache.lengths), dtype=torch.int32) + 1000
    rows = lambda step: [RowSpec(position=n + step, seq=b) for b, n in enumerate(cache.lengths)]  # noqa: E731
    for step in range(warmup):
        kernel.step(rows(step), tokens if step == 0 else None)
    kernel.check()
    schedules = [kernel.schedule(len(cache.lengths), max(r.position for r in rows(s))) for s in range(warmup, warmup + steps)]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for step in range(warmup, warmup + steps):
        kernel.set_rows(rows(step))
        kernel.launch(schedules[step - warmup], len(cache.lengths))
    end.record()
    end.synchronize()
    kernel.check()
    counts = kernel.expert_counts.tolist()
    breakdown = kernel.profile_step(rows(warmup + steps)) if profile else None
    return begin.elapsed_time(end) / steps, counts, breakdown


def time_torch(config, weights, cache, steps: int, warmup: int) -> tuple[float | None, list[int], str | None]:
    """The engine's TorchBackend (paged, CUDA graphs, grouped-GEMM MoE) -> (ms per step, expert counts, note).

    The note says what was timed when it is not the backend's best step (torch_backend_notes: a compile that
    failed, a capture that failed); if the backend fails outright, model.py's eager decode is timed instead (after the
    failed backend is gone, so nothing of it leaks into that measurement); ms is None if that fails too."""
    import gc

    import torch

    note = None
    try:
        ms, notes = time_torch_backend(config, weights, cache, steps, warmup)
        note = "; ".join(notes) or None
    except Exception as err:  # a baseline problem must not lose the megakernel's figures
        first_line = (str(err).strip().splitlines() or [""])[0]
        note = f"model.py eager; torch backend failed: {type(err).__name__}: {first_line}"
        ms = None
    if ms is None:
        print(f"torch B={len(cache.lengths)}: {note}", flush=True)
        gc.collect()  # the failed backend (its graphs, pools) goes before anything else runs
        torch.cuda.empty_cache()
        try:
            ms = time_model_eager(config, weights, cache, steps, warmup)
        except Exception as err:
            print(f"torch B={len(cache.lengths)}: model.py eager failed too ({type(err).__name__}: {err}); no figure",
                  flush=True)
            ms = None
    elif note:
        print(f"torch B={len(cache.lengths)}: {note}", flush=True)
    expected = expected_distinct_experts(config, len(cache.lengths))
    return ms, [0 if config.is_dense(i) else expected for i in range(config.num_hidden_layers)], note


def time_torch_backend(config, weights, cache, steps: int, warmup: int) -> tuple[float, list[str]]:
    """ms per decode step, and what the backend ran instead of its best step (torch_backend_notes). The backend
    is freed before returning (gc: it lives in reference cycles), so its graphs go before the next capture."""
    import gc

    import torch

    from northcode.bench.decode_setup import PAGE_SIZE
    from northcode.engine.backend import DecodeBatch
    from northcode.torch_backend.backend import TorchBackend
    from northcode.torch_backend.compiled_step import compiled_pool_pages

    batch, pages, limit = len(cache.lengths), cache.k_pool.shape[0], compiled_pool_pages(config, PAGE_SIZE)
    too_big = pages > limit  # its compile would fail (32-bit offsets): don't try
    backend = TorchBackend(config, weights, pages, PAGE_SIZE, batch, cache.block_tables.shape[2],
                           compile=False if too_big else None)
    backend.k_pool[:-1].copy_(cache.k_pool)
    backend.v_pool[:-1].copy_(cache.v_pool)
    tables = cache.block_tables.cpu()
    decode = lambda step: backend.decode(DecodeBatch(  # noqa: E731
        list(range(batch)), [1000 + b for b in range(batch)], [n + step for n in cache.lengths], [], sample=False,
        return_logits=True, block_tables=tables, tables_version=0))
    for step in range(warmup):
        decode(step)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for step in range(warmup, warmup + steps):
        decode(step)
    end.record()
    end.synchronize()
    notes = torch_backend_notes(backend.compile_failure, backend.capture_failures)
    if too_big:
        notes.insert(0, f"eager step: {pages} pool pages, over the compiled step's {limit}")
    del backend, decode
    gc.collect()
    torch.cuda.empty_cache()
    return begin.elapsed_time(end) / steps, notes


def torch_backend_notes(compile_failure: str | None, capture_failures: dict[tuple[int, int], str]) -> list[str]:
    """What a TorchBackend timed other than its best step: a torch.compile that failed (the eager step was
    graphed instead: a slower baseline, so a larger speed-up), buckets whose graph capture failed (run eagerly)."""
    notes = []
    if compile_failure:
        notes.append(f"eager step, torch.compile failed: {compile_failure}")
    notes += [f"eager, capture failed: batch {b}, {p} pages: {why}" for (b, p), why in capture_failures.items()]
    return notes


def time_model_eager(config, weights, cache, steps: int, warmup: int) -> float:
    """model.py's eager decode, the whole batch at once over a contiguous cache of the same length."""
    import torch

    from northcode.model.model import NorthModel

    model = NorthModel(config, weights)
    batch, length = len(cache.lengths), cache.lengths[0]
    kv = model.new_cache(batch)
    shape = (batch, length + steps + warmup, config.num_key_value_heads, config.head_dim)
    for layer in range(config.num_hidden_layers):
        kv.keys[layer] = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        kv.values[layer] = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    kv.seq_len = length
    tokens = list(range(1000, 1000 + batch))
    for _ in range(warmup):
        model.decode(tokens, kv)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        model.decode(tokens, kv)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def expected_distinct_experts(config, batch: int) -> int:
    """Distinct experts of `batch` independent uniform top-k draws (for the torch rows' byte count)."""
    e, k = config.num_experts, config.num_experts_per_tok
    return round(e * (1 - (1 - k / e) ** batch))


def add_speedups(results: list[dict]) -> None:
    torch_ms = {(r["batch"], r["context"]): r["ms_per_step"] for r in results if r["backend"] == "torch"}
    for r in results:
        base = torch_ms.get((r["batch"], r["context"]))
        r["speedup_vs_torch"] = base / r["ms_per_step"] if base and r["backend"] == "megakernel" else None


def format_row(r: dict) -> str:
    speedup = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else "-"
    note = f"  ({r['note']})" if r.get("note") else ""
    return (f"{r['backend']:>10} B={r['batch']} ctx={r['context']:>6} {r['ms_per_step']:8.3f} ms "
            f"{r['tokens_per_s']:8.1f} tok/s {r['gb_per_step']:6.2f} GB  SoL {100 * r['sol_datasheet']:5.1f}% "
            f"(4.8) {100 * r['sol_measured']:5.1f}% (measured)  {speedup}{note}")


def table(results: list[dict]) -> str:
    head = "| backend | batch | context | ms/step | tok/s | GB/step | experts/layer | % SoL 4.8 TB/s | % SoL measured | vs torch |"
    lines = [head, "|" + "---|" * 10]
    for r in results:
        speedup = f"{r['speedup_vs_torch']:.2f}x" if r.get("speedup_vs_torch") else "-"
        lines.append(f"| {r['backend']} | {r['batch']} | {r['context']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.1f} "
                     f"| {r['gb_per_step']:.2f} | {r['experts_per_layer']:.1f} | {100 * r['sol_datasheet']:.1f} "
                     f"| {100 * r['sol_measured']:.1f} | {speedup} |")
    notes = [f"{r['backend']} B={r['batch']} ctx={r['context']}: {r['note']}" for r in results if r.get("note")]
    return "\n".join(lines + notes)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return
    contexts = sorted({r["context"] for r in results})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4 * len(contexts), 3.5), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for backend in ("megakernel", "torch"):
            cells = sorted((r["batch"], r["tokens_per_s"]) for r in results if r["backend"] == backend and r["context"] == context)
            if cells:
                ax.plot(*zip(*cells), marker="o", label=backend)
        ax.set_title(f"context {context}")
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:  # `python -m northcode.bench.decode_bench` on a machine without the CLI installed
    parser = argparse.ArgumentParser(description=HELP)
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
