"""A failed step's recovery releases the old backend before it builds the new one (issue 24, point 1): on a
GPU the KV pool takes most of the memory, so a second pool allocated while the first is still held runs out
of it. Here the backends are TorchBackends on the CPU, tracked by weak references: when the factory is asked
for the second one, the first (its pools, its fused weights) must already be gone; the request of the failed
step ends with the error, and the next request completes on the new backend."""

from __future__ import annotations

import weakref

import pytest
import torch

from northcode.engine.engine import Engine
from northcode.engine.settings import EngineSettings
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend
from tests.test_engine import TEST_KV_BYTES, greedy, prompt_of, run, tokens_of


class FailingOnceBackend(TorchBackend):
    """decode_logits (the model step of decode and launch_decode) raises at its third call, once per class."""

    calls = 0

    def decode_logits(self, batch, token_ids):
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("injected: the decode step failed")
        return super().decode_logits(batch, token_ids)


class TrackingFactory:
    """Builds FailingOnceBackends and notes, at each build, how many earlier backends are still alive."""

    def __init__(self) -> None:
        self.built: list[weakref.ref] = []
        self.alive_at_build: list[int] = []

    def __call__(self, config, weights, settings, num_pages, max_pages_per_seq):
        self.alive_at_build.append(sum(ref() is not None for ref in self.built))
        backend = FailingOnceBackend(config, weights, num_pages, settings.page_size, settings.max_batch,
                                     max_pages_per_seq, cuda_graphs=False)
        self.built.append(weakref.ref(backend))
        return backend


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_old_backend_is_released_before_the_new_one_is_built(tiny_checkpoint, pipelined):
    FailingOnceBackend.calls = 0
    factory = TrackingFactory()
    config, weights = load_checkpoint(tiny_checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    settings = EngineSettings(page_size=16, chunk_size=24, device="cpu", seed=0, cpu_kv_bytes=TEST_KV_BYTES)
    engine = Engine(config, weights, Tokenizer.from_dir(tiny_checkpoint), settings, backend_factory=factory)
    params = greedy(6) if pipelined else greedy(6, logprobs=0)  # logprobs: unpipelined decode
    try:
        assert engine._pipelined() is True  # nothing runs yet; the request decides
        failed = run(engine, [(prompt_of(10, salt=30), params)])[0]
        assert failed[-1].finish_reason == "error" and "injected" in failed[-1].error
        after = run(engine, [(prompt_of(10, salt=31), params)])[0]
        assert after[-1].finish_reason == "length" and len(tokens_of(after)) == 6
        assert factory.alive_at_build == [0, 0] and engine.stats()["restarts"] == 1
    finally:
        engine.shutdown()
