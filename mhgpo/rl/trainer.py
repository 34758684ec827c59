"""The MHGPO training loop (paper Algorithm 4).

Each step: take `questions_per_step` questions; run the sampler's rollout trees breadth-first; score the leaves
(F1), propagate rewards backward (Aggr), add the agent-specific penalties, normalise advantages within group ids;
update the shared policy with the clipped objective and k3 KL; log, evaluate every `eval_every` steps, save
checkpoints. Ctrl-C or SIGTERM saves a checkpoint of the last completed step before exiting, and
`resume(run_dir)` continues from the last checkpoint with the same results as an uninterrupted run (on CPU).

A question whose rollout fails in a workflow method is left out of its step (the other questions' groups, rewards
and loss weights are those of a batch without it) and logged with its traceback in `errors.jsonl`; more than
`max_failures` such questions in a run stop it, with the last completed step saved.

The baselines share the loop: GRPO is the group-relative path on the single-agent system; MAPPO /
PPO (`algo=mappo|ppo`) replace the group advantages with the critic's GAE (`mhgpo/rl/critic.py`) and update the
critic before the policy; `train_roles` / `frozen_roles` untrain whole roles after the rewards are assigned.

Under `accelerate launch` the trainer runs on every rank (`mhgpo/model/distributed.py`, docs/design.md §5): each rank
rolls out its share of the step's questions, the trees are gathered and the step's bookkeeping runs on all of them,
the update is cut across the ranks, and rank 0 writes the run.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhgpo.config import CRITIC_ALGOS, TrainConfig, dump_config, to_dict
from mhgpo.config.samplers import sampler as sampler_entry
from mhgpo.data.records import Example
from mhgpo.errors import InputError, NotFinite, RunError, ServiceError
from mhgpo.model import sharding
from mhgpo.model.checkpoint import Live, list_checkpoints, load_checkpoint, save_checkpoint, snapshot
from mhgpo.model.distributed import Single, current
from mhgpo.model.statecodec import rng_states
from mhgpo.rl.advantages import (
    aggregated,
    drop_zero_variance,
    group_advantages,
    propagate_rewards,
    scheme_groups,
    total_rewards,
)
from mhgpo.rl.behaviour import agent_behaviour
from mhgpo.rl.evaluation import evaluate_examples, merge_results
from mhgpo.rl.policy import Policy, Sample, peak_memory_mb, weights_finite
from mhgpo.rl.rollout import RolloutBatch, RolloutSpec, assign_groups, merge_batches, run_rollouts
from mhgpo.rl.runlog import NoLog, RunLog, write_rollouts
from mhgpo.rl.stopguard import StopGuard
from mhgpo.rl.trackers import require_trackers
from mhgpo.team.workflow import Workflow


def assign_shared_rewards(batch: RolloutBatch, aggr: str, use_penalties: bool, rng: np.random.Generator) -> np.ndarray:
    """Backward propagation (paper Eq. aggr) and R = R_shared + R_specific on every node; returns R (N,)."""
    nodes = batch.nodes
    parents = np.array([n.parent_id for n in nodes], dtype=np.int64)  # (N,)
    terminal = np.array([n.terminal for n in nodes], dtype=np.float64)  # (N,) NaN except at leaves
    shared = propagate_rewards(parents, terminal, aggr, rng)  # (N,)
    penalties = np.array([n.penalty if n.kind == "llm" else 0.0 for n in nodes])  # (N,)
    rewards = total_rewards(shared, penalties, use_penalties)  # (N,)
    for n, s, r in zip(nodes, shared, rewards):
        n.reward_shared, n.reward = float(s), float(r)
    return rewards


def assign_rewards(
    batch: RolloutBatch, aggr: str, use_penalties: bool, rng: np.random.Generator, scheme: str = "mhgpo"
) -> dict[str, float]:
    """Backward propagation (paper Eq. aggr), R = R_shared + R_specific, advantages per group id (Eq. adv). A
    `scheme` other than `mhgpo` first replaces the sampler's groups by its own (`advantages.scheme_groups`); the
    samples it leaves in groups of one are untrained and counted in `singletons_dropped`."""
    rewards = assign_shared_rewards(batch, aggr, use_penalties, rng)  # (N,)
    nodes = batch.nodes
    group_ids = np.array([n.group_id for n in nodes], dtype=np.int64)  # (N,)
    if scheme != "mhgpo":
        prompts: dict[tuple[int, ...], int] = {}
        prompt_keys = np.array([prompts.setdefault(tuple(n.prompt_ids), len(prompts)) for n in nodes])  # (N,)
        group_ids, dropped = scheme_groups(
            scheme, group_ids, np.array([n.agent for n in nodes]), prompt_keys, np.array([n.visit for n in nodes])
        )  # (N,)
        for n, g in zip(nodes, group_ids):
            n.group_id = int(g)
        batch.stats["singletons_dropped"] = batch.stats.get("singletons_dropped", 0.0) + dropped
        batch.stats["samples"] = float((group_ids >= 0).sum())
    advantages, stats = group_advantages(rewards, group_ids)  # (N,)
    for n, a in zip(nodes, advantages):
        n.advantage = float(a)
    return {k: float(v) for k, v in stats.items()}


def apply_role_switches(batch: RolloutBatch, train_roles: list[str] | None, frozen_roles: list[str]) -> int:
    """Untrain the samples of frozen roles (or of roles outside `train_roles`): group id -1, advantage 0. They
    still acted (their outputs fed the next agents and their rewards were propagated). Returns their count."""
    count = 0
    for n in batch.nodes:
        if (
            n.kind == "llm"
            and n.trained
            and ((train_roles is not None and n.agent not in train_roles) or n.agent in frozen_roles)
        ):
            n.group_id = -1
            n.advantage = 0.0
            count += 1
    return count


def step_metrics(batch: RolloutBatch, workflow: Workflow) -> dict[str, float]:
    llm = batch.llm_nodes()
    leaves = batch.leaves()
    out: dict[str, float] = {"reward/mean": float(np.mean([n.terminal for n in leaves])) if leaves else 0.0}
    for agent in workflow.agents:
        mine = [n for n in llm if n.agent == agent]
        if not mine:
            continue
        trained = [n for n in mine if n.trained]
        out[f"{agent}/reward"] = float(np.mean([n.reward for n in mine]))
        out[f"{agent}/penalty"] = float(np.mean([n.penalty for n in mine]))
        out[f"{agent}/advantage_abs"] = float(np.mean([abs(n.advantage) for n in trained])) if trained else 0.0
        out[f"{agent}/samples"] = float(len(trained))
    out.update(agent_behaviour(llm, workflow))
    if leaves:  # the trained samples whose reward the aggregator (`reward.aggr`) decides
        parents = np.array([n.parent_id for n in batch.nodes], dtype=np.int64)  # (N,)
        terminal = np.array([n.terminal for n in batch.nodes], dtype=np.float64)  # (N,) NaN except at leaves
        in_loss = np.array([n.kind == "llm" and n.trained for n in batch.nodes])  # (N,)
        out["aggregated_samples"] = float((aggregated(parents, terminal) & in_loss).sum())
    return out


@dataclass
class TrainingSetup:
    """What training needs besides the config: data, the workflow (the team of agents) and the model pieces."""

    train: list[Example]
    val: list[Example]
    workflow: Workflow
    val_workflow: Workflow
    policy: Policy
    generator: Any
    encode: Callable[[list[dict[str, str]]], list[int]]
    critic: Any = None  # mhgpo.rl.critic.Critic for algo mappo | ppo
    engine_scratch: Path | None = None  # generation.engine=vllm: the folder of the adapters handed to the engine


@dataclass
class _Completed:
    """The run's state after its last completed step: what a step stopped half-way is rewound to."""

    rng: dict[str, Any]
    position: int
    failures: int
    saved_step: int  # the step of the last checkpoint this run wrote (or resumed from)


class TooManyFailures(InputError):
    """More questions failed in the workflow's methods than `max_failures` allows."""


def check_engine(cfg: TrainConfig, ranks: Single) -> None:
    """`generation.engine=vllm`: vLLM installed (a one-line error naming the install command, before anything
    slow), one process, no sharded actor."""
    if getattr(cfg, "generation", None) is None or cfg.generation.engine != "vllm":
        return
    from mhgpo.model.vllm_engine import require_vllm

    require_vllm()
    if ranks.world > 1:
        raise InputError(
            "generation.engine=vllm: the engine runs beside the trainer in one process; launch the "
            "run without accelerate, or use generation.engine=hf"
        )


def check_ranks(cfg: TrainConfig, ranks: Single) -> None:
    """What several ranks need of a config: each rolls out the same number of questions per step, and the warm
    start (a run of one process) is done beforehand; the generation engine's needs (:func:`check_engine`)."""
    check_engine(cfg, ranks)
    if ranks.world == 1:
        return
    if not isinstance(cfg, TrainConfig):
        raise InputError("only RL training (mhgpo train) runs on several processes")
    if sharding.requested() and cfg.lora.enabled and cfg.lora.per_role:
        raise InputError("FSDP: lora.per_role is not supported; launch with configs/accelerate/gpu_ddp.yaml")
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


class Trainer:
    def __init__(
        self, cfg: TrainConfig, setup: TrainingSetup, run_dir: Path, progress: bool = True, ranks: Single | None = None
    ):
        """`ranks`: the processes of a data-parallel run (default: :func:`mhgpo.model.distributed.current`; one process
        when not started by a launcher); rank 0 alone writes the run's files and shows progress."""
        self.ranks = ranks if ranks is not None else current()
        check_ranks(cfg, self.ranks)
        if self.ranks.is_main:
            require_trackers(cfg.report_to)
        progress = progress and self.ranks.is_main
        self.cfg, self.setup, self.run_dir, self.progress = cfg, setup, Path(run_dir), progress
        for part in (setup.policy, setup.critic):  # their updates cut the step's samples across the ranks
            if part is not None:
                part.ranks = self.ranks
        if self.ranks.world > 1 and sharding.requested():  # FSDP: the actor's layers sharded (mhgpo/model/sharding.py)
            try:
                setup.policy.shard(self.ranks.device, self.ranks.world)
            except ValueError as e:
                raise InputError(str(e)) from None
            if self.ranks.is_main:
                print(
                    f"mhgpo: FSDP: the actor's decoder layers sharded over {self.ranks.world} ranks",
                    file=sys.stderr,
                    flush=True,
                )
        self._guard: StopGuard | None = None
        self._updating = False  # inside a step's critical section: the weights belong to no saved step
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.position = 0  # questions consumed so far (defines the data order)
        self.failures = 0  # questions whose rollout failed so far (training and validation)
        self.val_history: list[dict[str, float]] = []
        self.last_eval: tuple[int, Any] | None = None  # (step, EvalResult) of the latest validation
        self._engine_synced = False  # whether a separate engine (vLLM) holds the policy's current weights

    # ------------------------------------------------------------------------------------------------- data

    def _next_questions(self, count: int) -> list[Example]:
        n = len(self.setup.train)
        out = []
        for _ in range(count):
            epoch, idx = divmod(self.position, n)
            order = np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
            out.append(self.setup.train[int(order[idx])])
            self.position += 1
        return out

    def _spec(self) -> RolloutSpec:
        return RolloutSpec(
            sampler=self.cfg.sampler,
            group_size=self.cfg.group_size,
            rr_probs=tuple(self.cfg.rr_probs),
            rr_regroup=self.cfg.rr_regroup,
            max_prompt_tokens=self.cfg.max_prompt_tokens,
        )

    # ------------------------------------------------------------------------------------------------- state

    def save(self, rng: dict[str, Any] | None = None) -> Path:
        """Write the checkpoint of the current step (rank 0; the other ranks hold the same state and write nothing)."""
        p = self.setup.policy
        # a sharded actor (FSDP) is gathered whole by every rank; else rank 0 alone reads it
        taken = snapshot(p.model, p.optimizer, self._extras()) if sharding.is_sharded(p.model) else None
        if not self.ranks.is_main:
            return self.run_dir / "checkpoints" / f"step_{self.step}"
        state = {"position": self.position, "val_history": self.val_history, "failures": self.failures}
        return save_checkpoint(
            self.run_dir,
            self.step,
            p.model,
            p.optimizer,
            p.scheduler,
            rng or rng_states(self.rng),
            state,
            self.cfg.keep_checkpoints,
            self._extras(),
            taken,
        )

    def _extras(self) -> dict[str, Any]:
        return {"critic": self.setup.critic.state()} if self.setup.critic is not None else {}

    def live(self) -> Live:
        """What a checkpoint of this run restores."""
        p = self.setup.policy
        return Live(p.model, p.optimizer, p.scheduler, self.rng, self._extras())

    def restore(self, path: Path) -> None:
        """Load a checkpoint; every file is checked against the model before anything changes."""
        state = load_checkpoint(path, self.live())
        self._engine_synced = False
        self.step, self.position = int(state["step"]), int(state["position"])
        self.val_history = list(state.get("val_history", []))
        self.failures = int(state.get("failures", 0))

    def _save_or_stop(self) -> Path:
        """Save a checkpoint; if the disk refuses (full, read-only), stop the run saying what is kept."""
        try:
            return self.save()
        except OSError as e:
            kept = list_checkpoints(self.run_dir)
            last = f"its last checkpoint is {kept[-1].name}" if kept else "it has no checkpoint yet"
            what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
            raise RunError(
                f"could not write the checkpoint of step {self.step} ({what}); the run stops at step "
                f"{self.step}; {last}; free space and continue with: mhgpo train --resume "
                f"{self.run_dir}"
            ) from e

    # ------------------------------------------------------------------------------------------------ engine

    def _engine_ready(self) -> None:
        """A separate engine (vLLM) holds the weights of the current step: synced when it may not (the run's
        first rollouts, a resumed run), without the check (no outputs of these weights yet)."""
        if self.setup.engine_scratch is not None and not self._engine_synced:
            from mhgpo.rl.engine_sync import sync

            sync(self.setup.generator, self.setup.policy, self.setup.engine_scratch, self.step)
            self._engine_synced = True

    def _sync_engine(self, samples: list[Sample], step: int) -> dict[str, float]:
        """After `step`'s update: the new weights handed to the engine, then checked (what the engine holds, and a
        few of the step's outputs scored, `generation.sync_check`); a failed check on any rank stops the run (the
        last checkpoint kept)."""
        from mhgpo.rl.engine_sync import check_sync, stop_if_any, sync, tolerance, verdict

        t = time.perf_counter()
        setup = self.setup
        sync(setup.generator, setup.policy, setup.engine_scratch, step)
        self._engine_synced = True
        out = {"seconds/engine_sync": time.perf_counter() - t}
        t = time.perf_counter()
        check = check_sync(setup.generator, setup.policy, samples, self.cfg.generation.sync_check, step)
        out.update(check.figures, **{"seconds/engine_check": time.perf_counter() - t})
        kept = list_checkpoints(self.run_dir)
        last = f"its last checkpoint is {kept[-1].name}" if kept else "it has no checkpoint yet"
        stop_if_any(verdict(check, tolerance(self.cfg), step, last), self.ranks, step, last)
        return out

    # -------------------------------------------------------------------------------------------------- loop

    def validate(self, desc: str = "") -> Any:
        """Greedy evaluation of the team on the fixed validation subset (an `EvalResult`); a progress bar with
        `desc`."""
        self._engine_ready()
        with sharding.gathered(self.setup.policy.model):  # FSDP: each rank decodes its own number of steps
            return self._validate(desc)

    def _validate(self, desc: str) -> Any:
        t = self.setup
        if self.ranks.world == 1:
            return evaluate_examples(
                t.val,
                t.val_workflow,
                t.generator,
                t.encode,
                self.cfg.eval_batch_size,
                progress=bool(desc) and self.progress,
                desc=desc or "eval",
                on_error="skip",
                max_prompt_tokens=self.cfg.max_prompt_tokens,
            )
        start = time.perf_counter()  # each rank its share of the questions, gathered in order
        mine = evaluate_examples(
            self.ranks.share(t.val),
            t.val_workflow,
            t.generator,
            t.encode,
            self.cfg.eval_batch_size,
            progress=bool(desc) and self.progress,
            desc=desc or "eval",
            on_error="skip",
            max_prompt_tokens=self.cfg.max_prompt_tokens,
        )
        return merge_results(self.ranks.gather(mine), t.val_workflow, time.perf_counter() - start)

    def collect(self) -> tuple[RolloutBatch, list[Sample], dict[str, float]]:
        """The step's first phase (no weight changes, safe to interrupt): rollouts, rewards, advantages (group
        ids for MHGPO / GRPO; the critic's GAE for MAPPO / PPO)."""
        cfg, setup = self.cfg, self.setup
        t0 = time.perf_counter()
        self._engine_ready()
        setup.policy.model.eval()
        with sharding.gathered(setup.policy.model):  # FSDP: each rank decodes its own number of steps
            batch, adv_stats, untrained, filter_stats = self._sample()
        trained = [n for n in batch.llm_nodes() if n.trained]
        samples = [
            Sample(
                n.prompt_ids,
                n.output_ids,
                list(n.logprobs),
                n.advantage,
                n.agent,
                setup.workflow.sampling(n.agent).temperature,
                reward=n.reward,
            )
            for n in trained
        ]
        engine_stats = {}
        if setup.engine_scratch is not None:  # a separate engine sampled them: whose old log-probs the ratio takes
            from mhgpo.rl.engine_sync import old_logprobs

            engine_stats = old_logprobs(setup.policy, samples, cfg.optim.old_logprobs)
        critic_stats = setup.critic.estimate(samples) if setup.critic is not None else {}
        if setup.critic is not None:
            for n, s in zip(trained, samples):  # the records show each output's mean token advantage
                n.advantage = float(np.mean(s.advantage)) if s.output_ids else 0.0
        metrics = step_metrics(batch, setup.workflow)
        metrics.update(
            failed_questions=batch.stats["failed_questions"],
            samples=float(len(samples)),
            groups=adv_stats["n_groups"],
            zero_variance_groups=adv_stats["n_zero_variance_groups"],
            singletons_dropped=batch.stats["singletons_dropped"],
            frozen_samples=float(untrained),
            **filter_stats,
            llm_calls=batch.stats["llm_calls"],
            tokens_generated=batch.stats["tokens_generated"],
            **critic_stats,
            **engine_stats,
            **{"seconds/rollout": time.perf_counter() - t0},
        )
        return batch, samples, metrics

    def _rollout(self, questions: list[Example]) -> tuple[RolloutBatch, dict[str, float], int]:
        """Rollout trees of `questions`, their rewards and advantages (group ids for MHGPO / GRPO; the critic's
        GAE later, for MAPPO / PPO), and the role switches; returns the batch, group counts and untrained count."""
        cfg, setup = self.cfg, self.setup
        batch = self._grow(questions, self.rng) if self.ranks.world == 1 else self._gather_trees(questions)
        assign_groups(batch, self._spec(), self.rng)  # (one process: run_rollouts' two halves, in its order)
        if setup.critic is None:
            adv_stats = assign_rewards(batch, cfg.reward.aggr, cfg.reward.penalties, self.rng, cfg.advantage)
        else:
            assign_shared_rewards(batch, cfg.reward.aggr, cfg.reward.penalties, self.rng)
            adv_stats = {"n_groups": 0.0, "n_zero_variance_groups": 0.0}
        return batch, adv_stats, apply_role_switches(batch, cfg.train_roles, cfg.frozen_roles)

    def _grow(self, questions: list[Example], rng: np.random.Generator) -> RolloutBatch:
        """The rollout trees of `questions`, scored, without group ids (`mhgpo.rl.rollout.run_rollouts`)."""
        setup = self.setup
        return run_rollouts(
            questions,
            setup.workflow,
            setup.generator,
            setup.encode,
            self._spec(),
            rng,
            max_rounds=self.cfg.max_rounds,
            on_error="skip",
            grouped=False,
        )

    def _gather_trees(self, questions: list[Example]) -> RolloutBatch:
        """Several ranks: this rank grows the trees of its share of `questions` (its own random streams, seeded by
        the run's seed, the data position and the rank) and the trees of every rank are gathered in rank order, so
        that the group ids are then assigned on the whole step, identically on every rank. A stop asked on any
        rank (a signal) stops every rank here, before the update."""
        ranks = self.ranks
        rng = np.random.default_rng([self.cfg.seed, self.position, ranks.rank])
        torch.manual_seed(int(rng.integers(2**62)))
        parts = ranks.gather((self._grow(ranks.share(questions), rng), self._guard is not None and self._guard.pending))
        if any(stop for _, stop in parts):
            raise KeyboardInterrupt
        return merge_batches([b for b, _ in parts])

    def _sample(self) -> tuple[RolloutBatch, dict[str, float], int, dict[str, float]]:
        """The step's rollouts. With `filter_zero_variance`, the groups whose rewards are all equal are untrained
        and more questions are drawn, `questions_per_step` at a time, until the step holds as many informative
        groups as its first draw formed groups, or `filter_max_questions` questions have been drawn."""
        cfg = self.cfg
        batch, adv_stats, untrained = self._rollout(self._next_questions(cfg.questions_per_step))
        if not cfg.filter_zero_variance:
            return batch, adv_stats, untrained, {}
        cap = cfg.filter_max_questions or 4 * cfg.questions_per_step
        batches, drawn, groups, dropped = [], 0, 0, 0
        target = None
        while True:
            drawn += len(batch.examples) + len(batch.failures)  # failed questions were drawn too
            ids = np.array([n.group_id for n in batch.nodes], dtype=np.int64)  # (N,)
            rewards = np.array([n.reward for n in batch.nodes], dtype=np.float64)  # (N,)
            kept, zero = drop_zero_variance(rewards, ids)
            for n, g in zip(batch.nodes, kept):
                if g < 0 and n.group_id >= 0:
                    n.group_id, n.advantage = -1, 0.0
            n_groups = len({int(g) for g in ids if g >= 0})
            target = n_groups if target is None else target
            groups, dropped = groups + n_groups, dropped + zero
            batches.append(batch)
            if groups - dropped >= target or drawn >= cap:
                break
            count = min(cfg.questions_per_step, cap - drawn)
            more, _, extra_untrained = self._rollout(self._next_questions(count))
            batch, untrained = more, untrained + extra_untrained
        merged = merge_batches(batches)
        stats = {"n_groups": float(groups - dropped), "n_zero_variance_groups": float(dropped)}
        return (
            merged,
            stats,
            untrained,
            {
                "groups/zero_variance_frac": dropped / groups if groups else 0.0,
                "filter/questions": float(drawn),
                "filter/extra_questions": float(drawn - cfg.questions_per_step),
            },
        )

    def learn(self, samples: list[Sample], metrics: dict[str, float]) -> dict[str, float]:
        """The step's second phase: the critic's update (MAPPO / PPO), then the policy's, except during the
        critic's warm-up (`critic.warmup_steps`) where only the critic learns. Run it where a signal cannot cut
        it in half."""
        t = time.perf_counter()
        critic = self.setup.critic
        comm = getattr(self.ranks, "comm_seconds", 0.0)
        if critic is not None:
            metrics.update(critic.update(samples))
            metrics["actor_updated"] = float(self.step >= self.cfg.critic.warmup_steps)
        if critic is None or metrics["actor_updated"]:
            metrics.update(self.setup.policy.update(samples))
        metrics["seconds/train"] = time.perf_counter() - t
        if self.setup.engine_scratch is not None:
            metrics.update(self._sync_engine(samples, self.step + 1))
        if self.ranks.world > 1:  # the update's all-reduces (gradients, statistics), on rank 0
            metrics["seconds/train_communication"] = self.ranks.comm_seconds - comm
        return metrics

    def train_step(self) -> dict[str, float]:
        """Both phases of one step, counted, without logging or checkpoints (benchmarks, tests)."""
        batch, samples, metrics = self.collect()
        self._last_batch = batch
        metrics = self.learn(samples, metrics)
        self.step += 1
        return metrics

    def run(self) -> dict[str, Any]:
        """Train until `cfg.steps`: each step collected, then learned, validated, logged and saved as one critical
        section; an interrupt or too many failures save what is complete and re-raise."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        if self.ranks.is_main:
            dump_config(cfg, self.run_dir / "config.yaml")
        log = (
            RunLog(self.run_dir, resume_step=self.step, report_to=cfg.report_to, config=to_dict(cfg))
            if self.ranks.is_main
            else NoLog()
        )
        bar = tqdm(
            total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not self.progress, dynamic_ncols=True
        )
        done = _Completed(rng_states(self.rng), self.position, self.failures, saved_step=self.step)
        guard: StopGuard | None = None
        try:
            with StopGuard(deferred=self.ranks.world > 1) as guard:
                self._guard = guard
                while self.step < cfg.steps:
                    metrics = self._run_step(log, guard, done)
                    bar.update(1)
                    bar.set_postfix(self._postfix(metrics))
        except (KeyboardInterrupt, TooManyFailures, ServiceError) as stop:  # the last completed step is saved
            bar.close()
            if not (isinstance(stop, ServiceError) and self._updating):  # (a failed validation after an update:
                self._save_on_stop(stop, guard, done)  # those weights are no step's, not saved)
            if isinstance(stop, ServiceError):
                kept = list_checkpoints(self.run_dir)
                then = (
                    f"its last checkpoint is {kept[-1].name}; continue with: mhgpo train --resume {self.run_dir}"
                    if kept
                    else f"it has no checkpoint yet: start it again (in another folder, or after "
                    f"removing {self.run_dir})"
                )
                raise ServiceError(f"{stop}; the run stops at step {self.step}; {then}") from stop
            raise
        finally:
            bar.close()
            log.close(finished=self.step >= cfg.steps)
        return {"steps": self.step, "val": self.val_history}

    def _run_step(self, log: RunLog, guard: StopGuard, done: _Completed) -> dict[str, float]:
        """One step: collect (safe to interrupt), then learn, validate, log and save. From the first weight change
        on, the step is completed (logged, saved) before a signal stops the run: an interrupted update would leave
        weights that belong to no step."""
        batch, samples, metrics = self.collect()
        if batch is not None:  # (the supervised warm start has no rollouts)
            self._failed(log, self.step + 1, "train", batch.failures)
        with guard.critical():
            self._updating = True
            step = self.step + 1
            try:
                metrics = self.learn(samples, metrics)
                if not weights_finite(self.setup.policy.params, self.ranks):
                    raise NotFinite("the trained weights are not finite after the update")
            except NotFinite as e:
                raise self._not_finite(log, step, e) from None
            if self._validates_at(step):
                metrics.update(self._validate_in_run(log, step))
            metrics["memory/peak_mb"] = peak_memory_mb()
            if batch is not None and self.ranks.is_main:
                write_rollouts(self.run_dir, step, batch)
            log.log(step, metrics)
            self.step = step
            done.rng, done.position, done.failures = rng_states(self.rng), self.position, self.failures
            if self._saves_at(step):
                self._save_or_stop()
                done.saved_step = step
            self._updating = False
        if guard.deferred and self.ranks.any(guard.pending):  # several ranks: a signal on any stops them all here
            raise KeyboardInterrupt
        return metrics

    def _not_finite(self, log: RunLog, step: int, e: NotFinite) -> RunError:
        """The error that stops a run whose update met a NaN / infinite loss, gradient or weight: nothing of this
        step is logged or saved (a checkpoint of it would rotate a good one away), errors.jsonl says why."""
        kept = list_checkpoints(self.run_dir)
        last = f"the last good checkpoint {kept[-1].name} is kept" if kept else "no checkpoint was saved before it"
        log.error(step, {"phase": "train", "error": str(e)})
        return RunError(f"step {step}: {e}; {last} (lower optim.lr, or check the data and rewards)")

    def _validate_in_run(self, log: RunLog, step: int) -> dict[str, float]:
        """Validate after `step`'s update: recorded in `val_history` and `last_eval`; returns the step's val
        metrics (its failures are logged, and stop the run at the next step's start when too many)."""
        t = time.perf_counter()
        res = self.validate()
        self._failed(log, step, "val", res.failures, stop=False)
        self.last_eval = (step, res)
        scores = {f"val/{k}": res.metrics[k] for k in ("f1", "em", "acc")}
        self.val_history.append({"step": step, **scores})
        return {**scores, "seconds/eval": time.perf_counter() - t}

    def _postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's figures: the step's mean reward (or loss) and the latest val F1."""
        post = (
            {"reward": f"{metrics['reward/mean']:.3f}"}
            if "reward/mean" in metrics
            else {"loss": f"{metrics.get('loss', 0.0):.3f}"}
        )
        if self.val_history:
            post["val_f1"] = f"{self.val_history[-1]['val/f1']:.1f}"
        return post

    def _save_on_stop(self, stop: BaseException, guard: StopGuard | None, done: _Completed) -> None:
        """On an interrupt (or too many failures): save the last completed step unless it is saved already,
        rewinding a step stopped half-way (data position, failures, rng); a second signal inside a critical
        section saves nothing."""
        if guard is not None and guard.aborted:
            print("mhgpo: aborted; nothing saved", flush=True)
            return
        if done.saved_step != self.step:
            self._save_last(stop, done)
        if guard is not None and guard.deferred:  # every rank stopped here: none ends before rank 0 has saved
            self.ranks.barrier()

    def _save_last(self, stop: BaseException, done: _Completed) -> None:
        rng = None
        if self.position != done.position:  # stopped inside a step: rewind it
            self.position, self.failures = done.position, done.failures
            rng = done.rng
        path = self.save(rng)
        if not self.ranks.is_main:
            return
        why = "interrupted" if isinstance(stop, KeyboardInterrupt) else "stopped"
        print(f"mhgpo: {why}; saved {path} (resume with: mhgpo train --resume {self.run_dir})", flush=True)

    def _validates_at(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    def _saves_at(self, step: int) -> bool:
        every = self.cfg.save_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    def _failed(self, log: RunLog, step: int, phase: str, failures: list, stop: bool = True) -> None:
        """Log the questions that failed (errors.jsonl, a warning) and count them; more than `max_failures` in the
        run stop it (`stop`: at once, before the step's update; else at the next step's start)."""
        for f in failures:
            self.failures += 1
            log.error(step, {"phase": phase, **f.record()})
            if self.ranks.is_main:
                _warn(
                    f"{f.message()}; question skipped, traceback in {self.run_dir / 'errors.jsonl'} "
                    f"({self.failures} failed of max_failures={self.cfg.max_failures})"
                )
        if stop and self.failures > self.cfg.max_failures:
            last = failures[-1].message() if failures else "the last failures are in errors.jsonl"
            raise TooManyFailures(
                f"{last}; {self.failures} questions failed in the workflow, more than max_failures="
                f"{self.cfg.max_failures} (tracebacks in {self.run_dir / 'errors.jsonl'})"
            )


def _warn(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"mhgpo: warning: {text}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------- builders


def load_team_data(
    cfg: Any, with_val: bool, val_limit: int | None = None, workflow: Any = None
) -> tuple[list[Example], list[Example], Workflow, Workflow]:
    """The training and validation examples of `cfg` (`data`, `val_data`, `val_limit`) and the workflows that
    answer them (one, or one per data set when each brings its own context corpus). `workflow`: the `Team`
    resolved at the entry (`team.build.resolve_team`), or what `resolve_team` takes."""
    from mhgpo.team.build import build_workflow, load_examples, resolve_team

    train = load_examples(cfg.data)
    val = load_examples(cfg.val_data, cfg.val_limit if val_limit is None else val_limit) if with_val else []
    team = resolve_team(cfg, workflow)
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


def build_team(cfg: TrainConfig, with_val: bool = False, workflow: Any = None) -> TrainingSetup:
    """The data, workflows (`workflow`: see `load_team_data`) and model pieces of `cfg`; the validation set is
    loaded when `cfg.eval_every` asks for it or `with_val` (the demo evaluates before and after training whatever
    `eval_every` says)."""
    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.precision import announce, default_device, resolve_precision, weight_dtype
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import initial_weights, run_model_spec

    require_trackers(cfg.report_to)  # before anything slow
    check_engine(cfg, Single())  # before the data and the model
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    train, val, workflow, val_workflow = load_team_data(cfg, bool(cfg.eval_every) or with_val, workflow=workflow)
    roles = set(workflow.agents)
    for key, names in (("train_roles", cfg.train_roles or []), ("frozen_roles", cfg.frozen_roles)):
        bad = [r for r in names if r not in roles]
        if bad:
            raise InputError(f"{key}: unknown role {bad[0]!r} (roles: {', '.join(workflow.agents)})")
    if sampler_entry(cfg.sampler).forks == "drawn" and len(cfg.rr_probs) != len(workflow.agents):
        raise InputError(
            f"rr_probs: {len(cfg.rr_probs)} probabilities for the {len(workflow.agents)} agents "
            f"({', '.join(workflow.agents)}) of system={cfg.system}"
        )
    device = default_device()
    cfg.precision, reason = resolve_precision(cfg.precision, device)  # the run's config.yaml records the result
    # `model` may be a trained run (its weights merged: the initial weights); `reference=base` keeps what lies
    # beneath. LoRA: the frozen base may be stored in bfloat16 (bf16-mixed); full fine-tuning: the master weights
    loaded, reference = initial_weights(
        run_model_spec(cfg.model, Path(cfg.output_dir)),
        cfg.reference,
        cfg.lora.enabled,
        device=device,
        dtype=weight_dtype(cfg.precision, trainable=not cfg.lora.enabled),
    )
    announce(cfg.precision, reason)
    engine, scratch = None, None
    if cfg.generation.engine == "vllm":  # on the initial weights, before LoRA wraps the model
        from mhgpo.model.vllm_engine import scratch_dir
        from mhgpo.rl.engine_sync import build_engine

        scratch = scratch_dir()
        engine = build_engine(cfg, run_model_spec(cfg.model, Path(cfg.output_dir)), loaded, scratch)
    critic = None
    actor_steps = cfg.steps
    pad_id = loaded.tokenizer.pad_token_id
    if cfg.algo in CRITIC_ALGOS:  # before the policy wraps the model: the critic starts from the plain weights
        from mhgpo.rl.critic import Critic

        critic = Critic(loaded.model, pad_id, cfg.critic, cfg.optim, cfg.lora, cfg.precision)
        actor_steps = max(cfg.steps - cfg.critic.warmup_steps, 1)  # the actor's schedule starts after warm-up
    policy = Policy(
        loaded.model, pad_id, cfg.optim, cfg.lora, actor_steps, reference, cfg.precision, roles=workflow.agents
    )
    generator = engine or HFGenerator(
        policy.model,
        loaded.tokenizer,
        batch_size=cfg.gen_batch_size,
        precision=cfg.precision,
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
