"""Rollout engine (docs/design.md §1–§2): call counts, breadth-first batching, group ids per sampler, tree structure,
reward propagation and advantages on real rollout batches, role switches, custom looping workflows, determinism.

Everything runs on a fake generator and a fake retriever: no model is loaded.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from mhgpo.config import SystemConfig
from mhgpo.data.records import Example, Passage
from mhgpo.model.generation import Generation, SamplingParams
from mhgpo.rl.rewards import apply_role_switches, assign_rewards, assign_shared_rewards, step_metrics
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.runlog import rollout_records
from mhgpo.rl.tree import RolloutBatch, RolloutSpec, merge_batches
from mhgpo.team.loader import WorkflowError
from mhgpo.team.search_system import ANSWERER, RERANKER, RETRIEVER, REWRITER, SearchSystem
from mhgpo.team.workflow import State, StepResult, Workflow

G = 4
AGENTS = (REWRITER, RERANKER, ANSWERER)

EXAMPLES = [
    Example("q0", "Which city is the capital of France?", ("Paris",)),
    Example("q1", "Which city is the capital of Germany?", ("Berlin", "Berlin city")),
    Example("q2", "Which city is the capital of Italy?", ("Rome",)),
    Example("q3", "Which city is the capital of Spain?", ("Madrid",)),
    Example("q4", "Which city is the capital of Japan?", ("Tokyo",)),
    Example("q5", "Which city is the capital of Peru?", ("Lima",)),
]

# Outputs cycle with a global generation counter, so consecutive samples (one group) differ.
SEARCH_OUTPUTS = {
    REWRITER: ["### capital city; country ###", "capital city of the country", "### a; b; c; d; e ###"],
    RERANKER: ["0, 1", "2", "1, 1", "0, 2, 1", "no ids"],
    ANSWERER: ["Paris", "Answer: Berlin", "Paris and Berlin", "Rome", " ".join(["word"] * 30 + ["Paris"])],
}
PENALTY = {REWRITER: -0.5, RERANKER: -0.5, ANSWERER: -1.0}  # SystemConfig defaults


# ------------------------------------------------------------------------------------------------- fakes


def encode(messages: list[dict[str, str]]) -> list[int]:
    """Deterministic token ids of a chat: the code points of its text (decodable by the fake generator)."""
    return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def search_agent_of(text: str) -> str:
    if "Original question is" in text:
        return REWRITER
    if "Do not output anything else." in text:
        return RERANKER
    if "Now, answer the Question" in text:
        return ANSWERER
    raise AssertionError(f"unrecognised prompt: {text[:80]!r}")


@dataclass
class Call:
    agents: list[str]
    params: SamplingParams
    prompts: list[list[int]]


class FakeGenerator:
    """Deterministic, varied outputs; records every `generate` call and every generation in order."""

    def __init__(self, agent_of, respond):
        self.agent_of = agent_of
        self.respond = respond  # (agent, k, prompt text) -> output text
        self.calls: list[Call] = []
        self.generated: list[Generation] = []
        self.k = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        texts = [decode(p) for p in prompts]
        agents = [self.agent_of(t) for t in texts]
        self.calls.append(Call(agents, params, [list(p) for p in prompts]))
        out = []
        for prompt, text, agent in zip(prompts, texts, agents):
            k = self.k
            self.k += 1
            length = 1 + k % 3
            gen = Generation(
                prompt_ids=list(prompt),
                output_ids=[10_000 + k] * length,
                logprobs=[-0.01 * (k + 1)] * length,
                text=self.respond(agent, k, text),
                finished=True,
            )
            out.append(gen)
            self.generated.append(gen)
        return out


def search_generator() -> FakeGenerator:
    return FakeGenerator(search_agent_of, lambda agent, k, text: SEARCH_OUTPUTS[agent][k % len(SEARCH_OUTPUTS[agent])])


class FakeRetriever:
    def __init__(self):
        self.calls: list[list[str]] = []

    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        return [[Passage(f"{q}#{i}", f"{q} {i}", f"passage {i} about {q}") for i in range(k)] for q in queries]


class RecordingSearch(SearchSystem):
    """The search system, recording each batched tool call as (tool, number of states)."""

    tool_calls: list[tuple[str, int]]

    def call_tools(self, tool, states):
        self.tool_calls.append((tool, len(states)))
        return super().call_tools(tool, states)


def search_system() -> RecordingSearch:
    system = RecordingSearch(FakeRetriever(), SystemConfig())
    system.tool_calls = []
    return system


def rollout(sampler, n_questions=3, rr_probs=(0.7, 0.1, 0.2), seed=0, regroup="fork", greedy=False, max_rounds=64):
    system, gen = search_system(), search_generator()
    spec = RolloutSpec(sampler=sampler, group_size=G, rr_probs=rr_probs, rr_regroup=regroup, greedy=greedy)
    batch = run_rollouts(
        EXAMPLES[:n_questions], system, gen, encode, spec, np.random.default_rng(seed), max_rounds=max_rounds
    )
    return batch, system, gen


def groups(batch: RolloutBatch) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for n in batch.nodes:
        if n.trained:
            out[n.group_id].append(n)
    return dict(out)


def children(batch: RolloutBatch) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for n in batch.nodes:
        if n.parent_id >= 0:
            out[n.parent_id].append(n)
    return out


def ancestor(batch: RolloutBatch, node, agent: str):
    while node.agent != agent:
        node = batch.nodes[node.parent_id]
    return node


def hand_f1(prediction: str, answers: tuple[str, ...]) -> float:
    """Token F1 (best over aliases) for the punctuation- and article-free strings used here."""
    best = 0.0
    for gold in answers:
        p_tok, g_tok = prediction.lower().split(), gold.lower().split()
        same = sum((Counter(p_tok) & Counter(g_tok)).values())
        if same:
            precision, recall = same / len(p_tok), same / len(g_tok)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ------------------------------------------------------------------------------------------ 1. call counts

RR_FIRST, RR_SECOND, RR_THIRD = (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)


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


# ------------------------------------------------------------------------------------------ 2. breadth-first


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


# ------------------------------------------------------------------------------------------ 3. group invariants


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


# ------------------------------------------------------------------------------------------ 4. tree structure


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


# ------------------------------------------------------------------------------------------ 5. rewards


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
    free.config = SystemConfig(rewriter_penalty=0.0, reranker_penalty=0.0, answerer_penalty=0.0)
    spec = RolloutSpec(sampler="fof", group_size=G, rr_probs=(0.7, 0.1, 0.2))
    unpenalised = run_rollouts(EXAMPLES[:3], free, gen, encode, spec, np.random.default_rng(0))
    assert all(n.penalty == 0.0 for n in unpenalised.llm_nodes())
    m, m_free = step_metrics(batch, system), step_metrics(unpenalised, free)
    assert m_free["rewriter/penalty_rate"] == m["rewriter/penalty_rate"] == 8 / 12
    broken = [n for n in batch.llm_nodes() if n.agent == "reranker" and n.penalty < 0]
    assert broken  # the fake Reranker's outputs include invalid ids
    assert m_free["reranker/invalid_rate"] == m["reranker/invalid_rate"] == len(broken) / 12
    assert m_free["reranker/penalty_rate"] == m["reranker/penalty_rate"]


# ------------------------------------------------------------------------------------------ 6. role switches


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


# ------------------------------------------------------------------------------------------ 7. custom workflows


class SolverJudge(Workflow):
    """solver -> judge -> (judge says "retry": solver -> judge) -> done. The solver's last attempt is the answer."""

    agents = ("solver", "judge")

    def next_agent(self, state: State) -> str | None:
        attempts, verdicts = state.get("attempts", ()), state.get("verdicts", ())
        if not attempts:
            return "solver"
        if len(verdicts) < len(attempts):
            return "judge"
        if verdicts[-1] == "retry" and len(attempts) < 2:
            return "solver"
        return None

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        attempts = state.get("attempts", ())
        return [{"role": "user", "content": f"[{agent}] {state.example.question} | {' / '.join(attempts)}"}]

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        if agent == "solver":
            return StepResult(
                state.with_values(attempts=state.get("attempts", ()) + (output,)), 0.0, {"answer": output}
            )
        verdict = "retry" if "retry" in output else "accept"
        return StepResult(
            state.with_values(verdicts=state.get("verdicts", ()) + (verdict,)),
            -0.1 if verdict == "retry" else 0.0,
            {"verdict": verdict},
        )

    def final_answer(self, state: State) -> str:
        return state.get("attempts")[-1]


def loop_agent_of(text: str) -> str:
    return text[len("<user>[") : text.index("]")]


LOOP_EXAMPLES = [Example("a", "Solve A", ("right answer",)), Example("b", "Solve B", ("right answer",))]


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


class LookupSolverJudge(SolverJudge):
    """SolverJudge with a batched tool called before every solver attempt."""

    tools = ("lookup",)

    def __init__(self):
        self.tool_calls: list[int] = []

    def next_agent(self, state: State) -> str | None:
        agent = super().next_agent(state)
        if agent == "solver" and len(state.get("lookups", ())) == len(state.get("attempts", ())):
            return "lookup"
        return agent

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        assert tool == "lookup"
        self.tool_calls.append(len(states))
        return [
            StepResult(s.with_values(lookups=s.get("lookups", ()) + ("fact",)), 0.0, {"batch": len(states)})
            for s in states
        ]


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


# ------------------------------------------------------------------------------------------ 8. determinism


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


# ------------------------------------------------------------------------------------------ 8. baselines


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


def test_role_switches_on_chains_untrain_exactly_that_role():
    batch, _, _ = rollout("chains", n_questions=2)
    assert apply_role_switches(batch, None, [RERANKER]) == 8
    assert {n.agent for n in batch.llm_nodes() if n.trained} == {REWRITER, ANSWERER}
    assert all(n.advantage == 0.0 for n in batch.llm_nodes() if not n.trained)


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
        LLMOnly(SystemConfig()),
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


def test_a_new_sampler_is_one_table_entry(monkeypatch):
    """The rollout engine reads the sampler table: an entry it has never seen (IS's fork at every agent with FoF(os)'s
    over-sampling, every sample trained) runs with no other change."""
    from mhgpo.config import samplers

    entry = samplers.Sampler("is_os", forks="every", oversample_terminal=True, team_only=True)
    monkeypatch.setitem(samplers.SAMPLERS, "is_os", entry)
    batch, _, _ = rollout("is_os", n_questions=2)
    llm = batch.llm_nodes()
    # Per question: 3 chains (one forked at each agent). Forked at the rewriter: 4 rewriter, 4 reranker, 16 answerer
    # calls; at the reranker: 1 + 4 + 16; at the answerer: 1 + 1 + 4 (no over-sampling before a fork).
    assert Counter(n.question_index for n in llm) == {0: 51, 1: 51}
    assert batch.stats["samples"] == float(sum(n.trained for n in llm))
    over = [n for n in llm if n.group_key[0] == "os"]
    assert len(over) == 2 * 32 and Counter(Counter(n.group_id for n in over).values()) == {4: 16}


def test_sampler_table_gives_the_config_choices_and_who_trains_with_what():
    from mhgpo.config import samplers
    from mhgpo.config.tables import ALGORITHMS

    assert samplers.train_samplers() == ("is", "fof", "rr", "fof_os", "chains")
    assert samplers.group_samplers() == ("is", "fof", "rr", "fof_os")
    trains = {a: [n for n, s in samplers.SAMPLERS.items() if samplers.trains_with(e, s)] for a, e in ALGORITHMS.items()}
    assert trains == {
        "mhgpo": ["is", "fof", "rr", "fof_os"],
        "grpo": ["is", "fof"],
        "mappo": ["chains"],
        "ppo": ["chains"],
    }
    with pytest.raises(ValueError, match="unknown sampler 'x'"):
        samplers.sampler("x")


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
