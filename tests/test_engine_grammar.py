"""Constrained decoding through the Engine on the tiny random-weights checkpoint (tests/closing_model.py): every
schema of tests/data/json_schemas.json, greedy and sampled, in batches of 8 on the pipelined step, gives JSON
that parses and validates (jsonschema); the same alone; under penalties (the unpipelined step, the host
Sampler); a grammar dormant until its trigger, whose first masked token the device samples before the host
has read the trigger; max_tokens before the grammar is done ("length", a valid prefix); unconstrained rows
untouched by a constrained one beside them; a thinking block before a forced answer, on a model leaning to
escape it, left only by its end (GrammarSpec.ban_while_dormant)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from northcode.engine.grammar import DUMPS_STYLE, RequestGrammar, json_text
from northcode.engine.request import GrammarSpec, SamplingParams
from tests.closing_model import SCHEMAS, THINKING_LEAN, closing_engine
from tests.test_engine import make_engine, prompt_of, run, tokens_of

MAX_TOKENS = 100  # the closing model ends every schema's JSON within 93 tokens (the longest seen)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = closing_engine(tiny_checkpoint)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("Reply with JSON.")


def schema_grammar(schema) -> GrammarSpec:
    schema = schema if isinstance(schema, dict) else {}  # `true`: any JSON
    return GrammarSpec("start: %json " + json_text({**schema, "x-guidance": DUMPS_STYLE}))


def generate(engine, prompt: list[int], params: list[SamplingParams]) -> list[tuple[str, list[int]]]:
    """All at once: (finish reason, token ids) of each."""
    async def one(i: int, p: SamplingParams):
        outputs = [out async for out in engine.generate(f"g{i}-{id(p)}", prompt, p)]
        assert outputs[-1].error is None, outputs[-1].error
        return outputs[-1].finish_reason, [t for out in outputs for t in out.token_ids]

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(params)])
    return asyncio.run(main())


def assert_valid(engine, entry: dict, reason: str, ids: list[int]) -> None:
    text = engine.tokenizer.decode(ids)
    assert reason == "stop", (entry["name"], reason, text)
    jsonschema.validate(json.loads(text), entry["schema"])


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_schema_in_batches_of_eight_parses_and_validates(engine, prompt, temperature):
    assert len(SCHEMAS) >= 100
    for start in range(0, len(SCHEMAS), 8):
        entries = SCHEMAS[start:start + 8]
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=start + k,
                                 grammar=schema_grammar(e["schema"])) for k, e in enumerate(entries)]
        for entry, (reason, ids) in zip(entries, generate(engine, prompt, params)):
            assert_valid(engine, entry, reason, ids)


def test_alone_as_in_a_batch_and_under_penalties_on_the_host(engine, prompt):
    entries = SCHEMAS[:8]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=schema_grammar(e["schema"])) for e in entries]
    batched = generate(engine, prompt, params)
    assert [generate(engine, prompt, [p])[0] for p in params[:3]] == batched[:3]
    penalised = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=k, presence_penalty=0.5, logprobs=2,
                                grammar=schema_grammar(e["schema"])) for k, e in enumerate(entries)]
    for entry, (reason, ids) in zip(entries, generate(engine, prompt, penalised)):
        assert_valid(engine, entry, reason, ids)


def test_a_grammar_cut_off_by_max_tokens_ends_with_length_and_a_valid_prefix(engine, prompt):
    spec = schema_grammar({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]})
    (reason, ids), = generate(engine, prompt, [SamplingParams(max_tokens=4, temperature=0.0, grammar=spec)])
    grammar = RequestGrammar(engine.grammars.compile(spec.grammar), spec)
    assert reason == "length" and len(ids) == 4
    grammar.catch_up(ids)
    assert grammar.error is None and not grammar.is_finished


@pytest.mark.parametrize("penalty", [0.0, 0.1], ids=["pipelined", "host-sampled"])
def test_free_until_the_trigger_then_held_and_the_rows_beside_it_untouched(tiny_checkpoint, penalty):
    """On the plain random model: the trigger is a token it writes a few tokens in (the same seed draws the same
    tokens up to it), so the grammar takes over mid-output; on the pipelined step the token after it is sampled
    before the host has read the trigger (the armed mask). The schema's JSON is finite: the noise ends it."""
    engine = make_engine(tiny_checkpoint)
    prompt = prompt_of(9)
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, presence_penalty=penalty)
    (_, alone), = generate(engine, prompt, [free])
    at = next(i for i in range(3, len(alone)) if alone[i] not in alone[:i])
    entry = {"name": "flag", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                        "additionalProperties": False}}
    grammar = f"start: <[{alone[at]}]> %json {json_text({**entry['schema'], 'x-guidance': DUMPS_STYLE})}"
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, presence_penalty=penalty,
                                 grammar=GrammarSpec(grammar, alone[at]))
    (reason, ids), (_, beside) = generate(engine, prompt, [constrained, free])
    engine.shutdown()
    assert beside == alone and ids[:at + 1] == alone[:at + 1]
    assert_valid(engine, entry, reason, ids[at + 1:])


@pytest.mark.parametrize("penalty", [0.0, 0.5], ids=["pipelined", "host-sampled"])
def test_a_thinking_block_before_a_forced_answer_is_left_only_by_its_end(tiny_checkpoint, penalty):
    """A grammar dormant until <|END_THINKING|> that bans markers meanwhile, on the closing model leaning harder to
    end the turn or open a text block than to end its thinking (THINKING_LEAN): 16 requests in batches of 8,
    greedy and sampled, the first token from the prefill, each think in text, end the thinking, then answer in
    JSON that validates. The same grammar without the ban: most end their turn instead (what the ban closes)."""
    engine = closing_engine(tiny_checkpoint, THINKING_LEAN)
    tok = engine.tokenizer
    start_thinking, end_thinking, start_text, end_text = (tok.token_to_id(f"<|{name}|>") for name in (
        "START_THINKING", "END_THINKING", "START_TEXT", "END_TEXT"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammar = f"start: <[{end_thinking}]> <[{start_text}]> %json {json_text({**schema, 'x-guidance': DUMPS_STYLE})} " \
              f"<[{end_text}]>"

    def requests(first: int, ban: bool) -> list[tuple[list[int], SamplingParams]]:
        return [(prompt_of(5 + k, salt=3) + [start_thinking],
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0 if k % 2 else 1.0, seed=k,
                                presence_penalty=penalty, grammar=GrammarSpec(grammar, end_thinking, ban)))
                for k in range(first, first + 8)]
    try:
        held = run(engine, requests(0, True)) + run(engine, requests(8, True))
        free = run(engine, requests(0, False))
    finally:
        engine.shutdown()
    for outputs in held:
        ids = tokens_of(outputs)
        assert outputs[-1].finish_reason == "stop" and end_thinking in ids, tok.decode(ids, skip_special_tokens=False)
        thinking, answer = ids[:ids.index(end_thinking)], ids[ids.index(end_thinking) + 1:]
        assert not set(thinking) & tok.special_ids and answer[0] == start_text and answer[-1] == end_text
        jsonschema.validate(json.loads(tok.decode(answer[1:-1])), schema)
    assert sum(end_thinking not in tokens_of(outputs) for outputs in free) >= 4


def test_an_unknown_special_token_in_a_grammar_is_refused_before_the_request_runs(engine, prompt):
    with pytest.raises(ValueError, match="unknown special token"):
        generate(engine, prompt, [SamplingParams(grammar=GrammarSpec("start: <|NO_SUCH_MARKER|>"))])
    assert engine.stats()["requests_running"] == 0
