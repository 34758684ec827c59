"""A question that fails in a workflow's code (its `apply`, a batched tool, a wrong agent name) is left out of its
batch with the rest of the batch as it would be without it, or stops the batch when asked to; the error names the
file, line, class, method and question."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from fakes import BAD, GOOD, G, LookupSolverJudge, SolverJudge, decode, encode, loop_agent_of

from mhgpo.model.generation import Generation
from mhgpo.rl.losses import token_weights
from mhgpo.rl.rewards import assign_rewards
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.team.loader import WorkflowError, display_path
from mhgpo.team.workflow import State, StepResult


def here() -> str:
    """How the errors name this file: relative to the working directory."""
    return display_path(__file__)


class PerPromptGenerator:
    """Outputs that depend on the prompt and on how many times that prompt was seen, not on the batch around it:
    a batch without one question gives the other questions exactly the same outputs."""

    def __init__(self, respond):
        self.respond, self.seen = respond, Counter()

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            text = decode(prompt)
            i = self.seen[text]
            self.seen[text] += 1
            reply = self.respond(loop_agent_of(text), i, text)
            ids = [ord(c) for c in reply]
            out.append(Generation(list(prompt), ids, [-0.01 * (k + 1) for k in range(len(ids))], reply, True))
        return out


def respond(agent: str, i: int, text: str) -> str:
    if agent == "solver":
        return ["right answer", "wrong answer", "right", "answer right now"][i % 4]
    first = " / " not in text  # the judge retries two of the four first attempts
    return "retry" if first and (text.endswith("wrong answer") or text.endswith("right")) else "accept"


class FailsOnBad(SolverJudge):
    """SolverJudge whose judge cannot judge question "bad" (a bug in a user's `apply`)."""

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        if agent == "judge" and state.example.id == "bad":
            raise ValueError(f"no verdict for {state.example.id}")
        return super().apply(state, agent, output)


def _summary(batch):
    return [
        (
            n.node_id,
            n.parent_id,
            n.question_index,
            n.agent,
            n.visit,
            n.output,
            n.group_id,
            None if np.isnan(n.terminal) else n.terminal,
            n.reward,
            n.advantage,
        )
        for n in batch.nodes
    ]


@pytest.mark.parametrize("sampler", ["fof", "is", "fof_os"])
def test_a_failing_question_leaves_the_rest_of_the_batch_as_without_it(sampler: str) -> None:
    spec = RolloutSpec(sampler=sampler, group_size=G)
    skipped = run_rollouts(
        [GOOD[0], BAD, GOOD[1]],
        FailsOnBad(),
        PerPromptGenerator(respond),
        encode,
        spec,
        np.random.default_rng(0),
        on_error="skip",
    )
    alone = run_rollouts(GOOD, FailsOnBad(), PerPromptGenerator(respond), encode, spec, np.random.default_rng(0))
    assert [e.id for e in skipped.examples] == ["a", "c"]
    assert skipped.fork_agents == alone.fork_agents
    for batch in (skipped, alone):
        assign_rewards(batch, "mean", True, np.random.default_rng(0))
    assert _summary(skipped) == _summary(alone)
    assert any(n.visit == 1 for n in alone.llm_nodes()) and alone.stats["groups"] >= 2
    for key in ("groups", "singletons_dropped", "samples"):
        assert skipped.stats[key] == alone.stats[key]
    assert skipped.stats["failed_questions"] == 1.0 and alone.stats["failed_questions"] == 0.0
    weights = [
        token_weights(
            [n.agent for n in b.llm_nodes()],
            [len(n.output_ids) for n in b.llm_nodes()],
            [n.trained for n in b.llm_nodes()],
        )
        for b in (skipped, alone)
    ]
    assert weights[0].tolist() == weights[1].tolist()  # the step's loss normalisers
    (f,) = skipped.failures
    assert (f.question_id, f.workflow, f.method, f.agent) == ("bad", "FailsOnBad", "apply", "judge")
    assert re.fullmatch(
        rf"{here()}:\d+: FailsOnBad.apply: ValueError: no verdict for bad \(question bad, agent "
        rf"judge\)",
        f.message(),
    ), f.message()
    assert "raise ValueError" in f.traceback and f.traceback.rstrip().endswith("ValueError: no verdict for bad")


def test_a_failing_question_stops_the_batch_when_asked_to_raise() -> None:
    with pytest.raises(
        WorkflowError,
        match=rf"^{here()}:\d+: FailsOnBad.apply: ValueError: no verdict for bad "
        rf"\(question bad, agent judge\)$",
    ):
        run_rollouts(
            [GOOD[0], BAD],
            FailsOnBad(),
            PerPromptGenerator(respond),
            encode,
            RolloutSpec("fof", G),
            np.random.default_rng(0),
        )


class LookupFailsOnBad(LookupSolverJudge):
    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        self.tool_calls.append(len(states))
        if any(s.example.id == "bad" for s in states):
            raise KeyError("bad")
        return [StepResult(s.with_values(lookups=s.get("lookups", ()) + ("fact",)), 0.0, {}) for s in states]


class Misroutes(SolverJudge):
    def next_agent(self, state: State) -> str | None:
        return "solvr" if state.example.id == "bad" else super().next_agent(state)


def test_a_batched_tool_that_fails_is_retried_one_state_at_a_time_and_wrong_names_fail() -> None:
    team = LookupFailsOnBad()
    batch = run_rollouts(
        [GOOD[0], BAD, GOOD[1]],
        team,
        PerPromptGenerator(respond),
        encode,
        RolloutSpec("fof", G),
        np.random.default_rng(0),
        on_error="skip",
    )
    assert team.tool_calls[:4] == [3, 1, 1, 1]  # the batch, then each state alone
    assert [e.id for e in batch.examples] == ["a", "c"] and len(batch.leaves()) == 2 * G
    (f,) = batch.failures
    assert (f.question_id, f.method, f.agent, f.error) == ("bad", "call_tools", "lookup", "KeyError: 'bad'")
    batch = run_rollouts(
        [BAD, GOOD[0]],
        Misroutes(),
        PerPromptGenerator(respond),
        encode,
        RolloutSpec("fof", G),
        np.random.default_rng(0),
        on_error="skip",
    )
    assert batch.failures[0].message() == (
        f"{here()}: Misroutes.next_agent: returned 'solvr', which is neither an "
        f"agent (solver, judge) nor a tool (none) (question bad)"
    )
    assert {n.question_index for n in batch.nodes} == {0} and batch.examples == [GOOD[0]]
