"""The step watchdog on the tiny checkpoint: a decode step that really blocks (a TorchBackend whose
decode_logits, the model step of both decode paths, waits on an event) ends its request with a clear error,
the backend is rebuilt, waiting requests run after the restart with the tokens they would have produced
alone, and new requests are served, pipelined (launch_decode) or not (requests that want logprobs); a step
that never comes back is a fatal error reported to every request, to stats() and to the listeners."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from northcode.engine.engine import Engine
from northcode.engine.settings import EngineSettings
from northcode.engine.watchdog import StepWatchdog
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend
from tests.test_engine import TEST_KV_BYTES, greedy, make_engine, prompt_of, run, tokens_of


class BlockingFactory:
    """Builds TorchBackends; the first one's decode step number `block_at` waits until `release` is set."""

    def __init__(self, block_at: int) -> None:
        self.block_at, self.release, self.blocked = block_at, threading.Event(), threading.Event()
        self.built = 0

    def __call__(self, config, weights, settings, num_pages, max_pages_per_seq):
        self.built += 1
        factory, first = self, self.built == 1

        class BlockingBackend(TorchBackend):
            calls = 0

            def decode_logits(self, batch, token_ids):
                BlockingBackend.calls += 1
                if first and BlockingBackend.calls == factory.block_at:
                    factory.blocked.set()
                    factory.release.wait(30)  # a real stall of the step thread, not an exception
                return super().decode_logits(batch, token_ids)

        return BlockingBackend(config, weights, num_pages, settings.page_size, settings.max_batch,
                               max_pages_per_seq, cuda_graphs=False)


def watched_engine(checkpoint, factory, **settings) -> Engine:
    values = dict(page_size=16, chunk_size=24, device="cpu", seed=0, cpu_kv_bytes=TEST_KV_BYTES, max_batch=1, step_timeout_s=0.3,
                  first_step_timeout_s=20.0, hang_grace_s=20.0)  # the blocked step's shape ran before: 0.3 s
    values.update(settings)
    config, weights = load_checkpoint(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    return Engine(config, weights, Tokenizer.from_dir(checkpoint), EngineSettings(**values), backend_factory=factory)


@pytest.fixture(scope="module")
def alone(tiny_checkpoint):
    """Greedy outputs of the two prompts the tests use, from an ordinary engine."""
    engine = make_engine(tiny_checkpoint)
    try:
        return {salt: tokens_of(run(engine, [(prompt_of(12, salt=salt), greedy(8))])[0]) for salt in (20, 21, 22)}
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_hung_step_ends_its_request_restarts_the_backend_and_keeps_the_waiting_ones(tiny_checkpoint, alone,
                                                                                     pipelined):
    factory = BlockingFactory(block_at=3)
    engine = watched_engine(tiny_checkpoint, factory)
    params = greedy(8) if pipelined else greedy(8, logprobs=0)  # logprobs need the host: decode, step by step

    async def main():
        hung = engine.generate("hung", prompt_of(12, salt=20), params)
        waiting = engine.generate("waiting", prompt_of(12, salt=21), params)  # max_batch 1: it waits
        hung_outputs = [out async for out in hung]  # ends while the step thread is still blocked
        assert factory.blocked.is_set() and not factory.release.is_set()
        assert engine.stats()["status"] == "restarting"
        factory.release.set()  # the stalled step returns; its results are dropped, the backend rebuilt
        waiting_outputs = [out async for out in waiting]
        after = [out async for out in engine.generate("after", prompt_of(12, salt=22), params)]
        return hung_outputs, waiting_outputs, after

    try:
        started = time.monotonic()
        hung, waiting, after = asyncio.run(main())
        final = hung[-1]
        assert final.finished and final.finish_reason == "error"
        assert "did not finish within 0.3 s" in final.error and "restarted" in final.error
        # the prefill's token and two decodes (pipelined: the second is still unread at the hang); no more
        assert tokens_of(hung) == alone[20][:2 if pipelined else 3]
        assert tokens_of(waiting) == alone[21] and waiting[-1].finish_reason == "length"
        assert tokens_of(after) == alone[22]
        stats = engine.stats()
        assert factory.built == 2 and stats["restarts"] == 1 and stats["status"] == "ok"
        assert stats["pages_used"] == 0 and stats["fatal_error"] is None
        assert time.monotonic() - started < 15
    finally:
        factory.release.set()
        engine.shutdown()


def test_a_step_that_never_returns_is_a_fatal_error_for_every_request(tiny_checkpoint):
    factory = BlockingFactory(block_at=2)
    engine = watched_engine(tiny_checkpoint, factory, hang_grace_s=0.5)
    heard: list[str] = []
    engine.add_fatal_listener(heard.append)

    async def main():
        hung = engine.generate("hung", prompt_of(12, salt=20), greedy(8))
        waiting = engine.generate("waiting", prompt_of(12, salt=21), greedy(8))
        return [out async for out in hung], [out async for out in waiting]

    try:
        hung, waiting = asyncio.run(main())
        assert hung[-1].finish_reason == "error" and "did not finish within" in hung[-1].error
        assert waiting[-1].finish_reason == "error" and "device stopped responding" in waiting[-1].error
        stats = engine.stats()
        assert stats["status"] == "failed" and "restart the server" in stats["fatal_error"]
        assert heard == [stats["fatal_error"]]
        later = run(engine, [(prompt_of(5, salt=23), greedy(4))])[0]  # refused at once, with the reason
        assert len(later) == 1 and later[0].finish_reason == "error" and later[0].error == stats["fatal_error"]
        late_listener: list[str] = []
        engine.add_fatal_listener(late_listener.append)
        assert late_listener == [stats["fatal_error"]]
    finally:
        factory.release.set()
        engine.shutdown()


def test_a_failed_step_restarts_the_backend_and_a_failed_restart_is_fatal(tiny_checkpoint):
    built = []

    def factory(config, weights, settings, num_pages, max_pages_per_seq):
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return TorchBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq)

    engine = watched_engine(tiny_checkpoint, factory, step_timeout_s=10.0)
    engine.backend.decode_logits = lambda batch, token_ids: (_ for _ in ()).throw(RuntimeError("device-side assert"))
    try:
        failed = run(engine, [(prompt_of(12, salt=20), greedy(4))])[0]
        assert failed[-1].finish_reason == "error" and "device-side assert" in failed[-1].error
        for _ in range(100):
            if engine.stats()["status"] == "failed":
                break
            time.sleep(0.02)
        assert "could not be restarted" in engine.stats()["fatal_error"]
        assert "illegal memory access" in engine.stats()["fatal_error"]
    finally:
        engine.shutdown()


def test_the_watchdog_fires_once_per_overdue_step_and_not_for_steps_in_time():
    events: list[tuple[str, str]] = []
    watchdog = StepWatchdog(lambda what, s: events.append(("overdue", what)),
                            lambda what, s: events.append(("lost", what)), grace_s=0.3)
    try:
        watchdog.begin(0.5, "quick")
        time.sleep(0.05)
        assert watchdog.end() is False
        watchdog.begin(0.05, "slow")
        time.sleep(0.2)
        assert events == [("overdue", "slow")]
        assert watchdog.end() is True
        time.sleep(0.4)
        assert events == [("overdue", "slow")]  # ended in time for the grace: not lost
        watchdog.begin(0.05, "stuck")
        time.sleep(0.6)
        assert events[1:] == [("overdue", "stuck"), ("lost", "stuck")] and watchdog.lost
    finally:
        watchdog.close()
