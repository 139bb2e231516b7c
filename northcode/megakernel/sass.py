"""The megakernel's machine code read with nvdisasm (CUDA's disassembler; the pip wheel nvidia-cuda-nvdisasm where
the toolkit has none), for faults the compiler lets through and only a GPU would meet.

ptxas 13.0 once placed the 64-bit L2-policy descriptor of 32 cp.async copies in an odd uniform register
(`LDGSTS.E.BYPASS.128 [R6+UR0+0x2800], desc[UR1][R30.64]`) in an experimental build of the kernel; the GPU stopped
there with "an illegal instruction was encountered" (compute-sanitizer named the copy), and nothing before the GPU
noticed. The compile test disassembles each geometry's build and looks.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

DESCRIPTOR = re.compile(r"desc\[UR(\d+)\]")  # a memory descriptor: a 64-bit pair of uniform registers


def find_nvdisasm() -> str | None:
    """nvdisasm on PATH, else the one of the nvidia-cuda-nvdisasm wheel (nvidia/cu*/bin), else None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(path)
    return None


def disassemble(cubin: Path, nvdisasm: str) -> list[str]:
    """nvdisasm -c: the cubin's code sections as SASS lines."""
    result = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, timeout=300)
    if result.returncode:
        raise RuntimeError(f"nvdisasm {cubin}: {result.stderr.strip()[-2000:]}")
    return result.stdout.splitlines()


def misaligned_descriptors(listing: list[str]) -> list[str]:
    """The instructions whose descriptor pair starts at an odd uniform register (the GPU refuses them)."""
    return [line.strip() for line in listing if any(int(n) % 2 for n in DESCRIPTOR.findall(line))]
