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
MAX_KV_STAGES = 5  # kStages of the .cu at head_dim > 64 (8 at head_dim 64): the attention ring's largest size


# run 17: the next task's prefetch too was 5% slower at B=1; run 32: o_proj through the register product after the
# NORM fix beat the o_proj ring (3.27 against 3.35 ms at B=1); runs 79-81: the register product (32 KB in flight
# per SM) is latency-bound and slows by half in some builds, the ring (64-96 KB) does not: the ring again
DEFAULT_FLAGS = FLAG_PREFETCH_CURRENT | FLAG_OPROJ_RING


@dataclass(frozen=True, slots=True)
class Variant:
    """How one decode step is run: Params.flags, the attention ring's stages, build_schedule's options, and
    (lean_fused) the kernel's build. Variants share the default's build where they can (run 4: a second kernel's
    code generation cost more than its ideas gained); lean-fused cannot: as run-time flags the lean dispatch slowed
    the default by 7% (docs/performance.md, day 3 session 2), so a variant's code that the default does not run is
    compiled only into the variant's build (build_defines)."""

    flags: int = DEFAULT_FLAGS
    kv_stages: int = 3
    wave_order: str = "attention-first"
    qkv_tiles: int = 2  # QKV tiles per task, multiplied together (run 12: 3% faster at B=1 than 1)
    combine_apart: bool = True  # COMBINE on the last blocks, which take no up tile (tasks.COMBINE_APART_MAX)
    up_claims: bool = True  # MoE up tiles claimed from a per-layer counter, not static round-robin shares
    lean_fused: bool = False  # the NC_LEAN_FUSED build: lean dispatch; a block's MoE up and down shares in one task
    norm_local: bool = False  # the NC_NORM_LOCAL build: QKV and ROUTER normalise x, no NORM task after layer 0
    topk_rank: bool = True  # NC_TOPK_RANK: TOPK by ranks, a thread per (row, expert), up to B = 4 (run 91)
    router_ring: bool = True  # NC_ROUTER_RING: a router tile's weight in shared memory before the wait (run 91)
    qkv_one_round: bool = False  # query tasks of 3 tiles where needed: one QKV task per block (tasks.one_round_q_tiles)
    attention_blocks: int = 0  # a sparse layer's attention on the last that many blocks, which take no MoE up tile
    max_splits: int = 32  # KV splits per (row, head) at most (tasks.attention_splits; 32 is the kernel's MAX_SPLITS)

    def schedule_options(self) -> dict:
        """build_schedule's keyword arguments for this variant (the task lists' part of it)."""
        return dict(order=self.wave_order, qkv_tiles=self.qkv_tiles, combine_apart=self.combine_apart,
                    up_claims=self.up_claims, moe_fused=self.lean_fused, qkv_one_round=self.qkv_one_round,
                    attention_blocks=self.attention_blocks, norm_local=self.norm_local)

    def build_defines(self) -> dict[str, int]:
        """The -D defines of the kernel build this variant runs on: its build fields that differ from the default's
        (empty: the default's build)."""
        fields = {"NC_LEAN_FUSED": "lean_fused", "NC_NORM_LOCAL": "norm_local", "NC_TOPK_RANK": "topk_rank",
                  "NC_ROUTER_RING": "router_ring"}
        default = Variant()
        return {name: int(getattr(self, field)) for name, field in fields.items()
                if getattr(self, field) != getattr(default, field)}


VARIANTS = {  # "default" is the tested path; the others are timed against it by `bench decode --variants`
    "default": Variant(),  # day 3 (runs 25-32): combine apart, up claims
    "day2-default": Variant(combine_apart=False, up_claims=False),  # until run 28
    "oproj-registers": Variant(flags=DEFAULT_FLAGS & ~FLAG_OPROJ_RING),  # the default of runs 32-80
    "no-combine-apart": Variant(combine_apart=False),
    "no-claims": Variant(up_claims=False),
    "lean-fused": Variant(lean_fused=True),  # its own build (build_defines); day 3 session 2
    "norm-local": Variant(norm_local=True, router_ring=False),  # its own build; runs 87-89: +1 to +7% at B=1
    "topk-rows": Variant(topk_rank=False),  # its own build: the top-k by warp-wide maxima at every batch (until run 91)
    "router-registers": Variant(router_ring=False),  # its own build: the router's product from registers (until 91)
    "qkv-one-round": Variant(qkv_one_round=True),  # day 3 session 2: +0.4% at B=1
    **{f"attention-{n}": Variant(attention_blocks=n) for n in (32, 48, 64, 96)},  # day 3 session 3: +3 to +28%
    **{f"splits-{n}": Variant(max_splits=n) for n in (2, 4, 8, 16)},  # caps; run 59 made half the SMs the default
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
