"""The megakernel's token masks (RowState.mask: a MaskSlot in mapped host memory, ABI 9) against the torch path
(sampling.apply_token_masks).

On the kernel alone (LM_HEAD + SAMPLE over random hidden states, as test_megakernel_sampling.py): rows
unconstrained, masked, armed with the trigger they fed, armed with another and pointing at a slot released
without a mask; the kernel's logits are the torch path's masked logits exactly (the same products: only the
forbidden ones are -inf), greedy rows take their argmax, and sampled rows, plain and filtered, never draw a
forbidden token and fit the masked distribution (chi-square). The late mask: slots released while the step
runs (it is still waiting 50 ms on) give the tokens and logits of slots released before the launch, greedy,
plain and filtered; a slot never released ends the step with the mask timeout. Dormant rules (a slot's
`dormant`: where its words do not apply, the text mask in device memory plus that token): the torch path's
logits where no words apply (NEVER) and where an armed row fed another token than its trigger, the words where
it fed the trigger, nothing before the text mask is uploaded; their draws fit their distribution; released late
as early. Then the Engine over the megakernel: constrained requests beside free ones, greedy and sampled, one
grammar dormant until a token it writes, give JSON of the schema, the same tokens alone (pipelined: masks written
while their step runs) as in the batch, and as beside a request with logprobs (unpipelined); a grammar that
bans markers while dormant writes no special token before its trigger, alone as in a batch. Needs llguidance
(the engine's grammars).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import pytest
import torch

pytestmark = pytest.mark.gpu
DRAWS = 800  # launches per setting, 8 rows each
STEPS = itertools.count(1)  # the step numbers slots are released as (each launch its own)


@pytest.fixture(autouse=True)
def hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the megakernel runs on sm_90 only")


def random_masks(vocab: int, rows: int, keep: float, seed: int) -> torch.Tensor:
    """int32 [rows, ceil(V / 32)] on the host: each token allowed with probability `keep`, token 0 always."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, -(-vocab // 32) * 32, generator=gen) < keep
    allowed[:, 0] = True
    weights = (1 << torch.arange(32, dtype=torch.int64))
    words = (allowed.view(rows, -1, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def launch(kernel, config, specs, fed: torch.Tensor, masks: dict | None = None, late: bool = False) -> list[int]:
    """LM_HEAD over every tile, then SAMPLE per row, with row b feeding fed[b] (what a trigger compares with).
    masks {row: (words or None, trigger[, dormant])}: row b reads mask slot b, released before the launch or,
    late, 50 ms after it, once the step is seen still waiting for it."""
    from northcode.megakernel.kernel import TaskType, flatten, make_task, place_waves

    masks, seq = masks or {}, next(STEPS)
    specs = [dataclasses.replace(spec, mask=kernel.mask_address(b), mask_seq=seq) if b in masks else spec
             for b, spec in enumerate(specs)]

    def release() -> None:
        for b, (words, trigger, *dormant) in masks.items():
            kernel.release_mask(b, seq, words, trigger, *dormant)

    if not late:
        release()
    tiles = -(-config.vocab_size // 32)
    lm = [make_task(TaskType.LM_HEAD, 0, (t, 1, t), (), 0) for t in range(tiles)]
    sample = [make_task(TaskType.SAMPLE, 0, (b, tiles), ((0, tiles),)) for b in range(len(specs))]
    kernel.set_rows(specs)
    kernel.tokens[:len(specs)].copy_(fed.to(torch.int32))
    kernel.launch(flatten(place_waves([lm, sample], kernel.num_blocks), 1, tiles), len(specs))
    if late:
        launched = torch.cuda.Event()
        launched.record()
        time.sleep(0.05)
        assert not launched.query(), "the step finished before its masks were released"
        release()
    kernel.check()
    return kernel.tokens[:len(specs)].tolist()


def test_masked_logits_and_greedy_tokens_equal_the_torch_path():
    from northcode.engine.sampling import ALWAYS, TokenMasks, apply_token_masks
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_tasks import env, randn_bf16  # tests/gpu is on sys.path (rootdir-less test modules)

    config, _, _, _, kernel = env()
    vocab = config.vocab_size
    kernel.h.copy_(randn_bf16(8, config.hidden_size))
    fed = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    launch(kernel, config, [RowSpec(position=0, seq=0) for _ in range(8)], fed)
    raw = kernel.logits.clone()  # [8, V] unmasked
    words = random_masks(vocab, 8, 0.3, seed=1)
    words[3] = random_masks(vocab, 1, 0.001, seed=2)[0]  # a handful of tokens
    triggers = [ALWAYS, ALWAYS, ALWAYS, ALWAYS, 9, 0, ALWAYS, ALWAYS]  # row 4 fed its trigger, row 5 did not
    masked_rows = (0, 2, 3, 4, 5, 7)  # rows 1 and 6 unconstrained; row 6 points at a slot released with no mask
    slots = {b: (words[b], triggers[b]) for b in masked_rows} | {6: (None, ALWAYS)}
    tokens = launch(kernel, config, [RowSpec(position=0, seq=0) for _ in range(8)], fed, slots)
    masks = TokenMasks(masked_rows, words[list(masked_rows)], tuple(triggers[b] for b in masked_rows))
    expected = apply_token_masks(raw, masks, fed.cuda())
    assert torch.equal(kernel.logits, expected)
    assert torch.equal(kernel.logits[[1, 5, 6]], raw[[1, 5, 6]])  # free, armed with a token it did not feed, no mask
    assert tokens == expected.argmax(-1).tolist()


@pytest.mark.parametrize("rule", ["words", "dormant"])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=40)],
                         ids=["plain", "filtered"])
def test_masked_draws_fit_the_masked_distribution(settings, rule):
    from northcode.engine.sampling import NEVER, allowed_tokens, filter_probs
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_sampling import chi_square_p_value, P_MIN
    from test_megakernel_tasks import env, randn_bf16

    config, _, _, _, kernel = env()
    kernel.h.copy_(randn_bf16(1, config.hidden_size).expand(8, -1).contiguous())  # same logits on every row
    mask = random_masks(config.vocab_size, 1, 0.05, seed=4)[0]
    counts = torch.zeros(config.vocab_size, dtype=torch.float64)
    fed = torch.zeros(8, dtype=torch.long)
    slot = (mask, -1)  # the words apply; or the dormant rule: the same tokens as the text mask plus its trigger
    if rule == "dormant":
        trigger = int(allowed_tokens(mask[None], config.vocab_size)[0].nonzero()[-1])
        text = mask.clone()
        text[trigger // 32] &= ~(1 << trigger % 32)
        kernel.set_text_mask(text)
        slot = (None, NEVER, trigger)
    for n in range(DRAWS):
        specs = [RowSpec(position=0, seq=0, step=n % 7, seed=5000 + 8 * n + b, **settings) for b in range(8)]
        for token in launch(kernel, config, specs, fed, {b: slot for b in range(8)}):
            counts[token] += 1
    logits = kernel.logits[0].double().cpu()
    allowed = torch.isfinite(logits)
    assert 0 < allowed.sum() < config.vocab_size
    probs = torch.softmax(logits / settings["temperature"], dim=-1)[None]
    probs = filter_probs(probs, torch.tensor([settings.get("top_k", 0)]),
                         torch.tensor([settings.get("top_p", 1.0)], dtype=torch.float64),
                         torch.tensor([settings.get("min_p", 0.0)], dtype=torch.float64))[0]
    assert counts[~allowed].sum() == 0, f"{int(counts[~allowed].sum())} draws of forbidden tokens"
    assert chi_square_p_value(counts, probs) > P_MIN


def test_a_mask_released_while_its_step_runs_gives_what_one_released_before_the_launch_gives():
    """The late mask of the pipelined step: the same tokens and logits, greedy, plain and filtered rows, armed
    and always, and a row whose slot comes with no mask."""
    from northcode.engine.sampling import ALWAYS
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_tasks import env, randn_bf16

    config, _, _, _, kernel = env()
    kernel.h.copy_(randn_bf16(8, config.hidden_size))
    fed = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    words = random_masks(config.vocab_size, 8, 0.2, seed=7)
    settings = [dict(), dict(), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=40),
                dict(temperature=1.0), dict(), dict(temperature=0.7, min_p=0.1), dict()]
    specs = [RowSpec(position=0, seq=0, step=3, seed=900 + b, **settings[b]) for b in range(8)]
    masks = {0: (words[0], ALWAYS), 1: (words[1], 6), 2: (words[2], ALWAYS), 3: (words[3], ALWAYS),
             4: (words[4], 0), 5: (None, ALWAYS), 6: (words[6], ALWAYS)}  # row 7 free; row 4 armed, not fed its trigger
    early = launch(kernel, config, specs, fed, masks)
    early_logits = kernel.logits.clone()
    late = launch(kernel, config, specs, fed, masks, late=True)
    assert late == early and torch.equal(kernel.logits, early_logits)
    assert torch.isinf(early_logits[[0, 1, 2, 3, 6]]).any(-1).all() and torch.isfinite(early_logits[[4, 5, 7]]).all()


def text_and_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A text mask (half the tokens, the rules' triggers 3 and 7 left out), slot words for 8 rows, and the triggers."""
    text = random_masks(vocab, 1, 0.5, seed=11)[0]
    for token in (3, 7):
        text[token // 32] &= ~(1 << token % 32)
    return text, random_masks(vocab, 8, 0.2, seed=12), [3, 7]


def test_dormant_rules_mask_with_the_text_mask_as_the_torch_path():
    """Greedy rows: 0 NEVER with a rule (text + 3); 1 armed, fed its trigger (its words); 2 armed, fed another
    (text + 7); 3 armed, fed another, no rule (free); 4 ALWAYS with a rule (its words); 5 free. Before the text
    mask is uploaded a rule leaves its row free (the kernel's null check)."""
    from northcode.engine.sampling import ALWAYS, NEVER, NO_DORMANT_RULE, TokenMasks, apply_token_masks
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_tasks import env, randn_bf16

    config, _, _, _, kernel = env()
    kernel.h.copy_(randn_bf16(8, config.hidden_size))
    fed = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    specs = [RowSpec(position=0, seq=0) for _ in range(6)]
    launch(kernel, config, specs, fed[:6])
    raw = kernel.logits[:6].clone()
    text, words, (t0, t2) = text_and_rows(config.vocab_size)
    assert kernel.text_mask is None
    launch(kernel, config, specs, fed[:6], {0: (None, NEVER, t0)})
    assert torch.equal(kernel.logits[:6], raw)  # no text mask yet: the rule does nothing
    kernel.set_text_mask(text)
    slots = {0: (None, NEVER, t0), 1: (words[1], 6, t2), 2: (words[2], 0, t2), 3: (words[3], 0),
             4: (words[4], ALWAYS, t0)}
    tokens = launch(kernel, config, specs, fed[:6], slots)
    rows = (0, 1, 2, 3, 4)
    bits = torch.stack([torch.zeros_like(words[0]) if slots[b][0] is None else slots[b][0] for b in rows])
    masks = TokenMasks(rows, bits, tuple(slots[b][1] for b in rows),
                       tuple(slots[b][2] if len(slots[b]) > 2 else NO_DORMANT_RULE for b in rows), text)
    expected = apply_token_masks(raw, masks, fed[:6].cuda())
    assert torch.equal(kernel.logits[:6], expected) and tokens == expected.argmax(-1).tolist()
    assert torch.equal(kernel.logits[[3, 5]], raw[[3, 5]]) and torch.isfinite(kernel.logits[0, t0])
    assert torch.isfinite(kernel.logits[2, t2]) and torch.isinf(kernel.logits[[0, 2]]).any(-1).all()


def test_a_dormant_rule_released_while_its_step_runs_gives_what_one_released_before_the_launch_gives():
    from northcode.engine.sampling import ALWAYS, NEVER
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_tasks import env, randn_bf16

    config, _, _, _, kernel = env()
    kernel.h.copy_(randn_bf16(8, config.hidden_size))
    text, words, (t0, t2) = text_and_rows(config.vocab_size)
    kernel.set_text_mask(text)
    fed = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    settings = [dict(), dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=40), dict(),
                dict(temperature=1.0), dict(temperature=0.7, min_p=0.1), dict(), dict(temperature=1.0)]
    specs = [RowSpec(position=0, seq=0, step=4, seed=700 + b, **settings[b]) for b in range(8)]
    masks = {0: (None, NEVER, t0), 1: (None, NEVER, t2), 2: (words[2], 0, t0), 3: (words[3], 8, t0),
             4: (words[4], 1, t2), 5: (None, NEVER, t0), 6: (words[6], ALWAYS, t2)}  # row 7 free
    early = launch(kernel, config, specs, fed, masks)
    early_logits = kernel.logits.clone()
    late = launch(kernel, config, specs, fed, masks, late=True)
    assert late == early and torch.equal(kernel.logits, early_logits)
    assert torch.isinf(early_logits[:7]).any(-1).all() and torch.isfinite(early_logits[7]).all()


def test_a_mask_never_released_ends_the_step_with_the_mask_timeout():
    from northcode.megakernel.kernel import RowSpec
    from test_megakernel_tasks import env, params_set

    config, _, _, _, kernel = env()
    seq = next(STEPS)
    specs = [RowSpec(position=0, seq=0), RowSpec(position=0, seq=0, mask=kernel.mask_address(1), mask_seq=seq)]
    with params_set(kernel, timeout_ns=300_000_000):
        with pytest.raises(RuntimeError, match=rf"row 1: its token mask \(step {seq}\) was not released by the host"):
            launch(kernel, config, specs, torch.tensor([1, 2]))
    assert launch(kernel, config, specs[:1], torch.tensor([1])) is not None  # the status was reset: the kernel runs


def test_the_engine_over_the_megakernel_writes_the_schema(tiny_checkpoint):
    from northcode.engine.grammar import DUMPS_STYLE, json_text
    from northcode.engine.request import GrammarSpec, SamplingParams
    from tests.gpu.test_megakernel_backend_gpu import megakernel_engine
    from tests.test_engine import prompt_of, run, tokens_of

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
              "required": ["ok", "n", "tags"], "additionalProperties": False}
    body = f"%json {json_text({**schema, 'x-guidance': DUMPS_STYLE})}"
    engine = megakernel_engine(tiny_checkpoint)
    try:
        free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        trigger = tokens_of(run(engine, [(prompt_of(21), free)])[0])[2]
        requests = [(prompt_of(5 + i), SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 1.0, seed=i,
                                                      grammar=GrammarSpec(f"start: {body}"))) for i in range(5)]
        requests += [(prompt_of(21), SamplingParams(max_tokens=60, temperature=0.0,
                                                    grammar=GrammarSpec(f"start: <[{trigger}]> {body}", trigger))),
                     (prompt_of(30), free), (prompt_of(31), free)]
        together = run(engine, requests)
        alone = [run(engine, [r])[0] for r in requests]  # pipelined: each constrained row's mask comes late
        assert [tokens_of(o) for o in together] == [tokens_of(o) for o in alone]
        host_sampled = (prompt_of(40), SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
        for request, outputs in zip(requests[:6:2], alone[:6:2]):  # unpipelined beside it: masks while the step runs
            assert tokens_of(run(engine, [request, host_sampled])[0]) == tokens_of(outputs)
        for i, outputs in enumerate(together[:6]):
            ids = tokens_of(outputs)
            ids = ids[ids.index(trigger) + 1:] if i == 5 else ids
            value = json.loads(engine.tokenizer.decode(ids))
            assert outputs[-1].finish_reason == "stop" and set(value) == {"ok", "n", "tags"}
            assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and set(value["tags"]) <= {"a", "b"}
    finally:
        engine.shutdown()


def test_the_engine_over_the_megakernel_holds_a_banning_dormant_grammar_to_text(tiny_checkpoint):
    """A grammar that bans markers until a token the free run writes (its dormant rule over the text mask, armed
    rows pipelined): greedy and sampled rows write no special token before it, the same tokens alone as together
    and as beside a request with logprobs (unpipelined: the host knows each fed token, NEVER)."""
    from northcode.engine.grammar import DUMPS_STYLE, json_text
    from northcode.engine.request import GrammarSpec, SamplingParams
    from tests.gpu.test_megakernel_backend_gpu import megakernel_engine
    from tests.test_engine import prompt_of, run, tokens_of

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = f"%json {json_text({**schema, 'x-guidance': DUMPS_STYLE})}"
    engine = megakernel_engine(tiny_checkpoint)
    special = engine.tokenizer.special_ids
    try:
        free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for n in range(21, 41):  # a greedy run whose first tokens are text, up to a new one: the trigger
            ids = tokens_of(run(engine, [(prompt_of(n), free)])[0])
            at = next((i for i in range(2, len(ids)) if ids[i] not in ids[:i] and not set(ids[:i + 1]) & special), None)
            if at is not None:
                break
        trigger = ids[at]
        spec = GrammarSpec(f"start: <[{trigger}]> {body}", trigger, ban_while_dormant=True)
        requests = [(prompt_of(n if i == 0 else 8 + i), SamplingParams(
            max_tokens=48, temperature=0.0 if i % 2 == 0 else 1.5, seed=i, grammar=spec)) for i in range(6)]
        requests += [(prompt_of(50), free), (prompt_of(51), free)]
        together = run(engine, requests)
        alone = [run(engine, [r])[0] for r in requests]
        assert [tokens_of(o) for o in together] == [tokens_of(o) for o in alone]
        host_sampled = (prompt_of(60), SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True))
        for request, outputs in zip(requests[:6:2], alone[:6:2]):
            assert tokens_of(run(engine, [request, host_sampled])[0]) == tokens_of(outputs)
        for outputs in together[:6]:
            got = tokens_of(outputs)
            assert not set(got[:got.index(trigger) if trigger in got else len(got)]) & special
        assert tokens_of(together[0])[:at + 1] == ids[:at + 1] and together[0][-1].finish_reason == "stop"
    finally:
        engine.shutdown()
