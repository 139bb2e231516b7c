"""engine/grammar.py and the masks' application (sampling.apply_token_masks) on the tiny checkpoint's tokenizer:
compiling and its cache, a request's matcher (dormant until its trigger, tokens taken ahead, a lost token),
the step's masks (active and armed; a dormant grammar's that bans markers, alone and as the armed mask's
otherwise, with no matcher run), and -inf where a mask forbids."""

from __future__ import annotations


import pytest
import torch

from northcode.engine.grammar import (GrammarCompiler, GrammarError, RequestGrammar, constrained_masks, grammar_problem,
                                      json_text, schema_problem)
from northcode.engine.request import GrammarSpec, SamplingParams
from northcode.engine.sampling import (ALWAYS, NEVER, NO_DORMANT_RULE, TokenMasks, allowed_tokens, apply_token_masks,
                                      token_words)
from northcode.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler.for_tokenizer(tok, tok.vocab_size)


def marker(tok, name: str) -> int:
    return tok.token_to_id(f"<|{name}|>")


def text_grammar(tok) -> str:
    """<|END_THINKING|> <|START_TEXT|> {"a": integer} <|END_TEXT|>: a thinking block's end, then a JSON answer."""
    return f"start: <[{marker(tok, 'END_THINKING')}]> <[{marker(tok, 'START_TEXT')}]> %json {json_text(SCHEMA)} " \
           f"<[{marker(tok, 'END_TEXT')}]>"


def allowed(tok, masks: TokenMasks, k: int) -> list[str]:
    ids = allowed_tokens(masks.bits, tok.vocab_size)[k].nonzero().flatten().tolist()
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_a_grammar_is_compiled_once_and_its_errors_name_the_construct(tok, compiler):
    grammar = text_grammar(tok)
    assert compiler.compile(grammar) is compiler.compile(grammar)
    assert schema_problem(json_text({"type": "object", "propertyNames": {"pattern": "^a"}})) == \
        'Unimplemented keys: ["propertyNames"]'
    assert schema_problem(json_text({"type": "string", "format": "iban"})) == "Unknown format: iban"
    assert schema_problem(json_text(SCHEMA)) is None and grammar_problem(grammar) is None
    with pytest.raises(GrammarError, match="unknown special token"):
        compiler.compile("start: <|NO_SUCH_MARKER|>")


def test_a_dormant_grammar_wakes_at_its_trigger_and_then_holds_the_output(tok, compiler):
    grammar = RequestGrammar(compiler.compile(text_grammar(tok)), GrammarSpec(text_grammar(tok), marker(tok, "END_THINKING")))
    thinking = tok.encode("I think {not json")
    assert constrained_masks(compiler, [grammar], [(thinking, None, False)]) is None  # free: nothing to mask
    output = thinking + [marker(tok, "END_THINKING")]
    masks = constrained_masks(compiler, [grammar, None], [(output, None, False), ([], None, False)])
    assert masks.rows == (0,) and masks.triggers == (ALWAYS,) and allowed(tok, masks, 0) == ["<|START_TEXT|>"]
    answer = tok.encode('<|START_TEXT|>{"a": 12}<|END_TEXT|>', allow_special=True)
    assert grammar.end(output + answer[:-1]) == (None, None) and not grammar.is_finished
    assert grammar.end(output + answer) == ("stop", None)
    masks = constrained_masks(compiler, [grammar], [(output + answer, None, False)])
    assert allowed(tok, masks, 0) == ["<|END_OF_TURN_TOKEN|>"]  # complete: only EOS may follow


def test_a_dormant_row_that_feeds_an_unread_token_gets_the_mask_after_its_trigger_armed(tok, compiler):
    spec = GrammarSpec(text_grammar(tok), marker(tok, "END_THINKING"))
    grammar = RequestGrammar(compiler.compile(spec.grammar), spec)
    masks = constrained_masks(compiler, [None, grammar], [([], None, True), (tok.encode("hmm"), None, True)])
    assert masks.rows == (1,) and masks.triggers == (marker(tok, "END_THINKING"),)
    assert allowed(tok, masks, 0) == ["<|START_TEXT|>"]
    logits = torch.zeros(2, tok.vocab_size)
    for fed, finite in ((marker(tok, "END_THINKING"), 1), (5, tok.vocab_size)):  # the mask holds only after the trigger
        masked = apply_token_masks(logits, masks, torch.tensor([7, fed]))
        assert masked[0].isfinite().sum() == tok.vocab_size and masked[1].isfinite().sum() == finite


def banning(tok, compiler) -> RequestGrammar:
    """text_grammar's grammar, dormant until <|END_THINKING|>, text only until then."""
    spec = GrammarSpec(text_grammar(tok), marker(tok, "END_THINKING"), ban_while_dormant=True)
    return RequestGrammar(compiler.compile(spec.grammar), spec)


def finite(masked: torch.Tensor) -> set[int]:
    return set(masked.isfinite().nonzero().flatten().tolist())


def test_the_text_mask_is_every_token_but_the_special_ones(tok, compiler):
    text = set(allowed_tokens(compiler.text_mask[None], tok.vocab_size)[0].nonzero().flatten().tolist())
    assert text == set(range(tok.vocab_size)) - tok.special_ids and len(tok.special_ids) == 18
    assert torch.equal(token_words(allowed_tokens(compiler.text_mask[None], tok.vocab_size)), compiler.text_mask[None])
    wider = GrammarCompiler.for_tokenizer(tok, tok.vocab_size + 70)  # logits wider than the tokenizer: no tokens there
    assert allowed_tokens(wider.text_mask[None], tok.vocab_size + 70)[0, tok.vocab_size:].sum() == 0


def test_a_dormant_grammar_that_bans_markers_allows_text_and_its_trigger_without_a_matcher(tok, compiler, monkeypatch):
    end_thinking, grammar = marker(tok, "END_THINKING"), banning(tok, compiler)
    monkeypatch.setattr(compiler, "fill_masks", lambda grammars: pytest.fail("llguidance ran for a dormant row"))
    masks = constrained_masks(compiler, [None, grammar], [([], None, False), (tok.encode("I think"), None, False)])
    assert masks.rows == (1,) and masks.triggers == (NEVER,) and masks.dormant == (end_thinking,)
    assert masks.text_bits is compiler.text_mask and grammar.matcher is None
    masked = apply_token_masks(torch.zeros(2, tok.vocab_size), masks)  # the host knows the token fed: no `fed`
    assert finite(masked[0]) == set(range(tok.vocab_size))
    assert finite(masked[1]) == set(range(tok.vocab_size)) - tok.special_ids | {end_thinking}
    assert torch.equal(constrained_masks(compiler, [grammar], [(tok.encode("I think more"), None, False)]).bits,
                       torch.zeros(1, compiler.num_words, dtype=torch.int32))
    with pytest.raises(ValueError, match="ban_while_dormant only with a trigger"):
        SamplingParams(grammar=GrammarSpec(text_grammar(tok), None, ban_while_dormant=True)).validate()


def test_a_banning_row_that_feeds_an_unread_token_gets_the_armed_mask_or_otherwise_text(tok, compiler, monkeypatch):
    end_thinking = marker(tok, "END_THINKING")
    free = RequestGrammar(compiler.compile(text_grammar(tok)), GrammarSpec(text_grammar(tok), end_thinking))
    monkeypatch.setattr(compiler, "fill_masks", lambda grammars: pytest.fail("llguidance ran for a dormant row"))
    masks = constrained_masks(compiler, [banning(tok, compiler), free], [([], None, True), ([], None, True)])
    assert masks.triggers == (end_thinking, end_thinking) and masks.dormant == (end_thinking, NO_DORMANT_RULE)
    text = set(range(tok.vocab_size)) - tok.special_ids
    eos = marker(tok, "END_OF_TURN_TOKEN")
    for fed, allowed_then in ((end_thinking, {marker(tok, "START_TEXT")}), (5, text | {end_thinking}),
                              (eos, text | {end_thinking})):  # the armed mask if it fed the trigger, else text
        masked = apply_token_masks(torch.zeros(2, tok.vocab_size), masks, torch.tensor([fed, fed]))
        assert finite(masked[0]) == allowed_then
        assert finite(masked[1]) == ({marker(tok, "START_TEXT")} if fed == end_thinking else set(range(tok.vocab_size)))
    grammar = banning(tok, compiler)
    grammar.catch_up(tok.encode("hmm") + [end_thinking])
    monkeypatch.undo()
    awake = constrained_masks(compiler, [grammar], [(tok.encode("hmm") + [end_thinking], None, True)])
    assert awake.triggers == (ALWAYS,) and awake.dormant == (NO_DORMANT_RULE,) and awake.text_bits is None


def test_tokens_taken_ahead_are_confirmed_or_replaced(tok, compiler):
    grammar = RequestGrammar(compiler.compile(f"start: %json {json_text(SCHEMA)}"), GrammarSpec(""))
    ids = tok.encode('{"a": 12}')
    grammar.catch_up(ids[:2], extra=ids[2])  # the pipelined step: a token read before it is appended
    grammar.catch_up(ids[:3])  # appended: nothing taken twice
    assert grammar.error is None
    grammar.catch_up(ids[:3], extra=tok.encode("x")[0])  # refused: the matcher fails
    assert grammar.error is not None
    grammar.catch_up(ids)  # that token was lost (a failed step): taken again from the start, cleanly
    assert grammar.error is None and grammar.is_finished


def test_a_finished_or_failed_row_still_has_a_token_to_sample(tok, compiler):
    grammar = RequestGrammar(compiler.compile(f"start: %json {json_text(SCHEMA)}"), GrammarSpec(""))
    grammar.catch_up(tok.encode("nope"))
    masks = constrained_masks(compiler, [grammar], [([], None, False)])
    assert grammar.error is not None and allowed(tok, masks, 0) == ["<|END_OF_TURN_TOKEN|>"]


def test_masked_logits_are_a_new_tensor_and_other_rows_stay(tok):
    logits = torch.randn(3, 40)
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 0] = 0b1010  # tokens 1 and 3
    bits[0, 1] = -(1 << 31)  # token 63 (past the vocabulary of 40: ignored)
    masked = apply_token_masks(logits, TokenMasks((1,), bits, (ALWAYS,)))
    assert masked is not logits and torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert masked[1].isfinite().nonzero().flatten().tolist() == [1, 3] and torch.equal(masked[1, [1, 3]], logits[1, [1, 3]])
    assert apply_token_masks(logits, None) is logits


def test_a_penalty_never_lifts_a_masked_token():
    """A repetition penalty of 1e-300 is fp32 zero: -inf * 0 would be NaN, and NaN logits sample token 0."""
    from northcode.engine.request import SamplingParams
    from northcode.engine.sampling import Sampler, SamplingRow

    logits = torch.randn(1, 64)
    bits = torch.zeros(1, 2, dtype=torch.int32)
    bits[0, 1] = 1 << 3  # token 35 only
    masked = apply_token_masks(logits, TokenMasks((0,), bits, (ALWAYS,)))
    for params in (SamplingParams(temperature=2.0, top_p=1e-300, repetition_penalty=1e-300, frequency_penalty=2.0),
                   SamplingParams(temperature=0.0, presence_penalty=-2.0, logprobs=3)):
        row = SamplingRow(params, 1, list(range(64)), [0, 1, 35])
        assert Sampler().sample(masked, [row]).token_ids == [35]
