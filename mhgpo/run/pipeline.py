"""Training runs end to end: an optional supervised warm start, then reinforcement learning.

`train(cfg)` starts a run in `cfg.output_dir`. With `warm_start.enabled` it first fine-tunes every role on its gold
outputs (an `mhgpo sft` run, `mhgpo/rl/sft.py`) in `RUN/warm_start/`, then starts RL from those weights: the run's
`model` becomes that folder, so loading the run (`--model RUN`) applies the warm start and then the RL weights, and
the KL reference is the warm-started team (`reference=init`; `reference=base` keeps the model beneath it). The warm
start uses the run's model, data, team settings (`search`, `retrieval`), precision, seed and LoRA settings (one
shared adapter, merged into the base before RL adds its own; with `lora.enabled=false` both stages fine-tune fully).

`resume(RUN)` continues whichever stage was interrupted: the warm start (from its checkpoint, or from scratch when it
had saved none) and then RL from its start, or RL from its last checkpoint.

Both take the team as `cfg.system` names it or, from Python, as a `workflow` (a `Workflow` subclass or instance,
`mhgpo.train(..., workflow=...)`): the warm start and RL then train that same team. A warm start needs the
workflow's `demonstration(state, agent)`; one without it is refused before anything is written.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from mhgpo.config import OptimConfig, SFTConfig, TrainConfig, carry_over, dump_config
from mhgpo.model.checkpoint import checkpoint_step, list_checkpoints
from mhgpo.model.distributed import current
from mhgpo.model.trained import run_model_spec
from mhgpo.rl.trainer import Trainer
from mhgpo.run.resuming import continue_run, main_lock, record_changes, run_config
from mhgpo.run.rundir import RunLock, refuse_links, require_empty_run_dir
from mhgpo.run.setup import WARM_START_DIR, Job, build_trainer, settle
from mhgpo.run.warm_start import resume_sft, run_sft


def warm_start_config(cfg: TrainConfig, out: Path) -> SFTConfig:
    """The warm start of the settled RL run `cfg`, written into `out`: the model beneath it (`warm_start.model`),
    the keys RL and SFT share (`TrainingRunConfig`: the run's data, team, precision, sizes, trackers), the
    `warm_start` section's size, learning-rate schedule and batch composition."""
    ws = cfg.warm_start
    optim = OptimConfig(
        lr=ws.lr,
        schedule=ws.schedule,
        warmup_steps=ws.warmup_steps,
        kl_beta=0.0,
        micro_batch_tokens=cfg.optim.micro_batch_tokens,
        logprob_chunk=cfg.optim.logprob_chunk,
        max_grad_norm=cfg.optim.max_grad_norm,
        gradient_checkpointing=cfg.optim.gradient_checkpointing,
    )
    return carry_over(
        cfg,
        SFTConfig,
        model=run_model_spec(cfg.warm_start.model or cfg.model, Path(cfg.output_dir)),
        data=ws.data or cfg.data,
        steps=ws.steps,
        batch_size=ws.batch_size,
        balance_roles=ws.balance_roles,
        loss_weighting=ws.loss_weighting,
        limit=ws.limit,
        output_dir=str(out),
        val_limit=0,
        format_limit=ws.format_limit,
        optim=optim,
        lora=dataclasses.replace(cfg.lora, per_role=False),
    )


def warm_start(job: Job, progress: bool = True) -> None:
    """Run (or finish) the warm start of the settled RL job in `RUN/warm_start/` (the folder its `model` names)."""
    cfg, run_dir = job.cfg, job.run_dir
    out = run_dir / WARM_START_DIR
    found = list_checkpoints(out)
    if found and checkpoint_step(found[-1]) >= cfg.warm_start.steps:
        return  # done before an interruption of the RL stage
    if found:
        resume_sft(out, progress=progress, workflow=job.team, reason=job.reason)
        return
    if out.exists():  # cut short before its first checkpoint: nothing of it to keep
        print(f"mhgpo: the warm start in {out} saved no checkpoint; starting it again", flush=True)
        shutil.rmtree(out)
    run_sft(warm_start_config(cfg, out), progress=progress, workflow=job.team, reason=job.reason)


class Stages:
    """What a caller of :func:`train` does between the stages of a new run (`mhgpo demo` evaluates the team in
    each): nothing by default."""

    with_val = False  # the RL stage loads its validation set whatever `eval_every` says

    def before_warm_start(self, job: Job) -> None:
        """Before the warm start (or before RL when there is none): the untrained team."""

    def before_rl(self, job: Job, trainer: Trainer) -> None:
        """The RL trainer built, before its first step: the team RL starts from."""

    def after_rl(self, job: Job, trainer: Trainer) -> None:
        """After the last step."""


def train(cfg: TrainConfig, progress: bool = True, workflow: Any = None, stages: Stages | None = None) -> Trainer:
    """A new run into `cfg.output_dir`, which must be empty or new (a run is continued with :func:`resume`): the
    warm start when `warm_start.enabled`, then RL. `workflow`: None (the team `cfg.system` names), a `Workflow`
    subclass or a built instance. `stages`: what to do between the stages (:class:`Stages`)."""
    stages = stages or Stages()
    job = settle(cfg, workflow, current())  # before anything slow or written
    run_dir, ranks = job.run_dir, job.ranks  # one process, or the ranks of `accelerate launch` (rank 0 writes)
    if ranks.is_main:
        require_empty_run_dir(run_dir)
    with main_lock(ranks, run_dir, "train"):
        if ranks.is_main:
            require_empty_run_dir(run_dir)  # again, now that no other run can write into it
        ranks.barrier()
        if ranks.is_main:
            dump_config(job.cfg, run_dir / "config.yaml")  # what `resume` continues if the run is cut short
        stages.before_warm_start(job)
        if job.cfg.warm_start.enabled:
            warm_start(job, progress)
        trainer = build_trainer(job, progress, with_val=stages.with_val)
        stages.before_rl(job, trainer)
        trainer.run()
        stages.after_rl(job, trainer)
    return trainer


def resume(
    run_dir: Path,
    overrides: list[str] = (),
    progress: bool = True,
    from_step: int | None = None,
    workflow: Any = None,
    trust_code: bool = True,
) -> Trainer:
    """Continue the run in `run_dir`: from RL's last checkpoint (or step `from_step`), or, when RL saved none yet,
    the warm start and then RL from its start. `workflow`: as for :func:`train` (None: the run's `system`).
    `overrides` may change only the keys of `RESUMABLE` (others are refused, naming the key). `trust_code=False`
    (the command line without `--trust-code`) refuses a run whose `system` is a workflow class the caller did not
    name: calling this function from Python is itself the opt-in."""
    run_dir = Path(run_dir)
    cfg, changed = run_config(run_dir, TrainConfig, overrides, trust_code or workflow is not None, "mhgpo train")
    job = settle(cfg, workflow, current(), new_run=False)
    if job.cfg.warm_start.enabled and not list_checkpoints(run_dir) and from_step is None:
        with RunLock(run_dir, "train --resume"):
            refuse_links(run_dir)
            warm_start(job, progress)
            trainer = build_trainer(job, progress)
            record_changes(run_dir, 0, changed)
            trainer.run()
        return trainer
    return continue_run(run_dir, lambda: build_trainer(job, progress), from_step, "train", job.ranks, changed)
