"""The decode megakernel from Python: build csrc/megakernel.cu, check its C ABI, build task lists, run steps.

`build_library(config)` compiles the .cu for the checkpoint's geometry (compile-time constants) into a
cache under paths.data_dir()/kernels keyed by a hash of source, geometry, nvcc flags and nvcc version;
`Megakernel` owns the library, the scratch buffers, the per-(batch, splits) task lists
(tasks.py builds them), the mask slots (`MaskSlots`: pinned host memory a constrained row's SAMPLE
waits on, so a mask can be written while its step runs) and the text mask (device memory: what a dormant
grammar's rule allows besides its trigger, uploaded once), and launches one step per call on the current
stream without waiting for it; backend.py's `MegakernelBackend` is the engine's decode backend over it.
Sampling happens on the device; this file never schedules requests and holds no engine state.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from northcode import paths
from northcode.config import ModelConfig
from northcode.engine.device import to_device
from northcode.engine.request import is_greedy_temperature
from northcode.engine.sampling import NEVER, NO_DORMANT_RULE  # MaskSlot's trigger kNoMask, its dormant -1
from northcode.megakernel.support import nvcc_path, unsupported_reason
from northcode.megakernel.tasks import (MAX_SPLITS, PAGE_SIZE, TASK_WORDS, Schedule, TaskType, attention_splits,
                                        build_schedule, flatten, make_task, place_waves, summarize_profile)

__all__ = ["Megakernel", "RowSpec", "Schedule", "TaskType", "attention_splits", "build_library", "raise_for_status",
           "build_schedule", "flatten", "geometry", "load_library", "make_task", "place_waves", "summarize_profile",
           "unsupported_reason", "MAX_SPLITS", "PAGE_SIZE", "TASK_WORDS"]

ABI_VERSION = 9
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "megakernel.cu"
NVCC_FLAGS = ("-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
GEOMETRY_FIELDS = ("NC_HIDDEN", "NC_HEADS", "NC_KV_HEADS", "NC_HEAD_DIM", "NC_VOCAB", "NC_EXPERTS",
                   "NC_TOPK", "NC_EXPERT_WIDTH", "NC_DENSE_WIDTH", "NC_MAX_BATCH", "NC_MAX_SPLITS", "NC_RMS_NORM",
                   "NC_SELECT_SIGMOID", "NC_NORM_TOPK")
MAX_BATCH = 8
STATUS_MESSAGES = {1: "a dependency wait timed out (counter {0}, target {1}): the step hung",
                   2: "task {0} has an unknown type {1}", 3: "layer {0}, row {1}: a needed KV page is unmapped",
                   4: "row {0}: token id {1} is outside the vocabulary",
                   5: "row {0}: its token mask (step {1}) was not released by the host in time: the step hung"}


def raise_for_status(status: list[int], kernel) -> None:
    """RuntimeError when the kernel's status words (code, detail, detail, ...) report a failure; the status
    (kernel.io[MAX_BATCH:], sticky on the device) is reset first, so that later steps of the kernel run."""
    if status[0] != 0:
        kernel.io[MAX_BATCH:].zero_()
        message = STATUS_MESSAGES.get(status[0], "unknown failure {0} {1}").format(status[1], status[2])
        raise RuntimeError(f"megakernel: step failed: {message}")


LAYER_PTR_NAMES = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                   "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight",
                   "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate_proj.weight",
                   "mlp.up_proj.weight", "mlp.down_proj.weight")  # order of LayerPtr in the .cu



# --- geometry and build ---


def geometry(config: ModelConfig) -> dict[str, int]:
    """The -D defines that fix the kernel's geometry (order: GEOMETRY_FIELDS): every per-layer shape, not the
    depth (the task lists carry the layers), so a shallow copy of a model shares its build."""
    values = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
              config.head_dim, config.vocab_size, config.num_experts, config.num_experts_per_tok,
              config.intermediate_size, config.dense_intermediate_size, MAX_BATCH, MAX_SPLITS,
              int(config.uses_rms_norm), int(config.expert_selection_fn == "sigmoid"), int(config.norm_topk_prob))
    return dict(zip(GEOMETRY_FIELDS, values))


def find_nvcc() -> str:
    """support.nvcc_path, or RuntimeError saying where it was looked for."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("megakernel: nvcc not found (put it on PATH or set CUDA_HOME)")
    return nvcc


def nvcc_command(config: ModelConfig, output: Path, extra_flags: tuple[str, ...] = ()) -> list[str]:
    defines = [f"-D{k}={v}" for k, v in geometry(config).items()]
    return [find_nvcc(), *NVCC_FLAGS, *extra_flags, *defines, "-o", str(output), str(SOURCE)]


def build_library(config: ModelConfig, cache_dir: Path | None = None) -> Path:
    """Compile (first use) and return the shared library for this geometry; builds are cached and locked."""
    reason = unsupported_reason(config)
    if reason:
        raise ValueError(f"megakernel: unsupported model: {reason}")
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + repr((geometry(config), NVCC_FLAGS, version)).encode()).hexdigest()[:20]
    cache_dir = cache_dir or paths.data_dir() / "kernels"
    cache_dir.mkdir(parents=True, exist_ok=True)
    library = cache_dir / f"megakernel-{key}.so"
    if library.is_file():
        return library
    with open(cache_dir / f".build-{key}.lock", "w") as lock:  # per build: two geometries compile in parallel
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.is_file():
            return library
        partial = library.with_suffix(f".tmp{os.getpid()}")
        result = subprocess.run(nvcc_command(config, partial), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"megakernel: nvcc failed for {SOURCE}:\n{result.stderr[-4000:]}")
        partial.rename(library)
    return library


# --- the C ABI (mirrors of Params, Task and RowState in the .cu) ---

_U64, _I32, _F32, _I64 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_float, ctypes.c_int64
SCRATCH_FIELDS = ("x", "h", "q", "attn_partial", "attn_ml", "attn_out", "router_logits", "moe_slots",
                  "slot_weight", "moe_act", "dense_act", "logits", "noisy", "lm_partial", "expert_counts", "routed")
# Params fields after the scratch pointers: profile (0 = off), then the scalars


class Params(ctypes.Structure):
    _fields_ = [("layer_ptrs", _U64), ("embed", _U64), ("final_norm", _U64), ("lm_head", _U64), ("inv_freq", _U64),
                ("k_pool", _U64), ("v_pool", _U64), ("block_tables", _U64), ("num_pages", _I64),
                ("max_seqs", _I32), ("max_pages_per_seq", _I32), ("tasks", _U64), ("task_start", _U64),
                ("num_blocks", _I32), ("batch_size", _I32), ("counters", _U64), ("num_counters", _I32),
                ("rows", _U64), ("tokens", _U64), ("status", _U64), ("text_mask", _U64),
                *[(name, _U64) for name in SCRATCH_FIELDS], ("profile", _U64),
                ("norm_eps", _F32), ("logit_scale", _F32), ("timeout_ns", _I64), ("trace_x", _U64),
                ("trace_router", _U64)]


ROW_FORMAT = "<iiiiQfffiQ"  # RowState: position, seq, step, top_k, seed, temperature, top_p, min_p, mask_seq, mask
SLOT_HEADER_WORDS = 4  # MaskSlot: ready, trigger, dormant, a word of padding, then the mask words


def load_library(path: Path, config: ModelConfig) -> ctypes.CDLL:
    """Open a built library and check its ABI version, struct sizes and geometry against this file's."""
    lib = ctypes.CDLL(str(path))
    lib.nc_last_error.restype = ctypes.c_char_p
    lib.nc_decode_step.argtypes = [ctypes.POINTER(Params), ctypes.c_void_p]
    lib.nc_host_device_pointer.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.nc_release_mask.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    checks = [("ABI version", lib.nc_abi_version(), ABI_VERSION),
              ("sizeof(Params)", lib.nc_params_size(), ctypes.sizeof(Params)),
              ("sizeof(Task)", lib.nc_task_size(), TASK_WORDS * 4),
              ("sizeof(RowState)", lib.nc_row_size(), struct.calcsize(ROW_FORMAT)),
              ("sizeof(MaskSlot)", lib.nc_mask_slot_size(), 4 * (SLOT_HEADER_WORDS + mask_words(config.vocab_size)))]
    built = (ctypes.c_int * len(GEOMETRY_FIELDS))()
    lib.nc_geometry(built, len(GEOMETRY_FIELDS))
    checks.append(("geometry", list(built), list(geometry(config).values())))
    for what, got, expected in checks:
        if got != expected:
            raise RuntimeError(f"megakernel: {path.name}: {what} is {got}, Python expects {expected} (stale build?)")
    if lib.nc_init() != 0:
        raise RuntimeError(f"megakernel: {lib.nc_last_error().decode()}")
    return lib


# --- the runner ---


@dataclass(frozen=True, slots=True)
class RowSpec:
    """One batch row of a step: which sequence, at which position, and how to sample its next token."""

    position: int  # tokens already cached for the sequence; the row's token goes here
    seq: int  # block-table row
    step: int = 0  # the request's draw counter (seeds the noise)
    seed: int = 0
    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    mask: int = 0  # device address of the row's mask slot (Megakernel.mask_address); 0: unconstrained
    mask_seq: int = -1  # the step's number, which the slot's ready word takes when its mask is released; -1: no slot

    def pack(self, vocab_size: int) -> bytes:
        """The row's RowState (ROW_FORMAT), taking every value a validated request carries (issue 24): a top_k
        at or above the vocabulary is off (0) as the kernel reads it, the seed is taken modulo 2^64, and a
        temperature below SAMPLING_EPS is greedy (0: the kernel's 1/T overflows fp32 at 1e-39). ValueError,
        naming the field, for an integer beyond int32 or a float beyond fp32."""
        for name in ("position", "seq", "step"):
            if not 0 <= getattr(self, name) < 2**31:
                raise ValueError(f"megakernel: row {name} = {getattr(self, name)}: must be in [0, 2^31)")
        if self.mask and not 0 <= self.mask_seq < 2**31:
            raise ValueError(f"megakernel: row mask_seq = {self.mask_seq}: must be in [0, 2^31) with a mask slot")
        for name in ("temperature", "top_p", "min_p"):
            if not abs(getattr(self, name)) <= 3.4028234663852886e38:  # NaN fails too
                raise ValueError(f"megakernel: row {name} = {getattr(self, name)}: must be a finite fp32 number")
        top_k = self.top_k if 0 < self.top_k < vocab_size else 0
        temperature = 0.0 if is_greedy_temperature(self.temperature) else self.temperature
        return struct.pack(ROW_FORMAT, self.position, self.seq, self.step, top_k, self.seed & (2**64 - 1),
                           temperature, self.top_p, self.min_p, self.mask_seq if self.mask else -1, self.mask)


def mask_words(vocab_size: int) -> int:
    """int32 words of a slot's mask: ceil(V / 32), padded to a multiple of 4 (the kernel reads uint4s)."""
    return -(-vocab_size // 128) * 4


class MaskSlots:
    """Pinned host memory, mapped into the device's address space, that constrained rows read their token masks
    from (MaskSlot in the .cu: ready, trigger, dormant, padding, the words; one per 128 bytes). `release` writes a slot
    and then, after a fence, its ready word: the step whose rows point at it waits for that in SAMPLE, so the
    host may write a mask after the launch, while the model part of the step runs. A slot is rewritten only
    once the step that read it is done (the backend's turns)."""

    def __init__(self, num_slots: int, vocab_size: int, lib: ctypes.CDLL) -> None:
        self.num_words = -(-vocab_size // 32)
        self.stride = -(-(SLOT_HEADER_WORDS + mask_words(vocab_size)) // 32) * 32  # int32 words, 128-byte aligned
        self.host = torch.zeros(num_slots, self.stride, dtype=torch.int32).pin_memory()  # caching host allocator
        self.host[:, 0] = -1  # ready: no step yet (steps count from 1)
        self._lib = lib
        device = ctypes.c_void_p()
        if lib.nc_host_device_pointer(ctypes.c_void_p(self.host.data_ptr()), ctypes.byref(device)) != 0:
            raise RuntimeError(f"megakernel: {lib.nc_last_error().decode()}")
        self.base = device.value

    def address(self, slot: int) -> int:
        """The device address of `slot` (what a RowSpec's mask holds)."""
        assert 0 <= slot < self.host.shape[0], f"mask slot {slot} of {self.host.shape[0]}"
        return self.base + slot * self.stride * 4

    def release(self, slot: int, seq: int, bits: torch.Tensor | None, trigger: int,
                dormant: int = NO_DORMANT_RULE) -> None:
        """Write the slot's mask (bits: int32 [ceil(V / 32)], or None: no words this step), its trigger
        (sampling.ALWAYS or a token id) and its dormant rule (NO_DORMANT_RULE, or the trigger a row may sample
        besides the text tokens where the words do not apply), then release it as step `seq`."""
        assert bits is None or bits.device.type == "cpu", "a mask from the device: its copy would wait for this step"
        row = self.host[slot]
        if bits is None:
            row[1] = NEVER  # its words do not apply this step
        else:
            row[SLOT_HEADER_WORDS:SLOT_HEADER_WORDS + self.num_words].copy_(bits)
            row[1] = trigger
        row[2] = dormant
        self._lib.nc_release_mask(ctypes.c_void_p(row.data_ptr()), seq)


class Megakernel:
    """One model's megakernel on one GPU: weights, KV pools and block tables by pointer, scratch owned here.

    `step(rows, tokens)` launches one decode step on the current stream and returns at once; the next
    tokens land in `self.tokens` (device int32 [8]) and the fp32 logits in `self.logits` [8, V].
    Call `check()` (it synchronises) to turn a device-side failure into an exception.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], k_pool: torch.Tensor,
                 v_pool: torch.Tensor, block_tables: torch.Tensor, num_blocks: int | None = None,
                 timeout_s: float = 20.0, row_buffers: int = 8, mask_slots: int = 2 * MAX_BATCH) -> None:
        """row_buffers: pinned staging buffers of the row states, used in turn; a launch waits for the copy out
        of the buffer it reuses (row_buffers launches back). Twice a step's launches: a step enqueued while the
        previous one runs never waits. mask_slots: MaskSlots to allocate (the backend uses two per row)."""
        from northcode.model.model import rope_inv_freq

        self.config, self.device = config, k_pool.device
        self.lib = load_library(build_library(config), config)
        self.num_blocks = num_blocks or torch.cuda.get_device_properties(self.device).multi_processor_count
        self._weights = self._check_weights(weights)
        self.layer_ptrs = torch.tensor(self._layer_pointers(), dtype=torch.int64, device=self.device)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta).to(self.device)
        self._allocate_scratch()
        self.params = Params(
            layer_ptrs=self.layer_ptrs.data_ptr(), embed=self._weights["model.embed_tokens.weight"].data_ptr(),
            final_norm=self._weights["model.norm.weight"].data_ptr(), lm_head=self._weights["lm_head.weight"].data_ptr(),
            inv_freq=self.inv_freq.data_ptr(), rows=self.rows.data_ptr(), tokens=self.io.data_ptr(),
            status=self.io[MAX_BATCH:].data_ptr(), norm_eps=config.norm_eps, logit_scale=config.logit_scale,
            timeout_ns=int(timeout_s * 1e9), **{name: getattr(self, name).data_ptr() for name in SCRATCH_FIELDS})
        self.set_cache(k_pool, v_pool, block_tables)
        self._schedules: dict[tuple[int, ...], Schedule] = {}  # (batch, *splits) -> the step's task lists
        self.trace_x = self.trace_router = None  # enable_trace() allocates them
        row_bytes = MAX_BATCH * struct.calcsize(ROW_FORMAT)
        self._rows_host = [torch.zeros(row_bytes, dtype=torch.uint8).pin_memory() for _ in range(row_buffers)]
        self._rows_copied = [torch.cuda.Event() for _ in range(row_buffers)]  # rewritten only after its copy
        self._rows_turn = 0
        self.mask_slots = MaskSlots(mask_slots, config.vocab_size, self.lib)
        self._slot_addresses = {self.mask_slots.address(k) for k in range(mask_slots)}
        self.text_mask: torch.Tensor | None = None  # device int32 [mask_words(V)], once set_text_mask uploaded it

    def _check_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        checked = {}
        for name, tensor in weights.items():
            if tensor.dtype != torch.bfloat16 or tensor.device != self.device or not tensor.is_contiguous():
                raise ValueError(f"megakernel: weight {name} must be a contiguous bfloat16 tensor on {self.device} "
                                 f"(got {tensor.dtype} on {tensor.device}, contiguous={tensor.is_contiguous()})")
            if tensor.data_ptr() % 16:  # the kernel reads weights in 16-byte pieces (loads and cp.async)
                raise ValueError(f"megakernel: weight {name} starts at an address that is not a multiple of 16 bytes "
                                 f"(a view into a larger tensor?); copy it with .clone()")
            checked[name] = tensor
        for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if name not in checked:
                raise ValueError(f"megakernel: weight {name} is missing")
        return checked

    def _layer_pointers(self) -> list[list[int]]:
        table = []
        for layer in range(self.config.num_hidden_layers):
            row = []
            for name in LAYER_PTR_NAMES:
                tensor = self._weights.get(f"model.layers.{layer}.{name}")
                row.append(tensor.data_ptr() if tensor is not None else 0)
            needed = (0, 1, 2, 3, 4) + ((8, 9, 10) if self.config.is_dense(layer) else (5, 6, 7))
            for j in needed:
                if row[j] == 0:
                    raise ValueError(f"megakernel: weight model.layers.{layer}.{LAYER_PTR_NAMES[j]} is missing")
            table.append(row)
        return table

    def _allocate_scratch(self) -> None:
        c, dev, b = self.config, self.device, MAX_BATCH
        group_width = c.num_attention_heads // c.num_key_value_heads * c.head_dim
        f32, bf16 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.bfloat16, device=dev)
        self.x, self.h = torch.zeros(b, c.hidden_size, **f32), torch.zeros(b, c.hidden_size, **bf16)
        self.q, self.attn_out = torch.zeros(b, c.q_size, **bf16), torch.zeros(b, c.q_size, **bf16)
        self.attn_partial = torch.zeros(b, c.num_key_value_heads, MAX_SPLITS, group_width, **f32)
        self.attn_ml = torch.zeros(b, c.num_key_value_heads, MAX_SPLITS, group_width // c.head_dim, 2, **f32)
        self.router_logits = torch.zeros(b, c.num_experts, **f32)
        self.moe_slots = torch.zeros(1 + c.num_experts, dtype=torch.int32, device=dev)
        self.slot_weight = torch.zeros(c.num_experts, b, **f32)
        self.moe_act = torch.zeros(c.num_experts, b, c.intermediate_size, **bf16)
        self.dense_act = torch.zeros(b, c.dense_intermediate_size, **bf16)
        self.logits = torch.zeros(b, c.vocab_size, **f32)
        self.noisy = torch.zeros(b, c.vocab_size, **f32)
        self.lm_partial = torch.zeros(4 * self.num_blocks + 8, b, 4, **f32)
        self.expert_counts = torch.zeros(c.num_hidden_layers, dtype=torch.int32, device=dev)
        self.routed = torch.zeros(c.num_hidden_layers, b, c.num_experts_per_tok, dtype=torch.int32, device=dev)
        self.rows = torch.zeros(b * struct.calcsize(ROW_FORMAT), dtype=torch.uint8, device=dev)
        self.io = torch.zeros(MAX_BATCH + 4, dtype=torch.int32, device=dev)  # tokens [8], then status [4]
        self.counters = torch.zeros(1, dtype=torch.int32, device=dev)

    @property
    def tokens(self) -> torch.Tensor:
        return self.io[:MAX_BATCH]

    def set_cache(self, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor) -> None:
        """Point the kernel at the KV pools [pages, 64, KVH, D] and device block tables int32 [L, seqs, pages]."""
        c = self.config
        expected = (PAGE_SIZE, c.num_key_value_heads, c.head_dim)
        for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
            if tuple(pool.shape[1:]) != expected or pool.dtype != torch.bfloat16 or not pool.is_contiguous():
                raise ValueError(f"megakernel: {name} must be contiguous bf16 [pages, {', '.join(map(str, expected))}], "
                                 f"got {pool.dtype} {list(pool.shape)}")
        if block_tables.dtype != torch.int32 or block_tables.dim() != 3 or block_tables.shape[0] != c.num_hidden_layers \
                or block_tables.device != self.device or not block_tables.is_contiguous():
            raise ValueError(f"megakernel: block_tables must be contiguous int32 [{c.num_hidden_layers}, seqs, pages] "
                             f"on {self.device}, got {block_tables.dtype} {list(block_tables.shape)}")
        self._cache = (k_pool, v_pool, block_tables)
        p = self.params
        p.k_pool, p.v_pool, p.block_tables = k_pool.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr()
        p.num_pages, p.max_seqs, p.max_pages_per_seq = k_pool.shape[0], block_tables.shape[1], block_tables.shape[2]

    def schedule(self, batch: int, context: int) -> Schedule:
        """The (cached) task lists for this batch size and longest context; a new one goes up through pinned
        memory without a sync (a longer context's first step does not stall the pipelined engine)."""
        splits = attention_splits(self.config, batch, self.num_blocks, context)
        key = (batch, *splits)
        if key not in self._schedules:
            s = build_schedule(self.config, batch, self.num_blocks, splits)
            self._schedules[key] = Schedule(to_device(s.tasks, self.device), to_device(s.task_start, self.device),
                                            s.num_counters, s.num_lm_tasks)
        return self._schedules[key]

    def mask_address(self, slot: int) -> int:
        """The device address of mask slot `slot`, for a RowSpec's mask."""
        return self.mask_slots.address(slot)

    def release_mask(self, slot: int, seq: int, bits: torch.Tensor | None, trigger: int,
                     dormant: int = NO_DORMANT_RULE) -> None:
        """Write mask slot `slot` (bits: int32 [ceil(V / 32)], None: no words this step) and release it as step
        `seq`: the rows pointing at it with that mask_seq sample once this returns (MaskSlots.release). A dormant
        rule reads the text mask set_text_mask uploaded before the step's launch (none: the row is unconstrained)."""
        self.mask_slots.release(slot, seq, bits, trigger, dormant)

    def set_text_mask(self, bits: torch.Tensor) -> None:
        """Upload the text tokens, host int32 [ceil(V / 32)] (GrammarCompiler.text_mask: static), that a dormant
        rule allows besides its trigger, on the current stream: launches enqueued after it read it."""
        assert bits.dtype == torch.int32 and bits.shape == (-(-self.config.vocab_size // 32),), "text mask shape"
        padded = torch.zeros(mask_words(self.config.vocab_size), dtype=torch.int32)  # the kernel reads uint4s
        padded[:bits.shape[0]] = bits
        self.text_mask = to_device(padded, self.device)
        self.params.text_mask = self.text_mask.data_ptr()

    def collect(self, tokens: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        """Enqueue copies of the last launch's sampled tokens (int32 [n]) and, when given, logits ([n, V] fp32)
        into these device tensors: the next launch overwrites the io buffer and the logits."""
        tokens.copy_(self.tokens[:tokens.shape[0]])
        if logits is not None:
            logits.copy_(self.logits[:logits.shape[0]])

    def set_rows(self, rows: list[RowSpec]) -> None:
        """Upload the rows' states (stream-ordered copy from pinned memory: the host never waits)."""
        if not 1 <= len(rows) <= MAX_BATCH:
            raise ValueError(f"megakernel: batch of {len(rows)} rows, must be 1..{MAX_BATCH}")
        for r in rows:
            if r.mask and r.mask not in self._slot_addresses:
                raise ValueError(f"megakernel: a row's mask {r.mask:#x} is not one of the kernel's mask slots")
        packed = b"".join(r.pack(self.config.vocab_size) for r in rows)
        turn = self._rows_turn = (self._rows_turn + 1) % len(self._rows_host)
        self._rows_copied[turn].synchronize()
        host = self._rows_host[turn]
        host[:len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        self.rows[:len(packed)].copy_(host[:len(packed)], non_blocking=True)
        self._rows_copied[turn].record()

    def step(self, rows: list[RowSpec], tokens: torch.Tensor | None = None) -> None:
        """Launch one decode step for `rows`; row b feeds `tokens[b]` (default: what the last step sampled)."""
        self.set_rows(rows)
        if tokens is not None:
            self.tokens[:len(rows)].copy_(tokens.to(self.device, torch.int32), non_blocking=True)
        self.launch(self.schedule(len(rows), max(r.position for r in rows)), len(rows))

    def launch(self, schedule: Schedule, batch: int) -> None:
        """Run a schedule (the decode step's or a test's own task list) on the current stream."""
        if schedule.tasks.device != self.device:
            schedule = Schedule(schedule.tasks.to(self.device), schedule.task_start.to(self.device),
                                schedule.num_counters, schedule.num_lm_tasks)
        if self.counters.numel() < schedule.num_counters:
            self.counters = torch.zeros(schedule.num_counters, dtype=torch.int32, device=self.device)
        p = self.params
        p.tasks, p.task_start = schedule.tasks.data_ptr(), schedule.task_start.data_ptr()
        p.num_blocks, p.batch_size = schedule.task_start.numel() - 1, batch
        p.counters, p.num_counters = self.counters.data_ptr(), schedule.num_counters
        self._keep = schedule  # alive until the next launch (the kernel reads it asynchronously)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self.lib.nc_decode_step(ctypes.byref(p), ctypes.c_void_p(stream)) != 0:
            raise RuntimeError(f"megakernel: {self.lib.nc_last_error().decode()}")

    def profile_step(self, rows: list[RowSpec], tokens: torch.Tensor | None = None) -> dict:
        """Run one step with per-task timestamps and return summarize_profile's breakdown (synchronises), with
        the raw record under "raw" (CPU tensors: tasks, task_start, times; lab/profile_report.py reads it)."""
        schedule = self.schedule(len(rows), max(r.position for r in rows))
        times = torch.zeros(schedule.tasks.shape[0], 3, dtype=torch.int64, device=self.device)
        self.params.profile = times.data_ptr()
        try:
            self.step(rows, tokens)
            self.check()
        finally:
            self.params.profile = 0
        tasks, task_start, times = schedule.tasks.cpu(), schedule.task_start.cpu(), times.cpu()
        return dict(summarize_profile(tasks, task_start, times), raw=dict(tasks=tasks, task_start=task_start, times=times))

    def enable_trace(self, on: bool = True) -> None:
        """Record, each step, the residual every layer reads (`trace_x` [L + 1, 8, H] fp32, row L: the final
        norm's input) and every layer's router logits (`trace_router` [L, 8, E]) for the whole-step checks."""
        c = self.config
        if on:
            self.trace_x = torch.zeros(c.num_hidden_layers + 1, MAX_BATCH, c.hidden_size, device=self.device)
            self.trace_router = torch.zeros(c.num_hidden_layers, MAX_BATCH, c.num_experts, device=self.device)
            self.params.trace_x, self.params.trace_router = self.trace_x.data_ptr(), self.trace_router.data_ptr()
        else:
            self.params.trace_x = self.params.trace_router = 0
            self.trace_x = self.trace_router = None

    def check(self) -> None:
        """Synchronise and raise RuntimeError if the last step failed on the device (then reset the status)."""
        raise_for_status(self.io[MAX_BATCH:].tolist(), self)
