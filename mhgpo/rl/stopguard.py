"""Stopping a training run cleanly: SIGINT and SIGTERM become a KeyboardInterrupt where nothing is half-done.

A step's first phase (rollouts) may be cut anywhere: the trainer rewinds it. From the first weight change on, the
step is finished (logged, saved) before the run stops. Several ranks (`deferred`) stop together: the signal is only
noted, and the trainer asks every rank at its sync points whether any was signalled.
"""

from __future__ import annotations

import signal
import time
from typing import Any

SAME_REQUEST_S = 2.0  # several ranks: signals this close to the first are the same request to stop


class StopGuard:
    """SIGINT/SIGTERM raise KeyboardInterrupt, except inside `critical()` where they wait for its end. `deferred`
    (several ranks): a signal never raises by itself, it is noted (`pending`) and the ranks stop together where the
    trainer asks them all (after the rollouts' gather, at the step's end); a second one aborts this rank."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self.depth = 0
        self.pending = False
        self.aborted = False  # a second signal inside a critical section: stop at once, save nothing
        self._first = 0.0  # when the pending signal came (deferred)
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopGuard:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.deferred:
            now = time.monotonic()
            if self.pending and now - self._first < SAME_REQUEST_S:
                return  # a terminal's Ctrl-C reaches each rank directly and again through the launcher
            if not self.pending:
                self.pending, self._first = True, now
                print(
                    "\nmhgpo: stopping every rank at the end of this phase (again to abort without saving)", flush=True
                )
                return
            self.aborted = True
            raise KeyboardInterrupt
        if self.depth > 0 and not self.pending:
            self.pending = True
            print("\nmhgpo: stopping after this update (Ctrl-C again to abort without saving)", flush=True)
            return
        self.aborted = self.depth > 0
        raise KeyboardInterrupt

    def critical(self) -> Critical:
        return Critical(self)


class Critical:
    def __init__(self, guard: StopGuard) -> None:
        self.guard = guard

    def __enter__(self) -> None:
        self.guard.depth += 1

    def __exit__(self, *exc: Any) -> None:
        self.guard.depth -= 1
        if self.guard.depth == 0 and self.guard.pending and exc[0] is None and not self.guard.deferred:
            raise KeyboardInterrupt
