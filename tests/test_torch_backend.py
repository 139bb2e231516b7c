"""The paged PyTorch backend against the contiguous reference model (model.py) on the tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from northcode.engine.backend import DecodeBatch, PrefillBatch, PrefillChunk
from northcode.engine.checkpoint import load_checkpoint
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.model import NorthModel, route, run_experts
from northcode.engine.torch_backend import TorchBackend, batched_moe

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
    batch = DecodeBatch(rows, [t[p] for t, p in zip(tokens_by_row, positions)], positions, [], False, True,
                        kv.block_tables, kv.version, kv.high_water)
    return backend.decode(batch).logits


def test_batched_moe_equals_the_reference_experts(tiny):
    config, _, model = tiny
    layer = model.layers[1]
    h = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, expert_ids = route(h, layer.router, config)
    torch.testing.assert_close(batched_moe(h, layer, config),
                               run_experts(h, layer.experts_gate_up, layer.experts_down, expert_ids, weights))


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


def test_rows_of_a_batch_do_not_interact(tiny):
    config, weights, model = tiny
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (40, 75, 9)]
    kv, backend = paged(config, weights)
    for row, seq in enumerate(seqs):
        prefill(kv, backend, row, seq, 0, len(seq) - 1)
    positions = [len(s) - 1 for s in seqs]
    together = decode(kv, backend, [0, 1, 2], seqs, positions)
    for row, seq in enumerate(seqs):
        want = model.forward(torch.tensor([seq]))[0, -1]
        torch.testing.assert_close(together[row], want, atol=1e-4, rtol=1e-4)


def test_long_prefill_attention_in_query_blocks_gives_the_same_logits(tiny, monkeypatch):
    """The fp32 score budget splits a chunk's queries into blocks (long contexts stay in memory)."""
    import northcode.engine.torch_backend as torch_backend

    config, weights, model = tiny
    tokens = torch.randint(0, config.vocab_size, (90,), generator=torch.Generator().manual_seed(3)).tolist()
    want = model.forward(torch.tensor([tokens]))[0, -1]
    monkeypatch.setattr(torch_backend, "SCORE_BUDGET_BYTES", 4 * config.num_attention_heads * 96 * 7)
    kv, backend = paged(config, weights)
    torch.testing.assert_close(prefill(kv, backend, 0, tokens, 0, 90), want, atol=1e-4, rtol=1e-4)
