"""The megakernel's machine code, offline (no GPU): build a cubin as the engine would, compare two builds' kernel
code byte for byte, and read an nvdisasm listing by source line.

    python lab/kernel_text.py build /tmp/a.cubin                    # the full geometry, ptxas's registers / spills
    python lab/kernel_text.py build /tmp/b.cubin --source /tmp/edited.cu   # an edited copy of the .cu
    python lab/kernel_text.py same /tmp/a.cubin /tmp/b.cubin        # is the kernel's .text byte-identical?
    nvdisasm -gi -c /tmp/a.cubin > /tmp/a.sass                      # nvdisasm: pip wheel nvidia-cuda-nvdisasm
    python lab/kernel_text.py region /tmp/a.sass 877                # instructions inlined from megakernel.cu:877
    python lab/kernel_text.py check /tmp/a.cubin                    # instructions the GPU refuses (megakernel/sass.py)

`same` is how a change meant to leave the kernel's code alone is checked (a comment, a rename): the figures
measured on the old build then still hold. `region` matched o_proj's instructions across builds in day 3
session 5 (notebook.md, run 77).
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
from pathlib import Path

KERNEL_SECTION = ".text._Z16nc_decode_kernel6Params"


def kernel_text(cubin: bytes, section: str = KERNEL_SECTION) -> bytes:
    """The bytes of one section of an ELF64 cubin (the kernel's code by default), by its section headers."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not an ELF64 file (a cubin from nvcc -cubin)")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    for name_at, _, _, _, offset, size, *_ in headers:
        start = names_offset + name_at
        if cubin[start:cubin.index(b"\0", start)].decode() == section:
            return cubin[offset:offset + size]
    raise ValueError(f"no section {section} in the cubin")


def build_command(preset: str, output: Path, source: Path | None = None) -> list[str]:
    """nvcc_command's flags and geometry defines, for a cubin instead of a library, of the package's .cu or of
    `source` (an edited copy)."""
    from northcode.megakernel.kernel import nvcc_command
    from northcode.model.synthetic import preset_config

    config = preset_config(preset, 1003 if preset == "tiny" else None)
    command = nvcc_command(config, output, ("-Xptxas", "-v"))
    if source is not None:
        command[-1] = str(source)
    library_only = {"-shared", "-fPIC"}
    kept = [arg for i, arg in enumerate(command)
            if arg not in library_only and not (arg == "-Xcompiler" and command[i + 1] == "-fPIC")]
    return kept[:1] + ["-cubin"] + kept[1:]


def build(preset: str, output: Path, source: Path | None = None) -> str:
    """Builds the cubin; returns ptxas's registers and spills of the kernel ("255 registers, 0 bytes spilled")."""
    result = subprocess.run(build_command(preset, output, source), capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    registers = re.findall(r"Used (\d+) registers", result.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", result.stderr)
    return f"{registers[-1]} registers, {spills[-1]} bytes spilled"


def region(listing: list[str], line: int) -> list[tuple[str, int, str]]:
    """(address, innermost source line, instruction) of every instruction of an `nvdisasm -gi -c` listing whose
    inline chain (the `//## File ..., line N` comments before it, innermost first) contains `line`."""
    chain: list[int] = []
    fresh = True
    found = []
    for text in listing:
        marker = re.match(r'\s*//## File ".*?", line (\d+)', text)
        if marker:
            chain = [] if fresh else chain
            fresh = False
            chain.append(int(marker.group(1)))
            continue
        fresh = True
        instruction = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)
        if instruction and line in chain:
            found.append((instruction.group(1), chain[0], instruction.group(2).strip()))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="build the kernel's cubin")
    make.add_argument("output", type=Path)
    make.add_argument("--preset", default="north-mini-code")
    make.add_argument("--source", type=Path, default=None,
                      help="an edited copy of megakernel.cu (default: the package's)")
    same = commands.add_parser("same", help="compare two cubins' kernel code byte for byte")
    same.add_argument("cubins", type=Path, nargs=2)
    check = commands.add_parser("check", help="instructions the GPU refuses (northcode/megakernel/sass.py)")
    check.add_argument("cubin", type=Path)
    lines = commands.add_parser("region", help="instructions inlined from one source line of megakernel.cu")
    lines.add_argument("listing", type=Path)
    lines.add_argument("line", type=int)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(f"{args.output}: {build(args.preset, args.output, args.source)}")
    elif args.command == "check":
        from northcode.megakernel.sass import disassemble, find_nvdisasm, misaligned_descriptors

        nvdisasm = find_nvdisasm()
        if nvdisasm is None:
            print("nvdisasm not found (pip install nvidia-cuda-nvdisasm)", file=sys.stderr)
            return 2
        bad = misaligned_descriptors(disassemble(args.cubin, nvdisasm))
        print(f"{len(bad)} instructions with a descriptor in an odd uniform register", *bad[:10], sep="\n")
        return 1 if bad else 0
    elif args.command == "same":
        a, b = (kernel_text(path.read_bytes()) for path in args.cubins)
        print(f"{'identical' if a == b else 'different'}: {len(a)} and {len(b)} bytes of kernel code")
        return 0 if a == b else 1
    else:
        for address, innermost, instruction in region(args.listing.read_text().splitlines(), args.line):
            print(address, innermost, instruction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
