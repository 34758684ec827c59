"""A step's reward bookkeeping on its rollout trees: rewards propagated backward and the agents' penalties added
(paper Eq. aggr), advantages normalised within groups (Eq. adv, in the groups of the `advantage` scheme), the
role switches of the role ablations, and the step's per-agent metrics. The trainer (`mhgpo.rl.trainer`) calls these
on each step's `RolloutBatch`; the arithmetic is in `mhgpo.rl.advantages`."""

from __future__ import annotations

import math

import numpy as np

from mhgpo.config.tables import ADVANTAGE_SCHEMES
from mhgpo.rl.advantages import aggregated, group_advantages, propagate_rewards, scheme_groups, total_rewards
from mhgpo.rl.behaviour import agent_behaviour
from mhgpo.rl.tree import Node, RolloutBatch
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
    advantages, stats = group_advantages(rewards, group_ids, scale=ADVANTAGE_SCHEMES[scheme].scale)  # (N,)
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
    """The step's figures per agent (reward, penalty, |advantage|, trained samples and the share of them that carry a
    gradient, the sampled tokens' entropy, its behaviour: formats, lengths) and the mean terminal reward."""
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
        # informative: the trained samples whose advantage is not 0 (a zero-variance group's members carry no gradient)
        out[f"{agent}/informative"] = float(np.mean([n.advantage != 0 for n in trained])) if trained else 0.0
        tokens = [-lp for n in mine for lp in n.logprobs]
        if tokens:  # the sampled tokens' mean -log π (at the sampling temperature, before top-p): the entropy's
            out[f"{agent}/entropy"] = float(np.mean(tokens))  # Monte Carlo estimate along the sampled outputs
            # no_choice: the sampled tokens top-p left no alternative to. The nucleus is the top token alone exactly
            # when that token's π (at the sampling temperature) reaches top_p, and then it is the token drawn; with
            # two or more in it the drawn token's π is below top_p. So the share of tokens with π >= top_p (none
            # at top_p 1, where the nucleus is the whole vocabulary: a log-prob that rounds to 0 is not counted)
            top_p = workflow.sampling(agent).top_p
            out[f"{agent}/no_choice"] = float(np.mean(np.array(tokens) <= -math.log(top_p))) if top_p < 1 else 0.0
        out.update(_identical_groups(agent, trained))
    out.update(agent_behaviour(llm, workflow))
    if leaves:  # the trained samples whose reward the aggregator (`reward.aggr`) decides
        parents = np.array([n.parent_id for n in batch.nodes], dtype=np.int64)  # (N,)
        terminal = np.array([n.terminal for n in batch.nodes], dtype=np.float64)  # (N,) NaN except at leaves
        in_loss = np.array([n.kind == "llm" and n.trained for n in batch.nodes])  # (N,)
        out["aggregated_samples"] = float((aggregated(parents, terminal) & in_loss).sum())
    return out


def _identical_groups(agent: str, trained: list[Node]) -> dict[str, float]:
    """``{agent}/identical_groups``: of the agent's advantage groups of two or more trained samples, the share whose
    outputs are all the same tokens: sampling that no longer explores (over a group of one prompt the policy gradient
    of such a group is zero whatever its rewards, its advantages summing to zero on one output). Nothing when the
    agent has no such group (MAPPO's samples are groups of one)."""
    outputs: dict[int, list[tuple[int, ...]]] = {}
    for n in trained:
        if n.group_id >= 0:
            outputs.setdefault(n.group_id, []).append(tuple(n.output_ids))
    shared = [v for v in outputs.values() if len(v) > 1]
    if not shared:
        return {}
    return {f"{agent}/identical_groups": float(np.mean([len(set(v)) == 1 for v in shared]))}


def question_rewards(batch: RolloutBatch) -> dict[str, float]:
    """Each question's mean terminal reward over its tree's leaves, by question id."""
    leaves: dict[int, list[float]] = {}
    for n in batch.leaves():
        leaves.setdefault(n.question_index, []).append(n.terminal)
    return {batch.examples[q].id: float(np.mean(v)) for q, v in leaves.items()}


def revisit_metrics(first: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """The epoch-paired train reward: over the step's questions seen in an earlier step, the mean of (reward now −
    reward on the first visit), the same question's rollouts compared so that which questions a step drew drops out;
    `first` (question id -> first reward) gains the questions seen for the first time. Nothing before a revisit."""
    again = [now[q] - first[q] for q in now if q in first]
    for q, r in now.items():
        first.setdefault(q, r)
    if not again:
        return {}
    return {"reward/revisit_delta": float(np.mean(again)), "reward/revisits": float(len(again))}
