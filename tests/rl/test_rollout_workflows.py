"""Rollouts of workflows that loop (an agent visited again, a tool visited twice): the calls, the visits and the
groups keyed by visit, routing by outputs. Everything runs on the fakes of fakes.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
from fakes import (
    LOOP_EXAMPLES,
    FakeGenerator,
    G,
    LookupSolverJudge,
    SolverJudge,
    ancestor,
    encode,
    groups,
    hand_f1,
    loop_agent_of,
)

from mhgpo.rl.rewards import assign_rewards
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec


def loop_rollout(respond, n_questions=1, sampler="fof"):
    gen = FakeGenerator(loop_agent_of, respond)
    spec = RolloutSpec(sampler=sampler, group_size=G)
    batch = run_rollouts(LOOP_EXAMPLES[:n_questions], SolverJudge(), gen, encode, spec, np.random.default_rng(0))
    return batch, gen


def test_looping_workflow_visits_and_groups_keyed_by_visit():
    def respond(agent, k, text):
        if agent == "solver":
            return ["right answer", "wrong answer"][k % 2]
        return "retry" if " / " not in text else "accept"  # retry after the first attempt only

    batch, gen = loop_rollout(respond)
    assert [c.agents for c in gen.calls] == [["solver"] * 4, ["judge"] * 4, ["solver"] * 4, ["judge"] * 4]
    llm = batch.llm_nodes()
    assert Counter((n.agent, n.visit) for n in llm) == {
        ("solver", 0): G,
        ("judge", 0): G,
        ("solver", 1): G,
        ("judge", 1): G,
    }
    gs = groups(batch)
    assert len(gs) == 4 and all(len(ms) == G for ms in gs.values())
    assert sorted((ms[0].agent, ms[0].visit) for ms in gs.values()) == [
        ("judge", 0),
        ("judge", 1),
        ("solver", 0),
        ("solver", 1),
    ]
    for ms in gs.values():
        assert len({(m.agent, m.visit) for m in ms}) == 1
    assert sum(1 for ms in gs.values() if ms[0].agent == "solver") == 2
    fork = [n for n in llm if n.fork_sample]
    assert {(n.agent, n.visit) for n in fork} == {("solver", 0)}
    assert len({tuple(n.prompt_ids) for n in fork}) == 1
    leaves = batch.leaves()
    assert len(leaves) == G and {(n.agent, n.visit) for n in leaves} == {("judge", 1)}
    for leaf in leaves:
        second = batch.nodes[leaf.parent_id]
        assert second.agent == "solver" and second.visit == 1
        assert leaf.final_answer == second.output
        assert leaf.terminal == hand_f1(second.output, ("right answer",))
    assert {leaf.terminal for leaf in leaves} == {1.0, 0.5}  # "wrong answer": P = R = 1/2
    stats = assign_rewards(batch, "mean", True, np.random.default_rng(0))
    assert stats["n_groups"] == 4.0


def test_looping_workflow_routing_depends_on_outputs():
    # solver outputs r, w, r, r | w, r, r, w for the two questions; the judge retries wrong attempts only.
    def respond(agent, k, text):
        if agent == "solver":
            return ["right answer", "wrong answer", "right answer"][k % 3]
        return "retry" if text.rstrip().endswith("wrong answer") else "accept"

    batch, gen = loop_rollout(respond, n_questions=2)
    # round 3 re-solves the 3 retried branches of both questions in one call
    assert [c.agents for c in gen.calls] == [["solver"] * 8, ["judge"] * 8, ["solver"] * 3, ["judge"] * 3]
    llm = batch.llm_nodes()
    assert Counter((n.question_index, n.agent, n.visit) for n in llm) == {
        (0, "solver", 0): G,
        (0, "judge", 0): G,
        (1, "solver", 0): G,
        (1, "judge", 0): G,
        (0, "solver", 1): 1,
        (0, "judge", 1): 1,
        (1, "solver", 1): 2,
        (1, "judge", 1): 2,
    }
    # question 0's second-visit samples are singletons: not trained, counted
    assert batch.stats["singletons_dropped"] == 2.0
    gs = groups(batch)
    assert sorted(len(ms) for ms in gs.values()) == [2, 2, G, G, G, G]
    assert all(len(ms) >= 2 for ms in gs.values())
    assert all(not n.trained for n in llm if n.question_index == 0 and n.visit == 1)
    assert len(batch.leaves()) == 2 * G
    assert {(n.agent, n.visit) for n in batch.leaves()} == {("judge", 0), ("judge", 1)}
    for leaf in batch.leaves():
        attempt = ancestor(batch, batch.nodes[leaf.parent_id], "solver")
        assert leaf.final_answer == attempt.output


def test_looping_workflow_under_is_forks_each_agent_at_its_first_visit():
    def respond(agent, k, text):
        if agent == "solver":
            return ["right answer", "wrong answer"][k % 2]
        return "retry" if " / " not in text else "accept"

    batch, _ = loop_rollout(respond, sampler="is")
    gs = groups(batch)
    assert sorted((ms[0].agent, ms[0].visit, len(ms)) for ms in gs.values()) == [("judge", 0, G), ("solver", 0, G)]
    assert all(n.trained == n.fork_sample for n in batch.llm_nodes())


def test_looping_workflow_with_a_tool_visited_twice():
    def respond(agent, k, text):
        if agent == "solver":
            return ["right answer", "wrong answer"][k % 2]
        return "retry" if " / " not in text else "accept"

    system = LookupSolverJudge()
    gen = FakeGenerator(loop_agent_of, respond)
    batch = run_rollouts(LOOP_EXAMPLES, system, gen, encode, RolloutSpec("fof", G), np.random.default_rng(0))
    assert system.tool_calls == [2, 2 * G]  # once per round, every waiting branch of both questions
    assert [c.agents for c in gen.calls] == [["solver"] * 8, ["judge"] * 8, ["solver"] * 8, ["judge"] * 8]
    assert batch.fork_agents == [["solver"], ["solver"]]
    tools = [n for n in batch.nodes if n.kind == "tool"]
    assert Counter((n.agent, n.visit) for n in tools) == {("lookup", 0): 2, ("lookup", 1): 2 * G}
    assert all(n.group_id == -1 and n.info == {"batch": len([t for t in tools if t.visit == n.visit])} for n in tools)
    for n in batch.llm_nodes():
        if n.agent == "solver":
            parent = batch.nodes[n.parent_id]
            assert (parent.agent, parent.visit) == ("lookup", n.visit)
    gs = groups(batch)
    assert sorted((ms[0].question_index, ms[0].agent, ms[0].visit, len(ms)) for ms in gs.values()) == [
        (q, a, v, G) for q in range(2) for a in ("judge", "solver") for v in (0, 1)
    ]
    assert len(batch.leaves()) == 2 * G
