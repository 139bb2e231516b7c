"""MegakernelBackend's bookkeeping on the CPU (megakernel/backend.py), over FakeMegakernel: the kernel's Python
interface (step, io, tokens, logits, schedule; sticky status) computed by the torch decode step on the shared
pools and sampled by engine/sampling.sample_on_device, so its tokens are TorchBackend's. What this checks: rows
cut into launches of 8, carried tokens (gathered, or left in the io buffer), rows that join, leave and
reorder, draw numbers, logits for the engine's Sampler, status failures raised when a step is read, late token
masks (asked for after the step's launches, each mask slot released then; a failure on the host releases them
all; dormant rules over the text mask, uploaded once), and the Engine pipelining over it with the torch
engine's outputs. The real kernel:
tests/gpu/test_megakernel_backend_gpu.py and tests/gpu/test_megakernel_masked_sampling.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest
import torch

from northcode.engine.engine import Engine
from northcode.engine.kv_cache import KVCacheManager
from northcode.engine.pipeline import IN_FLIGHT
from northcode.engine.request import GrammarSpec, SamplingParams
from northcode.engine.sampling import (ALWAYS, NEVER, NO_DORMANT_RULE, BatchSamplingArgs, SamplingRow, TokenMasks,
                                      allowed_tokens, apply_token_masks, sample_on_device)
from northcode.engine.settings import EngineSettings
from northcode.megakernel.backend import MegakernelBackend
from northcode.megakernel.kernel import MAX_BATCH, PAGE_SIZE, RowSpec
from northcode.megakernel.tasks import attention_splits
from northcode.model.checkpoint import load_checkpoint
from northcode.model.tokenizer import Tokenizer
from northcode.torch_backend.backend import TorchBackend
from tests.test_engine import greedy, prompt_of, run, tokens_of
from tests.test_torch_backend import SAMPLING, host_fed_batch, launch_batch, prefill

ROWS, MAX_PAGES, NUM_PAGES = 11, 8, 120  # 11 rows: steps of two launches (8 + 3)


SLOT_BASE, SLOT_BYTES = 1 << 40, 1 << 16  # the fake's mask slot addresses


class FakeMegakernel:
    """Megakernel's interface in torch on the CPU. Like the kernel: a launch holds 1..MAX_BATCH rows, feeds
    io[b] (the tokens given, else what io holds: the last launch's samples) and writes its samples there; a
    failure sets the sticky status (io[8:12]: code, detail, detail) and later launches compute nothing. A launch
    with a row that points at a mask slot samples once the host released that slot for the launch's step (as
    SAMPLE waits for it), masked by its words or its dormant rule (over the text mask uploaded before the launch,
    as the kernel reads it); until then it is pending, and it and the launches after it (one stream) write their
    tokens and logits, and fill what `collect` asked for, when it completes."""

    def __init__(self, prefiller: TorchBackend, fail_at: int | None = None, draw_salt: int = 0) -> None:
        self.backend, self.fail_at = prefiller, fail_at  # fail_at: the launch that reports a hang
        self.draw_salt = draw_salt  # not 0: draws differ from the Sampler's (the real kernel has its own noise)
        self.io = torch.zeros(MAX_BATCH + 4, dtype=torch.int32)
        self.logits = torch.zeros(MAX_BATCH, prefiller.config.vocab_size)
        self.launches: list[tuple[list[int], bool]] = []  # (block-table rows, fed from io) per launch
        self.rows: list[list[RowSpec]] = []  # the rows of each launch
        self.schedules: set[tuple[int, int]] = set()
        self.num_blocks = 132  # an H100/H200's SMs: what the task lists are built for
        self.slots: dict[int, tuple[int, torch.Tensor | None, int, int]] = {}  # slot -> (step, bits, trigger, dormant)
        self.text_masks: list[torch.Tensor] = []  # what set_text_mask uploaded, in order
        self.pending: list[dict] = []  # launches waiting for a mask slot (and those after them), in launch order
        self.late_releases = 0  # slots released while a launch that reads them was pending

    def mask_address(self, slot: int) -> int:
        return SLOT_BASE + slot * SLOT_BYTES

    def release_mask(self, slot: int, seq: int, bits: torch.Tensor | None, trigger: int,
                     dormant: int = NO_DORMANT_RULE) -> None:
        self.late_releases += any(r.mask == self.mask_address(slot) for launch in self.pending for r in launch["rows"])
        self.slots[slot] = (seq, None if bits is None else bits.clone(), trigger, dormant)
        self._complete()

    def set_text_mask(self, bits: torch.Tensor) -> None:
        self.text_masks.append(bits.clone())

    def collect(self, tokens: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        launch = self._last
        launch["out"].append((tokens, logits))
        if launch["done"]:
            self._copy_out(launch)

    @property
    def tokens(self) -> torch.Tensor:
        return self.io[:MAX_BATCH]

    def schedule(self, batch: int, context: int) -> None:
        self.schedules.add((batch, context))

    def step(self, rows: list[RowSpec], tokens: torch.Tensor | None = None) -> None:
        n, vocab = len(rows), self.logits.shape[1]
        assert 1 <= n <= MAX_BATCH, n
        assert tokens is not None or not self.pending, "fed from the io buffer while the launch before it waits"
        if tokens is not None:
            self.tokens[:n].copy_(tokens.to(torch.int32))
        self.launches.append(([r.seq for r in rows], tokens is None))
        self.rows.append(list(rows))
        inputs = self.tokens[:n].tolist()
        if len(self.launches) - 1 == self.fail_at:
            self._report(1, 7, 9)
        for b, token in enumerate(inputs):
            if not 0 <= token < vocab:
                self._report(4, b, token)
        self._last = launch = dict(rows=list(rows), inputs=inputs, logits=None, done=False, out=[],
                                   text=self.text_masks[-1] if self.text_masks else None)  # as Params holds it
        if self.io[MAX_BATCH] == 0:  # an aborted step skips its work
            positions = torch.tensor([r.position for r in rows])
            pages = -(-(max(r.position for r in rows) + 1) // PAGE_SIZE)
            launch["logits"] = self.backend.decode_step(torch.tensor(inputs), positions,
                                                        torch.tensor([r.seq for r in rows]), pages)
        self.pending.append(launch)
        self._complete()

    def _complete(self) -> None:
        """Sample the pending launches, in order, whose masked rows' slots are released for their step."""
        while self.pending and all(self._released(r) for r in self.pending[0]["rows"] if r.mask):
            self._sample(self.pending.pop(0))

    def _released(self, row: RowSpec) -> bool:
        slot = self.slots.get((row.mask - SLOT_BASE) // SLOT_BYTES)
        return slot is not None and slot[0] == row.mask_seq

    def _sample(self, launch: dict) -> None:
        rows, inputs, logits, n = launch["rows"], launch["inputs"], launch["logits"], len(launch["rows"])
        if logits is not None:
            for b, r in enumerate(rows):  # as the kernel's SAMPLE: a constrained row's forbidden logits at -inf
                if r.mask:
                    logits[b] = self._masked(logits[b:b + 1], self.slots[(r.mask - SLOT_BASE) // SLOT_BYTES],
                                             inputs[b], launch["text"])[0]
            sampling = BatchSamplingArgs.prepare(
                [SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p) for r in rows],
                [r.seed + self.draw_salt for r in rows], [r.step for r in rows])
            self.logits[:n] = logits
            self.tokens[:n] = sample_on_device(logits, sampling).to(torch.int32)
        launch["tokens"], launch["logits"], launch["done"] = self.tokens[:n].clone(), self.logits[:n].clone(), True
        self._copy_out(launch)

    @staticmethod
    def _masked(logits: torch.Tensor, slot: tuple, fed: int, text: torch.Tensor | None) -> torch.Tensor:
        """logits [1, V] as SAMPLE masks them with the slot: its words where they apply (no words: NEVER), else
        its dormant rule over the text mask (none uploaded: unconstrained, as the kernel's null check)."""
        _, bits, trigger, dormant = slot
        if text is None:
            dormant = NO_DORMANT_RULE
        words = bits if bits is not None else torch.zeros(-(-logits.shape[1] // 32), dtype=torch.int32)
        masks = TokenMasks((0,), words[None], (trigger if bits is not None else NEVER,), (dormant,), text)
        return apply_token_masks(logits, masks, torch.tensor([fed]))

    def _copy_out(self, launch: dict) -> None:
        for tokens, logits in launch["out"]:
            tokens.copy_(launch["tokens"][:tokens.shape[0]])
            if logits is not None:
                logits.copy_(launch["logits"][:logits.shape[0]])
        launch["out"] = []

    def _report(self, code: int, a: int, b: int) -> None:
        if self.io[MAX_BATCH] == 0:
            self.io[MAX_BATCH:MAX_BATCH + 3] = torch.tensor([code, a, b], dtype=torch.int32)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, dtype=torch.float32)


def fake_backend(config, weights, fail_at: int | None = None) -> MegakernelBackend:
    return MegakernelBackend(config, weights, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES,
                             kernel_factory=lambda prefiller: FakeMegakernel(prefiller, fail_at))


def prefilled(backend, config, prompts):
    kv = KVCacheManager(config, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES)
    for row, prompt in enumerate(prompts):
        prefill(kv, backend, row, prompt, 0, len(prompt) - 1)
    return kv


# row orders of consecutive steps: 8 rows, the same again (fed in place), rows 8-10 join (two launches), the
# same (gathered), the first four (gathered: the io buffer holds the second launch's rows), a reorder with
# rows back whose tokens the host read, three rows, the same three (in place), row 9 back, a reorder of two
ORDERS = [list(range(8)), list(range(8)), list(range(11)), list(range(11)), [0, 1, 2, 3], [10, *range(9)],
          [0, 1, 2], [0, 1, 2], [0, 1, 2, 9], [9, 0]]


def setup_rows(config):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 30, 64, 65, 100, 17, 128, 31, 40, 3, 70)]  # crossing pages and the window of 32
    params = [SAMPLING[r % len(SAMPLING)] for r in range(ROWS)]
    return prompts, lambda r, outputs: SamplingRow(params[r], 100 + r, prompts[r], outputs)


def decoded(backend, config) -> list[list[int]]:
    """Each row's tokens over ORDERS, every step fed from the host by decode."""
    prompts, sampling = setup_rows(config)
    kv = prefilled(backend, config, prompts)
    outputs: list[list[int]] = [[] for _ in range(ROWS)]
    for order in ORDERS:
        for r, token in zip(order, backend.decode(host_fed_batch(kv, order, prompts, outputs, sampling)).token_ids):
            outputs[r].append(token)
    return outputs


def launched(backend, config, launching=contextlib.nullcontext) -> list[list[int]]:
    """The same by launch_decode, pipelined as the engine does: launch n+1, then read n (each launch inside
    `launching()`: the GPU test refuses host syncs there)."""
    prompts, sampling = setup_rows(config)
    kv = prefilled(backend, config, prompts)
    read: list[list[int]] = [[] for _ in range(ROWS)]
    drawn = [0] * ROWS  # tokens sampled per row, read or not
    previous, pending = [], None
    for order in ORDERS + [None]:
        if order is not None:
            carry = [previous.index(r) if r in previous else -1 for r in order]
            fed = [-1 if c >= 0 else (prompts[r] + read[r])[-1] for r, c in zip(order, carry)]
            batch = launch_batch(kv, order, fed,
                                 [len(prompts[r]) + drawn[r] - 1 for r in order],
                                 [sampling(r, read[r] + [IN_FLIGHT] * (drawn[r] - len(read[r]))) for r in order])
            with launching():
                launch = backend.launch_decode(batch, carry)
        if pending is not None:
            for r, token in zip(previous, pending.result().token_ids):
                read[r].append(token)
        if order is not None:
            for r in order:
                drawn[r] += 1
            previous, pending = order, launch
    return read


def test_launches_carry_chunk_and_reorder_rows_as_host_fed_decode_and_the_torch_backend(tiny):
    config, weights = tiny
    reference = decoded(TorchBackend(config, weights, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES), config)
    host_fed = decoded(fake_backend(config, weights), config)
    backend = fake_backend(config, weights)
    pipelined = launched(backend, config)
    assert pipelined == host_fed == reference
    assert [len(o) for o in reference] == [sum(r in order for order in ORDERS) for r in range(ROWS)]
    assert any(len(set(o)) > 1 for o, p in zip(reference, SAMPLING * 2) if not p.is_greedy)
    sizes = [(len(rows), in_place) for rows, in_place in backend.kernel.launches]
    # steps 2 and 8 feed in place; 11-row steps are a launch of 8 and one of 3
    assert sizes == [(8, False), (8, True), (8, False), (3, False), (8, False), (3, False), (4, False), (8, False),
                     (2, False), (3, False), (3, True), (4, False), (2, False)]
    assert backend.kernel.launches[7][0] == [10, *range(7)] and backend.kernel.launches[8][0] == [7, 8]


def test_decode_returns_logits_of_every_launch_in_row_order(tiny):
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    results = []
    torch_backend = TorchBackend(config, weights, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES)
    for backend in (torch_backend, fake_backend(config, weights)):
        kv = prefilled(backend, config, prompts)
        order = [3, 10, 0, 9, 1, 8, 2, 7, 4, 6, 5]
        batch = launch_batch(kv, order, [prompts[r][-1] for r in order], [len(prompts[r]) - 1 for r in order],
                             [sampling(r, []) for r in order])
        batch.sample, batch.return_logits = False, True  # what the engine asks for penalties or logprobs
        results.append(backend.decode(batch))
    assert results[1].token_ids is None
    torch.testing.assert_close(results[1].logits, results[0].logits, rtol=1e-4, atol=1e-4)  # GEMMs of 8 vs 11 rows


def test_a_failed_status_raises_when_its_step_is_read_and_is_reset(tiny):
    config, weights = tiny
    backend = fake_backend(config, weights, fail_at=2)
    prompts, sampling = setup_rows(config)
    kv = prefilled(backend, config, prompts)
    greedy_row = SamplingRow(SamplingParams(temperature=0.0), 0, prompts[0], [])
    first = launch_batch(kv, [0], [prompts[0][-1]], [len(prompts[0]) - 1], [greedy_row])
    pending = [backend.launch_decode(first, [-1])]
    for step in range(1, 4):  # launch 2 fails (a hang); launch 3 runs after it, aborted
        row = SamplingRow(SamplingParams(temperature=0.0), 0, prompts[0], [IN_FLIGHT] * step)
        pending.append(backend.launch_decode(launch_batch(kv, [0], [-1], [len(prompts[0]) - 1 + step], [row]), [0]))
    assert len(pending[0].result().token_ids) == len(pending[1].result().token_ids) == 1
    with pytest.raises(RuntimeError, match=r"megakernel: step failed: a dependency wait timed out \(counter 7, "
                                           r"target 9\): the step hung"):
        pending[2].result()
    assert backend.kernel.io[MAX_BATCH:].tolist() == [0, 0, 0, 0]  # reset: later steps run
    vocab = config.vocab_size
    bad = launch_batch(kv, [1], [vocab + 5], [len(prompts[1]) - 1], [sampling(1, [])])
    with pytest.raises(RuntimeError, match=f"row 0: token id {vocab + 5} is outside the vocabulary"):
        backend.decode(bad)
    good = launch_batch(kv, [1], [prompts[1][-1]], [len(prompts[1]) - 1], [sampling(1, [])])
    assert len(backend.decode(good).token_ids) == 1


def test_launch_refuses_what_it_cannot_run(tiny):
    config, weights = tiny
    backend = fake_backend(config, weights)
    prompts, sampling = setup_rows(config)
    kv = prefilled(backend, config, prompts)
    row = SamplingRow(SamplingParams(temperature=0.0), 0, prompts[0], [])
    with pytest.raises(ValueError, match=r"carry\[0\] = 0, but the previous launch had 0 rows"):
        backend.launch_decode(launch_batch(kv, [0], [-1], [len(prompts[0]) - 1], [row]), [0])
    penalised = SamplingRow(SamplingParams(repetition_penalty=1.3), 0, prompts[0], [])
    with pytest.raises(ValueError, match="row 0 asks for penalties or logprobs"):
        backend.launch_decode(launch_batch(kv, [0], [5], [len(prompts[0]) - 1], [penalised]), [-1])
    backend.launch_decode(launch_batch(kv, [0], [5], [len(prompts[0]) - 1], [row]), [-1]).result()
    backend.decode(launch_batch(kv, [0], [6], [len(prompts[0])], [row]))  # host-fed: nothing left to carry
    with pytest.raises(ValueError, match="the previous launch had 0 rows"):
        backend.launch_decode(launch_batch(kv, [0], [-1], [len(prompts[0]) + 1], [row]), [0])
    assert not SamplingParams(logprobs=2).is_device_sampled and SamplingParams(top_p=0.5).is_device_sampled
    backend.warm_up()  # every launch size, one context per split bucket up to the longest sequence
    longest = MAX_PAGES * PAGE_SIZE - 1
    for b in range(1, MAX_BATCH + 1):
        built = {attention_splits(config, b, 132, c) for batch, c in backend.kernel.schedules if batch == b}
        assert built == {attention_splits(config, b, 132, c) for c in range(longest + 1)}


# --- late token masks ---

CONSTRAINED = {0: ALWAYS, 3: "fed", 9: None}  # row -> its mask's trigger: always, armed with the token it feeds, none


def constrained_batch(kv, prompts, sampling, order=tuple(range(ROWS)), masks_of=None):
    """A host-fed step of `order` whose rows in CONSTRAINED have a grammar (so a mask slot) and get masks_of's
    masks; every other row is free."""
    rows = []
    for r in order:
        row = sampling(r, [])
        params = dataclasses.replace(row.params, grammar=GrammarSpec("start: /[a-z]+/")) if r in CONSTRAINED \
            else row.params
        rows.append(dataclasses.replace(row, params=params))
    batch = launch_batch(kv, list(order), [prompts[r][-1] for r in order], [len(prompts[r]) - 1 for r in order], rows)
    batch.token_masks = masks_of
    return batch


def step_masks(config, prompts) -> TokenMasks:
    """Random masks of rows 0 and 3 (token 0 always allowed); row 3's armed with the token it feeds."""
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(-2**31, 2**31 - 1, (2, -(-config.vocab_size // 32)), generator=gen, dtype=torch.int32)
    words[:, 0] |= 1
    return TokenMasks((0, 3), words, (ALWAYS, prompts[3][-1]))


def test_a_mask_is_asked_for_after_the_step_is_launched_and_the_kernel_samples_with_it(tiny):
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    masks = step_masks(config, prompts)
    torch_backend = TorchBackend(config, weights, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES)
    kv = prefilled(torch_backend, config, prompts)
    expected = torch_backend.decode(constrained_batch(kv, prompts, sampling, masks_of=lambda: masks)).token_ids
    backend = fake_backend(config, weights)
    kernel, asked = backend.kernel, []

    def late_masks():  # both launches of the step are enqueued, and wait for their rows' slots
        asked.append((len(kernel.launches), len(kernel.pending)))
        return masks

    kv = prefilled(backend, config, prompts)
    got = backend.launch_decode(constrained_batch(kv, prompts, sampling, masks_of=late_masks), [-1] * ROWS)
    assert asked == [(2, 2)] and got.result().token_ids == expected
    rows = kernel.rows[-2] + kernel.rows[-1]
    assert [b for b, r in enumerate(rows) if r.mask] == sorted(CONSTRAINED) and kernel.late_releases == 3
    assert {r.mask_seq for r in rows if r.mask} == {1} and all(r.mask_seq == -1 for r in rows if not r.mask)
    assert kernel.slots[ROWS + 9][1] is None  # step 1 takes the second turn; row 9: constrained, no mask this step
    allowed = allowed_tokens(masks.bits, config.vocab_size)
    assert allowed[0, expected[0]] and allowed[1, expected[3]]


def test_consecutive_steps_take_turns_of_mask_slots_with_their_own_numbers(tiny):
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    backend = fake_backend(config, weights)
    kv = prefilled(backend, config, prompts)
    masks = TokenMasks((0,), step_masks(config, prompts).bits[:1], (ALWAYS,))
    for _ in range(3):
        backend.decode(constrained_batch(kv, prompts, sampling, order=(0, 1), masks_of=lambda: masks))
    slots = [(rows[0].mask, rows[0].mask_seq) for rows in backend.kernel.rows]
    turn = [(SLOT_BASE + SLOT_BYTES * (ROWS * t), seq) for seq, t in ((1, 1), (2, 0), (3, 1))]
    assert slots == turn and backend.kernel.pending == []


def test_dormant_rules_mask_over_the_text_mask_uploaded_once_as_the_torch_backend_does(tiny):
    """Rows 0 and 3 dormant with a rule (the host knows row 0's token: NEVER; row 3 is armed and feeds another
    token than its trigger), row 9 armed and fed its trigger (its words): the torch backend's tokens, over three
    steps, with the text mask uploaded once, before the first launch."""
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    gen = torch.Generator().manual_seed(8)
    text = torch.randint(-2**31, 2**31 - 1, (-(-config.vocab_size // 32),), generator=gen, dtype=torch.int32)
    words = step_masks(config, prompts).bits
    triggers = (7, prompts[3][-1] + 1, prompts[9][-1])
    text[triggers[0] // 32] &= ~(1 << triggers[0] % 32)  # the rule's trigger only by the rule
    masks = TokenMasks((0, 3, 9), torch.stack([torch.zeros_like(words[0]), words[0], words[1]]),
                       (NEVER, triggers[1], triggers[2]), (triggers[0], triggers[1], NO_DORMANT_RULE), text)

    def batch_of(kv):
        batch = constrained_batch(kv, prompts, sampling, masks_of=lambda: masks)
        batch.text_mask = text
        return batch
    torch_backend = TorchBackend(config, weights, NUM_PAGES, PAGE_SIZE, ROWS, MAX_PAGES)
    expected = torch_backend.decode(batch_of(prefilled(torch_backend, config, prompts))).token_ids
    backend = fake_backend(config, weights)
    kv = prefilled(backend, config, prompts)
    got = [backend.decode(batch_of(kv)).token_ids for _ in range(3)]  # host-fed: the same step thrice
    assert got == [expected] * 3 and len(backend.kernel.text_masks) == 1
    assert torch.equal(backend.kernel.text_masks[0], text)
    allowed_text = allowed_tokens(text[None], config.vocab_size)[0]
    assert expected[0] == triggers[0] or allowed_text[expected[0]]
    assert allowed_text[expected[3]] and allowed_tokens(words[1:], config.vocab_size)[0, expected[9]]
    slots = {b: backend.kernel.slots[ROWS + b][1:] for b in (0, 3)}  # step 3 took the second turn
    assert slots[0][0] is None and slots[0][1:] == (NEVER, triggers[0]) and slots[3][2] == triggers[1]


def test_masks_that_raise_release_every_slot_unconstrained_and_the_error_goes_on(tiny):
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    backend = fake_backend(config, weights)
    kv = prefilled(backend, config, prompts)

    def broken():
        raise ValueError("the grammar broke")

    with pytest.raises(ValueError, match="the grammar broke"):
        backend.launch_decode(constrained_batch(kv, prompts, sampling, masks_of=broken), [-1] * ROWS)
    assert backend.kernel.pending == []  # the launches finished: nothing waits for its timeout
    assert {slot: (seq, bits) for slot, (seq, bits, _, _) in backend.kernel.slots.items()} == \
        {ROWS + b: (1, None) for b in CONSTRAINED}


def test_a_launch_that_raises_releases_the_slots_of_the_launches_before_it_without_asking(tiny, monkeypatch):
    config, weights = tiny
    prompts, sampling = setup_rows(config)
    backend = fake_backend(config, weights)
    kv = prefilled(backend, config, prompts)
    kernel, own = backend.kernel, backend.kernel.step

    def second_fails(rows, tokens=None):
        if len(kernel.launches) == 1:
            raise ValueError("megakernel: row position = 2147483648: must be in [0, 2^31)")
        own(rows, tokens)

    monkeypatch.setattr(kernel, "step", second_fails)
    with pytest.raises(ValueError, match="row position"):
        backend.launch_decode(constrained_batch(kv, prompts, sampling, masks_of=lambda: pytest.fail("asked")),
                              [-1] * ROWS)
    assert len(kernel.launches) == 1 and kernel.pending == [] and kernel.slots[ROWS][1] is None


# --- the Engine over it ---

# 1024 pages (64 MiB): all 12 rows can reach the tiny model's 4096 tokens; the CPU default's 2 GiB pool would stay
# resident for the module, twice
ENGINE_SETTINGS = dict(page_size=PAGE_SIZE, chunk_size=512, device="cpu", seed=0, max_batch=12, num_pages=1024)


def engine_over(checkpoint, build) -> Engine:
    config, weights = load_checkpoint(checkpoint, dtype=torch.float32)
    return Engine(config, weights, Tokenizer.from_dir(checkpoint), EngineSettings(**ENGINE_SETTINGS),
                  backend_factory=build)


def fake_kernel_engine(checkpoint, fail_first_at: int | None = None, draw_salt: int = 0) -> Engine:
    built = []

    def build(config, weights, s, num_pages, max_pages):
        fail_at = fail_first_at if not built else None
        built.append(MegakernelBackend(config, weights, num_pages, s.page_size, s.max_batch, max_pages,
                                       kernel_factory=lambda prefiller: FakeMegakernel(prefiller, fail_at,
                                                                                       draw_salt)))
        return built[-1]
    return engine_over(checkpoint, build)


def torch_engine(checkpoint) -> Engine:
    return engine_over(checkpoint, lambda config, weights, s, num_pages, max_pages: TorchBackend(
        config, weights, num_pages, s.page_size, s.max_batch, max_pages))


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    both = fake_kernel_engine(tiny_checkpoint), torch_engine(tiny_checkpoint)
    yield both
    for engine in both:
        engine.shutdown()


def outcome(outputs) -> tuple:
    return tokens_of(outputs), outputs[-1].finish_reason, outputs[-1].stop_reason


def requests_of_twelve():
    sampled = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=14, temperature=1.2, top_k=20, seed=6, ignore_eos=True)]
    greedy_lengths = [(3, 12), (10, 12), (17, 4), (30, 12), (41, 7), (55, 12), (64, 12), (90, 1), (99, 12), (130, 9)]
    return [(prompt_of(n, salt=3), greedy(m)) for n, m in greedy_lengths] + \
        [(prompt_of(20 + i, salt=4), p) for i, p in enumerate(sampled)]


def test_the_engine_pipelines_twelve_requests_over_the_kernel_with_the_torch_engines_outputs(engines):
    fake, reference = engines
    assert fake.backend.name == "megakernel" and fake._pipelined()
    requests = requests_of_twelve()
    backend, steps = fake.backend, []
    own = backend.launch_decode

    def counted(batch, carry):
        steps.append((len(carry), sum(c >= 0 for c in carry)))
        return own(batch, carry)

    backend.launch_decode, before = counted, len(backend.kernel.launches)
    try:
        got = run(fake, requests)
    finally:
        backend.launch_decode = own
    assert max(rows for rows, _ in steps) > MAX_BATCH and sum(carried for _, carried in steps) > 8 * len(steps) // 2
    assert any(in_place for _, in_place in backend.kernel.launches[before:])  # rows fed from the io buffer
    assert [outcome(o) for o in got] == [outcome(o) for o in run(reference, requests)]
    assert [outcome(o) for o in got] == [outcome(run(fake, [r])[0]) for r in requests]  # each alone
    assert fake.stats()["pages_used"] == 0 and fake.pipeline.launched is None


def test_penalties_and_logprobs_arriving_mid_stream_decode_through_the_engines_sampler(engines):
    fake, reference = engines
    requests = requests_of_twelve()[:6]
    late = [(prompt_of(9, salt=4), SamplingParams(max_tokens=8, temperature=0.8, seed=7, frequency_penalty=1.5,
                                                  ignore_eos=True)),
            (prompt_of(12, salt=5), greedy(6, logprobs=2))]

    async def staggered(engine):  # the late ones arrive while the others decode pipelined
        async def one(i, prompt, params):
            return [out async for out in engine.generate(f"s{i}-{id(params)}", prompt, params)]
        first = [asyncio.ensure_future(one(i, *r)) for i, r in enumerate(requests)]
        await asyncio.sleep(0.05)
        rest = await asyncio.gather(*[one(10 + i, *r) for i, r in enumerate(late)])
        return [await f for f in first] + list(rest)

    got, expected = asyncio.run(staggered(fake)), asyncio.run(staggered(reference))
    assert [tokens_of(o) for o in got] == [tokens_of(o) for o in expected]
    logprobs = [lp for out in got[-1] for lp in out.logprobs or []]
    assert len(logprobs) == 6 and all(len(lp.top) == 2 for lp in logprobs)
    assert fake.stats()["pages_used"] == 0


def test_a_kernel_failure_read_with_its_step_ends_those_requests_and_the_engine_restarts(tiny_checkpoint, engines):
    _, reference = engines
    engine = fake_kernel_engine(tiny_checkpoint, fail_first_at=6)
    try:
        requests = [(prompt_of(n, salt=8), greedy(16)) for n in (5, 25, 45, 65)]
        failed = run(engine, requests)
        assert all(o[-1].finish_reason == "error" for o in failed)
        assert "megakernel: step failed: a dependency wait timed out" in failed[0][-1].error
        for _ in range(3000):  # the errors go out before the backend is rebuilt (gc, then a new backend)
            if engine.stats()["restarts"] == 1:
                break
            time.sleep(0.01)
        assert engine.stats()["restarts"] == 1 and engine.backend.name == "megakernel"
        assert [outcome(o) for o in run(engine, requests)] == [outcome(o) for o in run(reference, requests)]
        assert engine.stats()["pages_used"] == 0
    finally:
        engine.shutdown()


def test_a_seeded_request_draws_the_same_tokens_beside_a_penalised_one_as_alone(tiny_checkpoint):
    """Issue 3: the same seed gives the same tokens whatever else is in the batch. A penalised request is
    sampled by the engine's Sampler; the kernel must still sample the seeded one (its draws differ here)."""
    engine = fake_kernel_engine(tiny_checkpoint, draw_salt=1)
    try:
        seeded = (prompt_of(20, salt=6), SamplingParams(max_tokens=12, temperature=1.2, seed=5, ignore_eos=True))
        penalised = (prompt_of(24, salt=7), SamplingParams(max_tokens=12, temperature=0.8, seed=9,
                                                           frequency_penalty=1.5, ignore_eos=True))
        alone = tokens_of(run(engine, [seeded])[0])
        decodes = []
        own = engine.backend.decode

        def recorded(batch):
            decodes.append((len(batch.rows), batch.sample, batch.return_logits))
            return own(batch)

        engine.backend.decode = recorded
        together = run(engine, [seeded, penalised])
        assert tokens_of(together[0]) == alone
        assert (2, True, True) in decodes  # the steps they shared: the kernel sampled, logits came back
        assert len(set(alone)) > 1 and len(tokens_of(together[1])) == 12
        assert engine.stats()["pages_used"] == 0
    finally:
        engine.shutdown()


def test_constrained_rows_are_masked_by_the_kernel_as_by_the_torch_backend(engines):
    """JSON schemas and a grammar dormant until a token the rows write a few tokens in (its armed mask, read by
    the kernel against the token each row fed) beside free rows, twelve rows in two launches: the torch engine's
    tokens, and JSON that validates. And a sampled one that bans markers while dormant (its dormant rule, over the
    text mask): the torch engine's tokens, no special token before its trigger."""
    import json

    import jsonschema

    from northcode.engine.grammar import DUMPS_STYLE, json_text
    from northcode.engine.request import GrammarSpec

    fake, reference = engines
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = f"%json {json_text({**schema, 'x-guidance': DUMPS_STYLE})}"
    free = requests_of_twelve()
    (trigger_prompt, trigger_params), = free[:1]
    trigger = tokens_of(run(reference, [(trigger_prompt, trigger_params)])[0])[2]
    constrained = [(prompt_of(7 + i, salt=9), SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 1.0, seed=i,
                                                               grammar=GrammarSpec(f"start: {body}"))) for i in range(5)]
    dormant = (trigger_prompt, SamplingParams(max_tokens=40, temperature=0.0,
                                              grammar=GrammarSpec(f"start: <[{trigger}]> {body}", trigger)))
    banning = (prompt_of(12, salt=9), SamplingParams(max_tokens=40, temperature=1.5, seed=3, grammar=GrammarSpec(
        f"start: <[{trigger}]> {body}", trigger, ban_while_dormant=True)))
    requests = constrained + [dormant] + free[6:-1] + [banning]
    late, pipelined = fake.backend.kernel.late_releases, fake._pipelined()
    got = run(fake, requests)
    assert pipelined and fake.backend.kernel.late_releases > late  # masks written while their steps waited
    assert [outcome(o) for o in got] == [outcome(o) for o in run(reference, requests)]
    tokenizer = fake.tokenizer
    for outputs in got[:5]:
        jsonschema.validate(json.loads(tokenizer.decode(tokens_of(outputs))), schema)
    after = tokens_of(got[5])
    jsonschema.validate(json.loads(tokenizer.decode(after[after.index(trigger) + 1:])), schema)
    held = tokens_of(got[-1])
    assert not set(held[:held.index(trigger) if trigger in held else len(held)]) & tokenizer.special_ids
    assert len(fake.backend.kernel.text_masks) == 1 and torch.equal(fake.backend.kernel.text_masks[0],
                                                                     fake.grammars.text_mask)
