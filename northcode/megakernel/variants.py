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
FLAG_OPROJ_RING = 8  # o_proj tiles stream through a per-lane cp.async ring (issued after the task's wait)
FLAG_LEAN_DISPATCH = 16  # the next task's record copied during this one; skipped tasks do not signal (the .cu)
MAX_KV_STAGES = 5  # kStages of the .cu at head_dim > 64 (8 at head_dim 64): the attention ring's largest size


# run 17: the next task's prefetch too was 5% slower at B=1; run 32: o_proj through the register product after the
# NORM fix beats the o_proj ring (3.27 against 3.35 ms at B=1, twice in one process)
DEFAULT_FLAGS = FLAG_PREFETCH_CURRENT


@dataclass(frozen=True, slots=True)
class Variant:
    """How one decode step is run: Params.flags, the attention ring's stages, and build_schedule's options.
    Every variant runs the one kernel: a variant that needs other code generation is not a variant
    (docs/performance.md, run 4: a second kernel's code generation cost more than its ideas gained)."""

    flags: int = DEFAULT_FLAGS
    kv_stages: int = 3
    wave_order: str = "attention-first"
    qkv_tiles: int = 2  # QKV tiles per task, multiplied together (run 12: 3% faster at B=1 than 1)
    combine_apart: bool = True  # COMBINE on the last blocks, which take no up tile (tasks.COMBINE_APART_MAX)
    up_claims: bool = True  # MoE up tiles claimed from a per-layer counter, not static round-robin shares
    moe_fused: bool = False  # each block's MoE up and down shares in one task (tasks.build_schedule)
    qkv_one_round: bool = False  # query tasks of 3 tiles where needed: one QKV task per block (tasks.one_round_q_tiles)
    down_claims: bool = False  # MoE down tiles claimed in slot order, not contiguous shares

    def schedule_options(self) -> dict:
        """build_schedule's keyword arguments for this variant (the task lists' part of it)."""
        return dict(order=self.wave_order, qkv_tiles=self.qkv_tiles, combine_apart=self.combine_apart,
                    up_claims=self.up_claims, moe_fused=self.moe_fused, qkv_one_round=self.qkv_one_round,
                    down_claims=self.down_claims)


VARIANTS = {  # "default" is the tested path; the others are timed against it by `bench decode --variants`
    "default": Variant(),  # day 3 (runs 25-32): combine apart, up claims
    "day2-default": Variant(combine_apart=False, up_claims=False),  # until run 28
    "oproj-ring": Variant(flags=DEFAULT_FLAGS | FLAG_OPROJ_RING),  # the default of runs 28-31
    "no-combine-apart": Variant(combine_apart=False),
    "no-claims": Variant(up_claims=False),
    "lean-dispatch": Variant(flags=DEFAULT_FLAGS | FLAG_LEAN_DISPATCH),  # day 3: not yet run on a GPU
    "moe-fused": Variant(moe_fused=True),  # day 3: not yet run on a GPU
    "lean-fused": Variant(flags=DEFAULT_FLAGS | FLAG_LEAN_DISPATCH, moe_fused=True),  # day 3: not yet run on a GPU
    "qkv-one-round": Variant(qkv_one_round=True),  # day 3: not yet run on a GPU
    "down-claims": Variant(down_claims=True),  # day 3: not yet run on a GPU
    "fused-claims": Variant(moe_fused=True, down_claims=True),  # day 3: not yet run on a GPU
    "no-prefetch": Variant(flags=0),
    "prefetch-both": Variant(flags=DEFAULT_FLAGS | FLAG_PREFETCH_NEXT),
    "no-kv-preload": Variant(flags=DEFAULT_FLAGS | FLAG_NO_KV_PRELOAD),
    "tail-early": Variant(wave_order="tail-early"),
    "moe-first": Variant(wave_order="moe-first"),
    "oproj-before-down": Variant(wave_order="oproj-before-down"),  # run 26 (with combine apart): -0.3%
    "qkv-single": Variant(qkv_tiles=1),
    "kv-stages-2": Variant(kv_stages=2),
    "kv-stages-5": Variant(kv_stages=5),
}


def variant_from_env(default: str = "default") -> str:
    """The variant named by $NC_VARIANT (tests run every variant this way), checked."""
    name = os.environ.get("NC_VARIANT", default)
    if name not in VARIANTS:
        raise ValueError(f"NC_VARIANT={name!r}: unknown megakernel variant; choose from {', '.join(VARIANTS)}")
    return name
