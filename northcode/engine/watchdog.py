"""StepWatchdog: a thread that notices a model step that does not finish, since the step cannot notice it itself.

A wedged CUDA kernel blocks the host thread that waits for it (in a synchronize, a .tolist(), an event
wait) and nothing in Python can interrupt that wait. So the engine's step thread only brackets each step
with `begin(limit_s, what)` / `end()`, and this thread, which never touches the device, watches the clock:

  - the step passes its limit: `on_overdue(what, limit_s)` runs here (the engine ends the step's requests
    with an error at once, so no client waits on a frozen step); when the step thread comes back, `end()`
    returns True and the engine discards the step's results and restarts its backend;
  - the step is still not back `grace_s` after that: `on_lost(what, waited_s)` runs here (the engine's
    fatal error: the device or its context is presumably unusable, every request fails, /health says so
    and the server should exit non-zero for its supervisor to restart it).

The callbacks run while the step thread is blocked in the step, and `end()` waits for a callback that is
running, so the step thread never sees half of one. Callbacks must not wait for the step thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 5.0  # close() waits this long at most for the thread (a callback running then finishes first)


class StepWatchdog:
    def __init__(self, on_overdue: Callable[[str, float], None], on_lost: Callable[[str, float], None],
                 grace_s: float) -> None:
        self.on_overdue, self.on_lost, self.grace_s = on_overdue, on_lost, grace_s
        self._cond = threading.Condition()
        self._what: str | None = None  # the step being watched; None: none
        self._limit_s = 0.0
        self._started = 0.0
        self._fired = False  # on_overdue ran for the current step
        self._lost = False  # on_lost ran (at most once in the watchdog's life)
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="northcode-step-watchdog", daemon=True)
        self._thread.start()

    def begin(self, limit_s: float, what: str) -> None:
        """The step thread starts a step that should finish within limit_s seconds."""
        with self._cond:
            self._what, self._limit_s, self._started, self._fired = what, limit_s, time.monotonic(), False
            self._cond.notify_all()

    def end(self) -> bool:
        """The step thread is back; True when the watchdog gave the step up (its results must be dropped)."""
        with self._cond:
            fired = self._fired or self._lost
            self._what, self._fired = None, False
            self._cond.notify_all()
            return fired

    @property
    def lost(self) -> bool:
        return self._lost

    def close(self) -> None:
        """Stop watching; the thread is gone when this returns (unless called from it, or a callback is stuck)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _watch(self) -> None:
        with self._cond:
            while not self._closed and not self._lost:
                if self._what is None:
                    self._cond.wait()
                    continue
                elapsed = time.monotonic() - self._started
                if not self._fired:
                    if elapsed < self._limit_s:
                        self._cond.wait(self._limit_s - elapsed)
                        continue
                    self._fired = True
                    self._call(self.on_overdue, self._what, self._limit_s)
                    continue
                if elapsed < self._limit_s + self.grace_s:
                    self._cond.wait(self._limit_s + self.grace_s - elapsed)
                    continue
                self._lost = True
                self._call(self.on_lost, self._what, elapsed)

    @staticmethod
    def _call(callback: Callable[[str, float], None], what: str, seconds: float) -> None:
        try:
            callback(what, seconds)
        except Exception:  # a failing callback must not kill the watchdog
            log.exception("step watchdog callback failed")
