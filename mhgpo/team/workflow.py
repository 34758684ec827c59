"""The workflow abstraction: how a team of agents (and tools) turns a question into an answer.

A workflow is four functions over an immutable `State`:

- `next_agent(state)` names the next step (an agent or a tool), or None when the answer is final;
- `build_prompt(state, agent)` gives the chat messages for an agent (the paper's process_prompt);
- `apply(state, agent, output)` parses an agent's output and returns the next state, its format penalty and
  what it parsed (parsers never raise on model output);
- `call_tools(tool, states)` runs one tool for many states at once (batched, so retrieval is batched too).

Agents may be visited several times and routing may depend on outputs: the rollout engine only ever asks
`next_agent`. A workflow also says how a finished rollout is scored (`reward`, by default the answer's F1), what
its config section is (`config_class`) and which behaviour of each agent is worth logging (`behaviour`). To write
your own system, subclass `Workflow` in a short Python file and train it with `mhgpo train --system FILE.py:Class`
or `mhgpo.train(config, workflow=Class)` (docs/python-api.md, examples/).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from mhgpo.config import AgentSampling
from mhgpo.data.metrics import score
from mhgpo.data.records import Example


@dataclass(frozen=True)
class State:
    """What the team knows so far about one question. Never mutated: `with_values` returns a new State."""

    example: Example
    values: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def with_values(self, **updates: Any) -> State:
        merged = dict(self.values)
        merged.update(updates)
        return State(self.example, MappingProxyType(merged))


@dataclass(frozen=True)
class StepResult:
    """What `apply` (or a tool) returns: the new state, the agent-specific reward (≤ 0), and parsed details."""

    state: State
    penalty: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Call:
    """One LLM call of an agent, as `Workflow.behaviour` sees it: its output text, the format penalty and `info`
    that `apply` returned, its output length in tokens, and `visit` (0 for the agent's first call on the path)."""

    agent: str
    output: str
    penalty: float
    output_tokens: int
    visit: int
    info: Mapping[str, Any]


class Workflow(ABC):
    """Base class of a multi-agent system. `agents` are the LLM roles (shared backbone), `tools` the rest.

    Built from the command line (`--system FILE.py:Class`), the constructor is called with keyword arguments:
    `config=` an instance of `config_class` (the config's `team:` section) when the class declares one, and
    `retriever=` (the configured retriever over the data's corpus, with `search_batch(queries, k)`) when the
    constructor has a parameter of that name.
    """

    #: LLM roles in their usual order of appearance (used for per-agent metrics and fork choices).
    agents: tuple[str, ...] = ()
    #: names `next_agent` may return that are tools rather than LLM agents.
    tools: tuple[str, ...] = ()
    #: the dataclass of this workflow's config section (`team:`), or None when it takes no config.
    config_class: ClassVar[type | None] = None

    @property
    def terminal_agent(self) -> str:
        """The agent whose output is the final answer (FoF(os) over-samples it)."""
        return self.agents[-1]

    def init_state(self, example: Example) -> State:
        return State(example)

    @abstractmethod
    def next_agent(self, state: State) -> str | None: ...

    @abstractmethod
    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]: ...

    @abstractmethod
    def apply(self, state: State, agent: str, output: str) -> StepResult: ...

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        raise NotImplementedError(f"{type(self).__name__} has no tool {tool!r}")

    @abstractmethod
    def final_answer(self, state: State) -> str: ...

    def reward(self, state: State, example: Example) -> float:
        """The terminal reward of a finished rollout, propagated back to every agent on its path (the agents'
        format penalties come on top, from `apply`). Default: the F1 of `final_answer` against the gold answers,
        the best over their aliases."""
        return score(self.final_answer(state), example.answers)["f1"]

    def behaviour(self, agent: str, calls: list[Call]) -> dict[str, float]:
        """Measures of what `agent` did in `calls` (its `Call`s in a batch of rollouts or an evaluation), logged
        and plotted as `<agent>/<name>`. The penalty rate and the output
        length of every agent are always logged; this adds the workflow's own (default: none)."""
        return {}

    def sampling(self, agent: str) -> AgentSampling:
        """Generation settings of an agent (max new tokens, temperature, top_p)."""
        return AgentSampling()

    def demonstration(self, state: State, agent: str) -> str | None:
        """The gold output of `agent` in `state`, for supervised warm starts (`mhgpo sft`, `warm_start.enabled`),
        or None when the data gives none (the chain stops there). Built from the example's gold fields. A workflow
        that does not override it cannot be warm-started."""
        return None

    def is_tool(self, name: str) -> bool:
        return name in self.tools

    def trace(self, state: State) -> dict[str, Any]:
        """A JSON-able summary of a finished state (written with the predictions): by default the state's values
        that JSON can hold as they are."""
        return {k: v for k, v in state.values.items() if _jsonable(v)}


def breaks_format(call: Call) -> bool:
    """Whether an output broke its agent's format rule: it was penalised, or the workflow gave a `reason` in its
    info (counted even where that agent's penalty is set to 0, e.g. `search.reranker_penalty: 0.0`)."""
    return call.penalty < 0 or bool(call.info.get("reason"))


def mean_of(calls: list[Call], measure: Callable[[Call], float]) -> float:
    """The mean of `measure(call)` over `calls` (0.0 for none): a helper for `Workflow.behaviour`."""
    return float(sum(measure(c) for c in calls) / len(calls)) if calls else 0.0


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True
