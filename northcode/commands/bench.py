"""`northcode bench engine ...` and `northcode bench decode ...`: the benchmarks in northcode/bench/.

`engine` runs northcode.bench.engine_bench (the whole engine through generate()); `decode` runs
northcode.bench.decode_bench (the decode step alone: megakernel against the PyTorch path), imported
only when present, so this command works before that module exists and says so plainly.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

HELP = "benchmarks: bench engine | bench decode"
BENCHMARKS = {  # name -> (module, help)
    "engine": ("northcode.bench.engine_bench", "TTFT cold/warm, prefill and decode tokens/s through the engine"),
    "decode": ("northcode.bench.decode_bench", "the decode step alone: megakernel vs the PyTorch path"),
}


def _available(module_name: str) -> bool:
    try:
        return importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="benchmark", metavar="{engine,decode}", required=True)
    for name, (module_name, help_) in BENCHMARKS.items():
        sub = commands.add_parser(name, help=help_, description=help_)
        if _available(module_name):
            importlib.import_module(module_name).add_arguments(sub)
        else:
            sub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    module_name, _ = BENCHMARKS[args.benchmark]
    if not _available(module_name):
        raise ValueError(f"bench {args.benchmark}: not available yet ({module_name} is not installed in this build)")
    return int(importlib.import_module(module_name).run(args) or 0)
