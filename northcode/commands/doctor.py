"""`northcode doctor`: what this machine can run, and which model northcode would load.

Reports Python, torch (version, CPU or CUDA build), the GPU (name, compute capability, free
memory), nvcc (path, version), whether the decode megakernel can run here (and why not), how the torch
backend's decode step would run (compiled or eager), and the model. It never creates the demo checkpoint; it only says where it would be created.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

from northcode.megakernel.support import KERNEL_CAPABILITY, MIN_NVCC_RELEASE, nvcc_path, nvcc_release

HELP = "report Python, torch, CUDA, nvcc and the model northcode would load"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--brief", action="store_true", help="a few lines (what install.sh prints)")
    parser.add_argument("--model", metavar="DIR", help="report this checkpoint folder instead of the default")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    report = collect_report(args.model)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, brief=args.brief))
    return 1 if report["model"].get("error") else 0


# --- collecting ---

def collect_report(model: str | None = None) -> dict[str, Any]:
    torch_info = _torch_info()
    nvcc = _nvcc_info()
    return {
        "northcode": _northcode_version(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": torch_info,
        "nvcc": nvcc,
        "megakernel": _megakernel_verdict(torch_info, nvcc),
        "torch_step": _torch_step(torch_info),
        "model": _model_info(model),
    }


def _northcode_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("northcode")
    except PackageNotFoundError:
        return "not installed (running from the source tree)"


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError as err:
        return {"error": f"torch is not importable: {err}"}
    info: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "devices": []}
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(index)
            major, minor = torch.cuda.get_device_capability(index)
            info["devices"].append({"index": index, "name": torch.cuda.get_device_name(index),
                                    "compute_capability": f"{major}.{minor}",
                                    "free_memory_bytes": free, "total_memory_bytes": total})
    return info


def _nvcc_info() -> dict[str, Any]:
    path = nvcc_path()  # the megakernel's own search (megakernel/support.py)
    return {"path": path, "version": nvcc_release(path) if path else None}


def _megakernel_verdict(torch_info: dict[str, Any], nvcc: dict[str, Any]) -> dict[str, Any]:
    """Can the megakernel be built and run here? Needs a CUDA torch, an sm_90 GPU and nvcc >= 12."""
    reasons = []
    if not torch_info.get("cuda_build"):
        reasons.append("torch is a CPU build")
    devices = torch_info.get("devices", [])
    wanted = "{}.{}".format(*KERNEL_CAPABILITY)
    if not torch_info.get("cuda_available"):
        reasons.append("no CUDA GPU is visible")
    elif not any(d["compute_capability"] == wanted for d in devices):
        found = ", ".join(f"{d['name']} (sm_{d['compute_capability'].replace('.', '')})" for d in devices)
        reasons.append(f"needs an sm_90 GPU (H100/H200), found {found}")
    if nvcc.get("path") is None:
        reasons.append("nvcc is not on PATH (nor in CUDA_HOME or /usr/local/cuda)")
    elif nvcc.get("version") and int(nvcc["version"].split(".")[0]) < MIN_NVCC_RELEASE:
        reasons.append(f"nvcc {nvcc['version']} is too old for sm_90a (needs {MIN_NVCC_RELEASE}.0 or later)")
    return {"can_run": not reasons, "why_not": reasons}


def _torch_step(torch_info: dict[str, Any]) -> dict[str, Any]:
    """How the torch backend's decode step would run here: compiled (torch.compile at start-up, the default with
    CUDA graphs on a GPU) or eager; NORTHCODE_TORCH_COMPILE decides when set (a bad value is reported)."""
    if "error" in torch_info:
        return {"error": torch_info["error"]}
    import torch

    from northcode.torch_backend.compiled_step import compile_requested

    device = torch.device("cuda" if torch_info["cuda_available"] else "cpu")
    try:
        return {"compiled": compile_requested(None, device), "device": device.type}
    except ValueError as err:
        return {"error": str(err)}


def _model_info(model: str | None) -> dict[str, Any]:
    from northcode import paths

    if model is None and not (paths.demo_checkpoint_dir() / "config.json").is_file():
        where = paths.demo_checkpoint_dir()
        return {"path": str(where), "name": f"demo checkpoint (created on first use at {where})", "exists": False}
    try:
        path = paths.resolve_model(model)  # the demo checkpoint exists here, so this creates nothing
        from northcode.config import ModelConfig

        config = ModelConfig.from_file(path)
    except ValueError as err:
        return {"path": model, "error": str(err)}
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return {"path": str(path), "name": paths.model_display_name(path), "exists": True,
            "layers": config.num_hidden_layers, "experts": config.num_experts, "vocab_size": config.vocab_size,
            "weights_bytes": size}


# --- formatting ---

def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


def format_report(report: dict[str, Any], brief: bool = False) -> str:
    t, nvcc, mk, model = report["torch"], report["nvcc"], report["megakernel"], report["model"]
    lines = [f"northcode   {report['northcode']}",
             f"python      {report['python']['version']} ({report['python']['executable']})"]
    if "error" in t:
        lines.append(f"torch       {t['error']}")
    else:
        build = f"CUDA {t['cuda_build']} build" if t["cuda_build"] else "CPU build"
        lines.append(f"torch       {t['version']} ({build})")
        lines.append("cuda        " + ("available" if t["cuda_available"] else "not available"))
        for d in t["devices"]:
            lines.append(f"  gpu {d['index']}     {d['name']}, compute capability {d['compute_capability']}, "
                         f"{d['free_memory_bytes'] / 2**30:.1f} GiB free of {d['total_memory_bytes'] / 2**30:.1f} GiB")
    if not brief:
        lines.append("nvcc        " + (f"{nvcc['path']} (release {nvcc['version']})" if nvcc["path"] else "not found"))
    lines.append("megakernel  " + ("can run here" if mk["can_run"] else "cannot run here: " + "; ".join(mk["why_not"])))
    step = {} if brief else report.get("torch_step", {})
    if "error" in step:
        lines.append(f"torch step  ERROR: {step['error']}")
    elif step.get("compiled"):
        lines.append("torch step  compiled with torch.compile at start-up (minutes the first time, then cached; "
                     "NORTHCODE_TORCH_COMPILE=0: plain CUDA graphs)")
    elif step:
        lines.append("torch step  eager" + (" (the CPU)" if step["device"] == "cpu" else "")
                     + "; NORTHCODE_TORCH_COMPILE=1 compiles it")
    if "error" in model:
        lines.append(f"model       ERROR: {model['error']}")
    else:
        lines.append(f"model       {model['name']}")
        if model["exists"] and not brief:
            lines.append(f"            {model['path']}: {model['layers']} layers, {model['experts']} experts, "
                         f"vocab {model['vocab_size']}, {_size(model['weights_bytes'])} of weights")
    return "\n".join(lines)
