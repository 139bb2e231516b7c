"""northcode's reference model (model/model.py) against transformers' Cohere2MoeForCausalLM.

Each case builds a tiny random model with transformers (fp32, eager attention, eager experts),
saves it with `save_pretrained`, loads the folder with northcode's own loader, and compares
(1) fp32 logits over a prompt longer than every sliding window: max |diff| <= 1e-4 * scale, where
scale is the root mean square of transformers' logits; (2) 32 greedy tokens decoded incrementally
through northcode's KV cache against transformers' `generate(do_sample=False)`, exactly.
Between them the cases cover every config branch that the model implements (see CASES).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Cohere2MoeConfig, Cohere2MoeForCausalLM  # noqa: E402

from northcode.model.model import NorthModel  # noqa: E402

PROMPT_LEN = 80  # longer than every case's sliding window
NEW_TOKENS = 32
REL_TOL = 1e-4  # of the reference logits' RMS

COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    # The `tiny` preset's geometry family: window 32, dense layer 0 with forced RoPE (full attention),
    # NoPE full layer 4, sigmoid routing without renormalisation, RMSNorm, tied head, logit_scale 1.
    "tiny-family": dict(num_hidden_layers=5, sliding_window=32, sliding_window_pattern=4, first_k_dense_replace=1,
                        prefix_dense_sliding_window_pattern=1, prefix_dense_intermediate_size=96, num_experts=8,
                        num_experts_per_tok=2, expert_selection_fn="sigmoid", norm_topk_prob=False,
                        rms_norm_eps=1e-6, tie_word_embeddings=True, logit_scale=1.0, rope_theta=50000.0),
    # Softmax routing, mean-centred LayerNorm (no rms_norm_eps), untied head, logit_scale 1/16,
    # one shared expert averaged in, no dense layer, alternating sliding/full layers, 4 query heads per KV head.
    "softmax-layernorm-untied-shared-average": dict(
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, sliding_window=16,
        sliding_window_pattern=2, first_k_dense_replace=0, num_experts=6, num_experts_per_tok=3,
        expert_selection_fn="softmax", norm_topk_prob=True, layer_norm_eps=1e-5, num_shared_experts=1,
        shared_expert_combination_strategy="average", tie_word_embeddings=False, logit_scale=0.0625,
        rope_theta=10000.0),
    # Sigmoid routing renormalised (norm_topk_prob), two shared experts summed; two dense prefix layers
    # with their own window pattern 2 (layer 0 sliding with RoPE, layer 1 full and NoPE: no forced RoPE).
    "sigmoid-normalised-shared-sum-dense-prefix": dict(
        num_hidden_layers=5, sliding_window=24, sliding_window_pattern=3, first_k_dense_replace=2,
        prefix_dense_sliding_window_pattern=2, prefix_dense_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, expert_selection_fn="sigmoid", norm_topk_prob=True, num_shared_experts=2,
        shared_expert_combination_strategy="sum", rms_norm_eps=1e-5, tie_word_embeddings=True,
        logit_scale=0.5, rope_theta=50000.0),
    # Explicit layer_types / mlp_layer_types: dense full layers in the middle get forced RoPE;
    # plain multi-head attention, head_dim*heads != hidden, top-1 softmax routing, untied, logit_scale 2.
    "explicit-types-mha-top1": dict(
        num_hidden_layers=4, hidden_size=48, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "dense"], sliding_window=20,
        prefix_dense_sliding_window_pattern=1, prefix_dense_intermediate_size=64, num_experts=4,
        num_experts_per_tok=1, expert_selection_fn="softmax", norm_topk_prob=False, rms_norm_eps=1e-6,
        tie_word_embeddings=False, logit_scale=2.0, rope_theta=10000.0),
}


def build_reference(overrides: dict, seed: int = 0) -> Cohere2MoeForCausalLM:
    """A transformers model with non-degenerate random weights: every matrix ~ N(0, 1/fan_in), so
    attention, routers and experts all move the logits; norm weights ~ 1 + N(0, 0.1)."""
    config = Cohere2MoeConfig(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model = Cohere2MoeForCausalLM._from_config(config, attn_implementation="eager",
                                               experts_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def prompt_ids(vocab_size: int, seed: int = 1) -> torch.Tensor:
    """[1, PROMPT_LEN] random ids that avoid the special ids 0..2 (pad, bos, eos)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, PROMPT_LEN), generator=generator)


def reference_greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.float().pow(2).mean().sqrt().item()
    max_diff = (ours.float() - reference.float()).abs().max().item()
    assert max_diff <= REL_TOL * scale, f"max |diff| {max_diff:.3g} > {REL_TOL} * RMS {scale:.3g}"


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory):
    """(transformers model, northcode model loaded from its save_pretrained folder, prompt ids)."""
    reference = build_reference(CASES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    ours = NorthModel.from_dir(folder, device="cpu", dtype=torch.float32)
    return reference, ours, prompt_ids(reference.config.vocab_size)


def test_config_branches_are_as_intended(case):
    """Guards the cases themselves: the branches named in CASES really are in the configs."""
    reference, ours, ids = case
    config = ours.config
    assert ids.shape[1] > max(config.window(i) or 0 for i in range(config.num_hidden_layers))
    assert list(config.layer_types) == list(reference.config.layer_types)
    assert list(config.mlp_layer_types) == list(reference.config.mlp_layer_types)
    for i, layer in enumerate(reference.model.layers):
        attn = layer.self_attn
        assert config.uses_rope(i) == (attn.sliding_window is not None or attn.force_rope), f"layer {i}"
        assert config.window(i) == attn.sliding_window, f"layer {i}"


def test_prefill_logits_match_transformers(case):
    reference, ours, ids = case
    with torch.no_grad():
        expected = reference(ids).logits[0]  # [T, V]
    got = ours.prefill(ids[0], ours.new_cache())
    assert got.shape == expected.shape
    assert_logits_close(got, expected)


def test_greedy_decode_matches_transformers_generate(case):
    reference, ours, ids = case
    expected = reference_greedy(reference, ids, NEW_TOKENS)
    got = ours.greedy_generate(ids[0].tolist(), NEW_TOKENS)
    assert got == expected
    assert len(got) == NEW_TOKENS or got[-1] in ours.config.eos_token_ids


def test_bf16_matches_transformers_bitwise(tmp_path):
    """bf16 follows transformers' casts op for op, so on the same CPU kernels the logits are identical."""
    folder = tmp_path / "model"
    build_reference(CASES["tiny-family"]).save_pretrained(folder)
    reference = Cohere2MoeForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="eager",
                                                      experts_implementation="eager").eval()
    ours = NorthModel.from_dir(folder, dtype=torch.bfloat16)
    ids = prompt_ids(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids).logits[0]
    got = ours.prefill(ids[0], ours.new_cache())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected), f"max |diff| {(got.float() - expected.float()).abs().max():.3g}"
    assert ours.greedy_generate(ids[0].tolist(), 16) == reference_greedy(reference, ids, 16)


def test_tiny_checkpoint_matches_transformers(tiny_checkpoint):
    """The synthetic `tiny` checkpoint loads in transformers unchanged and agrees with northcode."""
    reference = Cohere2MoeForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32,
                                                      attn_implementation="eager",
                                                      experts_implementation="eager").eval()
    ours = NorthModel.from_dir(tiny_checkpoint, dtype=torch.float32)
    config = ours.config
    assert config.sliding_window == 32 and config.is_dense(0) and config.uses_rope(0)
    assert any(not config.uses_rope(i) for i in range(config.num_hidden_layers)), "tiny has NoPE layers"
    ids = prompt_ids(config.vocab_size, seed=2)
    with torch.no_grad():
        expected = reference(ids).logits[0]
    assert_logits_close(ours.prefill(ids[0], ours.new_cache()), expected)
    assert ours.greedy_generate(ids[0].tolist(), NEW_TOKENS) == reference_greedy(reference, ids, NEW_TOKENS)
