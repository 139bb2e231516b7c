"""Shared test set-up: a private NORTHCODE_HOME, the `gpu` marker's skip, and a tiny checkpoint. (A CPU engine
a test shuts down is freed by reference counting, its KV pool with it: no collection is needed here.)"""

from __future__ import annotations

import os

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


@pytest.fixture
def store(tmp_path):
    """A session store of its own for the test (the app's and the agent's saved sessions)."""
    from northcode.agent.sessions import SessionStore

    store = SessionStore(tmp_path / "sessions.sqlite3")
    yield store
    store.close()
