"""The megakernel's run variants: Params.flags and task-list options that `northcode bench decode --variants`
times against the default (the tested path), and that the GPU tests check with $NC_VARIANT / $NC_VARIANTS.
No torch import: the benchmark's argument parser lists the names. docs/performance.md has each variant's
prediction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FLAG_PREFETCH_CURRENT, FLAG_PREFETCH_NEXT = 1, 2  # Params.flags: L2 prefetch of this / the next task's weights
FLAG_NO_KV_PRELOAD = 4  # attention issues no KV page copy before its dependency wait
FLAG_FAST_TOPK = 16  # TOPK numbers the slots by ballot and scatters the weights (no loops over the experts)
FLAG_OPROJ_RING = 64  # o_proj tasks of two tiles stream through the per-lane ring, first steps before the wait
FLAG_DOWN_STRIDED = 32  # MoE down tiles round-robin over the blocks (each slot's tiles spread over many)
FLAG_DOWN_REVERSED = 8  # MoE down shares in reverse block order (the blocks with one up tile less take the first slots)
MAX_KV_STAGES = 5  # kStages of the .cu at head_dim > 64 (8 at head_dim 64): the attention ring's largest size


@dataclass(frozen=True, slots=True)
class Variant:
    """How one decode step is run: Params.flags, the attention ring's stages, and build_schedule's options.
    Every variant runs the one kernel: a variant that needs other code generation is not a variant
    (docs/performance.md, run 4: a second kernel's code generation cost more than its ideas gained)."""

    flags: int = FLAG_PREFETCH_CURRENT | FLAG_PREFETCH_NEXT
    kv_stages: int = 3
    wave_order: str = "attention-first"
    qkv_tiles: int = 2  # QKV tiles per task, multiplied together (run 12: 3% faster at B=1 than 1)
    oproj_tiles: int = 1  # o_proj tiles per task (2 with OPROJ_RING: one ring tile)


_PREFETCH = FLAG_PREFETCH_CURRENT | FLAG_PREFETCH_NEXT
VARIANTS = {  # "default" is the tested path; the others are timed against it by `bench decode --variants`
    "default": Variant(),
    "no-prefetch": Variant(flags=0),
    "prefetch-current": Variant(flags=FLAG_PREFETCH_CURRENT),
    "tail-early": Variant(wave_order="tail-early"),
    "moe-first": Variant(wave_order="moe-first"),
    "qkv-single": Variant(qkv_tiles=1),
    "no-kv-preload": Variant(flags=_PREFETCH | FLAG_NO_KV_PRELOAD),
    "kv-stages-2": Variant(kv_stages=2),
    "kv-stages-5": Variant(kv_stages=5),
    "oproj-before-down": Variant(wave_order="oproj-before-down"),
    "down-reversed": Variant(flags=_PREFETCH | FLAG_DOWN_REVERSED),  # not yet timed (no device time left, day 1)
    "fast-topk": Variant(flags=_PREFETCH | FLAG_FAST_TOPK),  # not yet run on a GPU (day 1)
    "down-strided": Variant(flags=_PREFETCH | FLAG_DOWN_STRIDED),  # not yet run on a GPU (day 1)
    "oproj-ring": Variant(flags=_PREFETCH | FLAG_OPROJ_RING, oproj_tiles=2),  # not yet run on a GPU (day 1)
}


def variant_from_env(default: str = "default") -> str:
    """The variant named by $NC_VARIANT (tests run every variant this way), checked."""
    name = os.environ.get("NC_VARIANT", default)
    if name not in VARIANTS:
        raise ValueError(f"NC_VARIANT={name!r}: unknown megakernel variant; choose from {', '.join(VARIANTS)}")
    return name
