"""Stopping a training run cleanly, and what it keeps.

SIGINT and SIGTERM become a KeyboardInterrupt where nothing is half-done (:class:`StopGuard`). A step's first phase
(rollouts) may be cut anywhere: the trainer rewinds it. From the first weight change on, the step is finished
(logged, saved) before the run stops. Several ranks (`deferred`) stop together: the signal is only noted, and the
trainer asks every rank at its sync points whether any was signalled.

A step that raises stops the run with one line (:func:`failed_step`): in its rollouts or in its records (validation,
rollout records, metrics) the completed steps are saved first, as on Ctrl-C, and `--resume` continues; in its
update nothing is saved, the weights belonging to no step (:func:`not_finite` for a diverged update).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mhgpo.errors import RunError, ServiceError, printable
from mhgpo.model.checkpoint import list_checkpoints

SAME_REQUEST_S = 2.0  # several ranks: signals this close to the first are the same request to stop


class Trainer(Protocol):
    """What the functions below act on: the RL trainer (`mhgpo.rl.trainer`, a layer above, passes itself), as far
    as they read, rewind and save it."""

    run_dir: Path
    ranks: Any  # the run's ranks (`mhgpo.model.distributed`)
    phase: str  # where the current step is: rollouts, update, validation or records
    step: int  # the last completed step
    position: int  # questions consumed so far
    failures: int  # questions whose rollout failed so far

    def save(self, rng: dict[str, Any] | None = None) -> Path: ...


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


class RankFailed(RuntimeError):
    """Another rank's step failed (its error, already in one line): every rank stops at the same step."""


@dataclass
class Completed:
    """The run's state after its last completed step: what a step stopped half-way is rewound to."""

    rng: dict[str, Any]
    position: int
    failures: int
    saved_step: int  # the step of the last checkpoint this run wrote (or resumed from)


def save_on_stop(
    trainer: Trainer, stop: BaseException, guard: StopGuard | None, done: Completed, quiet: bool = False
) -> None:
    """On an interrupt (or too many failures, or a failed step): save the last completed step unless it is saved
    already, rewinding a step stopped half-way (data position, failures, rng); a second signal inside a critical
    section saves nothing. `quiet`: the caller's error line says what was saved."""
    if guard is not None and guard.aborted:
        print("mhgpo: aborted; nothing saved", flush=True)
        return
    if done.saved_step != trainer.step:
        _save_last(trainer, stop, done, quiet)
        done.saved_step = trainer.step
    if guard is not None and guard.deferred:  # every rank stopped here: none ends before rank 0 has saved
        trainer.ranks.barrier()


def _save_last(trainer: Trainer, stop: BaseException, done: Completed, quiet: bool = False) -> None:
    rng = None
    if trainer.position != done.position:  # stopped inside a step: rewind it
        trainer.position, trainer.failures = done.position, done.failures
        rng = done.rng
    path = trainer.save(rng)
    if quiet or not trainer.ranks.is_main:
        return
    why = "interrupted" if isinstance(stop, KeyboardInterrupt) else "stopped"
    print(f"mhgpo: {why}; saved {path} (resume with: mhgpo train --resume {trainer.run_dir})", flush=True)


def failed_step(trainer: Trainer, e: BaseException, log: Any, guard: StopGuard | None, done: Completed) -> RunError:
    """The one-line error that stops a run whose step raised `e`: in its rollouts or its records the completed
    steps are saved first (a step cut short in its rollouts is rewound), as on Ctrl-C; in its update nothing is
    saved (the weights are no step's); in the hand-over of its update to a generation server the step is complete
    and saved already. errors.jsonl gets the step, the phase and the traceback."""
    import traceback

    phase = trainer.phase  # rollouts, update, validation, records or hand-over (after the step was saved)
    failing = trainer.step if phase in ("validation", "records", "hand-over") else trainer.step + 1
    kept = list_checkpoints(trainer.run_dir)
    if phase == "update":
        saved = f"the update's weights belong to no step and are not saved; {_last(kept)}"
    else:
        try:
            save_on_stop(trainer, e, guard, done, quiet=True)
            kept = list_checkpoints(trainer.run_dir)
            saved = f"its completed steps are saved ({_last(kept)})"
        except OSError as err:
            saved = f"saving the completed steps failed too ({err.strerror or err}); {_last(kept)}"
    try:
        log.error(failing, {"phase": phase, "error": error_text(e), "traceback": traceback.format_exc()})
    except RunError:
        pass  # (the disk is full: the error line below says it all)
    how = f"continue with: mhgpo train --resume {trainer.run_dir}" if kept else f"start it again ({trainer.run_dir})"
    cls = ServiceError if isinstance(e, ServiceError) else RunError
    return cls(
        f"step {failing}: {error_text(e)} (in its {phase}); the run stops at step {trainer.step}; {saved}; {how}"
    )


def not_finite(trainer: Trainer, log: Any, step: int, e: BaseException) -> RunError:
    """The error that stops a run whose update met a NaN / infinite loss, gradient or weight: nothing of this
    step is logged or saved (a checkpoint of it would rotate a good one away), errors.jsonl says why."""
    kept = list_checkpoints(trainer.run_dir)
    last = f"the last good checkpoint {kept[-1].name} is kept" if kept else "no checkpoint was saved before it"
    log.error(step, {"phase": "train", "error": str(e)})
    return RunError(f"step {step}: {e}; {last} (lower optim.lr, or check the data and rewards)")


def _last(kept: list[Path]) -> str:
    return f"its last checkpoint is {kept[-1].name}" if kept else "it has no checkpoint yet"


def error_text(e: BaseException) -> str:
    """What stopped a step, in one line: out of memory and a dead generation engine in words of their own (with what
    to change), else the error's type and first line; control characters made visible."""
    first = (str(e).strip().splitlines() or [""])[0][:300]
    name = type(e).__name__
    if isinstance(e, RankFailed):
        return first
    if isinstance(e, MemoryError) or "out of memory" in first.lower() or name == "OutOfMemoryError":
        return printable(
            f"out of memory ({first or name}); lower gen_batch_size, optim.micro_batch_tokens or "
            f"generation.gpu_memory_utilization before resuming"
        )
    if "EngineDead" in name or "engine core" in first.lower() or "enginecore" in first.lower():
        return printable(f"the generation engine died ({name}: {first}); it is started again on resuming")
    if isinstance(e, RunError):
        return printable(first)
    return printable(f"{name}: {first}" if first else name)
