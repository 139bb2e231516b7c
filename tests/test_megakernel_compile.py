"""CPU: northcode/csrc/megakernel.cu compiles with nvcc for sm_90a at the tiny and the full geometry,
with no register spills (ptxas -v), no instruction the GPU refuses (megakernel/sass.py, read with nvdisasm), and
the built library's C ABI matches megakernel/kernel.py's ctypes mirrors. Skips, saying why, where nvcc (or, for
the machine-code check, nvdisasm) is absent."""

from __future__ import annotations

import re
import subprocess

import pytest

from northcode.megakernel.kernel import find_nvcc, nvcc_command, unsupported_reason
from northcode.model.synthetic import preset_config


def _nvcc_or_skip() -> str:
    try:
        return find_nvcc()
    except RuntimeError as err:
        pytest.skip(str(err))


class MisalignedDescriptors(AssertionError):
    """A build with instructions whose memory descriptor sits in an odd uniform register (sass.py)."""


PTXAS_ODD_DESCRIPTORS = pytest.mark.xfail(
    raises=MisalignedDescriptors, strict=True,
    reason="ptxas 13.0 puts 32 cp.async descriptors of this build in odd uniform registers (run 89: the GPU stops "
           "with an illegal instruction); strict: a ptxas that stops doing it makes this test fail, to be unmarked")
BUILDS = ["default", "lean-fused", "norm-local", "topk-rows", "router-registers"]


@pytest.mark.parametrize("build,preset", [
    pytest.param(build, preset, marks=[PTXAS_ODD_DESCRIPTORS] if (build, preset) == ("norm-local", "tiny") else [])
    for preset in ("tiny", "north-mini-code") for build in BUILDS])
def test_compiles_for_sm90a_without_spills(preset: str, build: str, tmp_path) -> None:
    """Every build a variant runs on (Variant.build_defines)."""
    from northcode.megakernel.sass import disassemble, find_nvdisasm, misaligned_descriptors
    from northcode.megakernel.variants import VARIANTS

    _nvcc_or_skip()
    config = preset_config(preset, 1003 if preset == "tiny" else None)
    assert unsupported_reason(config) is None
    defines = VARIANTS[build].build_defines()
    assert bool(defines) == (build != "default")
    flags = ("-Xptxas", "-v", "-keep", "-keep-dir", str(tmp_path))  # -keep: megakernel.cubin for nvdisasm
    result = subprocess.run(nvcc_command(config, tmp_path / "megakernel.so", flags, defines),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert spills, "ptxas printed no resource report"
    assert all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    check_abi(tmp_path / "megakernel.so", config)
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("compiled, no spills, ABI checked; nvdisasm absent (pip install nvidia-cuda-nvdisasm): the "
                    "machine-code check did not run")
    bad = misaligned_descriptors(disassemble(tmp_path / "megakernel.cubin", nvdisasm))
    if bad:
        raise MisalignedDescriptors(f"{len(bad)} instructions with an odd descriptor register, e.g. {bad[0]}")


def check_abi(library, config) -> None:
    """The built library's ABI version, struct sizes and geometry are what megakernel/kernel.py's mirrors say
    (load_library checks the same on a GPU machine, where it also initialises the kernel)."""
    import ctypes
    import struct

    from northcode.megakernel.kernel import ABI_VERSION, GEOMETRY_FIELDS, ROW_FORMAT, TASK_WORDS, Params, geometry

    try:
        lib = ctypes.CDLL(str(library))
    except OSError as err:  # the CUDA runtime library is missing: compile-only machine
        pytest.skip(f"cannot load the built library here: {err}")
    assert lib.nc_abi_version() == ABI_VERSION
    assert lib.nc_params_size() == ctypes.sizeof(Params)
    assert lib.nc_task_size() == TASK_WORDS * 4 and lib.nc_row_size() == struct.calcsize(ROW_FORMAT)
    built = (ctypes.c_int * len(GEOMETRY_FIELDS))()
    assert lib.nc_geometry(built, len(GEOMETRY_FIELDS)) == len(GEOMETRY_FIELDS)
    assert list(built) == list(geometry(config).values())


def test_unsupported_geometry_is_named() -> None:
    config = preset_config("tiny", 1003)
    import dataclasses

    odd = dataclasses.replace(config, hidden_size=120)
    assert "hidden_size 120" in unsupported_reason(odd)


def test_tuning_defines_come_from_the_environment_and_are_checked(monkeypatch, tmp_path) -> None:
    """NORTHCODE_MEGAKERNEL_TUNING adds compile-time knobs to the build (and to its cache key); a name the .cu
    does not know, or a value that is not an integer, is refused with the variable named."""
    from northcode.megakernel.kernel import tuning_defines

    config = preset_config("tiny", 1003)
    monkeypatch.delenv("NORTHCODE_MEGAKERNEL_TUNING", raising=False)
    assert tuning_defines() == {}
    monkeypatch.setattr("northcode.megakernel.kernel.find_nvcc", lambda: "nvcc")
    assert not any(flag.startswith("-DNC_MOE_STAGES") for flag in nvcc_command(config, tmp_path / "k.so"))
    monkeypatch.setenv("NORTHCODE_MEGAKERNEL_TUNING", " NC_MOE_STAGES=10 ")
    assert tuning_defines() == {"NC_MOE_STAGES": 10}
    assert "-DNC_MOE_STAGES=10" in nvcc_command(config, tmp_path / "k.so")
    for bad in ("NC_UNKNOWN=3", "NC_MOE_STAGES=ten", "NC_MOE_STAGES"):
        monkeypatch.setenv("NORTHCODE_MEGAKERNEL_TUNING", bad)
        with pytest.raises(ValueError, match="NORTHCODE_MEGAKERNEL_TUNING"):
            tuning_defines()


def test_packed_experts_put_each_chunks_16_rows_together() -> None:
    """NC_MOE_PACKED's layout (kernel.py pack_row_blocks): in every 16-row block, the 16 rows x 32 columns of
    column chunk c are contiguous, at the offset the .cu's moe_issue reads lane (g, t)'s pieces from; the copy is
    made once per source tensor and version, and again after an in-place change."""
    import torch

    from northcode.megakernel.kernel import pack_row_blocks, packed_copy

    experts, rows, cols = 2, 32, 96
    weight = torch.arange(experts * rows * cols, dtype=torch.float32).view(experts, rows, cols)
    packed = pack_row_blocks(weight).flatten()
    for e, r, k in ((0, 0, 0), (0, 5, 37), (1, 17, 95), (1, 31, 64), (0, 15, 31)):
        block, row, chunk, col = r // 16, r % 16, k // 32, k % 32
        offset = e * rows * cols + block * 16 * cols + (chunk * 16 + row) * 32 + col
        assert packed[offset] == weight[e, r, k]
    g, t, chunk = 3, 2, 1  # lane (g, t)'s 8 values at chunk c: offset (c * 16 + g) * 32 + 8 t in the block
    lo = (chunk * 16 + g) * 32 + 8 * t
    assert torch.equal(packed[lo:lo + 8], weight[0, g, chunk * 32 + 8 * t:chunk * 32 + 8 * t + 8])
    assert torch.equal(packed[lo + 256:lo + 264], weight[0, g + 8, chunk * 32 + 8 * t:chunk * 32 + 8 * t + 8])
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_row_blocks(torch.zeros(2, 24, 64))
    first = packed_copy(weight)
    assert packed_copy(weight) is first
    weight.add_(1)
    assert packed_copy(weight) is not first and torch.equal(packed_copy(weight), pack_row_blocks(weight))


def test_weights_must_be_contiguous_aligned_bfloat16_and_named_when_not() -> None:
    """Megakernel._check_weights (CPU tensors stand in for the GPU's): the kernel reads weights in 16-byte pieces,
    so a view that starts mid-allocation is refused with its name, as a wrong dtype is."""
    import types

    import torch

    from northcode.megakernel.kernel import Megakernel

    host = types.SimpleNamespace(device=torch.device("cpu"))
    good = {name: torch.zeros(64, dtype=torch.bfloat16)
            for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    assert Megakernel._check_weights(host, good) == good
    shifted = torch.zeros(72, dtype=torch.bfloat16)[4:]  # 8 bytes into its storage
    with pytest.raises(ValueError, match=r"model\.layers\.3\.input_norm\.weight .*multiple of 16"):
        Megakernel._check_weights(host, {**good, "model.layers.3.input_norm.weight": shifted})
    with pytest.raises(ValueError, match=r"lm_head\.weight must be a contiguous bfloat16"):
        Megakernel._check_weights(host, {**good, "lm_head.weight": torch.zeros(64)})
