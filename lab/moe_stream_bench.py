"""The megakernel's MoE weight stream alone (`python lab/moe_stream_bench.py`, a GPU with sm_90).

In a decode step the up and down phases share the SMs with attention and o_proj, so their rate there mixes the
stream's own limit with the schedule's. This runs only MOE_UP tasks (one per SM, the slots' up tiles claimed from
one counter), then MOE_UP + MOE_DOWN, over N distinct experts of one North Mini Code layer (random weights), and
prints the bytes streamed per second against the read bandwidth of a plain 4 GiB sum measured in the same
process: if the stream alone stays well under it, the per-SM ring is the limit (its depth: kMoeStages in the
.cu, one build per value); if it reaches it, the step's schedule is. 8 experts is batch 1's working set (a 50 MB
up phase: launch overhead included), 128 all of them.
The "down+" row is up+down's time less up's: the down stream's own rate (the up phase alone carries the launch
and its shares' tail, which the down tasks overlap).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128], help="distinct experts streamed")
    parser.add_argument("--repeats", type=int, default=20, help="launches timed per cell (median)")


def run(args: argparse.Namespace) -> int:
    import torch

    from kernel_rig import device_schedule, route_row_zero, small_config, small_kernel

    from northcode.bench.decode_bench import measure_bandwidth, median_ms
    from northcode.megakernel.kernel import TaskType, make_task

    config = small_config(2)  # layer 0 dense, layer 1 sparse: the one streamed
    if any(not 1 <= n <= config.num_experts for n in args.experts):
        raise SystemExit(f"--experts: each count must be 1..{config.num_experts}")
    kernel = small_kernel(config)
    kernel.h.normal_()
    bandwidth = measure_bandwidth()
    read_tbps = bandwidth["read_tbps"]
    print(f"read bandwidth (4 GiB sum): {read_tbps:.2f} TB/s; {kernel.num_blocks} SMs")
    up_bytes = 2 * config.intermediate_size * config.hidden_size * 2  # one expert's gate_up, bf16
    down_bytes = config.hidden_size * config.intermediate_size * 2
    print(f"{'experts':>8}{'phase':>9}{'MB':>8}{'us':>9}{'TB/s':>7}{'of read':>9}{'GB/s per SM':>13}")
    generator = torch.Generator().manual_seed(0)
    for n in args.experts:
        experts = torch.randperm(config.num_experts, generator=generator)[:n].sort().values
        route_row_zero(kernel, experts)
        up = ("each", make_task(TaskType.MOE_UP, 1, (0, 0, n)))  # slot counters 0..n-1, tiles claimed from n
        down = ("each", make_task(TaskType.MOE_DOWN, 1, (0, 0)))  # contiguous down shares
        timed = {}
        for phase, waves, nbytes in (("up", [up], n * up_bytes), ("up+down", [up, down], n * (up_bytes + down_bytes))):
            schedule = device_schedule(kernel, waves, n + 1)
            ms = timed[phase] = median_ms(lambda: kernel.launch(schedule, 1), args.repeats)
            tbps = nbytes / (ms * 1e-3) / 1e12
            print(f"{n:>8}{phase:>9}{nbytes / 1e6:8.1f}{ms * 1e3:9.1f}{tbps:7.2f}{tbps / read_tbps:8.0%}"
                  f"{tbps * 1e3 / kernel.num_blocks:13.1f}")
        # the down tasks overlap the up phase's launch and tail, which bound the up-alone figure (runs 70-74):
        # the difference is the down stream's own rate, an upper bound
        extra_ms = timed["up+down"] - timed["up"]
        if extra_ms > 0:
            tbps = n * down_bytes / (extra_ms * 1e-3) / 1e12
            print(f"{n:>8}{'down+':>9}{n * down_bytes / 1e6:8.1f}{extra_ms * 1e3:9.1f}{tbps:7.2f}"
                  f"{tbps / read_tbps:8.0%}{tbps * 1e3 / kernel.num_blocks:13.1f}")
        kernel.check()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python lab/moe_stream_bench.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
