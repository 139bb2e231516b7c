"""`northcode checkpoint create`: write a synthetic checkpoint (real format, random weights).

It refuses to write into a non-empty folder unless --force, checks the free disk space first
(north-mini-code is about 61 GB), and says plainly that the weights are random.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

HELP = "create synthetic checkpoints (random weights)"
PRESET_NAMES = ("tiny", "north-mini-code")  # model.synthetic.PRESETS, without importing torch here


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="write a synthetic checkpoint folder",
                                description="Write config.json, safetensors shards with an index, and a "
                                            "trained tokenizer, with random weights.")
    create.add_argument("--preset", required=True, choices=PRESET_NAMES,
                        help="tiny: a few MB, runs on a CPU in seconds; north-mini-code: the real geometry (61 GB)")
    create.add_argument("--out", required=True, metavar="DIR", help="folder to write (created if missing)")
    create.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same files")
    create.add_argument("--force", action="store_true", help="write into a non-empty folder, replacing a checkpoint")


def run(args: argparse.Namespace) -> int:
    out_dir = Path(args.out).expanduser()
    _check_out_dir(out_dir, args.force)
    import torch

    from northcode.model.checkpoint import canonical_shapes
    from northcode.model.synthetic import create_checkpoint, preset_config

    if args.preset != "tiny":  # tiny's size is a few MB; the big one must fit on the disk first
        config = preset_config(args.preset)
        shapes = canonical_shapes(config)
        needed = 2 * sum(math.prod(shape) for name, shape in shapes.items() if name != "lm_head.weight")  # bf16
        _check_disk_space(out_dir, needed)
        if not torch.cuda.is_available():
            print(f"no CUDA GPU: drawing {_size(needed)} of random numbers on the CPU takes a while", file=sys.stderr)
    create_checkpoint(args.preset, out_dir, seed=args.seed)
    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    print(f"wrote a {args.preset} checkpoint (seed {args.seed}) to {out_dir}: {len(files)} files, {_size(total)}")
    for path in files:
        print(f"  {path.name:<40} {_size(path.stat().st_size):>10}")
    print("The weights are RANDOM: the model's output is noise. Use it for tests and benchmarks, not for answers.")
    return 0


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ValueError(f"--out {out_dir}: folder is not empty (pass --force to write into it)")


def _check_disk_space(out_dir: Path, needed_bytes: int) -> None:
    existing = out_dir
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise ValueError(f"--out {out_dir}: needs {_size(needed_bytes)} of disk space, {_size(free)} is free")


def _size(num_bytes: int) -> str:
    """Decimal units, as disk tools show them: 61.2 GB."""
    if num_bytes < 1000:
        return f"{num_bytes} B"
    for exponent, unit in ((3, "GB"), (2, "MB"), (1, "KB")):
        if num_bytes >= 1000 ** exponent:
            return f"{num_bytes / 1000 ** exponent:.1f} {unit}"
    return f"{num_bytes / 1000:.1f} KB"
