"""The Engine's handling of hung and failed steps, split out of engine.py: a mixin of Engine's methods.

The watchdog (watchdog.py) calls `_on_step_overdue` when a step passes its limit (its requests end with
finish_reason "error" at once) and `_on_step_lost` when the step never comes back (a fatal error). The
step thread runs each step through `_attempt`, which lets only the error's text out (the traceback's frames
hold the backend and its pools), then `_after_failed_step`: a step that raised where one request's sampling
cannot be built (sampling.sampling_fault) ends that request only, and the others go on with the same
backend (`_isolate`); otherwise `_recover` drops the old backend (collected before the new one is
allocated: a pool can be most of the GPU), rebuilds it, the KV cache and scheduler from the weights on the
device, and the other requests recompute and go on; a rebuild that fails or hangs is fatal. A fatal error
ends every request, present and future, with its message, shows in stats() and is passed to the fatal
listeners (the server: /health, non-zero exit).
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from northcode.engine.pipeline import IN_FLIGHT
from northcode.engine.sampling import SamplingRow, sampling_fault
from northcode.engine.scheduler import Sequence, StepPlan

if TYPE_CHECKING:
    from northcode.engine.engine import _Request

log = logging.getLogger("northcode.engine.engine")
RESTART = "backend restart"  # what the watchdog watches while the backend is rebuilt


class StepAbandoned(Exception):
    """The watchdog gave the step up while it ran; its results are dropped and the backend restarted."""


def step_shapes(plan: StepPlan, page_size: int, max_pages_per_seq: int) -> set[tuple]:
    """What makes a step's first run slow: a prefill at all, and a decode's batch and context buckets
    (the torch backend captures one CUDA graph per pair; the megakernel builds task lists per pair)."""
    from northcode.torch_backend.backend import context_bucket, next_power_of_two

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


class StepRecovery:
    """Engine methods (engine.py owns every attribute they use)."""

    def _attempt(self, work: Callable[[], None]) -> str | None:
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

    def _after_failed_step(self, failure: str) -> None:
        """Step thread, after _attempt(step) failed (failure "": given up by the watchdog): isolate the
        request that caused it when one did, else restart the backend."""
        if failure and self._isolate(failure):
            return
        if self.fatal_error is None:
            self._recover(failure or None)

    def _isolate(self, error: str) -> bool:
        """End the requests of the failed step whose own sampling cannot be built (fault_of) and keep the
        backend: read the step in flight (a failed launch may leave nothing to carry from), and the next step
        redoes the others' work (the same positions and tokens: its KV writes are idempotent). False when no
        request is to blame or that read fails; then the backend must be restarted."""
        faults = [(seq, fault) for seq in dict.fromkeys(self._in_step)
                  if (fault := fault_of(seq, self.config.vocab_size)) is not None]
        if not faults:
            return False
        for seq, fault in faults:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                log.error("engine: request %s ended: its sampling cannot be built (%s)", seq.request_id, fault)
                self._finish(request, "error", None, error=f"this request's sampling could not be built ({fault}); "
                                                             "it was ended and the other requests went on")
        self._in_step = []
        return self._launched is None or self._attempt(self._drain) is None

    def _on_step_overdue(self, what: str, limit_s: float) -> None:
        """Watchdog thread, while the step thread is blocked in the step: end the step's requests now."""
        if what == RESTART:
            self._declare_fatal(f"restarting the {self.backend_choice.name} backend did not finish within "
                                f"{limit_s:g} s; restart the server")
            return
        message = (f"the engine's {what} did not finish within {limit_s:g} s (a hung or runaway kernel?); "
                   f"the request was ended and the {self.backend_choice.name} backend is being restarted")
        log.error(message)
        self._publish_stats(status="restarting")  # before the errors: a client that saw one sees the status
        for seq in self._in_step:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                self._end_early(request, message)

    def _on_step_lost(self, what: str, waited_s: float) -> None:
        """Watchdog thread: the step never came back. The GPU (or its context) is presumed unusable."""
        self._declare_fatal(f"the device stopped responding: the engine's {what} has not returned after "
                            f"{waited_s:.0f} s, so the GPU or its CUDA context is presumed unusable; "
                            "restart the server")

    def _end_early(self, request: _Request, message: str) -> None:
        """Send a request's final error output from a thread other than the step thread (which then drops it)."""
        request.ended = True
        with self._lock:
            self._ids.discard(request.sequence.request_id)
        request.emit(self._final_output(request, "error", message))

    def _declare_fatal(self, message: str) -> None:
        """Any thread: nothing can run any more. Every request, present and future, ends with `message`."""
        with self._lock:
            if self.fatal_error is not None:
                return
            self.fatal_error = message
            inbox, self._inbox = self._inbox, []
            listeners, self._fatal_listeners = self._fatal_listeners, []
            self._lock.notify_all()
        log.critical("engine: %s", message)
        self._publish_stats(status="failed")
        for callback in listeners:  # first: the server reports the failure before its clients see it
            try:
                callback(message)
            except Exception:
                log.exception("fatal-error listener failed")
        for request in inbox + [r for r in list(self._requests.values()) if not r.ended]:
            self._end_early(request, message)

    def _recover(self, error: str | None) -> None:
        """After a hung (error None: its requests were already ended) or failed step: end the step's
        requests, then rebuild the KV cache, scheduler and backend from the weights on the device; every
        other request is kept, recomputes what it had, and goes on. A restart that fails is fatal."""
        for seq in self._in_step:
            request = self._requests.get(seq.request_id)
            if request is not None and not request.ended:
                self._finish(request, "error", None, error=error)
        self._in_step, self._launched = [], None  # a launched step's tokens are lost with its backend
        for request_id in [i for i, r in self._requests.items() if r.ended]:
            del self._requests[request_id]
        survivors = sorted((r.sequence for r in self._requests.values()), key=lambda s: s.arrival)
        self._publish_stats(status="restarting")
        self.backend = None  # drop the old pools and graphs before allocating new ones
        self.kv, self.scheduler = self._fresh_cache()
        self._shapes_seen = set()
        if self._watchdog is not None:
            self._watchdog.begin(max(self.settings.step_timeout_s, self.settings.first_step_timeout_s),
                                 RESTART)
        try:
            gc.collect()
            if self._weights["model.embed_tokens.weight"].is_cuda:
                torch.cuda.synchronize()  # a sticky CUDA error (the context is unusable) shows here: fatal
                torch.cuda.empty_cache()
            backend = self._build_backend()
        except Exception as err:
            log.exception("engine: restarting the backend failed")
            backend, why = None, f"{type(err).__name__}: {err}"
        if self._watchdog is not None and self._watchdog.end():
            return  # the restart overran its limit: _on_step_overdue declared the engine failed
        if backend is None:
            self._declare_fatal(f"the model backend could not be restarted after a failed step ({why}); "
                                "restart the server")
            return
        self.backend = backend
        self.restarts += 1
        for seq in survivors:
            self.scheduler.take_back(seq)
        log.warning("engine: %s backend restarted (restart %d); %d requests kept", self.backend_choice.name,
                    self.restarts, len(survivors))
