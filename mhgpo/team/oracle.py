"""Per-role oracles: where a team's headroom is.

`with_oracles(workflow, roles)` is the same team with some roles replaced by their gold output (the workflow's
`demonstration`, the output a warm start imitates) instead of a call to the LLM: `oracle=[reranker]` asks how well
the team answers when the Reranker always picks the retrieved gold paragraphs; `oracle=[rewriter]` when the
Rewriter writes the data's decomposition (or the supporting titles the question names). The built-in team has one
more, `context`: the Answerer is shown exactly the question's gold paragraphs (from the record's own `context`),
retrieval and reranking bypassed. The gap between a team and its oracle is the most that training the replaced
role alone could add (`docs/learning.md`).

An oracle role becomes a tool of the wrapped workflow, so it costs no LLM call and is never trained; the final
agent (the one whose output is scored) cannot be replaced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mhgpo.config import AgentSampling
from mhgpo.data.records import Example
from mhgpo.errors import InputError
from mhgpo.team.workflow import Call, State, StepResult, Workflow

CONTEXT = "context"  # the built-in team's gold-paragraphs oracle


class Oracle(Workflow):
    """`inner` with `roles` answering from the gold data (see the module's text)."""

    def __init__(self, inner: Workflow, roles: Sequence[str], context: bool = False):
        self.inner = inner
        self.roles = tuple(roles)
        self.context = context
        self.agents = tuple(a for a in inner.agents if a not in self.roles)
        self.tools = tuple(inner.tools) + self.roles

    @property
    def terminal_agent(self) -> str:
        return self.inner.terminal_agent

    def init_state(self, example: Example) -> State:
        return self.inner.init_state(example)

    def next_agent(self, state: State) -> str | None:
        return self.inner.next_agent(state)

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        return self.inner.build_prompt(state, agent)

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        return self.inner.apply(state, agent, output)

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        if tool in self.roles:
            return [self._gold_step(s, tool) for s in states]
        if self.context and tool == getattr(self.inner, "retrieval_tool", None):
            return self.inner.gold_context_results(states)
        return self.inner.call_tools(tool, states)

    def _gold_step(self, state: State, role: str) -> StepResult:
        gold = self.inner.demonstration(state, role)
        if gold is None:
            raise InputError(
                f"oracle={role}: question {state.example.id!r} has no gold output for the {role} "
                f"(the data lacks the fields its demonstration is built from)"
            )
        step = self.inner.apply(state, role, gold)
        return StepResult(step.state, step.penalty, {**step.info, "oracle": gold})

    def final_answer(self, state: State) -> str:
        return self.inner.final_answer(state)

    def reward(self, state: State, example: Example) -> float:
        return self.inner.reward(state, example)

    def behaviour(self, agent: str, calls: list[Call]) -> dict[str, float]:
        return self.inner.behaviour(agent, calls)

    def sampling(self, agent: str) -> AgentSampling:
        return self.inner.sampling(agent)

    def demonstration(self, state: State, agent: str) -> str | None:
        return self.inner.demonstration(state, agent)

    def trace(self, state: State) -> dict[str, Any]:
        return self.inner.trace(state)


def with_oracles(workflow: Workflow, oracles: Sequence[str]) -> Workflow:
    """`workflow` with the `oracles` (role names, or `context` for a workflow with `gold_context_results`) given
    their gold outputs; `workflow` itself when `oracles` is empty. Unknown names and the final agent are refused."""
    oracles = list(dict.fromkeys(oracles))
    if not oracles:
        return workflow
    has_context = callable(getattr(workflow, "gold_context_results", None))
    known = [*workflow.agents, *([CONTEXT] if has_context else [])]
    for name in oracles:
        if name not in known:
            raise InputError(
                f"oracle: unknown role {name!r} for system {type(workflow).__name__} (choose from {', '.join(known)})"
            )
        if name == workflow.terminal_agent:
            raise InputError(
                f"oracle: {name} is the final agent; its gold output is the gold answer itself "
                f"(choose from {', '.join(r for r in known if r != name)})"
            )
    context = CONTEXT in oracles
    roles = [r for r in oracles if r != CONTEXT]
    if context:  # the gold paragraphs are shown to the final agent as they are: the roles between are oracles too
        roles += [r for r in workflow.context_oracle_roles if r not in roles]
    return Oracle(workflow, [r for r in workflow.agents if r in roles], context=context)
