"""The prefill's routed experts alone, by part (`python lab/moe_prefill_bench.py`, a GPU; `--tiny` on the CPU).

One sparse layer of North Mini Code (its preset: hidden 2048, expert intermediate 768, 128 experts, top 8),
random weights in the backend's layout (gate_up [E, 2I, H], down [E, H, I]) and random routing (router logits
drawn at random, the product's top-k), for chunks of T tokens. It times, median of --repeats (CUDA events):
  today        routed_experts.grouped_experts: the prefill's whole routed MLP after the router (what
               paged_prefill.py runs per sparse layer: backend.prefill_moe_path "grouped")
  sort         its pair bookkeeping: the N*k (token, expert) pairs sorted by expert, searchsorted for group ends
  gather       h[order // k]: the copy of the hidden states in pair order ([N*k, H]; a fused gather would not
               write it)
  grouped-mm   the two grouped GEMMs (F.grouped_mm, else torch._grouped_mm: (mat_a, mat_b, *, offs int32 group
               ends, bias, out_dtype)) and SwiGLU between them, over the sorted pairs, weights in place
  ...-gemms    the two grouped GEMMs alone (SwiGLU's output made once, outside the time)
  ...-rowB     the same two GEMMs with the weights copied once to row-major [E, K, N] (is the transposed view slower?)
  unsort       index_copy back to (token, slot) order
  combine      add_weighted: x += sum_j w[:, j] * out[:, j] (products, an fp32 sum, one add)
  scatter-add  the alternative combine: sorted outputs times their weights, index_add_ into x (no unsort; atomics,
               another rounding order): whether it beats unsort + combine
  dense-mm     the ceiling: the same two products as plain bf16 GEMMs of M = N*k rows through one expert's shapes
               ([M, H] x [H, 2I], then [M, I] x [I, H]): the same FLOPs, no grouping
TFLOP/s for the GEMM rows counts 6 * N*k * H * I (2 per multiply-add), and the last columns give each GEMM row's
share of dense-mm's rate, and the time floor: the larger of those FLOPs at dense-mm's rate and the 128 experts' 1.2
GB (every expert is chosen at T >= 2048) at the read bandwidth of perf_anchors.md (4.63 TB/s).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

READ_TBPS = 4.63  # H200, one streaming read kernel (perf_anchors.md 1c)
TINY = dict(hidden_size=64, intermediate_size=32, num_experts=8, num_experts_per_tok=2)  # the CPU's sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 16384], help="chunk sizes T")
    parser.add_argument("--repeats", type=int, default=10, help="calls timed per part (median)")
    parser.add_argument("--tiny", action="store_true", help="tiny geometry in fp32 (the CPU); default on a CPU")


def geometry(tiny: bool) -> dict:
    """hidden_size, intermediate_size (per expert), num_experts, num_experts_per_tok."""
    if tiny:
        return dict(TINY)
    from northcode.model.synthetic import preset_config

    config = preset_config("north-mini-code")
    return {name: getattr(config, name) for name in TINY}


def moe_flops(num_tokens: int, geo: dict) -> int:
    """Multiply-adds x 2 of the routed experts of num_tokens: gate_up [2I, H] and down [H, I] per (token, expert)."""
    pairs = num_tokens * geo["num_experts_per_tok"]
    return 6 * pairs * geo["hidden_size"] * geo["intermediate_size"]


def expert_bytes(geo: dict, dtype: torch.dtype) -> int:
    """Every expert's gate_up and down, once."""
    return 3 * geo["num_experts"] * geo["hidden_size"] * geo["intermediate_size"] * dtype.itemsize


def layer_case(num_tokens: int, geo: dict, device, dtype, seed: int = 0) -> dict:
    """Random h, x [T, H], weights, routing (route_logits on random logits: the product's top-k and North Mini
    Code's rule, sigmoid without renormalisation)."""
    from northcode.torch_backend.routed_experts import route_logits

    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)  # noqa
    hidden, inter, experts = geo["hidden_size"], geo["intermediate_size"], geo["num_experts"]
    rule = SimpleNamespace(num_experts_per_tok=geo["num_experts_per_tok"], expert_selection_fn="sigmoid",
                           norm_topk_prob=False)
    weights, expert_ids = route_logits(randn(num_tokens, experts), rule)
    return dict(h=randn(num_tokens, hidden), x=randn(num_tokens, hidden),
                gate_up=randn(experts, 2 * inter, hidden, scale=hidden ** -0.5),
                down=randn(experts, hidden, inter, scale=inter ** -0.5), weights=weights, expert_ids=expert_ids,
                expert_range=torch.arange(experts, device=device))


# --- the parts, each a function of the case (and what the parts before it made) ---

def sort_pairs(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [N*k] pairs by expert, offsets int32 [E] group ends): grouped_pair_outputs' first two kernels."""
    sorted_ids, order = case["expert_ids"].flatten().sort(stable=True)
    return order, torch.searchsorted(sorted_ids, case["expert_range"], right=True, out_int32=True)


def gather_tokens(case: dict, order: torch.Tensor) -> torch.Tensor:
    return case["h"][order // case["expert_ids"].shape[1]]  # [N*k, H]


def grouped_swiglu(tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor,
                   transposed: bool = True) -> torch.Tensor:
    """[N*k, H] sorted pairs -> [N*k, H]. transposed: weights in the backend's layout ([E, N, K], read through a
    transposed view); else already [E, K, N] row-major."""
    from northcode.torch_backend.routed_experts import _grouped_mm

    first, second = (gate_up.transpose(1, 2), down.transpose(1, 2)) if transposed else (gate_up, down)
    gate, up = _grouped_mm(tokens, first, offs=offsets).chunk(2, dim=-1)
    return _grouped_mm(F.silu(gate) * up, second, offs=offsets)


def two_grouped_gemms(tokens, act, first, second, offsets) -> torch.Tensor:
    from northcode.torch_backend.routed_experts import _grouped_mm

    _grouped_mm(tokens, first, offs=offsets)
    return _grouped_mm(act, second, offs=offsets)


def unsort(expert_out: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return torch.empty_like(expert_out).index_copy_(0, order, expert_out).view(-1, k, expert_out.shape[-1])


def scatter_add(x: torch.Tensor, expert_out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, H] += each sorted pair's output times its weight, added at its token (index_add_)."""
    k = weights.shape[1]
    return x.index_add_(0, order // k, expert_out * weights.flatten()[order][:, None])


def dense_two_mm(tokens: torch.Tensor, act: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The ceiling: [M, H] x one expert's [H, 2I], [M, I] x its [I, H] as plain GEMMs."""
    F.linear(tokens, gate_up[0])
    return F.linear(act, down[0])


def parts(case: dict) -> dict[str, tuple[Callable, tuple, bool]]:
    """name -> (function, its arguments, whether its FLOPs are the layer's GEMMs), the arguments made once."""
    from northcode.torch_backend.routed_experts import add_weighted, grouped_experts

    k = case["expert_ids"].shape[1]
    order, offsets = sort_pairs(case)
    tokens = gather_tokens(case, order)
    gate_up, down = case["gate_up"], case["down"]
    expert_out = grouped_swiglu(tokens, gate_up, down, offsets)
    act = torch.empty(tokens.shape[0], down.shape[2], device=tokens.device, dtype=tokens.dtype).normal_()
    first_row, second_row = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    pair_out = unsort(expert_out, order, k)
    x = case["x"]
    return {
        "today": (grouped_experts, (x.clone(), case["h"], gate_up, down, case["expert_ids"], case["weights"],
                                    case["expert_range"]), True),
        "sort": (sort_pairs, (case,), False),
        "gather": (gather_tokens, (case, order), False),
        "grouped-mm": (grouped_swiglu, (tokens, gate_up, down, offsets), True),
        "grouped-mm-gemms": (two_grouped_gemms, (tokens, act, gate_up.transpose(1, 2), down.transpose(1, 2), offsets),
                             True),
        "grouped-mm-rowB": (two_grouped_gemms, (tokens, act, first_row, second_row, offsets), True),
        "unsort": (unsort, (expert_out, order, k), False),
        "combine": (add_weighted, (x.clone(), pair_out, case["weights"]), False),
        "scatter-add": (scatter_add, (x.clone(), expert_out, order, case["weights"]), False),
        "dense-mm": (dense_two_mm, (tokens, act, gate_up, down), True),
    }


def timed(fn: Callable, args: tuple, repeats: int) -> float:
    """Median seconds of fn(*args), after one untimed call (CUDA events on a GPU)."""
    fn(*args)
    times = []
    on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) or torch.cuda.is_available()
    for _ in range(repeats):
        if on_gpu:
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


def measure(tokens: list[int], geo: dict, device, dtype, repeats: int,
            report: Callable[[dict], None] | None = None) -> list[dict]:
    """One row per (T, part): ms, TFLOP/s for GEMM rows, share of dense-mm's rate; one "floor" row per T.
    report: called with each T's rows as they are done."""
    rows = []
    for num_tokens in tokens:
        first = len(rows)
        case = layer_case(num_tokens, geo, device, dtype)
        flops = moe_flops(num_tokens, geo)
        cells = {}
        for name, (fn, args, gemm) in parts(case).items():
            try:
                cells[name] = (1e3 * timed(fn, args, repeats), gemm, "")
            except RuntimeError as err:  # a grouped GEMM this device or dtype does not take
                cells[name] = (None, gemm, str(err).splitlines()[0][:70])
        ceiling_ms = cells["dense-mm"][0]
        for name, (ms, gemm, note) in cells.items():
            tflops = flops / (ms * 1e-3) / 1e12 if gemm and ms else None
            share = ceiling_ms / ms if gemm and ms and ceiling_ms else None
            rows.append(dict(tokens=num_tokens, part=name, ms=ms, tflops=tflops, of_ceiling=share, note=note))
        permutations = [cells[p][0] for p in ("sort", "gather", "unsort", "combine")]
        if None not in permutations:
            rows.append(dict(tokens=num_tokens, part="permutations", ms=sum(permutations), tflops=None,
                             of_ceiling=None, note="sort + gather + unsort + combine"))
        bytes_ms = 1e3 * expert_bytes(geo, dtype) / (READ_TBPS * 1e12)
        floor_ms = max(ceiling_ms or 0.0, bytes_ms)
        note = f"max(dense-mm, experts' bytes at {READ_TBPS} TB/s = {bytes_ms:.3f} ms)"
        rows.append(dict(tokens=num_tokens, part="floor", ms=floor_ms, tflops=flops / (floor_ms * 1e-3) / 1e12,
                         of_ceiling=None, note=note))
        for row in rows[first:] if report is not None else ():
            report(row)
    return rows


HEADER = f"{'T':>6}  {'part':<18}{'ms':>9}{'TFLOP/s':>9}{'of dense':>9}  note"


def format_row(r: dict) -> str:
    num = lambda x, f: format(x, f) if x is not None else "-"  # noqa: E731
    return (f"{r['tokens']:>6}  {r['part']:<18}{num(r['ms'], '.3f'):>9}{num(r['tflops'], '.0f'):>9}"
            f"{num(r['of_ceiling'], '.0%'):>9}  {r['note']}")


def format_rows(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python lab/moe_prefill_bench.py", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens) or args.repeats < 1:
        parser.error("--tokens and --repeats must be positive")
    on_gpu = torch.cuda.is_available()
    tiny = args.tiny or not on_gpu
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    geo = geometry(tiny)
    tokens = args.tokens if not tiny or args.tokens != [2048, 8192, 16384] else [16, 64]
    print(f"experts {geo['num_experts']} x (H {geo['hidden_size']}, I {geo['intermediate_size']}), top "
          f"{geo['num_experts_per_tok']}, {dtype}, {device}; experts' bytes {expert_bytes(geo, dtype) / 1e9:.2f} GB")
    print(HEADER, flush=True)
    measure(tokens, geo, device, dtype, args.repeats, report=lambda row: print(format_row(row), flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
