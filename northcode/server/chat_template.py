"""ChatTemplate: renders the checkpoint's own Jinja chat template exactly as transformers does.

Same environment as transformers' apply_chat_template: an immutable sandbox with trim_blocks and
lstrip_blocks, loop controls, `tojson` as json.dumps with ", "/": " separators and no ASCII
escaping, `raise_exception`, `strftime_now`, and the reasoning aliases (reasoning_content,
thinking, reasoning) filled on every message. `encode` keeps marker strings found in user-supplied
text (messages, tools, kwargs) from becoming special tokens: it wraps them in private-use
characters before rendering and encodes those pieces as plain text, the way transformers'
`sanitize_control_tokens=True` does; tests/test_chat_template.py diffs both against transformers.

Rendering is linear in the conversation: cmd4's `regen_tool_call_ids` makes the template number the
tool calls itself, searching every call for each result (quadratic: 1,000 round trips took 11-49 s),
so `render` numbers them once in Python and hands the template the numbers as the ids, with
regen_tool_call_ids off, where a probe history shows that the text comes out the same byte for byte.
Tokenizing releases the GIL (`_encoding`).
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
# What render and encode set themselves, and the template's globals: never a template kwarg from a client.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenizer", "self",
                                    "token_limit", "raise_exception", "strftime_now"})


def _probe_call(call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "read", "arguments": {"path": call_id}}}


_PROBE_HISTORY = [  # parallel calls, results out of order, an id used again in a later turn
    {"role": "user", "content": "read a and b"},
    {"role": "assistant", "content": "", "tool_calls": [_probe_call("call_a"), _probe_call("call_b")]},
    {"role": "tool", "tool_call_id": "call_b", "content": "B"},
    {"role": "tool", "tool_call_id": "call_a", "content": "A"},
    {"role": "assistant", "content": "", "tool_calls": [_probe_call("call_c"), _probe_call("call_a")]},
    {"role": "tool", "tool_call_id": "call_a", "content": "A again"},
    {"role": "tool", "tool_call_id": "call_c", "content": "C"},
]


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
        self._numbers_calls = self._numbering_is_exact()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate:
        return cls(load_template_source(model_dir), _special_tokens_map(Path(model_dir)))

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; equals transformers' apply_chat_template(tokenize=False) on the same inputs."""
        messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return self._render(messages, tools, add_generation_prompt, kwargs, number_calls=self._numbers_calls)
        except jinja2.TemplateError as err:  # raise_exception() in the template, or a template bug
            raise ValueError(f"chat template: {err}") from err

    def _render(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict, *, number_calls: bool) -> str:
        if number_calls and kwargs.get("regen_tool_call_ids", True) is True:
            numbered = _numbered_calls(messages)
            if numbered is not None:  # the template's own numbering is quadratic in the history
                messages, kwargs = numbered, {**kwargs, "regen_tool_call_ids": False}
        context = {**self.special_tokens, **kwargs, "messages": messages, "tools": tools, "documents": None,
                   "add_generation_prompt": add_generation_prompt}
        return self._template.render(context)

    def _numbering_is_exact(self) -> bool:
        """Whether this template renders calls numbered by _numbered_calls exactly as it numbers them
        itself, checked on a probe history; a template that cannot render the probe keeps its own."""
        try:
            ours, its_own = (self._render(_PROBE_HISTORY, None, True, {}, number_calls=n) for n in (True, False))
            return ours == its_own
        except Exception:  # any template, any failure: this is only a shortcut
            return False

    def encode(self, tokenizer, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, token_limit: int | None = None, **kwargs) -> list[int]:
        """Prompt token ids. Marker strings inside messages, tools and kwargs are encoded as plain text.

        PromptTooLong when the prompt has more than `token_limit` tokens, raised before the ids of its
        bulk are built (millions of Python ints, for a prompt that is refused anyway).
        """
        control = sorted((tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.special_ids),
                         key=len, reverse=True)
        control_re = re.compile("|".join(re.escape(t) for t in control if t) or "(?!)")
        marked = _mark(messages, control_re), _mark(tools, control_re), _mark(kwargs, control_re)
        text = self.render(marked[0], marked[1], add_generation_prompt=add_generation_prompt, **marked[2])
        pieces = _marked_pieces(text)
        head = _encoding(tokenizer, pieces[0], allow_special=True)  # the bulk: all of it without marker strings
        newline_ids = encode_text(tokenizer, "\n", allow_special=False)
        tail = []
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                tail += _encode_piece(tokenizer, piece, as_text=i % 2 == 1, newline_ids=newline_ids)
        if token_limit is not None and len(head) + len(tail) > token_limit:
            raise PromptTooLong(len(head) + len(tail), token_limit)
        return (head if isinstance(head, list) else head.ids) + tail


class PromptTooLong(ValueError):
    def __init__(self, num_tokens: int, token_limit: int) -> None:
        super().__init__(f"the prompt has {num_tokens} tokens, more than the limit of {token_limit}")
        self.num_tokens = num_tokens


def _encode_piece(tokenizer, piece: str, *, as_text: bool, newline_ids: list[int]) -> list[int]:
    # Encode after a newline and strip it again, as transformers does, so the ids match its output.
    piece_ids = encode_text(tokenizer, "\n" + piece, allow_special=not as_text)
    if piece_ids[: len(newline_ids)] == newline_ids:
        return piece_ids[len(newline_ids) :]
    return encode_text(tokenizer, piece, allow_special=not as_text)


def _marked_pieces(text: str) -> list[str]:
    """Rendered text cut at the marks `_mark` set: [text, control, text, control, ..., text], the marks
    gone (str.split, not a regex: a multi-MB prompt is cut in a few ms without holding the GIL long)."""
    first, *marked = text.split(_MARK_START)
    pieces = [first.replace(_MARK_END, "")]
    for part in marked:
        control, _, rest = part.partition(_MARK_END)
        pieces += [control, rest.replace(_MARK_END, "")]
    return pieces


def encode_text(tokenizer, text: str, *, allow_special: bool) -> list[int]:
    """tokenizer.encode(text, allow_special) (Tokenizer.encoding says why it releases the GIL)."""
    encoding = _encoding(tokenizer, text, allow_special=allow_special)
    return encoding if isinstance(encoding, list) else encoding.ids


def _encoding(tokenizer, text: str, *, allow_special: bool):
    """Tokenizer.encoding (len() counts the tokens before any id list is built); a tokenizer without it (a test
    double) gives its list of ids."""
    if not hasattr(tokenizer, "encoding"):
        return tokenizer.encode(text, allow_special=allow_special)
    return tokenizer.encoding(text, allow_special)


def _numbered_calls(messages: list[dict]) -> list[dict] | None:
    """The messages with the ids cmd4's regen_tool_call_ids gives: calls count up from 0 across the
    conversation, and a tool result takes the number of the first call with its id.

    None where the template's own numbering could come out otherwise: a call id that is not a string,
    a result that answers no earlier call, tool calls outside an assistant message, a role not in
    lower case (the template lower-cases roles).
    """
    numbers: dict[str, str] = {}  # call id -> the number of its first call
    num_calls = 0
    out = []
    for message in messages:
        role, calls, answered = message.get("role"), message.get("tool_calls"), message.get("tool_call_id")
        if not isinstance(role, str) or role != role.lower():
            return None
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                return None
            if not all(isinstance(call, dict) and isinstance(call.get("id"), str) for call in calls):
                return None
            renumbered = [{**call, "id": str(num_calls + i)} for i, call in enumerate(calls)]
            for call, new in zip(calls, renumbered):
                numbers.setdefault(call["id"], new["id"])
            num_calls += len(calls)
            message = {**message, "tool_calls": renumbered}
        elif role == "tool":
            if not isinstance(answered, str) or answered not in numbers:
                return None
            message = {**message, "tool_call_id": numbers[answered]}
        out.append(message)
    return out


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
