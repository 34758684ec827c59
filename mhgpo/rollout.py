"""Rollout trees, breadth-first over the whole batch, and the four samplers (DESIGN §3, paper Algorithms 1–5).

A rollout for one question is a tree of `Node`s (LLM calls and tool calls). A `Branch` is a live path through a
tree. `fork_on(q, G, agent)` (paper Algorithm 5) is a branch whose `fork_agent` is set: its first call of that
agent samples G outputs from one prompt and continues each one-to-one to the end. All pending calls of one
agent across every question and branch are generated in one batched call, and each tool is called once per
round for all branches waiting on it. Samplers:

- `is`:     fork_on at every agent (one chain per agent and question); only the forked agent's G samples train.
- `fof`:    fork_on at the first agent; all samples train.
- `rr`:     per question, fork agent ~ Categorical(p); prefix singletons regrouped across the batch (Algorithm 3)
            with the singletons of the same role whose questions forked at the same agent (§3.2; `rr_regroup`).
- `fof_os`: FoF, and the terminal agent samples G outputs per branch (its own homogeneous group).
- `chains`: G independent chains per question, no fork and no groups (MAPPO / PPO: the critic is the baseline).
- `none`:   one chain per question (evaluation).

Group ids come from the sampler: samples of one agent (at its k-th visit) under one question and one fork form
one group (homogeneous at the fork agent, heterogeneous downstream); FoF(os)'s terminal samples of one input
form one group. Groups of size 1 never train: RR regroups them (by role and fork agent by default), other samplers
drop and count them.
`chains` gives every LLM call an id of its own: it marks the sample as trained, it is not a group.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mhgpo.advantages import regroup_singletons, rr_pool_keys
from mhgpo.generation import Generator, SamplingParams
from mhgpo.metrics import score
from mhgpo.records import Example
from mhgpo.workflow import State, Workflow

SAMPLERS = ("is", "fof", "rr", "fof_os", "chains", "none")


@dataclass
class Node:
    """One LLM call or tool call of a rollout tree."""

    node_id: int
    question_index: int
    parent_id: int  # -1 for a root
    agent: str
    kind: str  # "llm" or "tool"
    visit: int  # this agent's k-th call along the path (0-based)
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list, repr=False)
    logprobs: list[float] = field(default_factory=list, repr=False)
    output: str = ""
    penalty: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    group_key: tuple | None = None  # filled at creation; None for tool nodes
    fork_sample: bool = False  # one of the G samples at a fork point
    group_id: int = -1  # -1: not trained
    terminal: float = float("nan")  # leaves: the final answer's score
    final_answer: str | None = None  # leaves only
    trace: dict[str, Any] | None = None  # leaves only
    reward_shared: float = 0.0
    reward: float = 0.0
    advantage: float = 0.0

    @property
    def trained(self) -> bool:
        return self.group_id >= 0


@dataclass
class Branch:
    question_index: int
    state: State
    parent_id: int
    fork_id: int
    fork_agent: str | None
    forked: bool = False
    visits: dict[str, int] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """All trees of one batch, nodes numbered so that a parent's id is smaller than its children's."""

    examples: list[Example]
    nodes: list[Node]
    fork_agents: list[list[str | None]]  # per question, the fork agent of each of its forks
    stats: dict[str, float]

    def llm_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "llm"]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.final_answer is not None]


@dataclass
class RolloutSpec:
    sampler: str = "none"
    group_size: int = 1
    rr_probs: tuple[float, ...] = (0.7, 0.1, 0.2)
    rr_regroup: str = "fork"  # fork | role | all: how RR pools singletons (mhgpo.advantages.regroup_singletons)
    greedy: bool = False


def _sampling_params(workflow: Workflow, agent: str, greedy: bool) -> SamplingParams:
    s = workflow.sampling(agent)
    return SamplingParams(s.max_new_tokens, 0.0 if greedy else s.temperature, s.top_p, agent)


def initial_branches(
    n_questions: int, workflow: Workflow, spec: RolloutSpec, rng: np.random.Generator
) -> tuple[list[tuple[int, str | None]], list[list[str | None]]]:
    """(question index, fork agent) of every chain to start, and the fork agents per question."""
    agents = list(workflow.agents)
    starts: list[tuple[int, str | None]] = []
    per_question: list[list[str | None]] = []
    for q in range(n_questions):
        if spec.sampler == "none":
            forks: list[str | None] = [None]
        elif spec.sampler == "chains":
            forks = [None] * spec.group_size  # no fork_agent: each start runs one chain
        elif spec.sampler == "is":
            forks = list(agents)
        elif spec.sampler in ("fof", "fof_os"):
            forks = [None]  # resolved to the first agent actually called (Algorithm 1)
        elif spec.sampler == "rr":
            probs = np.asarray(spec.rr_probs, dtype=float)
            if len(probs) != len(agents):
                raise ValueError(f"rr_probs has {len(probs)} entries for {len(agents)} agents {agents}")
            forks = [agents[int(rng.choice(len(agents), p=probs / probs.sum()))]]
        else:
            raise ValueError(f"unknown sampler {spec.sampler!r}; choose one of {', '.join(SAMPLERS)}")
        per_question.append(forks)
        starts.extend((q, f) for f in forks)
    return starts, per_question


def run_rollouts(
    examples: list[Example],
    workflow: Workflow,
    generator: Generator,
    encode: Callable[[list[dict[str, str]]], list[int]],
    spec: RolloutSpec,
    rng: np.random.Generator,
    reward_fn: Callable[[str, tuple[str, ...]], float] | None = None,
    max_rounds: int = 64,
) -> RolloutBatch:
    """Run every tree of the batch breadth-first; assign group ids; score the leaves.

    `reward_fn(prediction, answers)` gives a leaf's terminal reward (default: F1 best over aliases).
    """
    reward_fn = reward_fn or (lambda pred, answers: score(pred, answers)["f1"])
    G = spec.group_size if spec.sampler != "none" else 1
    first_agent_fork = spec.sampler in ("fof", "fof_os")
    starts, fork_agents = initial_branches(len(examples), workflow, spec, rng)
    nodes: list[Node] = []
    live = [
        Branch(q, workflow.init_state(examples[q]), -1, fork_id, fork_agent)
        for fork_id, (q, fork_agent) in enumerate(starts)
    ]
    llm_calls = 0
    tokens = 0
    for _round in range(max_rounds):
        if not live:
            break
        pending: dict[str, list[Branch]] = defaultdict(list)
        for b in live:
            agent = workflow.next_agent(b.state)
            if agent is None:
                _finish(b, nodes, workflow, reward_fn)
            else:
                pending[agent].append(b)
        live = []
        for agent, branches in pending.items():
            if workflow.is_tool(agent):
                live.extend(_run_tool(agent, branches, nodes, workflow))
                continue
            new, calls, toks = _run_agent(agent, branches, nodes, workflow, generator, encode, spec, G, first_agent_fork)
            live.extend(new)
            llm_calls += calls
            tokens += toks
    else:  # max_rounds steps taken: branches whose workflow is done still finish
        unfinished = []
        for b in live:
            if workflow.next_agent(b.state) is None:
                _finish(b, nodes, workflow, reward_fn)
            else:
                unfinished.append(b)
        if unfinished:
            raise RuntimeError(f"workflow did not finish within {max_rounds} rounds")

    stats = _assign_groups(nodes, spec, G, rng, fork_agents)
    stats.update(llm_calls=float(llm_calls), tokens_generated=float(tokens))
    if spec.sampler in ("fof", "fof_os"):
        fork_agents = [[_first_llm_agent(nodes, q)] for q in range(len(examples))]
    return RolloutBatch(examples, nodes, fork_agents, stats)


def merge_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """One batch holding the trees of `batches` in order: node ids, parent ids, question indices and group ids
    are shifted so that they stay distinct (group ids stay per batch: groups never span batches); stats add up."""
    if len(batches) == 1:
        return batches[0]
    examples: list[Example] = []
    nodes: list[Node] = []
    fork_agents: list[list[str | None]] = []
    stats: dict[str, float] = {}
    next_group = 0
    for b in batches:
        node_shift, question_shift = len(nodes), len(examples)
        groups = [n.group_id for n in b.nodes if n.group_id >= 0]
        for n in b.nodes:
            n.node_id += node_shift
            n.parent_id = n.parent_id + node_shift if n.parent_id >= 0 else -1
            n.question_index += question_shift
            n.group_id = n.group_id + next_group if n.group_id >= 0 else -1
            nodes.append(n)
        next_group += max(groups) + 1 if groups else 0
        examples.extend(b.examples)
        fork_agents.extend(b.fork_agents)
        for k, v in b.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    return RolloutBatch(examples, nodes, fork_agents, stats)


def _first_llm_agent(nodes: list[Node], q: int) -> str | None:
    return next((n.agent for n in nodes if n.question_index == q and n.kind == "llm"), None)


def _finish(b: Branch, nodes: list[Node], workflow: Workflow, reward_fn: Callable) -> None:
    if b.parent_id < 0:
        raise RuntimeError("a workflow finished before calling any agent")
    leaf = nodes[b.parent_id]
    answer = workflow.final_answer(b.state)
    leaf.final_answer = answer
    leaf.terminal = float(reward_fn(answer, b.state.example.answers))
    leaf.trace = workflow.trace(b.state)


def _child(b: Branch, agent: str, nodes: list[Node], kind: str) -> Node:
    visit = b.visits.get(agent, 0)
    node = Node(len(nodes), b.question_index, b.parent_id, agent, kind, visit)
    nodes.append(node)
    return node


def _run_tool(tool: str, branches: list[Branch], nodes: list[Node], workflow: Workflow) -> list[Branch]:
    results = workflow.call_tools(tool, [b.state for b in branches])
    out = []
    for b, res in zip(branches, results):
        node = _child(b, tool, nodes, "tool")
        node.info = dict(res.info)
        visits = dict(b.visits)
        visits[tool] = node.visit + 1
        out.append(Branch(b.question_index, res.state, node.node_id, b.fork_id, b.fork_agent, b.forked, visits))
    return out


def _run_agent(
    agent: str,
    branches: list[Branch],
    nodes: list[Node],
    workflow: Workflow,
    generator: Generator,
    encode: Callable,
    spec: RolloutSpec,
    G: int,
    first_agent_fork: bool,
) -> tuple[list[Branch], int, int]:
    prompts: list[list[int]] = []
    owners: list[tuple[Branch, bool, bool]] = []  # (branch, fork sample?, over-sample?)
    for b in branches:
        ids = encode(workflow.build_prompt(b.state, agent))
        if first_agent_fork and b.fork_agent is None and not b.forked:
            b.fork_agent = agent  # FoF: the fork point is the first agent called
        fork_here = b.fork_agent == agent and not b.forked
        oversample = spec.sampler == "fof_os" and b.forked and agent == workflow.terminal_agent
        n = G if (fork_here or oversample) else 1
        for _ in range(n):
            prompts.append(ids)
            owners.append((b, fork_here, oversample))
    generations = generator.generate(prompts, _sampling_params(workflow, agent, spec.greedy))
    out: list[Branch] = []
    for (b, fork_here, oversample), gen in zip(owners, generations):
        node = _child(b, agent, nodes, "llm")
        node.prompt_ids, node.output_ids, node.logprobs = gen.prompt_ids, gen.output_ids, gen.logprobs
        node.output = gen.text
        res = workflow.apply(b.state, agent, gen.text)
        node.penalty = float(res.penalty)
        node.info = dict(res.info)
        node.fork_sample = fork_here
        if oversample:
            node.group_key = ("os", b.question_index, b.parent_id)
        else:
            node.group_key = ("fork", b.question_index, b.fork_id, agent, node.visit)
        visits = dict(b.visits)
        visits[agent] = node.visit + 1
        forked = b.forked or fork_here
        out.append(Branch(b.question_index, res.state, node.node_id, b.fork_id, b.fork_agent, forked, visits))
    return out, len(generations), sum(len(g.output_ids) for g in generations)


def _assign_groups(
    nodes: list[Node], spec: RolloutSpec, G: int, rng: np.random.Generator, fork_agents: list[list[str | None]]
) -> dict[str, float]:
    """Turn group keys into integer group ids; drop (or, for RR, regroup) singletons. Returns counts."""
    llm = [n for n in nodes if n.kind == "llm"]
    if spec.sampler == "none" or not llm:
        return {"groups": 0.0, "singletons_dropped": 0.0, "samples": 0.0}
    if spec.sampler == "chains":  # every call trains on its own (the critic, not a group, gives its baseline)
        for i, n in enumerate(llm):
            n.group_id = i
        return {"groups": 0.0, "singletons_dropped": 0.0, "samples": float(len(llm))}
    keep = [n for n in llm if n.fork_sample] if spec.sampler == "is" else llm
    sizes = Counter(n.group_key for n in keep)
    ids: dict[tuple, int] = {}
    group_ids = np.full(len(keep), -1, dtype=np.int64)
    for i, n in enumerate(keep):
        group_ids[i] = ids.setdefault(n.group_key, len(ids))
    dropped = 0
    if spec.sampler == "rr":
        keys = rr_pool_keys(spec.rr_regroup, [n.agent for n in keep],
                            [fork_agents[n.question_index][0] for n in keep])  # RR: one fork agent per question
        group_ids, dropped = regroup_singletons(group_ids, keys, G, rng)
    else:
        for i, n in enumerate(keep):
            if sizes[n.group_key] < 2:
                group_ids[i] = -1
                dropped += 1
    # renumber to 0..K-1 in order of first appearance
    remap: dict[int, int] = {}
    for n, g in zip(keep, group_ids):
        n.group_id = -1 if g < 0 else remap.setdefault(int(g), len(remap))
    return {
        "groups": float(len(remap)),
        "singletons_dropped": float(dropped),
        "samples": float(sum(1 for n in keep if n.group_id >= 0)),
    }
