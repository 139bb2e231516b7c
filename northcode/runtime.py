"""Above the engine: which backend runs the model (auto | torch | megakernel, and why), and the Engine built over it.

The only module that names both backends; northcode.engine imports neither and takes a backend factory.
`choose_backend` resolves EngineSettings.backend for a model and a machine: "auto" takes the megakernel
where nothing blocks it (megakernel/support.py says what can: a device that is not a CUDA GPU, a GPU that is
not sm_90, no nvcc to build it, a dtype other than bfloat16, pages other than its 64 tokens, a geometry it does
not implement) and torch otherwise, with the reason either way; "megakernel" where it cannot run is a
ValueError naming the reason; "torch" is always possible. `BackendBuilder` is the Engine's factory for a
choice: under auto a megakernel that fails to start (an nvcc error, say) gives way to torch, and its `reason`
says so (the engine reports it in stats() and a log line). `build_engine` and `load_engine` build the Engine;
the commands (serve, bench) and the tests build theirs here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from northcode.config import ModelConfig
from northcode.engine.backend import BackendChoice, ModelBackend
from northcode.engine.engine import Engine
from northcode.engine.settings import EngineSettings
from northcode.megakernel.support import gpu_blocker, model_blocker, nvcc_path
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend
from northcode.torch_backend.compiled_step import compile_requested, compiled_pool_pages

log = logging.getLogger(__name__)
# auto takes the megakernel once it has passed its whole-step checks on the H200 at the full geometry (all 49
# layers at B = 1 and 8 and a 32K context, the kernel's logit error against fp32 0.95-1.0x the bf16 PyTorch
# path's; passed 2026-11-29). Set False to make auto serve with torch again (a kernel change that has not
# passed those checks).
MEGAKERNEL_VALIDATED = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine setting device = {name!r}: CUDA is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def megakernel_blocker(config: ModelConfig, settings: EngineSettings, device: torch.device, dtype: torch.dtype,
                       capability: tuple[int, int] | None = None, nvcc: str | None | bool = False) -> str | None:
    """Why the megakernel cannot run this model here, or None. `capability` and `nvcc` default to this
    machine's (tests pass them to check the decision for another machine)."""
    if device.type != "cuda":
        return f"the model runs on the {device.type.upper()}, and the megakernel needs a CUDA GPU"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "the GPU"
    reason = gpu_blocker(capability, name)
    if reason:
        return reason
    if nvcc is False:
        nvcc = nvcc_path()
    if not nvcc:
        return "nvcc was not found (put the CUDA toolkit's bin on PATH or set CUDA_HOME) to build the megakernel"
    return model_blocker(config, settings.page_size, str(dtype).removeprefix("torch."))


def choose_backend(config: ModelConfig, settings: EngineSettings, device: torch.device, dtype: torch.dtype,
                   capability: tuple[int, int] | None = None, nvcc: str | None | bool = False,
                   validated: bool = MEGAKERNEL_VALIDATED) -> BackendChoice:
    """settings.backend resolved for this model and machine; ValueError when 'megakernel' cannot run."""
    if settings.backend == "torch":
        return BackendChoice("torch", "asked for (backend = torch)")
    blocker = megakernel_blocker(config, settings, device, dtype, capability, nvcc)
    if settings.backend == "megakernel":
        if blocker:
            raise ValueError(f"engine setting backend = 'megakernel': it cannot run here: {blocker} "
                             "(use backend auto or torch)")
        return BackendChoice("megakernel", "asked for (backend = megakernel)")
    if blocker:
        return BackendChoice("torch", f"auto: {blocker}")
    if not validated:
        return BackendChoice("torch", "auto: the megakernel could run here but has not yet passed its whole-step "
                                      "checks at this geometry on the H200 (use backend megakernel to try it)")
    return BackendChoice("megakernel", "auto: sm_90 GPU, nvcc found, bfloat16, geometry supported")


def page_limit(choice: BackendChoice, config: ModelConfig, settings: EngineSettings, device: torch.device) -> int | None:
    """The most KV pages the chosen backend can run over, or None: the torch backend's compiled decode step
    indexes its pool with 32-bit offsets (compiled_step.compiled_pool_pages; NORTHCODE_TORCH_COMPILE=0 runs
    the eager step over any pool)."""
    if choice.name != "torch" or not compile_requested(settings.compile, device, settings.cuda_graphs):
        return None
    return compiled_pool_pages(config, settings.page_size)


class BackendBuilder:
    """The Engine's backend factory for one BackendChoice; `reason` says why the backend it built last runs."""

    def __init__(self, choice: BackendChoice) -> None:
        self.choice = choice

    @property
    def reason(self) -> str:
        return self.choice.reason

    def __call__(self, config: ModelConfig, weights: dict[str, torch.Tensor], settings: EngineSettings,
                 num_pages: int, max_pages_per_seq: int) -> ModelBackend:
        """Every backend takes the same arguments. Under auto, a megakernel that fails to start gives way to
        torch, from then on (a rebuild after a failed step builds torch too)."""
        if self.choice.name == "megakernel":
            try:
                from northcode.megakernel.backend import MegakernelBackend  # a broken module: torch under auto

                return MegakernelBackend(config, weights, num_pages, settings.page_size, settings.max_batch,
                                         max_pages_per_seq, cuda_graphs=settings.cuda_graphs)
            except Exception as err:
                if settings.backend == "megakernel":
                    raise
                log.warning("the megakernel failed to start; using the torch backend", exc_info=True)
                self.choice = BackendChoice("torch", f"auto: the megakernel failed to start ({type(err).__name__}: "
                                                     f"{str(err)[:300]})")
        return TorchBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                            cuda_graphs=settings.cuda_graphs, compile=settings.compile)


def build_engine(config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer | None,
                 settings: EngineSettings | None = None, model_name: str = "model") -> Engine:
    """The Engine over the backend settings.backend resolves to for these weights (on their device)."""
    settings = settings or EngineSettings()
    embed = weights["model.embed_tokens.weight"]
    choice = choose_backend(config, settings, embed.device, embed.dtype)
    return Engine(config, weights, tokenizer, settings, model_name, backend_factory=BackendBuilder(choice),
                  max_pages=page_limit(choice, config, settings, embed.device))


def load_engine(model_dir: str | Path, settings: EngineSettings | None = None,
                progress: Callable[[int, int], None] | None = None) -> Engine:
    """Read a checkpoint folder (weights onto settings.device, its tokenizer) and build its Engine.
    progress(done_bytes, total_bytes) while the weights load."""
    from northcode.model.checkpoint import load_checkpoint
    from northcode.paths import model_display_name

    settings = settings or EngineSettings()
    device = resolve_device(settings.device)
    config, weights = load_checkpoint(model_dir, device=device, dtype=resolve_dtype(settings.dtype, device),
                                      progress=progress)
    return build_engine(config, weights, Tokenizer.from_dir(model_dir), settings, model_display_name(model_dir))


def check_backend_setting(model: ModelConfig | str | Path, settings: EngineSettings) -> None:
    """Refuse backend = megakernel where it cannot run, before any weight is read: ValueError naming the
    reason. `model` is a ModelConfig or a checkpoint folder. serve and bench engine call this first,
    because building the engine reads every weight (minutes for the full model) before it decides."""
    if settings.backend != "megakernel":
        return
    config = model if isinstance(model, ModelConfig) else ModelConfig.from_file(model)
    device = resolve_device(settings.device)
    choose_backend(config, settings, device, resolve_dtype(settings.dtype, device))
