"""`mhgpo sft` as a run: a new warm-start run directory, or one continued from its last checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mhgpo.config import SFTConfig
from mhgpo.io import atomic_write_json
from mhgpo.model.trained import portable_model_spec
from mhgpo.rl.sft import SFTTrainer, build_sft
from mhgpo.run.resuming import continue_run, run_config
from mhgpo.run.rundir import RunLock, require_empty_run_dir


def run_sft(cfg: SFTConfig, progress: bool = True, workflow: Any = None) -> SFTTrainer:
    """`mhgpo sft`: build the demonstrations and the model, train, validate, save (a new or empty `output_dir`).
    `workflow`: as for `build_sft`."""
    run_dir = Path(cfg.output_dir)
    require_empty_run_dir(run_dir)
    with RunLock(run_dir, "sft"):
        require_empty_run_dir(run_dir)
        cfg.model = portable_model_spec(cfg.model, run_dir)  # stored relative to the run's parent (trained.py)
        setup, demos, held, skipped = build_sft(cfg, workflow)
        trainer = SFTTrainer(cfg, setup, run_dir, demos, held, progress)
        counts = {a: sum(d.agent == a for d in demos) for a in setup.workflow.agents}
        atomic_write_json(
            run_dir / "demonstrations.json",
            {
                "questions": len(setup.train),
                "demonstrations": counts,
                "stopped_at": {k.split("/", 1)[1]: v for k, v in skipped.items()},
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
) -> SFTTrainer:
    """Continue the warm start in `run_dir` from its last checkpoint (or step `from_step`); `overrides` and
    `trust_code` as for `mhgpo.run.pipeline.resume`."""
    run_dir = Path(run_dir)
    cfg, changed = run_config(run_dir, SFTConfig, overrides, trust_code or workflow is not None, "mhgpo sft")

    def make() -> SFTTrainer:
        setup, demos, held, _ = build_sft(cfg, workflow)
        return SFTTrainer(cfg, setup, run_dir, demos, held, progress)

    return continue_run(run_dir, make, from_step, "sft", changed=changed)  # type: ignore[return-value]
