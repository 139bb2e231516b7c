"""The tiny random-weights model, leaning toward closing what it writes: the model the constrained tests run.

Under a grammar the noise model writes valid JSON but may never end it (a string goes on until max_tokens
when its closing quote is one token among a thousand). ClosingBackend adds a fixed bias to the logits of the
tokens that end things, as a trained model would prefer them: a lone `"` (it closes a string) and `"}`-like
tokens most, then `}` and `]` (alone, together or with whitespace), a line break, `,` (it ends a number),
null's prefixes and a time zone's Z; with THINKING_LEAN, the end of a thinking block and, more, the escapes from
it. The bias knows no grammar and no schema: whatever the outputs' validity owes, it owes the engine's masks
(without them this model writes noise). Shared by the engine and the server tests of constrained
decoding, with the schema set they run (tests/data/json_schemas.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from northcode.engine.engine import Engine
from northcode.engine.settings import EngineSettings
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend

LEAN = 8.0  # logit units; the random model's logits have a spread of 3 (synthetic.LOGIT_STD)
SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())  # [{"name", "schema"}]
SETTINGS = dict(page_size=16, chunk_size=64, device="cpu", seed=0, cpu_kv_bytes=64 << 20)
# A thinking model's leaning: close the thinking block (above every closing token's lean, 4 * LEAN) or, more
# still, end the turn or open a text block at once, escapes a forced answer's grammar must close
THINKING_LEAN = {"<|END_THINKING|>": 4 * LEAN + 4, "<|END_OF_TURN_TOKEN|>": 4 * LEAN + 6,
                 "<|START_TEXT|>": 4 * LEAN + 5}


def lean_of(text: str) -> float:
    """The bias of a token whose text is `text`."""
    if text == '"':
        return 3 * LEAN
    if len(text) > 1 and text[0] == '"' and set(text[1:]) <= set("}]"):
        return 4 * LEAN
    if text.strip() and set(text.strip()) <= set("}]"):  # whitespace around them too: `\n]` ends a list of calls
        return 2 * LEAN
    if text == "\n":  # compact JSON has no line breaks: in an action block, the one before `]` ends the calls
        return 1.5 * LEAN
    if text == ",":
        return LEAN
    if (text and "null".startswith(text)) or text in ("Z", "z"):
        return LEAN
    return 0.0


class ClosingBackend(TorchBackend):
    """TorchBackend whose logits lean toward closing tokens (`bias`, fp32 [V], set by the factory)."""

    bias: torch.Tensor

    def decode_logits(self, batch, token_ids):
        return super().decode_logits(batch, token_ids) + self.bias

    def prefill(self, batch):
        return super().prefill(batch) + self.bias


def closing_engine(checkpoint: Path, markers: dict[str, float] | None = None, **settings) -> Engine:
    """A CPU engine of `checkpoint` over ClosingBackend (shut it down when done); markers: a bias of their own for
    some special tokens, by name (THINKING_LEAN)."""
    tokenizer = Tokenizer.from_dir(checkpoint)
    config, weights = load_checkpoint(checkpoint, device="cpu", dtype=torch.float32)
    bias = torch.tensor([lean_of(tokenizer.decode([t], skip_special_tokens=False)) for t in range(config.vocab_size)])
    for name, value in (markers or {}).items():
        bias[tokenizer.token_to_id(name)] = value

    def build(config, weights, settings, num_pages, max_pages_per_seq):
        backend = ClosingBackend(config, weights, num_pages, settings.page_size, settings.max_batch, max_pages_per_seq,
                                 cuda_graphs=False, compile=False)
        backend.bias = bias
        return backend

    return Engine(config, weights, tokenizer, EngineSettings(**{**SETTINGS, **settings}), "tiny",
                  backend_factory=build)
