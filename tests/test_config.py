"""ModelConfig: transformers' defaults and derivations, round trips, and the validation messages."""

from __future__ import annotations

import json

import pytest

from northcode.config import ModelConfig

BASE = {"model_type": "cohere2_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "num_experts": 4, "num_experts_per_tok": 2}


def config_with(**fields) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **fields})


@pytest.mark.parametrize("fields", [
    {},
    {"first_k_dense_replace": 1, "sliding_window_pattern": 4},
    {"first_k_dense_replace": 2, "prefix_dense_sliding_window_pattern": 2, "sliding_window_pattern": 3},
    {"num_hidden_layers": 9, "first_k_dense_replace": 3, "prefix_dense_sliding_window_pattern": 1},
])
def test_derived_layer_types_match_transformers(fields):
    transformers = pytest.importorskip("transformers")
    ours = config_with(**fields)
    theirs = transformers.Cohere2MoeConfig(**{k: v for k, v in {**BASE, **fields}.items() if k != "model_type"})
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.num_key_value_heads == theirs.num_key_value_heads


def test_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    ours, theirs = ModelConfig(), transformers.Cohere2MoeConfig()
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "head_dim", "logit_scale", "layer_norm_eps", "rms_norm_eps", "sliding_window", "num_experts",
                 "num_experts_per_tok", "expert_selection_fn", "norm_topk_prob", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


def test_round_trip_through_to_dict_and_transformers():
    transformers = pytest.importorskip("transformers")
    config = config_with(first_k_dense_replace=1, prefix_dense_intermediate_size=24, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, expert_selection_fn="sigmoid",
                         norm_topk_prob=False, eos_token_id=[3, 4], custom_field={"kept": True})
    raw = config.to_dict()
    assert raw["custom_field"] == {"kept": True} and raw["eos_token_id"] == [3, 4]
    assert ModelConfig.from_dict(json.loads(json.dumps(raw))) == config
    theirs = transformers.Cohere2MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert theirs.layer_types == list(config.layer_types) and theirs.rope_parameters["rope_theta"] == 50000.0
    assert theirs.prefix_dense_intermediate_size == 24 and theirs.rms_norm_eps == 1e-6


def test_rope_theta_read_from_either_place():
    assert config_with(rope_theta=123.0).rope_theta == 123.0
    assert config_with(rope_parameters={"rope_type": "default", "rope_theta": 7.0}).rope_theta == 7.0


def test_layer_helpers_follow_model_md():
    config = config_with(num_hidden_layers=9, first_k_dense_replace=1, sliding_window=16)
    assert [config.window(i) for i in range(9)] == [None, 16, 16, 16, None, 16, 16, 16, None]
    assert [config.uses_rope(i) for i in range(9)] == [True, True, True, True, False, True, True, True, False]
    assert config.is_dense(0) and not config.is_dense(1)
    assert config_with(eos_token_id=[1, 2]).eos_token_ids == (1, 2)
    assert config_with(eos_token_id=None).eos_token_ids == ()


@pytest.mark.parametrize("fields, message", [
    ({"model_type": "llama"}, "model_type = 'llama': northcode serves 'cohere2_moe' only"),
    ({"layer_types": ["full_attention"] * 5}, "layer_types = .*has 5 entries, num_hidden_layers is 6"),
    ({"layer_types": ["full_attention"] * 5 + ["global"]}, r"layer_types\[5\] = 'global': must be one of"),
    ({"mlp_layer_types": ["dense"] * 7}, "mlp_layer_types = .*has 7 entries"),
    ({"expert_selection_fn": "relu"}, "expert_selection_fn = 'relu': must be one of \\['softmax', 'sigmoid'\\]"),
    ({"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy = 'max'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads = 3: must divide num_attention_heads \\(4\\)"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok = 5: exceeds num_experts \\(4\\)"),
    ({"head_dim": 7}, "head_dim = 7: must be even"),
    ({"hidden_size": "32"}, "hidden_size = '32': must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0: must be a positive integer"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern = 0: must be a positive integer"),
    ({"first_k_dense_replace": 7}, "first_k_dense_replace = 7: must be an integer from 0 to num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"use_qk_norm": True}, "use_qk_norm = True"),
    ({"attention_bias": True}, "attention_bias = True"),
    ({"sliding_window": None}, "sliding_window = None: layer_types has sliding_attention layers"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type = 'yarn'"),
    ({"rope_theta": "big"}, "rope_theta = 'big': must be a number"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps = -1.0: must be > 0"),
    ({"logit_scale": None}, "logit_scale = None: must be a number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings = 'yes': must be true or false"),
    ({"eos_token_id": "<EOS>"}, "eos_token_id = '<EOS>'"),
    ({"prefix_dense_intermediate_size": 0}, "prefix_dense_intermediate_size = 0"),
    ({"layer_types": 3}, "layer_types = 3: must be a list of strings"),
])
def test_rejections_name_the_field_and_value(fields, message):
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        config_with(**fields)


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "num_experts": 0}))
    with pytest.raises(ValueError, match="num_experts = 0"):
        ModelConfig.from_file(tmp_path / "config.json")
