"""The Engine end to end on the tiny checkpoint: batching, prefix reuse, windows, preemption, no leaks,
seeds, stop strings, errors. Greedy outputs are checked against the reference model (model.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from northcode.engine.engine import Engine
from northcode.engine.request import RequestOutput, SamplingParams
from northcode.engine.settings import EngineSettings
from northcode.model.model import NorthModel
from northcode.runtime import load_engine

PAGE = 16  # small pages: more page crossings, evictions and cached blocks per token
# KV pool of a test's CPU engine: 64 MiB, 4096 pages of 16 tokens (a few of the tiny model's 4096-token sequences);
# the CPU default's 2 GiB is zero-filled and resident, and module fixtures hold two engines at once
TEST_KV_BYTES = 64 << 20


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_engine(checkpoint, **settings) -> Engine:
    defaults = dict(page_size=PAGE, chunk_size=24, device="cpu", seed=0, cpu_kv_bytes=TEST_KV_BYTES)
    return load_engine(checkpoint, EngineSettings(**{**defaults, **settings}))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return NorthModel.from_dir(tiny_checkpoint, dtype=torch.float32)


async def collect(engine: Engine, request_id: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, prompt, params)]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[RequestOutput]]:
    """Submit all requests at once; the outputs of each, in order."""
    async def main():
        return await asyncio.gather(*[collect(engine, f"req-{i}-{id(p)}", prompt, p)
                                      for i, (prompt, p) in enumerate(requests)])
    return asyncio.run(main())


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return torch.randint(20, 1000, (n,), generator=torch.Generator().manual_seed(n * 1000 + salt)).tolist()


def assert_greedy_matches_reference(reference: NorthModel, prompt: list[int], generated: list[int]) -> None:
    """Teacher-forced: every generated token is the reference's argmax after the tokens before it."""
    sequence = torch.tensor([prompt + generated])
    logits = reference.forward(sequence)[0, len(prompt) - 1:-1]  # [len(generated), V]
    assert logits.argmax(-1).tolist() == generated


def test_eight_requests_together_equal_each_alone_and_the_reference(engine, reference):
    requests = [(prompt_of(n), greedy(12)) for n in (3, 10, 17, 30, 41, 55, 64, 90)]
    together = run(engine, requests)
    alone = [run(engine, [r])[0] for r in requests]
    assert [tokens_of(o) for o in together] == [tokens_of(o) for o in alone]
    for (prompt, _), outputs in zip(requests, together):
        assert len(tokens_of(outputs)) == 12 and outputs[-1].finish_reason == "length"
        assert_greedy_matches_reference(reference, prompt, tokens_of(outputs))
    assert engine.stats()["pages_used"] == 0


def test_repeated_prompt_reuses_its_prefix(engine):
    prompt = prompt_of(100, salt=1)
    before = engine.stats()["prefix_cache_hit_tokens"]
    first = run(engine, [(prompt, greedy(8))])[0]
    second = run(engine, [(prompt, greedy(8))])[0]
    assert tokens_of(first) == tokens_of(second)
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == 96  # all full blocks; the last token is always recomputed
    assert engine.stats()["prefix_cache_hit_tokens"] - before == 96


def test_agent_loop_turn_reuses_all_but_the_new_message(tiny_checkpoint, engine):
    turn1 = prompt_of(70, salt=2)
    out1 = tokens_of(run(engine, [(turn1, greedy(25))])[0])
    turn2 = turn1 + out1 + prompt_of(12, salt=3)  # the whole conversation again, plus a new message
    out2 = run(engine, [(turn2, greedy(10))])[0]
    # the 95 tokens of turn 1 minus its last output token (never run) have KV: 5 full blocks of 16
    assert out2[-1].usage.cached_tokens == (len(turn1) + len(out1) - 1) // PAGE * PAGE == 80
    cold = make_engine(tiny_checkpoint, enable_prefix_cache=False)
    try:
        assert tokens_of(run(cold, [(turn2, greedy(10))])[0]) == tokens_of(out2)
    finally:
        cold.shutdown()


def test_tiny_window_crossed_many_times_frees_pages_and_matches_the_reference(engine, reference):
    prompt = prompt_of(20, salt=4)
    peak = 0

    async def watch():
        nonlocal peak
        outputs = []
        async for out in engine.generate("long", prompt, greedy(140)):
            peak = max(peak, engine.stats()["pages_used"])
            outputs.append(out)
        return outputs

    outputs = asyncio.run(watch())
    generated = tokens_of(outputs)
    assert len(generated) == 140
    assert_greedy_matches_reference(reference, prompt, generated)
    # 160 tokens = 10 pages in each of the 2 full layers; the 4 sliding layers keep at most 4 pages each
    assert peak <= 2 * 10 + 4 * 4 < 6 * 10
    assert engine.stats()["pages_used"] == 0


def assert_a_tiny_pool_preempts_and_completes_as_alone(reference, small) -> None:
    """4 requests that cannot fit a 60-page pool together: `small` (such a pool; shut down here) preempts and
    still gives each the tokens `reference` gives it alone, and ends with every page free."""
    requests = [(prompt_of(n, salt=5), greedy(40)) for n in (20, 28, 36, 44)]
    alone = [tokens_of(run(reference, [r])[0]) for r in requests]
    try:
        together = run(small, requests)
        assert [tokens_of(o) for o in together] == alone
        assert small.scheduler.num_preemptions > 0
        assert small.stats()["pages_used"] == 0
    finally:
        small.shutdown()


def test_tiny_pool_forces_preemption_and_every_request_completes_as_alone(tiny_checkpoint, engine):
    assert_a_tiny_pool_preempts_and_completes_as_alone(engine, make_engine(tiny_checkpoint, num_pages=60))


def test_abort_and_early_close_free_every_page(engine):
    async def main():
        stream = engine.generate("to-abort", prompt_of(50, salt=6), greedy(500))
        outputs = [await stream.__anext__() for _ in range(3)]
        engine.abort("to-abort")
        outputs += [out async for out in stream]
        closed = engine.generate("to-close", prompt_of(30, salt=7), greedy(500))
        await closed.__anext__()
        await closed.aclose()  # a client that goes away
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    for _ in range(100):  # the close is handled by the step thread
        if engine.stats()["pages_used"] == 0 and engine.stats()["requests_running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert engine.stats()["pages_used"] == 0


def test_seeds_reproduce_whatever_the_batch(engine):
    prompt = prompt_of(15, salt=8)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tokens_of(run(engine, [(prompt, sampled)])[0])
    crowd = run(engine, [(prompt_of(33, salt=9), greedy(12)), (prompt, sampled),
                         (prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))])
    assert tokens_of(crowd[1]) == alone
    assert tokens_of(crowd[2]) != alone


def test_stop_string_split_across_tokens_is_caught(engine):
    prompt = prompt_of(12, salt=10)
    outputs = run(engine, [(prompt, greedy(30))])[0]
    text = "".join(o.text_delta for o in outputs)
    pieces = [engine.tokenizer.decode([t]) for t in tokens_of(outputs)]
    # a stop string made of the end of one token's text and the start of the next one's
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    at = text.find(stop)
    assert at >= 0
    stopped = run(engine, [(prompt, greedy(30, stop=[stop]))])[0]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop
    assert "".join(o.text_delta for o in stopped) == text[:at]


def test_logprobs_and_timings_are_reported(engine):
    outputs = run(engine, [(prompt_of(9, salt=11), greedy(5, logprobs=3))])[0]
    entries = [lp for out in outputs for lp in (out.logprobs or [])]
    assert [e.token_id for e in entries] == tokens_of(outputs)
    assert all(len(e.top) == 3 and e.top[0][0] == e.token_id for e in entries)  # greedy: the top one
    final = outputs[-1]
    assert final.usage.prompt_tokens == 9 and final.usage.completion_tokens == 5
    assert final.timings.time_to_first_token_s > 0 and len(final.timings.token_latencies_s) == 4


def test_bad_requests_fail_before_the_first_output_with_a_clear_message(engine):
    async def first(prompt, params, request_id="bad"):
        return await engine.generate(request_id, prompt, params).__anext__()

    with pytest.raises(ValueError, match=f"does not fit the context of {engine.max_model_len}"):
        asyncio.run(first([5] * engine.max_model_len, greedy(4)))
    with pytest.raises(ValueError, match="not a token id"):
        asyncio.run(first([5, engine.config.vocab_size], greedy(4)))
    with pytest.raises(ValueError, match="temperature"):
        asyncio.run(first([5], SamplingParams(temperature=-1)))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(first([], greedy(4)))


def test_stats_report_pages_and_requests(engine):
    stats = engine.stats()
    assert stats["pages_total"] > 0 and stats["pages_used"] == 0
    assert {"prefix_cache_hit_rate", "requests_running", "requests_waiting"} <= set(stats)


def test_a_prompt_sharing_only_the_start_of_a_long_one_finds_that_start(engine):
    """Two conversations with the same 80-token start (system prompt, tools), then different text:
    the second finds the shared start although the first's sliding layers freed those pages."""
    shared = prompt_of(80, salt=12)
    first = shared + prompt_of(100, salt=13)
    second = shared + prompt_of(20, salt=14)
    run(engine, [(first, greedy(2))])
    outputs = run(engine, [(second, greedy(2))])[0]
    assert outputs[-1].usage.cached_tokens == 80


def test_a_failed_step_ends_the_running_requests_with_the_error_and_the_engine_goes_on(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    backend = engine.backend
    real_step = backend.decode_logits  # the model step of decode and launch_decode (what the engine uses)

    def broken_step(batch, token_ids):
        backend.decode_logits = real_step  # fail once
        raise RuntimeError("device lost")

    backend.decode_logits = broken_step
    try:
        failed = run(engine, [(prompt_of(10, salt=15), greedy(5))])[0]
        assert failed[-1].finish_reason == "error" and "device lost" in failed[-1].error
        assert engine.stats()["pages_used"] == 0
        assert len(tokens_of(run(engine, [(prompt_of(10, salt=15), greedy(5))])[0])) == 5
    finally:
        engine.shutdown()


def test_a_shut_down_engine_is_freed_by_reference_counting(tiny_checkpoint):
    """No reference cycle holds an engine (the watchdog's callbacks, the step thread, the backend's helpers):
    shut down and let go, it is freed at once, its backend and KV pool with it, without the cyclic collector."""
    engine = make_engine(tiny_checkpoint)
    run(engine, [(prompt_of(10, salt=18), greedy(3))])
    engine.shutdown()
    alive = [weakref.ref(engine), weakref.ref(engine.backend), weakref.ref(engine.backend.kv_pool)]
    gc.collect()  # what earlier tests left behind; the engine is still referenced here
    gc.disable()
    try:
        del engine
        assert [ref() is None for ref in alive] == [True, True, True]
    finally:
        gc.enable()


def test_stop_token_ids_one_token_prompts_and_the_context_limit(engine, reference):
    prompt = prompt_of(1, salt=16)
    free = tokens_of(run(engine, [(prompt, greedy(8))])[0])
    assert_greedy_matches_reference(reference, prompt, free)  # a one-token prompt starts in a decode step
    stop_id = free[3]
    stopped = run(engine, [(prompt, greedy(8, stop_token_ids=[stop_id]))])[0]
    first = free.index(stop_id)
    assert tokens_of(stopped) == free[:first + 1]  # the stop token is reported, then nothing more
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop_id
    near_end = prompt_of(engine.max_model_len - 3, salt=17)
    capped = run(engine, [(near_end, greedy(100))])[0]
    assert len(tokens_of(capped)) == 3 and capped[-1].finish_reason == "length"


def test_min_tokens_bans_the_stop_tokens_until_it_is_reached(engine):
    """vLLM's rule: below min_tokens neither the model's EOS nor a stop token id is drawn, so the request goes on."""
    prompt = prompt_of(6, salt=18)
    free = tokens_of(run(engine, [(prompt, greedy(12))])[0])
    stop_id = free[0]
    assert len(tokens_of(run(engine, [(prompt, greedy(12, stop_token_ids=[stop_id]))])[0])) == 1
    held = run(engine, [(prompt, greedy(12, stop_token_ids=[stop_id], min_tokens=5))])[0]
    assert len(tokens_of(held)) >= 5 and stop_id not in tokens_of(held)[:5], tokens_of(held)
    eos_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=False, min_tokens=12)
    to_the_end = run(engine, [(prompt, eos_params)])[0]
    assert len(tokens_of(to_the_end)) == 12 and to_the_end[-1].finish_reason == "length"
    assert not set(engine.config.eos_token_ids) & set(tokens_of(to_the_end))  # EOS is banned below min_tokens


def test_each_step_reports_its_wall_time_to_the_scheduler(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, chunk_size=8)
    recorded = []
    record = engine.scheduler.record
    engine.scheduler.record = lambda plan, s: (recorded.append((bool(plan.decodes), bool(plan.prefills), s)),
                                               record(plan, s))
    try:
        outputs = run(engine, [(prompt_of(5), greedy(40)), (prompt_of(90), greedy(2))])
    finally:
        engine.shutdown()
    assert [len(tokens_of(o)) for o in outputs] == [40, 2]
    assert all(s > 0 for _, _, s in recorded)
    assert any(decodes and prefills for decodes, prefills, _ in recorded)  # the long prompt beside the decoder
    assert engine.scheduler.decode_step_s is not None
