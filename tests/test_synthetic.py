"""Synthetic checkpoints: presets, random weights, the trained tokenizer, the files, the demo checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from northcode import paths
from northcode.cli import main as cli_main
from northcode.model.checkpoint import canonical_shapes, load_checkpoint
from northcode.model.synthetic import (CHAT_TEMPLATE_PATH, SPECIAL_TOKENS, LazyRandomWeights, create_checkpoint,
                                        preset_config, random_weights)


def file_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_north_mini_code_preset_has_the_real_geometry():
    c = preset_config("north-mini-code")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (2048, 49, 32, 4, 128)
    assert (c.num_experts, c.num_experts_per_tok, c.intermediate_size, c.dense_intermediate_size) == (128, 8, 768, 3072)
    assert (c.vocab_size, c.eos_token_id, c.bos_token_id) == (262144, 255001, 2)
    assert (c.sliding_window, c.rope_theta) == (4096, 5e4)
    assert (c.expert_selection_fn, c.norm_topk_prob, c.logit_scale, c.rms_norm_eps) == ("sigmoid", False, 1.0, 1e-6)
    assert c.tie_word_embeddings and c.max_position_embeddings == 500000
    assert [i for i in range(49) if c.layer_types[i] == "full_attention"] == list(range(0, 49, 4))
    assert c.mlp_layer_types == ("dense",) + ("sparse",) * 48
    assert [i for i in range(49) if c.uses_rope(i)] == [0] + [i for i in range(49) if i % 4]
    weight_bytes = 2 * sum(math.prod(s) for n, s in canonical_shapes(c).items() if n != "lm_head.weight")
    assert 60e9 < weight_bytes < 63e9  # "61 GB of random BF16"


def test_tiny_preset_exercises_every_layer_kind():
    c = preset_config("tiny", vocab_size=1024)
    assert c.layer_types == ("full_attention",) + ("sliding_attention",) * 3 + ("full_attention", "sliding_attention")
    assert [c.uses_rope(i) for i in range(6)] == [True, True, True, True, False, True]  # layer 4: NoPE
    assert [c.window(i) for i in range(6)] == [None, 32, 32, 32, None, 32]
    assert c.is_dense(0) and not any(c.is_dense(i) for i in range(1, 6))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (128, 4, 2, 64)
    assert (c.num_experts, c.num_experts_per_tok) == (16, 4)
    assert (c.intermediate_size, c.dense_intermediate_size) == (64, 192)
    assert c.eos_token_id == SPECIAL_TOKENS.index("<|END_OF_TURN_TOKEN|>")
    with pytest.raises(ValueError, match="preset 'huge'"):
        preset_config("huge")


def test_random_weights_are_canonical_deterministic_and_well_scaled():
    config = preset_config("tiny", vocab_size=1024)
    weights = random_weights(config, seed=3)
    assert {n: tuple(t.shape) for n, t in weights.items()} == canonical_shapes(config)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    again = random_weights(config, seed=3)
    assert all(torch.equal(weights[n], again[n]) for n in weights)
    other = random_weights(config, seed=4)
    assert not torch.equal(weights["model.layers.3.mlp.gate.weight"], other["model.layers.3.mlp.gate.weight"])
    bf16 = random_weights(config, dtype="bfloat16", seed=3)
    assert all(torch.equal(bf16[n], weights[n].to(torch.bfloat16)) for n in weights)  # dtype only rounds
    norm = weights["model.layers.2.input_layernorm.weight"]
    assert 0.95 < norm.mean() < 1.05 and 0.05 < norm.std() < 0.15
    up = weights["model.layers.2.mlp.experts.gate_up_proj"]  # [E, 2I, H]: std 1/sqrt(H)
    assert abs(up.std().item() * math.sqrt(128) - 1) < 0.05


def test_tiny_routing_is_not_trivial():
    config = preset_config("tiny", vocab_size=1024)
    weights = random_weights(config)
    hidden = torch.nn.functional.rms_norm(weights["model.embed_tokens.weight"], (128,), eps=1e-6)
    for layer in range(1, 6):
        router_logits = hidden @ weights[f"model.layers.{layer}.mlp.gate.weight"].T  # [V, E]
        chosen = router_logits.topk(4, dim=-1).indices
        counts = torch.bincount(chosen.flatten(), minlength=16)
        assert (counts > 0).all(), f"layer {layer}: some expert is never chosen"
        assert counts.max() < 3 * counts.float().mean(), f"layer {layer}: routing collapses onto few experts"
        assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 200


def test_lazy_weights_draw_only_what_is_read():
    config = preset_config("north-mini-code")
    lazy = LazyRandomWeights(config, "cpu", torch.bfloat16, seed=0)
    reads = []
    lazy.on_read = reads.append
    assert len(lazy) == len(canonical_shapes(config)) and "model.layers.48.mlp.gate.weight" in lazy
    assert reads == []  # membership does not draw a 1.6 GB tensor
    router = lazy["model.layers.7.mlp.gate.weight"]
    assert router.shape == (128, 2048) and router.dtype == torch.bfloat16
    assert reads == ["model.layers.7.mlp.gate.weight"]


def test_tiny_checkpoint_files_and_markers(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) >= 2
    weight_map = json.loads((tiny_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in weight_map  # the published per-expert layout
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    assert raw["northcode_synthetic"] == {"preset": "tiny", "seed": 0, "note": "random weights"}
    assert raw["dtype"] == "bfloat16" and raw["model_type"] == "cohere2_moe"
    assert "RANDOM WEIGHTS" in paths.model_display_name(tiny_checkpoint)
    tok_config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == \
        ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<PAD>")
    assert tok_config["model_max_length"] == 4096
    if CHAT_TEMPLATE_PATH.is_file():
        assert tok_config["chat_template"] == CHAT_TEMPLATE_PATH.read_text()
        assert (tiny_checkpoint / "chat_template.jinja").read_text() == CHAT_TEMPLATE_PATH.read_text()


def test_tiny_checkpoint_loads_unchanged_in_transformers(tiny_checkpoint):
    transformers = pytest.importorskip("transformers")
    config, weights = load_checkpoint(tiny_checkpoint, dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert type(model).__name__ == "Cohere2MoeForCausalLM"
    assert model.config.layer_types == list(config.layer_types) and model.config.sliding_window == 32
    state = model.state_dict()
    assert set(state) == set(weights)
    assert all(torch.equal(state[n], weights[n]) for n in state)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tokenizer("def fib(n):\n    return", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    logits = out.logits[0]
    assert torch.isfinite(logits).all()
    assert 1.5 < logits.std(-1).mean() < 6  # not degenerate: neither flat nor one-hot
    assert all(0.2 < h.pow(2).mean().sqrt() < 10 for h in out.hidden_states[1:])  # activations stay O(1)


def test_same_seed_gives_identical_files(tiny_checkpoint, tmp_path):
    again = create_checkpoint("tiny", tmp_path / "again", seed=0)
    assert file_bytes(again) == file_bytes(tiny_checkpoint)
    other = create_checkpoint("tiny", tmp_path / "other", seed=1)
    other_files = file_bytes(other)
    assert other_files["tokenizer.json"] == file_bytes(tiny_checkpoint)["tokenizer.json"]
    shard = "model-00002-of-00003.safetensors"
    assert other_files[shard] != file_bytes(tiny_checkpoint)[shard]


def test_tokenizer_training_is_deterministic_across_processes():
    script = "import hashlib; from northcode.model.synthetic import train_tokenizer; " \
             "print(hashlib.sha256(train_tokenizer().to_str().encode()).hexdigest())"
    digests = set()
    for hash_seed, threads in (("1", "1"), ("2", "2")):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "RAYON_NUM_THREADS": threads}
        digests.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    assert len(digests) == 1


def test_demo_checkpoint_is_created_once(monkeypatch, tmp_path):
    monkeypatch.setenv("NORTHCODE_HOME", str(tmp_path / "home"))
    path = paths.resolve_model(None)
    assert path == paths.demo_checkpoint_dir() and (path / "config.json").is_file()
    first = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert paths.resolve_model(None) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == first
    reference = create_checkpoint(paths.DEMO_PRESET, tmp_path / "reference", seed=paths.DEMO_SEED)
    assert file_bytes(path) == file_bytes(reference)


def test_checkpoint_command(tmp_path, capsys):
    out = tmp_path / "made"
    assert cli_main(["checkpoint", "create", "--preset", "tiny", "--out", str(out), "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM" in printed and "model.safetensors.index.json" in printed
    assert json.loads((out / "config.json").read_text())["northcode_synthetic"]["seed"] == 2
    assert cli_main(["checkpoint", "create", "--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty (pass --force" in capsys.readouterr().err
    assert cli_main(["checkpoint", "create", "--preset", "tiny", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["northcode_synthetic"]["seed"] == 0
    with pytest.raises(SystemExit):
        cli_main(["checkpoint", "create", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_north_mini_code_tokenizer_uses_the_real_special_ids(tmp_path):
    from northcode.model.synthetic import REAL_SPECIAL_IDS, _write_tokenizer_files, spread_to_real_ids, train_tokenizer
    from northcode.model.tokenizer import Tokenizer

    base = train_tokenizer()
    big = spread_to_real_ids(base, 262144)
    assert big.get_vocab_size() == 262144
    assert {token: big.token_to_id(token) for token in REAL_SPECIAL_IDS} == REAL_SPECIAL_IDS
    text = "def fib(n):\n    return 日本 😀"
    assert big.encode(text).tokens == base.encode(text).tokens  # same merges, other ids
    assert big.decode(list(range(100000, 100010)))  # filler ids decode to text
    config = preset_config("north-mini-code")
    _write_tokenizer_files(tmp_path, big, config)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_ids, tokenizer.pad_id) == (2, (255001,), 0)
    assert tokenizer.encode("<|START_TEXT|>", allow_special=True) == [255012]
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_checkpoint_command_checks_disk_space_before_writing_61_gb(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 10**9, 10**9))
    out = tmp_path / "big"
    assert cli_main(["checkpoint", "create", "--preset", "north-mini-code", "--out", str(out)]) == 2
    assert "needs 61.0 GB of disk space, 1.0 GB is free" in capsys.readouterr().err
    assert not out.exists()


def test_the_north_mini_code_path_of_create_checkpoint_on_a_narrow_copy(tmp_path, monkeypatch):
    """The real preset writes 61 GB; the same code path with the width cut down, vocab kept."""
    from northcode.model import synthetic
    from northcode.model.tokenizer import Tokenizer

    narrow = {**synthetic.PRESETS["north-mini-code"], "hidden_size": 32, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
              "num_experts_per_tok": 2, "intermediate_size": 8, "prefix_dense_intermediate_size": 16}
    monkeypatch.setitem(synthetic.PRESETS, "north-mini-code", narrow)
    monkeypatch.setitem(synthetic.MAX_SHARD_BYTES, "north-mini-code", 8 << 20)
    out = create_checkpoint("north-mini-code", tmp_path / "narrow", seed=5, progress=False)
    config, weights = load_checkpoint(out)
    assert config.vocab_size == 262144 and config.eos_token_id == 255001
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    tokenizer = Tokenizer.from_dir(out)
    assert (tokenizer.bos_id, tokenizer.eos_ids, tokenizer.vocab_size) == (2, (255001,), 262144)
    assert json.loads((out / "config.json").read_text())["northcode_synthetic"]["preset"] == "north-mini-code"
