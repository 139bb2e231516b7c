"""Shared test set-up: a private NORTHCODE_HOME, the `gpu` marker's skip, a tiny checkpoint, and the
collection of the engines a test leaves behind."""

from __future__ import annotations

import gc
import os
import resource

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Tiny models run fastest on one thread, and CI has two cores shared with the servers that
    # tests start as subprocesses (they inherit this): oversubscription made decode 5-10x slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Before any test imports northcode: keep the demo checkpoint and sessions out of the user's home.
    if "NORTHCODE_HOME" not in os.environ:
        import tempfile

        os.environ["NORTHCODE_HOME"] = tempfile.mkdtemp(prefix="northcode-test-home-")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    if os.environ.get("NORTHCODE_REQUIRE_GPU") == "1":
        return  # let the gpu tests run and fail: a GPU job must not pass by skipping
    skip = pytest.mark.skip(reason="needs CUDA (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A `tiny` synthetic checkpoint folder (seed 0), written once per test session."""
    from northcode.model.synthetic import create_checkpoint

    out = tmp_path_factory.mktemp("tiny-checkpoint")
    create_checkpoint("tiny", out, seed=0)
    return out


COLLECT_ABOVE_BYTES = 1 << 30  # growth of the process since the last collection that triggers one
_collected_at = [0]  # resident bytes after the last collection


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.fixture(autouse=True)
def _collect_left_engines():
    """An Engine and its backend sit in reference cycles (the step thread's target is a bound method), so their
    KV pools (2 GiB each on the CPU by default) go only when the cyclic collector runs, and it rarely does: the
    engines of a dozen tests piled up to 13 GB in one process. After a test that left the process a GiB larger,
    collect: the suite then holds one test's engines, not the sum of everyone's."""
    yield
    if not os.path.exists("/proc/self/statm"):
        return
    if _resident_bytes() > _collected_at[0] + COLLECT_ABOVE_BYTES:
        gc.collect()
        _collected_at[0] = _resident_bytes()
