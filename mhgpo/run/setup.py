"""The composition root: a job's config is settled once, then one place builds everything the job needs.

:func:`settle` runs before anything slow (no data, index or model is loaded) and returns a :class:`Job`: the config
as the job runs it and as its `config.yaml` records it (nothing changes it afterwards), the team, and the ranks of a
data-parallel run. It decides

- the team: `system` and its `team` section, or the `Workflow` given from Python, resolved once;
- the precision (`auto` → what this machine runs) and the model relative to the run (a new run stores a relative
  path relative to its folder's parent; with `warm_start.enabled`, `model` becomes the warm start's folder, where RL
  starts, and `warm_start.model` what lies beneath);
- and checks what can fail early: the generation engine is installed, the ranks can share the steps, the trackers
  are installed, the roles named by `train_roles`, `frozen_roles` and `rr_probs` exist, a warm start can walk the
  team through gold outputs.

Settling a settled config changes nothing, so a resumed run settles its saved config again.

The builders then make, from a job, what each command needs, in one way each: :func:`build_training` (`mhgpo
train`, the data, workflows, model, policy, critic and generator in a `TrainingSetup`), :func:`build_sft` (the warm
start, `mhgpo sft`), :func:`build_generation` (`mhgpo eval`, `mhgpo ask` and the validations of `mhgpo demo`: one
generator path). The RL layer (`mhgpo.rl`) receives these finished objects.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhgpo.config import EvalConfig, SFTConfig, TrainConfig, carry_over
from mhgpo.config.samplers import sampler as sampler_entry
from mhgpo.config.tables import ALGORITHMS, ENGINES, POLICY_LOSSES, load_function
from mhgpo.data.records import Example
from mhgpo.errors import InputError
from mhgpo.model import sharding
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.model.distributed import Single
from mhgpo.model.precision import announce, default_device, resolve_precision, weight_dtype
from mhgpo.model.pretrained import DEFAULT_MODEL, ModelNotFoundError, encode_chat, resolve_model
from mhgpo.model.trained import initial_weights, load_model, portable_model_spec, run_model_spec
from mhgpo.rl.policy import Policy
from mhgpo.rl.trainer import Trainer, TrainingSetup
from mhgpo.runtime.trackers import require_trackers
from mhgpo.team.build import Team, build_workflow, load_examples, resolve_team
from mhgpo.team.loader import require_demonstrations
from mhgpo.team.oracle import with_oracles
from mhgpo.team.workflow import Workflow

WARM_START_DIR = "warm_start"  # RUN/warm_start: the warm start's own run folder


@dataclass(frozen=True)
class Job:
    """A settled config and what was decided with it: `cfg` is what the job runs and what `config.yaml` records;
    `reason` says why the precision is what it is (printed once the model has loaded)."""

    cfg: Any  # TrainConfig | SFTConfig | EvalConfig
    team: Team
    ranks: Single
    reason: str

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output_dir)


# --------------------------------------------------------------------------------------------------- settling


def settle(
    cfg: Any, workflow: Any = None, ranks: Single | None = None, new_run: bool = True, reason: str | None = None
) -> Job:
    """`cfg` (a train, sft or eval config) settled for this machine and these `ranks` (see the module); `cfg` itself
    is not changed. `workflow`: None (the team `cfg.system` names), a `Workflow` subclass or instance, or a `Team`.
    `new_run=False`: a run's saved config, being resumed (its `model` is already stored relative to the run).
    `reason`: why the precision is what it is, for a config that comes settled from a job that decided it (a run's
    warm start or validation): settling it again would only find its precision "set in the config"."""
    ranks = ranks or Single()
    team = resolve_team(cfg, workflow)
    settled, found = settle_precision(copy.deepcopy(cfg))
    reason = reason or found
    settled = dataclasses.replace(settled, system=team.system, team=dict(team.section))
    if isinstance(settled, (TrainConfig, SFTConfig)):
        settled = _settle_model(settled, new_run)
    _check(settled, team, ranks)
    return Job(settled, team, ranks, reason)


def _settle_model(cfg: Any, new_run: bool) -> Any:
    """A run's `model`: a new run's relative path made relative to the run folder's parent (`mhgpo.model.trained`);
    with a warm start, the warm start's folder, `warm_start.model` recording what it fine-tunes."""
    run_dir = Path(cfg.output_dir)
    model = portable_model_spec(cfg.model, run_dir) if new_run else cfg.model
    if not isinstance(cfg, TrainConfig) or not cfg.warm_start.enabled:
        if new_run:
            check_model("model", model, run_dir)
        return dataclasses.replace(cfg, model=model)
    warm = f"{run_dir.name}/{WARM_START_DIR}"  # relative to the run's parent: moves with the run
    # (realpath: a link loop is a path like any other here, refused below as naming no model)
    if os.path.realpath(run_model_spec(model, run_dir)) == os.path.realpath(run_dir / WARM_START_DIR):
        return dataclasses.replace(cfg, model=warm)  # settled before (or a run saved before warm_start.model)
    base = cfg.warm_start.model or model
    if new_run and cfg.warm_start.model:
        base = portable_model_spec(base, run_dir)
    if new_run:
        check_model("warm_start.model" if cfg.warm_start.model else "model", base, run_dir)
    return dataclasses.replace(cfg, model=warm, warm_start=dataclasses.replace(cfg.warm_start, model=base))


def check_model(key: str, spec: str, run_dir: Path) -> None:
    """A new run's model (or its warm start's) must name a model before its folder is made: one that names none
    would leave a folder that can be neither continued (the model is not a key `--resume` changes) nor reused. (The
    packaged default is checked when it loads: installing it then lets the run be continued.)"""
    if str(spec).strip().lower() == DEFAULT_MODEL:
        return
    try:
        resolve_model(run_model_spec(spec, run_dir))
    except ModelNotFoundError as e:
        raise InputError(f"{key}: {e}") from None


def _check(cfg: Any, team: Team, ranks: Single) -> None:
    """What can be refused before anything slow: the engine, the ranks, the trackers, the roles, demonstrations."""
    generation = getattr(cfg, "generation", None)
    if generation is not None and ENGINES[generation.engine].require:
        load_function(ENGINES[generation.engine].require)()
    check_ranks(cfg, ranks)
    if isinstance(cfg, (TrainConfig, SFTConfig)) and ranks.is_main:
        require_trackers(cfg.report_to)
    if isinstance(cfg, SFTConfig) or (isinstance(cfg, TrainConfig) and cfg.warm_start.enabled):
        require_demonstrations(team.source)
    agents = team.agents
    roles = getattr(cfg, "roles", None) if isinstance(cfg, SFTConfig) else None
    named = [("roles", roles or [])]
    if isinstance(cfg, TrainConfig):
        named += [("train_roles", cfg.train_roles or []), ("frozen_roles", cfg.frozen_roles)]
        named += [("optim.role_lr", list(cfg.optim.role_lr))]
    for key, names in named:
        bad = [r for r in names if r not in agents]
        if bad:
            raise InputError(f"{key}: unknown role {bad[0]!r} (roles: {', '.join(agents)})")
    if (
        isinstance(cfg, TrainConfig)
        and sampler_entry(cfg.sampler).forks == "drawn"
        and len(cfg.rr_probs) != len(agents)
    ):
        raise InputError(
            f"rr_probs: {len(cfg.rr_probs)} probabilities for the {len(agents)} agents "
            f"({', '.join(agents)}) of system={cfg.system}"
        )


def check_ranks(cfg: Any, ranks: Single) -> None:
    """What several ranks need of a config: each rolls out the same number of questions per step, and the warm
    start (a run of one process) is done beforehand. A separate engine (vLLM) runs on every rank, beside its
    trainer (`build_training`)."""
    if ranks.world == 1:
        return
    if not isinstance(cfg, TrainConfig):
        raise InputError("only RL training (mhgpo train) runs on several processes")
    if sharding.requested() and cfg.lora.enabled and cfg.lora.per_role:
        raise InputError("FSDP: lora.per_role is not supported; launch with configs/accelerate/gpu_ddp.yaml")
    if cfg.rollout.max_staleness > 0:
        raise InputError(
            f"rollout.max_staleness: rollouts that overlap the update run in one trainer process; with "
            f"{ranks.world} processes set it to 0"
        )
    if cfg.questions_per_step % ranks.world:
        raise InputError(
            f"questions_per_step={cfg.questions_per_step} is not divisible by the {ranks.world} "
            f"processes of this run: each rank rolls out questions_per_step / processes questions"
        )
    if cfg.warm_start.enabled and not list_checkpoints(Path(cfg.output_dir)):
        raise InputError(
            f"warm_start.enabled: the warm start runs in one process; run it first (mhgpo sft "
            f"--output-dir WARM ...) and train on {ranks.world} processes with --model WARM "
            f"warm_start.enabled=false"
        )


def initial_model(cfg: TrainConfig) -> str:
    """The model a run's team is before it trains: beneath its warm start, if any (as stored in the config)."""
    return cfg.warm_start.model if cfg.warm_start.enabled and cfg.warm_start.model else cfg.model


def validation_config(cfg: TrainConfig, model: str, oracle: tuple[str, ...] | list[str] = ()) -> EvalConfig:
    """The evaluation that a training run's validation is: `val_data` (its first `val_limit` questions) with the
    run's team, generation and precision settings, of `model` (a spec as given: resolved by the caller)."""
    return carry_over(
        cfg,
        EvalConfig,
        model=model,
        data=cfg.val_data,
        limit=cfg.val_limit,
        batch_size=cfg.eval_batch_size,
        generation=copy.deepcopy(cfg.generation),
        oracle=list(oracle),
    )


# --------------------------------------------------------------------------------------------------- building


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_data(
    job: Job, with_val: bool, val_limit: int | None = None
) -> tuple[list[Example], list[Example], Workflow, Workflow]:
    """The training and validation examples of the job (`data`, `val_data`, `val_limit`) and the workflows that
    answer them (one, or one per data set when each brings its own context corpus)."""
    cfg, team = job.cfg, job.team
    train = load_examples(cfg.data)
    val = load_examples(cfg.val_data, cfg.val_limit if val_limit is None else val_limit) if with_val else []
    workflow = build_workflow(team.source, cfg.data, cfg.retrieval, cfg.search, team.section)
    same_corpus = (
        cfg.retrieval.corpus not in (None, "context")  # a corpus file; "context": each data set's own
        or cfg.data.split(":")[0] == cfg.val_data.split(":")[0] == "synthetic"
    )
    val_workflow = (
        workflow
        if same_corpus or not val
        else build_workflow(team.source, cfg.val_data, cfg.retrieval, cfg.search, team.section)
    )
    return train, val, workflow, val_workflow


def build_generator(engine: str, **inputs: Any) -> Any:
    """The generator of the `generation.engine` table entry `engine`, built from `inputs` (`mhgpo.config.tables`)."""
    return load_function(ENGINES[engine].build)(**inputs)


def build_training(job: Job, with_val: bool = False, loaded: Any = None) -> TrainingSetup:
    """Everything RL training needs (a `TrainingSetup`): the data and workflows, the model with its reference, the
    critic (an algorithm with one), the policy with its loss, and the generator; the validation set is loaded when
    `eval_every` asks for it or `with_val`. With several ranks, the policy and critic are told them, an FSDP
    launch shards the actor's layers, and a separate engine (vLLM) is started on every rank. `loaded`: a model
    already built (a `LoadedModel`, stored as the precision asks: `weight_dtype(precision, trainable=not
    lora.enabled)`) instead of `cfg.model` (its reference is itself: `reference=init`), e.g. one initialised at
    random from a config to measure speed and memory."""
    cfg, ranks = job.cfg, job.ranks
    seed_everything(cfg.seed)
    train, val, workflow, val_workflow = build_data(job, bool(cfg.eval_every) or with_val)
    spec = run_model_spec(cfg.model, job.run_dir)
    reference = None
    if loaded is None:
        sharding.load_whole()  # FSDP: every rank loads the whole model (sharded below)
        # `model` may be a trained run (its weights merged: the initial weights); `reference=base` keeps what lies
        # beneath. LoRA: the frozen base may be stored in bfloat16 (bf16-mixed); full fine-tuning: the master weights
        loaded, reference = initial_weights(
            spec,
            cfg.reference,
            cfg.lora.enabled,
            device=default_device(),
            dtype=weight_dtype(cfg.precision, trainable=not cfg.lora.enabled),
        )
    announce(cfg.precision, job.reason)
    engine = ENGINES[cfg.generation.engine]
    generator, scratch = None, None
    if engine.separate:  # on the initial weights, before LoRA wraps the model
        from mhgpo.model.vllm_files import scratch_dir
        from mhgpo.rl.engine_sync import PER_ROLE_ADAPTERS

        scratch = scratch_dir()
        generator = build_generator(
            engine.name,
            spec=spec,
            loaded=loaded,
            generation=cfg.generation,
            precision=cfg.precision,
            seed=cfg.seed,
            lora_rank=cfg.lora.r if cfg.lora.enabled else None,
            adapters=PER_ROLE_ADAPTERS if cfg.lora.enabled and cfg.lora.per_role else 1,
            scratch=scratch,
            ranks=ranks,  # several: one engine per rank, each sampling the rank's share
        )
    algo = ALGORITHMS[cfg.algo]
    critic, actor_steps = None, cfg.steps
    pad_id = loaded.tokenizer.pad_token_id
    if algo.critic:  # before the policy wraps the model: the critic starts from the plain weights
        from mhgpo.rl.critic import Critic

        critic = Critic(loaded.model, pad_id, cfg.critic, cfg.optim, cfg.lora, cfg.precision)
        actor_steps = max(cfg.steps - cfg.critic.warmup_steps, 1)  # the actor's schedule starts after warm-up
    policy = Policy(
        loaded.model,
        pad_id,
        cfg.optim,
        cfg.lora,
        actor_steps,
        reference,
        cfg.precision,
        roles=workflow.agents,
        loss=load_function(POLICY_LOSSES[cfg.optim.loss or algo.loss].function),
        loss_engine=POLICY_LOSSES[cfg.optim.loss or algo.loss].engine,
        loss_stats=POLICY_LOSSES[cfg.optim.loss or algo.loss].stats,
    )
    _share(policy, critic, ranks)
    if generator is None:
        generator = build_generator(
            engine.name,
            model=policy.model,
            loaded=loaded,
            spec=spec,
            generation=cfg.generation,
            precision=cfg.precision,
            seed=cfg.seed,
            batch_size=cfg.gen_batch_size,
            select=policy.acting_as if policy.roles else None,
        )
    return TrainingSetup(
        train,
        val,
        workflow,
        val_workflow,
        policy,
        generator,
        lambda messages: encode_chat(loaded.tokenizer, messages),
        critic,
        scratch,
    )


def _share(policy: Policy, critic: Any, ranks: Single) -> None:
    """Several ranks: the updates of the policy and critic cut the step's samples across them, and under an FSDP
    launch the actor's decoder layers are sharded (`mhgpo.model.sharding`)."""
    for part in (policy, critic):
        if part is not None:
            part.ranks = ranks
    if ranks.world > 1 and sharding.requested():
        try:
            policy.shard(ranks.device, ranks.world)
        except ValueError as e:
            raise InputError(str(e)) from None
        if ranks.is_main:
            import sys

            print(
                f"mhgpo: FSDP: the actor's decoder layers sharded over {ranks.world} ranks", file=sys.stderr, flush=True
            )


def build_trainer(job: Job, progress: bool = True, with_val: bool = False) -> Trainer:
    """The RL trainer of a settled training job, built (:func:`build_training`) and ready to run or restore."""
    return Trainer(job.cfg, build_training(job, with_val), job.run_dir, progress, job.ranks)


def build_sft(job: Job) -> tuple[TrainingSetup, list, list, dict[str, int]]:
    """The warm start's setup (data, workflows, model, policy without a reference copy, generator) and its training
    and held-out demonstrations (`mhgpo.rl.sft`), and how many chains stopped at each agent."""
    from mhgpo.model.generation import HFGenerator
    from mhgpo.rl.sft import collect_demonstrations, held_out, target_encoder

    cfg = job.cfg
    seed_everything(cfg.seed)
    n_val = max(cfg.val_limit, cfg.format_limit)
    train, val, workflow, val_workflow = build_data(job, n_val > 0, n_val)
    if cfg.limit is not None:
        train = train[: cfg.limit]
    loaded, _ = initial_weights(
        run_model_spec(cfg.model, job.run_dir),
        "init",
        cfg.lora.enabled,
        device=default_device(),
        dtype=weight_dtype(cfg.precision, trainable=not cfg.lora.enabled),
    )
    announce(cfg.precision, job.reason)
    encode = lambda messages: encode_chat(loaded.tokenizer, messages)  # noqa: E731
    to_ids = target_encoder(loaded.tokenizer)
    demos, skipped = collect_demonstrations(train, workflow, encode, to_ids, cfg.max_rounds, cfg.max_prompt_tokens)
    held_demos, _ = (
        collect_demonstrations(val, val_workflow, encode, to_ids, cfg.max_rounds, cfg.max_prompt_tokens)
        if val
        else ([], {})
    )
    if cfg.roles is not None:
        demos = [d for d in demos if d.agent in cfg.roles]
        held_demos = [d for d in held_demos if d.agent in cfg.roles]
    if not demos:
        raise InputError(
            f"{cfg.data}: the data gives no demonstration for the roles {', '.join(cfg.roles or workflow.agents)}"
        )
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        cfg.optim,
        cfg.lora,
        cfg.steps,
        precision=cfg.precision,
        keep_reference=False,
    )
    generator = HFGenerator(policy.model, loaded.tokenizer, batch_size=cfg.gen_batch_size, precision=cfg.precision)
    setup = TrainingSetup(train, val[: cfg.val_limit], workflow, val_workflow, policy, generator, encode)
    return setup, demos, held_out(held_demos, cfg.format_limit), skipped


@dataclass
class Generation:
    """What evaluating or asking a team needs: its workflow (with the `oracle` roles' gold outputs), the loaded
    model, a generator over it and the prompt encoder."""

    workflow: Workflow
    loaded: Any
    generator: Any
    encode: Any

    def close(self) -> None:
        """Release a separate engine's model and cache now."""
        if hasattr(self.generator, "close"):
            self.generator.close()


def build_generation(job: Job) -> Generation:
    """The workflow, model and generator of an evaluation job (`mhgpo eval`, `mhgpo ask`, a run's validation as its
    own job): the team over `data` (with its `oracle` roles) and :func:`load_generator`."""
    cfg = job.cfg
    workflow = with_oracles(
        build_workflow(job.team.source, cfg.data, cfg.retrieval, cfg.search, job.team.section), cfg.oracle
    )
    loaded, generator, encode = load_generator(cfg, job.reason)
    return Generation(workflow, loaded, generator, encode)


def load_generator(cfg: Any, reason: str) -> tuple[Any, Any, Any]:
    """The one generator path of the commands that generate without training (eval, ask, eval-retrieval's
    Rewriter, a run's validation as its own job): the model `cfg.model` as it is (a trained run merged), its weights
    stored as the (resolved) precision keeps frozen weights, the generator of `cfg.generation.engine` over it (hf
    for a config without a `generation` section) and the prompt encoder; `reason` (why the precision) is printed
    once the model has loaded."""
    torch.manual_seed(cfg.seed)
    loaded = load_model(cfg.model, dtype=weight_dtype(cfg.precision, trainable=False))
    announce(cfg.precision, reason)
    generation = getattr(cfg, "generation", None)
    generator = build_generator(
        generation.engine if generation is not None else "hf",
        model=loaded.model,
        loaded=loaded,
        spec=cfg.model,
        generation=generation,
        precision=cfg.precision,
        seed=cfg.seed,
        batch_size=cfg.gen_batch_size,
        select=loaded.select,
    )
    return loaded, generator, lambda messages: encode_chat(loaded.tokenizer, messages)


def settle_precision(cfg: Any) -> tuple[Any, str]:
    """`cfg` with its `precision` resolved for this machine (`auto` → what it runs), and why."""
    precision, reason = resolve_precision(cfg.precision, default_device())
    return dataclasses.replace(cfg, precision=precision), reason
