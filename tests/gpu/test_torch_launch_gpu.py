"""TorchBackend.launch_decode on the GPU (tiny checkpoint, fp32, CUDA graphs): pipelined launches, each made
before the previous step is read, give the tokens of decode fed from the host; and no launch makes the host
wait for the device (torch's sync debug mode raises on any synchronising call made inside one), so the GPU
runs step n+1 while the host reads step n."""

from __future__ import annotations

import contextlib

import pytest
import torch

from northcode.model.checkpoint import load_checkpoint
from tests.test_torch_backend import decoded_and_launched

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def no_device_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_launches_on_the_gpu_never_wait_for_the_device_and_equal_decode(tiny_checkpoint):
    config, weights = load_checkpoint(tiny_checkpoint, device=torch.device("cuda"), dtype=torch.float32)
    decoded, launched = decoded_and_launched(config, weights, no_device_sync)
    assert launched == decoded and [len(o) for o in decoded] == [8, 6, 5]
