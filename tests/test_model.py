"""model/model.py on its own: each building block against its definition (and transformers'
module where there is one), the KV cache against full recomputation, batching, weight checks."""

from __future__ import annotations

import math

import pytest
import torch

from northcode.config import ModelConfig
from northcode.model.checkpoint import canonical_shapes
from northcode.model.model import (
    NorthModel,
    apply_rope,
    attention,
    attention_mask,
    norm,
    rope_cos_sin,
    rope_inv_freq,
    route,
    run_experts,
)

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=16, prefix_dense_intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
            sliding_window_pattern=4, first_k_dense_replace=1, num_experts=6, num_experts_per_tok=2,
            expert_selection_fn="sigmoid", norm_topk_prob=False, rms_norm_eps=1e-6, logit_scale=1.0,
            rope_theta=50000.0, max_position_embeddings=512, eos_token_id=2, bos_token_id=1)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical weights: every matrix ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in canonical_shapes(config).items():
        values = torch.randn(shape, generator=generator)
        weights[name] = 1 + 0.1 * values if len(shape) == 1 else values / math.sqrt(shape[-1])
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def random_model(seed: int = 0, **overrides) -> NorthModel:
    config = ModelConfig(**{**TINY, **overrides})
    return NorthModel(config, random_weights(config, seed))


def token_ids(length: int, seed: int = 1, batch: int | None = None) -> torch.Tensor:
    shape = (length,) if batch is None else (batch, length)
    return torch.randint(3, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


# --- building blocks ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [True, False])
def test_norm_matches_transformers_modules(rms, dtype):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeLayerNorm, Cohere2MoeRMSNorm

    config = ModelConfig(**{**TINY, "rms_norm_eps": 1e-6 if rms else None, "layer_norm_eps": 1e-5})
    module = Cohere2MoeRMSNorm(32, eps=1e-6) if rms else Cohere2MoeLayerNorm(32, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(32))
    module = module.to(dtype)
    x = (3 * torch.randn(5, 32) + 1).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x, module.weight, config), module(x))


def test_rope_rotates_interleaved_pairs_by_position_times_frequency():
    head_dim, theta = 8, 10000.0
    inv_freq = rope_inv_freq(head_dim, theta)
    positions = torch.tensor([0, 1, 7, 300])
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)  # [4, 8]
    x = torch.randn(4, 3, head_dim)  # [T, heads, D]
    rotated = apply_rope(x, cos, sin)
    for t, p in enumerate(positions.tolist()):
        for i in range(head_dim // 2):
            angle = p * theta ** (-2 * i / head_dim)
            x0, x1 = x[t, :, 2 * i], x[t, :, 2 * i + 1]
            torch.testing.assert_close(rotated[t, :, 2 * i], x0 * math.cos(angle) - x1 * math.sin(angle))
            torch.testing.assert_close(rotated[t, :, 2 * i + 1], x1 * math.cos(angle) + x0 * math.sin(angle))
    assert torch.equal(rotated[0], x[0])  # position 0 is the identity


def test_rope_matches_transformers():
    from transformers import Cohere2MoeConfig
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeRotaryEmbedding, apply_rotary_pos_emb

    hf_config = Cohere2MoeConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rope_theta=50000.0)
    positions = torch.arange(40, 60)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(1, 4, 20, 16, dtype=dtype), torch.randn(1, 2, 20, 16, dtype=dtype)  # [B, heads, T, D]
        cos_ref, sin_ref = Cohere2MoeRotaryEmbedding(hf_config)(q, positions[None])
        q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
        cos, sin = rope_cos_sin(positions, rope_inv_freq(16, 50000.0), dtype)
        assert torch.equal(cos, cos_ref[0]) and torch.equal(sin, sin_ref[0])
        assert torch.equal(apply_rope(q.transpose(1, 2), cos, sin), q_ref.transpose(1, 2))
        assert torch.equal(apply_rope(k.transpose(1, 2), cos, sin), k_ref.transpose(1, 2))


def test_attention_mask_is_causal_with_window():
    mask = attention_mask(torch.arange(10), torch.arange(10), window=3)
    for p in range(10):
        assert mask[p].nonzero().flatten().tolist() == list(range(max(0, p - 2), p + 1))
    full = attention_mask(torch.tensor([5]), torch.arange(10), window=None)
    assert full[0].nonzero().flatten().tolist() == list(range(6))


def test_attention_equals_explicit_per_head_softmax():
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)  # 2 query heads per KV head
    out = attention(q, k, v, torch.arange(6), torch.arange(6), window=4).view(1, 6, 4, 8)
    for t in range(6):
        keys = list(range(max(0, t - 3), t + 1))
        for head in range(4):
            kv = head // 2
            probs = torch.softmax(k[0, keys, kv] @ q[0, t, head] / math.sqrt(8), dim=0)
            torch.testing.assert_close(out[0, t, head], probs @ v[0, keys, kv])


def test_route_selection_functions():
    router = torch.eye(4)  # logit of expert e is h[e]
    h = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    config = ModelConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2})
    weights, ids = route(h, router, config)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[2.0, 1.0]])))
    normalised_config = ModelConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True})
    weights, _ = route(h, router, normalised_config)
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(weights, (s / s.sum())[None])
    softmax_config = ModelConfig(**{**TINY, "num_experts": 4, "num_experts_per_tok": 2,
                                    "expert_selection_fn": "softmax"})
    weights, _ = route(h, router, softmax_config)
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), dim=-1))


def test_run_experts_computes_only_selected_experts():
    num_experts, hidden, inter = 5, 8, 4
    gate_up, down = torch.randn(num_experts, 2 * inter, hidden), torch.randn(num_experts, hidden, inter)
    gate_up[[0, 4]] = float("nan")  # experts nobody selects: touching them would poison the output
    h = torch.randn(3, hidden)
    expert_ids = torch.tensor([[1, 2], [2, 3], [3, 1]])
    weights = torch.rand(3, 2)
    out = run_experts(h, gate_up, down, expert_ids, weights)
    for n in range(3):
        expected = sum(weights[n, j] * down[e] @ (torch.nn.functional.silu(gate_up[e, :inter] @ h[n])
                                                  * (gate_up[e, inter:] @ h[n]))
                       for j, e in enumerate(expert_ids[n].tolist()))
        torch.testing.assert_close(out[n], expected)


def test_run_experts_groups_pairs_as_torch_where_did():
    """The pairs are grouped on the host (one transfer, not a GPU sync per expert); each expert must still see
    its (token, slot) pairs in torch.where's row-major order, so sums are bit for bit what they were."""
    gen = torch.Generator().manual_seed(3)
    num_experts, hidden, inter, tokens, k = 16, 32, 8, 40, 4
    gate_up, down = torch.randn(num_experts, 2 * inter, hidden, generator=gen), torch.randn(num_experts, hidden, inter,
                                                                                          generator=gen)
    h, weights = torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, k, generator=gen)
    expert_ids = torch.randint(0, num_experts, (tokens, k), generator=gen)  # repeats inside a row too
    want = torch.zeros_like(h)
    for expert_id in torch.unique(expert_ids).tolist():
        token_idx, slot_idx = torch.where(expert_ids == expert_id)
        gate, up = torch.nn.functional.linear(h[token_idx], gate_up[expert_id]).chunk(2, dim=-1)
        out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[expert_id])
        want.index_add_(0, token_idx, out * weights[token_idx, slot_idx, None])
    assert torch.equal(run_experts(h, gate_up, down, expert_ids, weights), want)


# --- the model over its cache ---


def test_incremental_decode_matches_full_recomputation():
    model = random_model()
    ids = token_ids(24)  # crosses the window of 8 several times
    full = model.prefill(ids, model.new_cache())  # [24, V]
    cache = model.new_cache()
    steps = [model.prefill(ids[:5], cache)[-1]] + [model.decode(int(t), cache) for t in ids[5:]]
    assert cache.seq_len == 24
    torch.testing.assert_close(torch.stack(steps), full[4:], rtol=1e-5, atol=1e-5)


def test_chunked_prefill_matches_single_prefill():
    model = random_model()
    ids = token_ids(30)
    full = model.prefill(ids, model.new_cache())
    cache = model.new_cache()
    chunks = [model.prefill(ids[a:b], cache) for a, b in ((0, 7), (7, 19), (19, 30))]
    torch.testing.assert_close(torch.cat(chunks), full, rtol=1e-5, atol=1e-5)
    last = model.prefill(ids, model.new_cache(), last_only=True)
    assert last.shape == (1, model.config.vocab_size)
    torch.testing.assert_close(last[0], full[-1])


def test_batched_forward_matches_each_sequence_alone():
    model = random_model(expert_selection_fn="softmax", num_shared_experts=1)
    ids = token_ids(12, batch=3)
    cache = model.new_cache(batch_size=3)
    batched = model.prefill(ids, cache)  # [3, 12, V]
    next_ids = torch.tensor([5, 6, 7])
    batched_step = model.decode(next_ids, cache)  # [3, V]
    for b in range(3):
        alone = model.prefill(torch.cat([ids[b], next_ids[b:b + 1]]), model.new_cache())
        torch.testing.assert_close(batched[b], alone[:12], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched_step[b], alone[12], rtol=1e-5, atol=1e-5)


def test_sliding_window_changes_only_positions_past_it():
    windowed = random_model(sliding_window=8)
    unwindowed = random_model(sliding_window=1000)  # same weights (same seed), window longer than the prompt
    ids = token_ids(20)
    a = windowed.prefill(ids, windowed.new_cache())
    b = unwindowed.prefill(ids, unwindowed.new_cache())
    torch.testing.assert_close(a[:8], b[:8])
    assert (a[8:] - b[8:]).abs().amax(dim=-1).min() > 1e-3


def test_greedy_generate_stops_after_a_stop_id():
    model = random_model()
    ids = token_ids(10).tolist()
    tokens = model.greedy_generate(ids, 12)
    assert len(tokens) == 12
    assert model.greedy_generate(ids, 12, stop_ids=[tokens[3]])[-1] == tokens[3]
    assert len(model.greedy_generate(ids, 12, stop_ids=[tokens[3]])) == tokens.index(tokens[3]) + 1


def test_bf16_model_runs_in_bf16():
    model = random_model()
    weights = {name: t.to(torch.bfloat16) for name, t in random_weights(model.config).items()}
    bf16 = NorthModel(model.config, weights)
    logits = bf16.prefill(token_ids(12), bf16.new_cache())
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    reference = model.prefill(token_ids(12), model.new_cache())
    assert (logits.float() - reference).abs().max() < 0.1 * reference.abs().max()


# --- bad weights ---


def test_missing_tensor_is_named():
    model = random_model()
    weights = random_weights(model.config)
    del weights["model.layers.2.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.down_proj is missing"):
        NorthModel(model.config, weights)


def test_wrong_shape_is_named():
    model = random_model()
    weights = random_weights(model.config)
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight has shape \[8, 32\]"):
        NorthModel(model.config, weights)
