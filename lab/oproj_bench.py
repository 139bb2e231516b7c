"""The megakernel's o_proj tiles alone (`python lab/oproj_bench.py`, a GPU with sm_90).

Day 3 session 2 found builds of the kernel whose o_proj tasks took ~7 us a tile in the decode step instead of
~4.4, with the same instructions (notebook.md, runs 37-46; the register product's latency beside the MoE stream,
runs 75-81, which the o_proj ring since removed). This runs OPROJ tasks (B = 1, one 16 x 4096 tile of 128 KB each,
128 a round, one per SM) in the current build, so that builds (one per .cu edit) can be compared outside the step:
  stream     rounds without waits: every block runs its tiles back to back (the tile's own rate);
  phased     round r waits for round r - 1's 128 tiles (the step's layer boundary: one dependency wait a tile);
  after-moe  each block runs a MoE up and down share (8 experts, as at B = 1) before each o_proj tile, as in
             the step.
Rounds cycle through the layers of an 8-layer North Mini Code (random weights; 118 MB of o_proj, more than the L2),
so the tiles come from HBM as in the step. Printed: the launch's time (median) and, from one launch with per-task
timestamps, the o_proj tasks' median busy time (dependencies met to done: the step profile's figure).
"""

from __future__ import annotations

import argparse

LAYERS = 8  # o_proj of layers 1..7 cycled: 7 x 16.8 MB, past the 50 MB L2
MODES = ("stream", "phased", "after-moe")
MOE_EXPERTS = 8  # batch 1's distinct experts a layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=49, help="o_proj waves per launch (a step has 49)")
    parser.add_argument("--repeats", type=int, default=20, help="launches timed per cell (median)")


def oproj_waves(config, rounds: int, mode: str) -> tuple[list, int]:
    """The waves of a mode and the counters they use. phased: round r's tiles wait for round r - 1's (counter
    r - 1, all its tiles) and signal counter r. after-moe: before round r's tiles every block runs a MOE_UP and
    a MOE_DOWN share of the slots set by the caller, with round r's own MOE_EXPERTS "slot done" counters and up
    claims counter (rounds x MOE_EXPERTS + r)."""
    from northcode.megakernel.kernel import TaskType, make_task

    assert mode in MODES, mode
    tiles = config.hidden_size // 16
    waves = []
    for r in range(rounds):
        layer = 1 + r % (config.num_hidden_layers - 1)
        if mode == "after-moe":
            slots = r * MOE_EXPERTS
            waves += [("each", make_task(TaskType.MOE_UP, layer, (0, slots, rounds * MOE_EXPERTS + r))),
                      ("each", make_task(TaskType.MOE_DOWN, layer, (0, slots)))]
        waits = ((r - 1, tiles),) if mode == "phased" and r > 0 else ()
        signal = r if mode == "phased" else -1
        waves.append([make_task(TaskType.OPROJ, layer, (t, 1), waits, signal) for t in range(tiles)])
    return waves, rounds * (MOE_EXPERTS + 1 if mode == "after-moe" else 1)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit("--rounds and --repeats must be at least 1")
    import torch

    from kernel_rig import device_schedule, route_row_zero, small_config, small_kernel

    from northcode.bench.decode_bench import measure_bandwidth, median_ms
    from northcode.megakernel.kernel import TaskType

    config = small_config(LAYERS)
    kernel = small_kernel(config)
    kernel.attn_out.normal_()
    kernel.h.normal_()
    generator = torch.Generator().manual_seed(0)
    route_row_zero(kernel, torch.randperm(config.num_experts, generator=generator)[:MOE_EXPERTS].sort().values)
    read_tbps = measure_bandwidth()["read_tbps"]
    print(f"read bandwidth (4 GiB sum): {read_tbps:.2f} TB/s; {kernel.num_blocks} SMs")
    print(f"{'mode':>10}{'launch us':>11}{'o_proj busy us (median)':>25}")
    for mode in MODES:
        waves, counters = oproj_waves(config, args.rounds, mode)
        schedule = device_schedule(kernel, waves, counters)
        is_oproj = schedule.tasks[:, 0] == int(TaskType.OPROJ)
        ms = median_ms(lambda: kernel.launch(schedule, 1), args.repeats)
        times = torch.zeros(schedule.tasks.shape[0], 3, dtype=torch.int64, device=kernel.device)
        kernel.params.profile = times.data_ptr()
        try:
            kernel.launch(schedule, 1)
            kernel.check()
        finally:
            kernel.params.profile = 0
        busy = (times[:, 2] - times[:, 1])[is_oproj].double().median().item() / 1e3
        print(f"{mode:>10}{ms * 1e3:11.1f}{busy:25.2f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python lab/oproj_bench.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
