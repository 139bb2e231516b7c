"""Where a cold prefill's GPU time goes: North Mini Code's geometry (random weights) through the engine's torch
prefill path, one prompt of --tokens after a warm-up, under torch.profiler; prints TTFT and the top kernels.

    NORTHCODE_TORCH_COMPILE=0 python tools/prefill_profile.py --tokens 4096 [--layers N]

(The decode step's compile is not needed here: NORTHCODE_TORCH_COMPILE=0 skips its minutes at start-up.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

import torch


async def first_token(engine, request_id: str, prompt: list[int]) -> None:
    from northcode.engine.request import SamplingParams

    async for _ in engine.generate(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=0, help="only the first N layers (0: all 49)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--preset", default="north-mini-code", help="tiny: a smoke test on the CPU")
    args = parser.parse_args()
    from northcode.engine.engine import Engine
    from northcode.engine.settings import EngineSettings
    from northcode.model.synthetic import preset_config, random_weights

    config = preset_config(args.preset)
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers, layer_types=None, mlp_layer_types=None)
    weights = random_weights(config, device=device, dtype=dtype)
    settings = EngineSettings(max_batch=8, device=device, dtype=str(dtype).removeprefix("torch."), backend="torch",
                              num_pages=4096, seed=0)
    engine = Engine(config, weights, None, settings, model_name="profile")
    rng = random.Random(0)
    prompt = lambda: [rng.randrange(10, config.vocab_size) for _ in range(args.tokens)]  # noqa: E731
    asyncio.run(first_token(engine, "warm-up", prompt()))
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    asyncio.run(first_token(engine, "timed", prompt()))
    seconds = time.perf_counter() - start
    print(f"TTFT {args.tokens} tokens, {config.num_hidden_layers} layers: {1e3 * seconds:.1f} ms "
          f"({args.tokens / seconds:.0f} tokens/s)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU]) as prof:
        asyncio.run(first_token(engine, "profiled", prompt()))
        if device == "cuda":
            torch.cuda.synchronize()
    own = (lambda e: e.self_device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)  # us
    events = [e for e in prof.key_averages() if own(e) > 0]
    total = sum(own(e) for e in events)
    print(f"GPU time under the profiler: {total / 1e3:.1f} ms")
    for e in sorted(events, key=lambda e: -own(e))[:args.top]:
        print(f"{own(e) / 1e3:9.2f} ms {100 * own(e) / total:5.1f}% "
              f"{e.count:6d}x  {e.key[:110]}")
    engine.shutdown()


if __name__ == "__main__":
    main()
