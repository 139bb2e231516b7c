"""Can the megakernel run here? The one place that says: the GPU it is built for, the nvcc that builds it, and the
models and settings it implements.

Torch-free and cheap to import: `northcode doctor` asks it without torch, and northcode/runtime.py asks it
before deciding a backend (auto takes the megakernel only where nothing here blocks it). Each `*_blocker`
returns why not, in words, or None; the callers put them in their own sentences.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from northcode.config import ModelConfig, env_cuda_homes
from northcode.engine.settings import PAGE_SIZE

KERNEL_CAPABILITY = (9, 0)  # csrc/megakernel.cu is compiled for sm_90a only (H100 / H200)
MIN_NVCC_RELEASE = 12  # the first CUDA release that compiles sm_90a


def nvcc_path() -> str | None:
    """nvcc on PATH, else in the bin/ of $CUDA_HOME, $CUDA_PATH or /usr/local/cuda; None when none has it."""
    for candidate in [shutil.which("nvcc")] + [os.path.join(home, "bin", "nvcc") for home in env_cuda_homes()]:
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def nvcc_release(nvcc: str) -> str | None:
    """The "X.Y" release `nvcc --version` reports, or None when it cannot be run or read."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def gpu_blocker(capability: tuple[int, int], gpu_name: str) -> str | None:
    """Why a GPU of this compute capability cannot run the kernel, or None."""
    if tuple(capability) == KERNEL_CAPABILITY:
        return None
    return f"{gpu_name} is sm_{capability[0]}{capability[1]}; the megakernel is built for sm_90a (H100/H200)"


def model_blocker(config: ModelConfig, page_size: int, dtype_name: str = "bfloat16") -> str | None:
    """Why the kernel cannot run this model with these settings (dtype, page size, geometry), or None."""
    if dtype_name != "bfloat16":
        return f"the weights are {dtype_name}; the megakernel reads bfloat16"
    if page_size != PAGE_SIZE:
        return f"page_size is {page_size}; the megakernel's pages hold {PAGE_SIZE} tokens"
    reason = unsupported_reason(config)
    return f"the model's geometry is not supported: {reason}" if reason else None


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the megakernel cannot run this model's geometry, or None when it can."""
    checks = [
        (config.num_shared_experts == 0, "shared experts are not implemented in the megakernel"),
        (config.hidden_size % 64 == 0, f"hidden_size {config.hidden_size} is not a multiple of 64"),
        (config.q_size % 32 == 0, f"num_attention_heads*head_dim {config.q_size} is not a multiple of 32"),
        (config.head_dim % 16 == 0, f"head_dim {config.head_dim} is not a multiple of 16"),
        (config.intermediate_size % 32 == 0, f"intermediate_size {config.intermediate_size} is not a multiple of 32"),
        (config.dense_intermediate_size % 32 == 0,
         f"dense intermediate size {config.dense_intermediate_size} is not a multiple of 32"),
        (config.num_experts <= 256 and config.num_experts_per_tok <= 32, "more than 256 experts or top-k above 32"),
        (config.num_attention_heads // config.num_key_value_heads * config.head_dim * 4 <= 64 * 1024,
         "query group too large for the attention task's shared memory"),
    ]
    for ok, why in checks:
        if not ok:
            return why
    return None
