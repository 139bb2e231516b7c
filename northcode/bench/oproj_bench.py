"""The megakernel's o_proj tiles alone (`python -m northcode.bench.oproj_bench`, a GPU with sm_90).

Day 3 session 2 found builds of the kernel whose o_proj tasks take ~7 us a tile in the decode step instead of
~4.4, with the same instructions (docs/performance.md, runs 37-46): the default's build is fast, lean-fused's
and a deeper MoE ring's are slow. This times only OPROJ tasks (B = 1, one 16 x 4096 tile of 128 KB each, 128 a
round, one per SM) in the build of --variant, so that two builds can be compared outside the step:
  stream  rounds without waits: every block runs its tiles back to back (the tile's own rate);
  phased  round r waits for round r - 1's 128 tiles (the step's layer boundary: one dependency wait a tile).
Each with and without the L2 prefetch of the task's weights before its wait (Params.flags). Rounds cycle
through the layers of an 8-layer North Mini Code (random weights; 118 MB of o_proj, more than the L2), so the
tiles come from HBM as in the step; rates are against the read bandwidth of a plain 4 GiB sum measured in the
same process. If every build is fast here, the step's slow o_proj comes from what runs beside it.
"""

from __future__ import annotations

import argparse
import dataclasses

LAYERS = 8  # o_proj of layers 1..7 cycled: 7 x 16.8 MB, past the 50 MB L2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=49, help="o_proj waves per launch (a step has 49)")
    parser.add_argument("--repeats", type=int, default=20, help="launches timed per cell (median)")
    parser.add_argument("--variant", default="default", help="megakernel variant: its build and flags")


def oproj_waves(config, rounds: int, phased: bool) -> list:
    """`rounds` waves of the layer's o_proj tiles (one task each); phased: round r waits for round r - 1 (counter
    r - 1, all its tiles) and signals counter r."""
    from northcode.megakernel.kernel import TaskType, make_task

    tiles = config.hidden_size // 16
    waves = []
    for r in range(rounds):
        layer = 1 + r % (config.num_hidden_layers - 1)
        waits = ((r - 1, tiles),) if phased and r > 0 else ()
        waves.append([make_task(TaskType.OPROJ, layer, (t, 1), waits, r if phased else -1) for t in range(tiles)])
    return waves


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be at least 1")
    import torch

    from northcode.bench.decode_bench import measure_bandwidth, median_ms
    from northcode.bench.decode_setup import paged_cache
    from northcode.megakernel.kernel import VARIANTS, Megakernel, RowSpec, Schedule, flatten, place_waves
    from northcode.megakernel.variants import FLAG_PREFETCH_CURRENT
    from northcode.model.synthetic import preset_config, random_weights

    if args.variant not in VARIANTS:
        raise SystemExit(f"--variant {args.variant}: unknown; choose from {', '.join(VARIANTS)}")
    config = dataclasses.replace(preset_config("north-mini-code"), num_hidden_layers=LAYERS, layer_types=None,
                                 mlp_layer_types=None)
    weights = random_weights(config, device="cuda", dtype=torch.bfloat16, seed=0)
    cache = paged_cache(config, [64], 4, "cuda", seed=0)
    kernel = Megakernel(config, weights, cache.k_pool, cache.v_pool, cache.block_tables, timeout_s=5.0,
                        variant=args.variant)
    kernel.set_rows([RowSpec(position=64, seq=0)])
    kernel.attn_out.normal_()
    read_tbps = measure_bandwidth()["read_tbps"]
    print(f"read bandwidth (4 GiB sum): {read_tbps:.2f} TB/s; {kernel.num_blocks} SMs; variant {args.variant}")
    tile_bytes = 16 * config.q_size * 2
    nbytes = args.rounds * (config.hidden_size // 16) * tile_bytes
    print(f"{'mode':>8}{'prefetch':>10}{'us':>9}{'us/round':>10}{'TB/s':>7}{'of read':>9}")
    flags = kernel.params.flags
    try:
        for mode in ("stream", "phased"):
            built = flatten(place_waves(oproj_waves(config, args.rounds, mode == "phased"), kernel.num_blocks),
                            args.rounds, 0)
            schedule = Schedule(built.tasks.to(kernel.device), built.task_start.to(kernel.device), built.num_counters,
                                built.num_lm_tasks)  # on the device once: launch would copy a host list each time
            for prefetch in (True, False):
                kernel.params.flags = (flags | FLAG_PREFETCH_CURRENT) if prefetch else (flags & ~FLAG_PREFETCH_CURRENT)
                ms = median_ms(lambda: kernel.launch(schedule, 1), args.repeats)
                tbps = nbytes / (ms * 1e-3) / 1e12
                print(f"{mode:>8}{'on' if prefetch else 'off':>10}{ms * 1e3:9.1f}{ms * 1e3 / args.rounds:10.2f}"
                      f"{tbps:7.2f}{tbps / read_tbps:8.0%}")
                kernel.check()
    finally:
        kernel.params.flags = flags
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m northcode.bench.oproj_bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
