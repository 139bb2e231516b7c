"""Which decode backend runs the model (EngineSettings.backend = auto | torch | megakernel), and why.

`megakernel_blocker` lists, in order, what keeps the megakernel (megakernel/kernel.py; the engine's backend
over it: megakernel/backend.py) from running here: a device that is not a CUDA GPU, a GPU that is not sm_90
(the kernel is built for sm_90a: H100/H200), no nvcc to build it, a dtype other than bfloat16, pages other
than the kernel's 64 tokens, or a model geometry the kernel does not implement
(megakernel.unsupported_reason). `choose_backend` turns the
setting into a BackendChoice: "auto" takes the megakernel when nothing blocks it and torch otherwise,
with the reason either way; "megakernel" where it cannot run is a ValueError naming the reason; "torch"
is always possible. `build_backend` constructs it; under "auto" a megakernel that fails to start (an
nvcc error, say) falls back to torch, and the choice says so. The engine reports the choice in
stats() ("backend", "backend_reason") and in a log line.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

import torch

from northcode.config import ModelConfig
from northcode.engine.backend import ModelBackend
from northcode.engine.settings import EngineSettings

log = logging.getLogger(__name__)
KERNEL_CAPABILITY = (9, 0)  # the megakernel is compiled for sm_90a only
KERNEL_PAGE_SIZE = 64
# auto takes the megakernel once it has passed its whole-step checks on the H200 at the full geometry:
# passed 2026-11-29 (docs/performance.md, runs 4-7: 49 layers at B = 1 and 8 and a 32K context, the
# kernel's logit error against fp32 0.95-1.0x the bf16 PyTorch path's). Set False to make auto serve
# with torch again (a kernel change that has not passed those checks).
MEGAKERNEL_VALIDATED = True


@dataclass(frozen=True, slots=True)
class BackendChoice:
    name: str  # "torch" or "megakernel"
    reason: str  # why, in words: shown by stats() and the server's start-up lines


def find_nvcc() -> str | None:
    """nvcc's path (PATH, then $CUDA_HOME/bin), or None. The megakernel module has the same search."""
    try:
        from northcode.megakernel.kernel import find_nvcc as kernel_find_nvcc
    except Exception:  # the module is broken or missing: megakernel_blocker says so
        return shutil.which("nvcc")
    try:
        return kernel_find_nvcc()
    except RuntimeError:
        return None


def megakernel_blocker(config: ModelConfig, settings: EngineSettings, device: torch.device, dtype: torch.dtype,
                       capability: tuple[int, int] | None = None, nvcc: str | None | bool = False) -> str | None:
    """Why the megakernel cannot run this model here, or None. `capability` and `nvcc` default to this
    machine's (tests pass them to check the decision for another machine)."""
    if device.type != "cuda":
        return f"the model runs on the {device.type.upper()}, and the megakernel needs a CUDA GPU"
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != KERNEL_CAPABILITY:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "the GPU"
        return (f"{name} is sm_{capability[0]}{capability[1]}; the megakernel is built for sm_90a "
                "(H100/H200)")
    if nvcc is False:
        nvcc = find_nvcc()
    if not nvcc:
        return "nvcc was not found (put the CUDA toolkit's bin on PATH or set CUDA_HOME) to build the megakernel"
    if dtype != torch.bfloat16:
        return f"the weights are {str(dtype).removeprefix('torch.')}; the megakernel reads bfloat16"
    if settings.page_size != KERNEL_PAGE_SIZE:
        return f"page_size is {settings.page_size}; the megakernel's pages hold {KERNEL_PAGE_SIZE} tokens"
    try:
        from northcode.megakernel.kernel import unsupported_reason
    except Exception as err:  # ImportError, or a broken module: torch still serves under auto
        return f"the megakernel module cannot be imported ({type(err).__name__}: {err})"
    reason = unsupported_reason(config)
    return f"the model's geometry is not supported: {reason}" if reason else None


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


def build_backend(choice: BackendChoice, config: ModelConfig, weights: dict[str, torch.Tensor],
                  settings: EngineSettings, num_pages: int,
                  max_pages_per_seq: int) -> tuple[ModelBackend, BackendChoice]:
    """Construct the chosen backend (every backend takes the same arguments, backend.py). Under auto, a
    megakernel that fails to start gives way to torch; the returned choice then says why."""
    if choice.name == "megakernel":
        try:
            from northcode.megakernel.backend import MegakernelBackend

            backend = MegakernelBackend(config, weights, num_pages, settings.page_size, settings.max_batch,
                                        max_pages_per_seq, cuda_graphs=settings.cuda_graphs)
            return backend, choice
        except Exception as err:
            if settings.backend == "megakernel":
                raise
            log.warning("the megakernel failed to start; using the torch backend", exc_info=True)
            choice = BackendChoice("torch", f"auto: the megakernel failed to start ({type(err).__name__}: "
                                            f"{str(err)[:300]})")
    from northcode.torch_backend.backend import TorchBackend

    backend = TorchBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                           cuda_graphs=settings.cuda_graphs, compile=settings.compile)
    return backend, choice


def check_backend_setting(model: ModelConfig | str, settings: EngineSettings) -> None:
    """Refuse backend = megakernel where it cannot run, before any weight is read: ValueError naming the
    reason. `model` is a ModelConfig or a checkpoint folder. serve and bench engine call this first,
    because building the engine reads every weight (minutes for the full model) before it decides."""
    if settings.backend != "megakernel":
        return
    from northcode.engine.engine import resolve_device, resolve_dtype

    config = model if isinstance(model, ModelConfig) else ModelConfig.from_file(model)
    device = resolve_device(settings.device)
    choose_backend(config, settings, device, resolve_dtype(settings.dtype, device))
