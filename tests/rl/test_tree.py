"""Rollout trees (mhgpo/rl/tree.py) as the samplers grow them: parents, children, leaves and their rewards, and the
merging of batches. Everything runs on the fakes of fakes.py."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import (
    RR_FIRST,
    RR_THIRD,
    G,
    children,
    groups,
    hand_f1,
    rollout,
)

from mhgpo.rl.tree import merge_batches, rollout_records
from mhgpo.team.search_system import ANSWERER, RERANKER, RETRIEVER, REWRITER

# -------------------------------------------------------------------------------------------------- tree structure


@pytest.mark.parametrize(
    "sampler, rr_probs",
    [("is", RR_FIRST), ("fof", RR_FIRST), ("fof_os", RR_FIRST), ("rr", RR_THIRD), ("none", RR_FIRST)],
)
def test_tree_structure(sampler, rr_probs):
    batch, _, _ = rollout(sampler, n_questions=3, rr_probs=rr_probs)
    nodes = batch.nodes
    kids = children(batch)
    assert [n.node_id for n in nodes] == list(range(len(nodes)))
    for n in nodes:
        assert n.parent_id < n.node_id
        assert n.visit == 0
        if n.parent_id >= 0:
            assert nodes[n.parent_id].question_index == n.question_index
        if n.agent == REWRITER:
            assert n.parent_id == -1 and n.kind == "llm"
        elif n.agent == RETRIEVER:
            assert n.kind == "tool" and n.group_key is None
            assert nodes[n.parent_id].agent == REWRITER
            assert len(kids[n.node_id]) >= 1 and all(k.agent == RERANKER for k in kids[n.node_id])
        elif n.agent == RERANKER:
            assert nodes[n.parent_id].agent == RETRIEVER
        else:
            assert n.agent == ANSWERER and nodes[n.parent_id].agent == RERANKER
    # tool nodes have one child per reranker sample drawn from them (G at a reranker fork)
    for n in nodes:
        if n.kind == "tool":
            assert len(kids[n.node_id]) in (1, G)
            assert n.info["ids"] == [f"{q}#{i}" for q in nodes[n.parent_id].info["queries"] for i in range(3)][:10]
    leaves = batch.leaves()
    assert [n.node_id for n in leaves] == [n.node_id for n in nodes if not kids[n.node_id]]
    assert {n.agent for n in leaves} == {ANSWERER}
    assert [n.node_id for n in leaves] == [n.node_id for n in nodes if n.agent == ANSWERER]
    for leaf in leaves:
        answers = batch.examples[leaf.question_index].answers
        assert leaf.final_answer == leaf.info["answer"] == leaf.trace["answer"]
        assert leaf.terminal == hand_f1(leaf.final_answer, answers)
    for n in nodes:
        if n.final_answer is None:
            assert np.isnan(n.terminal)


def test_leaf_rewards_are_the_f1_of_known_answers():
    batch, _, _ = rollout("fof", n_questions=3)
    got = {(leaf.question_index, leaf.final_answer): leaf.terminal for leaf in batch.leaves()}
    # answers cycle with the generation counter: 24 generations before the answerer, 12 answers
    long = " ".join(["word"] * 30 + ["Paris"])
    assert got == {
        (0, long): 2 * (1 / 31) / (1 / 31 + 1),
        (0, "Paris"): 1.0,
        (0, "Berlin"): 0.0,
        (0, "Paris and Berlin"): 2 * (1 / 3) / (1 / 3 + 1),
        (1, "Rome"): 0.0,
        (1, long): 0.0,
        (1, "Paris"): 0.0,
        (1, "Berlin"): 1.0,
        (2, "Paris and Berlin"): 0.0,
        (2, "Rome"): 1.0,
        (2, long): 0.0,
        (2, "Paris"): 0.0,
    }
    penalties = [n.penalty for n in batch.leaves()]
    assert penalties == [-1.0 if n.final_answer == long else 0.0 for n in batch.leaves()]
    assert penalties.count(-1.0) == 3


# ------------------------------------------------------------------------------------------------- merging batches


def test_merge_batches_keeps_trees_groups_and_stats_apart():
    first, _, _ = rollout("fof", n_questions=2, seed=0)
    second, _, _ = rollout("rr", n_questions=3, seed=1)
    parts = [(len(b.nodes), len(b.examples), groups(b), dict(b.stats)) for b in (first, second)]
    before = [[(n.agent, n.output, n.group_id, n.question_index) for n in b.nodes] for b in (first, second)]
    merged = merge_batches([first, second])
    assert len(merged.nodes) == parts[0][0] + parts[1][0] and len(merged.examples) == 5
    assert [n.node_id for n in merged.nodes] == list(range(len(merged.nodes)))
    for n in merged.nodes:
        if n.parent_id >= 0:
            parent = merged.nodes[n.parent_id]
            assert parent.node_id < n.node_id and parent.question_index == n.question_index
    shift = max(parts[0][2]) + 1
    for i, (agent, output, group, question) in enumerate(before[1]):
        n = merged.nodes[parts[0][0] + i]
        assert (n.agent, n.output, n.question_index) == (agent, output, question + 2)
        assert n.group_id == (group + shift if group >= 0 else -1)
    assert len(groups(merged)) == len(parts[0][2]) + len(parts[1][2])
    assert merged.stats == {k: parts[0][3][k] + parts[1][3][k] for k in parts[0][3]}
    assert merged.ranks == [] and "rank" not in rollout_records(merged)[0]  # one process: no rank recorded
    assert merge_batches([first]) is first
    first, _, _ = rollout("fof", n_questions=2, seed=0)
    second, _, _ = rollout("rr", n_questions=3, seed=1)
    first.ranks, second.ranks = [0, 0], [1, 1, 1]  # the ranks that grew them (a data-parallel step)
    merged = merge_batches([first, second])
    records = rollout_records(merged)
    assert merged.ranks == [0, 0, 1, 1, 1] and len(records) == len(merged.nodes)
    assert [r["rank"] for r in records] == [0] * parts[0][0] + [1] * parts[1][0]
