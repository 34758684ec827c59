"""Continuing a run: the checkpoint to resume from, the run's saved config, the lock of its folder, and the
trainer restored from the checkpoint (`mhgpo train --resume`, `mhgpo sft --resume`)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mhgpo.model.checkpoint import (CheckpointError, CheckpointMismatch, check_checkpoint, checkpoint_step, clean_leftovers,
                              list_checkpoints, previous_complete)
from mhgpo.config import load_config
from mhgpo.model.distributed import Single
from mhgpo.errors import InputError
from mhgpo.run.rundir import RunLock

if TYPE_CHECKING:
    from mhgpo.rl.trainer import Trainer


def main_lock(ranks: Single, run_dir: Path, command: str) -> AbstractContextManager:
    """The run directory's lock, held by rank 0 (the rank that writes into it)."""
    return RunLock(run_dir, command) if ranks.is_main else nullcontext()


def choose_checkpoint(run_dir: Path, from_step: int | None = None) -> Path:
    """The checkpoint to resume from (the last one, or step `from_step`), after the checks that need no model."""
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise InputError(f"{run_dir}: no checkpoint to resume from (checkpoints/step_N/)")
    if from_step is None:
        chosen = checkpoints[-1]
    else:
        steps = [checkpoint_step(p) for p in checkpoints]
        if from_step not in steps:
            raise InputError(f"--from-step {from_step}: {run_dir} has no checkpoint of step {from_step} "
                             f"(its checkpoints: {', '.join(p.name for p in checkpoints)})")
        chosen = checkpoints[steps.index(from_step)]
    return chosen


def _with_fallback(error: CheckpointError, run_dir: Path, chosen: Path, command: str = "train") -> CheckpointError:
    if isinstance(error, CheckpointMismatch):  # the config, not the checkpoint, is at fault
        return error
    prev = previous_complete(run_dir, checkpoint_step(chosen))
    if prev is None:
        return CheckpointError(f"{error}; there is no earlier complete checkpoint")
    return CheckpointError(f"{error}; the previous complete checkpoint is {prev.name}: mhgpo {command} --resume "
                           f"{run_dir} --from-step {checkpoint_step(prev)}")


def _set_aside_later(run_dir: Path, step: int) -> None:
    """Resuming from an earlier checkpoint: the later ones leave the run's history (kept in checkpoints/discarded/)."""
    later = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) > step]
    if not later:
        return
    aside = Path(run_dir) / "checkpoints" / "discarded"
    aside.mkdir(exist_ok=True)
    for p in later:
        target = aside / p.name
        if target.exists():
            target = aside / f"{p.name}.{int(time.time())}"
        p.rename(target)
    print(f"mhgpo: resuming from step {step}; the later checkpoints ({', '.join(p.name for p in later)}) moved to "
          f"{aside}", flush=True)


def run_config(run_dir: Path, cls: type, overrides: list[str] = ()) -> Any:
    """The saved config of the run in `run_dir` (with `overrides`), its output_dir set to `run_dir`."""
    if not (run_dir / "config.yaml").is_file():
        raise InputError(f"{run_dir}: not a run directory (no config.yaml)")
    cfg = load_config(cls, run_dir / "config.yaml", list(overrides))
    cfg.output_dir = str(run_dir)
    return cfg


def continue_run(run_dir: Path, make: Callable[[], Trainer], from_step: int | None, command: str,
                 ranks: Single | None = None) -> Trainer:
    """Lock `run_dir`, check its checkpoint (the last, or step `from_step`) before and after `make()` builds the
    trainer, restore it, and run on; `command` (train, sft) names how to resume from an earlier checkpoint. With
    several `ranks`, rank 0 locks and tidies the folder, and every rank loads the checkpoint."""
    ranks = ranks or Single()
    with main_lock(ranks, run_dir, f"{command} --resume"):
        if ranks.is_main:
            clean_leftovers(run_dir)  # of a save that was cut short
        ranks.barrier()
        chosen = choose_checkpoint(run_dir, from_step)
        try:
            check_checkpoint(chosen)  # fail before the model loads
            trainer = make()
            trainer.restore(chosen)  # every file checked against the model before any state changes
        except CheckpointError as e:
            raise _with_fallback(e, run_dir, chosen, command) from None
        ranks.barrier()  # every rank has read the checkpoint
        if ranks.is_main:
            _set_aside_later(run_dir, trainer.step)
        trainer.run()
    return trainer
