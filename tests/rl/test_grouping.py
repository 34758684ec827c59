"""Group ids on real rollout batches (mhgpo/rl/grouping.py, docs/design.md §2): the groups of each sampler, RR's
regrouped singletons, and the groups of the peer advantage schemes. Everything runs on the fakes of fakes.py."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
from fakes import (
    AGENTS,
    RR_SECOND,
    RR_THIRD,
    G,
    ancestor,
    children,
    groups,
    rollout,
)

from mhgpo.rl.rewards import assign_rewards
from mhgpo.team.search_system import ANSWERER, RERANKER, REWRITER

# ------------------------------------------------------------------------------------------------ group invariants


def _assert_group_basics(batch):
    gs = groups(batch)
    assert sorted(gs) == list(range(len(gs)))  # ids are 0..K-1
    assert batch.stats["groups"] == float(len(gs))
    for members in gs.values():
        assert len(members) == G  # never a group of size 1 (nor any other size)
        assert len({m.agent for m in members}) == 1  # never mixes roles
        assert all(m.kind == "llm" for m in members)
    assert all(n.group_id == -1 for n in batch.nodes if n.kind == "tool")
    return gs


def test_fof_groups():
    batch, _, _ = rollout("fof", n_questions=3)
    gs = _assert_group_basics(batch)
    assert len(gs) == 9
    assert batch.stats["singletons_dropped"] == 0.0
    for members in gs.values():
        assert len({m.question_index for m in members}) == 1
    by_key = {(ms[0].question_index, ms[0].agent): ms for ms in gs.values()}
    assert sorted(by_key) == [(q, a) for q in range(3) for a in sorted(AGENTS)]
    for q in range(3):
        fork = by_key[(q, REWRITER)]
        assert all(m.fork_sample for m in fork)
        assert len({tuple(m.prompt_ids) for m in fork}) == 1  # homogeneous: one prompt
        assert len({m.output for m in fork}) > 1
        for agent in (RERANKER, ANSWERER):
            down = by_key[(q, agent)]
            assert not any(m.fork_sample for m in down)
            # one member per branch: their fork-point ancestors are exactly the fork group
            assert sorted(ancestor(batch, m, REWRITER).node_id for m in down) == sorted(m.node_id for m in fork)
    assert all(n.trained for n in batch.llm_nodes())


def test_is_groups_keep_only_the_forked_agents_samples():
    batch, _, _ = rollout("is", n_questions=3)
    gs = _assert_group_basics(batch)
    assert len(gs) == 9
    assert batch.stats["singletons_dropped"] == 0.0
    for n in batch.llm_nodes():
        assert n.trained == n.fork_sample
    for members in gs.values():
        assert all(m.fork_sample for m in members)
        assert len({tuple(m.prompt_ids) for m in members}) == 1
        assert len({m.parent_id for m in members}) == 1
    assert Counter((ms[0].question_index, ms[0].agent) for ms in gs.values()) == {
        (q, a): 1 for q in range(3) for a in AGENTS
    }
    # untrained: 15 per question (the chains' prefixes and the downstream samples)
    assert sum(1 for n in batch.llm_nodes() if not n.trained) == 3 * 15


def test_fof_os_terminal_groups_per_parent():
    batch, _, _ = rollout("fof_os", n_questions=3)
    gs = _assert_group_basics(batch)
    kids = children(batch)
    answerer_groups = [ms for ms in gs.values() if ms[0].agent == ANSWERER]
    assert len(answerer_groups) == 3 * G
    for members in answerer_groups:
        parent = batch.nodes[members[0].parent_id]
        assert parent.agent == RERANKER
        assert {m.parent_id for m in members} == {parent.node_id}
        assert sorted(m.node_id for m in members) == sorted(k.node_id for k in kids[parent.node_id])
        assert len({tuple(m.prompt_ids) for m in members}) == 1
    for n in batch.llm_nodes():
        if n.agent == RERANKER:
            assert len(kids[n.node_id]) == G
    assert Counter((n.question_index, n.agent) for n in batch.llm_nodes()) == {
        (q, a): {REWRITER: 4, RERANKER: 4, ANSWERER: 16}[a] for q in range(3) for a in AGENTS
    }
    assert len(gs) == 3 * (1 + 1 + G)
    assert all(n.trained for n in batch.llm_nodes())


def test_rr_fork_at_reranker_drops_unfillable_rewriter_singletons():
    batch, _, _ = rollout("rr", n_questions=3, rr_probs=RR_SECOND)
    gs = _assert_group_basics(batch)
    assert batch.stats["singletons_dropped"] == 3.0
    assert all(not n.trained for n in batch.llm_nodes() if n.agent == REWRITER)
    assert len(gs) == 6
    for members in gs.values():
        assert len({m.question_index for m in members}) == 1
        if members[0].agent == RERANKER:
            assert all(m.fork_sample for m in members)
            assert len({tuple(m.prompt_ids) for m in members}) == 1


def test_rr_singletons_regrouped_within_role_and_leftovers_counted():
    batch, _, _ = rollout("rr", n_questions=5, rr_probs=RR_THIRD)
    gs = _assert_group_basics(batch)
    # 5 rewriter and 5 reranker singletons: one group of 4 per role, one leftover per role
    assert batch.stats["singletons_dropped"] == 2.0
    assert Counter(ms[0].agent for ms in gs.values()) == {ANSWERER: 5, REWRITER: 1, RERANKER: 1}
    for role in (REWRITER, RERANKER):
        [regrouped] = [ms for ms in gs.values() if ms[0].agent == role]
        assert len({m.question_index for m in regrouped}) == G  # one singleton from each of 4 questions
        assert sum(1 for n in batch.llm_nodes() if n.agent == role and not n.trained) == 1
    assert batch.stats["samples"] == float(5 * 6 - 2)


@pytest.mark.parametrize("regroup", ["fork", "role"])
def test_rr_regroup_by_fork_point_or_by_role(regroup):
    batch, _, _ = rollout("rr", n_questions=6, rr_probs=(0.0, 0.5, 0.5), seed=3, regroup=regroup)
    fork_of = [f[0] for f in batch.fork_agents]
    assert Counter(fork_of) == {RERANKER: 4, ANSWERER: 2}  # rewriter singletons from both fork points
    singles = Counter(
        (n.agent, fork_of[n.question_index])
        for n in batch.llm_nodes()
        if fork_order(n.agent) < fork_order(fork_of[n.question_index])
    )  # the prefix calls
    pools = Counter()
    for (agent, fork), count in singles.items():
        pools[(agent, fork) if regroup == "fork" else agent] += count
    assert batch.stats["singletons_dropped"] == float(sum(c % G for c in pools.values()))
    mixed = False
    for members in groups(batch).values():
        assert len(members) == G
        if not members[0].fork_sample and fork_order(members[0].agent) < fork_order(fork_of[members[0].question_index]):
            assert len({m.agent for m in members}) == 1
            forks = {fork_of[m.question_index] for m in members}
            mixed |= len(forks) > 1
            assert regroup == "role" or len(forks) == 1  # fork: only singletons that forked at the same agent
    assert mixed == (regroup == "role")  # with this seed, pooling by role does mix fork points


def fork_order(agent: str) -> int:
    return (REWRITER, RERANKER, ANSWERER).index(agent)


def test_rr_regroup_across_roles_option():
    batch, _, _ = rollout("rr", n_questions=5, rr_probs=RR_THIRD, regroup="all")
    gs = groups(batch)
    assert all(len(ms) == G for ms in gs.values())
    assert batch.stats["singletons_dropped"] == 2.0  # 10 singletons in one pool: 2 groups, 2 left
    assert len(gs) == 5 + 2


# -------------------------------------------------------------------------------------- the peer advantage schemes


@pytest.mark.parametrize("scheme", ["agent", "prompt_agent_turn"])
def test_peer_advantage_schemes_on_a_fof_batch(scheme):
    """`advantage=agent` normalises each agent's trained samples across the batch (mean 0, unbiased std 1);
    `advantage=prompt_agent_turn` keeps only samples whose prompt, agent and visit another sample shares: under FoF
    the Rewriter's G samples of each question (one prompt), not the downstream calls with prompts of their own."""
    batch, _, _ = rollout("fof", n_questions=4)
    sampler_trained = sum(n.trained for n in batch.llm_nodes())
    stats = assign_rewards(batch, "mean", True, np.random.default_rng(0), scheme)
    llm = batch.llm_nodes()
    by_group = defaultdict(list)
    for n in llm:
        if n.trained:
            by_group[n.group_id].append(n)
    if scheme == "agent":
        assert {g: {n.agent for n in ns} for g, ns in by_group.items()} == {0: {REWRITER}, 1: {RERANKER}, 2: {ANSWERER}}
        assert batch.stats["samples"] == sampler_trained and batch.stats["singletons_dropped"] == 0
    else:
        prompts = Counter((tuple(n.prompt_ids), n.agent, n.visit) for n in llm)
        assert all(prompts[(tuple(n.prompt_ids), n.agent, n.visit)] >= 2 for n in llm if n.trained)
        assert all(prompts[(tuple(n.prompt_ids), n.agent, n.visit)] == 1 for n in llm if not n.trained)
        assert {n.agent for ns in by_group.values() for n in ns} >= {REWRITER}
        assert sum(len(ns) for ns in by_group.values() if ns[0].agent == REWRITER) == 4 * G
        dropped = sum(not n.trained for n in llm)
        assert batch.stats["singletons_dropped"] == dropped and batch.stats["samples"] == len(llm) - dropped
    assert stats["n_groups"] == len(by_group)
    for ns in by_group.values():
        rewards = np.array([n.reward for n in ns])
        adv = np.array([n.advantage for n in ns])
        if np.ptp(rewards) == 0:
            assert np.all(adv == 0.0)
        else:
            assert adv.mean() == pytest.approx(0.0, abs=1e-12) and adv.std(ddof=1) == pytest.approx(1.0, rel=1e-5)
