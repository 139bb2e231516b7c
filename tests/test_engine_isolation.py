"""No request can hurt another (issue 24, points 1 and 3), on the tiny checkpoint: a greedy stream runs while
a request with an extreme sampling parameter arrives (every one valid); the stream gives the tokens it gives
alone, and the extreme request finishes normally with token ids in the vocabulary, finite logprobs and the
tokens it draws alone, on the torch backend and on MegakernelBackend over a fake kernel that packs every row
as the real kernel's ABI does (RowSpec.pack). A failure that the step can trace to one request's sampling
ends that request only, without a backend restart."""

from __future__ import annotations

import asyncio
import math
import struct

import pytest
import torch

from northcode.engine import sampling
from northcode.engine.engine import Engine
from northcode.engine.request import SamplingParams
from northcode.engine.settings import EngineSettings
from northcode.megakernel.backend import MegakernelBackend
from northcode.megakernel.kernel import PAGE_SIZE, ROW_FORMAT, RowSpec
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from tests.test_engine import TEST_KV_BYTES, collect, greedy, make_engine, prompt_of, run, tokens_of
from tests.test_megakernel_backend_cpu import FakeMegakernel

MAX_MODEL_LEN = 80  # max_tokens of 2^63 ends at the context, after 80 - 12 tokens
STREAM_TOKENS = 24


def extreme(**params) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **params})


EXTREMES = {  # name -> (params, greedy: its tokens are the greedy ones)
    "top_k 2^63": (extreme(temperature=1.0, top_k=2**63, seed=1), False),
    "top_k 2^31": (extreme(temperature=1.0, top_k=2**31, seed=1), False),
    "seed 2^64-1": (extreme(temperature=1.0, seed=2**64 - 1), False),
    "seed 0": (extreme(temperature=1.0, seed=0), False),
    "seed -2^63": (extreme(temperature=0.7, seed=-2**63), False),
    "temperature 1e-39": (extreme(temperature=1e-39, logprobs=5), True),
    "temperature 5e-324 top_k 3": (extreme(temperature=5e-324, top_k=3, seed=2), True),
    "temperature 100": (extreme(temperature=100.0, seed=3, logprobs=20), False),
    "top_p 1e-300": (extreme(temperature=1.0, top_p=1e-300, seed=4), True),
    "top_p 5e-324": (extreme(temperature=2.0, top_p=5e-324, seed=4), True),
    "min_p 1": (extreme(temperature=1.0, min_p=1.0, seed=5), True),
    "penalties high": (extreme(temperature=1.0, repetition_penalty=10.0, presence_penalty=2.0,
                               frequency_penalty=2.0, seed=6, logprobs=20), False),
    "penalties low": (extreme(temperature=1.0, repetition_penalty=1e-300, presence_penalty=-2.0,
                              frequency_penalty=-2.0, seed=7, logprobs=20), False),
    "repetition 5e-324 greedy": (extreme(temperature=0.0, repetition_penalty=5e-324, logprobs=20), False),
    "max_tokens 2^63": (extreme(max_tokens=2**63, temperature=0.0, logprobs=0), True),
}


def assert_sane(outputs, vocab_size: int) -> None:
    """Finished normally; every token id in the vocabulary; every logprob a finite number."""
    final = outputs[-1]
    assert final.finish_reason == "length" and final.error is None, final.error
    assert all(0 <= t < vocab_size for t in tokens_of(outputs))
    for entry in [e for out in outputs for e in out.logprobs or []]:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        assert all(math.isfinite(value) for _, value in entry.top)


def stream_beside(engine: Engine, params: SamplingParams, name: str):
    """The stream's outputs and the extreme request's, the latter sent once the stream has its second token."""
    async def main():
        stream = engine.generate(f"stream-{name}", prompt_of(12, salt=40), greedy(STREAM_TOKENS))
        outputs = [await stream.__anext__(), await stream.__anext__()]
        other = asyncio.ensure_future(collect(engine, f"extreme-{name}", prompt_of(12, salt=41), params))
        outputs += [out async for out in stream]
        return outputs, await other
    return asyncio.run(main())


def check_isolation(engine: Engine, name: str, alone: dict, batch_invariant: bool = True) -> None:
    """batch_invariant: a row's logits do not depend on what else is in the step (fp32 on the CPU, the megakernel's
    independent rows), so both requests must draw their tokens alone; otherwise (cuBLAS picks its kernels by batch
    size) a near-tie may flip and only how they end is compared."""
    params, is_greedy = EXTREMES[name]
    restarts = engine.stats()["restarts"]
    streamed, extreme_outputs = stream_beside(engine, params, name)
    assert streamed[-1].finish_reason == "length" and streamed[-1].error is None, streamed[-1].error
    assert len(tokens_of(streamed)) == len(alone["stream"])
    assert_sane(extreme_outputs, engine.config.vocab_size)
    if batch_invariant:
        assert tokens_of(streamed) == alone["stream"]
        assert tokens_of(extreme_outputs) == tokens_of(run(engine, [(prompt_of(12, salt=41), params)])[0])
    if is_greedy and batch_invariant:
        count = len(tokens_of(extreme_outputs))
        assert tokens_of(extreme_outputs) == alone["greedy"][:count]
    if params.max_tokens > MAX_MODEL_LEN:
        assert len(tokens_of(extreme_outputs)) == MAX_MODEL_LEN - 12
    assert engine.stats()["restarts"] == restarts and engine.stats()["pages_used"] == 0


def alone_of(engine: Engine) -> dict:
    return {"stream": tokens_of(run(engine, [(prompt_of(12, salt=40), greedy(STREAM_TOKENS))])[0]),
            "greedy": tokens_of(run(engine, [(prompt_of(12, salt=41), greedy(MAX_MODEL_LEN))])[0])}


@pytest.fixture(scope="module")
def torch_engine(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_model_len=MAX_MODEL_LEN)
    yield engine, alone_of(engine)
    engine.shutdown()


class PackingKernel(FakeMegakernel):
    """FakeMegakernel that first packs its rows as Megakernel.set_rows does (the ABI's struct)."""

    def step(self, rows: list[RowSpec], tokens: torch.Tensor | None = None) -> None:
        for row in rows:
            row.pack(self.backend.config.vocab_size)
        super().step(rows, tokens)


@pytest.fixture(scope="module")
def kernel_engine(tiny_checkpoint):
    config, weights = load_checkpoint(tiny_checkpoint, dtype=torch.float32)

    def build(config, weights, s, num_pages, max_pages):
        return MegakernelBackend(config, weights, num_pages, s.page_size, s.max_batch, max_pages,
                                 kernel_factory=PackingKernel)

    settings = EngineSettings(page_size=PAGE_SIZE, chunk_size=512, device="cpu", seed=0, max_model_len=MAX_MODEL_LEN,
                              cpu_kv_bytes=TEST_KV_BYTES)
    engine = Engine(config, weights, Tokenizer.from_dir(tiny_checkpoint), settings, backend_factory=build)
    yield engine, alone_of(engine)
    engine.shutdown()


@pytest.mark.parametrize("name", list(EXTREMES))
def test_an_extreme_request_neither_fails_nor_disturbs_a_stream_on_the_torch_backend(torch_engine, name):
    check_isolation(*torch_engine[:1], name, torch_engine[1])


@pytest.mark.parametrize("name", list(EXTREMES))
def test_an_extreme_request_neither_fails_nor_disturbs_a_stream_on_the_megakernel_backend(kernel_engine, name):
    assert kernel_engine[0].backend.name == "megakernel"
    check_isolation(kernel_engine[0], name, kernel_engine[1])


def test_the_kernel_row_packs_every_value_a_validated_request_carries():
    vocab = 1024
    packed = RowSpec(position=2**31 - 1, seq=63, step=2**31 - 1, seed=2**64 - 1, temperature=100.0,
                     top_k=2**63, top_p=1e-300, min_p=1.0).pack(vocab)
    position, _, step, top_k, seed, temperature, top_p, min_p, trigger, mask = struct.unpack(ROW_FORMAT, packed)
    assert (trigger, mask) == (-1, 0)  # unconstrained: no mask to read
    assert (position, step, top_k, seed, temperature, top_p, min_p) == (2**31 - 1, 2**31 - 1, 0, 2**64 - 1, 100.0,
                                                                        0.0, 1.0)
    assert struct.unpack(ROW_FORMAT, RowSpec(0, 0, seed=-1, top_k=5, temperature=1e-39).pack(vocab))[3:6] == \
        (5, 2**64 - 1, 0.0)  # a seed modulo 2^64; a temperature below SAMPLING_EPS is greedy
    with pytest.raises(ValueError, match="position"):
        RowSpec(position=2**31, seq=0).pack(vocab)


def test_a_failure_traced_to_one_requests_sampling_ends_only_that_request(tiny_checkpoint, monkeypatch):
    """Defence beyond validation: the noise seed of one request (seed 666) raises wherever it is built (in the
    step, and when the engine asks which request failed); that request ends with the error, the others go on
    with their tokens alone, and the backend is not restarted."""
    real = sampling.noise_seed

    def noise_seed(seed: int, output_index: int) -> int:
        if seed == 666 and output_index == 2:
            raise OverflowError("injected: this request's noise cannot be built")
        return real(seed, output_index)

    engine = make_engine(tiny_checkpoint)
    try:
        seeded = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
        requests = [(prompt_of(12, salt=42), greedy(10)), (prompt_of(14, salt=43), seeded),
                    (prompt_of(16, salt=44), SamplingParams(max_tokens=10, temperature=0.8, seed=666, ignore_eos=True)),
                    (prompt_of(18, salt=45), greedy(10, logprobs=2))]
        alone = [tokens_of(run(engine, [r])[0]) for r in requests[:2] + requests[3:]]
        monkeypatch.setattr(sampling, "noise_seed", noise_seed)
        together = run(engine, requests)
        failed = together[2][-1]
        assert failed.finish_reason == "error" and "injected" in failed.error and "sampling" in failed.error
        assert len(tokens_of(together[2])) == 2
        assert [tokens_of(o) for o in together[:2] + together[3:]] == alone
        assert all(o[-1].finish_reason == "length" for o in together[:2] + together[3:])
        assert engine.stats()["restarts"] == 0 and engine.stats()["pages_used"] == 0
    finally:
        engine.shutdown()
