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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mhgpo.config import OptimConfig, SFTConfig, TrainConfig, dump_config
from mhgpo.model.checkpoint import checkpoint_step, list_checkpoints
from mhgpo.model.distributed import current
from mhgpo.model.trained import portable_model_spec, run_model_spec
from mhgpo.rl.evaluation import EvalResult
from mhgpo.rl.trainer import Trainer, build_team, check_ranks, load_team_data
from mhgpo.run.resuming import continue_run, main_lock, record_changes, run_config
from mhgpo.run.rundir import RunLock, refuse_links, require_empty_run_dir
from mhgpo.run.warm_start import resume_sft, run_sft
from mhgpo.team.build import Team, resolve_team
from mhgpo.team.loader import require_demonstrations
from mhgpo.team.oracle import with_oracles

WARM_START_DIR = "warm_start"


def warm_start_config(cfg: TrainConfig, out: Path) -> SFTConfig:
    """The warm start of the RL run `cfg`, written into `out`: the run's model, data, team and precision, the
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
    return SFTConfig(
        model=run_model_spec(cfg.model, Path(cfg.output_dir)),
        data=ws.data or cfg.data,
        val_data=cfg.val_data,
        system=cfg.system,
        steps=ws.steps,
        batch_size=ws.batch_size,
        balance_roles=ws.balance_roles,
        limit=ws.limit,
        seed=cfg.seed,
        output_dir=str(out),
        val_limit=0,
        format_limit=ws.format_limit,
        eval_batch_size=cfg.eval_batch_size,
        gen_batch_size=cfg.gen_batch_size,
        max_rounds=cfg.max_rounds,
        max_failures=cfg.max_failures,
        precision=cfg.precision,
        max_prompt_tokens=cfg.max_prompt_tokens,
        report_to=list(cfg.report_to),
        retrieval=cfg.retrieval,
        search=cfg.search,
        team=dict(cfg.team),
        optim=optim,
        lora=dataclasses.replace(cfg.lora, per_role=False),
    )


def warm_start(cfg: TrainConfig, run_dir: Path, progress: bool = True, workflow: Any = None) -> str:
    """Run (or finish) the warm start of `cfg` (its team: `workflow`, or what `cfg.system` names) in
    `RUN/warm_start/`; return the RL run's `model` (that folder)."""
    out = run_dir / WARM_START_DIR
    found = list_checkpoints(out)
    if found and checkpoint_step(found[-1]) >= cfg.warm_start.steps:
        pass  # done before an interruption of the RL stage
    elif found:
        resume_sft(out, progress=progress, workflow=workflow)
    else:
        if out.exists():  # cut short before its first checkpoint: nothing of it to keep
            print(f"mhgpo: the warm start in {out} saved no checkpoint; starting it again", flush=True)
            shutil.rmtree(out)
        run_sft(warm_start_config(cfg, out), progress=progress, workflow=workflow)
    return f"{run_dir.name}/{WARM_START_DIR}"  # relative to the run's parent: moves with the run (trained.py)


def _is_warm_start(cfg: TrainConfig, run_dir: Path) -> bool:
    """Whether the run's `model` already is its own warm start (RL had started)."""
    return Path(run_model_spec(cfg.model, run_dir)).resolve() == (run_dir / WARM_START_DIR).resolve()


def _settle_team(cfg: TrainConfig, workflow: Any) -> Team:
    """The team of the run, resolved once (`cfg.system` and the `team` section name it), checked that a warm start
    can train it, before anything is written."""
    team = resolve_team(cfg, workflow)
    if cfg.warm_start.enabled:
        require_demonstrations(team.source)
    return team


def train(cfg: TrainConfig, progress: bool = True, workflow: Any = None) -> Trainer:
    """A new run into `cfg.output_dir`, which must be empty or new (a run is continued with :func:`resume`): the
    warm start when `warm_start.enabled`, then RL. `workflow`: None (the team `cfg.system` names), a `Workflow`
    subclass or a built instance."""
    run_dir = Path(cfg.output_dir)
    ranks = current()  # one process, or the ranks of `accelerate launch` (rank 0 writes the run)
    check_ranks(cfg, ranks)
    if ranks.is_main:
        require_empty_run_dir(run_dir)
    team = _settle_team(cfg, workflow)
    with main_lock(ranks, run_dir, "train"):
        if ranks.is_main:
            require_empty_run_dir(run_dir)  # again, now that no other run can write into it
        ranks.barrier()
        cfg.model = portable_model_spec(cfg.model, run_dir)  # stored relative to the run's parent (trained.py)
        if cfg.warm_start.enabled:
            dump_config(cfg, run_dir / "config.yaml")  # what `resume` continues if the warm start is cut short
            cfg.model = warm_start(cfg, run_dir, progress, team)
        trainer = Trainer(cfg, build_team(cfg, workflow=team), run_dir, progress, ranks)
        trainer.run()
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
    ranks = current()
    check_ranks(cfg, ranks)
    if cfg.warm_start.enabled and not list_checkpoints(run_dir) and from_step is None:
        team = _settle_team(cfg, workflow)
        with RunLock(run_dir, "train --resume"):
            refuse_links(run_dir)
            if not _is_warm_start(cfg, run_dir):
                cfg.model = warm_start(cfg, run_dir, progress, team)
            trainer = Trainer(cfg, build_team(cfg, workflow=team), run_dir, progress)
            record_changes(run_dir, 0, changed)
            trainer.run()
        return trainer
    team = resolve_team(cfg, workflow)
    return continue_run(
        run_dir,
        lambda: Trainer(cfg, build_team(cfg, workflow=team), run_dir, progress, ranks),
        from_step,
        "train",
        ranks,
        changed,
    )


def evaluate_model(cfg: TrainConfig, run_dir: Path, desc: str = "eval", oracle: Sequence[str] = ()) -> EvalResult:
    """Greedy validation (`val_data`, `val_limit` questions) of the model `cfg.model` as it is, loaded for
    evaluation only (and released afterwards): the untrained team of a run, before anything trains. `oracle`:
    roles that give their gold output instead (mhgpo/team/oracle.py)."""
    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.precision import default_device, resolve_precision, weight_dtype
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import load_model
    from mhgpo.rl.evaluation import evaluate_examples

    _, val, _, val_workflow = load_team_data(cfg, with_val=True)
    val_workflow = with_oracles(val_workflow, oracle)
    precision, _ = resolve_precision(cfg.precision, default_device())
    loaded = load_model(run_model_spec(cfg.model, run_dir), dtype=weight_dtype(precision, trainable=False))
    if cfg.generation.engine == "vllm" and loaded.select is None:  # (one adapter per agent: mhgpo's own loop)
        from mhgpo.model.vllm_engine import build_engine

        generator: Any = build_engine(run_model_spec(cfg.model, run_dir), loaded, cfg.generation, precision, cfg.seed)
    else:
        generator = HFGenerator(
            loaded.model, loaded.tokenizer, batch_size=cfg.gen_batch_size, precision=precision, select=loaded.select
        )
    try:
        return evaluate_examples(
            val,
            val_workflow,
            generator,
            lambda m: encode_chat(loaded.tokenizer, m),
            cfg.eval_batch_size,
            desc=desc,
            max_prompt_tokens=cfg.max_prompt_tokens,
        )
    finally:
        if hasattr(generator, "close"):
            generator.close()
