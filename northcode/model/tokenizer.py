"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library) and streaming decode.

`Tokenizer.encode` never turns marker strings found in ordinary text (a file that contains
"<|END_OF_TURN_TOKEN|>") into special tokens unless asked to: prompts insert markers by id or
with allow_special=True; `to_json` hands tokenizer.json to a grammar library. `IncrementalDetokenizer`
turns a growing list of ids into text pieces whose concatenation is always a prefix of the full decode
and never ends in half a UTF-8 character. This module does not render chat templates.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tokenizers

REPLACEMENT_CHAR = "\ufffd"  # what a byte-level decode yields for an incomplete UTF-8 sequence


class Tokenizer:
    """tokenizers.Tokenizer plus the special ids that the model's config files name."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, bos_id: int | None = None,
                 eos_ids: tuple[int, ...] = (), pad_id: int | None = None,
                 chat_template: str | None = None, model_max_length: int | None = None) -> None:
        self._with_special = tokenizer  # splits marker strings into special tokens
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_str())  # treats them as text
        self._plain.encode_special_tokens = True
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.special_ids = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Reads tokenizer.json, and bos/eos/pad from tokenizer_config.json (or special_tokens_map.json),
        config.json and generation_config.json (eos ids from all; a token named by the first wins)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: no tokenizer.json in the model folder")
        try:
            inner = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own Exception subclass for bad files
            raise ValueError(f"{path}: cannot read the tokenizer: {err}") from None
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        named = {**_read_json(model_dir / "special_tokens_map.json"), **tok_config}
        config = _read_json(model_dir / "config.json")
        gen_config = _read_json(model_dir / "generation_config.json")

        def named_id(field: str) -> int | None:
            token = named.get(field)
            token = token.get("content") if isinstance(token, dict) else token
            if token is None:
                return None
            token_id = inner.token_to_id(token)
            if token_id is None:
                source = "tokenizer_config.json" if field in tok_config else "special_tokens_map.json"
                raise ValueError(f"{model_dir / source}: {field} {token!r} is not in tokenizer.json")
            return token_id

        bos_id = named_id("bos_token")
        bos_id = config.get("bos_token_id") if bos_id is None else bos_id
        eos_ids = [named_id("eos_token"), *_ids(config.get("eos_token_id")), *_ids(gen_config.get("eos_token_id"))]
        pad_id = named_id("pad_token")
        pad_id = config.get("pad_token_id") if pad_id is None else pad_id
        template_path = model_dir / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else tok_config.get("chat_template")
        max_len = tok_config.get("model_max_length")
        return cls(inner, bos_id=bos_id, eos_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
                   pad_id=pad_id, chat_template=template if isinstance(template, str) else None,
                   model_max_length=max_len if isinstance(max_len, int) else None)

    @property
    def vocab_size(self) -> int:
        return self._with_special.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, without BOS. Marker strings stay ordinary text unless allow_special."""
        return self.encoding(text, allow_special).ids

    def encoding(self, text: str, allow_special: bool = False) -> tokenizers.Encoding:
        """The library's Encoding of `text` (len() counts its tokens without building the ids). Through
        encode_batch_fast: it releases the GIL while it works and computes no offsets (the library's encode
        holds the GIL throughout, and freeing millions of offsets held it for half a second), so a multi-MB
        prompt tokenized in a worker thread does not stall the server's event loop. The same ids."""
        inner = self._with_special if allow_special else self._plain
        return inner.encode_batch_fast([text], add_special_tokens=False)[0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._with_special.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """tokenizer.json's text (added tokens included): what a grammar library builds its own view from."""
        return self._with_special.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._with_special.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._with_special.id_to_token(token_id)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from an optional file: {} when absent, ValueError naming the file when broken."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class IncrementalDetokenizer:
    """Streams the text of generated ids: `push(ids)` returns only text that can no longer change.

    It decodes a window of recent ids and holds back a trailing U+FFFD (an incomplete UTF-8
    character) until the next ids complete it; `flush()` returns whatever is held at the end.
    The window restarts a few tokens back whenever the text is clean, so each push costs O(window).
    """

    CONTEXT_TOKENS = 4  # ids kept before a new window, so decoders that strip a leading space stay stable

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # index into ids where the decoded window begins
        self._emitted_chars = 0  # chars of decode(ids[_window_start:]) already returned

    def push(self, ids: list[int] | int) -> str:
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        text = self._window_text()
        complete = not text.endswith(REPLACEMENT_CHAR)
        stable = text if complete else text[:-1]
        piece = stable[self._emitted_chars:]
        self._emitted_chars = max(self._emitted_chars, len(stable))
        if complete and len(self.ids) - self._window_start > 2 * self.CONTEXT_TOKENS:
            self._window_start = len(self.ids) - self.CONTEXT_TOKENS
            self._emitted_chars = len(self._window_text())
        return piece

    def flush(self) -> str:
        """The text held back (an incomplete character at the very end, shown as U+FFFD)."""
        piece = self._window_text()[self._emitted_chars:]
        self._emitted_chars += len(piece)
        return piece

    def _window_text(self) -> str:
        return self.tokenizer.decode(self.ids[self._window_start:], skip_special_tokens=self.skip_special_tokens)
