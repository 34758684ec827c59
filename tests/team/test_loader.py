"""Workflows of one's own: loading `PATH.py:Class` / `module:Class`, the `team:` config section, errors that name
file, class, method and question; a failing question left out of its batch with the rest unchanged; failures in
training (errors.jsonl, max_failures, the saved step, resume); the Python API."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml
from fakes import G, LookupSolverJudge, SolverJudge, decode, loop_agent_of

from mhgpo.config import EvalConfig, TrainConfig, dump_config, load_config
from mhgpo.data.records import Example
from mhgpo.errors import InputError
from mhgpo.model.generation import Generation
from mhgpo.rl.losses import token_weights
from mhgpo.rl.rewards import assign_rewards
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.trainer import TooManyFailures
from mhgpo.rl.tree import RolloutSpec
from mhgpo.run.pipeline import resume
from mhgpo.run.setup import settle
from mhgpo.team.build import build_workflow, resolve_team
from mhgpo.team.loader import WorkflowError, construct, display_path, load_workflow_class, system_spec, team_config
from mhgpo.team.search_system import SearchSystem
from mhgpo.team.workflow import State, StepResult, Workflow

REPO = Path(__file__).resolve().parents[2]


def here() -> str:
    """How the errors name this file: relative to the working directory."""
    return display_path(__file__)


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


# ------------------------------------------------------------------------------------------- failing questions


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


def encode(messages):
    return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]


GOOD = [Example("a", "Solve A", ("right answer",)), Example("c", "Solve C", ("right",))]
BAD = Example("bad", "Solve Bad", ("right answer",))


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


# ------------------------------------------------------------------------------------------ failing in training


@dataclass
class ParrotConfig:
    fail_on: list[str] | None = None  # question ids whose rollout raises
    max_new_tokens: int = 4


class Parrot(Workflow):
    """One agent, called twice; `apply` raises on the questions of `fail_on`."""

    agents = ("parrot",)
    config_class = ParrotConfig

    def __init__(self, config: ParrotConfig):
        self.config = config

    def next_agent(self, state: State) -> str | None:
        return None if len(state.get("said", ())) >= 2 else "parrot"

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": state.example.question + " ".join(state.get("said", ()))}]

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        if state.example.id in (self.config.fail_on or []):
            raise RuntimeError(f"cannot parrot {state.example.id}")
        return StepResult(state.with_values(said=state.get("said", ()) + (output,)), -0.5 * ("user" in output))

    def final_answer(self, state: State) -> str:
        return state.get("said")[-1]

    def sampling(self, agent: str):
        from mhgpo.config import AgentSampling

        return AgentSampling(max_new_tokens=self.config.max_new_tokens)


def _four_questions(world: Path, folder: Path) -> tuple[Path, list[str]]:  # noqa: F811
    rows = [json.loads(line) for line in (world / "train_echo.jsonl").read_text().splitlines()][:4]
    path = folder / "four.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, [r["_id"] if "_id" in r else r["id"] for r in rows]


def _parrot_config(tiny_model_dir: Path, data: Path, out: Path, fail_on: list[str], **extra) -> dict:
    return {
        "model": str(tiny_model_dir),
        "data": f"hotpotqa:{data}",
        "output_dir": str(out),
        "steps": 3,
        "questions_per_step": 2,
        "group_size": 2,
        "eval_every": 0,
        "save_every": 0,
        "lora": {"r": 4},
        "optim": {"lr": 0.01},
        "team": {"fail_on": fail_on},
        **extra,
    }


def test_training_skips_a_failing_question_logs_it_and_stops_past_max_failures(
    tiny_model_dir: Path,
    world: Path,
    tmp_path: Path,
    capsys,  # noqa: F811
) -> None:
    import mhgpo

    data, ids = _four_questions(world, tmp_path)
    out = tmp_path / "run"
    # One bad question: seen once in steps 1-2 (the first epoch) and again in step 3; max_failures=1 allows one.
    with pytest.raises(TooManyFailures) as err:
        mhgpo.train(
            _parrot_config(tiny_model_dir, data, out, [ids[0]], max_failures=1), workflow=Parrot, progress=False
        )
    assert re.fullmatch(
        rf"{here()}:\d+: Parrot.apply: RuntimeError: cannot parrot {ids[0]} \(question {ids[0]}, "
        rf"agent parrot\); 2 questions failed in the workflow, more than max_failures=1 \(tracebacks "
        rf"in {re.escape(str(out / 'errors.jsonl'))}\)",
        str(err.value),
    ), str(err.value)
    stderr = capsys.readouterr()
    assert f"mhgpo: stopped; saved {out / 'checkpoints' / 'step_2'}" in stderr.out
    assert stderr.err.count("question skipped, traceback in") == 2
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["phase"], e["question_id"], e["method"], e["workflow"]) for e in errors][1:] == [
        (3, "train", ids[0], "apply", "Parrot")
    ]
    assert errors[0]["step"] in (1, 2) and "RuntimeError: cannot parrot" in errors[0]["traceback"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["failed_questions"] for m in metrics] == [float(m["step"] == errors[0]["step"]) for m in metrics]
    failed_step = errors[0]["step"]
    rows = [json.loads(line) for line in (out / "rollouts" / f"step_{failed_step:06d}.jsonl").read_text().splitlines()]
    assert {r["question_id"] for r in rows} == set(ids) - {ids[0]} - _questions(out, 3 - failed_step)
    check = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_rollouts.py"), str(out)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    state = json.loads((out / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["position"] == 4 and state["failures"] == 1  # the stopped step's failure is not kept
    # Resume with room for more failures: step 3 runs again, its failure logged once.
    trainer = resume(out, ["max_failures=5"], progress=False)
    assert trainer.step == 3 and trainer.failures == 2
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [e["step"] for e in errors] == [failed_step, 3]


def _questions(run: Path, step: int) -> set[str]:
    rows = (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    return {json.loads(line)["question_id"] for line in rows}


def test_api_trains_and_evaluates_a_workflow_class_and_instance(
    tiny_model_dir: Path,
    world: Path,
    tmp_path: Path,  # noqa: F811
) -> None:
    import mhgpo

    data, ids = _four_questions(world, tmp_path)
    out = tmp_path / "api"
    run = mhgpo.train(_parrot_config(tiny_model_dir, data, out, [], steps=1), workflow=Parrot, progress=False)
    assert run == out
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["system"] == "test_teams:Parrot" and cfg["team"] == {"fail_on": [], "max_new_tokens": 4}
    assert cfg["sampler"] == "fof" and not (out / "errors.jsonl").exists()
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"parrot/samples", "parrot/penalty_rate", "parrot/output_tokens"} <= set(metrics)
    result = mhgpo.evaluate(
        {"model": str(tiny_model_dir), "data": f"hotpotqa:{data}", "limit": 3, "output_dir": str(tmp_path / "eval")},
        workflow=Parrot(ParrotConfig(max_new_tokens=3)),
        progress=False,
    )
    assert result.metrics["n"] == 3 and [p["id"] for p in result.predictions] == ids[:3]
    assert all(len(p["trace"]["steps"]) == 2 for p in result.predictions)
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: saved[k] for k in result.metrics} == result.metrics and saved["system"] == "test_teams:Parrot"
    with pytest.raises(
        WorkflowError,
        match=rf"^{here()}:\d+: Parrot.apply: RuntimeError: cannot parrot {ids[1]} "
        rf"\(question {ids[1]}, agent parrot\)$",
    ):
        mhgpo.evaluate(
            {"model": str(tiny_model_dir), "data": f"hotpotqa:{data}", "limit": 3},
            workflow=Parrot(ParrotConfig(fail_on=[ids[1]])),
            progress=False,
        )


def test_importing_the_package_stays_light() -> None:
    code = (
        "import sys, mhgpo; mhgpo.train; mhgpo.evaluate; mhgpo.Workflow; "
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_the_documented_example_is_a_working_team(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REPO / "docs" / "python-api.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 40
    (tmp_path / "draft_and_edit.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    cls = load_workflow_class("draft_and_edit.py:DraftAndEdit")
    outputs = ["It is Paris, I think.", "Rome?", "Paris", "the city of Paris in France"]

    def agent_of(text: str) -> str:
        return "editor" if "Draft:" in text else "drafter"

    from fakes import FakeGenerator

    gen = FakeGenerator(agent_of, lambda agent, k, text: outputs[k])
    batch = run_rollouts(
        [Example("q", "Which city?", ("Paris",)), Example("r", "Which city?", ("Paris",))],
        cls(),
        gen,
        encode,
        RolloutSpec(greedy=True),
        np.random.default_rng(0),
    )
    assert [(n.agent, n.output) for n in batch.llm_nodes()] == [
        ("drafter", outputs[0]),
        ("drafter", outputs[1]),
        ("editor", outputs[2]),
        ("editor", outputs[3]),
    ]
    assert "Draft: It is Paris, I think." in decode(gen.calls[1].prompts[0])
    assert [n.penalty for n in batch.llm_nodes()] == [0.0, 0.0, 0.0, -0.5]
    assert [leaf.terminal for leaf in batch.leaves()] == [1.0, 0.0]  # exact match, not F1: no partial credit
    assert "mhgpo.train(" in code and "mhgpo.evaluate(" in code


def test_the_default_trace_keeps_what_json_can_hold() -> None:
    from mhgpo.data.records import Passage

    state = State(GOOD[0]).with_values(
        attempts=("x", "y"),
        n=2,
        info={"a": [1, 2]},
        documents=(Passage("p", "T", "text"),),
        mixed=["ok", Passage("q", "U", "")],
    )
    assert SolverJudge().trace(state) == {"attempts": ("x", "y"), "n": 2, "info": {"a": [1, 2]}}


def test_api_evaluation_resumes_after_an_interrupt(
    tiny_model_dir: Path,
    world: Path,
    tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`mhgpo.evaluate` runs the same routine as `mhgpo eval`: Ctrl-C after the first batch keeps it, and
    `resume=True` finishes the other questions with the saved config, giving the uninterrupted predictions."""
    import mhgpo
    import mhgpo.run.evaluate as routine
    from mhgpo.run.evaluate import EvalInterrupted

    data, ids = _four_questions(world, tmp_path)
    cfg = {
        "model": str(tiny_model_dir),
        "data": f"hotpotqa:{data}",
        "limit": 4,
        "batch_size": 2,
        "precision": "fp32",
        "output_dir": str(tmp_path / "whole"),
    }
    whole = mhgpo.evaluate(cfg, workflow=Parrot, progress=False)
    real = routine.evaluate_examples

    def cut_after_one_batch(examples, *args, on_batch=None, **kwargs):
        def keep_then_stop(rows):
            on_batch(rows)
            raise KeyboardInterrupt

        return real(examples, *args, on_batch=keep_then_stop, **kwargs)

    monkeypatch.setattr(routine, "evaluate_examples", cut_after_one_batch)
    cut = {**cfg, "output_dir": str(tmp_path / "cut")}
    with pytest.raises(EvalInterrupted, match=r"interrupted; 2 of 4 questions are in .*predictions.jsonl"):
        mhgpo.evaluate(cut, workflow=Parrot, progress=False)
    assert not (tmp_path / "cut" / "metrics.json").exists()
    with pytest.raises(InputError, match=r"already holds an evaluation; continue it with"):
        mhgpo.evaluate(cut, workflow=Parrot, progress=False)
    monkeypatch.setattr(routine, "evaluate_examples", real)
    with pytest.raises(InputError, match=r"^limit: 3 here, but the evaluation in .* used 4"):
        mhgpo.evaluate({**cut, "limit": 3}, workflow=Parrot, progress=False, resume=True)
    resumed = mhgpo.evaluate(cut, workflow=Parrot, progress=False, resume=True)
    assert resumed.metrics["resumed"] == 2 and resumed.metrics["n"] == 4
    as_json = lambda rows: json.loads(json.dumps(rows))  # noqa: E731 (rows read back from the file hold lists)
    assert as_json(resumed.predictions) == as_json(whole.predictions)
    assert [p["id"] for p in resumed.predictions] == ids
    assert {k: resumed.metrics[k] for k in ("acc", "em", "f1")} == {k: whole.metrics[k] for k in ("acc", "em", "f1")}
    saved = [json.loads(line) for line in (tmp_path / "cut" / "predictions.jsonl").read_text().splitlines()]
    assert sorted(p["id"] for p in saved) == sorted(ids)
