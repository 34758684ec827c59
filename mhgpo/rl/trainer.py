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
critic before the policy; `train_roles` / `frozen_roles` untrain whole roles after the rewards are assigned. The
step's reward bookkeeping is in `mhgpo/rl/rewards.py`; what the trainer is given (a `TrainingSetup`) is built by the
composition root, `mhgpo/run/setup.py`.

Under `accelerate launch` the trainer runs on every rank (`mhgpo/model/distributed.py`, docs/design.md §5): each rank
rolls out its share of the step's questions, the trees are gathered and the step's bookkeeping runs on all of them,
the update is cut across the ranks, and rank 0 writes the run.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhgpo.config import TrainConfig, dump_config, rollout_pipelined, to_dict
from mhgpo.data.forms import is_form_metric
from mhgpo.data.records import Example
from mhgpo.errors import InputError, NotFinite, RunError, ServiceError
from mhgpo.model import sharding
from mhgpo.model.checkpoint import Live, list_checkpoints, load_checkpoint, save_checkpoint, snapshot
from mhgpo.model.distributed import Single, current
from mhgpo.model.statecodec import rng_states
from mhgpo.rl.advantages import drop_zero_variance
from mhgpo.rl.evaluation import evaluate_on_ranks
from mhgpo.rl.grouping import assign_groups
from mhgpo.rl.policy import Policy, Sample, peak_memory_mb, weights_finite
from mhgpo.rl.reference_ahead import ReferenceAhead
from mhgpo.rl.rewards import (
    apply_role_switches,
    assign_rewards,
    assign_shared_rewards,
    question_rewards,
    revisit_metrics,
    step_metrics,
)
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutBatch, RolloutSpec, merge_batches, rollout_records
from mhgpo.runtime.budget import Budget
from mhgpo.runtime.runlog import NoLog, RunLog, write_rollouts, write_validation
from mhgpo.runtime.stopguard import (
    Completed,
    RankFailed,
    StopGuard,
    error_text,
    failed_step,
    not_finite,
    save_on_stop,
)
from mhgpo.team.workflow import Workflow


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


AHEAD_FILE = "ahead"  # a checkpoint's ahead.safetensors: the weights that grow the trees of its next step


class Ahead:
    """The next step's rollout trees, grown in a thread (rollout.max_staleness=1) with a random stream of their own
    (seeded by the run's seed and the data position, so that a run is repeatable), while the trainer updates on the
    previous step's; :meth:`result` waits for them and raises what stopped them."""

    def __init__(self, trainer: Trainer, questions: list[Example], weights: dict[str, torch.Tensor]) -> None:
        self.questions = questions
        self.batch: RolloutBatch | None = None
        self.error: BaseException | None = None
        rng = np.random.default_rng([trainer.cfg.seed, trainer.position])
        pin = trainer.setup.generator.pin()  # the weights the engine holds now, whenever the thread starts
        # those weights (the LoRA adapters' tensors) and their version: a checkpoint taken while the trees grow keeps
        # them, so that a resumed run grows the same trees on the same weights (:meth:`Trainer._resume_ahead`)
        self.version, self.weights = pin[1], weights
        position = trainer.position  # (the sampling seeds' key: the batch's, as a resumed run draws it again)

        def grow() -> None:
            try:
                self.batch = trainer._grow(questions, rng, pin, position)
            except BaseException as e:  # (raised in the trainer's thread by result)
                self.error = e

        self.thread = threading.Thread(target=grow, name="mhgpo-rollouts-ahead", daemon=True)
        self.thread.start()

    def result(self) -> RolloutBatch:
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.batch is not None
        return self.batch


class TooManyFailures(InputError):
    """More questions failed in the workflow's methods than `max_failures` allows."""


class Trainer:
    def __init__(
        self, cfg: TrainConfig, setup: TrainingSetup, run_dir: Path, progress: bool = True, ranks: Single | None = None
    ):
        """`ranks`: the processes of a data-parallel run (default: :func:`mhgpo.model.distributed.current`; one process
        when not started by a launcher); rank 0 alone writes the run's files and shows progress."""
        self.ranks = ranks if ranks is not None else current()
        progress = progress and self.ranks.is_main
        self.cfg, self.setup, self.run_dir, self.progress = cfg, setup, Path(run_dir), progress
        self._guard: StopGuard | None = None
        # where the current step is: rollouts, update (weights of no step), validation, records, hand-over (the
        # update's weights to a server that failed, after the step was saved)
        self.phase = "rollouts"
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.position = 0  # questions consumed so far (defines the data order)
        self.failures = 0  # questions whose rollout failed so far (training and validation)
        self.val_history: list[dict[str, float]] = []  # per validation: step, val/f1 ..., cpu_minutes
        self.first_rewards: dict[str, float] = {}  # question id -> its mean reward on its first visit
        self.cpu_seconds = 0.0  # the process's CPU time in the completed steps' rollouts and updates
        self.last_eval: tuple[int, Any] | None = None  # (step, EvalResult) of the latest validation
        self._engine_synced = False  # whether a separate engine (vLLM) holds the policy's current weights
        # a server that failed while the step's update was handed over: the step is saved, then the run stops
        self._handover_error: ServiceError | None = None
        # rollout.max_staleness=1: the next step's trees, grown on the servers while this step updates
        self._ahead: Ahead | None = None
        # a resumed run's checkpoint taken while trees grew ahead: the version and weights that grew them
        self._ahead_saved: tuple[int, dict[str, torch.Tensor]] | None = None
        self._step_started: float | None = None  # wall clock at the start of the step's collect (idle fractions)
        # rollout.pipeline with a separate engine: the step's reference pass, worked out while the rollouts run, and
        # what it worked out (for the update)
        self._reference: ReferenceAhead | None = None
        self._known_reference: dict | None = None
        # `budget_minutes` (the warm start's config has none): the steps' time, and whether it ended the run
        self.budget = Budget(getattr(cfg, "budget_minutes", None), getattr(cfg, "budget_clock", "cpu"))
        self.stopped_on_budget = False

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
        state = {"position": self.committed_position(), "val_history": self.val_history, "failures": self.failures}
        state.update(first_rewards=self.first_rewards, cpu_seconds=self.cpu_seconds)
        state["budget"] = self.budget.state()
        aside = None
        if self._ahead is not None and self._ahead.version is not None:  # trees grown ahead, on older weights
            state["ahead_version"], aside = int(self._ahead.version), {AHEAD_FILE: self._ahead.weights}
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
            aside,
        )

    def committed_position(self) -> int:
        """The data position of the completed steps: the questions drawn for trees grown ahead (rollout.max_staleness)
        belong to the next step, which a resumed run draws again."""
        return self.position - (len(self._ahead.questions) if self._ahead is not None else 0)

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
        self._ahead_saved = None
        if "ahead_version" in state and self.cfg.rollout.max_staleness > 0:
            from safetensors.torch import load_file

            self._ahead_saved = (int(state["ahead_version"]), load_file(str(Path(path) / f"{AHEAD_FILE}.safetensors")))
        self.step, self.position = int(state["step"]), int(state["position"])
        self.val_history = list(state.get("val_history", []))
        self.failures = int(state.get("failures", 0))
        self.first_rewards = {str(k): float(v) for k, v in (state.get("first_rewards") or {}).items()}
        self.cpu_seconds = float(state.get("cpu_seconds", 0.0))
        self.budget.restore(state.get("budget"))

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

    def _decoding(self) -> Any:
        """FSDP: the whole model on every rank while the trainer's model decodes (each rank its own number of
        steps); a separate engine decodes in its stead, and nothing is gathered."""
        return sharding.gathered(None if self.setup.engine_scratch is not None else self.setup.policy.model)

    # -------------------------------------------------------------------------------------------------- loop

    def validate(self, desc: str = "") -> Any:
        """Greedy evaluation of the team on the fixed validation subset (an `EvalResult`); a progress bar with
        `desc`."""
        self._engine_ready()
        with self._decoding():
            return self._validate(desc)

    def _validate(self, desc: str) -> Any:
        t = self.setup
        return evaluate_on_ranks(
            t.val,
            t.val_workflow,
            t.generator,
            t.encode,
            self.cfg.eval_batch_size,
            self.ranks,
            progress=bool(desc) and self.progress,
            desc=desc or "eval",
            on_error="skip",
            max_prompt_tokens=self.cfg.max_prompt_tokens,
            pipeline=rollout_pipelined(self.cfg),
        )

    def collect(self) -> tuple[RolloutBatch, list[Sample], dict[str, float]]:
        """The step's first phase (no weight changes, safe to interrupt): rollouts, rewards, advantages (group
        ids for MHGPO / GRPO; the critic's GAE for MAPPO / PPO)."""
        cfg, setup = self.cfg, self.setup
        t0 = time.perf_counter()
        self._resume_ahead()
        self._engine_ready()
        setup.policy.model.eval()
        waited = 0.0
        busy = self._busy()
        self._reference = self._reference_beside()
        try:
            with self._decoding():
                batch, adv_stats, untrained, filter_stats = self._sample()
        except BaseException:
            if self._reference is not None:  # (the segment under way ends: the trainer's model is free again)
                self._reference.close()
            self._reference = None
            raise
        reference, self._reference = self._reference, None
        if reference is not None:  # its last segments, before anything else uses the trainer's model
            self._known_reference = reference.results()
        if cfg.rollout.max_staleness > 0:
            waited = self._waited
            self._grow_ahead()  # the next step's trees, sampled by these weights while this step updates
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

            engine_stats = old_logprobs(
                setup.policy, samples, cfg.optim.old_logprobs, self.ranks, cfg.generation.engine
            )
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
            **self._staleness(batch),
            **{"seconds/rollout": time.perf_counter() - t0},
        )
        if busy is not None:  # (learn adds the idle fractions, once the step's wall time is known)
            self._step_started, self._busy_at, self._rollout_wait = (
                t0,
                busy,
                (waited if cfg.rollout.max_staleness > 0 else time.perf_counter() - t0),
            )
        return batch, samples, metrics

    # ------------------------------------------------------------------------------------------- staleness

    def _reference_beside(self) -> ReferenceAhead | None:
        """A worker for this step's reference pass beside its rollouts, where that pays and cannot change a number:
        the rollouts pipelined (`rollout.pipeline`), an engine that samples outside the trainer's model, a KL term,
        synchronous (`rollout.max_staleness: 0`: nothing updates meanwhile) and one process (`mhgpo.rl.reference_ahead`)."""
        cfg = self.cfg
        if not (
            cfg.optim.kl_beta != 0
            and cfg.rollout.max_staleness == 0
            and self.ranks.world == 1
            and self.setup.engine_scratch is not None
            and rollout_pipelined(cfg)
        ):
            return None
        workflow = self.setup.workflow
        return ReferenceAhead(
            self.setup.policy.reference_segment,
            lambda agent: workflow.sampling(agent).temperature,
            lambda agent: (cfg.train_roles is None or agent in cfg.train_roles) and agent not in cfg.frozen_roles,
        )

    def _busy(self) -> float | None:
        """The servers' busy seconds so far (an engine in other processes; else None)."""
        busy = getattr(self.setup.generator, "busy_seconds", None)
        return busy() if busy is not None else None

    def _handover_waited(self) -> float:
        """The seconds the trainer has waited so far on the servers in hand-overs and sync checks (0 in process)."""
        waited = getattr(self.setup.generator, "waited_seconds", None)
        return waited() if waited is not None else 0.0

    def _staleness(self, batch: RolloutBatch) -> dict[str, float]:
        """The step's trees' staleness (the trainer's update count now minus the version that sampled each tree):
        its mean and largest, and the trees older than `rollout.max_staleness`, which are not trained."""
        if not batch.versions:
            return {}
        lag = [self.step - v for v in batch.versions]
        return {
            "staleness/mean": float(np.mean(lag)),
            "staleness/max": float(max(lag)),
            "staleness/dropped_trees": float(batch.stats.get("stale_trees", 0.0)),
        }

    def _drop_stale(self, batch: RolloutBatch) -> None:
        """Untrain every tree older than `rollout.max_staleness` updates (group id -1, advantage 0: its groups are
        its own, so the others' are unchanged) and count them in the batch's ``stale_trees``."""
        bound = self.cfg.rollout.max_staleness
        stale = {q for q, v in enumerate(batch.versions) if self.step - v > bound}
        for n in batch.nodes:
            if n.question_index in stale and n.group_id >= 0:
                n.group_id, n.advantage = -1, 0.0
        batch.stats["stale_trees"] = batch.stats.get("stale_trees", 0.0) + float(len(stale))

    def _grow_ahead(self) -> None:
        """Start growing the next step's trees in a thread (rollout.max_staleness=1), on the weights the engine
        holds now: they are trained by the next step, one update later. Not past the run's last step."""
        if self.step + 1 >= self.cfg.steps or not self.budget.fits():
            return
        from mhgpo.rl.engine_sync import trainer_weights

        weights = {name: t.detach().clone() for name, t in trainer_weights(self.setup.policy).items()}
        questions = self._next_questions(self.cfg.questions_per_step)
        self._ahead = Ahead(self, questions, weights)

    def _resume_ahead(self) -> None:
        """A run resumed from a checkpoint taken while the next step's trees grew ahead: grow them again as the
        uninterrupted run did, on the weights of their version (kept in the checkpoint, handed to the engine under
        that version), from the same data position and seeds; then the checkpoint's own weights are handed over."""
        if self._ahead_saved is None:
            return
        from mhgpo.rl.engine_sync import sync

        (version, weights), self._ahead_saved = self._ahead_saved, None
        sync(self.setup.generator, self.setup.policy, self.setup.engine_scratch, version, weights)
        self._ahead = Ahead(self, self._next_questions(self.cfg.questions_per_step), weights)
        self._engine_synced = False  # (the current weights follow, before this step's update)

    def _take_ahead(self) -> RolloutBatch | None:
        """The trees grown ahead for this step (waiting for them; their error raised here), or None."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        t = time.perf_counter()
        batch = ahead.result()
        self._waited = time.perf_counter() - t
        return batch

    def _rollout(
        self, questions: list[Example], grown: RolloutBatch | None = None
    ) -> tuple[RolloutBatch, dict[str, float], int]:
        """Rollout trees of `questions`, their rewards and advantages (group ids for MHGPO / GRPO; the critic's
        GAE later, for MAPPO / PPO), and the role switches; returns the batch, group counts and untrained count."""
        cfg, setup = self.cfg, self.setup
        if grown is not None:
            batch = grown
        else:
            batch = self._grow(questions, self.rng) if self.ranks.world == 1 else self._gather_trees(questions)
        assign_groups(batch, self._spec(), self.rng)  # (one process: run_rollouts' two halves, in its order)
        if setup.critic is None:
            adv_stats = assign_rewards(batch, cfg.reward.aggr, cfg.reward.penalties, self.rng, cfg.advantage)
        else:
            assign_shared_rewards(batch, cfg.reward.aggr, cfg.reward.penalties, self.rng)
            adv_stats = {"n_groups": 0.0, "n_zero_variance_groups": 0.0}
        if batch.versions:
            self._drop_stale(batch)
        return batch, adv_stats, apply_role_switches(batch, cfg.train_roles, cfg.frozen_roles)

    def _grow(
        self, questions: list[Example], rng: np.random.Generator, pin: Any = None, position: int | None = None
    ) -> RolloutBatch:
        """The rollout trees of `questions`, scored, without group ids (`mhgpo.rl.rollout.run_rollouts`). On a server
        the whole batch samples with one version's adapters, those of `pin` (`ServerGenerator.pin`, taken when the
        batch was asked for; else the current ones), and each tree records that version. On vLLM (in the process or
        a server; `generation.seeded`) each request samples with a seed of its own, from a stream keyed by the run's
        seed, the batch's data position (`position`, that after its questions were drawn; None: the trainer's now)
        and the rank (`VLLMGenerator.seeded`): the same rollouts from either engine, and from a resumed run."""
        setup = self.setup
        pinned = getattr(setup.generator, "pinned", None)
        seeded = getattr(setup.generator, "seeded", None) if self.cfg.generation.seeded else None
        key = (self.cfg.seed, self.position if position is None else position, self.ranks.rank)
        with (
            pinned(pin) if pinned is not None else nullcontext(self.step) as version,
            seeded(key) if seeded is not None else nullcontext(),
        ):
            batch = run_rollouts(
                questions,
                setup.workflow,
                setup.generator,
                setup.encode,
                self._spec(),
                rng,
                max_rounds=self.cfg.max_rounds,
                on_error="skip",
                grouped=False,
                pipeline=rollout_pipelined(self.cfg),
                on_call=self._reference.on_call if self._reference is not None else None,
            )
        if pinned is not None:  # (an engine that samples between updates holds the current version throughout)
            batch.versions = [self.step if version is None else int(version)] * len(batch.examples)
        return batch

    def _gather_trees(self, questions: list[Example]) -> RolloutBatch:
        """Several ranks: this rank grows the trees of its share of `questions` (its own random streams, seeded by
        the run's seed, the data position and the rank) and the trees of every rank are gathered in rank order, so
        that the group ids are then assigned on the whole step, identically on every rank. A stop asked on any
        rank (a signal) stops every rank here, before the update."""
        ranks = self.ranks
        rng = np.random.default_rng([self.cfg.seed, self.position, ranks.rank])
        torch.manual_seed(int(rng.integers(2**62)))
        mine, error = None, None
        try:
            mine = self._grow(ranks.share(questions), rng)
        except (KeyboardInterrupt, RunError):
            raise
        except Exception as e:  # told to every rank, so that all stop here (and save) rather than wait for it
            error = e
        told = f"rank {ranks.rank}: {error_text(error)}" if error is not None else ""
        parts = ranks.gather((mine, self._guard is not None and self._guard.pending, told))
        if error is not None:
            raise error
        failed = [f for _, _, f in parts if f]
        if failed:
            raise RankFailed(failed[0])
        if any(stop for _, stop, _ in parts):
            raise KeyboardInterrupt
        for rank, (b, _, _) in enumerate(parts):  # (the rollout file says which rank grew each tree)
            b.ranks = [rank] * len(b.examples)
        return merge_batches([b for b, _, _ in parts])

    def _sample(self) -> tuple[RolloutBatch, dict[str, float], int, dict[str, float]]:
        """The step's rollouts. With `filter_zero_variance`, the groups whose rewards are all equal are untrained
        and more questions are drawn, `questions_per_step` at a time, until the step holds as many informative
        groups as its first draw formed groups, or `filter_max_questions` questions have been drawn."""
        cfg = self.cfg
        self._waited = 0.0
        grown = self._take_ahead()
        questions = [] if grown is not None else self._next_questions(cfg.questions_per_step)
        batch, adv_stats, untrained = self._rollout(questions, grown)
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
        known, self._known_reference = self._known_reference, None
        if critic is None or metrics["actor_updated"]:
            metrics.update(self.setup.policy.update(samples, known))
        metrics["seconds/train"] = time.perf_counter() - t
        waited_before = self._handover_waited()
        if self.setup.engine_scratch is not None:  # the new weights to the engine, checked (a gap stops the run)
            from mhgpo.rl.engine_sync import sync_after_update

            try:
                metrics.update(
                    sync_after_update(self.setup, self.cfg, samples, self.step + 1, self.run_dir, self.ranks)
                )
                self._engine_synced = True
            except ServiceError as e:  # a server failed in the hand-over: the update is good, the step completes
                if self.ranks.world > 1:  # (the other ranks wait in the check's collectives: all stop here)
                    raise
                self._handover_error = e
        if self.ranks.world > 1:  # the update's all-reduces (gradients, statistics), on rank 0
            metrics["seconds/train_communication"] = self.ranks.comm_seconds - comm
        busy = self._busy()
        if busy is not None and self._step_started is not None:  # the step's wall time, from its collect's start
            wall = max(time.perf_counter() - self._step_started, 1e-9)
            waited = self._handover_waited() - waited_before  # (off-policy it queues behind the next step's generation)
            metrics["seconds/handover_wait"] = waited
            metrics["idle/trainer"] = min((self._rollout_wait + waited) / wall, 1.0)
            metrics["idle/server"] = max(0.0, 1.0 - (busy - self._busy_at) / wall)
            metrics["seconds/step"] = wall  # from the rollouts' start (or the wait for them) to the hand-over's end
            self._step_started = None
        return metrics

    def train_step(self) -> dict[str, float]:
        """Both phases of one step, counted, without logging or checkpoints (benchmarks, tests)."""
        batch, samples, metrics = self.collect()
        self._last_batch = batch
        metrics = self.learn(samples, metrics)
        self.step += 1
        handover, self._handover_error = self._handover_error, None
        if handover is not None:
            raise handover
        return metrics

    def run(self) -> dict[str, Any]:
        """Train until `cfg.steps`, or until the next step would not fit `budget_minutes` (`mhgpo.runtime.budget`): each
        step collected, then learned, validated, logged and saved as one critical section; an interrupt or too many
        failures save what is complete and re-raise."""
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
        done = Completed(rng_states(self.rng), self.position, self.failures, saved_step=self.step)
        guard: StopGuard | None = None
        try:
            with StopGuard(deferred=self.ranks.world > 1) as guard:
                self._guard = guard
                while self.step < cfg.steps and self.budget.fits():
                    metrics = self._run_step(log, guard, done)
                    bar.update(1)
                    bar.set_postfix(self._postfix(metrics))
        except (KeyboardInterrupt, TooManyFailures) as stop:  # the last completed step is saved
            bar.close()
            save_on_stop(self, stop, guard, done)
            raise
        except RunError as stop:  # a stop that says itself what is kept (a full disk, a diverged or stale update)
            if not isinstance(stop, ServiceError):
                raise
            raise failed_step(self, stop, log, guard, done) from stop
        except Exception as e:  # an engine, the memory, a team's code, a tool: a saving stop like Ctrl-C
            raise failed_step(self, e, log, guard, done) from e
        finally:
            bar.close()
            self.stopped_on_budget = self.step < cfg.steps and not self.budget.fits()
            log.close(finished=self.step >= cfg.steps or self.stopped_on_budget)
        return {"steps": self.step, "val": self.val_history, "stopped_on_budget": self.stopped_on_budget}

    def _run_step(self, log: RunLog, guard: StopGuard, done: Completed) -> dict[str, float]:
        """One step: collect (safe to interrupt), then learn, validate, log and save. From the first weight change
        on, the step is completed (logged, saved) before a signal stops the run: an interrupted update would leave
        weights that belong to no step. Once the update is done the step is complete: what fails in its records
        (validation, rollout records, metrics) stops the run with the step saved. The budget counts the step's
        rollouts and update."""
        self.phase = "rollouts"
        started, cpu = self.budget.now(), time.process_time()
        batch, samples, metrics = self.collect()
        if batch is not None:  # (the supervised warm start has no rollouts)
            self._failed(log, self.step + 1, "train", batch.failures)
        with guard.critical():
            self.phase = "update"
            step = self.step + 1
            try:
                metrics = self.learn(samples, metrics)
                if not weights_finite(self.setup.policy.params, self.ranks):
                    raise NotFinite("the trained weights are not finite after the update")
            except NotFinite as e:
                raise not_finite(self, log, step, e) from None
            self.budget.spend(started, self.ranks)
            self.cpu_seconds += time.process_time() - cpu
            metrics["seconds/cpu_steps"] = self.cpu_seconds  # the steps' CPU time so far (a curve's x axis)
            if batch is not None:  # (committed with the step: a step cut short leaves no first visits)
                metrics.update(revisit_metrics(self.first_rewards, question_rewards(batch)))
            metrics.update(self.budget.metrics(stopping=step < self.cfg.steps and self._ends_at(step)))
            self.step = step  # the update is done: the step is complete, whatever happens to its records
            done.rng, done.position, done.failures = rng_states(self.rng), self.committed_position(), self.failures
            failed = None
            handover, self._handover_error = self._handover_error, None  # (no validation: no engine holds the step)
            if self._validates_at(step) and handover is None:
                self.phase = "validation"
                try:
                    metrics.update(self._validate_in_run(log, step))
                except Exception as e:  # the step is logged and saved without it, then the run stops
                    failed = e
            self.phase = "records"
            metrics["memory/peak_mb"] = peak_memory_mb()
            if batch is not None and self.ranks.is_main:
                write_rollouts(self.run_dir, step, rollout_records(batch))
            log.log(step, metrics)
            if self._saves_at(step) or failed is not None or handover is not None:
                self._save_or_stop()
                done.saved_step = step
            if failed is not None:
                self.phase = "validation"
                raise failed
            if handover is not None:  # the step is saved: a resumed run hands its weights over first
                self.phase = "hand-over"
                raise handover
        if guard.deferred and self.ranks.any(guard.pending):  # several ranks: a signal on any stops them all here
            raise KeyboardInterrupt
        return metrics

    def _validate_in_run(self, log: RunLog, step: int) -> dict[str, float]:
        """Validate after `step`'s update: recorded in `val_history` and `last_eval`, its questions in
        `validation/step_NNNNNN.jsonl`; returns the step's val metrics (its failures are logged, and stop the run at
        the next step's start when too many)."""
        t = time.perf_counter()
        res = self.validate()
        self._failed(log, step, "val", res.failures, stop=False)
        self.last_eval = (step, res)
        if self.ranks.is_main:
            write_validation(self.run_dir, step, res.predictions)
        scores = {f"val/{k}": res.metrics[k] for k in ("f1", "em", "acc")}
        scores.update({f"val/{k}": v for k, v in res.metrics.items() if is_form_metric(k)})  # F1 by question form
        self.val_history.append({"step": step, **scores, "cpu_minutes": self.cpu_seconds / 60})
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

    def _ends_at(self, step: int) -> bool:
        """Whether `step` is the run's last: `cfg.steps`, or the next step would not fit the budget."""
        return step == self.cfg.steps or not self.budget.fits()

    def _validates_at(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or self._ends_at(step))

    def _saves_at(self, step: int) -> bool:
        every = self.cfg.save_every
        return bool(every) and (step % every == 0 or self._ends_at(step))

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
