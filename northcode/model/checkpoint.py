"""Checkpoint files <-> canonical weights: safetensors shards streamed onto a device, and back.

`load_checkpoint` returns the canonical weights of docs/architecture.md (transformers-5 names,
fused experts [E, 2I, H] / [E, H, I], lm_head the same object as the embedding when tied),
whatever expert layout the files use. It reads one tensor at a time into tensors preallocated
on the target device, so host memory never holds more than one tensor of the checkpoint.
Every problem with the files (missing, unexpected, wrong shape or dtype, truncated shard) is a
ValueError that names the file and the tensor. transformers 5.24's save_pretrained writes the
per-expert layout (it undoes its load-time fusion); the fused one is accepted too. No model here.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from northcode.config import ModelConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
DISK_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
               "float": torch.float32}
PROGRESS_BAR_MIN_BYTES = 1 << 30  # show a progress bar from 1 GiB on
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports include; never weights
ProgressCallback = Callable[[int, int], None]  # (done_bytes, total_bytes)


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a torch dtype (accepts "bfloat16", "float32", ...); ValueError for anything else."""
    if dtype is None or dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r}: must be one of bfloat16, float16, float32")


# --- canonical names and the on-disk layouts ---

def canonical_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical weight name with its shape, in checkpoint order (lm_head listed even when tied)."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.is_dense(i):
            shapes.update(_mlp_shapes(p + "mlp.", c.dense_intermediate_size, c.hidden_size))
            continue
        shapes[p + "mlp.gate.weight"] = (c.num_experts, c.hidden_size)
        shapes[p + "mlp.experts.gate_up_proj"] = (c.num_experts, 2 * c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.experts.down_proj"] = (c.num_experts, c.hidden_size, c.intermediate_size)
        if c.num_shared_experts:
            width = c.intermediate_size * c.num_shared_experts
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", width, c.hidden_size))
    shapes["model.norm.weight"] = (c.hidden_size,)
    shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def _mlp_shapes(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (width, hidden), prefix + "up_proj.weight": (width, hidden),
            prefix + "down_proj.weight": (hidden, width)}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one tensor on disk goes: `weights[target][index]` (index () = the whole tensor)."""

    target: str
    index: tuple
    shape: tuple[int, ...]


def disk_layout(config: ModelConfig, fused_layers: set[int] | frozenset[int] = frozenset()) -> dict[str, Placement]:
    """On-disk tensor name -> placement. Sparse layers in `fused_layers` store experts fused
    (transformers 5), the others per expert (the published shards). lm_head only when untied."""
    layout: dict[str, Placement] = {}
    intermediate = config.intermediate_size
    for name, shape in canonical_shapes(config).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        prefix, _, leaf = name.rpartition(".experts.")
        layer_idx = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if not prefix or layer_idx in fused_layers:
            layout[name] = Placement(name, (), shape)
            continue
        for e in range(config.num_experts):
            expert = f"{prefix}.experts.{e}."
            if leaf == "gate_up_proj":
                layout[expert + "gate_proj.weight"] = Placement(name, (e, slice(0, intermediate)),
                                                                (intermediate, shape[2]))
                layout[expert + "up_proj.weight"] = Placement(name, (e, slice(intermediate, 2 * intermediate)),
                                                              (intermediate, shape[2]))
            else:
                layout[expert + "down_proj.weight"] = Placement(name, (e,), shape[1:])
    return layout


# --- reading safetensors headers ---

@dataclass(frozen=True, slots=True)
class DiskTensor:
    file: Path
    name: str
    dtype: str  # safetensors dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the data section (reading in this order is sequential)
    num_bytes: int


_ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_header(path: Path) -> dict[str, DiskTensor]:
    """The tensors a safetensors file declares, checked against the file's size (truncation)."""
    try:
        with open(path, "rb") as f:
            file_bytes = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated or not a safetensors file ({file_bytes} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if 8 + header_len > file_bytes:
                raise ValueError(f"{path}: truncated: its header says {header_len} bytes, the file has {file_bytes}")
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise ValueError(f"{path}: shard file is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    tensors = {name: _header_entry(path, name, spec) for name, spec in header.items() if name != "__metadata__"}
    for tensor in tensors.values():
        if data_start + tensor.offset + tensor.num_bytes > file_bytes:
            raise ValueError(f"{path}: truncated: tensor {tensor.name} ends at byte "
                             f"{data_start + tensor.offset + tensor.num_bytes}, the file has {file_bytes} bytes")
    return tensors


def _header_entry(path: Path, name: str, spec: Any) -> DiskTensor:
    try:
        (begin, end), dtype, shape = spec["data_offsets"], spec["dtype"], tuple(spec["shape"])
        expected_bytes = math.prod(shape) * _ITEM_BYTES.get(dtype, 0)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name}: malformed safetensors header entry {spec!r}") from None
    if dtype in _ITEM_BYTES and end - begin != expected_bytes:
        raise ValueError(f"{path}: tensor {name}: header gives {end - begin} bytes for shape {list(shape)} {dtype}")
    return DiskTensor(path, name, dtype, shape, begin, end - begin)


def find_shards(model_dir: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files to read and, when there is an index, its weight_map (tensor -> file name)."""
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path}: not a valid index (needs a 'weight_map' object): {err}") from None
        return [model_dir / name for name in sorted(set(weight_map.values()))], weight_map
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{model_dir}: no *.safetensors files and no {INDEX_NAME}")
    return shards, None


def scan_checkpoint(model_dir: Path) -> dict[str, DiskTensor]:
    """Every tensor in the checkpoint's shards, checked against the index when there is one."""
    shards, weight_map = find_shards(model_dir)
    found: dict[str, DiskTensor] = {}
    for shard in shards:
        for name, tensor in read_header(shard).items():
            if name in found:
                raise ValueError(f"{shard}: tensor {name} is also in {found[name].file.name}")
            found[name] = tensor
    for name, file_name in (weight_map or {}).items():
        if name not in found:
            raise ValueError(f"{model_dir / file_name}: tensor {name} (listed in {INDEX_NAME}) is not in this file")
        if found[name].file.name != file_name:
            raise ValueError(f"{found[name].file}: tensor {name} is here, but {INDEX_NAME} says {file_name}")
    return found


# --- loading ---

def load_checkpoint(model_dir: str | os.PathLike, device: str | torch.device = "cpu",
                    dtype: torch.dtype | str | None = None,
                    progress: ProgressCallback | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, canonical weights on `device`), in `dtype` (default: the checkpoint's own dtype)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_file(model_dir)
    dtype = resolve_dtype(dtype)
    on_disk = {name: t for name, t in scan_checkpoint(model_dir).items() if not name.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        on_disk.pop("lm_head.weight", None)  # a tied head saved anyway: transformers ignores it too
    fused = {i for i in range(config.num_hidden_layers) if f"model.layers.{i}.mlp.experts.gate_up_proj" in on_disk
             or f"model.layers.{i}.mlp.experts.down_proj" in on_disk}
    layout = disk_layout(config, fused)
    _check_names_and_shapes(model_dir, config, layout, on_disk)
    if dtype is None:
        dtype = DISK_DTYPES[on_disk["model.embed_tokens.weight"].dtype]
    weights = {name: torch.empty(shape, dtype=dtype, device=device)
               for name, shape in canonical_shapes(config).items()}
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    _stream_into(weights, layout, on_disk, progress)
    return config, weights


def _check_names_and_shapes(model_dir: Path, config: ModelConfig, layout: dict[str, Placement],
                            on_disk: dict[str, DiskTensor]) -> None:
    for name, tensor in on_disk.items():
        if name not in layout:
            raise ValueError(f"{tensor.file}: unexpected tensor {name} (not part of a cohere2_moe model "
                             f"with this config.json{_layout_hint(name, config)})")
        if tensor.shape != layout[name].shape:
            raise ValueError(f"{tensor.file}: tensor {name} has shape {list(tensor.shape)}, "
                             f"config.json implies {list(layout[name].shape)}")
        if tensor.dtype not in DISK_DTYPES:
            raise ValueError(f"{tensor.file}: tensor {name} has dtype {tensor.dtype}, "
                             f"expected one of {', '.join(DISK_DTYPES)}")
    missing = [name for name in layout if name not in on_disk]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{model_dir}: tensor {missing[0]} is missing from the checkpoint's shards{more}")


def _layout_hint(name: str, config: ModelConfig) -> str:
    if name == "lm_head.weight":
        return ": lm_head.weight is present but tie_word_embeddings is true"
    if ".experts." in name:
        return ": a layer mixes the per-expert and the fused expert layouts, or the expert index is out of range"
    return ""


def _stream_into(weights: dict[str, torch.Tensor], layout: dict[str, Placement],
                 on_disk: dict[str, DiskTensor], progress: ProgressCallback | None) -> None:
    """Copy each disk tensor into its place, shard by shard, in file order; report bytes done."""
    total_bytes = sum(t.num_bytes for t in on_disk.values())
    done_bytes = 0
    by_file: dict[Path, list[DiskTensor]] = {}
    for tensor in sorted(on_disk.values(), key=lambda t: (t.file, t.offset)):
        by_file.setdefault(tensor.file, []).append(tensor)
    with _progress_bar(total_bytes) as bar:
        for path, tensors in by_file.items():
            bar.set_description(f"loading {path.name}")
            with _open_shard(path) as f:
                for tensor in tensors:
                    place = layout[tensor.name]
                    weights[place.target][place.index].copy_(_read_tensor(f, tensor))
                    done_bytes += tensor.num_bytes
                    bar.update(tensor.num_bytes)
                    if progress is not None:
                        progress(done_bytes, total_bytes)


def _open_shard(path: Path):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as err:  # safetensors raises its own SafetensorError (not OSError) for damaged files
        raise ValueError(f"{path}: cannot open the shard: {err}") from None


def _read_tensor(shard, tensor: DiskTensor) -> torch.Tensor:
    try:
        return shard.get_tensor(tensor.name)
    except Exception as err:  # as above: a damaged file, named with the tensor
        raise ValueError(f"{tensor.file}: cannot read tensor {tensor.name}: {err}") from None


def _progress_bar(total_bytes: int):
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, file=sys.stderr, leave=False,
                disable=total_bytes < PROGRESS_BAR_MIN_BYTES)


# --- writing ---

def save_checkpoint(out_dir: str | os.PathLike, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                    max_shard_bytes: int, expert_layout: str = "per_expert") -> list[Path]:
    """Write config.json, safetensors shards of at most `max_shard_bytes` and the index.

    `weights` is canonical; it may be a lazy Mapping (each tensor is read once, in order), so a
    61 GB model is written holding one shard in host memory. Returns the shard paths."""
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout {expert_layout!r}: must be 'per_expert' or 'fused'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fused = set(range(config.num_hidden_layers)) if expert_layout == "fused" else set()
    shard_paths, weight_map, total_bytes, dtypes = _write_shards(out_dir, _disk_tensors(config, weights, fused),
                                                                 max_shard_bytes)
    if len(shard_paths) == 1:
        shard_paths[0] = shard_paths[0].rename(out_dir / SINGLE_FILE_NAME)
        (out_dir / INDEX_NAME).unlink(missing_ok=True)
    else:
        count = len(shard_paths)
        renamed = [path.rename(out_dir / f"model-{k + 1:05d}-of-{count:05d}.safetensors")
                   for k, path in enumerate(shard_paths)]
        names = {old.name: new.name for old, new in zip(shard_paths, renamed)}
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": {tensor: names[file] for tensor, file in weight_map.items()}}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        shard_paths = renamed
    raw = config.to_dict()
    if len(dtypes) == 1:
        raw["dtype"] = str(dtypes.pop()).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return shard_paths


def _disk_tensors(config: ModelConfig, weights: Mapping[str, torch.Tensor],
                  fused_layers: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """(disk name, contiguous CPU tensor) in checkpoint order, reading each canonical tensor once."""
    layout = disk_layout(config, fused_layers)
    by_target: dict[str, list[tuple[str, Placement]]] = {}
    for disk_name, place in layout.items():
        by_target.setdefault(place.target, []).append((disk_name, place))
    for target, parts in by_target.items():
        if target not in weights:
            raise ValueError(f"weights: tensor {target} is missing")
        full = weights[target]
        expected = canonical_shapes(config)[target]
        if tuple(full.shape) != expected:
            raise ValueError(f"weights: tensor {target} has shape {list(full.shape)}, expected {list(expected)}")
        for disk_name, place in parts:
            yield disk_name, full[place.index].to("cpu", copy=True).contiguous()  # owns its memory: no sharing


def _write_shards(out_dir: Path, tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int):
    """Write shards under temporary names (their count is known only at the end)."""
    shard_paths: list[Path] = []
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total_bytes = 0
    dtypes: set[torch.dtype] = set()

    def flush() -> None:
        path = out_dir / f".shard-{len(shard_paths):05d}.safetensors.partial"
        save_file(pending, str(path), metadata={"format": "pt"})
        shard_paths.append(path)
        weight_map.update({name: path.name for name in pending})
        pending.clear()

    for name, tensor in tensors:
        num_bytes = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + num_bytes > max_shard_bytes:
            flush()
            pending_bytes = 0
        pending[name] = tensor
        pending_bytes += num_bytes
        total_bytes += num_bytes
        dtypes.add(tensor.dtype)
    if pending:
        flush()
    return shard_paths, weight_map, total_bytes, dtypes
