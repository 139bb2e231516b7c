"""CPU: lab/kernel_text.py builds the megakernel's cubin as the engine's flags say, finds the kernel's code in it,
tells identical builds from different ones, and reads nvdisasm's inline chains. Skips the builds without nvcc."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from northcode.megakernel.kernel import find_nvcc

TOOL = Path(__file__).resolve().parent / "kernel_text.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("kernel_text", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_builds_compare_by_the_kernels_code(tmp_path) -> None:
    from northcode.megakernel.kernel import SOURCE

    try:
        find_nvcc()
    except RuntimeError as err:
        pytest.skip(str(err))
    tool = load_tool()
    report = tool.build("tiny", tmp_path / "a.cubin")
    assert report.endswith("0 bytes spilled"), report
    code = tool.kernel_text((tmp_path / "a.cubin").read_bytes())
    assert len(code) > 10_000 and len(code) % 16 == 0  # Hopper instructions are 16 bytes
    edited = tmp_path / "edited.cu"  # the MoE ring 3 steps deep instead of 4
    edited.write_text(SOURCE.read_text().replace("constexpr int kMoeStages = 4;", "constexpr int kMoeStages = 3;"))
    assert edited.read_text() != SOURCE.read_text()
    tool.build("tiny", tmp_path / "b.cubin", edited)
    assert tool.main(["same", str(tmp_path / "a.cubin"), str(tmp_path / "a.cubin")]) == 0
    assert tool.main(["same", str(tmp_path / "a.cubin"), str(tmp_path / "b.cubin")]) == 1
    with pytest.raises(ValueError, match="no section"):
        tool.kernel_text((tmp_path / "a.cubin").read_bytes(), ".text.nothing")


def test_region_follows_the_inline_chain() -> None:
    listing = '''
\t//## File "megakernel.cu", line 419 inlined at "megakernel.cu", line 865
\t//## File "megakernel.cu", line 865 inlined at "megakernel.cu", line 871
\t//## File "megakernel.cu", line 871
        /*19c30*/                   IMAD.SHL.U32 R16, R228, 0x2, RZ ;
        /*19c40*/                   ULDC UR4, c[0x0][0x274] ;
\t//## File "megakernel.cu", line 595
        /*8dd0*/                   LDG.E.NA.128.CONSTANT R36, desc[UR6][R36.64] ;
'''.splitlines()
    tool = load_tool()
    assert tool.region(listing, 871) == [("19c30", 419, "IMAD.SHL.U32 R16, R228, 0x2, RZ"),
                                         ("19c40", 419, "ULDC UR4, c[0x0][0x274]")]
    assert [address for address, _, _ in tool.region(listing, 595)] == ["8dd0"]
    assert tool.region(listing, 1) == []
    with pytest.raises(ValueError, match="ELF64"):
        tool.kernel_text(b"not a cubin")


def test_misaligned_descriptors_are_the_odd_uniform_registers() -> None:
    from northcode.megakernel.sass import misaligned_descriptors

    listing = ["        /*1ada0*/                   LDGSTS.E.BYPASS.128 [R6+UR0+0x2800], desc[UR1][R30.64] ;",
               "        /*1adc0*/                   LDGSTS.E.BYPASS.128 [R29+0x2800], desc[UR6][R28.64+0x400] ;",
               "        /*8dd0*/                   LDG.E.NA.128.CONSTANT R36, desc[UR10][R36.64] ;",
               "        /*8de0*/                   STG.E desc[UR13][R2.64], R5 ;",
               "        /*8df0*/                   IMAD R1, R2, 0x3, RZ ;"]
    assert misaligned_descriptors(listing) == [listing[0].strip(), listing[3].strip()]
