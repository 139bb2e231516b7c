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


PRESETS = ("tiny", "north-mini-code")


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict:
    """Both geometries' builds, started together (nvcc is single-threaded: on two cores the pair takes about as
    long as the larger one): preset -> (config, build folder, ptxas's report). -keep: megakernel.cubin for nvdisasm."""
    _nvcc_or_skip()
    running = {}
    for preset in PRESETS:
        config, out = preset_config(preset, 1003 if preset == "tiny" else None), tmp_path_factory.mktemp(preset)
        command = nvcc_command(config, out / "megakernel.so", ("-Xptxas", "-v", "-keep", "-keep-dir", str(out)))
        running[preset] = config, out, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                         text=True)
    built = {}
    for preset, (config, out, nvcc) in running.items():
        _, stderr = nvcc.communicate(timeout=300)
        assert nvcc.returncode == 0, f"nvcc, {preset}: {stderr[-3000:]}"
        built[preset] = config, out, stderr
    return built


@pytest.mark.parametrize("preset", PRESETS)
def test_compiles_for_sm90a_without_spills(preset: str, builds: dict) -> None:
    from northcode.megakernel.sass import disassemble, find_nvdisasm, misaligned_descriptors

    config, out, report = builds[preset]
    assert unsupported_reason(config) is None
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, "ptxas printed no resource report"
    assert all(s == ("0", "0") for s in spills), f"register spills: {spills}"
    check_abi(out / "megakernel.so", config)
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("compiled, no spills, ABI checked; nvdisasm absent (pip install nvidia-cuda-nvdisasm): the "
                    "machine-code check did not run")
    bad = misaligned_descriptors(disassemble(out / "megakernel.cubin", nvdisasm))
    assert not bad, f"{len(bad)} instructions with an odd descriptor register (the GPU refuses them), e.g. {bad[0]}"


def check_abi(library, config) -> None:
    """The built library's ABI version, struct sizes and geometry are what megakernel/kernel.py's mirrors say
    (load_library checks the same on a GPU machine, where it also initialises the kernel)."""
    import ctypes
    import struct

    from northcode.megakernel.kernel import (ABI_VERSION, GEOMETRY_FIELDS, ROW_FORMAT, SLOT_HEADER_WORDS, TASK_WORDS,
                                             Params, geometry, mask_words)

    try:
        lib = ctypes.CDLL(str(library))
    except OSError as err:  # the CUDA runtime library is missing: compile-only machine
        pytest.skip(f"cannot load the built library here: {err}")
    assert lib.nc_abi_version() == ABI_VERSION
    assert lib.nc_params_size() == ctypes.sizeof(Params)
    assert lib.nc_task_size() == TASK_WORDS * 4 and lib.nc_row_size() == struct.calcsize(ROW_FORMAT)
    assert lib.nc_mask_slot_size() == 4 * (SLOT_HEADER_WORDS + mask_words(config.vocab_size))  # MaskSlots' layout
    built = (ctypes.c_int * len(GEOMETRY_FIELDS))()
    assert lib.nc_geometry(built, len(GEOMETRY_FIELDS)) == len(GEOMETRY_FIELDS)
    assert list(built) == list(geometry(config).values())


def test_unsupported_geometry_is_named() -> None:
    config = preset_config("tiny", 1003)
    import dataclasses

    odd = dataclasses.replace(config, hidden_size=120)
    assert "hidden_size 120" in unsupported_reason(odd)


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
