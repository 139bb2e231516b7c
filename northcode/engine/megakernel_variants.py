"""The megakernel's run variants: Params.flags and task-list options that `northcode bench decode --variants`
times against the default (the tested path), and that the GPU tests check with $NC_VARIANT / $NC_VARIANTS.
No torch import: the benchmark's argument parser lists the names. docs/performance.md has each variant's
prediction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FLAG_PREFETCH_CURRENT, FLAG_PREFETCH_NEXT = 1, 2  # Params.flags: L2 prefetch of this / the next task's weights
FLAG_DEEP_LOADS = 4  # single 16-row tiles (QKV, o_proj, router) copied whole into shared memory first (variant kernel)
FLAG_VARIANTS = 8  # launch the variant kernel (arrival tickets, OPROJ_DRAIN, deep products); the default kernel refuses them
FLAG_DEEP_MOE = 16  # two-tile products (MoE up / down, dense up, LM head) copied whole into shared memory first (variant kernel)


@dataclass(frozen=True, slots=True)
class Variant:
    """How one decode step is run: Params.flags and build_schedule's options (docs/performance.md, the plan)."""

    flags: int = FLAG_PREFETCH_CURRENT | FLAG_PREFETCH_NEXT
    wave_order: str = "attention-first"
    qkv_tiles: int = 1
    fuse_combine: bool = False
    oproj_drain: bool = False
    topk_ticket: bool = False


_V = FLAG_PREFETCH_CURRENT | FLAG_PREFETCH_NEXT | FLAG_VARIANTS
VARIANTS = {  # "default" is the tested path; the others are timed against it by `bench decode --variants`
    "default": Variant(),
    "no-prefetch": Variant(flags=0),
    "prefetch-current": Variant(flags=FLAG_PREFETCH_CURRENT),
    "moe-first": Variant(wave_order="moe-first"),
    "qkv-pairs": Variant(qkv_tiles=2),
    "tail-early": Variant(wave_order="tail-early"),
    # plan item 1: the last ATTN split merges (no COMBINE), o_proj claimed between the MoE up and down drains
    "fused-tail": Variant(flags=_V, wave_order="tail-early", fuse_combine=True, oproj_drain=True),
    # plan item 3: the last ROUTER task runs TOPK (one hand-off less per sparse layer)
    "router-ticket": Variant(flags=_V, topk_ticket=True),
    # plan item 2 (first step): each QKV, o_proj and router tile requested whole (64-128 KB in flight per block
    # instead of 32 KB), through shared memory (mma_tile_deep)
    "deep-loads": Variant(flags=_V | FLAG_DEEP_LOADS),
    # plan item 2 (second step): the same for the MoE up / down drains, the dense up tiles and the LM head
    # (two 16-row tiles per product: 128 KB in flight per block at K = 2048 instead of 64 KB)
    "deep-moe": Variant(flags=_V | FLAG_DEEP_MOE),
    # all of the above together
    "fast": Variant(flags=_V | FLAG_DEEP_LOADS | FLAG_DEEP_MOE, wave_order="tail-early", fuse_combine=True,
                    oproj_drain=True, topk_ticket=True),
}
NEW_VARIANTS = ("fused-tail", "router-ticket", "deep-loads", "deep-moe", "fast")  # need the variant kernel


def variant_from_env(default: str = "default") -> str:
    """The variant named by $NC_VARIANT (tests run every variant this way), checked."""
    name = os.environ.get("NC_VARIANT", default)
    if name not in VARIANTS:
        raise ValueError(f"NC_VARIANT={name!r}: unknown megakernel variant; choose from {', '.join(VARIANTS)}")
    return name
