"""MegakernelBackend: engine/backend.py's protocol as torch prefill plus kernel decode over one set of block tables.

mini-sglang's HybridBackend(prefill, decode), said out loud: `prefiller`, a TorchBackend without graphs or
compile, owns the KV pools and the device block tables and runs every prefill; `kernel` (kernel.py) decodes
over the same pools and the same tables, which each step uploads once (`tables.upload`, a no-op when their
version did not move) before its launches. Nothing else of the TorchBackend is touched after construction.
A step of B rows is ceil(B / 8) kernel launches on one stream; each copies its sampled tokens out of the
kernel's io buffer (the next launch overwrites it) into the step's device int32 [B + 4]: tokens, then the
kernel's sticky status words. `launch_decode` feeds carried rows from the previous step's tensor (one gather
on the device), or leaves them in the io buffer when rows 0..B-1 of a one-launch step go on in place; the
tensor goes to pinned memory without a wait, and `result()` waits on an event, then raises on a failed status.
`decode` is the same launches fed from the host (plus logits for the engine's Sampler), then the same wait.
Constrained rows (a request with a grammar) point at a mask slot in mapped host memory (kernel.MaskSlots):
the step is launched first, then its token masks are asked for (`batch.masks()`: in the pipelined step that
reads the previous step's tokens, then llguidance computes the masks while the device runs this one) and
each slot is written and released; the kernel's SAMPLE of such a row waits for its slot (armed masks
included: it compares the token the row fed with the trigger), so the logits returned are masked too. A
dormant grammar that bans markers gives its slot a dormant rule (its trigger), which the kernel applies with
the text mask in device memory (`batch.text_mask`, uploaded before the first launch that may need it, once). A
failure on the host still releases every slot, unconstrained, so the step never waits for its timeout.
Slots go in two turns of max_batch: a step's slots are rewritten two steps later, once that step is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from northcode.config import ModelConfig
from northcode.engine.backend import DecodeBatch, DecodeResult, PrefillBatch, check_launch
from northcode.engine.device import PendingTokens, carried_tokens, to_device
from northcode.engine.sampling import ALWAYS, NEVER, NO_DORMANT_RULE, TokenMasks
from northcode.megakernel.kernel import MAX_BATCH, PAGE_SIZE, Megakernel, RowSpec, raise_for_status
from northcode.megakernel.support import gpu_blocker, model_blocker
from northcode.megakernel.tasks import split_contexts
from northcode.torch_backend.backend import TorchBackend

KernelFactory = Callable[[TorchBackend], Megakernel]  # the kernel over the prefiller's pools and block tables


def unavailable_reason(config: ModelConfig, page_size: int, needs_hopper: bool = True) -> str | None:
    """Why the megakernel backend cannot run this model here, or None (support.py's rules; the weights' dtype
    is checked by Megakernel itself)."""
    reason = model_blocker(config, page_size)
    if reason is None and needs_hopper:
        if not torch.cuda.is_available():
            return "it needs a Hopper GPU (sm_90), and no CUDA GPU is visible"
        gpu = gpu_blocker(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
        reason = gpu and f"it needs a Hopper GPU (sm_90): {gpu}"
    return reason


def row_spec(batch: DecodeBatch, b: int, mask: int = 0, mask_seq: int = -1) -> RowSpec:
    """The kernel's row state of batch row b: its position and block-table row, how to sample it, and its mask
    slot (a device address, 0: none) with the step's number that slot is released as."""
    if not batch.sample:
        return RowSpec(position=batch.positions[b], seq=batch.rows[b], mask=mask, mask_seq=mask_seq)
    args = batch.sampling
    params = args.params[b]
    return RowSpec(position=batch.positions[b], seq=batch.rows[b], step=args.draws[b], seed=args.seeds[b],
                   temperature=0.0 if params.is_greedy else params.temperature, top_k=params.top_k,
                   top_p=params.top_p, min_p=params.min_p, mask=mask, mask_seq=mask_seq)


def constrained_rows(batch: DecodeBatch) -> list[int]:
    """The rows that may get a token mask this step: their request has a grammar (active or dormant)."""
    if batch.token_masks is None:
        return []
    return [b for b, params in enumerate(batch.sampling.params) if params.grammar is not None]


@dataclass(slots=True)
class _Carried:
    tokens: torch.Tensor  # device int32 [B_prev]: what the last launch sampled (what carry indexes)
    in_io: bool  # they are also still in the kernel's io buffer, rows 0..B_prev-1 (one launch, none since)


class LaunchedKernelStep(PendingTokens):
    """engine/backend.py's PendingDecode of one step: its tokens and status on their way to the host."""

    def __init__(self, out: torch.Tensor, num_rows: int, kernel: Megakernel) -> None:
        """out: device int32 [num_rows + status words], written by kernels enqueued and maybe not yet run."""
        super().__init__(out)
        self._num_rows, self._kernel = num_rows, kernel

    def result(self) -> DecodeResult:
        """The tokens once copied, or RuntimeError when the kernel reported a failure."""
        values = self.host_values()
        raise_for_status(values[self._num_rows:], self._kernel)
        return DecodeResult(values[:self._num_rows], None)


class MegakernelBackend:
    """Torch prefill plus kernel decode (8 rows per launch) over one set of pools and block tables. Samples
    every row on the device; returns logits for the engine's Sampler when asked. kernel_factory (tests):
    builds the kernel instead of Megakernel, on any device."""

    name = "megakernel"

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], num_pages: int, page_size: int,
                 max_batch: int, max_pages_per_seq: int, cuda_graphs: bool = True,
                 kernel_factory: KernelFactory | None = None) -> None:
        """cuda_graphs is not used: a decode step is ceil(B / 8) kernel launches, and prefill runs eagerly."""
        reason = unavailable_reason(config, page_size, needs_hopper=kernel_factory is None)
        if reason:
            raise ValueError(f"engine setting backend = 'megakernel': {reason}")
        self.config, self.max_batch, self.max_pages_per_seq = config, max_batch, max_pages_per_seq
        self.prefiller = TorchBackend(config, weights, num_pages, page_size, max_batch, max_pages_per_seq,
                                      cuda_graphs=False, compile=False)  # prefill only: no decode step to graph or compile
        # the one set both halves use: the prefiller's pools and device block tables
        self.k_pool, self.v_pool, self.tables = self.prefiller.k_pool, self.prefiller.v_pool, self.prefiller.device_tables
        self.device = self.k_pool.device
        launches = -(-max_batch // MAX_BATCH)  # per step; two steps may be queued (the pipeline)
        self.kernel = (kernel_factory(self.prefiller) if kernel_factory is not None
                       else Megakernel(config, weights, self.k_pool, self.v_pool, self.tables.tables,
                                       row_buffers=max(8, 2 * launches), mask_slots=2 * max_batch))
        self._carried: _Carried | None = None  # the last launch_decode's tokens
        self._num_steps = 0  # steps launched: the next one's number is what its mask slots are released as
        self._turn_done: list[torch.cuda.Event | None] = [None, None]  # the last step that used each turn's slots
        self._text_mask: torch.Tensor | None = None  # the host text mask the kernel holds (DecodeBatch.text_mask)

    def prefill(self, batch: PrefillBatch) -> torch.Tensor:
        return self.prefiller.prefill(batch)

    def warm_up(self) -> None:
        """Before serving: on a GPU, the prefiller's chunk lengths once (TorchBackend.warm_up_prefill: a short
        turn's kernels load now, not in its TTFT); every task list a step can need (launch sizes 1..8, one per
        split bucket up to the longest sequence: a few dozen, ~10 ms each), so no step waits for one."""
        self.prefiller.warm_up()  # without graphs or compile: its prefill chunk lengths only (on a GPU)
        longest = self.max_pages_per_seq * PAGE_SIZE - 1
        for rows in range(1, min(self.max_batch, MAX_BATCH) + 1):
            for context in split_contexts(self.config, rows, self.kernel.num_blocks, longest):
                self.kernel.schedule(rows, context)

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch) -> DecodeResult:
        """One step fed from the host; waits for it. Logits [B, V] fp32 when asked (copied per launch)."""
        self._carried = None  # the io buffer now holds this step's tokens: a later launch carries nothing
        inputs = to_device(torch.tensor(batch.token_ids, dtype=torch.int32), self.device)  # [B]
        out, logits = self.launch_step(batch, inputs, batch.return_logits)
        tokens = LaunchedKernelStep(out, len(batch.rows), self.kernel).result().token_ids
        return DecodeResult(tokens if batch.sample else None, logits)

    @torch.inference_mode()
    def launch_decode(self, batch: DecodeBatch, carry: list[int]) -> LaunchedKernelStep:
        """Enqueue one step and return without reading the device. carry[b] >= 0: row b feeds the token that
        row carry[b] of the previous launch sampled."""
        previous = self._carried
        check_launch(batch, carry, None if previous is None else previous.tokens.shape[0])
        inputs = None  # every row feeds the token the kernel left in its io buffer
        if not self._goes_on_in_place(carry):
            inputs = carried_tokens(batch.token_ids, carry, None if previous is None else previous.tokens,
                                    self.device)  # device long [B]
        num_rows = len(batch.rows)
        self._carried = None  # until this launch is enqueued whole (a launch that raises leaves nothing to carry)
        out, _ = self.launch_step(batch, inputs, want_logits=False)
        self._carried = _Carried(out[:num_rows], in_io=num_rows <= MAX_BATCH)
        return LaunchedKernelStep(out, num_rows, self.kernel)

    def _goes_on_in_place(self, carry: list[int]) -> bool:
        """Row b feeds what row b of the previous launch sampled, for every row of a one-launch step whose
        previous step was one launch too: those tokens are still in the kernel's io buffer."""
        previous = self._carried
        return (previous is not None and previous.in_io and len(carry) <= MAX_BATCH
                and carry == list(range(len(carry))))

    def launch_step(self, batch: DecodeBatch, inputs: torch.Tensor | None,
                    want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch the step, MAX_BATCH rows at a time, on the current stream; nothing waits. inputs: device
        [B] token ids, or None to feed rows 0..B-1 (B <= 8) what the kernel's io buffer holds. Returns the
        device int32 [B + status words] tokens-and-status, and the logits [B, V] fp32 when asked. The model
        step of both decode and launch_decode: where tests inject hangs and failures."""
        num_rows, kernel = len(batch.rows), self.kernel
        assert num_rows > 0 and (inputs is not None or num_rows <= MAX_BATCH), "nothing to feed the launch"
        slots, seq = self._mask_slots(batch)
        specs = [row_spec(batch, b, kernel.mask_address(slots[b]), seq) if b in slots else row_spec(batch, b)
                 for b in range(num_rows)]
        self.tables.upload(batch.block_tables, batch.tables_version, batch.tables_columns)
        if batch.text_mask is not None and batch.text_mask is not self._text_mask:  # static: once per backend
            kernel.set_text_mask(batch.text_mask)
            self._text_mask = batch.text_mask
        status = kernel.io[MAX_BATCH:]
        out = torch.empty(num_rows + status.numel(), dtype=torch.int32, device=self.device)
        logits = torch.empty(num_rows, self.config.vocab_size, device=self.device) if want_logits else None
        chunks = [(start, min(num_rows, start + MAX_BATCH)) for start in range(0, num_rows, MAX_BATCH)]
        for start, end in chunks:  # built before the first launch: nothing below may wait for the device
            kernel.schedule(end - start, max(r.position for r in specs[start:end]))
        launched = False
        try:
            for start, end in chunks:
                kernel.step(specs[start:end], None if inputs is None else inputs[start:end])
                kernel.collect(out[start:end], None if logits is None else logits[start:end])  # before the next launch
            out[num_rows:].copy_(status)
            launched = True
        finally:  # a launch that raised leaves the ones before it to finish, unconstrained
            if slots:
                self._release_masks(batch.masks if launched else None, slots, seq)
        return out, logits

    def _mask_slots(self, batch: DecodeBatch) -> tuple[dict[int, int], int]:
        """{row: its mask slot} for the rows that may be constrained, and the step's number (what the slots are
        released as). The slots are the turn the step two back used: waited for here, before any launch (done
        already when the engine has read that step, as it has by now)."""
        self._num_steps += 1
        rows = constrained_rows(batch)
        turn = self._num_steps % 2
        if rows and self._turn_done[turn] is not None:
            self._turn_done[turn].synchronize()
        return {b: turn * self.max_batch + b for b in rows}, self._num_steps % 2**31

    def _release_masks(self, masks_of: Callable[[], TokenMasks | None] | None, slots: dict[int, int],
                       seq: int) -> None:
        """After the step's launches: ask for its masks (batch.masks: they may wait for the previous step's tokens)
        and release every slot of the step, with its mask or unconstrained (no mask for the row; no masks_of; or
        masks_of raised, and the error goes on once every slot is released)."""
        if self.device.type == "cuda":  # the slots of this turn are free again once the step is done
            self._turn_done[self._num_steps % 2] = torch.cuda.Event()
            self._turn_done[self._num_steps % 2].record()
        masks: TokenMasks | None = None
        try:
            masks = masks_of() if masks_of is not None else None
        finally:
            given = {} if masks is None else {b: k for k, b in enumerate(masks.rows)}
            for b, slot in slots.items():
                self._release(slot, seq, masks, given.get(b))
        assert masks is None or set(masks.rows) <= set(slots), "a mask for a row whose request has no grammar"
        assert masks is None or self._text_mask is not None or all(d == NO_DORMANT_RULE for d in masks.dormant), \
            "a dormant rule, and no text mask on the device (DecodeBatch.text_mask)"

    def _release(self, slot: int, seq: int, masks: TokenMasks | None, k: int | None) -> None:
        """Release one slot as step seq: with row k of masks (its words unless NEVER, its trigger and dormant
        rule), or, k None, with no mask."""
        if k is None:
            self.kernel.release_mask(slot, seq, None, ALWAYS)
            return
        trigger, dormant = masks.triggers[k], masks.dormant[k] if masks.dormant else NO_DORMANT_RULE
        self.kernel.release_mask(slot, seq, None if trigger == NEVER else masks.bits[k], trigger, dormant)
