"""load_checkpoint / save_checkpoint: layouts, tied heads, dtypes, and every way the files can be wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from northcode.config import ModelConfig
from northcode.model.checkpoint import INDEX_NAME, canonical_shapes, load_checkpoint, save_checkpoint
from northcode.model.synthetic import random_weights


def small_config(**overrides) -> ModelConfig:
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=16, prefix_dense_intermediate_size=24,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                  num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6, sliding_window=8)
    return ModelConfig(**{**fields, **overrides})


def write(tmp_path, config, layout="per_expert", max_shard_bytes=20_000, dtype=torch.float32, seed=0):
    weights = random_weights(config, dtype=dtype, seed=seed)
    out = tmp_path / f"ckpt-{layout}-{seed}-{str(dtype)[6:]}"
    save_checkpoint(out, config, weights, max_shard_bytes, expert_layout=layout)
    return out, weights


def assert_same_weights(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_both_expert_layouts_load_to_the_same_canonical_weights(tmp_path):
    config = small_config()
    per_expert_dir, weights = write(tmp_path, config, "per_expert")
    fused_dir, _ = write(tmp_path, config, "fused")
    per_expert_names = json.loads((per_expert_dir / INDEX_NAME).read_text())["weight_map"]
    fused_names = json.loads((fused_dir / INDEX_NAME).read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in per_expert_names
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused_names
    _, from_per_expert = load_checkpoint(per_expert_dir)
    _, from_fused = load_checkpoint(fused_dir)
    assert_same_weights(from_per_expert, weights)
    assert_same_weights(from_fused, weights)
    assert from_fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 32, 32)  # [E, 2I, H]
    assert from_fused["model.layers.2.mlp.experts.down_proj"].shape == (4, 32, 16)  # [E, H, I]


def test_per_expert_tensors_land_gate_rows_first_then_up(tmp_path):
    config = small_config()
    out, weights = write(tmp_path, config)
    shards = {}
    for path in out.glob("*.safetensors"):
        shards.update(load_file(path))
    fused = weights["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(shards["model.layers.2.mlp.experts.1.gate_proj.weight"], fused[1, :16])
    assert torch.equal(shards["model.layers.2.mlp.experts.1.up_proj.weight"], fused[1, 16:])
    assert torch.equal(shards["model.layers.2.mlp.experts.3.down_proj.weight"],
                       weights["model.layers.2.mlp.experts.down_proj"][3])


def test_tied_head_is_the_embedding_object_and_untied_is_its_own(tmp_path):
    tied_dir, _ = write(tmp_path, small_config(tie_word_embeddings=True))
    _, tied = load_checkpoint(tied_dir)
    assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"]
    untied_config = small_config(tie_word_embeddings=False)
    untied_dir, weights = write(tmp_path / "untied", untied_config)
    _, untied = load_checkpoint(untied_dir)
    assert untied["lm_head.weight"] is not untied["model.embed_tokens.weight"]
    assert torch.equal(untied["lm_head.weight"], weights["lm_head.weight"])
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])


def test_shared_experts_and_all_dense_configs_round_trip(tmp_path):
    for config in (small_config(num_shared_experts=2), small_config(first_k_dense_replace=3)):
        out, weights = write(tmp_path / str(config.num_shared_experts), config)
        loaded_config, loaded = load_checkpoint(out)
        assert loaded_config == config
        assert set(loaded) == set(canonical_shapes(config))
        assert_same_weights(loaded, weights)


def test_without_index_single_file_and_several_shards(tmp_path):
    config = small_config()
    single, weights = write(tmp_path / "single", config, max_shard_bytes=10**9)
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    assert not (single / INDEX_NAME).exists()
    assert_same_weights(load_checkpoint(single)[1], weights)
    sharded, _ = write(tmp_path / "sharded", config)
    assert len(list(sharded.glob("*.safetensors"))) > 2
    (sharded / INDEX_NAME).unlink()
    assert_same_weights(load_checkpoint(sharded)[1], weights)


def test_dtype_on_disk_is_kept_or_converted(tmp_path):
    config = small_config()
    out, weights = write(tmp_path, config, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, as_saved = load_checkpoint(out)
    assert as_saved["model.norm.weight"].dtype == torch.bfloat16
    _, as_fp32 = load_checkpoint(out, dtype="float32")
    assert all(t.dtype == torch.float32 for t in as_fp32.values())
    assert torch.equal(as_fp32["model.layers.1.mlp.experts.down_proj"],
                       weights["model.layers.1.mlp.experts.down_proj"].float())
    with pytest.raises(ValueError, match="dtype 'int8'"):
        load_checkpoint(out, dtype="int8")


def test_progress_callback_reaches_the_total(tmp_path):
    out, _ = write(tmp_path, small_config())
    calls = []
    load_checkpoint(out, progress=lambda done, total: calls.append((done, total)))
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert calls[-1][0] == calls[-1][1]
    assert 0.9 * total < calls[-1][1] <= total  # tensor bytes, without the shard headers
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def _shard_holding(out, name):
    weight_map = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    return out / weight_map[name]


def _rewrite_shard(path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor_names_the_tensor(tmp_path):
    out, _ = write(tmp_path, small_config())
    name = "model.layers.2.self_attn.k_proj.weight"
    shard = _shard_holding(out, name)
    _rewrite_shard(shard, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor {name} \(listed in"):
        load_checkpoint(out)
    (out / INDEX_NAME).unlink()
    with pytest.raises(ValueError, match=rf"tensor {name} is missing"):
        load_checkpoint(out)


def test_unexpected_tensor_names_file_and_tensor(tmp_path):
    out, _ = write(tmp_path, small_config())
    shard = _shard_holding(out, "model.norm.weight")
    _rewrite_shard(shard, lambda t: t.update({"model.layers.9.mystery.weight": torch.zeros(3)}))
    (out / INDEX_NAME).unlink()
    with pytest.raises(ValueError, match=rf"{shard.name}: unexpected tensor model.layers.9.mystery.weight"):
        load_checkpoint(out)


def test_wrong_shape_names_file_tensor_and_both_shapes(tmp_path):
    out, _ = write(tmp_path, small_config())
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    shard = _shard_holding(out, name)
    _rewrite_shard(shard, lambda t: t.update({name: torch.zeros(32, 15)}))
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor {name} has shape \[32, 15\], "
                                         rf"config.json implies \[32, 16\]"):
        load_checkpoint(out)


def test_wrong_dtype_names_file_and_tensor(tmp_path):
    out, _ = write(tmp_path, small_config())
    name = "model.norm.weight"
    shard = _shard_holding(out, name)
    _rewrite_shard(shard, lambda t: t.update({name: torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor {name} has dtype I32"):
        load_checkpoint(out)


def test_truncated_shard_names_file_and_tensor(tmp_path):
    out, _ = write(tmp_path, small_config())
    shard = sorted(out.glob("*.safetensors"))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=rf"{shard.name}: truncated: tensor model\.\S+ ends at byte {size}"):
        load_checkpoint(out)
    with open(shard, "r+b") as f:
        f.truncate(5)
    with pytest.raises(ValueError, match=rf"{shard.name}: truncated"):
        load_checkpoint(out)


def test_missing_shard_and_no_weights_at_all(tmp_path):
    out, _ = write(tmp_path, small_config())
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ValueError, match=rf"{shard.name}: shard file is missing"):
        load_checkpoint(out)
    for path in out.glob("*.safetensors"):
        path.unlink()
    (out / INDEX_NAME).unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        load_checkpoint(out)


def test_mixing_expert_layouts_in_one_layer_is_rejected(tmp_path):
    config = small_config()
    out, weights = write(tmp_path, config)
    shard = _shard_holding(out, "model.layers.1.mlp.experts.0.gate_proj.weight")
    fused = weights["model.layers.1.mlp.experts.gate_up_proj"]
    _rewrite_shard(shard, lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj": fused.clone()}))
    (out / INDEX_NAME).unlink()
    with pytest.raises(ValueError, match="mixes the per-expert and the fused expert layouts"):
        load_checkpoint(out)


def test_checkpoints_written_by_transformers_load(tmp_path):
    transformers = pytest.importorskip("transformers")
    for tied in (True, False):
        hf_config = transformers.Cohere2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, prefix_dense_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6, tie_word_embeddings=tied,
            num_shared_experts=1, eos_token_id=3)
        torch.manual_seed(0)
        model = transformers.Cohere2MoeForCausalLM(hf_config)
        out = tmp_path / f"hf-tied-{tied}"
        model.save_pretrained(out)
        config, weights = load_checkpoint(out)
        assert config.tie_word_embeddings is tied
        state = model.state_dict()
        assert set(state) == set(weights)
        for name, tensor in state.items():
            assert torch.equal(tensor, weights[name]), name
        assert (weights["lm_head.weight"] is weights["model.embed_tokens.weight"]) is tied


def test_transformers_loads_what_save_checkpoint_writes_in_both_layouts(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = small_config(tie_word_embeddings=False, eos_token_id=3)
    for layout in ("per_expert", "fused"):
        out, weights = write(tmp_path, config, layout)
        model = transformers.Cohere2MoeForCausalLM.from_pretrained(out, dtype=torch.float32)
        state = model.state_dict()
        assert set(state) == set(weights)
        for name, tensor in state.items():
            assert torch.equal(tensor, weights[name]), (layout, name)


def test_save_checkpoint_rejects_bad_weights_and_layout(tmp_path):
    config = small_config()
    weights = random_weights(config)
    with pytest.raises(ValueError, match="expert_layout 'mixed'"):
        save_checkpoint(tmp_path / "a", config, weights, 10**6, expert_layout="mixed")
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match="tensor model.norm.weight is missing"):
        save_checkpoint(tmp_path / "b", config, weights, 10**6)
    shutil.rmtree(tmp_path / "b", ignore_errors=True)


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    out, _ = write(tmp_path, small_config())
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes((20).to_bytes(8, "little") + b"this is not json!!!!" + b"\0" * 64)
    with pytest.raises(ValueError, match=rf"{shard.name}: not a safetensors file \(header is not JSON"):
        load_checkpoint(out)
    shard.write_bytes((40).to_bytes(8, "little") + b'{"w": {"dtype": "F32", "shape": [2]}}   ')
    with pytest.raises(ValueError, match=rf"{shard.name}: tensor w: malformed safetensors header entry"):
        load_checkpoint(out)


def test_a_tied_checkpoint_that_also_saved_lm_head_loads_the_embedding(tmp_path):
    out, weights = write(tmp_path, small_config())
    (out / INDEX_NAME).unlink()
    save_file({"lm_head.weight": torch.zeros(64, 32)}, out / "extra.safetensors")
    _, loaded = load_checkpoint(out)
    assert loaded["lm_head.weight"] is loaded["model.embed_tokens.weight"]
    assert torch.equal(loaded["lm_head.weight"], weights["model.embed_tokens.weight"])
