"""Issue 24 on the H200 (tiny checkpoint, bf16), for the torch backend and the megakernel (sm_90): an engine
with the DEFAULT gpu_memory_fraction (a KV pool of most of the GPU, ~120 GiB) survives a failed step: the
step's requests end with the error, the backend is rebuilt without a second pool ever being allocated beside
the first (that ran out of memory and killed the server), and the next requests complete with the same
tokens as before. Then every extreme request of tests/test_engine_isolation.py runs beside a greedy stream
without any error (the megakernel packs each row: RowSpec.pack), the stream's tokens are those it gives alone.

The torch engine runs the eager step in CUDA graphs (compile=False): the compiled step caps its pool at 2^31
elements (compiled_step.compiled_pool_pages, ~4 GiB here), which would not test a pool of the whole GPU.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from tests.test_engine import greedy, prompt_of, run, tokens_of
from tests.test_engine_isolation import EXTREMES, MAX_MODEL_LEN, alone_of, check_isolation

pytestmark = pytest.mark.gpu
GiB = 1 << 30
MIN_POOL_SHARE = 0.6  # of the GPU's memory: the default fraction (0.9 of what is free) gives ~0.85


def model_step(backend: str):
    """(class, name) of the backend's model step, the one place both decode paths go through."""
    if backend == "torch":
        from northcode.torch_backend.backend import TorchBackend

        return TorchBackend, "decode_logits"
    from northcode.megakernel.backend import MegakernelBackend

    return MegakernelBackend, "launch_step"


@pytest.fixture(scope="module", params=["torch", "megakernel"])
def engine(request, tiny_checkpoint):
    from northcode.engine.settings import EngineSettings
    from northcode.runtime import load_engine

    if request.param == "megakernel" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel runs on sm_90 only")
    settings = EngineSettings(device="cuda", seed=0, backend=request.param, compile=False, max_model_len=MAX_MODEL_LEN)
    assert settings.gpu_memory_fraction == EngineSettings().gpu_memory_fraction  # the default
    engine = load_engine(tiny_checkpoint, settings)
    assert engine.backend.name == request.param, engine.stats()["backend_reason"]
    yield engine
    engine.shutdown()
    engine.backend = None  # the step thread has stopped: free the pool before the next backend's engine
    gc.collect()
    torch.cuda.empty_cache()


def pool_bytes(engine) -> int:
    from northcode.engine.kv_cache import page_bytes

    dtype = engine._weights["model.embed_tokens.weight"].dtype
    return (engine.num_pages + 1) * page_bytes(engine.config, engine.settings.page_size, dtype)


def wait_for_restart(engine, restarts: int) -> None:
    for _ in range(6000):  # the step's errors go out before the backend is rebuilt (warm-up included)
        if engine.stats()["restarts"] == restarts:
            return
        asyncio.run(asyncio.sleep(0.01))
    raise AssertionError(f"no restart: {engine.stats()}")


def test_a_failed_step_recovers_with_a_pool_of_most_of_the_gpu(engine, monkeypatch):
    total = torch.cuda.get_device_properties(0).total_memory
    assert pool_bytes(engine) > MIN_POOL_SHARE * total, (pool_bytes(engine) / GiB, total / GiB)
    requests = [(prompt_of(n, salt=60), greedy(24)) for n in (3, 17, 40, 65)]
    first = run(engine, requests)
    assert all(outputs[-1].finish_reason == "length" for outputs in first)
    allocated = torch.cuda.memory_allocated()
    cls, name = model_step(engine.backend.name)
    real, armed = getattr(cls, name), [True]

    def fails_once(self, *args, **kwargs):  # on the class: the test holds no reference to the backend
        if armed:
            armed.clear()
            raise RuntimeError("injected: the model step failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, fails_once)
    failed = run(engine, requests)
    assert any(outputs[-1].finish_reason == "error" and "injected" in outputs[-1].error for outputs in failed)
    wait_for_restart(engine, 1)
    stats = engine.stats()
    assert stats["status"] == "ok" and stats["fatal_error"] is None and stats["backend"] == cls.name
    again = run(engine, requests)
    assert [tokens_of(o) for o in again] == [tokens_of(o) for o in first]
    assert torch.cuda.memory_allocated() < allocated + 2 * GiB  # one pool, the new one
    assert engine.stats()["pages_used"] == 0


@pytest.fixture(scope="module")
def alone(engine) -> dict:
    return alone_of(engine)


@pytest.mark.parametrize("name", list(EXTREMES))
def test_an_extreme_request_runs_beside_a_stream_without_any_error(engine, alone, name):
    check_isolation(engine, name, alone, batch_invariant=engine.backend_choice.name != "torch")
