"""`northcode generate`: raw completion of a prompt with the reference model, streamed to stdout.

No chat template: the prompt is tokenized as is, after the tokenizer's BOS. It runs
model/model.py directly (one sequence, contiguous KV cache) with a small sampler of its own,
greedy or temperature with a seeded generator, so it is a check of the model rather than a
server; the engine's full sampler lives in engine/sampling.py. torch's CPU threads are the
engine's (engine/settings.cpu_threads), or --threads.
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports happen inside run()
    import torch

    from northcode.model.model import NorthModel
    from northcode.model.tokenizer import Tokenizer

HELP = "raw completion of a prompt, streamed to stdout"
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}  # --dtype value -> torch dtype name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", metavar="PROMPT", help="the text to complete (no chat template)")
    parser.add_argument("--model", metavar="DIR",
                        help="checkpoint folder (default: the demo checkpoint, random weights)")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 picks the likeliest token (greedy, the default); > 0 samples")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="seed for sampling: the same seed gives the same tokens (default: random)")
    parser.add_argument("--dtype", default=None, metavar="D",
                        help="bfloat16, float16 or float32 (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch's CPU threads (default: OMP_NUM_THREADS, else half the cores, at most 4)")
    parser.add_argument("--json", action="store_true",
                        help='print {"token_ids": [...], "text": "..."} of the generated tokens instead of streaming')


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError naming the first bad option."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: must be >= 1")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature {args.temperature}: must be a number >= 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be >= 1")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: must be one of bfloat16 (bf16), float16 (fp16), float32 (fp32)")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    import torch

    from northcode import paths
    from northcode.engine.settings import cpu_threads
    from northcode.model.model import NorthModel
    from northcode.model.tokenizer import IncrementalDetokenizer, Tokenizer

    torch.set_num_threads(cpu_threads(args.threads))
    model_dir = paths.resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype] if args.dtype else ("bfloat16" if device == "cuda" else "float32")
    print(f"northcode generate: model {paths.model_display_name(model_dir)} on {device}, {dtype}", file=sys.stderr)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = NorthModel.from_dir(model_dir, device=device, dtype=getattr(torch, dtype))
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    room = model.config.max_position_embeddings - len(prompt_ids)  # tokens left in the context
    if room < 1:
        raise ValueError(f"PROMPT is {len(prompt_ids)} tokens; the model's context is "
                         f"{model.config.max_position_embeddings} (max_position_embeddings)")
    stop_ids = set(tokenizer.eos_ids) | set(model.config.eos_token_ids)
    seed = args.seed if args.seed is not None else secrets.randbits(63)
    generator = torch.Generator().manual_seed(seed)
    detokenizer = None if args.json else IncrementalDetokenizer(tokenizer)

    start = time.perf_counter()
    token_ids: list[int] = []
    for token_id in generate_tokens(model, prompt_ids, min(args.max_tokens, room), args.temperature,
                                    generator, stop_ids):
        token_ids.append(token_id)
        if detokenizer is not None:
            write(detokenizer.push(token_id))
    elapsed = time.perf_counter() - start
    if detokenizer is None:
        print(json.dumps({"token_ids": token_ids, "text": tokenizer.decode(token_ids)}, ensure_ascii=False))
    else:
        write(detokenizer.flush() + "\n")
    print(f"northcode generate: {len(token_ids)} tokens in {elapsed:.2f} s "
          f"({len(token_ids) / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """BOS (when the tokenizer has one), then the prompt as plain text: no chat template."""
    prompt_ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
    if not prompt_ids:
        raise ValueError("PROMPT is empty and the tokenizer has no BOS token to start from")
    return prompt_ids


def generate_tokens(model: NorthModel, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                    generator: torch.Generator, stop_ids: set[int]) -> Iterator[int]:
    """Yield sampled token ids one by one; the last is a stop id or the max_new_tokens-th."""
    cache = model.new_cache()
    logits = model.prefill(prompt_ids, cache, last_only=True)[-1]  # [V]
    for step in range(max_new_tokens):
        token_id = sample(logits, temperature, generator)
        yield token_id
        if token_id in stop_ids or step + 1 == max_new_tokens:
            return
        logits = model.decode(token_id, cache)


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else one draw from softmax(logits / T) with the (CPU) generator,
    on the CPU in fp32 so that a seed gives the same token whatever device computed the logits."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().to("cpu", torch.float32) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
