"""Constrained decoding's grammars: compiled once against the checkpoint's tokenizer, one matcher per request.

The grammar library is llguidance (vLLM, SGLang and llama.cpp can use it too); a grammar is its text
(request.GrammarSpec). It is imported on first use, not with the engine: an engine that serves no
constrained request runs without it. `GrammarCompiler.compile` builds a grammar against the tokenizer
(byte-level BPE: grammar text never matches a special token, so JSON cannot hold a marker) and caches it by
its text, so a repeated schema costs one copy of a matcher. `RequestGrammar` is one request's matcher:
dormant while its spec's trigger token has not been sampled, then fed every token the request samples.
`constrained_masks` gives a step's token masks (sampling.TokenMasks): an active grammar's next-token mask,
its rows computed in parallel; and for a dormant grammar whose row feeds a token the host has not read yet
(the pipelined step), the mask right after its trigger, armed: it applies only if that token is the trigger,
which the device checks, so a dormant row never waits for the host. A dormant grammar that bans markers
(GrammarSpec.ban_while_dormant) adds its dormant rule: otherwise, text tokens (`GrammarCompiler.text_mask`,
built once from the tokenizer) and the trigger; no matcher runs for it. Nothing here touches the device.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable

import torch

from northcode.engine.request import GrammarSpec
from northcode.engine.sampling import ALWAYS, NEVER, NO_DORMANT_RULE, TokenMasks, token_words

CACHE_SIZE = 64  # compiled grammars kept (least recently used goes first)
# llguidance's JSON options (a schema's "x-guidance") for JSON as json.dumps writes it: ", " and ": ", no other
# whitespace (a grammar that allows any whitespace lets a model run on in it)
DUMPS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar the library cannot compile; the message names the construct."""


def _library():
    try:
        import llguidance
    except ImportError as err:
        raise GrammarError("constrained decoding (response_format, tool_choice) needs the llguidance package: "
                           "pip install llguidance") from err
    return llguidance


@functools.lru_cache(maxsize=256)
def grammar_problem(grammar: str) -> str | None:
    """Why llguidance cannot compile `grammar`, or None. Checked without a tokenizer (so special token names are
    not), for the server to answer a 400 before a request reaches the engine."""
    failed, messages = _library().LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0].strip() if failed else None


@functools.lru_cache(maxsize=256)
def schema_problem(schema: str) -> str | None:
    """Why llguidance cannot enforce the JSON schema `schema` (its JSON text), or None."""
    try:
        grammar = _library().LLMatcher.grammar_from_json_schema(schema)
    except ValueError as err:
        return str(err)
    return grammar_problem(grammar)


def json_text(value) -> str:
    """JSON as a grammar's inline `%json` (and the caches' keys) take it: compact, keys in the given order."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class CompiledGrammar:
    """A grammar built against the tokenizer: `new_matcher` copies its fresh matcher (cheap); `mask_after(token)`
    is the mask once `token` (its first) is taken, computed once."""

    def __init__(self, text: str, template, num_words: int) -> None:
        self.text, self._template, self._num_words = text, template, num_words  # template: llguidance.LLMatcher
        self._masks_after: dict[int, torch.Tensor] = {}

    def new_matcher(self):
        return self._template.deep_copy()

    def mask_after(self, token: int) -> torch.Tensor:
        """int32 [num_words]: what may follow `token` at the grammar's start (all zero if it cannot start it)."""
        mask = self._masks_after.get(token)
        if mask is None:
            matcher = self.new_matcher()
            mask = torch.zeros(self._num_words, dtype=torch.int32)
            if matcher.consume_token(token):
                mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[:self._num_words]
            self._masks_after[token] = mask  # a race computes it twice: the same value
        return mask


class GrammarCompiler:
    """Builds grammars against one tokenizer, cached by text; thread-safe (the server compiles in worker threads,
    the engine's step thread reads the cache and fills masks)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...],
                 cache_size: int = CACHE_SIZE, special_ids: Iterable[int] = (), num_tokens: int | None = None) -> None:
        """tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the logits' width (masks cover it);
        special_ids: the tokenizer's special tokens; num_tokens: its size (ids from it up to vocab_size are none)."""
        self.vocab_size, self.num_words = vocab_size, -(-vocab_size // 32)
        text = torch.zeros(1, vocab_size, dtype=torch.bool)
        text[0, :min(vocab_size, num_tokens or vocab_size)] = True
        text[0, [t for t in special_ids if t < vocab_size]] = False
        self.text_mask = token_words(text)[0]  # int32 [num_words]: the text tokens (what a dormant rule allows)
        self._tokenizer_json, self._eos_ids = tokenizer_json, list(eos_ids)
        self._library_tokenizer = None  # llguidance.LLTokenizer, built on first use (~1 s for 256K tokens)
        self._executor = None  # llguidance.LLExecutor: its threads compute a step's masks together
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> GrammarCompiler:
        return cls(tokenizer.to_json(), vocab_size, tuple(tokenizer.eos_ids), special_ids=tokenizer.special_ids,
                   num_tokens=tokenizer.vocab_size)

    def _tokenizer(self):
        with self._lock:
            if self._library_tokenizer is None:
                library = _library()
                self._library_tokenizer = library.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                              eos_token=self._eos_ids)
                self._executor = library.LLExecutor()
            return self._library_tokenizer

    def compile(self, grammar: str) -> CompiledGrammar:
        """The grammar built against the tokenizer (from the cache when it was built before); GrammarError."""
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                return compiled
        matcher = _library().LLMatcher(self._tokenizer(), grammar, log_level=0)  # drops the GIL while it builds
        if matcher.is_error():
            raise GrammarError(f"the grammar cannot be compiled: {_first_line(matcher.get_error())}")
        compiled = CompiledGrammar(grammar, matcher, self.num_words)
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def fill_masks(self, grammars: list[RequestGrammar]) -> torch.Tensor:
        """int32 [len(grammars), num_words]: each active grammar's next-token mask. A row that allows nothing (a
        failed or finished matcher) allows the EOS tokens, so that every row has a token to sample."""
        self._tokenizer()
        bits = torch.zeros(len(grammars), self.num_words, dtype=torch.int32)
        matchers = [(g.matcher, k) for k, g in enumerate(grammars)]
        self._executor.unsafe_compute_mask_ptr(matchers, bits.data_ptr(), self.num_words * 4, len(grammars))
        for k in (~bits.any(dim=1)).nonzero().flatten().tolist():
            for token in self._eos_ids:
                bits[k, token // 32] |= -(1 << 31) if token % 32 == 31 else 1 << (token % 32)  # bit 31: the sign
        return bits


def _first_line(error: str) -> str:
    return (error.strip().splitlines() or [""])[0]  # the rest is the parser's state, for debugging


class RequestGrammar:
    """One request's matcher. Dormant (unconstrained, or held to text when the spec bans markers) until its trigger
    token when the spec names one; that token is the grammar's first. `catch_up` feeds it the request's tokens; a
    token it took that the request then lost (a decode step that failed before its tokens were appended) makes it
    start again from the beginning."""

    def __init__(self, compiled: CompiledGrammar, spec: GrammarSpec) -> None:
        self.compiled, self.trigger_id, self.ban_while_dormant = compiled, spec.trigger_id, spec.ban_while_dormant
        self._restart()

    def _restart(self) -> None:
        self.matcher = None if self.trigger_id is not None else self.compiled.new_matcher()
        self._confirmed = 0  # tokens of the request's output taken
        self._ahead: list[int] = []  # tokens taken beyond them (sampled, not yet appended to the output)

    @property
    def is_active(self) -> bool:
        return self.matcher is not None

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it refused, a limit of the library), or None."""
        if self.matcher is None or not self.matcher.is_error():
            return None
        return _first_line(self.matcher.get_error())

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: no token but EOS can follow."""
        return self.matcher is not None and not self.matcher.is_error() and self.matcher.is_stopped()

    def end(self, output_ids: list[int]) -> tuple[str | None, str | None]:
        """After the request's latest token: ("stop", None) when the grammar is complete, ("error", why) when the
        matcher failed, else (None, None)."""
        self.catch_up(output_ids)
        if self.error is not None:
            return "error", f"the request's grammar failed: {self.error}"
        return ("stop", None) if self.is_finished else (None, None)

    def catch_up(self, output_ids: list[int], extra: int | None = None) -> None:
        """Take the request's output so far, and `extra` (a token sampled and not yet in output_ids)."""
        tail = [] if extra is None else [extra]
        new, ahead = output_ids[self._confirmed:] + tail, self._ahead
        if new[:len(ahead)] != ahead[:len(new)]:  # a token it took ahead was lost: take everything again
            self._restart()
            new, ahead = output_ids + tail, []
        for token in new[len(ahead):]:
            self._take(token)
        taken = new if len(new) >= len(ahead) else ahead  # what it has taken since output_ids[_confirmed]
        self._ahead = taken[len(output_ids) - self._confirmed:]
        self._confirmed = len(output_ids)

    def _take(self, token: int) -> None:
        if self.matcher is None:
            if token != self.trigger_id:
                return
            self.matcher = self.compiled.new_matcher()
        self.matcher.consume_token(token)  # a refused token leaves the matcher failed: `error` says why


def constrained_masks(compiler: GrammarCompiler, grammars: list[RequestGrammar | None],
                      histories: list[tuple[list[int], int | None, bool]]) -> TokenMasks | None:
    """The step's token masks, or None when no row is constrained. histories[b]: row b's output ids, a token it
    sampled that is not in them yet (or None), and whether the token it feeds is still unread on the device.
    A row whose grammar is active gets its mask; a dormant one that feeds an unread token, the armed mask; a
    dormant one that bans markers, its dormant rule too (alone, NEVER, when the host knows the token it feeds)."""
    triggers: dict[int, int] = {}  # row -> ALWAYS (active), its trigger (armed) or NEVER (dormant rule only)
    for b, (grammar, (output_ids, extra, unread)) in enumerate(zip(grammars, histories)):
        if grammar is None:
            continue
        grammar.catch_up(output_ids, extra)
        if grammar.is_active:
            triggers[b] = ALWAYS
        elif unread:
            triggers[b] = grammar.trigger_id
        elif grammar.ban_while_dormant:
            triggers[b] = NEVER
    if not triggers:
        return None
    rows = tuple(sorted(triggers))
    active = [b for b in rows if triggers[b] == ALWAYS]
    bits = dict(zip(active, compiler.fill_masks([grammars[b] for b in active]))) if active else {}
    unused = torch.zeros(compiler.num_words, dtype=torch.int32)  # a NEVER row's mask
    bits.update((b, unused if t == NEVER else grammars[b].compiled.mask_after(t)) for b, t in triggers.items()
                if t != ALWAYS)
    dormant = tuple(grammars[b].trigger_id if triggers[b] != ALWAYS and grammars[b].ban_while_dormant
                    else NO_DORMANT_RULE for b in rows)
    return TokenMasks(rows, torch.stack([bits[b] for b in rows]), tuple(triggers[b] for b in rows), dormant,
                      compiler.text_mask if any(d != NO_DORMANT_RULE for d in dormant) else None)
