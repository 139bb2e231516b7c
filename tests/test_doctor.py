"""`northcode doctor`: the report on this machine, the megakernel verdict, and the model it names."""

from __future__ import annotations

import json
import platform

import pytest
import torch

from northcode import paths
from northcode.cli import main as cli_main
from northcode.commands.doctor import _megakernel_verdict, collect_report, format_report

H200 = {"index": 0, "name": "NVIDIA H200", "compute_capability": "9.0",
        "free_memory_bytes": 140 * 2**30, "total_memory_bytes": 141 * 2**30}
A100 = {**H200, "name": "NVIDIA A100", "compute_capability": "8.0"}


@pytest.fixture
def fresh_home(monkeypatch, tmp_path):
    monkeypatch.setenv("NORTHCODE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_report_describes_this_machine(fresh_home):
    report = collect_report()
    assert report["python"]["version"] == platform.python_version()
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()
    assert report["torch"]["cuda_build"] == torch.version.cuda
    if not torch.cuda.is_available():
        assert report["megakernel"]["can_run"] is False
        assert "no CUDA GPU is visible" in report["megakernel"]["why_not"]


def test_doctor_names_the_demo_checkpoint_without_creating_it(fresh_home, capsys):
    assert cli_main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"demo checkpoint (created on first use at {paths.demo_checkpoint_dir()})" in out
    assert "megakernel" in out and "torch" in out and "nvcc" in out
    assert not paths.demo_checkpoint_dir().exists()


def test_doctor_reports_a_given_model_and_says_its_weights_are_random(fresh_home, tiny_checkpoint, capsys):
    assert cli_main(["doctor", "--model", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in out and "6 layers, 16 experts, vocab 1024" in out


def test_doctor_reports_a_bad_model_folder_and_fails(fresh_home, tmp_path, capsys):
    assert cli_main(["doctor", "--model", str(tmp_path / "nowhere")]) == 1
    assert "no config.json there" in capsys.readouterr().out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli_main(["doctor", "--model", str(tmp_path / "bad"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "model_type = 'llama'" in report["model"]["error"]


def test_brief_and_json_forms(fresh_home, capsys):
    assert cli_main(["doctor", "--brief"]) == 0
    brief = capsys.readouterr().out.splitlines()
    assert 4 <= len(brief) <= 8 and brief[-1].startswith("model")
    assert cli_main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == {"northcode", "python", "torch", "nvcc", "megakernel", "torch_step", "model"}


def test_megakernel_verdict_says_why_not():
    cuda_torch = {"cuda_build": "12.8", "cuda_available": True, "devices": [H200]}
    nvcc = {"path": "/usr/local/cuda/bin/nvcc", "version": "13.0"}
    assert _megakernel_verdict(cuda_torch, nvcc) == {"can_run": True, "why_not": []}
    verdict = _megakernel_verdict({**cuda_torch, "devices": [A100]}, nvcc)
    assert not verdict["can_run"] and "needs an sm_90 GPU (H100/H200), found NVIDIA A100 (sm_80)" in verdict["why_not"]
    assert "nvcc is not on PATH" in _megakernel_verdict(cuda_torch, {"path": None, "version": None})["why_not"][0]
    assert "too old" in _megakernel_verdict(cuda_torch, {"path": "nvcc", "version": "11.8"})["why_not"][0]
    cpu = _megakernel_verdict({"cuda_build": None, "cuda_available": False, "devices": []}, nvcc)
    assert cpu["why_not"] == ["torch is a CPU build", "no CUDA GPU is visible"]


def test_format_shows_gpu_memory_and_capability():
    report = {"northcode": "0.1.0", "python": {"version": "3.11.7", "executable": "python"},
              "torch": {"version": "2.13.0", "cuda_build": "12.8", "cuda_available": True, "devices": [H200]},
              "nvcc": {"path": "/usr/local/cuda/bin/nvcc", "version": "13.0"},
              "megakernel": {"can_run": True, "why_not": []},
              "model": {"path": "/m", "name": "m", "exists": False}}
    text = format_report(report)
    assert "NVIDIA H200, compute capability 9.0, 140.0 GiB free of 141.0 GiB" in text
    assert "CUDA 12.8 build" in text and "megakernel  can run here" in text


def test_doctor_says_how_the_torch_step_runs(fresh_home, monkeypatch):
    """Eager on the CPU (compiled by default only with CUDA graphs on a GPU), compiled when the variable asks,
    and a bad value of the variable reported, not raised."""
    monkeypatch.delenv("NORTHCODE_TORCH_COMPILE", raising=False)
    report = collect_report()
    if not torch.cuda.is_available():
        assert report["torch_step"] == {"compiled": False, "device": "cpu"}
        assert "torch step  eager (the CPU); NORTHCODE_TORCH_COMPILE=1 compiles it" in format_report(report)
    monkeypatch.setenv("NORTHCODE_TORCH_COMPILE", "1")
    report = collect_report()
    assert report["torch_step"]["compiled"] is True
    assert "torch step  compiled with torch.compile at start-up" in format_report(report)
    monkeypatch.setenv("NORTHCODE_TORCH_COMPILE", "yes")
    assert "NORTHCODE_TORCH_COMPILE='yes'" in format_report(collect_report())
