"""The rollout engine (mhgpo/rl/rollout.py, docs/design.md §1–§2) with each sampler: LLM calls and trained samples
per question, breadth-first batching (one generate call per agent and round), the rounds limit, determinism, and the
baselines' samplers (independent chains, single-agent GRPO).

Everything runs on the fakes of fakes.py: no model is loaded.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from fakes import (
    AGENTS,
    EXAMPLES,
    LOOP_EXAMPLES,
    RR_FIRST,
    RR_SECOND,
    RR_THIRD,
    FakeGenerator,
    G,
    SolverJudge,
    children,
    encode,
    groups,
    loop_agent_of,
    rollout,
)

from mhgpo.config import SearchConfig
from mhgpo.model.generation import SamplingParams
from mhgpo.rl.rewards import assign_rewards, assign_shared_rewards
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.team.loader import WorkflowError
from mhgpo.team.search_system import ANSWERER, RERANKER, RETRIEVER, REWRITER
from mhgpo.team.workflow import State

# ----------------------------------------------------------------------------------------------------- call counts


@pytest.mark.parametrize(
    "sampler, rr_probs, calls, trained",
    [
        ("is", RR_FIRST, 27, 12),
        ("fof", RR_FIRST, 12, 12),
        ("fof_os", RR_FIRST, 24, 24),
        ("rr", RR_FIRST, 12, 12),
        ("rr", RR_SECOND, 9, 9),
        ("rr", RR_THIRD, 6, 6),
        ("none", RR_FIRST, 3, 0),
    ],
)
def test_llm_calls_and_trained_samples_per_question(sampler, rr_probs, calls, trained):
    # 4 questions: RR prefix singletons (4 per prefix agent) regroup into exactly one group each.
    batch, _, gen = rollout(sampler, n_questions=4, rr_probs=rr_probs)
    llm = batch.llm_nodes()
    assert Counter(n.question_index for n in llm) == {q: calls for q in range(4)}
    assert Counter(n.question_index for n in llm if n.trained) == ({q: trained for q in range(4)} if trained else {})
    assert batch.stats["llm_calls"] == float(len(llm)) == float(4 * calls)
    assert len(gen.generated) == 4 * calls
    assert batch.stats["tokens_generated"] == float(sum(len(n.output_ids) for n in llm))
    assert batch.stats["samples"] == float(4 * trained)
    assert batch.stats["singletons_dropped"] == 0.0
    assert len(batch.leaves()) == 4 * {"is": 12, "fof": 4, "fof_os": 16, "rr": 4, "none": 1}[sampler]


def test_rr_fork_choice_is_forced_by_probs():
    for probs, agent, per_q in ((RR_FIRST, REWRITER, 12), (RR_SECOND, RERANKER, 9), (RR_THIRD, ANSWERER, 6)):
        batch, _, _ = rollout("rr", n_questions=3, rr_probs=probs)
        assert batch.fork_agents == [[agent]] * 3
        forks = [n for n in batch.llm_nodes() if n.fork_sample]
        assert Counter((n.question_index, n.agent) for n in forks) == {(q, agent): G for q in range(3)}
        assert batch.stats["llm_calls"] == float(3 * per_q)


def test_fork_agents_reported_per_sampler():
    assert rollout("is")[0].fork_agents == [list(AGENTS)] * 3
    assert rollout("fof")[0].fork_agents == [[REWRITER]] * 3
    assert rollout("fof_os")[0].fork_agents == [[REWRITER]] * 3


# --------------------------------------------------------------------------------------------------- breadth-first


def test_fof_breadth_first_one_generate_call_per_agent_and_one_tool_call():
    batch, system, gen = rollout("fof", n_questions=3)
    assert [c.agents for c in gen.calls] == [[REWRITER] * 12, [RERANKER] * 12, [ANSWERER] * 12]
    assert [c.params for c in gen.calls] == [
        SamplingParams(48, 1.0, 0.9, REWRITER),
        SamplingParams(16, 1.0, 0.9, RERANKER),
        SamplingParams(24, 1.0, 0.9, ANSWERER),
    ]  # each call names its agent
    assert system.tool_calls == [(RETRIEVER, 12)]
    rewriter_queries = [q for n in batch.llm_nodes() if n.agent == REWRITER for q in n.info["queries"]]
    assert system.retriever.calls == [rewriter_queries]
    # Nodes keep the generator's token ids and log-probs as generated, in generation order.
    llm = batch.llm_nodes()
    assert [n.output_ids for n in llm] == [g.output_ids for g in gen.generated]
    assert [n.logprobs for n in llm] == [g.logprobs for g in gen.generated]
    assert [n.prompt_ids for n in llm] == [p for c in gen.calls for p in c.prompts]
    assert [n.output for n in llm] == [g.text for g in gen.generated]


def test_is_and_fof_os_breadth_first_call_sizes():
    _, system, gen = rollout("is", n_questions=3)
    # per question: rewriter 4+1+1, reranker 4+4+1, answerer 4+4+4
    assert [c.agents for c in gen.calls] == [[REWRITER] * 18, [RERANKER] * 27, [ANSWERER] * 36]
    assert system.tool_calls == [(RETRIEVER, 18)]
    assert len(system.retriever.calls) == 1
    _, system, gen = rollout("fof_os", n_questions=3)
    assert [c.agents for c in gen.calls] == [[REWRITER] * 12, [RERANKER] * 12, [ANSWERER] * 48]
    assert system.tool_calls == [(RETRIEVER, 12)]


def test_rr_mixed_forks_still_one_call_per_agent_per_round():
    # 6 questions under the default probabilities: forks at different agents share every round's call.
    batch, system, gen = rollout("rr", n_questions=6, seed=3)
    per_q = {REWRITER: (G, G, G), RERANKER: (1, G, G), ANSWERER: (1, 1, G)}
    sizes = [sum(per_q[f[0]][i] for f in batch.fork_agents) for i in range(3)]
    assert [c.agents for c in gen.calls] == [[a] * s for a, s in zip(AGENTS, sizes)]
    assert system.tool_calls == [(RETRIEVER, sizes[0])]
    assert len({f[0] for f in batch.fork_agents}) > 1  # the seed gives a mix of fork agents


def test_greedy_spec_decodes_at_temperature_zero():
    _, _, gen = rollout("none", n_questions=2, greedy=True)
    assert [c.params for c in gen.calls] == [
        SamplingParams(48, 0.0, 0.9, REWRITER),
        SamplingParams(16, 0.0, 0.9, RERANKER),
        SamplingParams(24, 0.0, 0.9, ANSWERER),
    ]
    assert [len(c.agents) for c in gen.calls] == [2, 2, 2]


# ----------------------------------------------------------------------------------------------- rounds, bad input


class Endless(SolverJudge):
    def next_agent(self, state: State) -> str | None:
        return "solver"


def test_workflow_that_never_finishes_raises_after_max_rounds():
    gen = FakeGenerator(loop_agent_of, lambda agent, k, text: "again")
    with pytest.raises(
        WorkflowError,
        match=r"Endless.next_agent: did not finish within 5 rounds \(max_rounds\) "
        r"\(question a, agent solver\)",
    ):
        run_rollouts(
            LOOP_EXAMPLES, Endless(), gen, encode, RolloutSpec("fof", G), np.random.default_rng(0), max_rounds=5
        )
    assert [len(c.agents) for c in gen.calls] == [2 * G] * 5


def test_max_rounds_counts_steps():
    # the search system takes exactly 4 steps (rewriter, retriever, reranker, answerer)
    batch, _, _ = rollout("fof", n_questions=2, max_rounds=4)
    assert len(batch.leaves()) == 2 * G
    with pytest.raises(WorkflowError, match="did not finish within 3 rounds"):
        rollout("fof", n_questions=2, max_rounds=3)


def test_bad_sampler_and_rr_probs_are_rejected():
    with pytest.raises(ValueError, match="unknown sampler"):
        rollout("grpo")
    with pytest.raises(ValueError, match="rr_probs has 2 entries"):
        rollout("rr", rr_probs=(0.5, 0.5))


# ----------------------------------------------------------------------------------------------------- determinism


def _signature(batch):
    return (
        batch.fork_agents,
        [n.group_id for n in batch.nodes],
        [n.fork_sample for n in batch.nodes],
        [(n.agent, n.parent_id) for n in batch.nodes],
        batch.stats,
    )


def test_rr_same_seed_same_forks_and_groups():
    a, _, _ = rollout("rr", n_questions=6, seed=11)
    b, _, _ = rollout("rr", n_questions=6, seed=11)
    assert _signature(a) == _signature(b)
    c, _, _ = rollout("rr", n_questions=6, seed=12)
    assert c.fork_agents != a.fork_agents
    for batch in (a, c):
        for q, [agent] in enumerate(batch.fork_agents):
            forks = [n for n in batch.llm_nodes() if n.question_index == q and n.fork_sample]
            assert len(forks) == G and {n.agent for n in forks} == {agent}
        per_q = {REWRITER: 12, RERANKER: 9, ANSWERER: 6}
        assert batch.stats["llm_calls"] == float(sum(per_q[f[0]] for f in batch.fork_agents))


def test_rr_regrouping_is_seeded():
    a, _, _ = rollout("rr", n_questions=6, rr_probs=RR_THIRD, seed=1)
    b, _, _ = rollout("rr", n_questions=6, rr_probs=RR_THIRD, seed=1)
    assert [n.group_id for n in a.nodes] == [n.group_id for n in b.nodes]
    # 6 singletons per prefix role: one group of 4 each, 2 left per role
    assert a.stats["singletons_dropped"] == 4.0

    def regrouped(batch):
        return sorted(
            (ms[0].agent, sorted(m.question_index for m in ms))
            for ms in groups(batch).values()
            if ms[0].agent != ANSWERER
        )

    assert regrouped(a) == [(RERANKER, [0, 1, 2, 5]), (REWRITER, [0, 1, 3, 4])]
    c, _, _ = rollout("rr", n_questions=6, rr_probs=RR_THIRD, seed=2)
    assert regrouped(c) == [(RERANKER, [0, 2, 3, 5]), (REWRITER, [0, 1, 4, 5])]


# ----------------------------------------------------------------------------------------- the baselines' samplers


def test_chains_sampler_runs_g_independent_chains_with_every_call_trained_on_its_own():
    """MAPPO / PPO rollouts: G chains per question, nothing forked, each LLM call trained (an id of its own)."""
    batch, system, gen = rollout("chains", n_questions=3)
    llm = batch.llm_nodes()
    assert [c.agents for c in gen.calls] == [[REWRITER] * 12, [RERANKER] * 12, [ANSWERER] * 12]
    assert system.tool_calls == [(RETRIEVER, 12)]
    assert Counter(n.question_index for n in llm) == {0: 12, 1: 12, 2: 12}
    assert sorted(n.group_id for n in llm) == list(range(36)) and all(n.trained for n in llm)
    assert not any(n.fork_sample for n in llm)
    assert all(len(k) == 1 for k in children(batch).values())  # chains: no node has two children
    assert sum(n.parent_id == -1 for n in batch.nodes) == 12 and len(batch.leaves()) == 12
    assert batch.fork_agents == [[None] * G] * 3
    assert batch.stats == {
        "groups": 0.0,
        "singletons_dropped": 0.0,
        "samples": 36.0,
        "llm_calls": 36.0,
        "tokens_generated": float(sum(len(n.output_ids) for n in llm)),
        "failed_questions": 0.0,
    }
    rewards = assign_shared_rewards(batch, "mean", True, np.random.default_rng(0))
    assert [n.reward for n in batch.nodes] == list(rewards)
    for n in llm:  # a chain passes its leaf's score back unchanged; the penalty is the agent's own
        leaf = n
        while children(batch).get(leaf.node_id):
            leaf = children(batch)[leaf.node_id][0]
        assert n.reward == leaf.terminal + n.penalty


def llm_only_agent_of(text: str) -> str:
    assert "Answer the question as accurately and briefly as possible." in text, text[:80]
    return "llm"


def test_single_agent_grpo_groups_are_g_answers_to_one_prompt():
    """`system=llm algo=grpo` (sampler fof on the one-agent workflow): each group is G samples of one prompt."""
    from mhgpo.team.search_system import LLMOnly

    answers = ["Paris", "Berlin", "Rome", "Madrid", "Tokyo"]
    gen = FakeGenerator(llm_only_agent_of, lambda agent, k, text: answers[k % len(answers)])
    batch = run_rollouts(
        EXAMPLES[:3],
        LLMOnly(SearchConfig()),
        gen,
        encode,
        RolloutSpec(sampler="fof", group_size=G),
        np.random.default_rng(0),
    )
    assert [c.agents for c in gen.calls] == [["llm"] * 12]
    gs = groups(batch)
    assert len(gs) == 3
    for q, members in enumerate(gs.values()):
        assert len(members) == G and {m.question_index for m in members} == {q}
        assert len({tuple(m.prompt_ids) for m in members}) == 1  # homogeneous: one prompt
        assert all(m.parent_id == -1 and m.final_answer is not None for m in members)
    assign_rewards(batch, "mean", True, np.random.default_rng(0))
    for members in gs.values():  # plain GRPO: (R - mean) / (std + eps) of the G answers to the question
        r = np.array([m.terminal for m in members])
        want = (r - r.mean()) / (r.std(ddof=1) + 1e-6) if np.ptp(r) else np.zeros(G)
        np.testing.assert_allclose([m.advantage for m in members], want, rtol=0, atol=1e-12)
