"""Builds what the commands share from their configs: the data and the team (its retriever: `mhgpo.retrieval.build`)."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from mhgpo.config import BUILT_IN, RetrievalConfig, SearchConfig, is_custom
from mhgpo.data.records import Example
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError
from mhgpo.retrieval.build import build_retriever
from mhgpo.team.loader import (
    check_workflow_class,
    construct,
    load_workflow_class,
    system_spec,
    team_config,
    team_section,
)
from mhgpo.team.workflow import Workflow


@dataclass(frozen=True)
class Team:
    """The team of a run or an evaluation, resolved once where the command or API call starts and passed down:
    `source` is what `build_workflow` builds from (a built-in team's name, a `Workflow` class or a built instance);
    `system` and `section` are the `system` and resolved `team` section the config records."""

    source: Any
    system: str
    section: dict[str, Any]

    @property
    def agents(self) -> tuple[str, ...]:
        """The team's LLM agents, known before it is built (a class's `agents`, or a built instance's)."""
        if isinstance(self.source, str):
            from mhgpo.team.search_system import LLMOnly, SearchSystem

            return tuple({"mas": SearchSystem, "llm": LLMOnly}[self.source].agents)
        return tuple(self.source.agents)


def resolve_team(cfg: Any, workflow: Any = None) -> Team:
    """The team of `cfg` (a train, sft or eval config): what `cfg.system` and `cfg.team` name, or `workflow`: None
    (what `cfg.system` names), a `Workflow` subclass, a built instance (used as it is; its `config`, when it is an
    instance of its `config_class`, is the team section), or a `Team` already resolved (returned as it is). The
    section is the resolved one (every field of the config class), as config.yaml shows it; `cfg` is not changed."""
    if isinstance(workflow, Team):
        return workflow
    if isinstance(workflow, Workflow):
        cls = type(workflow)
        check_workflow_class(cls)
        config = getattr(workflow, "config", None)
        own = dataclasses.asdict(config) if cls.config_class and isinstance(config, cls.config_class) else {}
        if cfg.team and cfg.team != own:  # (the instance's own section: settled by an earlier call)
            raise InputError(
                f"team.{sorted(cfg.team)[0]}: the workflow was passed already built; set its config "
                f"when constructing it"
            )
        return Team(workflow, system_spec(cls), own)
    if workflow is not None:
        if not (inspect.isclass(workflow) and issubclass(workflow, Workflow)):
            raise InputError(f"workflow: expected a Workflow subclass or instance, got {workflow!r}")
        check_workflow_class(workflow)
        return Team(workflow, system_spec(workflow), team_section(workflow, cfg.team))
    if is_custom(cfg.system):
        cls = load_workflow_class(cfg.system)
        return Team(cls, cfg.system, team_section(cls, cfg.team))
    return Team(cfg.system, cfg.system, dict(cfg.team))


def build_workflow(
    system: Any, data_spec: str, retrieval: RetrievalConfig, search: SearchConfig, team: dict[str, Any] | None = None
) -> Workflow:
    """The team `system` names: `mas` (the default team over the data's corpus), `llm` (the model alone), a
    workflow class (`PATH.py:Class`, `module.path:Class`, or the class itself) built from its `team` section and,
    when its constructor asks, the retriever; a built `Workflow` is returned as it is."""
    from mhgpo.team.search_system import LLMOnly, SearchSystem

    if isinstance(system, Workflow):
        return system
    if isinstance(system, str) and not is_custom(system):
        if system == "mas":
            return SearchSystem(build_retriever(data_spec, retrieval), search)
        if system == "llm":
            return LLMOnly(search)
        raise InputError(
            f"system: unknown system {system!r} (choose one of: {', '.join(BUILT_IN)}, or a workflow "
            f"class PATH.py:Class)"
        )
    cls = load_workflow_class(system) if isinstance(system, str) else system
    return construct(cls, team_config(cls, team), lambda: build_retriever(data_spec, retrieval))


def load_examples(spec: str, limit: int | None = None) -> list[Example]:
    examples = load_data(spec)
    if limit is not None:
        if limit <= 0:
            raise InputError(f"limit: must be positive, got {limit}")
        examples = examples[:limit]
    if not examples:
        raise InputError(f"{spec}: no questions found")
    return examples
