"""A small North Mini Code megakernel for the rigs that run hand-built task lists instead of a decode step
(moe_stream_bench.py, oproj_bench.py): the full geometry with a few layers, random weights, one row at position 64."""

from __future__ import annotations

import dataclasses


def small_config(layers: int):
    """North Mini Code with `layers` layers (layer 0 dense, the rest sparse; CPU only: arguments are checked
    against it before a GPU is touched)."""
    from northcode.model.synthetic import preset_config

    return dataclasses.replace(preset_config("north-mini-code"), num_hidden_layers=layers, layer_types=None,
                               mlp_layer_types=None)


def small_kernel(config):
    """The config's megakernel on random weights, batch 1 at position 64."""
    import torch

    from northcode.bench.decode_setup import paged_cache
    from northcode.megakernel.kernel import Megakernel, RowSpec
    from northcode.model.synthetic import random_weights

    weights = random_weights(config, device="cuda", dtype=torch.bfloat16, seed=0)
    cache = paged_cache(config, [64], 4, "cuda", seed=0)
    kernel = Megakernel(config, weights, cache.k_pool, cache.v_pool, cache.block_tables, timeout_s=5.0)
    kernel.set_rows([RowSpec(position=64, seq=0)])
    return kernel


def route_row_zero(kernel, experts) -> None:
    """The MoE slots as TOPK would leave them for row 0 alone routed to `experts` (int tensor, ascending), with
    equal weights: what MOE_UP and MOE_DOWN tasks read."""
    import torch

    n = len(experts)
    kernel.moe_slots.zero_()
    kernel.moe_slots[0] = n
    kernel.moe_slots[1:1 + n] = experts.to(kernel.device, torch.int32)
    kernel.slot_weight.zero_()
    kernel.slot_weight[:n, 0] = 1.0 / n  # row 0 only: the batch is 1


def device_schedule(kernel, waves: list, num_counters: int):
    """The waves placed on the kernel's blocks and flattened, on the device once (launch would copy a host list
    at every call, inside the timed loop)."""
    from northcode.megakernel.kernel import Schedule, flatten, place_waves

    built = flatten(place_waves(waves, kernel.num_blocks), num_counters, 0)
    return Schedule(built.tasks.to(kernel.device), built.task_start.to(kernel.device), built.num_counters,
                    built.num_lm_tasks)
