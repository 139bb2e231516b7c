"""CPU: northcode/csrc/megakernel.cu compiles with nvcc for sm_90a at the tiny and the full geometry,
with no register spills (ptxas -v). Skips, saying why, where nvcc is absent."""

from __future__ import annotations

import re
import subprocess

import pytest

from northcode.engine.megakernel import find_nvcc, nvcc_command, unsupported_reason
from northcode.engine.synthetic import preset_config


def _nvcc_or_skip() -> str:
    try:
        return find_nvcc()
    except RuntimeError as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("preset", ["tiny", "north-mini-code"])
def test_compiles_for_sm90a_without_spills(preset: str, tmp_path) -> None:
    _nvcc_or_skip()
    config = preset_config(preset, 1003 if preset == "tiny" else None)
    assert unsupported_reason(config) is None
    result = subprocess.run(nvcc_command(config, tmp_path / "megakernel.so", ("-Xptxas", "-v")),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.stderr)
    assert spills, "ptxas printed no resource report"
    assert all(s == ("0", "0") for s in spills), f"register spills: {spills}"


def test_unsupported_geometry_is_named() -> None:
    config = preset_config("tiny", 1003)
    import dataclasses

    odd = dataclasses.replace(config, hidden_size=120)
    assert "hidden_size 120" in unsupported_reason(odd)
