"""Scheduler policy on the real KV cache manager, with the model replaced by a token rule (no tensors)."""

from __future__ import annotations

import pytest

from northcode.config import ModelConfig
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.request import SamplingParams
from northcode.engine.scheduler import Scheduler, StepPlan
from northcode.engine.sequence import Sequence, SequenceStatus

PAGE = 4


def make_scheduler(num_pages: int = 200, max_batch: int = 4, chunk_size: int = 8, window: int = 8) -> Scheduler:
    config = ModelConfig(vocab_size=64, hidden_size=8, num_hidden_layers=2, num_attention_heads=1, head_dim=4,
                         layer_types=("full_attention", "sliding_attention"), sliding_window=window,
                         max_position_embeddings=256)
    kv = KVCacheManager(config, num_pages, PAGE, max_batch, 64)
    return Scheduler(kv, max_batch, chunk_size, max_model_len=256)


_arrivals = iter(range(1, 10**6))


def make_seq(prompt_len: int, max_new: int = 4, first_token: int = 1) -> Sequence:
    prompt = [(first_token + i) % 64 for i in range(prompt_len)]
    return Sequence(f"r{next(_arrivals)}", prompt, SamplingParams(max_tokens=max_new), seed=0,
                    max_new_tokens=max_new, arrival=next(_arrivals))


def step(scheduler: Scheduler) -> StepPlan:
    """Run one step the way the engine does: schedule, 'compute', sample token 7, finish at max_new."""
    plan = scheduler.schedule()
    scheduler.commit(plan)
    for seq in plan.decodes + [c.sequence for c in plan.prefills if c.samples]:
        seq.output_ids.append(7)
        if len(seq.output_ids) >= seq.max_new_tokens:
            scheduler.finish(seq)
    return plan


def run_to_end(scheduler: Scheduler, max_steps: int = 500) -> list[StepPlan]:
    plans = []
    while scheduler.has_work:
        plans.append(step(scheduler))
        assert len(plans) < max_steps, "no progress"
    return plans


def test_chunked_prefill_shares_steps_with_running_decodes():
    scheduler = make_scheduler(chunk_size=8)
    short = make_seq(3, max_new=20)
    scheduler.add(short)
    step(scheduler)  # prefill of the short prompt, first token
    long = make_seq(40, max_new=2)
    scheduler.add(long)
    plans = [step(scheduler) for _ in range(5)]
    for i, plan in enumerate(plans):  # every step decodes the short one and one chunk of the long prompt
        assert plan.decodes == [short]
        assert [(c.sequence, c.start, c.end) for c in plan.prefills] == [(long, 8 * i, 8 * i + 8)]
    assert long.is_decoding and len(long.output_ids) == 1


def test_prefill_budget_is_shared_by_several_short_prompts():
    scheduler = make_scheduler(chunk_size=8)
    seqs = [make_seq(3) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plan = step(scheduler)
    assert [c.end - c.start for c in plan.prefills] == [3, 3, 2]  # 8 tokens, FIFO


def test_fifo_admission_up_to_max_batch():
    scheduler = make_scheduler(max_batch=2)
    seqs = [make_seq(3) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    step(scheduler)
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]
    run_to_end(scheduler)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert scheduler.kv.num_free_pages == 200 and sorted(scheduler.free_rows) == [0, 1]


def test_preemption_when_pages_run_out_keeps_output_and_completes_everything():
    # 2 layers x 10 pages: each sequence of 3 + 12 tokens needs 4 full pages + 3..4 sliding pages
    scheduler = make_scheduler(num_pages=12, max_batch=3, window=8)
    seqs = [make_seq(3, max_new=12) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    plans = run_to_end(scheduler)
    preempted = [s for plan in plans for s in plan.preempted]
    assert preempted, "the pool was meant to run out"
    assert all(s is seqs[-1] or s is seqs[-2] for s in preempted)  # victims are the latest arrivals
    assert all(s.output_ids == [7] * 12 for s in seqs)
    assert scheduler.kv.num_free_pages == 12


def test_request_that_can_never_fit_fails_with_the_numbers():
    scheduler = make_scheduler(num_pages=10)
    with pytest.raises(ValueError, match=r"needs \d+ KV pages .* the pool holds 10"):
        scheduler.add(make_seq(60, max_new=10))
    with pytest.raises(ValueError, match="does not fit the context of 256"):
        scheduler.check_fits(256, 1)
    with pytest.raises(ValueError, match="empty"):
        scheduler.check_fits(0, 1)


def test_abort_frees_everything_at_any_time():
    scheduler = make_scheduler(chunk_size=4)
    running, waiting = make_seq(30, max_new=50), make_seq(5)
    scheduler.add(running)
    step(scheduler)  # mid-prefill
    scheduler.add(waiting)
    scheduler.finish(running)
    scheduler.finish(waiting)
    assert not scheduler.has_work
    assert scheduler.kv.num_free_pages == 200 and scheduler.kv.block_tables.eq(-1).all()


def test_a_finished_request_publishes_prompt_and_output_for_the_next_turn():
    scheduler = make_scheduler(chunk_size=64)
    first = make_seq(10, max_new=10)
    scheduler.add(first)
    run_to_end(scheduler)
    # next turn: the whole first sequence (prompt + output) plus a new message
    second = Sequence("turn2", first.tokens + [3, 4, 5], SamplingParams(), 0, 4, next(_arrivals))
    scheduler.add(second)
    step(scheduler)
    # 19 of its 20 tokens have KV (the last output token never ran through the model): 4 full blocks
    assert second.num_cached_tokens == 16


def test_after_a_backend_restart_sequences_are_taken_back_and_recompute_what_they_had():
    old = make_scheduler(chunk_size=8)
    first, second, waiting = make_seq(6, max_new=6), make_seq(6, max_new=6), make_seq(4, max_new=3)
    for seq in (first, second):
        old.add(seq)
    for _ in range(3):
        step(old)
    old.add(waiting)
    assert first.output_ids == [7, 7, 7] and first.status is SequenceStatus.RUNNING
    new = make_scheduler(chunk_size=8)  # the restarted engine's: a fresh pool, nothing cached
    for seq in (waiting, second, first):
        new.take_back(seq)
    assert [s.arrival for s in new.waiting] == sorted(s.arrival for s in (first, second, waiting))
    assert first.row is None and first.num_computed == 0 and first.num_preemptions == 1
    assert waiting.num_preemptions == 0
    plan = step(new)  # the prompt and the 3 tokens so far are prefilled again, then decoding goes on
    assert [(c.sequence, c.start, c.end) for c in plan.prefills][0] == (first, 0, 8)
    run_to_end(new)
    assert first.output_ids == [7] * 6 and second.output_ids == [7] * 6 and waiting.output_ids == [7] * 3
    assert new.kv.num_free_pages == 200


# --- prompts beside decoding rows: turns by wall time ---

def test_a_chunk_beside_decoding_rows_is_followed_by_decode_only_steps_for_its_share_of_the_time():
    from northcode.engine.scheduler import DECODE_SHARE

    scheduler = make_scheduler(chunk_size=8)
    decoder = make_seq(4, max_new=100)
    scheduler.add(decoder)
    scheduler.record(step(scheduler), 0.010)  # its prompt, alone: nothing owed
    assert scheduler.prefill_debt_s == 0.0
    scheduler.record(step(scheduler), 0.003)  # decoding alone: the step's time is learned
    assert scheduler.decode_step_s == pytest.approx(0.003)
    scheduler.add(make_seq(40))  # a long prompt arrives
    mixed = step(scheduler)
    assert mixed.decodes == [decoder] and mixed.prefills
    scheduler.record(mixed, 0.093)  # 90 ms of chunk beside the decode
    owed = 0.090 * DECODE_SHARE / (1 - DECODE_SHARE)
    assert scheduler.prefill_debt_s == pytest.approx(owed)
    held = 0
    while True:
        plan = step(scheduler)
        if plan.prefills:
            break
        assert plan.decodes == [decoder]
        scheduler.record(plan, 0.003)
        held += 1
    assert held == -(-owed // 0.003)  # decode-only steps until the decoder had its share


def test_without_decoding_rows_prompts_run_every_step_whatever_is_owed():
    scheduler = make_scheduler(chunk_size=8)
    scheduler.prefill_debt_s = 5.0
    scheduler.add(make_seq(30))
    plans = [step(scheduler) for _ in range(3)]
    assert all(plan.prefills and not plan.decodes for plan in plans)
    scheduler.record(plans[-1], 0.050)
    assert scheduler.prefill_debt_s == 0.0


def test_a_long_prompt_beside_a_decoder_still_finishes_its_prefill():
    from northcode.engine.scheduler import DECODE_SHARE

    scheduler = make_scheduler(chunk_size=8)
    decoder = make_seq(4, max_new=400)
    scheduler.add(decoder)
    scheduler.record(step(scheduler), 0.001)
    scheduler.record(step(scheduler), 0.002)
    long = make_seq(64, max_new=2)
    scheduler.add(long)
    mixed = decode_only = 0
    while not long.output_ids:
        plan = step(scheduler)
        mixed, decode_only = mixed + bool(plan.prefills), decode_only + (not plan.prefills)
        scheduler.record(plan, 0.010 if plan.prefills else 0.002)
        assert mixed + decode_only < 200, "the prompt starved beside the decoder"
    assert mixed == 64 // 8
    # each chunk's 8 ms beside the decode is owed DECODE_SHARE / (1 - DECODE_SHARE) of it in 2 ms steps
    assert decode_only == (mixed - 1) * -(-0.008 * DECODE_SHARE / (1 - DECODE_SHARE) // 0.002)


def test_prompts_that_came_with_a_decoding_row_are_not_held_by_it():
    scheduler = make_scheduler(chunk_size=8)
    short, long = make_seq(4, max_new=100), make_seq(64, max_new=2)
    scheduler.add(short)
    scheduler.add(long)  # the same burst: both are waiting when the first is admitted
    while not long.output_ids:
        plan = step(scheduler)
        assert plan.prefills, "a prompt of the burst was held"
        assert not plan.turns
        scheduler.record(plan, 0.050)
        scheduler.prefill_debt_s = 1.0  # whatever is owed, it is not owed by these prompts
    assert short.output_ids
