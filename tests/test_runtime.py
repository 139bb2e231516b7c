"""runtime.py: --backend auto | torch | megakernel, what each resolves to, and why, on this CPU machine and (by passing
the GPU's capability and nvcc) on the machines the megakernel is for."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from northcode.engine.settings import EngineSettings
from northcode.model.synthetic import preset_config
from northcode.runtime import choose_backend, load_engine, megakernel_blocker

CUDA, CPU, BF16 = torch.device("cuda"), torch.device("cpu"), torch.bfloat16
H200 = dict(capability=(9, 0), nvcc="/usr/local/cuda/bin/nvcc")


@pytest.fixture(scope="module")
def config():
    return preset_config("tiny")


def test_auto_takes_the_megakernel_only_where_it_can_run(config):
    auto = EngineSettings()
    assert auto.backend == "auto"
    chosen = choose_backend(config, auto, CUDA, BF16, validated=False, **H200)  # a kernel not yet checked
    assert chosen.name == "torch" and "not yet passed its whole-step checks" in chosen.reason
    assert choose_backend(config, auto, CUDA, BF16, **H200).name == "megakernel"  # MEGAKERNEL_VALIDATED
    chosen = choose_backend(config, auto, CUDA, BF16, validated=True, **H200)
    assert chosen.name == "megakernel" and chosen.reason.startswith("auto: sm_90")
    cases = {  # what differs from an H200 with nvcc -> the reason torch is taken
        "the CPU": dict(device=CPU),
        "sm_80": dict(capability=(8, 0)),
        "sm_120": dict(capability=(12, 0)),
        "nvcc was not found": dict(nvcc=None),
        "the weights are float32": dict(dtype=torch.float32),
        "page_size is 16": dict(settings=EngineSettings(page_size=16)),
        "shared experts": dict(config=dataclasses.replace(config, num_shared_experts=1)),
    }
    for why, change in cases.items():
        args = dict(config=config, settings=auto, device=CUDA, dtype=BF16, validated=True, **H200)
        args.update(change)
        chosen = choose_backend(**args)
        assert chosen.name == "torch" and chosen.reason.startswith("auto: ") and why in chosen.reason, (why, chosen)


def test_megakernel_where_it_cannot_run_is_a_clear_error_and_torch_is_always_possible(config):
    with pytest.raises(ValueError, match="backend = 'megakernel': it cannot run here: .*sm_86"):
        choose_backend(config, EngineSettings(backend="megakernel"), CUDA, BF16, capability=(8, 6), nvcc="nvcc")
    with pytest.raises(ValueError, match="backend = 'megakernel': it cannot run here: the model runs on the CPU"):
        choose_backend(config, EngineSettings(backend="megakernel"), CPU, torch.float32)
    assert choose_backend(config, EngineSettings(backend="megakernel"), CUDA, BF16, **H200).name == "megakernel"
    assert choose_backend(config, EngineSettings(backend="torch"), CUDA, BF16, **H200).name == "torch"
    assert megakernel_blocker(config, EngineSettings(), CUDA, BF16, **H200) is None
    with pytest.raises(ValueError, match="engine setting backend = 'fast': must be one of"):
        EngineSettings(backend="fast")


def test_the_engine_reports_its_choice_and_refuses_an_impossible_one(tiny_checkpoint):
    engine = load_engine(tiny_checkpoint, EngineSettings(device="cpu", page_size=16, num_pages=64))
    try:
        stats = engine.stats()
        assert engine.backend.name == stats["backend"] == "torch"
        assert stats["backend_reason"] == "auto: the model runs on the CPU, and the megakernel needs a CUDA GPU"
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="backend = 'megakernel': it cannot run here: the model runs on the CPU"):
        load_engine(tiny_checkpoint, EngineSettings(device="cpu", backend="megakernel", num_pages=64))


@pytest.mark.parametrize("name, value", [("step_timeout_s", 0), ("first_step_timeout_s", None),
                                         ("hang_grace_s", -1.0), ("step_timeout_s", True)])
def test_watchdog_settings_are_checked(name, value):
    with pytest.raises(ValueError, match=f"engine setting {name} = "):
        EngineSettings(**{name: value})
    assert EngineSettings(step_timeout_s=None).step_timeout_s is None
