"""The paged PyTorch backend against the contiguous reference model (model.py) on the tiny checkpoint."""

from __future__ import annotations

import contextlib

import pytest
import torch

from northcode.engine.backend import MIN_CONTEXT_PAGES, DecodeBatch, PrefillBatch, PrefillChunk, context_bucket
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.request import SamplingParams
from northcode.engine.sampling import BatchSamplingArgs, Sampler, SamplingRow, sample_on_device
from northcode.model.checkpoint import load_checkpoint
from northcode.model.model import NorthModel, route, run_experts
from northcode.torch_backend.backend import TorchBackend
from northcode.torch_backend.routed_experts import add_moe

NO_SAMPLING = BatchSamplingArgs.of_rows([])  # a batch that asks for logits only

PAGE = 16  # small pages: the tiny model's 32-token window spans three of them


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    config, weights = load_checkpoint(tiny_checkpoint, dtype=torch.float32)
    return config, weights, NorthModel(config, weights)


def paged(config, weights, num_pages=200, rows=4):
    kv = KVCacheManager(config, num_pages, PAGE, rows, 64)
    return kv, TorchBackend(config, weights, num_pages, PAGE, rows, 64)


def prefill(kv, backend, row, tokens, start, end):
    kv.evict_behind_window(row, start)
    kv.allocate(row, end)
    batch = PrefillBatch([PrefillChunk(row, tokens[start:end], start)], kv.block_tables, kv.version, kv.high_water)
    return backend.prefill(batch)[0]


def decode(kv, backend, rows, tokens_by_row, positions):
    for row, pos in zip(rows, positions):
        kv.evict_behind_window(row, pos)
        kv.allocate(row, pos + 1)
    batch = DecodeBatch(rows, [t[p] for t, p in zip(tokens_by_row, positions)], positions, NO_SAMPLING, False, True,
                        kv.block_tables, kv.version, kv.high_water)
    return backend.decode(batch).logits


@pytest.mark.parametrize("path", ["grouped", "gathered", "loop"])
def test_every_moe_path_equals_the_reference_experts(tiny, path):
    config, _, model = tiny
    layer = model.layers[1]
    h = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(1))
    weights, expert_ids = route(h, layer.router, config)
    want = x + run_experts(h, layer.experts_gate_up, layer.experts_down, expert_ids, weights)
    got = add_moe(x.clone(), h, layer, config, path, torch.arange(config.num_experts))
    torch.testing.assert_close(got, want)


def test_chunked_paged_prefill_and_decode_equal_the_contiguous_reference(tiny):
    """120 tokens teacher-forced: a prompt of 70 in chunks of 25, then 50 decode steps; the 32-token
    window is crossed many times and sliding layers free their pages; logits match at every step."""
    config, weights, model = tiny
    tokens = torch.randint(0, config.vocab_size, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    want = model.forward(torch.tensor([tokens]))[0]  # [120, V]
    kv, backend = paged(config, weights)
    for start in range(0, 70, 25):
        got = prefill(kv, backend, 2, tokens, start, min(70, start + 25))
    torch.testing.assert_close(got, want[69], atol=1e-4, rtol=1e-4)
    for pos in range(70, 120):
        got = decode(kv, backend, [2], [tokens], [pos])[0]
        torch.testing.assert_close(got, want[pos], atol=1e-4, rtol=1e-4)
    sliding = [i for i in range(config.num_hidden_layers) if config.window(i)]
    held = [(kv.block_tables[i, 2] >= 0).sum().item() for i in sliding]
    assert max(held) <= 4 < 120 // PAGE  # window (2-3 pages) + one of slack; full layers hold all 8
    assert (kv.block_tables[0, 2] >= 0).sum().item() == 8


@pytest.mark.parametrize("moe_path", ["grouped", "gathered"])
def test_rows_of_a_batch_do_not_interact(tiny, moe_path):
    config, weights, model = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (40, 75, 9)]
    kv, backend = paged(config, weights)
    backend.moe_path = moe_path
    for row, seq in enumerate(seqs):
        prefill(kv, backend, row, seq, 0, len(seq) - 1)
    positions = [len(s) - 1 for s in seqs]
    together = decode(kv, backend, [0, 1, 2], seqs, positions)
    for row, seq in enumerate(seqs):
        want = model.forward(torch.tensor([seq]))[0, -1]
        torch.testing.assert_close(together[row], want, atol=1e-4, rtol=1e-4)


def test_long_prefill_attention_in_query_blocks_gives_the_same_logits(tiny, monkeypatch):
    """The fp32 score budget splits a chunk's queries into blocks (long contexts stay in memory)."""
    import northcode.torch_backend.paged_prefill as paged_prefill

    config, weights, model = tiny
    tokens = torch.randint(0, config.vocab_size, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    want = model.forward(torch.tensor([tokens]))[0, -1]
    monkeypatch.setattr(paged_prefill, "SCORE_BUDGET_BYTES", 4 * config.num_attention_heads * 96 * 7)
    kv, backend = paged(config, weights)
    torch.testing.assert_close(prefill(kv, backend, 0, tokens, 0, 90), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("query_blocks", [False, True], ids=["whole", "query-blocks"])
def test_full_layers_attend_causal_without_a_mask_and_give_the_same_logits(tiny, monkeypatch, query_blocks):
    """Chunks of at least CAUSAL_MIN_QUERIES tokens attend on full layers from the bottom right without a mask:
    chunks that start mid-page, every chunk's last logits equal the reference's, whole or in query blocks."""
    import northcode.torch_backend.paged_prefill as paged_prefill

    config, weights, model = tiny
    tokens = torch.randint(0, config.vocab_size, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    want = model.forward(torch.tensor([tokens]))[0]  # [90, V]
    monkeypatch.setattr(paged_prefill, "CAUSAL_MIN_QUERIES", 2)
    if query_blocks:
        monkeypatch.setattr(paged_prefill, "SCORE_BUDGET_BYTES", 4 * config.num_attention_heads * 96 * 7)
    kv, backend = paged(config, weights)
    for start in range(0, 90, 23):
        end = min(90, start + 23)
        torch.testing.assert_close(prefill(kv, backend, 1, tokens, start, end), want[end - 1], atol=1e-4, rtol=1e-4)


def test_padded_rows_touch_only_the_scratch_page_and_change_no_real_row(tiny):
    """What a CUDA graph does with a batch of 2 in a bucket of 4: two rows at index max_batch (all -1),
    token 0 at position 0. Real rows' logits are unchanged, and only the scratch page is written."""
    config, weights, model = tiny
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (50, 20)]
    kv, backend = paged(config, weights)
    for row, seq in enumerate(seqs):
        prefill(kv, backend, row, seq, 0, len(seq) - 1)
        kv.allocate(row, len(seq))
    backend.device_tables.upload(kv.block_tables, kv.version)
    before = backend.kv_pool.clone()
    def step(tokens, positions, rows):
        return backend.decode_step(torch.tensor(tokens), torch.tensor(positions), torch.tensor(rows), 4)

    with torch.inference_mode():
        padded = step([seqs[0][-1], seqs[1][-1], 0, 0], [49, 19, 0, 0], [0, 1, backend.max_batch, backend.max_batch])
        written = (backend.kv_pool != before).flatten(2).any(-1)  # [2, pages]: K or V, page
        backend.kv_pool.copy_(before)
        alone = step([seqs[0][-1], seqs[1][-1]], [49, 19], [0, 1])
    torch.testing.assert_close(padded[:2], alone, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()
    real_pages = {int(p) for p in kv.block_tables[:, :2].flatten() if p >= 0}
    touched = set(written.any(0).nonzero().flatten().tolist())
    assert backend.scratch_page in touched and touched - {backend.scratch_page} <= real_pages


def test_prefill_warm_up_runs_every_length_bucket_and_changes_no_live_page_or_table(tiny, monkeypatch):
    """warm_up_prefill (warm_up runs it on a GPU) runs chunks of 1, 2, 4, ... tokens on the padding row over the
    scratch page only: a prefilled row's pages, the device tables and the row's next logits are as without
    it, and the scratch page is zero again."""
    config, weights, _ = tiny
    tokens = torch.randint(0, config.vocab_size, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    (kv, backend), (plain_kv, plain) = paged(config, weights), paged(config, weights)
    for cache, b in ((kv, backend), (plain_kv, plain)):
        prefill(cache, b, 1, tokens, 0, 50)
    pool, tables = backend.kv_pool.clone(), backend.tables.clone()
    chunks, forward = [], backend.prefiller.forward
    monkeypatch.setattr(backend.prefiller, "forward",
                        lambda ids, start, row: chunks.append((len(ids), start, row)) or forward(ids, start, row))
    backend.warm_up_prefill()
    longest = backend.max_pages_per_seq * PAGE  # 1024: the row's table
    assert [n for n, _, _ in chunks] == [1 << i for i in range(11)]
    assert all(row == backend.max_batch and start % PAGE == 0 and start + n <= longest for n, start, row in chunks)
    assert torch.equal(backend.tables, tables) and not backend.kv_pool[:, backend.scratch_page].any()
    assert torch.equal(backend.kv_pool, pool)
    torch.testing.assert_close(prefill(kv, backend, 1, tokens, 50, 70), prefill(plain_kv, plain, 1, tokens, 50, 70),
                               atol=0, rtol=0)


def test_context_buckets_round_up_by_at_most_an_eighth():
    for pages in range(1, 3000):
        bucket = context_bucket(pages, 10_000)
        most = max(MIN_CONTEXT_PAGES, 2 * pages) if pages <= 16 else pages * 1.125
        assert pages <= bucket <= most
    assert context_bucket(129, 10_000) == 144 and context_bucket(129, 130) == 130
    assert len({context_bucket(p, 10_000) for p in range(1, 8000)}) < 100  # graphs per batch size up to 512K tokens


def test_decode_step_of_the_full_layer_plan_launches_few_kernels_and_never_syncs():
    """North Mini Code's 49 layers, 128 experts top-8, 32/4 heads at tiny widths (kernel counts depend on
    the structure, not the widths): a bounded number of kernels per layer whatever the batch and the
    number of experts (no loop over rows or experts), and no op that makes the host wait (CUDA-graph safe).
    Before this step was reorganised it took 2825 at batch 1."""
    from collections import Counter

    from northcode.torch_backend.decode_step import layer_kind
    from northcode.torch_backend.op_count import count_decode, structural_config

    config = structural_config()
    per_kind = Counter(layer_kind(config, i) for i in range(config.num_hidden_layers))
    # batch > 1: two more per MoE layer for the combine without a batched GEMM (routed_experts.add_weighted)
    for batch, most, per_sliding_layer in ((1, 1150, 24), (4, 1300, 26)):
        counter = count_decode(batch=batch, context=300)
        assert not counter.syncs
        assert len(counter.kernels) <= most, f"batch {batch}: {len(counter.kernels)} kernels"
        by_part = Counter(part for _, part in counter.kernels)
        assert by_part["layer.sliding_rope_moe"] <= per_sliding_layer * per_kind["sliding_rope_moe"]
        assert by_part["prepare"] <= 80


def test_the_moe_path_is_chosen_by_dtype_and_device():
    from northcode.torch_backend.routed_experts import choose_moe_path

    assert choose_moe_path(torch.device("cpu"), torch.float32) == "grouped"
    assert choose_moe_path(torch.device("cuda"), torch.bfloat16) == "grouped"
    assert choose_moe_path(torch.device("cuda"), torch.float32) == "gathered"  # CUDA's grouped GEMM: bf16 only


def test_bf16_decode_is_as_close_to_fp32_as_the_bf16_reference(tiny):
    """The bf16 step moves a few roundings (scale with the mask, residual adds inside the GEMMs): over 30
    teacher-forced decode steps its logits stay as close to the fp32 model's as model.py's own bf16 path.
    (Medians: a random model's router near-ties make single steps of any bf16 path jump.)"""
    config, weights, model = tiny
    bf16 = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    exact = NorthModel(config, {name: tensor.float() for name, tensor in bf16.items()})  # fp32 of the bf16 weights
    tokens = torch.randint(0, config.vocab_size, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    want = exact.forward(torch.tensor([tokens]))[0, 59:89]
    reference = NorthModel(config, bf16).forward(torch.tensor([tokens]))[0, 59:89].float()
    kv, backend = paged(config, bf16)
    prefill(kv, backend, 0, tokens, 0, 59)
    got = torch.stack([decode(kv, backend, [0], [tokens], [pos])[0] for pos in range(59, 89)])
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=-1).median().item()  # noqa: E731
    assert cosine(got, want) >= min(0.999, cosine(reference, want) - 1e-3)


SAMPLING = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2),
            SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05)]


@pytest.mark.parametrize("kinds", [[0, 1, 2, 3, 4, 5], [0, 1, 1], [5, 0], [0, 0]])
def test_the_device_sampler_draws_the_tokens_of_the_pytorch_sampler(kinds):
    """Same logits and rows: the same tokens as sampling.Sampler for every mix of greedy and random rows (with
    and without top-k/top-p/min-p in the batch), over many seeds and draw numbers."""
    gen = torch.Generator().manual_seed(len(kinds))
    for trial in range(25):
        logits = torch.randn(len(kinds), 300, generator=gen) * 3
        rows = [SamplingRow(SAMPLING[k], seed=trial * 7 + b, prompt_ids=[1, 2], output_ids=[5] * (trial % 4))
                for b, k in enumerate(kinds)]
        assert sample_on_device(logits, BatchSamplingArgs.of_rows(rows)).tolist() == Sampler().sample(logits, rows).token_ids


def launch_batch(kv, rows, tokens, positions, sampling) -> DecodeBatch:
    """sampling: a SamplingRow per row (its output_ids' length is the draw number)."""
    for row, pos in zip(rows, positions):
        kv.evict_behind_window(row, pos)
        kv.allocate(row, pos + 1)
    return DecodeBatch(rows, tokens, positions, BatchSamplingArgs.of_rows(sampling), True, False, kv.block_tables,
                       kv.version, kv.high_water)


def host_fed_batch(kv, order, prompts, outputs, sampling) -> DecodeBatch:
    """The next step of rows `order`, each fed its last token (prompt + outputs so far) from the host."""
    return launch_batch(kv, order, [(prompts[r] + outputs[r])[-1] for r in order],
                        [len(prompts[r]) + len(outputs[r]) - 1 for r in order], [sampling(r, outputs[r]) for r in order])


@contextlib.contextmanager
def no_host_reads():
    """Fails on any op that makes the host wait for the device (op_count's list) or reads a tensor's values."""
    from northcode.torch_backend.op_count import KernelCounter

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host during the launch")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", refuse)
        patch.setattr(torch.Tensor, "item", refuse)
        with KernelCounter() as counter:
            yield
    assert not counter.syncs


def test_launch_decode_feeds_carried_rows_from_the_device_and_samples_as_decode(tiny):
    """Rows join, leave and change order between launches; each launch is made before the previous one is
    read, carried rows feed the token still on the device, and no launch reads the device. The tokens equal
    those of decode fed every token from the host."""
    config, weights, _ = tiny
    decoded, launched = decoded_and_launched(config, weights, no_host_reads)
    assert launched == decoded and [len(o) for o in decoded] == [8, 6, 5]
    assert len(set(decoded[1])) > 1  # the random row did draw


def decoded_and_launched(config, weights, no_sync) -> tuple[list[list[int]], list[list[int]]]:
    """The tokens of three rows (greedy, top-p, top-k) over eight steps whose rows join, leave and change
    order: (by decode, fed from the host; by launch_decode, pipelined, each launch under no_sync())."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (30, 45, 12)]
    params = [SAMPLING[0], SAMPLING[3], SAMPLING[2]]
    orders = [[0, 1], [1, 0], [0, 1], [2, 0, 1], [1, 2, 0], [0, 1, 2], [2, 0], [0, 2]]  # row 2 joins, row 1 leaves

    def sampling(row, outputs):
        return SamplingRow(params[row], 100 + row, prompts[row], outputs)

    def prefilled():
        kv, backend = paged(config, weights)
        backend.warm_up()  # a GPU's graphs are captured before the launches (a capture synchronises)
        for row, prompt in enumerate(prompts):
            prefill(kv, backend, row, prompt, 0, len(prompt) - 1)
        return kv, backend

    kv, plain = prefilled()
    outputs: list[list[int]] = [[], [], []]
    for order in orders:
        for r, token in zip(order, plain.decode(host_fed_batch(kv, order, prompts, outputs, sampling)).token_ids):
            outputs[r].append(token)

    kv, launching = prefilled()
    read: list[list[int]] = [[], [], []]
    drawn = [0, 0, 0]  # tokens sampled per row, read or not
    previous, pending = [], None
    for order in orders:
        carry = [previous.index(r) if r in previous else -1 for r in order]
        batch = launch_batch(kv, order, [-1 if c >= 0 else (prompts[r] + read[r])[-1] for r, c in zip(order, carry)],
                             [len(prompts[r]) + drawn[r] - 1 for r in order],
                             [sampling(r, read[r] + [-1] * (drawn[r] - len(read[r]))) for r in order])
        with no_sync():
            launched = launching.launch_decode(batch, carry)
        if pending is not None:
            for r, token in zip(previous, pending.result().token_ids):
                read[r].append(token)
        for r in order:
            drawn[r] += 1
        previous, pending = order, launched
    for r, token in zip(previous, pending.result().token_ids):
        read[r].append(token)
    return outputs, read


def test_launch_decode_refuses_what_it_cannot_run(tiny):
    config, weights, _ = tiny
    kv, backend = paged(config, weights)
    prefill(kv, backend, 0, [5, 6, 7, 8], 0, 3)
    row = SamplingRow(SamplingParams(temperature=0.0), 0, [5, 6, 7, 8], [])
    with pytest.raises(ValueError, match=r"carry\[0\] = 0, but the previous launch had 0 rows"):
        backend.launch_decode(launch_batch(kv, [0], [-1], [3], [row]), [0])
    penalised = SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.5), 0, [5, 6, 7, 8], [])
    with pytest.raises(ValueError, match="row 0 asks for penalties or logprobs"):
        backend.launch_decode(launch_batch(kv, [0], [8], [3], [penalised]), [-1])
    backend.launch_decode(launch_batch(kv, [0], [8], [3], [row]), [-1]).result()
    backend.decode(launch_batch(kv, [0], [9], [4], [row]))  # a synchronous step: nothing left to carry
    with pytest.raises(ValueError, match="the previous launch had 0 rows"):
        backend.launch_decode(launch_batch(kv, [0], [-1], [5], [row]), [0])


def test_decode_and_launch_decode_both_run_the_model_through_decode_logits(tiny):
    """launch_decode is a method the engine always finds; a fault injected into decode_logits (what the
    engine's fault tests replace) reaches the pipelined path and the step-by-step one alike."""
    config, weights, _ = tiny
    kv, backend = paged(config, weights)
    prefill(kv, backend, 0, [5, 6, 7, 8], 0, 3)
    row = SamplingRow(SamplingParams(temperature=0.0), 0, [5, 6, 7, 8], [])
    calls = []

    def failing(batch, token_ids):
        calls.append(token_ids.tolist())
        raise RuntimeError("injected")

    backend.decode_logits = failing
    with pytest.raises(RuntimeError, match="injected"):
        backend.launch_decode(launch_batch(kv, [0], [8], [3], [row]), [-1])
    with pytest.raises(RuntimeError, match="injected"):
        backend.decode(launch_batch(kv, [0], [8], [3], [row]))
    assert calls == [[8], [8]]


def test_a_bucket_whose_capture_fails_decodes_eagerly_and_says_why(tiny, monkeypatch):
    """The capture is what fails (the warm-up steps ran): the bucket is recorded with the error and runs the
    same step eagerly, giving the logits of a backend without graphs; later steps do not retry it."""
    import northcode.torch_backend.backend as torch_backend

    attempts = []

    class FailingCapture:
        def __init__(self, backend, batch, num_full_pages):
            self.key = (batch, num_full_pages)

        def warm_up(self):
            pass

        def capture(self):
            attempts.append(self.key)
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")

    config, weights, _ = tiny
    tokens = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    kv, backend = paged(config, weights)
    prefill(kv, backend, 0, tokens, 0, 30)
    want = [decode(kv, backend, [0], [tokens], [pos])[0] for pos in (30, 31)]
    kv, backend = paged(config, weights)
    prefill(kv, backend, 0, tokens, 0, 30)
    monkeypatch.setattr(torch_backend, "_DecodeGraph", FailingCapture)
    backend.use_graphs = True  # what a GPU does; the captures fail
    got = [decode(kv, backend, [0], [tokens], [pos])[0] for pos in (30, 31)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert attempts == [(1, MIN_CONTEXT_PAGES)] and not backend.graphs
    assert backend.capture_failures == {
        (1, MIN_CONTEXT_PAGES): "RuntimeError: CUDA error: operation failed due to a previous error during capture"}
