"""Growing rollout trees, breadth-first over the whole batch, with the four samplers (paper Algorithms 1–5).

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

The trees' data types are in `mhgpo.rl.tree`; their group ids, which come from the sampler, in
`mhgpo.rl.grouping`.

A question whose rollout fails in a workflow method (an exception, a name `next_agent` should not return, no end
within `max_rounds`) either stops the batch with a `WorkflowError` naming file, class, method and question
(`on_error="raise"`), or is left out of the batch whole and reported in `RolloutBatch.failures`
(`on_error="skip"`): the other questions' trees, group ids and rewards are those of a batch without it.
A `ServiceError` of a tool (its retrieval service is down) is no question's failure: it stops the batch.

`pipeline=True` (`rollout.pipeline`): the tool calls and rewards of each generation batch are worked out in a thread
while the engine generates the next batches (`mhgpo.rl.pipeline`); the results are the same.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mhgpo.config.samplers import sampler as sampler_entry
from mhgpo.data.records import Example
from mhgpo.errors import ServiceError
from mhgpo.model.generation import Generator, OnChunk, SamplingParams, generate_in_chunks
from mhgpo.rl.grouping import assign_groups
from mhgpo.rl.pipeline import Failed, Prefetch
from mhgpo.rl.tree import Branch, Node, RolloutBatch, RolloutSpec
from mhgpo.team.loader import RolloutFailure, WorkflowError, failure
from mhgpo.team.workflow import State, StepResult, Workflow

# (agent, the call's prompts, whether each prompt's sample may be trained) -> the callback of the call's batches
OnCall = Callable[[str, list[list[int]], list[bool]], OnChunk | None]


def too_long(tokens: int, limit: int) -> str:
    """Why a prompt is refused (the failure names the question, the agent and the method)."""
    return (
        f"gave a prompt of {tokens} tokens, more than max_prompt_tokens={limit} (a very long question or "
        f"passage?); the question is left out"
    )


def _sampling_params(workflow: Workflow, agent: str, greedy: bool) -> SamplingParams:
    s = workflow.sampling(agent)
    return SamplingParams(s.max_new_tokens, 0.0 if greedy else s.temperature, s.top_p, agent)


def initial_branches(
    n_questions: int, workflow: Workflow, spec: RolloutSpec, rng: np.random.Generator
) -> tuple[list[tuple[int, str | None]], list[list[str | None]]]:
    """(question index, fork agent) of every chain to start, and the fork agents per question."""
    agents = list(workflow.agents)
    forking = sampler_entry(spec.sampler).forks
    starts: list[tuple[int, str | None]] = []
    per_question: list[list[str | None]] = []
    for q in range(n_questions):
        if forking == "none":
            forks: list[str | None] = [None]
        elif forking == "chains":
            forks = [None] * spec.group_size  # no fork_agent: each start runs one chain
        elif forking == "every":
            forks = list(agents)
        elif forking == "first":
            forks = [None]  # resolved to the first agent actually called (Algorithm 1)
        else:  # drawn
            probs = np.asarray(spec.rr_probs, dtype=float)
            if len(probs) != len(agents):
                raise ValueError(f"rr_probs has {len(probs)} entries for {len(agents)} agents {agents}")
            forks = [agents[int(rng.choice(len(agents), p=probs / probs.sum()))]]
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
    max_rounds: int = 64,
    on_error: str = "raise",
    grouped: bool = True,
    pipeline: bool | Prefetch = False,
    on_call: OnCall | None = None,
) -> RolloutBatch:
    """Run every tree of the batch breadth-first; assign group ids; score the leaves (`workflow.reward`).

    `on_error`: "raise" (a failing question stops with a `WorkflowError`) or "skip" (it is left out and listed in
    the batch's `failures`). `grouped=False`: the trees without group ids, for :func:`assign_groups` later (several
    ranks each grow the trees of their questions, and the whole step's trees are grouped together). `pipeline`:
    tool calls and rewards worked out while later generation batches run (`mhgpo.rl.pipeline`; a `Prefetch` of
    one's own: its worker, closed here). `on_call(agent, prompts, may_train)`: called before each agent call's generation
    (`may_train`: whether each prompt's sample can be trained, as the sampler says), it returns a callback for the
    call's batches as they finish (`generate_in_chunks`), or None (`mhgpo.rl.reference_ahead`)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error: expected raise or skip, got {on_error!r}")
    prefetch = pipeline if isinstance(pipeline, Prefetch) else Prefetch(workflow) if pipeline else None
    try:
        return _run_rollouts(
            examples, workflow, generator, encode, spec, rng, max_rounds, on_error, grouped, prefetch, on_call
        )
    finally:
        if prefetch is not None:
            prefetch.close()


def _run_rollouts(
    examples: list[Example],
    workflow: Workflow,
    generator: Generator,
    encode: Callable[[list[dict[str, str]]], list[int]],
    spec: RolloutSpec,
    rng: np.random.Generator,
    max_rounds: int,
    on_error: str,
    grouped: bool,
    prefetch: Prefetch | None,
    on_call: OnCall | None = None,
) -> RolloutBatch:
    starts, fork_agents = initial_branches(len(examples), workflow, spec, rng)
    guard = _Guard(workflow, examples, on_error, prefetch, on_call)
    nodes: list[Node] = []
    live = []
    for fork_id, (q, fork_agent) in enumerate(starts):
        state = guard.call(q, "init_state", None, workflow.init_state, examples[q])
        if state is not _FAILED:
            live.append(Branch(q, state, -1, fork_id, fork_agent))
    llm_calls = 0
    tokens = 0
    for _round in range(max_rounds):
        live = guard.alive(live)
        if not live:
            break
        pending: dict[str, list[Branch]] = defaultdict(list)
        for b in live:
            agent = guard.next_agent(b)
            if agent is None:
                _finish(b, nodes, workflow, guard)
            elif agent is not _FAILED:
                pending[agent].append(b)
        live = []
        for agent, branches in pending.items():
            branches = guard.alive(branches)
            if workflow.is_tool(agent):
                live.extend(_run_tool(agent, branches, nodes, guard))
                continue
            done = _run_agent(agent, branches, len(nodes), guard, generator, encode, spec)
            nodes.extend(done.nodes)
            live.extend(done.branches)
            llm_calls += done.llm_calls
            tokens += done.tokens
    else:  # max_rounds steps taken: branches whose workflow is done still finish
        for b in guard.alive(live):
            agent = guard.next_agent(b)
            if agent is None:
                _finish(b, nodes, workflow, guard)
            elif agent is not _FAILED:
                guard.fail(
                    b.question_index,
                    "next_agent",
                    agent,
                    problem=f"did not finish within {max_rounds} rounds (max_rounds)",
                )

    if guard.failures:
        examples, nodes, fork_agents = _without_questions(set(guard.failures), examples, nodes, fork_agents)
    stats = dict(
        llm_calls=float(llm_calls), tokens_generated=float(tokens), failed_questions=float(len(guard.failures))
    )
    batch = RolloutBatch(examples, nodes, fork_agents, stats, list(guard.failures.values()))
    if grouped:
        assign_groups(batch, spec, rng)
    return batch


_FAILED = object()  # what a guarded call returns for a question that failed (on_error="skip")


class _Guard:
    """Calls the workflow's methods for one question at a time and turns what goes wrong into a failure of that
    question: raised at once as a `WorkflowError` (on_error="raise") or recorded (on_error="skip")."""

    def __init__(
        self,
        workflow: Workflow,
        examples: list[Example],
        on_error: str,
        prefetch: Prefetch | None = None,
        on_call: OnCall | None = None,
    ) -> None:
        self.workflow, self.examples, self.on_error = workflow, examples, on_error
        self.prefetch = prefetch  # rollout.pipeline: tool calls and rewards worked out ahead
        self.on_call = on_call  # (rollout.pipeline) what else works on each call's batches as they finish
        self.failures: dict[int, RolloutFailure] = {}
        self.names = set(workflow.agents) | set(workflow.tools)

    def fail(self, q: int, method: str, agent: str | None, exc: BaseException | None = None, problem: str = ""):
        if q in self.failures:
            return _FAILED
        record = failure(self.workflow, method, self.examples[q].id, agent, exc, problem)
        if self.on_error == "raise":
            raise WorkflowError(record.message()) from exc
        self.failures[q] = record
        return _FAILED

    def call(self, q: int, method: str, agent: str | None, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:
            return self.fail(q, method, agent, e)

    def taken(self, q: int, method: str, agent: str | None, value: Any) -> Any:
        """A value worked out ahead, as :meth:`call` would have returned it (a `Failed` call fails the question)."""
        return self.fail(q, method, agent, value.exc) if isinstance(value, Failed) else value

    def alive(self, branches: list[Branch]) -> list[Branch]:
        return [b for b in branches if b.question_index not in self.failures]

    def next_agent(self, b: Branch) -> Any:
        """The branch's next step (None: done), checked to be one of the workflow's agents or tools."""
        name = self.call(b.question_index, "next_agent", None, self.workflow.next_agent, b.state)
        if name is None or name is _FAILED or (isinstance(name, str) and name in self.names):
            return name
        return self.fail(
            b.question_index,
            "next_agent",
            None,
            problem=(
                f"returned {name!r}, which is neither an agent ({', '.join(self.workflow.agents)}) nor a tool "
                f"({', '.join(self.workflow.tools) or 'none'})"
            ),
        )

    def step_result(self, q: int, method: str, agent: str, res: Any) -> Any:
        if res is _FAILED:
            return res
        if not isinstance(res, StepResult) or not isinstance(res.state, State):
            return self.fail(q, method, agent, problem=f"returned {type(res).__name__}, not a StepResult(state, ...)")
        try:
            float(res.penalty)
        except (TypeError, ValueError):
            return self.fail(q, method, agent, problem=f"returned the penalty {res.penalty!r}, not a number")
        return res


def _without_questions(
    failed: set[int], examples: list[Example], nodes: list[Node], fork_agents: list[list[str | None]]
) -> tuple[list[Example], list[Node], list[list[str | None]]]:
    """The batch without the failed questions: the others' nodes renumbered (ids, parents, question indices).
    Group keys keep the old numbers, which still tell the groups apart."""
    keep = [q for q in range(len(examples)) if q not in failed]
    q_map = {q: i for i, q in enumerate(keep)}
    kept = [n for n in nodes if n.question_index not in failed]
    id_map = {n.node_id: i for i, n in enumerate(kept)}
    for n in kept:
        n.node_id = id_map[n.node_id]
        n.parent_id = id_map[n.parent_id] if n.parent_id >= 0 else -1
        n.question_index = q_map[n.question_index]
    return [examples[q] for q in keep], kept, [fork_agents[q] for q in keep]


def _finish(b: Branch, nodes: list[Node], workflow: Workflow, guard: _Guard) -> None:
    q = b.question_index
    if b.parent_id < 0:
        guard.fail(q, "next_agent", None, problem="returned None before any agent was called")
        return
    example = b.state.example
    ahead = guard.prefetch.finish(b.ahead, b.state) if guard.prefetch is not None and b.ahead is not None else None
    if ahead is not None:  # (rollout.pipeline) worked out while later batches generated
        answer, terminal, trace = (
            guard.taken(q, m, None, v) for m, v in zip(("final_answer", "reward", "trace"), ahead)
        )
    else:
        answer = guard.call(q, "final_answer", None, workflow.final_answer, b.state)
        terminal = guard.call(q, "reward", None, lambda: float(workflow.reward(b.state, example)))
        trace = guard.call(q, "trace", None, workflow.trace, b.state)
    if _FAILED in (answer, terminal, trace):
        return
    leaf = nodes[b.parent_id]
    leaf.final_answer = answer if isinstance(answer, str) else str(answer)
    leaf.terminal = terminal
    leaf.trace = trace


def _child(b: Branch, agent: str, nodes: list[Node], kind: str) -> Node:
    visit = b.visits.get(agent, 0)
    node = Node(len(nodes), b.question_index, b.parent_id, agent, kind, visit, fork_id=b.fork_id)
    nodes.append(node)
    return node


def _run_tool(tool: str, branches: list[Branch], nodes: list[Node], guard: _Guard) -> list[Branch]:
    """One batched call of the tool for every waiting branch; if it raises, each state is tried alone, so that
    only the questions it fails on are failures."""
    workflow = guard.workflow
    results: list[Any] = [None] * len(branches)
    ahead: set[int] = set()  # (rollout.pipeline) the branches whose call was made while later batches generated
    if guard.prefetch is not None:
        for i, b in enumerate(branches):
            worked = guard.prefetch.tool_result(b.ahead, b.state, tool) if b.ahead is not None else None
            if worked is not None:
                results[i] = worked.tool_result
                ahead.add(i)
    rest = [i for i in range(len(branches)) if i not in ahead]
    alone = False
    try:
        if rest or not ahead:
            called = list(workflow.call_tools(tool, [branches[i].state for i in rest]))
            if len(called) != len(rest):
                raise ValueError(f"returned {len(called)} results for {len(rest)} states")
            for i, res in zip(rest, called):
                results[i] = res
    except ServiceError:  # a service the tool needs is down: not one question's failure
        raise
    except Exception:
        alone = True
    for i, b in enumerate(branches):
        if i in ahead:
            results[i] = guard.taken(b.question_index, "call_tools", tool, results[i])
        elif alone:
            res = guard.call(b.question_index, "call_tools", tool, workflow.call_tools, tool, [b.state])
            results[i] = res[0] if isinstance(res, list) and len(res) == 1 else res
    out = []
    for b, res in zip(branches, results):
        res = guard.step_result(b.question_index, "call_tools", tool, res)
        if res is _FAILED:
            continue
        node = _child(b, tool, nodes, "tool")
        node.info = dict(res.info)
        visits = dict(b.visits)
        visits[tool] = node.visit + 1
        out.append(Branch(b.question_index, res.state, node.node_id, b.fork_id, b.fork_agent, b.forked, visits))
    return out


@dataclass
class AgentRound:
    """What one batched call of an agent adds: the branches that continue, the new LLM nodes (numbered on from the
    batch's nodes), and the calls and tokens generated."""

    branches: list[Branch]
    nodes: list[Node]
    llm_calls: int = 0
    tokens: int = 0


def _run_agent(
    agent: str,
    branches: list[Branch],
    next_id: int,
    guard: _Guard,
    generator: Generator,
    encode: Callable,
    spec: RolloutSpec,
) -> AgentRound:
    """One batched generation for every branch waiting on `agent` (G samples where a branch forks or
    over-samples); the input branches are left as they are."""
    workflow = guard.workflow
    G = spec.width
    entry = sampler_entry(spec.sampler)
    first_agent_fork = entry.forks == "first"
    prompts: list[list[int]] = []
    owners: list[tuple[Branch, str | None, bool, bool]] = []  # (branch, its fork agent, fork sample?, over-sample?)
    for b in branches:
        ids = guard.call(
            b.question_index, "build_prompt", agent, lambda b=b: encode(workflow.build_prompt(b.state, agent))
        )
        if ids is _FAILED:
            continue
        if len(ids) > spec.max_prompt_tokens:  # one huge question or passage must not take the machine's memory
            guard.fail(b.question_index, "build_prompt", agent, problem=too_long(len(ids), spec.max_prompt_tokens))
            continue
        fork_agent = b.fork_agent
        if first_agent_fork and fork_agent is None and not b.forked:
            fork_agent = agent  # FoF: the fork point is the first agent called
        fork_here = fork_agent == agent and not b.forked
        oversample = entry.oversample_terminal and b.forked and agent == workflow.terminal_agent
        n = G if (fork_here or oversample) else 1
        for _ in range(n):
            prompts.append(ids)
            owners.append((b, fork_agent, fork_here, oversample))
    kept = [i for i, (b, *_) in enumerate(owners) if b.question_index not in guard.failures]
    prompts, owners = [prompts[i] for i in kept], [owners[i] for i in kept]
    if not prompts:
        return AgentRound([], [])
    try:
        params = _sampling_params(workflow, agent, spec.greedy)
    except Exception as e:  # not one question's failure: every question needs it
        raise WorkflowError(failure(workflow, "sampling", None, agent, e).message()) from e
    prefetch = guard.prefetch
    watchers: list[OnChunk] = []
    if prefetch is not None:  # (rollout.pipeline) each batch's tool calls and rewards, while the next batches generate
        call = prefetch.call()
        watchers.append(
            lambda indices, gens: prefetch.submit(
                [((call, i), owners[i][0].state, agent, g) for i, g in zip(indices, gens)]
            )
        )
    watcher = None
    if guard.on_call is not None:  # (IS trains the fork samples alone)
        may_train = [entry.forks != "none" and (fork or not entry.fork_samples_only) for _, _, fork, _ in owners]
        watcher = guard.on_call(agent, prompts, may_train)
    if watcher is not None:
        watchers.append(watcher)
    if watchers:
        generations = generate_in_chunks(
            generator, prompts, params, lambda indices, gens: [watch(indices, gens) for watch in watchers]
        )
    else:
        generations = generator.generate(prompts, params)
    out: list[Branch] = []
    new_nodes: list[Node] = []
    for i, ((b, fork_agent, fork_here, oversample), gen) in enumerate(zip(owners, generations)):
        res = guard.step_result(
            b.question_index,
            "apply",
            agent,
            guard.call(b.question_index, "apply", agent, workflow.apply, b.state, agent, gen.text),
        )
        if res is _FAILED:
            continue
        node = Node(
            next_id + len(new_nodes),
            b.question_index,
            b.parent_id,
            agent,
            "llm",
            b.visits.get(agent, 0),
            fork_id=b.fork_id,
        )
        new_nodes.append(node)
        node.prompt_ids, node.output_ids, node.logprobs = gen.prompt_ids, gen.output_ids, gen.logprobs
        node.output = gen.text
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
        key = (call, i) if prefetch is not None else None
        out.append(Branch(b.question_index, res.state, node.node_id, b.fork_id, fork_agent, forked, visits, key))
    return AgentRound(out, new_nodes, len(generations), sum(len(g.output_ids) for g in generations))
