"""Synthetic checkpoints: model presets, random weights, a trained tokenizer, and the files on disk.

A synthetic checkpoint has the real checkpoint's format (config.json, per-expert safetensors
shards with an index, tokenizer.json, tokenizer_config.json, chat template) and random weights,
marked in config.json under "northcode_synthetic". Everything is a pure function of the preset
and the seed: each tensor draws from its own generator seeded by (seed, name), and the tokenizer
is trained deterministically on northcode/data/corpus.txt (for north-mini-code, re-laid over the
real 262144 ids with the special tokens at their real ids). This module does not run the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from northcode.config import ModelConfig
from northcode.model.checkpoint import canonical_shapes, resolve_dtype, save_checkpoint
from northcode.paths import SYNTHETIC_KEY  # the config.json field that marks random weights

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_PATH = DATA_DIR / "corpus.txt"
CHAT_TEMPLATE_PATH = DATA_DIR / "chat_template.jinja"
TOKENIZER_VOCAB_SIZE = 1024  # the trained tokenizer's size, special tokens included

# The model's special tokens by their real names (docs: prompt_format.md section 1). Ids follow
# list order, so <PAD> = 0 and <BOS_TOKEN> = 2 as in the real vocabulary.
SPECIAL_TOKENS = (
    "<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>",
    "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>",
    "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
    "<|START_THINKING|>", "<|END_THINKING|>", "<|START_TEXT|>", "<|END_TEXT|>",
    "<|START_ACTION|>", "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>",
    "<|IMG_PATCH|>",
)
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", "<PAD>", "<UNK>"
# Where north-mini-code's tokenizer puts them: the ids of prompt_format.md (some only Cohere's
# convention there), so that its config's bos 2 / eos 255001 name the same tokens as the real model's.
REAL_SPECIAL_IDS = {
    "<PAD>": 0, "<UNK>": 1, "<BOS_TOKEN>": 2, "<EOS_TOKEN>": 3,
    "<|START_OF_TURN_TOKEN|>": 255000, "<|END_OF_TURN_TOKEN|>": 255001, "<|USER_TOKEN|>": 255006,
    "<|CHATBOT_TOKEN|>": 255007, "<|SYSTEM_TOKEN|>": 255008, "<|START_THINKING|>": 255010,
    "<|END_THINKING|>": 255011, "<|START_TEXT|>": 255012, "<|END_TEXT|>": 255013, "<|START_ACTION|>": 255014,
    "<|END_ACTION|>": 255015, "<|START_TOOL_RESULT|>": 255016, "<|END_TOOL_RESULT|>": 255017,
    "<|IMG_PATCH|>": 255018,
}

# ModelConfig fields per preset; tiny's vocab_size is the trained tokenizer's size.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        # layer 0: dense, full attention with RoPE (forced); 1-3 sliding; 4 full NoPE; 5 sliding
        layer_types=("full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                     "full_attention", "sliding_attention"),
        sliding_window=32, first_k_dense_replace=1, prefix_dense_intermediate_size=192,
        num_experts=16, num_experts_per_tok=4, intermediate_size=64, max_position_embeddings=4096,
        rope_theta=50000.0, vocab_size=TOKENIZER_VOCAB_SIZE, pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN), eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
    ),
    "north-mini-code": dict(
        hidden_size=2048, num_hidden_layers=49, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        sliding_window=4096, sliding_window_pattern=4, first_k_dense_replace=1, prefix_dense_intermediate_size=3072,
        num_experts=128, num_experts_per_tok=8, intermediate_size=768, max_position_embeddings=500000,
        rope_theta=50000.0, vocab_size=262144, pad_token_id=0, bos_token_id=2, eos_token_id=255001,
    ),
}
_COMMON = dict(expert_selection_fn="sigmoid", norm_topk_prob=False, logit_scale=1.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True, num_shared_experts=0, prefix_dense_sliding_window_pattern=1)
MAX_SHARD_BYTES = {"tiny": 2 << 20, "north-mini-code": 5 << 30}  # tiny still gets several shards
LOGIT_STD = 3.0  # target spread of the random model's logits: a peaked but not one-hot softmax


def preset_config(preset: str, vocab_size: int | None = None, **extra) -> ModelConfig:
    """The ModelConfig of a preset (vocab_size overrides the preset's); extra goes to config.json."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: must be one of {', '.join(PRESETS)}")
    fields = {**_COMMON, **PRESETS[preset]}
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    return ModelConfig(**fields, extra=extra)


# --- random weights ---

def random_tensor(config: ModelConfig, name: str, shape: tuple[int, ...], seed: int,
                  device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One canonical tensor, drawn on `device` from a generator seeded by (seed, name).

    Scales keep activations O(1) through every layer: projections ~ N(0, 1/fan_in), so each
    output has unit variance for a unit-RMS input; norm weights ~ 1 +- 0.1; the embedding (the
    tied LM head) has std LOGIT_STD / (sqrt(hidden) * logit_scale), so that logits of a unit-RMS
    final hidden state have std LOGIT_STD (RMSNorm makes the small input embeddings unit-RMS)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if name.endswith("norm.weight"):
        values = values.mul_(0.1).add_(1.0)
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        values = values.mul_(LOGIT_STD / (math.sqrt(config.hidden_size) * (abs(config.logit_scale) or 1.0)))
    else:
        values = values.mul_(1.0 / math.sqrt(shape[-1]))  # fan_in = the last dim of [out, in], [E, out, in]
    return values.to(dtype)


def random_weights(config: ModelConfig, device: str | torch.device = "cpu",
                   dtype: torch.dtype | str = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical random weights generated directly on `device` (no disk). The same (config, seed,
    device) always gives the same values; `dtype` only rounds them."""
    return dict(LazyRandomWeights(config, device, dtype, seed).items())


class LazyRandomWeights(Mapping):
    """The canonical random weights as a Mapping that draws each tensor when it is read, so a 61 GB
    model can be written to disk a shard at a time. lm_head reads as the embedding when tied."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype | str = torch.float32, seed: int = 0) -> None:
        self.config, self.device, self.dtype, self.seed = config, device, resolve_dtype(dtype), seed
        self.shapes = canonical_shapes(config)
        self.on_read: Callable[[str], None] | None = None  # called with each name read (progress)
        self._tied_cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            name = "model.embed_tokens.weight"
        if self.on_read is not None:
            self.on_read(name)
        return random_tensor(self.config, name, self.shapes[name], self.seed, self.device, self.dtype)

    def __contains__(self, name: object) -> bool:  # Mapping's default would draw the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def items(self):  # one embedding object for both names when tied (the canonical contract)
        for name in self.shapes:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                yield name, self._tied_cache.pop("model.embed_tokens.weight")
                continue
            tensor = self[name]
            if self.config.tie_word_embeddings and name == "model.embed_tokens.weight":
                self._tied_cache[name] = tensor
            yield name, tensor


# --- tokenizer ---

def train_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE, corpus_path: Path = CORPUS_PATH):
    """A byte-level BPE (tokenizers.Tokenizer) trained on the shipped corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus_path.read_text(encoding="utf-8").splitlines(keepends=True), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(  # like the real one: BOS first
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


def spread_to_real_ids(tokenizer, vocab_size: int):
    """The trained tokenizer re-laid over `vocab_size` ids: special tokens at REAL_SPECIAL_IDS, the
    learned tokens at the lowest free ids (same merges, so the same text splits), and every other
    id a filler token (two learned tokens joined) that encoding never produces but decoding shows."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    learned = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if t not in SPECIAL_TOKENS]
    taken = set(REAL_SPECIAL_IDS.values())
    free_ids = (i for i in range(vocab_size) if i not in taken)
    vocab = dict(REAL_SPECIAL_IDS)
    vocab.update(zip(learned, free_ids))
    fillers = (a + b for a in learned[256:] for b in learned[256:])  # past the 256 single bytes
    for token_id in free_ids:
        token = next(fillers)
        while token in vocab:
            token = next(fillers)
        vocab[token] = token_id
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    spec["post_processor"]["special_tokens"][BOS_TOKEN]["ids"] = [vocab[BOS_TOKEN]]
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def preset_tokenizer(preset: str):
    """The tokenizer (tokenizers.Tokenizer) of a preset's checkpoint: the trained one, laid over the preset's
    real ids unless tiny (north-mini-code's 262144: what a grammar library builds its masks over)."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: must be one of {', '.join(PRESETS)}")
    tokenizer = train_tokenizer()
    return tokenizer if preset == "tiny" else spread_to_real_ids(tokenizer, PRESETS[preset]["vocab_size"])


def tokenizer_config(model_max_length: int, chat_template: str | None) -> dict:
    """tokenizer_config.json in the format of Cohere's checkpoints (fast tokenizer, BOS added)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "padding_side": "left",
        "additional_special_tokens": [t for t in SPECIAL_TOKENS
                                      if t not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)],
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


# --- the checkpoint on disk ---

def create_checkpoint(preset: str, out_dir: str | os.PathLike, seed: int = 0, progress: bool = True) -> Path:
    """Write a synthetic checkpoint of `preset` into out_dir; config.json is written last, so a
    folder with a config.json is complete. Returns out_dir."""
    out_dir = Path(out_dir)
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: must be one of {', '.join(PRESETS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    stale_names = ("config.json", "model.safetensors.index.json", "chat_template.jinja")
    for stale in [*(out_dir / name for name in stale_names), *out_dir.glob("*.safetensors")]:
        stale.unlink(missing_ok=True)  # an older checkpoint's files must not mix with the new ones
    tokenizer = preset_tokenizer(preset)
    device = "cpu" if preset == "tiny" or not torch.cuda.is_available() else "cuda"
    marker = {"preset": preset, "seed": seed, "note": "random weights"}
    if device != "cpu":
        marker["device"] = device  # the values depend on the generator's device
    config = preset_config(preset, tokenizer.get_vocab_size(), **{SYNTHETIC_KEY: marker})
    assert config.eos_token_id == tokenizer.token_to_id(EOS_TOKEN), "eos_token_id must name END_OF_TURN"
    assert config.bos_token_id == tokenizer.token_to_id(BOS_TOKEN), "bos_token_id must name BOS"
    _write_tokenizer_files(out_dir, tokenizer, config)
    weights = LazyRandomWeights(config, device, torch.bfloat16, seed)
    num_written = len(weights) - int(config.tie_word_embeddings)  # a tied lm_head is not written
    with _progress_bar(num_written, enabled=progress and preset != "tiny") as bar:
        weights.on_read = lambda name: bar.update(1)
        save_checkpoint(out_dir, config, weights, MAX_SHARD_BYTES[preset])
    return out_dir


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", file=sys.stderr, desc="writing random weights", disable=not enabled)


def _write_tokenizer_files(out_dir: Path, tokenizer, config: ModelConfig) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    template = CHAT_TEMPLATE_PATH.read_text() if CHAT_TEMPLATE_PATH.is_file() else None
    if template is not None:
        shutil.copyfile(CHAT_TEMPLATE_PATH, out_dir / "chat_template.jinja")
    tok_config = tokenizer_config(config.max_position_embeddings, template)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    special = {k: tok_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token",
                                         "additional_special_tokens")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "pad_token_id": config.pad_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
