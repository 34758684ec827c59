"""Rollout trees as data: a `Node` per LLM or tool call, the live `Branch`es of a rollout being grown, a step's
`RolloutBatch` of trees, the `RolloutSpec` that says how they are sampled, the merging of batches (the ranks'
trees of one step) and the trees' records (one JSON-able row per node: what the run log writes to
`rollouts/step_NNNNNN.jsonl`). The trees are grown by `mhgpo.rl.rollout` and grouped by `mhgpo.rl.grouping`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mhgpo.config.eval import MAX_PROMPT_TOKENS
from mhgpo.config.samplers import sampler as sampler_entry
from mhgpo.data.records import Example
from mhgpo.model import wire
from mhgpo.team.loader import RolloutFailure
from mhgpo.team.workflow import State


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
    fork_id: int = -1  # the fork (start of chains) of its question it belongs to
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
    ahead: Any = None  # rollout.pipeline: the key of what was worked out ahead for this branch (mhgpo/rl/pipeline.py)


@dataclass
class RolloutBatch:
    """All trees of one batch, nodes numbered so that a parent's id is smaller than its children's."""

    examples: list[Example]
    nodes: list[Node]
    fork_agents: list[list[str | None]]  # per question, the fork agent of each of its forks
    stats: dict[str, float]
    failures: list[RolloutFailure] = field(default_factory=list)  # questions left out (on_error="skip")
    ranks: list[int] = field(default_factory=list)  # per question, the rank that grew its tree (several ranks)
    # per question, the policy version (the trainer's update count) whose weights sampled its whole tree
    versions: list[int] = field(default_factory=list)

    def llm_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "llm"]

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.final_answer is not None]


wire.register(Node, RolloutBatch)  # (gathered from the ranks of a data-parallel run)


@dataclass
class RolloutSpec:
    sampler: str = "none"
    group_size: int = 1
    rr_probs: tuple[float, ...] = (0.7, 0.1, 0.2)
    rr_regroup: str = "fork"  # fork | role | all: how RR pools singletons (mhgpo.rl.advantages.regroup_singletons)
    greedy: bool = False
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # a longer prompt fails its question (`too_long`)

    @property
    def width(self) -> int:
        """Samples drawn at a fork point (G; 1 without a sampler)."""
        return self.group_size if sampler_entry(self.sampler).forks != "none" else 1


def merge_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """One batch holding the trees of `batches` in order: node ids, parent ids, question indices, fork ids and
    group ids are shifted so that they stay distinct (group ids stay per batch: groups never span batches), and
    group keys are tagged with their batch, so that grouping the merged trees (`mhgpo.rl.grouping.assign_groups`: the ranks'
    trees of one step) groups within each question as each batch would; stats add up and failures are listed
    together."""
    if len(batches) == 1:
        return batches[0]
    examples: list[Example] = []
    nodes: list[Node] = []
    fork_agents: list[list[str | None]] = []
    stats: dict[str, float] = {}
    failures: list[RolloutFailure] = []
    ranks: list[int] = []
    versions: list[int] = []
    next_group = next_fork = 0
    for part, b in enumerate(batches):
        node_shift, question_shift = len(nodes), len(examples)
        groups = [n.group_id for n in b.nodes if n.group_id >= 0]
        forks = [n.fork_id for n in b.nodes if n.fork_id >= 0]
        for n in b.nodes:
            n.node_id += node_shift
            n.parent_id = n.parent_id + node_shift if n.parent_id >= 0 else -1
            n.question_index += question_shift
            n.group_id = n.group_id + next_group if n.group_id >= 0 else -1
            n.fork_id = n.fork_id + next_fork if n.fork_id >= 0 else -1
            n.group_key = None if n.group_key is None else (part, n.group_key)  # distinct across batches
            nodes.append(n)
        next_group += max(groups) + 1 if groups else 0
        next_fork += max(forks) + 1 if forks else 0
        examples.extend(b.examples)
        fork_agents.extend(b.fork_agents)
        failures.extend(b.failures)
        ranks.extend(b.ranks)
        versions.extend(b.versions)
        for k, v in b.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    return RolloutBatch(
        examples,
        nodes,
        fork_agents,
        stats,
        failures,
        ranks if len(ranks) == len(examples) else [],
        versions if len(versions) == len(examples) else [],
    )


def rollout_records(batch: RolloutBatch) -> list[dict[str, Any]]:
    """One JSON-able record per node: ids, agent, group, rewards, advantage and the output text (and, in a
    data-parallel run, the rank that grew its tree)."""
    rows = []
    for n in batch.nodes:
        ex = batch.examples[n.question_index]
        row: dict[str, Any] = {
            "question_id": ex.id,
            "node_id": n.node_id,
            "parent_id": n.parent_id,
            "agent": n.agent,
            "kind": n.kind,
            "visit": n.visit,
            "fork": n.fork_id,
            "group_id": n.group_id,
            "trained": n.trained,
            "reward_shared": n.reward_shared,
            "reward_specific": n.penalty,
            "reward": n.reward,
            "advantage": n.advantage,
            "output": n.output if n.kind == "llm" else n.info,
            "output_tokens": len(n.output_ids),
            "prompt_tokens": len(n.prompt_ids),
        }
        if batch.ranks:
            row["rank"] = batch.ranks[n.question_index]
        if batch.versions:
            row["version"] = batch.versions[n.question_index]
        if n.final_answer is not None:
            row.update(
                final_answer=n.final_answer, terminal_reward=n.terminal, answers=list(ex.answers), question=ex.question
            )
        rows.append(row)
    return rows
