"""Whole decode steps of the megakernel, teacher-forced, against the decode oracle (decode_oracle.py): the
checks the GPU tests assert, and the per-layer diagnostic (`python -m northcode.bench.decode_check`).

Every step, for every row: the kernel runs the step (tracing the residual each layer reads and each
layer's router logits); an fp32 path and the bf16 torch path then run the same step following the
kernel's experts at every sparse layer; the new K/V of the fp32 path (rounded to bf16) replace what
the kernel appended, so every step starts all three from the same state; the next tokens are fp32's
argmax. Checks (the kernel must be as accurate as the bf16 torch path, up to ERR_FACTOR):
  logits   rel. error vs fp32 <= ERR_FACTOR x torch's + ERR_FLOOR; 1 - cosine <= max(1 - COSINE_MIN,
           ERR_FACTOR x torch's); max |diff| <= max(MAX_ABS, ERR_FACTOR x torch's); the same argmax as
           fp32 wherever fp32's top-2 gap exceeds twice that bound; greedy sampling = argmax.
  residual per layer, rel. error vs fp32 <= ERR_FACTOR x torch's + RESID_FLOOR (first_jump names the layer).
  routing  router logits: max |diff| vs fp32 <= ERR_FACTOR x torch's + ROUTER_ERR_FLOOR; the kernel's
           experts are the top-k of its own logits (a swap margin within twice its logit error); and it
           picks fp32's own experts wherever fp32's k-th/(k+1)-th gap exceeds what those errors allow.
Figures (how often and at what gap the kernel's and torch's experts differ from fp32's) are reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys

import torch

from northcode.config import env_report_path

ERR_FACTOR = 2.0  # the kernel may be this many times farther from fp32 than the bf16 torch path is ...
ERR_FLOOR = 2e-3  # ... plus this (relative error of the logits: a few bf16 roundings)
RESID_FLOOR = 1e-3  # relative error of a residual
COSINE_MIN = 0.999
MAX_ABS = 0.35  # logits have std ~3 (synthetic.LOGIT_STD)
ROUTER_GAP_TOL = 0.05  # router gaps below this are near-ties whatever the errors
ROUTER_ERR_FLOOR = 0.02  # router logits are bf16: ~2 roundings at |z| in [2, 4)


def preset_config(preset: str, layers: int | None = None):
    """The preset's config (tiny with a vocabulary of 1003, not a multiple of 32); `layers` keeps only the
    first layers (the same per-layer shapes, so the same kernel build, and the same weights by name)."""
    from northcode.model.synthetic import preset_config as base

    config = base(preset, 1003 if preset == "tiny" else None)
    if layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=layers, layer_types=None, mlp_layer_types=None)
    return config


@functools.lru_cache(maxsize=3)  # tiny, 5 layers and 49 layers of North Mini Code: ~80 GB with fp32 casts
def model(preset: str, layers: int | None = None, device: str = "cuda"):
    """(config, bf16 weights on `device`, fp32 oracle, bf16 oracle) of a preset, random weights seed 0."""
    from northcode.bench.decode_oracle import Oracle
    from northcode.model.synthetic import random_weights

    config = preset_config(preset, layers)
    weights = random_weights(config, device=device, dtype=torch.bfloat16, seed=0)
    return config, weights, Oracle(config, weights, torch.float32), Oracle(config, weights, torch.bfloat16)


def teacher_forced(preset: str, lengths: list[int], steps: int, layers: int | None = None, seed: int | None = None,
                   timeout_s: float = 5.0, device: str = "cuda") -> dict:
    """Run the checks; return figures (with "failures": the checks that did not hold, as strings)."""
    from northcode.bench.decode_oracle import compare_routing, first_jump, residual_errors
    from northcode.bench.decode_setup import paged_cache, row_history, write_kv
    from northcode.megakernel.kernel import Megakernel, RowSpec

    config, weights, exact, bf16 = model(preset, layers, device)
    batch, L = len(lengths), config.num_hidden_layers
    cache = paged_cache(config, lengths, steps, device, seed=len(lengths) if seed is None else seed)
    kernel = Megakernel(config, weights, cache.k_pool, cache.v_pool, cache.block_tables, timeout_s=timeout_s)
    kernel.enable_trace()
    history = [row_history(config, cache, b, steps) for b in range(batch)]
    tokens = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(1)).tolist()
    failures: list[str] = []
    logit_rows, layer_rows, routing_rows = [], [], []
    argmax_clear = argmax_agree = 0
    for step in range(steps):
        kernel.step([RowSpec(position=n + step, seq=b) for b, n in enumerate(lengths)], torch.tensor(tokens))
        kernel.check()
        got_logits = kernel.logits[:batch].clone()
        routed = kernel.routed[:, :batch].cpu()
        trace_x, trace_router = kernel.trace_x[:, :batch].clone(), kernel.trace_router[:, :batch].clone()
        if kernel.tokens[:batch].tolist() != got_logits.argmax(-1).tolist():
            failures.append(f"step {step}: greedy sampling is not the argmax of the kernel's logits")
        next_tokens = []
        positions, follow = [n + step for n in lengths], routed.permute(1, 0, 2)  # follow: [batch, L, k]
        exact_rows = exact.steps(tokens, positions, history, follow=follow)  # every row at once (Oracle.steps)
        bf16_rows = bf16.steps(tokens, positions, history, follow=follow)
        for b in range(batch):
            pos, where = positions[b], f"step {step} row {b}"
            keys, values = history[b]
            ex, bt = exact_rows[b], bf16_rows[b]
            record, clear, agree = check_logits(where, got_logits[b], ex, bt, failures)
            logit_rows.append(dict(step=step, row=b, **record))
            argmax_clear, argmax_agree = argmax_clear + clear, argmax_agree + agree
            per_layer = residual_errors(trace_x[:, b], ex, bt)
            layer_rows.append(per_layer)
            jump = first_jump(per_layer, ERR_FACTOR, RESID_FLOOR)
            if jump is not None:
                row = per_layer[jump]
                failures.append(f"{where}: residual of layer {jump}: rel. error {row['kernel']:.2e} "
                                f"vs torch bf16's {row['torch']:.2e}")
            for r in compare_routing(config, routed[:, b], trace_router[:, b], ex, bt):
                r.update(step=step, row=b)
                routing_rows.append(r)
                check_routing(f"{where} layer {r['layer']}", r, failures)
            write_kv(cache, b, pos, ex.keys, ex.values)
            for layer in range(L):
                keys[layer][pos], values[layer][pos] = ex.keys[layer], ex.values[layer]
            next_tokens.append(int(ex.logits.argmax()))
        tokens = next_tokens
    return summarize(preset, layers, lengths, steps, logit_rows, layer_rows, routing_rows, argmax_agree,
                     argmax_clear, failures)


def check_logits(where: str, got: torch.Tensor, ex, bt, failures: list[str]) -> tuple[dict, int, int]:
    """The logit checks of one row and step: (errors of kernel and torch vs fp32, argmax gap clear, same argmax)."""
    from northcode.bench.decode_oracle import logit_errors

    e_k, e_t = logit_errors(got, ex.logits), logit_errors(bt.logits, ex.logits)
    e_k["vs_torch_one_minus_cos"] = logit_errors(got, bt.logits)["one_minus_cos"]
    abs_bound = max(MAX_ABS, ERR_FACTOR * e_t["max_abs"])
    if e_k["rel"] > ERR_FACTOR * e_t["rel"] + ERR_FLOOR:
        failures.append(f"{where}: logits rel. error {e_k['rel']:.2e} vs torch bf16's {e_t['rel']:.2e}")
    if e_k["one_minus_cos"] > max(1 - COSINE_MIN, ERR_FACTOR * e_t["one_minus_cos"]):
        failures.append(f"{where}: cosine {1 - e_k['one_minus_cos']:.5f} (torch bf16 {1 - e_t['one_minus_cos']:.5f})")
    if e_k["max_abs"] > abs_bound:
        failures.append(f"{where}: max |diff| {e_k['max_abs']:.3f} > {abs_bound:.3f}")
    top2 = ex.logits.topk(2).values
    gap, same = float(top2[0] - top2[1]), int(got.argmax()) == int(ex.logits.argmax())
    clear = gap > 2 * abs_bound
    if clear and not same:
        failures.append(f"{where}: argmax differs where fp32's top-2 gap is {gap:.3f}")
    return dict(kernel=e_k, torch=e_t), int(clear), int(same)


def check_routing(where: str, r: dict, failures: list[str]) -> None:
    """The routing checks of one sparse layer (a compare_routing record)."""
    err_bound = ERR_FACTOR * r["torch_router_err"] + ROUTER_ERR_FLOOR
    allow = max(ROUTER_GAP_TOL, 2 * err_bound)
    if r["kernel_router_err"] > err_bound:
        failures.append(f"{where}: router logits off by {r['kernel_router_err']:.3f} "
                        f"(torch bf16 {r['torch_router_err']:.3f})")
    if r["kernel_margin"] > 2 * r["kernel_router_err"] + 1e-6:
        failures.append(f"{where}: the experts are not the top-k of the kernel's own logits "
                        f"(swap margin {r['kernel_margin']:.3f})")
    if r["kernel_margin"] > 0 and r["gap"] > allow:
        failures.append(f"{where}: experts differ from fp32's where its gap {r['gap']:.3f} > {allow:.3f} "
                        f"(swap margin {r['kernel_margin']:.3f})")


def summarize(preset, layers, lengths, steps, logit_rows, layer_rows, routing_rows, argmax_agree, argmax_clear,
              failures) -> dict:
    def worst(path: str, key: str) -> float:
        return max(r[path][key] for r in logit_rows)

    ratios = [r["kernel"]["rel"] / max(r["torch"]["rel"], 1e-12) for r in logit_rows]
    n_layers = len(layer_rows[0])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    per_layer = [dict(layer=l, kernel=mean([rows[l]["kernel"] for rows in layer_rows]),
                      torch=mean([rows[l]["torch"] for rows in layer_rows])) for l in range(n_layers)]
    by_layer: dict[int, list] = {}
    for r in routing_rows:
        by_layer.setdefault(r["layer"], []).append(r)
    for row in per_layer:
        rs = by_layer.get(row["layer"], [])
        if rs:
            row.update(kernel_router=mean([r["kernel_router_err"] for r in rs]),
                       torch_router=mean([r["torch_router_err"] for r in rs]),
                       kernel_swaps=sum(r["kernel_margin"] > 0 for r in rs),
                       torch_swaps=sum(r["torch_margin"] > 0 for r in rs))
    jumps = [first_jump_row(rows) for rows in layer_rows]
    ratios_by_layer = [(row["kernel"] / row["torch"], row["layer"]) for row in per_layer if row["torch"] > 0]
    worst_ratio = max(ratios_by_layer, default=(0.0, None))
    k_swaps = [r for r in routing_rows if r["kernel_margin"] > 0]
    t_swaps = [r for r in routing_rows if r["torch_margin"] > 0]
    return dict(
        test="teacher_forced", preset=preset, layers=layers, lengths=lengths, steps=steps,
        kernel_rel_err_max=round(worst("kernel", "rel"), 5), torch_rel_err_max=round(worst("torch", "rel"), 5),
        rel_err_ratio_max=round(max(ratios), 3), rel_err_ratio_median=round(sorted(ratios)[len(ratios) // 2], 3),
        kernel_min_cosine=round(1 - worst("kernel", "one_minus_cos"), 6),
        torch_min_cosine=round(1 - worst("torch", "one_minus_cos"), 6),
        kernel_vs_torch_min_cosine=round(1 - worst("kernel", "vs_torch_one_minus_cos"), 6),
        kernel_max_abs=round(worst("kernel", "max_abs"), 4), torch_max_abs=round(worst("torch", "max_abs"), 4),
        argmax_agree=argmax_agree, argmax_total=len(logit_rows), argmax_clear_gaps=argmax_clear,
        routing_decisions=len(routing_rows),
        kernel_expert_swaps=len(k_swaps), kernel_swap_gap_max=round(max((r["gap"] for r in k_swaps), default=0.0), 4),
        kernel_swap_margin_max=round(max((r["kernel_margin"] for r in k_swaps), default=0.0), 4),
        torch_expert_swaps=len(t_swaps), torch_swap_gap_max=round(max((r["gap"] for r in t_swaps), default=0.0), 4),
        torch_swap_margin_max=round(max((r["torch_margin"] for r in t_swaps), default=0.0), 4),
        swap_gap_buckets=dict(bounds=list(GAP_BUCKETS), kernel=gap_histogram(k_swaps), torch=gap_histogram(t_swaps),
                              all=gap_histogram(routing_rows)),
        resid_ratio_max=round(worst_ratio[0], 3), resid_ratio_max_layer=worst_ratio[1],
        first_jump_layer=min((j for j in jumps if j is not None), default=None),
        per_layer=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()} for row in per_layer],
        failures=failures)


GAP_BUCKETS = (0.01, 0.05, 0.1, 0.2)  # upper bounds of fp32 top-k gap buckets (the last bucket: above 0.2)


def gap_histogram(rows: list[dict]) -> list[int]:
    """How many routing decisions fall in each fp32 gap bucket (GAP_BUCKETS, then the rest)."""
    counts = [0] * (len(GAP_BUCKETS) + 1)
    for r in rows:
        counts[sum(r["gap"] > bound for bound in GAP_BUCKETS)] += 1
    return counts


def first_jump_row(rows: list[dict]) -> int | None:
    from northcode.bench.decode_oracle import first_jump

    return first_jump(rows, ERR_FACTOR, RESID_FLOOR)


def report(record: dict, path: str | None = None) -> None:
    """Print a figure line (per-layer rows and failures shortened) and append the whole record to $NC_REPORT."""
    short = {k: v for k, v in record.items() if k not in ("per_layer", "failures")}
    short["failures"] = len(record.get("failures", []))
    print(json.dumps(short))
    path = path or env_report_path()
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def print_layers(record: dict, out=sys.stdout) -> None:
    """The per-layer diagnostic table: where the kernel's error departs from the bf16 torch path's."""
    print(f"{'layer':>5} {'resid kernel':>12} {'resid torch':>11} {'ratio':>6} {'router k':>8} {'router t':>8} "
          f"{'swaps k':>7} {'swaps t':>7}", file=out)
    for row in record["per_layer"]:
        ratio = row["kernel"] / row["torch"] if row["torch"] > 0 else (math.inf if row["kernel"] > 0 else 1.0)
        extra = (f" {row['kernel_router']:8.4f} {row['torch_router']:8.4f} {row['kernel_swaps']:7d} "
                 f"{row['torch_swaps']:7d}") if "kernel_router" in row else ""
        print(f"{row['layer']:5d} {row['kernel']:12.5f} {row['torch']:11.5f} {ratio:6.2f}{extra}", file=out)
    print(f"first layer where the kernel's residual error exceeds {ERR_FACTOR} x torch bf16's + {RESID_FLOOR}: "
          f"{record['first_jump_layer']}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m northcode.bench.decode_check",
                                     description="Per-layer diagnostic of the megakernel's whole decode step "
                                                 "against fp32 and bf16 torch paths that follow its routing.")
    parser.add_argument("--preset", default="north-mini-code", choices=("tiny", "north-mini-code"))
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--lengths", default="4090", help="comma-separated cached tokens per row (batch = count)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", default=None, help="append the full record (JSON line) to this file")
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {args.lengths!r}: expected comma-separated integers")
    if not 1 <= len(lengths) <= 8 or min(lengths) < 1:
        parser.error(f"--lengths {args.lengths!r}: 1 to 8 rows of at least one token")
    if not torch.cuda.is_available():
        print("decode_check: needs a CUDA GPU (the megakernel runs on sm_90)", file=sys.stderr)
        return 2
    record = teacher_forced(args.preset, lengths, args.steps, args.layers)
    print_layers(record)
    report(record, args.json)
    for failure in record["failures"][:20]:
        print("FAIL", failure)
    return 1 if record["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
