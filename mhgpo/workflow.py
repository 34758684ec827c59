"""The workflow abstraction: how a team of agents (and tools) turns a question into an answer.

A workflow is four functions over an immutable `State` (DESIGN §2):

- `next_agent(state)` names the next step (an agent or a tool), or None when the answer is final;
- `build_prompt(state, agent)` gives the chat messages for an agent (the paper's process_prompt);
- `apply(state, agent, output)` parses an agent's output and returns the next state, its format penalty and
  what it parsed (parsers never raise on model output);
- `call_tools(tool, states)` runs one tool for many states at once (batched, so retrieval is batched too).

Agents may be visited several times and routing may depend on outputs: the rollout engine only ever asks
`next_agent`. To write your own system, subclass `Workflow` in a short Python file and pass it to the trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from mhgpo.config import AgentSampling
from mhgpo.records import Example


@dataclass(frozen=True)
class State:
    """What the team knows so far about one question. Never mutated: `with_values` returns a new State."""

    example: Example
    values: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def with_values(self, **updates: Any) -> "State":
        merged = dict(self.values)
        merged.update(updates)
        return State(self.example, MappingProxyType(merged))


@dataclass(frozen=True)
class StepResult:
    """What `apply` (or a tool) returns: the new state, the agent-specific reward (≤ 0), and parsed details."""

    state: State
    penalty: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)


class Workflow(ABC):
    """Base class of a multi-agent system. `agents` are the LLM roles (shared backbone), `tools` the rest."""

    #: LLM roles in their usual order of appearance (used for per-agent metrics and fork choices).
    agents: tuple[str, ...] = ()
    #: names `next_agent` may return that are tools rather than LLM agents.
    tools: tuple[str, ...] = ()

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

    def sampling(self, agent: str) -> AgentSampling:
        """Generation settings of an agent (max new tokens, temperature, top_p)."""
        return AgentSampling()

    def demonstration(self, state: State, agent: str) -> str | None:
        """The gold output of `agent` in `state`, for supervised warm starts (`mhgpo sft`), or None when the data
        gives none (the chain stops there). Built from the example's gold fields; the default has none."""
        return None

    def is_tool(self, name: str) -> bool:
        return name in self.tools

    def trace(self, state: State) -> dict[str, Any]:
        """A JSON-able summary of a finished state (written to predictions and rollout files)."""
        return {k: v for k, v in state.values.items() if _jsonable(v)}


def _jsonable(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None), list, tuple, dict))
