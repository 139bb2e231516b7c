"""`northcode bench engine`: the engine's latency and throughput through its real API (generate()).

Measures time to first token for a cold prompt and for the same prompt plus a short new turn (the
prefix cache's case), prefill tokens/s (cold prompt tokens / cold TTFT), and decode tokens/s at each
batch size (B requests at the same context, tokens after the first / time). Prompts are random token
ids; a warm-up request per shape runs first, so CUDA-graph capture is not timed. Prints a table, or
JSON with --json. With --preset, random weights are drawn on the device (no files, and no tokenizer
unless --schema asks for one). With --schema, each batch size's decode runs again with every row held to
the schema (the grammar the server builds for a json_schema response_format), in the same process: its
tokens/s and its ratio to the unconstrained figure. The schema must allow --decode-tokens tokens or more
(an array with minItems, say): a grammar that completes ends its request early, and the bench says so.
With --profile-prefill, one more cold prompt of --prompt-len runs under torch.profiler after the rest, and its
time is split into attention, expert GEMMs, other GEMMs, copies and elementwise, other and gaps
(bench/prefill_profile.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

HELP = "engine benchmark: TTFT cold and warm, prefill and decode tokens/s at batch 1..8"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the demo checkpoint)")
    source.add_argument("--preset", choices=("tiny", "north-mini-code"),
                        help="random weights of a preset drawn on the device instead of a checkpoint")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--prompt-len", type=int, metavar="N", help="cold prompt tokens (default 4096 GPU, 256 CPU)")
    parser.add_argument("--turn-len", type=int, default=32, metavar="N", help="new tokens of the warm turn (default 32)")
    parser.add_argument("--context", type=int, metavar="N",
                        help="context of each decoding request (default 8192 GPU, 128 CPU)")
    parser.add_argument("--decode-tokens", type=int, metavar="N", help="tokens per decode run (default 64 GPU, 8 CPU)")
    parser.add_argument("--batch-sizes", default="1,2,4,8", metavar="LIST", help="decode batch sizes (default 1,2,4,8)")
    parser.add_argument("--chunk-size", type=int, default=2048, metavar="N", help="prefill chunk size (default 2048)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32")
    parser.add_argument("--backend", choices=("auto", "torch", "megakernel"), default="auto",
                        help="decode backend (default: auto; the result names the one that ran and why)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run the torch decode step eagerly")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="of free GPU memory for KV pages")
    parser.add_argument("--num-pages", type=int, help="fixed KV pool size in pages")
    parser.add_argument("--schema", metavar="JSON",
                        help="a JSON schema (its text, or @FILE): decode also runs with every row held to it; it must "
                             "allow long output, e.g. {\"type\": \"array\", \"items\": {\"type\": \"integer\"}, "
                             "\"minItems\": 64}")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="then one more cold prefill of --prompt-len under torch.profiler: its time by attention, "
                             "expert GEMMs, other GEMMs, copies and elementwise, other, gaps")


@dataclass
class EngineBenchResult:
    model: str
    device: str
    backend: str
    prompt_len: int
    turn_len: int
    context: int
    backend_reason: str = ""  # why this backend runs (the engine's stats()["backend_reason"])
    ttft_cold_s: float = 0.0
    ttft_warm_s: float = 0.0
    warm_cached_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    # {batch, tokens_per_s, per_sequence_tokens_per_s, ms_per_step}, and with a schema: constrained_tokens_per_s,
    # constrained_ms_per_step, constrained_ratio (constrained / unconstrained tokens/s), constrained_min_tokens
    # (the fewest tokens a constrained request wrote: below decode_tokens, its grammar completed early)
    decode: list[dict] = field(default_factory=list)
    decode_tokens: int = 0
    schema: dict | None = None
    # with --profile-prefill: prefill_profile.PrefillSplit as a dict (source, prompt_len, wall_ms, categories_ms, top)
    prefill_profile: dict | None = None


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes {text!r}: expected comma-separated integers like 1,2,4,8") from None
    if not sizes or any(size < 1 for size in sizes):
        raise ValueError(f"--batch-sizes {text!r}: every size must be >= 1")
    return sizes


def read_schema(text: str) -> dict:
    """--schema's JSON schema, from its text or @FILE; ValueError naming what is wrong."""
    if text.startswith("@"):
        try:
            text = open(text[1:], encoding="utf-8").read()
        except OSError as err:
            raise ValueError(f"--schema {text}: cannot read the file ({err.strerror})") from None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--schema: not valid JSON ({err})") from None
    if not isinstance(schema, dict):
        raise ValueError("--schema: expected a JSON object (a JSON schema)")
    return schema


def schema_grammar(schema: dict):
    """The GrammarSpec of a json_schema response_format as the server builds it, without its text markers:
    `%llguidance {}` / `start: %json <schema, x-guidance tojson style>`; ValueError when it cannot be enforced."""
    from northcode.server.errors import RequestError
    from northcode.server.structured_output import json_schema_grammar

    try:
        return json_schema_grammar(schema, "--schema")
    except RequestError as err:
        raise ValueError(err.message) from None


def preset_tokenizer(preset: str, config):
    """The tokenizer a synthetic checkpoint of `preset` has (synthetic.preset_tokenizer), with config's special ids."""
    from northcode.model.synthetic import preset_tokenizer as trained
    from northcode.model.tokenizer import Tokenizer

    return Tokenizer(trained(preset), bos_id=config.bos_token_id, eos_ids=tuple(config.eos_token_ids),
                     pad_id=config.pad_token_id, model_max_length=config.max_position_embeddings)


def build_engine(args: argparse.Namespace):
    from northcode import runtime
    from northcode.engine.settings import EngineSettings

    sizes = parse_batch_sizes(args.batch_sizes)
    settings = EngineSettings(max_batch=max(8, *sizes), chunk_size=args.chunk_size, device=args.device,
                              dtype=args.dtype, backend=args.backend, cuda_graphs=not args.no_cuda_graphs,
                              gpu_memory_fraction=args.gpu_memory_fraction, num_pages=args.num_pages, seed=0)
    if args.preset is None:
        from northcode.paths import resolve_model

        model_dir = resolve_model(args.model)
        runtime.check_backend_setting(model_dir, settings)  # a megakernel that cannot run: refused before loading
        return runtime.load_engine(model_dir, settings)
    from northcode.model.synthetic import TOKENIZER_VOCAB_SIZE, preset_config, random_weights

    config = preset_config(args.preset, vocab_size=TOKENIZER_VOCAB_SIZE if args.preset == "tiny" else None)
    runtime.check_backend_setting(config, settings)
    device = runtime.resolve_device(settings.device)
    weights = random_weights(config, device=device, dtype=runtime.resolve_dtype(settings.dtype, device))
    tokenizer = preset_tokenizer(args.preset, config) if args.schema is not None else None  # grammars need one
    return runtime.build_engine(config, weights, tokenizer, settings, model_name=f"{args.preset} (random weights)")


async def generate_one(engine, request_id: str, prompt: list[int], max_tokens: int, grammar=None):
    """One greedy request of max_tokens (no stop at EOS; held to `grammar`, a GrammarSpec, when given) through the
    engine; its final output."""
    from northcode.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    final = None
    async for out in engine.generate(request_id, prompt, params):
        final = out
    return final


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def measure(engine, args: argparse.Namespace, on_gpu: bool, schema: dict | None = None) -> EngineBenchResult:
    rng = random.Random(0)
    vocab = engine.config.vocab_size
    limit = engine.max_model_len - 1
    prompt_len = min(args.prompt_len or (4096 if on_gpu else 256), limit - args.turn_len - 1)
    context = min(args.context or (8192 if on_gpu else 128), limit)
    decode_tokens = args.decode_tokens or (64 if on_gpu else 8)
    stats = engine.stats()
    result = EngineBenchResult(engine.model_name, str(engine.backend.k_pool.device), stats["backend"],
                               prompt_len, args.turn_len, context, backend_reason=stats["backend_reason"],
                               decode_tokens=decode_tokens, schema=schema)
    grammar = schema_grammar(schema) if schema is not None else None
    run = lambda coro: asyncio.run(coro)  # noqa: E731
    run(generate_one(engine, "warm-up", random_prompt(rng, vocab, prompt_len), 2))  # allocator, lazy kernels
    prompt = random_prompt(rng, vocab, prompt_len)
    cold = run(generate_one(engine, "cold", prompt, 1))
    warm = run(generate_one(engine, "warm", prompt + random_prompt(rng, vocab, args.turn_len), 1))
    result.ttft_cold_s = cold.timings.time_to_first_token_s
    result.ttft_warm_s = warm.timings.time_to_first_token_s
    result.warm_cached_tokens = warm.usage.cached_tokens
    result.prefill_tokens_per_s = prompt_len / result.ttft_cold_s
    for batch in parse_batch_sizes(args.batch_sizes):
        prompts = [random_prompt(rng, vocab, context - decode_tokens) for _ in range(batch)]
        row = _measure_decode(engine, prompts, decode_tokens)
        if grammar is not None:  # the same prompts (cached), every row constrained
            constrained = _measure_decode(engine, prompts, decode_tokens, grammar)
            row.update(constrained_tokens_per_s=constrained["tokens_per_s"],
                       constrained_ms_per_step=constrained["ms_per_step"],
                       constrained_ratio=constrained["tokens_per_s"] / row["tokens_per_s"],
                       constrained_min_tokens=constrained["min_tokens"])
        del row["min_tokens"]
        result.decode.append(row)
    if args.profile_prefill:  # last, so the profiler touches none of the figures above
        from northcode.bench.prefill_profile import profile_prefill

        result.prefill_profile = asdict(profile_prefill(engine, random_prompt(rng, vocab, prompt_len), on_gpu))
    return result


def _measure_decode(engine, prompts: list[list[int]], decode_tokens: int, grammar=None) -> dict:
    """len(prompts) requests prefilled to `context - 1` tokens, then decode_tokens each; timed from token 2 on."""
    batch, tag = len(prompts), "constrained" if grammar is not None else "decode"

    async def all_of(name: str):
        return await asyncio.gather(*[generate_one(engine, f"{name}-{batch}-{i}", p, decode_tokens, grammar)
                                      for i, p in enumerate(prompts)])

    asyncio.run(all_of(f"{tag}-warm-up"))  # captures the graphs (compiles the grammar); the prompts stay cached
    finals = asyncio.run(all_of(tag))
    errors = [final.error for final in finals if final.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"a {tag} request at batch {batch} failed: {errors[0]}")
    gaps = [gap for final in finals for gap in final.timings.token_latencies_s[1:]]  # the first may share a prefill step
    step_s = statistics.median(gaps) if gaps else float("nan")
    return {"batch": batch, "tokens_per_s": batch / step_s, "per_sequence_tokens_per_s": 1 / step_s,
            "ms_per_step": step_s * 1e3, "min_tokens": min(final.usage.completion_tokens for final in finals)}


def short_runs(result: EngineBenchResult) -> list[str]:
    """A note per batch size whose constrained requests wrote fewer tokens than asked (the grammar completed)."""
    return [f"batch {row['batch']}: a constrained request ended after {row['constrained_min_tokens']} of "
            f"{result.decode_tokens} tokens (its JSON was complete): give --schema longer output, e.g. minItems"
            for row in result.decode if row.get("constrained_min_tokens", result.decode_tokens) < result.decode_tokens]


def format_table(result: EngineBenchResult) -> str:
    lines = [f"engine benchmark: {result.model} on {result.device}, {result.backend} backend",
             f"  ({result.backend_reason})",
             f"  TTFT cold ({result.prompt_len} tokens)          {result.ttft_cold_s * 1e3:9.1f} ms",
             f"  TTFT warm (+{result.turn_len} tokens, {result.warm_cached_tokens} cached) "
             f"{result.ttft_warm_s * 1e3:9.1f} ms",
             f"  prefill                              {result.prefill_tokens_per_s:9.0f} tokens/s",
             f"  decode at context {result.context}{', unconstrained and with --schema' if result.schema else ''}:",
             "    batch   tokens/s   per sequence   ms/step" + ("   constrained tokens/s   ratio" if result.schema else "")]
    for row in result.decode:
        line = (f"    {row['batch']:5d} {row['tokens_per_s']:10.1f} {row['per_sequence_tokens_per_s']:14.1f}"
                f" {row['ms_per_step']:9.2f}")
        if result.schema:
            line += f" {row['constrained_tokens_per_s']:22.1f} {row['constrained_ratio']:7.3f}"
        lines.append(line)
    lines += [f"  note: {note}" for note in short_runs(result)]
    if result.prefill_profile is not None:
        from northcode.bench.prefill_profile import PrefillSplit, format_split

        lines += format_split(PrefillSplit(**result.prefill_profile))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for name in ("prompt_len", "context", "decode_tokens", "turn_len", "chunk_size", "num_pages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    parse_batch_sizes(args.batch_sizes)
    schema = read_schema(args.schema) if args.schema is not None else None
    if schema is not None:
        schema_grammar(schema)  # a schema llguidance cannot enforce is refused before the weights load
    import torch

    on_gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
    started = time.perf_counter()
    engine = build_engine(args)
    print(f"northcode bench engine: {engine.model_name} loaded in {time.perf_counter() - started:.1f} s",
          file=sys.stderr)
    try:
        result = measure(engine, args, on_gpu, schema)
    finally:
        engine.shutdown()
    print(json.dumps(asdict(result), indent=2) if args.json else format_table(result))
    for note in short_runs(result) if args.json else []:
        print(f"northcode bench engine: note: {note}", file=sys.stderr)
    return 0
