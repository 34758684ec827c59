"""The configs of training: `mhgpo train` / `mhgpo demo` (`TrainConfig` and its sections `reward:`, `optim:`,
`lora:`, `critic:`, `warm_start:`) and the supervised warm start `mhgpo sft` (`SFTConfig`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mhgpo.config.choices import (
    AGGREGATORS,
    BUDGET_CLOCKS,
    OLD_LOGPROBS,
    REFERENCES,
    RR_REGROUP,
    SCHEDULES,
    SFT_WEIGHTINGS,
    TRACKERS,
    is_retriever_url,
    one_of,
)
from mhgpo.config.eval import GenerationConfig, TeamRunConfig
from mhgpo.config.load import at_least, check_counts
from mhgpo.config.samplers import SAMPLERS as SAMPLER_TABLE
from mhgpo.config.samplers import group_samplers, train_samplers, trains_with
from mhgpo.config.tables import ADVANTAGE_SCHEMES, ALGORITHMS, ENGINES, POLICY_LOSSES, algorithm
from mhgpo.errors import InputError


@dataclasses.dataclass
class RewardConfig:
    """Section `reward:`: how the team's rewards are formed."""

    aggr: str = "mean"
    """How an agent's reward aggregates the final rewards of the answers downstream of it (Aggr, paper Eq. aggr)."""
    penalties: bool = True
    """The agents' format penalties added to their rewards (false: the final reward only)."""

    def validate(self) -> None:
        if self.aggr not in AGGREGATORS:
            raise InputError(f"reward.aggr: expected {one_of(AGGREGATORS)}, got {self.aggr!r}")


@dataclasses.dataclass
class OptimConfig:
    """Section `optim:`: the policy's optimiser (AdamW), learning-rate schedule and objective."""

    lr: float = 1e-4
    """The learning rate (of the actor)."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    # Linear warm-up: update t (0-based) runs at lr * (t + 1) / (warmup_steps + 1) for t < warmup_steps, then at
    # lr (or the cosine decay over the remaining updates); 0: no warm-up.
    warmup_steps: int = 0
    """Updates of linear learning-rate warm-up (0: none)."""
    schedule: str = "constant"
    """The learning rate after the warm-up: constant, or a cosine decay to 0 over the remaining updates."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm."""
    ppo_epochs: int = 1
    """Updates per step over the step's samples."""
    clip_eps: float = 0.2
    """The ratio's clip range: [1 - clip_eps, 1 + clip_eps]."""
    kl_beta: float = 0.001
    """The weight of the KL term to the reference policy (0: none, and no reference pass)."""
    # The objective gains - entropy_coef * H, H the entropy of the policy's whole next-token distribution at each
    # trained output token (at the sampling temperature, before top-p), averaged as the objective averages tokens:
    # a push back towards exploring when an agent's samples turn identical and its groups stop carrying a gradient.
    # Logged as `entropy` (the per-role `ROLE/entropy` is the sampled tokens' estimate, always logged).
    entropy_coef: float = 0.0
    """The weight of an entropy bonus on the trained tokens (0: none, as the paper)."""
    micro_batch_tokens: int = 4096
    """Prompt and output tokens per forward/backward (padding included; a shared prompt counted once)."""
    logprob_chunk: int = 256
    """Output positions per log-softmax chunk."""
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (actor and critic):
    # the activation memory of a micro-batch falls to about one layer's, for a quarter to a third more update time.
    gradient_checkpointing: bool = True
    """Recompute activations in the backward pass: less memory, a slower update."""
    # Samples with identical prompts (a forked group) computed as one sequence: the prompt once, then each output
    # (mhgpo/model/packing.py), in the update, the reference pass and the critic; the same log-probs, values and gradients
    # as one row per sample, for a fraction of the tokens.
    share_prefix: bool = True
    """Samples with one prompt computed as one sequence: the prompt once, then each output."""
    # The ratio's old log-probs: trainer (the policy's log-probs of the step's outputs, recomputed before the
    # update when another engine sampled them) or engine (the sampler's own, as it reported them: no extra pass)
    old_logprobs: str = "trainer"
    """The ratio's old log-probs: the trainer's (recomputed) or the engine's (as it reported them)."""
    # The policy objective (mhgpo/config/tables.py POLICY_LOSSES): null, the algorithm's (the paper's clipped
    # objective with the k3 KL term)
    loss: str | None = None
    """The policy objective (null: the algorithm's)."""
    # generation.engine=vllm with old_logprobs=trainer: each token's policy-gradient term is weighted by the
    # truncated importance weight min(exp(log p_trainer - log p_engine), engine_is_cap) on the engine / trainer
    # mismatch (TIS; docs/vllm.md); null: no weight
    engine_is_cap: float | None = None
    """The cap of the truncated importance weight on the engine / trainer mismatch (TIS; null: no weight)."""
    # e.g. {reranker: 3.0e-5}: each role's adapter in a parameter group of its own (roles not named: `lr`); the
    # warm-up and schedule scale every group alike
    role_lr: dict[str, float] = dataclasses.field(default_factory=dict)
    """A learning rate per role, {role: lr} (one adapter per role: lora.per_role; roles not named train at lr)."""

    def validate(self) -> None:
        if self.old_logprobs not in OLD_LOGPROBS:
            raise InputError(f"optim.old_logprobs: expected {one_of(OLD_LOGPROBS)}, got {self.old_logprobs!r}")
        if self.engine_is_cap is not None and not self.engine_is_cap >= 1:
            raise InputError(f"optim.engine_is_cap: must be at least 1 (null: no weight), got {self.engine_is_cap}")
        if self.schedule not in SCHEDULES:
            raise InputError(f"optim.schedule: expected {one_of(SCHEDULES)}, got {self.schedule!r}")
        if self.lr <= 0:
            raise InputError(f"optim.lr: must be positive, got {self.lr}")
        for role, lr in self.role_lr.items():
            if not lr > 0:
                raise InputError(f"optim.role_lr.{role}: must be positive, got {lr}")
        for key in ("ppo_epochs", "micro_batch_tokens", "logprob_chunk"):
            at_least(self, key, 1, "optim.")
        for key in ("warmup_steps", "weight_decay", "kl_beta", "entropy_coef"):
            if getattr(self, key) < 0:
                raise InputError(f"optim.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("max_grad_norm", "clip_eps"):
            if getattr(self, key) <= 0:
                raise InputError(f"optim.{key}: must be positive, got {getattr(self, key)}")


@dataclasses.dataclass
class LoraConfig:
    """Section `lora:`: low-rank adapters on a frozen base, or full fine-tuning."""

    enabled: bool = True
    """Train LoRA adapters (false: fine-tune every weight)."""
    r: int = 16
    """The adapters' rank."""
    alpha: int = 32
    """The adapters' scale alpha (their output times alpha / r)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    # One adapter per agent on the shared frozen base: each agent generates with, and is trained through, its own
    # adapter (no role's updates reach another role's outputs); the reference stays the base. False: one adapter
    # shared by every agent (the paper's parameter sharing).
    per_role: bool = False
    """One adapter per agent on the shared base (false: one adapter shared by every agent, as the paper)."""
    target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """The linear layers that get adapters (their names in the model)."""

    def validate(self) -> None:
        at_least(self, "r", 1, "lora.")
        if self.alpha <= 0:
            raise InputError(f"lora.alpha: must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise InputError(f"lora.dropout: must be in [0, 1), got {self.dropout}")


CRITIC_LR_FACTOR = 2.0  # the critic learns this much faster than the actor when critic.lr is null


def critic_lr(critic: CriticConfig, optim: OptimConfig) -> float:
    """The critic's learning rate: `critic.lr`, or `CRITIC_LR_FACTOR × optim.lr` when it is null."""
    return critic.lr if critic.lr is not None else CRITIC_LR_FACTOR * optim.lr


@dataclasses.dataclass
class CriticConfig:
    """The critic of MAPPO / PPO (`algo=mappo|ppo`; ignored otherwise): see `mhgpo/rl/critic.py`."""

    # null: CRITIC_LR_FACTOR × optim.lr, the paper's ratio (critic 1e-6, actor 5e-7); a number sets it outright
    lr: float | None = None
    """The critic's learning rate (null: 2 × optim.lr)."""
    warmup_steps: int = 0
    """First steps in which only the critic learns (the actor is not updated)."""
    gamma: float = 1.0
    """GAE's discount within an output."""
    lam: float = 0.95
    """GAE's lambda."""
    value_clip: float = 0.2
    """The clip range of the value loss around the rollout-time values."""
    whiten: bool = True
    """Normalise the step's advantages to mean 0, std 1 over its trained tokens."""
    # Under LoRA: false, the critic's decoder shares the actor's frozen base tensors (one model in memory); true, it
    # has a copy of its own, as the paper's MAPPO (actor and critic two models: the memory of one more model).
    own_base: bool = False
    """Under LoRA: the critic has a copy of the base of its own (false: it shares the actor's frozen base)."""

    def validate(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise InputError(f"critic.lr: must be positive (or null: {CRITIC_LR_FACTOR:g} × optim.lr), got {self.lr}")
        if self.warmup_steps < 0:
            raise InputError(f"critic.warmup_steps: must be >= 0, got {self.warmup_steps}")
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise InputError(f"critic.{key}: must be in [0, 1], got {getattr(self, key)}")
        if self.value_clip <= 0:
            raise InputError(f"critic.value_clip: must be positive, got {self.value_clip}")


@dataclasses.dataclass
class WarmStartConfig:
    """A supervised warm start before RL (`mhgpo/run/pipeline.py`): every role first learns its gold outputs, in
    `RUN/warm_start/` (an `mhgpo sft` run with the RL run's model, data, team, precision and LoRA settings)."""

    enabled: bool = False
    """Run a supervised warm start before RL."""
    # When a run starts, its `model` becomes the warm start's folder (RUN/warm_start, where RL starts from) and
    # this key records what lies beneath.
    model: str | None = None
    """The model the warm start fine-tunes (null: the run's model)."""
    steps: int = 20
    """Optimiser steps."""
    batch_size: int = 16
    """Demonstrations per step (all roles mixed)."""
    lr: float = 5e-4
    """The learning rate."""
    schedule: str = "constant"
    """The learning rate after the warm-up: constant, or a cosine decay to 0 over the remaining steps."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up (0: none)."""
    balance_roles: bool = False
    """Every batch holds the roles in equal shares (else drawn at random from all demonstrations)."""
    loss_weighting: str = "output"
    """How the cross-entropy weighs the gold tokens: `output` (each demonstration's token mean, then each role's mean
    over its demonstrations: the RL objective's weights; a short output weighs as much as a long one, so where gold
    outputs share a beginning, the token that ends the shorter ones outweighs the one that goes on) or `token`
    (each role's tokens alike, as a language model's loss: an output weighs by its length; then the roles' mean)."""
    limit: int | None = None
    """Training questions to draw demonstrations from (null: all of data)."""
    data: str | None = None
    """The questions whose gold outputs are learnt (null: the RL run's data)."""
    format_limit: int = 8
    """Held-out demonstrations per role for the logged format accuracy."""

    def validate(self) -> None:
        if self.format_limit < 0:
            raise InputError(f"warm_start.format_limit: must be >= 0, got {self.format_limit}")
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise InputError(f"warm_start.{key}: must be at least 1, got {getattr(self, key)}")
        if self.lr <= 0:
            raise InputError(f"warm_start.lr: must be positive, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise InputError(f"warm_start.schedule: expected {one_of(SCHEDULES)}, got {self.schedule!r}")
        if self.loss_weighting not in SFT_WEIGHTINGS:
            raise InputError(
                f"warm_start.loss_weighting: expected {one_of(SFT_WEIGHTINGS)}, got {self.loss_weighting!r}"
            )
        if self.warmup_steps < 0:
            raise InputError(f"warm_start.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"warm_start.limit: must be at least 1, got {self.limit}")


def check_sampler(name: str | None, algo: str) -> None:
    """`sampler` against the sampler table (mhgpo/config/samplers.py): a training sampler that `algo` trains with
    (:func:`mhgpo.config.samplers.trains_with`)."""
    entry = algorithm(algo)
    if name not in train_samplers():
        others = "; ".join(
            f"{n} for {'/'.join(a for a, e in ALGORITHMS.items() if trains_with(e, s))}"
            for n, s in SAMPLER_TABLE.items()
            if s.trains and not s.groups
        )
        raise InputError(f"sampler: expected {one_of(group_samplers())} (or {others}), got {name!r}")
    allowed = tuple(n for n, s in SAMPLER_TABLE.items() if trains_with(entry, s))
    if name in allowed:
        return
    if not any(SAMPLER_TABLE[n].groups for n in allowed):
        raise InputError(f"sampler: {algo} learns from independent chains (sampler={one_of(allowed)}), got {name!r}")
    if not SAMPLER_TABLE[name].groups:
        raise InputError(f"sampler: {name} forms no groups; {algo} needs {one_of(allowed)}")
    raise InputError(f"sampler: {algo} trains with {one_of(allowed)}, got {name!r}")


def default_sampler(algo: str, system: str) -> str:
    """The rollout sampler an algorithm uses when `sampler` is not set (its entry in `mhgpo/config/tables.py`): MHGPO
    on the default team → rr; GRPO, MHGPO on the single-agent system or on a workflow class → fof (G samples of one
    prompt at the first agent; RR needs `rr_probs` with one probability per agent of the team); MAPPO / PPO → chains
    (G independent chains). An unknown `algo` is left to :meth:`TrainConfig.validate` to name."""
    return ALGORITHMS[algo].default_sampler(system) if algo in ALGORITHMS else "fof"


@dataclasses.dataclass
class TrainingRunConfig(TeamRunConfig):
    """The keys RL training and the supervised warm start share (`TrainConfig`, `SFTConfig`) besides those of every
    run of the team: a run's warm start takes them over from it (:func:`mhgpo.config.eval.carry_over`)."""

    data: str = "synthetic:train"
    """The training questions: a data spec (docs/cli.md, "Data")."""
    val_data: str = "synthetic:dev"
    """The validation questions: a data spec."""
    eval_batch_size: int = 32
    """Validation questions per breadth-first batch."""
    max_rounds: int = 64
    """A safety bound on the workflow's steps per rollout."""
    # Questions whose rollout may fail in a workflow method (each skipped, logged with its traceback in the run
    # directory's errors.jsonl) before the run stops.
    max_failures: int = 10
    """Questions whose rollout may fail in a workflow method before the run stops (0: stop at the first)."""
    report_to: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """Trackers the metrics and the config go to besides metrics.jsonl (all but tensorboard are optional extras)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters or full fine-tuning."""

    def validate(self) -> None:
        super().validate()
        check_report_to(self.report_to)
        if self.max_failures < 0:
            raise InputError(f"max_failures: must be >= 0, got {self.max_failures}")
        check_counts(self, ("eval_batch_size", "max_rounds"))


@dataclasses.dataclass
class RolloutConfig:
    """Section `rollout:`: how rollouts overlap training (docs/vllm.md, "Rollouts that overlap the update")."""

    max_staleness: int = 0
    """Updates a rollout tree may lag the weights it trains (0: synchronous; 1: the next step's trees are sampled
    on a generation server while this step updates; an older tree is not trained)."""
    pipeline: bool | None = None
    """Tool calls and rewards of each generation batch run while the next batches generate, and the reference pass
    too where the engine samples outside the trainer's model; same results (null: on with a retrieval service or a
    generation server, where it pays)."""

    def validate(self) -> None:
        if self.max_staleness not in (0, 1):
            raise InputError(f"rollout.max_staleness: expected 0 or 1, got {self.max_staleness!r}")


@dataclasses.dataclass
class TrainConfig(TrainingRunConfig):
    """`mhgpo train` and `mhgpo demo`: reinforcement learning of the team, after an optional warm start."""

    algo: str = "mhgpo"
    """The algorithm: mhgpo or mappo (the team); grpo or ppo (the single-agent baseline, system=llm)."""
    sampler: str | None = None
    """The rollout sampler (mhgpo/config/samplers.py; null: the algorithm's default for the system)."""
    steps: int = 20
    """RL steps."""
    # A step starts only if the minutes used so far plus the mean step so far still fit; the run then validates and
    # saves at the step it stops at, as at its last. `steps` still caps the run.
    budget_minutes: float | None = None
    """A time budget for the RL steps, minutes (mhgpo/runtime/budget.py; null: none)."""
    budget_clock: str = "cpu"
    """The budget's clock: the process's CPU time (fair when runs share a machine) or wall time."""
    questions_per_step: int = 8
    """Questions rolled out per step."""
    group_size: int = 4
    """G: samples per group (at the fork point), or independent chains per question (MAPPO, PPO)."""
    rr_probs: list[float] = dataclasses.field(default_factory=lambda: [0.7, 0.1, 0.2])
    """sampler=rr: the probability that each agent, in the team's order, is the fork point."""
    rr_regroup: str = "fork"
    """sampler=rr: what the singletons upstream of the fork are pooled by (mhgpo/rl/advantages.py)."""
    # mhgpo: the sampler's, heterogeneous; mhgpo_mean: the same without the std (A = R - mean_g); agent: one per
    # agent across the step, as Dr.MAS; prompt_agent_turn: same prompt, agent and visit, as AT-GRPO (singletons
    # untrained)
    advantage: str = "mhgpo"
    """The groups advantages are normalised in (mhgpo/config/tables.py)."""
    filter_zero_variance: bool = False
    """Untrain groups whose rewards are all equal, drawing more questions until the step holds as many informative
    groups as a plain draw forms."""
    filter_max_questions: int | None = None
    """filter_zero_variance: questions a step may draw at most (null: 4 × questions_per_step)."""
    output_dir: str = "runs/train"
    """The run directory (new or empty)."""
    eval_every: int = 10
    """Validation every this many steps (0: never during training)."""
    val_limit: int = 50
    """The first this many questions of val_data validate."""
    save_every: int = 10
    """A checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept, the latest (0: all)."""
    train_roles: list[str] | None = None
    """The roles that train (null: every role)."""
    frozen_roles: list[str] = dataclasses.field(default_factory=list)
    """Roles that do not train."""
    # init: `model`, a trained run's weights included; base: the base model beneath a trained run given as `model`
    # (what its own first run started from)
    reference: str = "init"
    """The KL term's reference policy: the initial weights (init) or the base model beneath a trained run (base)."""
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    """The supervised warm start before RL."""
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    """The rewards."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The policy's optimiser and objective."""
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    """The critic of MAPPO and PPO."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """The engine that samples the rollouts."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """How rollouts overlap training."""

    def resolved(self) -> TrainConfig:
        """This config with the defaults that depend on other keys filled in (the loader calls it before
        :meth:`validate`, so the dumped config names them): `sampler` from `algo` and `system`."""
        if self.sampler is not None:
            return self
        return dataclasses.replace(self, sampler=default_sampler(self.algo, self.system))

    def validate(self) -> None:
        super().validate()
        if self.reference not in REFERENCES:
            raise InputError(f"reference: expected {one_of(REFERENCES)}, got {self.reference!r}")
        if self.algo not in ALGORITHMS:
            raise InputError(f"algo: expected {one_of(tuple(ALGORITHMS))}, got {self.algo!r}")
        algo = ALGORITHMS[self.algo]
        if algo.single_agent and self.system != "llm":
            team = one_of(tuple(a for a, e in ALGORITHMS.items() if not e.single_agent))
            raise InputError(
                f"algo: {self.algo} is the single-agent baseline (system=llm); the team "
                f"(system={self.system}) trains with {team}"
            )
        check_sampler(self.sampler, self.algo)
        least = 1 if algo.critic else 2  # a group needs 2; chains per question need 1
        if self.group_size < least:
            raise InputError(f"group_size: must be at least {least}, got {self.group_size}")
        check_counts(self, ("steps", "questions_per_step", "val_limit"))
        if self.budget_minutes is not None and self.budget_minutes <= 0:
            raise InputError(f"budget_minutes: must be positive (or null: no budget), got {self.budget_minutes:g}")
        if self.budget_clock not in BUDGET_CLOCKS:
            raise InputError(f"budget_clock: expected {one_of(BUDGET_CLOCKS)}, got {self.budget_clock!r}")
        for key in ("eval_every", "save_every", "keep_checkpoints"):
            if getattr(self, key) < 0:
                raise InputError(f"{key}: must be >= 0 (0: never / keep all), got {getattr(self, key)}")
        # rr_probs is a distribution over the agents: rejected rather than normalised, so that the config that is
        # dumped with the run is the one that ran
        if any(p < 0 for p in self.rr_probs) or abs(sum(self.rr_probs) - 1.0) > 1e-6:
            raise InputError(
                f"rr_probs: expected non-negative probabilities that sum to 1, got {self.rr_probs} "
                f"(sum {sum(self.rr_probs):g})"
            )
        if self.advantage not in ADVANTAGE_SCHEMES:
            raise InputError(f"advantage: expected {one_of(tuple(ADVANTAGE_SCHEMES))}, got {self.advantage!r}")
        if self.advantage != "mhgpo" and algo.critic:
            raise InputError(
                f"advantage: {self.algo}'s advantages come from its critic (GAE); advantage="
                f"{self.advantage} is for group-relative algorithms (mhgpo, grpo)"
            )
        if self.rr_regroup not in RR_REGROUP:
            raise InputError(f"rr_regroup: expected {', '.join(RR_REGROUP)}, got {self.rr_regroup!r}")
        if self.optim.loss is not None and self.optim.loss not in POLICY_LOSSES:
            raise InputError(f"optim.loss: expected {one_of(tuple(POLICY_LOSSES))} (or null), got {self.optim.loss!r}")
        check_engine_is_cap(self)
        check_engine_weights(self)
        if self.optim.role_lr and not (self.lora.enabled and self.lora.per_role):
            raise InputError(
                "optim.role_lr: a learning rate per role needs an adapter per role (lora.enabled=true, "
                "lora.per_role=true)"
            )
        if self.filter_zero_variance and algo.critic:
            raise InputError(f"filter_zero_variance: {self.algo} forms no groups (its critic is the baseline)")
        if self.filter_max_questions is not None and self.filter_max_questions < self.questions_per_step:
            raise InputError(
                f"filter_max_questions: must be at least questions_per_step ({self.questions_per_step}),"
                f" got {self.filter_max_questions}"
            )


def check_engine_is_cap(cfg: TrainConfig) -> None:
    """`optim.engine_is_cap` weighs the engine / trainer mismatch: it needs a separate engine and the trainer's old
    log-probs (with optim.old_logprobs=engine the ratio already divides by the engine's: the weight would be 1)."""
    if cfg.optim.engine_is_cap is None:
        return
    if not ENGINES[cfg.generation.engine].separate:
        raise InputError(
            f"optim.engine_is_cap: weighs the mismatch between a separate engine and the trainer; "
            f"generation.engine={cfg.generation.engine} samples with the trainer (set it to null)"
        )
    if cfg.optim.old_logprobs != "trainer":
        raise InputError(
            "optim.engine_is_cap: the weight exp(log p_trainer - log p_engine) needs the trainer's old log-probs; "
            "with optim.old_logprobs=engine the ratio already divides by the engine's (use optim.old_logprobs=trainer)"
        )


def check_engine_weights(cfg: TrainConfig) -> None:
    """What the engine must take: full fine-tuning needs an engine that takes full weights; a loss that needs the
    sampler's log-probs (IcePop) needs a separate engine and the trainer's old log-probs; `rollout.max_staleness`
    above 0 needs an engine in other processes (servers), which samples while the trainer updates, and LoRA (full
    weights are reloaded in place: no tree may grow across a hand-over)."""
    engine = ENGINES[cfg.generation.engine]
    if not cfg.lora.enabled and not engine.full_weights:
        raise InputError(
            f"lora.enabled: generation.engine={engine.name} takes the trained weights as LoRA adapters only "
            f"(use lora.enabled=true)"
        )
    loss = POLICY_LOSSES[cfg.optim.loss or ALGORITHMS[cfg.algo].loss]
    if loss.engine and not (engine.separate and cfg.optim.old_logprobs == "trainer"):
        raise InputError(
            f"optim.loss: {loss.name} compares the trainer's log-probs with the sampler's; it needs a separate engine "
            f"(generation.engine=vllm or vllm_server, got {engine.name}) and optim.old_logprobs=trainer "
            f"(got {cfg.optim.old_logprobs})"
        )
    if cfg.rollout.max_staleness > 0 and not engine.remote:
        raise InputError(
            f"rollout.max_staleness: rollouts overlap the update only on an engine in other processes "
            f"(generation.engine=vllm_server); generation.engine={engine.name} samples between updates (set it to 0)"
        )
    if cfg.rollout.max_staleness > 0 and not cfg.lora.enabled:
        raise InputError(
            f"rollout.max_staleness: full fine-tuning reloads the servers' weights in place, so no rollout may grow "
            f"across a hand-over (set it to 0, or train LoRA adapters: lora.enabled=true); got "
            f"{cfg.rollout.max_staleness}"
        )


def rollout_pipelined(cfg: Any) -> bool:
    """Whether the rollouts pipeline their tool calls and rewards (`rollout.pipeline`; null: where the tools wait on
    a retrieval service or the engine samples in other processes, so that the overlap pays). `cfg`: a training
    config, or an evaluation's or a warm start's (no `rollout` section: null; no `generation` section: hf)."""
    choice = getattr(getattr(cfg, "rollout", None), "pipeline", None)
    if choice is not None:
        return bool(choice)
    engine = getattr(getattr(cfg, "generation", None), "engine", "hf")
    return is_retriever_url(cfg.retrieval.retriever) or ENGINES[engine].remote


def check_report_to(names: list[str]) -> None:
    """`report_to`: trackers from TRACKERS, each once (whether each is installed is checked when a run starts)."""
    for name in names:
        if name not in TRACKERS:
            raise InputError(
                f"report_to: unknown tracker {name!r} (choose from {', '.join(TRACKERS)}; [] for metrics.jsonl alone)"
            )
    if len(set(names)) != len(names):
        raise InputError(f"report_to: {names} names a tracker twice")


# --------------------------------------------------------------------------------------------- warm start


def _sft_optim() -> OptimConfig:
    return OptimConfig(lr=5e-4, kl_beta=0.0, warmup_steps=0, schedule="constant")


@dataclasses.dataclass
class SFTConfig(TrainingRunConfig):
    """`mhgpo sft`: supervised warm start of every role on its gold outputs (`mhgpo/rl/sft.py`). The `search` and
    `retrieval` sections must match the RL run's, so that the prompts are the same."""

    roles: list[str] | None = None
    """The roles that learn (null: every role with demonstrations)."""
    steps: int = 40
    """Optimiser steps."""
    batch_size: int = 16
    """Demonstrations per optimiser step (all roles mixed)."""
    balance_roles: bool = False
    """Every batch holds the roles in equal shares (else drawn at random from all demonstrations)."""
    loss_weighting: str = "output"
    """How the cross-entropy weighs the gold tokens: `output` (each demonstration's token mean, then each role's mean
    over its demonstrations: the RL objective's weights; a short output weighs as much as a long one, so where gold
    outputs share a beginning, the token that ends the shorter ones outweighs the one that goes on) or `token`
    (each role's tokens alike, as a language model's loss: an output weighs by its length; then the roles' mean)."""
    limit: int | None = None
    """Training questions to draw demonstrations from (null: all)."""
    output_dir: str = "runs/sft"
    """The run directory (new or empty)."""
    eval_every: int = 0
    """Validation every this many steps (0: at the end only)."""
    val_limit: int = 40
    """Validation questions for the team's Acc / EM / F1 (0: none)."""
    format_limit: int = 16
    """Held-out demonstrations per role for the format accuracy."""
    eval_batch_size: int = 40
    """Validation questions per breadth-first batch."""
    save_every: int = 0
    """A checkpoint every this many steps (0: at the end only)."""
    keep_checkpoints: int = 1
    """Checkpoints kept, the latest (0: all)."""
    optim: OptimConfig = dataclasses.field(default_factory=_sft_optim)
    """The optimiser and learning-rate schedule (defaults: lr 5e-4, no KL term, no warm-up, constant)."""

    def validate(self) -> None:
        super().validate()
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise InputError(f"{key}: must be at least 1, got {getattr(self, key)}")
        for key in ("eval_every", "val_limit", "format_limit", "save_every"):
            if getattr(self, key) < 0:
                raise InputError(f"{key}: must be >= 0, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"limit: must be at least 1, got {self.limit}")
        if self.loss_weighting not in SFT_WEIGHTINGS:
            raise InputError(f"loss_weighting: expected {one_of(SFT_WEIGHTINGS)}, got {self.loss_weighting!r}")
        if self.optim.role_lr:
            raise InputError("optim.role_lr: a warm start trains one shared adapter; set it on the RL run instead")
        if self.lora.per_role:
            raise InputError(
                "lora.per_role: a warm start trains one shared adapter (merged into the base when an RL "
                "run starts from it); set lora.per_role=true on the RL run instead"
            )
