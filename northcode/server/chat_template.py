"""ChatTemplate: renders the checkpoint's own Jinja chat template exactly as transformers does.

Same environment as transformers' apply_chat_template: an immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, `tojson` as json.dumps with ", "/": " separators and no ASCII
escaping, `raise_exception`, `strftime_now`, and the reasoning aliases (reasoning_content,
thinking, reasoning) filled on every message. `encode` keeps marker strings found in user-supplied
text (messages, tools, kwargs) from becoming special tokens: it wraps them in private-use
characters before rendering and encodes those pieces as plain text, the way transformers'
`sanitize_control_tokens=True` does; tests/test_chat_template.py diffs both against transformers.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"  # private-use; transformers uses the same pair
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant masks in training templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_template_source(model_dir: str | Path) -> str:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's chat_template."""
    model_dir = Path(model_dir)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    config_file = model_dir / "tokenizer_config.json"
    try:
        template = json.loads(config_file.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError) as err:
        raise ValueError(f"{model_dir}: no chat_template.jinja and no readable tokenizer_config.json ({err})") from err
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str) or not template:
        raise ValueError(f"{config_file}: no chat_template (and no chat_template.jinja in {model_dir})")
    return template


def _special_tokens_map(model_dir: Path) -> dict[str, str]:
    """bos_token, eos_token, pad_token, ... from tokenizer_config.json (transformers passes them all)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    tokens = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return tokens


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ValueError(f"chat template: syntax error at line {err.lineno}: {err.message}") from err
        self.source = source
        self.special_tokens = {"bos_token": "<BOS_TOKEN>", **(special_tokens or {})}

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        return cls(load_template_source(model_dir), _special_tokens_map(Path(model_dir)))

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; equals transformers' apply_chat_template(tokenize=False) on the same inputs."""
        messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as err:  # raise_exception() in the template, or a template bug
            raise ValueError(f"chat template: {err}") from err

    def encode(self, tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Prompt token ids. Marker strings inside messages, tools and kwargs are encoded as plain text."""
        control = sorted((tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.special_ids),
                         key=len, reverse=True)
        control_re = re.compile("|".join(re.escape(t) for t in control if t) or "(?!)")
        marked = _mark(messages, control_re), _mark(tools, control_re), _mark(kwargs, control_re)
        text = self.render(marked[0], marked[1], add_generation_prompt=add_generation_prompt, **marked[2])
        pieces = re.split(f"{_MARK_START}({control_re.pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]", text)
        ids = tokenizer.encode(pieces[0], allow_special=True)
        newline_ids = tokenizer.encode("\n", allow_special=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += _encode_piece(tokenizer, piece, as_text=i % 2 == 1, newline_ids=newline_ids)
        return ids


def _encode_piece(tokenizer, piece: str, *, as_text: bool, newline_ids: list[int]) -> list[int]:
    # Encode after a newline and strip it again, as transformers does, so the ids match its output.
    piece_ids = tokenizer.encode("\n" + piece, allow_special=not as_text)
    if piece_ids[: len(newline_ids)] == newline_ids:
        return piece_ids[len(newline_ids) :]
    return tokenizer.encode(piece, allow_special=not as_text)


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _mark(value, control_re: re.Pattern):
    """Wrap control-token strings in user data with the private-use pair (dict keys are left alone)."""
    if isinstance(value, str):
        value = value.replace(_MARK_START, "").replace(_MARK_END, "")
        return control_re.sub(lambda m: f"{_MARK_START}{m.group(0)}{_MARK_END}", value)
    if isinstance(value, dict):
        return {k: _mark(v, control_re) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, control_re) for v in value]
    return value
