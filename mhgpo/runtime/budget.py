"""A training run's time budget (`budget_minutes`, `budget_clock`): how long its RL steps may take.

The budget counts each completed step's rollouts and update (from the start of its rollouts to the end of its
update), on the process's CPU time (`budget_clock: cpu`, the default: a run sharing the machine with other work
gets as much training as one alone, only later) or on wall time (`wall`). Loading, the warm start, validations,
logging and checkpoints are not counted. A step starts only if the time used so far plus the mean step so far still
fits the budget, so the run stops before the first step that would overrun it; the first step always runs.

The time used and the steps timed are part of a checkpoint's state, so a resumed run goes on with the time it had
used: a run stopped by its budget stays stopped when resumed, unless `--resume` gives it more minutes
(`budget_minutes` is one of the keys a resume may change). The ranks of a data-parallel run each time their own
steps and stop together, when any of them is over its budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


@dataclass
class Budget:
    minutes: float | None  # None: no budget (the run trains `steps`)
    clock: str = "cpu"
    used: float = 0.0  # seconds of the clock spent by the completed steps, over every session of the run
    steps: int = 0  # the steps timed
    over: bool = False  # the next step would not fit (agreed by the ranks of a data-parallel run)

    def now(self) -> float:
        return CLOCKS[self.clock]()

    def spend(self, since: float, ranks: Any = None) -> None:
        """Count one completed step that started at `since` (a reading of :meth:`now`) and decide whether another
        fits; `ranks` (`mhgpo.model.distributed`): another fits only if it fits on every rank."""
        self.used += max(self.now() - since, 0.0)
        self.steps += 1
        self.over = not self._fits() if ranks is None else ranks.any(not self._fits())

    def fits(self) -> bool:
        """Whether another step may start (as decided by the last :meth:`spend` or :meth:`restore`)."""
        return not self.over

    def _fits(self) -> bool:
        """No budget, no step timed yet, or the time used plus the mean step so far within the budget."""
        if self.minutes is None or not self.steps:
            return True
        return self.used + self.used / self.steps <= self.minutes * 60

    def metrics(self, stopping: bool) -> dict[str, float]:
        """A step's budget metrics (none without a budget): the minutes used so far, and `budget/stopped` on the
        step the budget ends the run at."""
        if self.minutes is None:
            return {}
        out = {"budget/minutes_used": self.used / 60}
        if stopping:
            out["budget/stopped"] = 1.0
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (the clock, so that a resumed run does not mix two clocks' seconds)."""
        return {"seconds": self.used, "steps": self.steps, "clock": self.clock}

    def restore(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's budget state (a checkpoint written before budgets were counted: nothing used)."""
        if state and state.get("clock", self.clock) == self.clock:
            self.used, self.steps = float(state["seconds"]), int(state["steps"])
        else:
            self.used, self.steps = 0.0, 0
        self.over = not self._fits()  # the same on every rank: each restores the same state

    def describe(self) -> str:
        """`2.9 of 3 cpu minutes`: the time used against the budget."""
        return f"{self.used / 60:.1f} of {self.minutes:g} {self.clock} minutes"
