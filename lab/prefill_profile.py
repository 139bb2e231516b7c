"""Cold prefill through the engine's torch prefill path on North Mini Code's geometry (random weights): TTFT for
each prompt length x prefill chunk size, then the last pair's prefill under torch.profiler, split by
northcode.bench.prefill_profile (attention, expert GEMMs, other GEMMs, copies, gaps) with its --top kernels.

    NORTHCODE_TORCH_COMPILE=0 python lab/prefill_profile.py --tokens 4096 16384 --chunk-sizes 512 2048

(NORTHCODE_TORCH_COMPILE=0: the decode step's compile is not needed here and takes minutes at start-up.
`--preset tiny` runs it on the CPU as a smoke test, split by CPU op self times.)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

import torch


def time_first_token(engine, request_id: str, prompt: list[int], on_gpu: bool) -> float:
    """Seconds from the request to its first token."""
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    from northcode.bench.engine_bench import generate_one

    asyncio.run(generate_one(engine, request_id, prompt, 1))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--layers", type=int, default=0, help="only the first N layers (0: all 49)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--warm-turns", type=int, nargs="*", default=[32, 40, 57],
                        help="after each cold prompt: new tokens of warm turns on it (each a new shape)")
    parser.add_argument("--preset", default="north-mini-code", help="tiny: a smoke test on the CPU")
    parser.add_argument("--causal-min", type=int, help="paged_prefill.CAUSAL_MIN_QUERIES for this run")
    parser.add_argument("--profile-warm", action="store_true",
                        help="profile a warm turn (+40 tokens on the last prompt) instead of the cold prompt")
    args = parser.parse_args()
    from northcode.bench.prefill_profile import format_split, profile_prefill
    from northcode.engine.settings import EngineSettings
    from northcode.model.synthetic import preset_config, random_weights
    from northcode.runtime import build_engine
    from northcode.torch_backend import paged_prefill

    if args.causal_min is not None:
        paged_prefill.CAUSAL_MIN_QUERIES = args.causal_min

    config = preset_config(args.preset)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers, layer_types=None, mlp_layer_types=None)
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    weights = random_weights(config, device=device, dtype=dtype)
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(10, config.vocab_size) for _ in range(n)]  # noqa: E731
    pages = -(-(max(args.tokens) + 64) // 64) * (config.num_hidden_layers + 1)  # the longest prompt, every layer
    print(f"{'tokens':>7}{'chunk':>7}{'TTFT ms':>10}{'tokens/s':>10}")
    for chunk in args.chunk_sizes:
        settings = EngineSettings(max_batch=8, chunk_size=chunk, device=device, dtype=str(dtype).removeprefix("torch."),
                                  backend="torch", num_pages=pages, seed=0)
        engine = build_engine(config, weights, None, settings, model_name="profile")
        time_first_token(engine, "warm-up", prompt(min(args.tokens)), on_gpu)
        for n in args.tokens:
            seconds = time_first_token(engine, f"cold-{n}", prompt(n), on_gpu)
            print(f"{n:7d}{chunk:7d}{1e3 * seconds:10.1f}{n / seconds:10.0f}", flush=True)
            cold = prompt(n)  # a new prompt, prefilled once so that it is cached; then warm turns on it
            time_first_token(engine, f"cold-again-{n}", cold, on_gpu)
            warm = [time_first_token(engine, f"warm-{n}-{k}", cold + prompt(k), on_gpu) for k in args.warm_turns]
            print(f"{'':14}warm turns (+{', +'.join(map(str, args.warm_turns))} tokens on {n} cached): "
                  + ", ".join(f"{1e3 * w:.1f}" for w in warm) + " ms", flush=True)
        if chunk == args.chunk_sizes[-1]:
            profiled = prompt(args.tokens[-1])
            if args.profile_warm:  # cached first, then the turn of 40 new tokens on it is what is profiled
                time_first_token(engine, "cached", profiled, on_gpu)
                profiled = profiled + prompt(40)
            split = profile_prefill(engine, profiled, on_gpu, top=args.top)
            print(f"profile: {'a warm turn of 40 tokens on ' if args.profile_warm else ''}{args.tokens[-1]} tokens, "
                  f"chunks of {chunk}, CAUSAL_MIN_QUERIES {paged_prefill.CAUSAL_MIN_QUERIES}")
            print("\n".join(format_split(split)))
        engine.shutdown()


if __name__ == "__main__":
    main()
