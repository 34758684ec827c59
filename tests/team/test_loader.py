"""Workflows of one's own: loading `PATH.py:Class` / `module:Class`, the `team:` config section, and errors that
name the file, class and method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mhgpo.config import EvalConfig, TrainConfig, dump_config, load_config
from mhgpo.errors import InputError
from mhgpo.run.setup import settle
from mhgpo.team.build import build_workflow, resolve_team
from mhgpo.team.loader import WorkflowError, construct, load_workflow_class, system_spec, team_config
from mhgpo.team.search_system import SearchSystem
from mhgpo.team.workflow import Workflow

ECHO = """\
from dataclasses import dataclass

from mhgpo.team.workflow import State, StepResult, Workflow


@dataclass
class EchoConfig:
    rounds: int = 2
    word: str = "hi"


class Echo(Workflow):
    agents = ("echo",)
    config_class = EchoConfig

    def __init__(self, config):
        self.config = config

    def next_agent(self, state):
        return None if len(state.get("said", ())) >= self.config.rounds else "echo"

    def build_prompt(self, state, agent):
        return [{"role": "user", "content": f"[echo] {state.example.question}"}]

    def apply(self, state, agent, output):
        return StepResult(state.with_values(said=state.get("said", ()) + (output,)))

    def final_answer(self, state):
        return state.get("said")[-1]
"""


@pytest.fixture
def team_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch folder, the working directory, holding `echo.py` (a valid workflow) and broken files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "echo.py").write_text(ECHO)
    (tmp_path / "syntax.py").write_text("from mhgpo.team.workflow import Workflow\n\nclass A(Workflow)\n    pass\n")
    (tmp_path / "imports.py").write_text("import os\nimport no_such_module_for_mhgpo_tests\n")
    (tmp_path / "half.py").write_text(
        "from mhgpo.team.workflow import Workflow\n\nclass Half(Workflow):\n    agents = ('a',)\n\n"
        "    def next_agent(self, state):\n        return None\n"
    )
    (tmp_path / "noagents.py").write_text(ECHO.replace('agents = ("echo",)', "agents = ()"))
    (tmp_path / "badconfig.py").write_text(ECHO.replace("config_class = EchoConfig", "config_class = dict"))
    (tmp_path / "noconfigarg.py").write_text(ECHO.replace("def __init__(self, config):", "def __init__(self):"))
    (tmp_path / "raises.py").write_text(
        ECHO.replace("        self.config = config", "        self.config = config\n        raise ValueError('boom')")
    )
    return tmp_path


# ----------------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing.py:Echo", r"system: missing.py: file not found$"),
        ("syntax.py:A", r"syntax.py:3: importing the file failed: SyntaxError: "),
        (
            "imports.py:A",
            r"imports.py:2: importing the file failed: ModuleNotFoundError: No module named "
            r"'no_such_module_for_mhgpo_tests'$",
        ),
        ("echo.py:Nope", r"echo.py: no class 'Nope' \(Workflow classes there: Echo\)$"),
        ("echo.py:EchoConfig", r"echo.py: EchoConfig is not a subclass of mhgpo.team.workflow.Workflow$"),
        ("half.py:Half", r"half.py: Half does not define apply, build_prompt, final_answer$"),
        ("noagents.py:Echo", r"noagents.py: Echo.agents must name the LLM agents \(a tuple of strings\), got \(\)$"),
        ("badconfig.py:Echo", r"badconfig.py: Echo.config_class must be a dataclass, got <class 'dict'>$"),
        (
            "no_such_module_for_mhgpo_tests:X",
            r"system: importing module 'no_such_module_for_mhgpo_tests' failed: "
            r"ModuleNotFoundError",
        ),
        (
            "mhgpo.team.search_system:Nope",
            r"search_system.py: no class 'Nope' \(Workflow classes there: LLMOnly, "
            r"SearchSystem\)$",
        ),
        ("echo.py:", r"system: expected PATH.py:Class or module.path:Class, got 'echo.py:'$"),
    ],
)
def test_loading_errors_name_the_file_and_class(team_dir: Path, spec: str, message: str) -> None:
    with pytest.raises(InputError) as err:
        load_workflow_class(spec)
    assert re.search(message, str(err.value)), str(err.value)
    assert "\n" not in str(err.value)


def test_a_file_and_a_module_load_and_name_themselves_again(team_dir: Path) -> None:
    cls = load_workflow_class("echo.py:Echo")
    assert cls.__name__ == "Echo" and issubclass(cls, Workflow)
    assert load_workflow_class(str(team_dir / "echo.py") + ":Echo") is cls  # one module per file
    assert system_spec(cls) == "echo.py:Echo"
    assert load_workflow_class("mhgpo.team.search_system:SearchSystem") is SearchSystem
    assert system_spec(SearchSystem) == "mhgpo.team.search_system:SearchSystem"


def test_constructor_gets_its_config_and_the_retriever_only_when_it_asks(team_dir: Path) -> None:
    built = []

    def retriever():
        built.append(1)
        return "the retriever"

    echo = load_workflow_class("echo.py:Echo")
    team = construct(echo, team_config(echo, {"rounds": 3}), retriever)
    assert team.config.rounds == 3 and team.config.word == "hi" and built == []
    search = construct(SearchSystem, team_config(SearchSystem, {"top_k": 7}), retriever)
    assert search.retriever == "the retriever" and search.config.top_k == 7 and built == [1]
    with pytest.raises(
        InputError,
        match=r"^noconfigarg.py: Echo declares config_class but its constructor takes "
        r"no `config` argument$",
    ):
        construct(*_class_and_config("noconfigarg.py:Echo"), retriever)
    line = next(i for i, text in enumerate((team_dir / "raises.py").read_text().splitlines(), 1) if "raise" in text)
    with pytest.raises(WorkflowError, match=rf"^raises.py:{line}: Echo.__init__: ValueError: boom$"):
        construct(*_class_and_config("raises.py:Echo"), retriever)


def _class_and_config(spec: str):
    cls = load_workflow_class(spec)
    return cls, team_config(cls, {})


# ------------------------------------------------------------------------------------------------ team section


def test_team_section_is_checked_dumped_and_loaded_back(team_dir: Path) -> None:
    cfg = load_config(TrainConfig, None, ["system=echo.py:Echo", "team.rounds=3", "steps=1"])
    assert cfg.team == {"rounds": 3} and cfg.sampler == "fof"  # RR needs one probability per agent of the team
    team = resolve_team(cfg)
    assert team.source.__name__ == "Echo" and team.section == {"rounds": 3, "word": "hi"}
    assert cfg.team == {"rounds": 3}  # the config given is not changed: settling returns a new one
    cfg = settle(cfg).cfg
    assert cfg.team == {"rounds": 3, "word": "hi"}
    source = team.source
    dump_config(cfg, team_dir / "config.yaml")
    dumped = yaml.safe_load((team_dir / "config.yaml").read_text())
    assert dumped["team"] == {"rounds": 3, "word": "hi"} and dumped["system"] == "echo.py:Echo"
    again = load_config(TrainConfig, team_dir / "config.yaml")
    assert again.team == cfg.team and again.system == cfg.system
    team = build_workflow(source, cfg.data, cfg.retrieval, cfg.search, cfg.team)
    assert team.config.rounds == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["system=echo.py:Echo", "team.round=3"],
            r"^unknown config key team.round; valid keys here: team.rounds, "
            r"team.word$",
        ),
        (["system=echo.py:Echo", "team.rounds=many"], r"^team.rounds: expected an integer, got 'many'$"),
        (["system=echo.py:Echo", "team=3"], r"^team: expected a mapping of keys to values, got 3$"),
        (
            ["team.rounds=3"],
            r"^team.rounds: the team section configures a workflow class \(system: PATH.py:Class\); "
            r"system=mas is configured under search.\*$",
        ),
        (["system=crew"], r"^system: unknown system 'crew' \(mas, llm, or a workflow class"),
    ],
)
def test_bad_team_keys_are_named(team_dir: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        cfg = load_config(EvalConfig, None, overrides)
        resolve_team(cfg)


def test_a_built_workflow_names_its_class_and_config(team_dir: Path) -> None:
    cfg = load_config(EvalConfig)
    team = SearchSystem(None, team_config(SearchSystem, {"top_k": 5}))
    assert resolve_team(cfg, team).source is team
    settled = settle(cfg, team).cfg
    assert settled.system == "mhgpo.team.search_system:SearchSystem" and settled.team["top_k"] == 5
    cfg = load_config(EvalConfig, None, ["system=echo.py:Echo", "team.rounds=1"])
    with pytest.raises(InputError, match=r"^team.rounds: the workflow was passed already built"):
        resolve_team(cfg, team)
    with pytest.raises(InputError, match=r"^workflow: expected a Workflow subclass or instance, got 3$"):
        resolve_team(load_config(EvalConfig), 3)
