"""The routed experts of a sparse layer in few kernels and no host sync: prefill and decode.

model.run_experts loops over the chosen experts in Python (one host sync a call and ~6 kernels per expert);
here a whole batch of (token, expert) pairs goes through in a fixed number of kernels, so the step can
be captured in a CUDA graph. Two ways, both exact up to fp32 rounding against model.run_experts (the
experts of a token are summed in top-k order instead of ascending id order):

- grouped (`grouped_experts`): sort the N*k pairs by expert, searchsorted for the group ends, two
  grouped GEMMs (F.grouped_mm) over the expert weights in place, unsort, combine: 9 kernels after the
  top-k at N = 1, 11 at N > 1. Reads each *distinct* chosen expert once: the default for bf16 on a GPU
  (CUDA's grouped GEMM takes bf16 only) and on the CPU.
- gathered (`gathered_experts`): index_select the N*k chosen experts' weights into [N*k, 2I, H] and
  [N*k, H, I], then plain batched GEMVs: 7 kernels at N = 1, but three times the bytes of the experts at
  batch 1 (the copy is written and read again) and a copy per (token, expert) pair at batch 8: used for
  fp32/fp16 on a GPU and in the compiled step's GEMV buckets (compiled_step.py). At N > 1 its two
  GEMMs are batched with one output column, the kind of cuBLAS call that failed in capture (below).
- loop (model.run_experts, host syncs): the prefill of fp32/fp16 models on a GPU.

Both end with the combine `x += sum_j weights[:, j] * expert_out[:, j]` in place on the residual stream
(`add_weighted`), so the caller passes its residual x [N, H] and gets it back updated. For N > 1 the
combine is elementwise (products, an fp32 sum over the k, one add: two kernels more than a GEMM): the
baddbmm of batch N with one output column it replaces failed inside CUDA-graph capture at batch 8 on
the H200 (torch 2.11, CUDA 13: CUBLAS_STATUS_EXECUTION_FAILED in cublasGemmStridedBatchedEx) although it
ran eagerly; at N = 1 it stays one baddbmm, which captured and ran there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from northcode.config import ModelConfig
from northcode.model.model import expert_weights, route, run_experts

_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm  # public from torch 2.10 on


def choose_moe_path(device: torch.device, dtype: torch.dtype) -> str:
    """The decode MoE path: grouped where the grouped GEMM runs (CPU, bf16 on CUDA), else gathered."""
    return "grouped" if device.type == "cpu" or dtype == torch.bfloat16 else "gathered"


def grouped_experts(x: torch.Tensor, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    expert_ids: torch.Tensor, weights: torch.Tensor, expert_range: torch.Tensor) -> torch.Tensor:
    """x [N, H] += sum_j weights[:, j] * SwiGLU_{expert_ids[:, j]}(h) over sorted pairs; returns x.

    h [N, H] normed input; gate_up [E, 2I, H]; down [E, H, I]; expert_ids, weights [N, k];
    expert_range: int arange(E) on the device (a constant: searchsorted gives each group's end)."""
    return add_weighted(x, grouped_pair_outputs(h, gate_up, down, expert_ids, expert_range), weights)


def grouped_pair_outputs(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                         expert_range: torch.Tensor) -> torch.Tensor:
    """[N, k, H]: SwiGLU_{expert_ids[n, j]}(h[n]) at [n, j], through the grouped GEMM (grouped_experts)."""
    num_tokens, k = expert_ids.shape
    sorted_ids, order = expert_ids.flatten().sort(stable=True)  # [N*k] pairs grouped by expert
    offsets = torch.searchsorted(sorted_ids, expert_range, right=True, out_int32=True)  # [E] group ends
    tokens = h.expand(k, -1).contiguous() if num_tokens == 1 else h[order // k]  # [N*k, H] in pair order
    gate, up = _grouped_mm(tokens, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)  # [N*k, I]
    expert_out = _grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [N*k, H] sorted
    unsorted = torch.empty_like(expert_out).index_copy_(0, order, expert_out)  # pair j of token n at n*k+j
    return unsorted.view(num_tokens, k, -1)


def add_weighted(x: torch.Tensor, pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [N, H] += sum_j weights[:, j] * pair_out[:, j] (pair_out [N, k, H], weights [N, k]); returns x.

    N = 1: one baddbmm (fp32 accumulation, one rounding). N > 1: no GEMM (module docstring): the products
    in the model dtype, as model.run_experts rounds them, summed in fp32, added to x with one rounding."""
    if x.shape[0] == 1:
        x.view(1, 1, -1).baddbmm_(weights.view(1, 1, -1), pair_out)
        return x
    combined = torch.sum(pair_out * weights[:, :, None], dim=1, dtype=torch.float32)  # [N, H] fp32
    return x.add_(combined)


def gathered_experts(x: torch.Tensor, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """As grouped_experts, by copying the N*k chosen experts' weights (static shapes, no sort)."""
    return add_weighted(x, gathered_pair_outputs(h, gate_up, down, expert_ids), weights)


def gathered_pair_outputs(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                          expert_ids: torch.Tensor) -> torch.Tensor:
    """[N, k, H] as grouped_pair_outputs, by batched GEMVs over the chosen experts' weights. Eagerly the
    index_select copies them; compiled with inductor's GEMV decomposition (compiled_step.py) the gather
    becomes the GEMV's own indirect loads, and only the chosen experts are read, in place."""
    num_tokens, k = expert_ids.shape
    flat_ids = expert_ids.flatten()  # [N*k]
    chosen_gate_up = gate_up.index_select(0, flat_ids).view(num_tokens, -1, gate_up.shape[-1])  # [N, k*2I, H]
    hidden = torch.bmm(chosen_gate_up, h[:, :, None]).view(num_tokens * k, 2, -1)  # [N*k, 2, I]: gate, up
    act = F.silu(hidden[:, 0]) * hidden[:, 1]  # [N*k, I]
    expert_out = torch.bmm(down.index_select(0, flat_ids), act[:, :, None])  # [N*k, H, 1]
    return expert_out.view(num_tokens, k, -1)


def route_logits(logits: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """model.route after its router GEMM: logits [N, E] -> (weights [N, k] in logits' dtype, expert ids [N, k]).

    The k experts come in no particular order (sorted=False: CUDA's top-k then skips its sort); the
    paths here sort the pairs themselves or do not care."""
    top_logits, expert_ids = torch.topk(logits, config.num_experts_per_tok, dim=-1, sorted=False)
    return expert_weights(top_logits, config).to(logits.dtype), expert_ids


def add_moe(x: torch.Tensor, h: torch.Tensor, layer, config: ModelConfig, path: str,
            expert_range: torch.Tensor, router_logits: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H] += the sparse MLP of h [N, H] (routed experts, plus shared ones); returns x (in place).

    `layer` is a model.LayerWeights; router_logits [N, E] when the caller's GEMM already made them (the
    decode step fuses the router into its QKV GEMM). Shared experts (none in North Mini Code) follow
    model.moe."""
    if router_logits is None:
        weights, expert_ids = route(h, layer.router, config)  # [N, k] in h's dtype, [N, k]
    else:
        weights, expert_ids = route_logits(router_logits, config)
    if config.num_shared_experts > 0:  # combine as model.moe does: (routed + shared) [/ 2]
        routed = torch.zeros_like(x)
        add_routed(routed, h, layer, expert_ids, weights, path, expert_range)
        shared = F.linear(F.silu(F.linear(h, layer.gate_proj)) * F.linear(h, layer.up_proj), layer.down_proj)
        total = routed + shared
        return x.add_(total if config.shared_expert_combination_strategy == "sum" else total / 2)
    return add_routed(x, h, layer, expert_ids, weights, path, expert_range)


def add_routed(x, h, layer, expert_ids, weights, path: str, expert_range: torch.Tensor) -> torch.Tensor:
    if path == "loop":
        return x.add_(run_experts(h, layer.experts_gate_up, layer.experts_down, expert_ids, weights))
    if path == "grouped":
        return grouped_experts(x, h, layer.experts_gate_up, layer.experts_down, expert_ids, weights, expert_range)
    return gathered_experts(x, h, layer.experts_gate_up, layer.experts_down, expert_ids, weights)
