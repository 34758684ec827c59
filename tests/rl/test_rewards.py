"""A step's rewards on real rollout batches (mhgpo/rl/rewards.py): reward propagation, penalties and advantages,
the step's metrics, and the role switches of the role ablations. Everything runs on the fakes of fakes.py."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import (
    AGENTS,
    EXAMPLES,
    RR_SECOND,
    G,
    children,
    encode,
    groups,
    rollout,
    search_generator,
    search_system,
)

from mhgpo.config import SearchConfig
from mhgpo.rl.rewards import (
    apply_role_switches,
    assign_rewards,
    question_rewards,
    revisit_metrics,
    step_metrics,
)
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.team.search_system import ANSWERER, RERANKER, REWRITER

# --------------------------------------------------------------------------------------------------------- rewards


def _aggregate(values, aggr):
    if aggr == "mean":
        total = 0.0
        for v in values:
            total += v
        return total / len(values)
    return max(values) if aggr == "max" else min(values)


def _expected_advantages(batch):
    gs = groups(batch)
    out = {}
    zero_var = 0
    for members in gs.values():
        rewards = [m.reward for m in members]
        if max(rewards) == min(rewards):
            zero_var += 1
            out.update({m.node_id: 0.0 for m in members})
            continue
        total = 0.0
        for r in rewards:
            total += r
        mean = total / len(rewards)
        sq = 0.0
        for r in rewards:
            sq += (r - mean) * (r - mean)
        std = float(np.sqrt(sq / (len(rewards) - 1)))
        out.update({m.node_id: (m.reward - mean) / (std + 1e-6) for m in members})
    return out, zero_var


@pytest.mark.parametrize("sampler", ["fof_os", "is", "rr"])
@pytest.mark.parametrize("aggr", ["mean", "max", "min"])
def test_assign_rewards_on_a_real_batch(sampler, aggr):
    batch, _, _ = rollout(sampler, n_questions=4, rr_probs=RR_SECOND)
    stats = assign_rewards(batch, aggr, True, np.random.default_rng(0))
    kids = children(batch)
    for n in batch.nodes:
        if kids[n.node_id]:
            assert n.reward_shared == _aggregate([k.reward_shared for k in kids[n.node_id]], aggr)
        else:
            assert n.reward_shared == n.terminal
        assert n.reward == n.reward_shared + (n.penalty if n.kind == "llm" else 0.0)
    assert any(n.penalty < 0 for n in batch.llm_nodes())
    expected, zero_var = _expected_advantages(batch)
    for n in batch.nodes:
        assert n.advantage == expected.get(n.node_id, 0.0)
    assert any(a != 0.0 for a in expected.values())
    assert stats == {
        "n_groups": float(len(groups(batch))),
        "n_zero_variance_groups": float(zero_var),
        "n_untrained": float(sum(1 for n in batch.nodes if not n.trained)),
    }


def test_fof_os_mean_propagation_averages_the_answerer_group():
    batch, _, _ = rollout("fof_os", n_questions=2)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    kids = children(batch)
    for n in batch.llm_nodes():
        if n.agent == RERANKER:
            values = [k.terminal for k in kids[n.node_id]]
            assert len(values) == G
            assert n.reward_shared == ((values[0] + values[1]) + values[2] + values[3]) / 4
            tool = batch.nodes[n.parent_id]
            assert tool.reward_shared == n.reward_shared  # a tool with one child passes it through


def test_penalties_off_and_penalties_never_propagate():
    batch, _, _ = rollout("fof_os", n_questions=3)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    shared_on = [n.reward_shared for n in batch.nodes]
    assign_rewards(batch, "mean", False, np.random.default_rng(0))
    assert [n.reward_shared for n in batch.nodes] == shared_on
    for n in batch.nodes:
        assert n.reward == n.reward_shared
    expected, _ = _expected_advantages(batch)
    for n in batch.nodes:
        assert n.advantage == expected.get(n.node_id, 0.0)


def test_rand_aggregation_picks_one_child():
    batch, _, _ = rollout("fof_os", n_questions=2)
    assign_rewards(batch, "rand", True, np.random.default_rng(5))
    kids = children(batch)
    for n in batch.nodes:
        if kids[n.node_id]:
            assert n.reward_shared in [k.reward_shared for k in kids[n.node_id]]


def test_step_metrics_on_a_real_batch():
    batch, system, _ = rollout("fof", n_questions=3)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    m = step_metrics(batch, system)
    assert m["reward/mean"] == float(np.mean([n.terminal for n in batch.leaves()]))
    for agent in AGENTS:
        mine = [n for n in batch.llm_nodes() if n.agent == agent]
        assert m[f"{agent}/samples"] == 12.0
        assert m[f"{agent}/reward"] == float(np.mean([n.reward for n in mine]))
        assert m[f"{agent}/penalty"] == float(np.mean([n.penalty for n in mine]))
        assert m[f"{agent}/advantage_abs"] == float(np.mean([abs(n.advantage) for n in mine]))
    # rewriter outputs cycle: block ok, no block, five queries -> 8 of 12 penalised
    assert m["rewriter/penalty_rate"] == 8 / 12
    assert m["aggregated_samples"] == 0.0  # FoF forks once per question: every sample has one leaf below it
    for agent in AGENTS:  # the sampled tokens' mean -log-prob, over every token of the agent's outputs
        logprobs = [lp for n in batch.llm_nodes() if n.agent == agent for lp in n.logprobs]
        assert len(logprobs) > 0 and m[f"{agent}/entropy"] == pytest.approx(-sum(logprobs) / len(logprobs), rel=1e-12)


def test_step_metrics_count_the_samples_that_carry_a_gradient():
    batch, system, _ = rollout("fof", n_questions=3)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    mine = [n for n in batch.llm_nodes() if n.agent == "reranker"]
    for i, n in enumerate(mine):  # 12 trained Reranker samples: 3 with a gradient, 1 untrained
        n.advantage = 0.5 if i < 3 else 0.0
    mine[-1].group_id = -1
    m = step_metrics(batch, system)
    assert m["reranker/samples"] == 11.0 and m["reranker/informative"] == 3 / 11
    for agent in ("rewriter", "answerer"):  # the share of the agent's trained samples whose advantage is not 0
        trained = [n for n in batch.llm_nodes() if n.agent == agent and n.trained]
        assert m[f"{agent}/informative"] == sum(n.advantage != 0 for n in trained) / len(trained)


def test_step_metrics_say_where_sampling_stopped_exploring():
    """no_choice: the share of an agent's sampled tokens whose nucleus held that token alone (its pi reaches top_p);
    identical_groups: the share of its advantage groups whose samples are the same tokens."""
    batch, system, _ = rollout("fof", n_questions=3)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    system.config.reranker.top_p, system.config.answerer.top_p = 0.85, 0.75  # each agent's own top_p is its threshold
    m = step_metrics(batch, system)
    for agent, top_p in ((REWRITER, 0.9), (RERANKER, 0.85), (ANSWERER, 0.75)):
        logprobs = [lp for n in batch.llm_nodes() if n.agent == agent for lp in n.logprobs]  # -0.01, -0.02, ...
        sure = sum(np.exp(lp) >= top_p for lp in logprobs)
        assert 0 < sure < len(logprobs) and m[f"{agent}/no_choice"] == sure / len(logprobs)
        assert m[f"{agent}/identical_groups"] == 0.0  # the fake generator never repeats an output
    by_group = groups(batch)
    reranker_groups = sorted(g for g, members in by_group.items() if members[0].agent == RERANKER)
    assert len(reranker_groups) == 3 and all(len(by_group[g]) == G for g in reranker_groups)
    first = by_group[reranker_groups[0]]
    for n in first[1:]:  # one of the three groups samples one output G times
        n.output_ids = list(first[0].output_ids)
    system.config.rewriter.top_p = 1.0  # the whole vocabulary: a token is never alone, even one whose log-prob is 0
    assert batch.llm_nodes()[0].agent == REWRITER
    batch.llm_nodes()[0].logprobs[0] = 0.0
    m = step_metrics(batch, system)
    assert m["reranker/identical_groups"] == 1 / 3 and m["rewriter/identical_groups"] == 0.0
    assert m["rewriter/no_choice"] == 0.0
    first[-1].output_ids = first[-1].output_ids + [7]  # one token more in one sample: not identical
    assert step_metrics(batch, system)["reranker/identical_groups"] == 0.0


def test_identical_groups_leave_out_groups_of_one():
    batch, system, _ = rollout("fof", n_questions=2)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    for i, n in enumerate(batch.llm_nodes()):  # every sample a group of its own, as MAPPO's are
        n.group_id = i
    m = step_metrics(batch, system)
    assert not any(k.endswith("/identical_groups") for k in m) and "reranker/no_choice" in m


def test_question_rewards_average_each_trees_leaves():
    batch, _, _ = rollout("fof", n_questions=3)
    got = question_rewards(batch)
    assert list(got) == [e.id for e in batch.examples]
    for q, e in enumerate(batch.examples):
        leaves = [n.terminal for n in batch.leaves() if n.question_index == q]
        assert len(leaves) == G and got[e.id] == pytest.approx(sum(leaves) / G, rel=1e-12)


def test_revisit_delta_pairs_each_question_with_its_first_visit():
    first: dict[str, float] = {}
    assert revisit_metrics(first, {"a": 0.2, "b": 0.5}) == {}  # first visits: nothing to pair yet
    assert first == {"a": 0.2, "b": 0.5}
    got = revisit_metrics(first, {"a": 0.6, "c": 0.9})  # a again (+0.4); c new
    assert got == {"reward/revisit_delta": pytest.approx(0.4, abs=1e-12), "reward/revisits": 1.0}
    got = revisit_metrics(first, {"a": 0.1, "b": 0.7, "c": 0.9})  # against the first visit, not the last
    assert got["reward/revisit_delta"] == pytest.approx((-0.1 + 0.2 + 0.0) / 3, abs=1e-12)
    assert got["reward/revisits"] == 3.0 and first == {"a": 0.2, "b": 0.5, "c": 0.9}


def test_aggregated_samples_count_the_trained_samples_above_differing_answers():
    batch, system, _ = rollout("fof_os", n_questions=2)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    kids = children(batch)

    def leaves_below(n):
        return [n.terminal] if not kids[n.node_id] else [t for k in kids[n.node_id] for t in leaves_below(k)]

    expected = sum(len(set(leaves_below(n))) > 1 for n in batch.llm_nodes() if n.trained)
    assert expected > 0  # the over-sampled Answerers disagree somewhere
    assert step_metrics(batch, system)["aggregated_samples"] == float(expected)
    apply_role_switches(batch, None, [REWRITER, RERANKER])  # only the Answerers, all leaves, stay trained
    assert step_metrics(batch, system)["aggregated_samples"] == 0.0


def test_format_breaks_are_counted_when_their_penalty_is_zero():
    """penalty_rate / invalid_rate count the outputs that break an agent's format rule, not the penalties paid:
    with every penalty set to 0 (no reward changes), the rates are those of the penalised run."""
    batch, system, _ = rollout("fof", n_questions=3)
    free, gen = search_system(), search_generator()
    free.config = SearchConfig(rewriter_penalty=0.0, reranker_penalty=0.0, answerer_penalty=0.0)
    spec = RolloutSpec(sampler="fof", group_size=G, rr_probs=(0.7, 0.1, 0.2))
    unpenalised = run_rollouts(EXAMPLES[:3], free, gen, encode, spec, np.random.default_rng(0))
    assert all(n.penalty == 0.0 for n in unpenalised.llm_nodes())
    m, m_free = step_metrics(batch, system), step_metrics(unpenalised, free)
    assert m_free["rewriter/penalty_rate"] == m["rewriter/penalty_rate"] == 8 / 12
    broken = [n for n in batch.llm_nodes() if n.agent == "reranker" and n.penalty < 0]
    assert broken  # the fake Reranker's outputs include invalid ids
    assert m_free["reranker/invalid_rate"] == m["reranker/invalid_rate"] == len(broken) / 12
    assert m_free["reranker/penalty_rate"] == m["reranker/penalty_rate"]


# --------------------------------------------------------------------------------------------------- role switches


def test_frozen_roles_untrain_exactly_that_role():
    batch, _, _ = rollout("fof", n_questions=3)
    before = {n.node_id: n.group_id for n in batch.nodes}
    count = apply_role_switches(batch, None, [RERANKER])
    assert count == 12
    for n in batch.nodes:
        assert n.group_id == (-1 if n.agent == RERANKER else before[n.node_id])
    assert apply_role_switches(batch, None, [RERANKER]) == 0


def test_train_roles_keep_only_that_role():
    batch, _, _ = rollout("fof", n_questions=3)
    before = {n.node_id: n.group_id for n in batch.nodes}
    count = apply_role_switches(batch, [REWRITER], [])
    assert count == 24
    for n in batch.nodes:
        assert n.group_id == (before[n.node_id] if n.agent == REWRITER else -1)
    assert sum(1 for n in batch.nodes if n.trained) == 12


def test_no_role_switches_change_nothing():
    batch, _, _ = rollout("is", n_questions=2)
    before = [n.group_id for n in batch.nodes]
    assert apply_role_switches(batch, None, []) == 0
    assert [n.group_id for n in batch.nodes] == before


def test_role_switches_on_chains_untrain_exactly_that_role():
    batch, _, _ = rollout("chains", n_questions=2)
    assert apply_role_switches(batch, None, [RERANKER]) == 8
    assert {n.agent for n in batch.llm_nodes() if n.trained} == {REWRITER, ANSWERER}
    assert all(n.advantage == 0.0 for n in batch.llm_nodes() if not n.trained)
