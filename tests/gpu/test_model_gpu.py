"""model/model.py on a GPU: fp32 agrees with the CPU, bf16 agrees with transformers on the same GPU."""

from __future__ import annotations

import pytest
import torch

from northcode.model.model import NorthModel

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32


def prompt(vocab_size: int, length: int = 100) -> list[int]:
    """Random ids past the tiny preset's window of 32, avoiding the special ids."""
    generator = torch.Generator().manual_seed(3)
    return torch.randint(32, vocab_size, (length,), generator=generator).tolist()


def test_fp32_on_gpu_matches_cpu(tiny_checkpoint):
    cpu = NorthModel.from_dir(tiny_checkpoint, device="cpu", dtype=torch.float32)
    gpu = NorthModel.from_dir(tiny_checkpoint, device="cuda", dtype=torch.float32)
    ids = prompt(cpu.config.vocab_size)
    expected = cpu.prefill(ids, cpu.new_cache())
    got = gpu.prefill(ids, gpu.new_cache())
    assert got.device.type == "cuda"
    scale = expected.pow(2).mean().sqrt().item()
    assert (got.cpu() - expected).abs().max().item() <= 1e-4 * scale
    assert gpu.greedy_generate(ids, NEW_TOKENS) == cpu.greedy_generate(ids, NEW_TOKENS)


def test_bf16_on_gpu_matches_transformers(tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Cohere2MoeForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Cohere2MoeForCausalLM")
    reference = transformers.Cohere2MoeForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).to("cuda").eval()
    ours = NorthModel.from_dir(tiny_checkpoint, device="cuda", dtype=torch.bfloat16)
    ids = prompt(ours.config.vocab_size)
    input_ids = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        expected = reference(input_ids).logits[0].float()
    got = ours.prefill(ids, ours.new_cache()).float()
    scale = expected.pow(2).mean().sqrt().item()
    assert (got - expected).abs().max().item() <= 2e-2 * scale  # bf16: same ops, kernels may round apart
    generated = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                   max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert ours.greedy_generate(ids, NEW_TOKENS) == generated


# --- the real model's widths (hidden 2048, 32/4 heads, 128 experts top-8, vocab 262144, window 4096) ---

REAL_LAYERS = 5  # layer 0 dense full attention with forced RoPE, 1-3 sliding, 4 full NoPE: every kind once


@pytest.fixture(scope="module")
def real_width_config():
    import dataclasses

    from northcode.model.synthetic import preset_config

    if torch.cuda.get_device_properties(0).total_memory < 60e9:
        pytest.skip("needs a GPU with 60 GB or more")
    full = preset_config("north-mini-code")
    return dataclasses.replace(full, num_hidden_layers=REAL_LAYERS, layer_types=full.layer_types[:REAL_LAYERS],
                               mlp_layer_types=full.mlp_layer_types[:REAL_LAYERS])


def test_real_width_decode_matches_recomputation_across_the_window(real_width_config):
    """fp32: prefill up to just before the 4096 window, then decode one token at a time past it;
    each step's logits equal those of one prefill over the whole sequence."""
    from northcode.model.synthetic import random_weights

    model = NorthModel(real_width_config, random_weights(real_width_config, "cuda", torch.float32))
    ids = prompt(real_width_config.vocab_size, length=4096 + 64)
    split = 4096 - 32
    full = model.prefill(ids, model.new_cache())  # [T, V]
    cache = model.new_cache()
    steps = [model.prefill(ids[:split], cache, last_only=True)[-1]]
    steps += [model.decode(token, cache) for token in ids[split:]]  # logits of positions split-1 .. T-1
    scale = full.pow(2).mean().sqrt().item()
    assert (torch.stack(steps) - full[split - 1:]).abs().max().item() <= 1e-4 * scale


def test_real_width_bf16_matches_transformers(real_width_config):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Cohere2MoeForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Cohere2MoeForCausalLM")
    from northcode.model.synthetic import random_weights

    weights = random_weights(real_width_config, "cuda", torch.bfloat16)
    ours = NorthModel(real_width_config, weights)
    hf_config = transformers.Cohere2MoeConfig.from_dict(real_width_config.to_dict())
    reference = transformers.Cohere2MoeForCausalLM._from_config(
        hf_config, attn_implementation="eager", experts_implementation="eager", dtype=torch.bfloat16
    ).to("cuda").eval()
    reference.load_state_dict(weights, strict=True)
    ids = prompt(real_width_config.vocab_size, length=4096 + 100)
    input_ids = torch.tensor([ids], device="cuda")
    with torch.no_grad():
        expected = reference(input_ids, logits_to_keep=200).logits[0].float()  # the positions past the window
    got = ours.prefill(ids, ours.new_cache())[-200:].float()
    scale = expected.pow(2).mean().sqrt().item()
    assert (got - expected).abs().max().item() <= 2e-2 * scale
    generated = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8,
                                   do_sample=False)[0, len(ids):].tolist()
    assert ours.greedy_generate(ids, 8) == generated
