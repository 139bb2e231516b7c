"""The pipelined step (pipeline.py) on the tiny checkpoint: TorchBackend's own launch_decode (carried rows fed
from the tokens the previous launch sampled, kept as a tensor; sampled on the device; read one step later)
gives exactly the outputs of the unpipelined engine (the same backend, decoded step by step): batching, stop
strings and token ids, max_tokens, aborts, seeds, penalties (which turn pipelining off until they are gone),
preemption, and no page leaks."""

from __future__ import annotations

import asyncio

import pytest
import torch

from northcode.engine.engine import Engine
from northcode.engine.request import SamplingParams
from northcode.engine.settings import EngineSettings
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend
from tests.test_engine import (TEST_KV_BYTES, assert_a_tiny_pool_preempts_and_completes_as_alone, greedy, make_engine,
                               prompt_of, run, tokens_of)

SETTINGS = dict(page_size=16, chunk_size=24, device="cpu", seed=0, cpu_kv_bytes=TEST_KV_BYTES)


class LaunchingBackend(TorchBackend):
    """TorchBackend with its launch_decode, counting the rows fed from the previous launch (the pipelined ones)."""

    carried = 0
    rows = 0

    def launch_decode(self, batch, carry):
        LaunchingBackend.carried += sum(c >= 0 for c in carry)
        LaunchingBackend.rows += len(carry)
        return super().launch_decode(batch, carry)


def factory_of(backend_class):
    def build(config, weights, settings, num_pages, max_pages_per_seq):
        return backend_class(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq)
    return build


def engine_with(checkpoint, backend_class, **settings) -> Engine:
    config, weights = load_checkpoint(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    return Engine(config, weights, Tokenizer.from_dir(checkpoint), EngineSettings(**{**SETTINGS, **settings}),
                  backend_factory=factory_of(backend_class))


def pipelined_engine(checkpoint, **settings) -> Engine:
    return engine_with(checkpoint, LaunchingBackend, **settings)


@pytest.fixture(scope="module")
def piped(tiny_checkpoint):
    engine = pipelined_engine(tiny_checkpoint)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    engine = engine_with(tiny_checkpoint, TorchBackend)
    engine._pipelined = lambda: False  # the engine decodes step by step (the reference)
    assert not engine._pipelined()
    yield engine
    engine.shutdown()


def test_the_engine_pipelines_with_the_torch_backend_it_builds_itself(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    try:
        assert engine.backend_choice.name == "torch" and callable(engine.backend.launch_decode)
        assert engine._pipelined()
    finally:
        engine.shutdown()


def outcome(outputs) -> tuple:
    final = outputs[-1]
    return tokens_of(outputs), "".join(o.text_delta for o in outputs), final.finish_reason, final.stop_reason


def test_eight_together_equal_each_alone_and_the_unpipelined_engine(piped, plain):
    requests = [(prompt_of(n), greedy(12)) for n in (3, 10, 17, 30, 41, 55, 64, 90)]
    before = LaunchingBackend.carried
    together = run(piped, requests)
    assert LaunchingBackend.carried - before >= 8 * 8  # most decode rows were fed from device memory
    alone = [run(piped, [r])[0] for r in requests]
    reference = run(plain, requests)
    assert [outcome(o) for o in together] == [outcome(o) for o in alone] == [outcome(o) for o in reference]
    assert piped.stats()["pages_used"] == 0 and piped.stats()["requests_running"] == 0


def test_stops_and_max_tokens_end_at_the_same_token(piped, plain):
    prompt = prompt_of(12, salt=10)
    free = tokens_of(run(plain, [(prompt, greedy(30))])[0])
    pieces = [plain.tokenizer.decode([t]) for t in free]
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    requests = [(prompt, greedy(30, stop=[pieces[k][-2:] + pieces[k + 1][:2]])),  # split across tokens
                (prompt, greedy(30, stop_token_ids=[free[5]])),
                (prompt, greedy(7)),
                (prompt_of(1, salt=16), greedy(1)),
                (prompt, SamplingParams(max_tokens=30, temperature=0.0)),  # EOS may end it
                (prompt_of(piped.max_model_len - 3, salt=17), greedy(100))]  # the context ends it
    got, expected = run(piped, requests), run(plain, requests)
    assert [outcome(o) for o in got] == [outcome(o) for o in expected]
    assert got[0][-1].finish_reason == "stop" and got[1][-1].stop_reason == free[5]
    assert len(tokens_of(got[2])) == 7 and len(tokens_of(got[3])) == 1
    assert len(tokens_of(got[5])) == 3 and got[5][-1].finish_reason == "length"
    assert piped.stats()["pages_used"] == 0


def test_abort_mid_stream_frees_everything(piped):
    async def main():
        stream = piped.generate("to-abort", prompt_of(50, salt=6), greedy(500))
        other = asyncio.ensure_future(collect_all(piped.generate("other", prompt_of(20, salt=7), greedy(20))))
        outputs = [await stream.__anext__() for _ in range(3)]
        piped.abort("to-abort")
        outputs += [out async for out in stream]
        return outputs, await other

    outputs, other = asyncio.run(main())
    assert outputs[-1].finish_reason == "abort" and other[-1].finish_reason == "length"
    assert len(tokens_of(other)) == 20
    for _ in range(100):
        if piped.stats()["pages_used"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert piped.stats()["pages_used"] == 0


async def collect_all(stream):
    return [out async for out in stream]


def test_seeds_and_penalties_give_the_unpipelined_tokens(piped, plain):
    prompt = prompt_of(15, salt=8)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    penalised = SamplingParams(max_tokens=12, temperature=0.8, seed=7, frequency_penalty=1.5, ignore_eos=True)
    requests = [(prompt_of(33, salt=9), greedy(12)), (prompt, sampled), (prompt_of(20, salt=3), greedy(9))]
    assert [outcome(o) for o in run(piped, requests)] == [outcome(o) for o in run(plain, requests)]

    async def staggered(engine):  # the penalised request arrives while the others decode pipelined
        first = [asyncio.ensure_future(collect_all(engine.generate(f"s{i}", prompt, params)))
                 for i, (prompt, params) in enumerate(requests)]
        await asyncio.sleep(0.01)
        late = await collect_all(engine.generate("late", prompt_of(9, salt=4), penalised))
        return [await f for f in first] + [late]

    got, expected = asyncio.run(staggered(piped)), asyncio.run(staggered(plain))
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in expected]
    assert piped.stats()["pages_used"] == 0


def test_a_tiny_pool_preempts_and_every_request_completes_as_alone(tiny_checkpoint, plain):
    assert_a_tiny_pool_preempts_and_completes_as_alone(plain, pipelined_engine(tiny_checkpoint, num_pages=60))


def test_no_step_is_launched_past_max_tokens_and_one_past_a_stop(piped):
    prompt = prompt_of(12, salt=10)
    before = LaunchingBackend.rows
    free = tokens_of(run(piped, [(prompt, greedy(7))])[0])
    assert LaunchingBackend.rows - before == 6  # the first token comes from the prefill
    before = LaunchingBackend.rows
    stopped = tokens_of(run(piped, [(prompt, greedy(7, stop_token_ids=[free[3]]))])[0])
    assert stopped == free[:free.index(free[3]) + 1]
    assert LaunchingBackend.rows - before == len(stopped)  # the step launched before the stop was read
