"""StepGuard: the mechanics of a step that may hang or fail; the engine decides what a failure ends.

Every model step runs through `StepGuard.run(work, shapes, plan)`: under the step watchdog (watchdog.py), with
the long limit (first_step_timeout_s) for a shape not run since the backend was built (it may capture a
graph or compile) and step_timeout_s otherwise; StepAbandoned when the watchdog gave it up, its own error when
it raised. `attempt` runs a whole step and lets only the error's text out (the traceback's frames hold the
backend and its pools). `rebuild` drops nothing itself: the engine has let go of the old backend; it collects
it (a pool can be most of the GPU), checks the device and builds the new one under the restart limit.
The pure helpers: `step_shapes` (what makes a step's first run slow), `describe_step` (the watchdog's
words), `fault_of` (whether one sequence's sampling can be built at all: sampling.sampling_fault).
The watchdog holds the engine's callbacks; `close` lets go of it, which breaks that reference cycle.
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable

import torch

from northcode.engine.backend import ModelBackend, context_bucket, next_power_of_two
from northcode.engine.pipeline import IN_FLIGHT
from northcode.engine.sampling import SamplingRow, sampling_fault
from northcode.engine.scheduler import StepPlan
from northcode.engine.sequence import Sequence
from northcode.engine.settings import EngineSettings
from northcode.engine.watchdog import StepWatchdog

log = logging.getLogger("northcode.engine.engine")
RESTART = "backend restart"  # what the watchdog watches while the backend is rebuilt


class StepAbandoned(Exception):
    """The watchdog gave the step up while it ran; its results are dropped and the backend restarted."""


def step_shapes(plan: StepPlan, page_size: int, max_pages_per_seq: int) -> set[tuple]:
    """What makes a step's first run slow: a prefill at all, and a decode's batch and context buckets
    (the torch backend captures one CUDA graph per pair; the megakernel builds task lists per pair)."""
    shapes = {("prefill",)} if plan.prefills else set()
    if plan.decodes:
        pages = -(-(max(s.num_computed for s in plan.decodes) + 1) // page_size)
        shapes.add(("decode", next_power_of_two(len(plan.decodes)), context_bucket(pages, max_pages_per_seq)))
    return shapes


def describe_step(plan: StepPlan) -> str:
    """The step in words, for the watchdog's messages."""
    parts = []
    if plan.decodes:
        parts.append(f"decode of {len(plan.decodes)} rows (up to {max(s.num_computed for s in plan.decodes) + 1} "
                     "tokens of context)")
    if plan.prefills:
        tokens = sum(c.end - c.start for c in plan.prefills)
        parts.append(f"prefill of {len(plan.prefills)} chunks ({tokens} tokens)")
    return "step (" + " and ".join(parts) + ")"


def fault_of(seq: Sequence, vocab_size: int) -> str | None:
    """Why this sequence's next sampling cannot be built (its draw number counts a token in flight), or None."""
    history = seq.output_ids + [IN_FLIGHT] * seq.in_flight  # len(history) is the draw number
    return sampling_fault(SamplingRow(seq.params, seq.seed, seq.prompt_ids, history), vocab_size)


def attempt(work: Callable[[], None]) -> str | None:
    """work(); None when it returned, "" when the watchdog gave it up (its requests are ended), else the
    error in words (logged with its traceback as text: a log record must not keep the frames alive)."""
    try:
        work()
    except StepAbandoned:
        return ""
    except Exception as err:
        log.error("engine step failed: %s", "".join(traceback.format_exception(err)).rstrip())
        return f"{type(err).__name__}: {err}"
    return None


class StepGuard:
    """The step watchdog, the limits it applies, and the step shapes run since the backend was built."""

    def __init__(self, settings: EngineSettings, on_overdue: Callable[[str, float], None],
                 on_lost: Callable[[str, float], None]) -> None:
        self.step_timeout_s, self.first_step_timeout_s = settings.step_timeout_s, settings.first_step_timeout_s
        self.watchdog: StepWatchdog | None = None
        if settings.step_timeout_s is not None:
            self.watchdog = StepWatchdog(on_overdue, on_lost, settings.hang_grace_s)
        self.shapes_seen: set[tuple] = set()

    def run(self, work: Callable[[], object], shapes: set[tuple], plan: StepPlan | None):
        """work() under the step watchdog (the long limit for a shape not run before); StepAbandoned when
        the watchdog gave it up, its exception when it raised."""
        limit = self.step_timeout_s
        if shapes - self.shapes_seen:  # a new shape may capture a graph or compile: the long limit
            limit = limit and max(limit, self.first_step_timeout_s)
        error = result = None
        watchdog = self.watchdog  # the one that watched the step, even if `close` let go of it meanwhile
        if watchdog is not None:
            what = describe_step(plan) if plan and not plan.is_empty else "read of the decode step in flight"
            watchdog.begin(limit, what)
        try:
            result = work()
        except Exception as err:
            error = err
        try:
            if watchdog is not None and watchdog.end():
                raise StepAbandoned
            if error is not None:
                raise error
        finally:
            error = None  # this frame is in the error's traceback: no cycle keeps the backend's frames alive
        self.shapes_seen |= shapes
        return result

    def rebuild(self, build: Callable[[], ModelBackend], on_device: bool) -> tuple[ModelBackend | None, str, bool]:
        """build() a new backend under the restart limit, after collecting the old one: (the backend or None,
        why it failed, whether the watchdog gave the rebuild up)."""
        self.shapes_seen = set()
        watchdog = self.watchdog
        if watchdog is not None:
            watchdog.begin(max(self.step_timeout_s, self.first_step_timeout_s), RESTART)
        backend, why = None, ""
        try:
            gc.collect()
            if on_device:
                torch.cuda.synchronize()  # a sticky CUDA error (the context is unusable) shows here: fatal
                torch.cuda.empty_cache()
            backend = build()
        except Exception as err:
            log.exception("engine: restarting the backend failed")
            why = f"{type(err).__name__}: {err}"
        given_up = watchdog is not None and watchdog.end()
        return backend, why, given_up

    def close(self) -> None:
        """Stop the watchdog and let go of it (it holds the engine's callbacks)."""
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
