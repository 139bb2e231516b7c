"""Where northcode keeps its files, and which model a command loads when --model is not given.

NORTHCODE_HOME (read by config.env_data_home) overrides the user's data directory (tests point it at a
temporary folder). The demo checkpoint (the `tiny` preset
with a fixed seed, random weights) is created there on first use, so every command works on a
fresh machine with no GPU and no download.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from northcode.config import env_data_home

DEMO_PRESET = "tiny"
DEMO_SEED = 0
SYNTHETIC_KEY = "northcode_synthetic"  # config.json field written by `northcode checkpoint create`


def data_dir() -> Path:
    """The user's northcode data directory (created on demand)."""
    override = env_data_home()
    if override:
        path = Path(override).expanduser()
    else:
        import platformdirs

        path = platformdirs.user_data_path("northcode")
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_checkpoint_dir() -> Path:
    return data_dir() / "models" / f"demo-{DEMO_PRESET}-seed{DEMO_SEED}"


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The model folder to load: `model` if given (checked to exist), else the demo checkpoint,
    created on first use under a file lock so that two processes never write it at once."""
    if model is not None:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {path}: no config.json there (expected a checkpoint folder)")
        return path
    path = demo_checkpoint_dir()
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            from northcode.model.synthetic import create_checkpoint

            create_checkpoint(DEMO_PRESET, path, seed=DEMO_SEED)
    return path


def synthetic_info(model_dir: str | os.PathLike) -> dict | None:
    """The synthetic-checkpoint record of config.json ({"preset", "seed", ...}) or None for real weights."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    info = raw.get(SYNTHETIC_KEY)
    return info if isinstance(info, dict) else None


def model_display_name(model_dir: str | os.PathLike) -> str:
    """The model's name as every command shows it; says plainly when its weights are random."""
    path = Path(model_dir)
    info = synthetic_info(path)
    if info is None:
        return path.name
    return f"{path.name} ({info.get('preset', 'synthetic')} preset, RANDOM WEIGHTS: output is noise)"
