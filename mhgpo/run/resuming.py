"""Continuing a run: the checkpoint to resume from, the run's saved config, the lock of its folder, and the
trainer restored from the checkpoint (`mhgpo train --resume`, `mhgpo sft --resume`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mhgpo.config import load_config, parse_override, to_dict
from mhgpo.config.load import differences, lookup, names_key, shown
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_jsonl, read_jsonl
from mhgpo.model.checkpoint import (
    CheckpointError,
    CheckpointMismatch,
    check_checkpoint,
    checkpoint_step,
    clean_leftovers,
    list_checkpoints,
    previous_complete,
)
from mhgpo.model.distributed import Single
from mhgpo.run.rundir import RunLock, refuse_links
from mhgpo.team.loader import refuse_untrusted_code

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
            raise InputError(
                f"--from-step {from_step}: {run_dir} has no checkpoint of step {from_step} "
                f"(its checkpoints: {', '.join(p.name for p in checkpoints)})"
            )
        chosen = checkpoints[steps.index(from_step)]
    return chosen


def _with_fallback(error: CheckpointError, run_dir: Path, chosen: Path, command: str = "train") -> CheckpointError:
    if isinstance(error, CheckpointMismatch):  # the config, not the checkpoint, is at fault
        return error
    prev = previous_complete(run_dir, checkpoint_step(chosen))
    if prev is None:
        return CheckpointError(f"{error}; there is no earlier complete checkpoint")
    return CheckpointError(
        f"{error}; the previous complete checkpoint is {prev.name}: mhgpo {command} --resume "
        f"{run_dir} --from-step {checkpoint_step(prev)}"
    )


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
    print(
        f"mhgpo: resuming from step {step}; the later checkpoints ({', '.join(p.name for p in later)}) moved to "
        f"{aside}",
        flush=True,
    )


# The keys `--resume` may change: how long the run goes on and how it saves, validates and tolerates failures, none
# of which changes what a step computes. Every other key must repeat the saved value (a different learning rate, say,
# would be a different run, and the optimiser's restored state would undo part of it).
RESUMABLE = ("steps", "budget_minutes", "eval_every", "save_every", "keep_checkpoints", "max_failures")
CHANGES_FILE = "resumes.jsonl"


def run_config(
    run_dir: Path, cls: type, overrides: list[str] = (), trust_code: bool = True, command: str = "mhgpo train"
) -> tuple[Any, dict[str, list[Any]]]:
    """The saved config of the run in `run_dir` with `overrides`, its output_dir set to `run_dir`, and the keys
    the overrides change ({key: [saved, new]}, only keys of `RESUMABLE`). An override that changes any other key
    is refused naming it; a saved workflow class (`system: PATH.py:Class`) is refused unless `trust_code` or the
    overrides name the system again (the command line's `--trust-code` / `--system`)."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise InputError(f"{run_dir}: not a run directory (no config.yaml)")
    saved = load_config(cls, path)
    refuse_untrusted_code(saved.system, path, trust_code or names_key(None, overrides, "system"), command)
    given = [o for o in overrides if parse_override(o)[0] != ["output_dir"]]
    for o in overrides:
        if parse_override(o)[0] == ["output_dir"] and Path(str(parse_override(o)[1])).resolve() != run_dir.resolve():
            raise InputError(f"output_dir: {parse_override(o)[1]} is not the run being continued ({run_dir})")
    cfg = load_config(cls, path, given)
    old, new = to_dict(saved), to_dict(cfg)
    changed = {}
    for key in differences(old, new):
        if key not in RESUMABLE:
            raise InputError(
                f"{key}: {shown(lookup(new, key))} here, but the run in {run_dir} used {shown(lookup(old, key))}; "
                f"--resume continues the same run (it may change only {', '.join(RESUMABLE)}): leave "
                f"{key} out, or start a new run"
            )
        changed[key] = [lookup(old, key), lookup(new, key)]
    return dataclasses.replace(cfg, output_dir=str(run_dir)), changed


def record_changes(run_dir: Path, step: int, changed: dict[str, list[Any]]) -> None:
    """Note the keys a resume changed in `RUN/resumes.jsonl` (one line per resume that changed any: the step it
    continued from and {key: [before, after]}); config.yaml then holds the new values."""
    if not changed:
        return
    rows, _ = read_jsonl(run_dir / CHANGES_FILE)
    row = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": step, "changed": changed}
    atomic_write_jsonl(run_dir / CHANGES_FILE, [*rows, row])
    print(
        f"mhgpo: resuming with {', '.join(f'{k} {a!r} → {b!r}' for k, (a, b) in changed.items())} (noted in "
        f"{run_dir / CHANGES_FILE})",
        flush=True,
    )


def continue_run(
    run_dir: Path,
    make: Callable[[], Trainer],
    from_step: int | None,
    command: str,
    ranks: Single | None = None,
    changed: dict[str, list[Any]] | None = None,
) -> Trainer:
    """Lock `run_dir`, check its checkpoint (the last, or step `from_step`) before and after `make()` builds the
    trainer, restore it, and run on; `command` (train, sft) names how to resume from an earlier checkpoint. With
    several `ranks`, rank 0 locks and tidies the folder, and every rank loads the checkpoint. `changed`: the keys
    the resume changes (`run_config`), noted once the checkpoint is restored."""
    ranks = ranks or Single()
    with main_lock(ranks, run_dir, f"{command} --resume"):
        if ranks.is_main:
            refuse_links(run_dir)
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
            record_changes(run_dir, trainer.step, changed or {})
        trainer.run()
    return trainer
