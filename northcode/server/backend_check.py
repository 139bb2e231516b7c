"""check_backend_setting: refuse `--backend megakernel` where it cannot run, before any weight is read.

The engine makes the same decision (engine/backend_choice.py, choose_backend) when it is built, but
`northcode serve` builds it in a background thread after uvicorn has started, and both serve and
`northcode bench engine` would first read every weight (minutes for the full model). This asks the
engine's own choose_backend with the config alone, so the ValueError naming the reason comes at once
and the command exits 2 with one line. "auto" and "torch" can always run: nothing is checked.
"""

from __future__ import annotations


def check_backend_setting(model, settings) -> None:
    """ValueError (the engine's message, naming the reason) when settings.backend cannot run `model` (a
    ModelConfig, or a checkpoint folder whose config.json is read) here."""
    if settings.backend != "megakernel":
        return
    from northcode.config import ModelConfig
    from northcode.engine.backend_choice import choose_backend
    from northcode.engine.engine import resolve_device, resolve_dtype

    config = model if isinstance(model, ModelConfig) else ModelConfig.from_file(model)

    device = resolve_device(settings.device)
    choose_backend(config, settings, device, resolve_dtype(settings.dtype, device))
