"""`mhgpo sft` as a run: a new warm-start run directory, or one continued from its last checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mhgpo.config import SFTConfig
from mhgpo.io import atomic_write_json
from mhgpo.model.distributed import current
from mhgpo.rl.sft import SFTTrainer, warn_over_budget
from mhgpo.run.resuming import continue_run, run_config
from mhgpo.run.rundir import RunLock, require_empty_run_dir
from mhgpo.run.setup import Job, build_sft, settle


def run_sft(cfg: SFTConfig, progress: bool = True, workflow: Any = None, reason: str | None = None) -> SFTTrainer:
    """`mhgpo sft`: build the demonstrations and the model, train, validate, save (a new or empty `output_dir`).
    `workflow`: None (the team `cfg.system` names), a `Workflow` subclass or instance, or a resolved `Team`; it must
    define `demonstration`. `reason`: why the precision is what it is, when `cfg` comes settled (a run's warm start:
    its run's reason)."""
    job = settle(cfg, workflow, current(), reason=reason)  # before anything slow or written
    run_dir = job.run_dir
    require_empty_run_dir(run_dir)
    with RunLock(run_dir, "sft"):
        require_empty_run_dir(run_dir)
        trainer = _trainer(job, progress)
        counts = {a: sum(d.agent == a for d in trainer.demos) for a in trainer.setup.workflow.agents}
        atomic_write_json(
            run_dir / "demonstrations.json",
            {
                "questions": len(trainer.setup.train),
                "demonstrations": counts,
                "stopped_at": {k.split("/", 1)[1]: v for k, v in trainer.skipped.items()},
                "over_budget": warn_over_budget(trainer.demos, trainer.setup.workflow),
            },
        )
        trainer.run()
    return trainer


def resume_sft(
    run_dir: Path,
    overrides: list[str] = (),
    progress: bool = True,
    from_step: int | None = None,
    workflow: Any = None,
    trust_code: bool = True,
    reason: str | None = None,
) -> SFTTrainer:
    """Continue the warm start in `run_dir` from its last checkpoint (or step `from_step`); `overrides` and
    `trust_code` as for `mhgpo.run.pipeline.resume`, `reason` as for :func:`run_sft`."""
    run_dir = Path(run_dir)
    cfg, changed = run_config(run_dir, SFTConfig, overrides, trust_code or workflow is not None, "mhgpo sft")

    def make() -> SFTTrainer:  # settled once the checkpoint passed its checks (the team's code imported after them)
        return _trainer(settle(cfg, workflow, current(), new_run=False, reason=reason), progress)

    return continue_run(run_dir, make, from_step, "sft", changed=changed)  # type: ignore[return-value]


def _trainer(job: Job, progress: bool) -> SFTTrainer:
    setup, demos, held, skipped = build_sft(job)
    return SFTTrainer(job.cfg, setup, job.run_dir, demos, held, progress, skipped)
