"""EngineSettings: how the engine runs a model (batch, pages, chunks, memory, device), validated once.

The model's math lives in config.py (ModelConfig); this file holds only what a user or a
benchmark may set. Every field a user can set is checked in `__post_init__` with a ValueError that
names it. Derived values that need the model or the device (the page count, the context length)
are computed by the engine at start-up, never written back here. `cpu_threads` takes OMP_NUM_THREADS
(config.env_cpu_threads) when no setting names the thread count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from northcode.config import env_cpu_threads

BACKENDS = ("auto", "torch", "megakernel")  # auto: northcode/runtime.py decides, and says why
PAGE_SIZE = 64  # tokens per KV page: the default, and the only page the megakernel is built for
DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_DEFAULT_THREADS = 4  # torch's CPU threads by default: at most this many, and at most half the cores


def cpu_threads(num_threads: int | None) -> int:
    """torch's CPU threads (torch.set_num_threads, once at engine start): num_threads; else OMP_NUM_THREADS when
    it is a positive integer; else half the cores this process may run on, between 1 and MAX_DEFAULT_THREADS.
    Why not torch's default (one per core): the engine shares the machine with its server, tokenizer, the TUI
    or other work, and an OpenMP pool whose threads wait for busy cores stalls every op (issue 24: `generate`
    ran at 4-10 tokens/s beside other work on 2 cores, 142 with one thread)."""
    if num_threads is not None:
        return num_threads
    if env_cpu_threads() is not None:
        return env_cpu_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


@dataclass(frozen=True, slots=True)
class EngineSettings:
    max_batch: int = 8  # sequences in one step (decode rows + prefilling sequences)
    page_size: int = PAGE_SIZE  # tokens per KV page
    # prefill tokens per step (all prefilling sequences together): a 4096-token prompt of the full model on the
    # H200 took 437 ms in chunks of 512 (each chunk reads every expert), 185 ms in 2048, 166 ms in 4096, while
    # a running decode waits for each chunk (~90 ms at 2048)
    chunk_size: int = 2048
    gpu_memory_fraction: float = 0.90  # of the GPU memory free after the weights, for the KV pool
    cpu_kv_bytes: int = 2 << 30  # KV pool budget on the CPU (K and V together)
    num_pages: int | None = None  # fixed pool size (tests, benchmarks); None: from the memory above
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the pool
    backend: str = "auto"  # auto: the megakernel where it can run (sm_90, nvcc, supported geometry), else torch
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    enable_prefix_cache: bool = True
    cuda_graphs: bool = True  # decode step in a CUDA graph per batch size (GPU only)
    # torch backend: torch.compile the decode step before graph capture (torch_backend/compiled_step.py); None:
    # NORTHCODE_TORCH_COMPILE=0/1 when set, else on with CUDA graphs on a GPU (compiled_step.compile_requested)
    compile: bool | None = None
    seed: int | None = None  # draws the seeds of requests that give none; None: fresh entropy
    num_threads: int | None = None  # torch's CPU threads, set at engine start; None: cpu_threads' default
    # the step watchdog (watchdog.py): a step (its prefill chunks, decode and sampling) that runs longer than
    # this ends its requests with an error and restarts the backend; None: no watchdog. 30 s is hundreds of
    # times a decode step of the full model even at 128K context, and longer than the megakernel's own 20 s
    # dependency-wait timeout (its hang becomes an exception first)
    step_timeout_s: float | None = 30.0
    # the limit of a step of a shape not run before (it may capture a CUDA graph or torch.compile: 272 s
    # measured for batch 1 on the H200) and of a backend restart
    first_step_timeout_s: float = 900.0
    # after the watchdog fired, how long the hung step may take to return before the device is declared
    # lost (a fatal error: every request fails, /health reports it, the server should exit non-zero)
    hang_grace_s: float = 60.0

    def __post_init__(self) -> None:
        def reject(name: str, why: str) -> None:
            raise ValueError(f"engine setting {name} = {getattr(self, name)!r}: {why}")

        for name in ("max_batch", "page_size", "chunk_size", "cpu_kv_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                reject(name, "must be a positive integer")
        if self.max_batch > 64:
            reject("max_batch", "must be <= 64")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            reject("gpu_memory_fraction", "must be in (0, 1]")
        for name in ("num_pages", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                reject(name, "must be a positive integer or None")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            reject("max_model_len", "must be an integer >= 2 or None")
        for name in ("step_timeout_s", "first_step_timeout_s", "hang_grace_s"):
            value = getattr(self, name)
            if value is None and name == "step_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                reject(name, "must be a positive number of seconds" + (" or None" if name == "step_timeout_s" else ""))
        if self.backend not in BACKENDS:
            reject("backend", f"must be one of {list(BACKENDS)}")
        if self.dtype not in DTYPES:
            reject("dtype", f"must be one of {list(DTYPES)}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            reject("device", "must be auto, cpu, cuda or cuda:N")
