"""Synthetic North Mini Code weights on a GPU: fast to build, well-scaled, and the loader streams to CUDA."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from northcode.model.checkpoint import load_checkpoint, save_checkpoint
from northcode.model.synthetic import LazyRandomWeights, preset_config, random_tensor, random_weights

pytestmark = pytest.mark.gpu


def _short_north(num_layers: int):
    """north-mini-code geometry with fewer layers (same pattern), small enough to write to disk."""
    full = preset_config("north-mini-code")
    return dataclasses.replace(full, num_hidden_layers=num_layers, layer_types=full.layer_types[:num_layers],
                               mlp_layer_types=full.mlp_layer_types[:num_layers])


def _transformers_forward(config, weights, ids):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Cohere2MoeForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no Cohere2MoeForCausalLM")
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeRotaryEmbedding

    hf_config = transformers.Cohere2MoeConfig(**{k: v for k, v in config.to_dict().items() if k != "model_type"})
    hf_config._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.Cohere2MoeForCausalLM(hf_config)
    model.load_state_dict(weights, assign=True, strict=True)  # the 61 GB are not copied
    model.model.rotary_emb = Cohere2MoeRotaryEmbedding(hf_config).to("cuda")  # its buffers were on meta
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda"), output_hidden_states=True)


def test_north_mini_code_builds_on_the_gpu_quickly_and_stays_well_scaled():
    config = preset_config("north-mini-code")
    start = time.perf_counter()
    weights = random_weights(config, "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    num_bytes = sum(t.numel() * 2 for n, t in weights.items() if n != "lm_head.weight")
    print(f"random north-mini-code weights: {num_bytes / 1e9:.1f} GB in {seconds:.1f} s on the GPU")
    assert 60e9 < num_bytes < 63e9 and seconds < 120
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    name = "model.layers.30.mlp.experts.down_proj"
    assert torch.equal(weights[name], random_tensor(config, name, weights[name].shape, 0, "cuda", torch.bfloat16))

    ids = torch.randint(10, 250000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    out = _transformers_forward(config, weights, ids)
    rms = [h.float().pow(2).mean().sqrt().item() for h in out.hidden_states[1:]]
    logits = out.logits[0].float()
    top_prob = logits.softmax(-1).max(-1).values
    greedy = set(logits.argmax(-1).tolist())
    print(f"hidden RMS per layer: min {min(rms):.2f} max {max(rms):.2f}; logits std {logits.std(-1).mean():.2f}; "
          f"top-1 probability median {top_prob.median():.3f}; distinct greedy tokens {len(greedy)}")
    assert torch.isfinite(logits).all()
    assert all(0.2 < r < 30 for r in rms), rms  # O(1) through all 49 layers
    assert 1.5 < logits.std(-1).mean() < 6
    assert top_prob.median() < 0.5 and len(greedy) > 32  # not degenerate


def test_load_checkpoint_streams_onto_the_gpu(tmp_path):
    config = _short_north(5)
    save_checkpoint(tmp_path, config, LazyRandomWeights(config, "cuda", torch.bfloat16, seed=1), 2 << 30)
    progress = []
    start = time.perf_counter()
    loaded_config, weights = load_checkpoint(tmp_path, device="cuda", progress=lambda d, t: progress.append((d, t)))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    total = progress[-1][1]
    print(f"loaded {total / 1e9:.1f} GB onto the GPU in {seconds:.1f} s ({total / 1e9 / seconds:.2f} GB/s)")
    assert loaded_config == config and progress[-1][0] == total
    assert all(t.device.type == "cuda" and t.dtype == torch.bfloat16 for t in weights.values())
    expected = random_weights(config, "cuda", torch.bfloat16, seed=1)
    assert all(torch.equal(weights[n], expected[n]) for n in expected)


def test_doctor_on_a_gpu_machine():
    from northcode.commands.doctor import collect_report, format_report

    report = collect_report()
    print(format_report(report))
    device = report["torch"]["devices"][0]
    assert device["free_memory_bytes"] > 0 and device["name"]
    if device["compute_capability"] == "9.0" and report["nvcc"]["path"]:
        assert report["megakernel"] == {"can_run": True, "why_not": []}
