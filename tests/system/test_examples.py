"""The teams of examples/: their routing on scripted outputs; one training step of each on the tiny model from the
command line, whose run directory passes scripts/check_rollouts.py (agents visited more than once, their group ids
per visit) and whose report names the agents; `--system` errors, `ask` and a failing team on the command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fakes import FakeGenerator, FakeRetriever, encode

from mhgpo.data.records import Example
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutSpec
from mhgpo.run.report import md_text
from mhgpo.team.loader import construct, load_workflow_class, team_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = {"iterative_search": "IterativeSearch", "solver_verifier": "SolverVerifier"}
REVISITED = {"iterative_search": "planner", "solver_verifier": "solver"}  # the agent a rollout calls again


def example(name: str, retriever=None, **team):
    cls = load_workflow_class(f"{REPO / 'examples' / name}.py:{EXAMPLES[name]}")
    return construct(cls, team_config(cls, team), lambda: retriever or FakeRetriever())


def scripted(team, outputs: list[str], question: str = "Where was Ann Lee born?", gold=("Paris",)):
    """One greedy chain of `team` on one question, the LLM agents answering `outputs` in order."""
    gen = FakeGenerator(lambda text: "?", lambda agent, k, text: outputs[k])
    batch = run_rollouts(
        [Example("q", question, gold)], team, gen, encode, RolloutSpec(greedy=True), np.random.default_rng(0)
    )
    return batch, [decode(c.prompts[0]) for c in gen.calls]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


# ------------------------------------------------------------------------------------------------ routing


def test_iterative_search_searches_until_it_answers_or_runs_out_of_turns() -> None:
    retriever = FakeRetriever()
    team = example("iterative_search", retriever, max_rounds=3)
    batch, prompts = scripted(team, ["Search: Ann Lee birthplace", "The answer is Paris"])
    assert [(n.agent, n.visit) for n in batch.nodes] == [
        ("retriever", 0),
        ("planner", 0),
        ("retriever", 1),
        ("planner", 1),
    ]
    assert retriever.calls == [["Where was Ann Lee born?"], ["Ann Lee birthplace"]]
    assert [n.penalty for n in batch.llm_nodes()] == [0.0, 0.0]
    leaf = batch.leaves()[0]
    assert leaf.final_answer == "Paris" and leaf.terminal == 1.0
    assert leaf.trace["queries"] == ["Where was Ann Lee born?", "Ann Lee birthplace"]
    assert "Queries so far: Where was Ann Lee born?; Ann Lee birthplace" in prompts[1]
    assert "last turn" not in prompts[0] and "last turn" not in prompts[1]
    # no format: searched as it is, penalised; the last turn answers whatever it says, penalised without "Answer:"
    batch, prompts = scripted(
        example("iterative_search", max_rounds=3), ["Searched: Lee", "search for Lee", "Paris, France"]
    )
    assert [(n.agent, n.visit) for n in batch.llm_nodes()] == [("planner", 0), ("planner", 1), ("planner", 2)]
    assert [n.info["action"] for n in batch.llm_nodes()] == ["search", "search", "answer"]
    assert [n.info.get("query") for n in batch.llm_nodes()] == ["Searched: Lee", "Lee", None]
    assert [n.penalty for n in batch.llm_nodes()] == [-0.5, 0.0, -0.5]
    assert "This is your last turn" in prompts[2] and batch.leaves()[0].final_answer == "Paris, France"
    assert team.behaviour("planner", batch.llm_nodes()) == {"search_rate": 2 / 3, "answer_turn": 3.0}
    batch, _ = scripted(example("iterative_search"), ["The answer is 'Answer:"])  # the format, but no answer
    assert [n.penalty for n in batch.llm_nodes()] == [-0.5] and batch.leaves()[0].terminal == 0.0


def test_solver_verifier_sends_the_answer_back_once() -> None:
    batch, _ = scripted(example("solver_verifier"), ["Paris", "Correct."])
    assert [(n.agent, n.visit) for n in batch.nodes] == [("retriever", 0), ("solver", 0), ("verifier", 0)]
    assert batch.leaves()[0].final_answer == "Paris" and [n.penalty for n in batch.llm_nodes()] == [0.0, 0.0]
    batch, prompts = scripted(example("solver_verifier"), ["Lyon", "Wrong: the documents say Paris", "Paris"])
    assert [(n.agent, n.visit) for n in batch.llm_nodes()] == [("solver", 0), ("verifier", 0), ("solver", 1)]
    assert "Your answer 'Lyon' was judged wrong: the documents say Paris." in prompts[2]
    assert batch.leaves()[0].final_answer == "Paris" and batch.leaves()[0].terminal == 1.0
    # an unclear verdict sends the answer back, penalised; the second answer is final whatever it is
    team = example("solver_verifier", max_answer_words=3)
    batch, prompts = scripted(team, ["Lyon", "hmm", "it is in the city of Lyon"])
    assert [n.info.get("verdict") for n in batch.llm_nodes()] == [None, "wrong", None]
    assert [n.penalty for n in batch.llm_nodes()] == [0.0, -0.5, -0.5]
    assert "judged wrong: the verifier was not convinced" in prompts[2]
    assert team.behaviour("solver", [n for n in batch.llm_nodes() if n.agent == "solver"]) == {
        "answer_words": 4.0,
        "second_attempts": 0.5,
    }


# ------------------------------------------------------------------------------------ training, command line


@pytest.fixture(scope="module")
def runs(cli, tiny_model_dir: Path, world: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """One MHGPO-FoF step of each example on the tiny model (G = 3, 2 questions), from the command line."""
    out = {}
    for name, cls in EXAMPLES.items():
        run = tmp_path_factory.mktemp("runs") / name
        res = cli(
            "train",
            "--system",
            f"examples/{name}.py:{cls}",
            "--model",
            tiny_model_dir,
            "--data",
            f"hotpotqa:{world / 'train_echo.jsonl'}",
            "--corpus",
            world / "corpus.jsonl",
            "--steps",
            1,
            "--questions-per-step",
            2,
            "--group-size",
            3,
            "--output-dir",
            run,
            "eval_every=0",
            "lora.r=4",
            f"team.{REVISITED[name]}.max_new_tokens=8",
        )
        assert res.returncode == 0, res.stderr
        out[name] = run
    return out


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_one_training_step_passes_the_rollout_checks(runs, name: str) -> None:
    run = runs[name]
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_rollouts.py"), str(run)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("step_000001.jsonl: ok")
    rows = _records(run)
    agent = REVISITED[name]
    again = [r for r in rows if r["agent"] == agent and r["visit"] >= 1]
    assert again, f"no {agent} called twice on one path"
    trained_again = {r["group_id"] for r in again if r["trained"]}
    assert trained_again, "no group of second visits"
    for gid in trained_again:  # a group of repeated visits holds one visit of that agent
        (pair,) = {(r["agent"], r["visit"]) for r in rows if r["group_id"] == gid}
        assert pair[0] == agent and pair[1] >= 1
    cfg = (run / "config.yaml").read_text()
    assert f"system: examples/{name}.py:{EXAMPLES[name]}" in cfg and "sampler: fof" in cfg and "\nteam:\n" in cfg


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_report_names_the_examples_agents(runs, cli, name: str, tmp_path: Path) -> None:
    res = cli("report", runs[name], "--out", tmp_path / "report")
    assert res.returncode == 0, res.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    agents = {"iterative_search": ["planner"], "solver_verifier": ["solver", "verifier"]}[name]
    for agent in agents:
        assert f"- *{agent}* (agent):" in md
    assert "- *retriever* (tool):" in md
    assert md_text(f"({EXAMPLES[name]}) [{name}]") in md and "behaviour.png" in md  # the run's label, escaped
    metrics = json.loads((runs[name] / "metrics.jsonl").read_text().splitlines()[0])
    own = {
        "iterative_search": ["planner/search_rate"],
        "solver_verifier": ["verifier/reject_rate", "solver/second_attempts"],
    }[name]
    assert all(k in metrics for k in own)


def _check_rollouts_module():
    spec = importlib.util.spec_from_file_location("check_rollouts", REPO / "scripts" / "check_rollouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_rollouts_catches_wrong_group_ids_and_visits(runs) -> None:
    check = _check_rollouts_module()
    rows = _records(runs["iterative_search"])
    args = (3, "mean", True, "fof", False)
    check.check_step([dict(r) for r in rows], *args)  # as written: fine
    second = [r for r in rows if r["trained"] and r["visit"] == 1]
    split = [dict(r) for r in rows]
    moved = next(
        r for r in split if (r["node_id"], r["question_id"]) == (second[0]["node_id"], second[0]["question_id"])
    )
    moved["group_id"] = max(r["group_id"] for r in rows) + 1
    with pytest.raises(AssertionError, match="members, expected 2..3|not all the nodes"):
        check.check_step(split, *args)
    revisited = [dict(r) for r in rows]
    node = next(r for r in revisited if r["visit"] == 1)
    node["visit"] = 0
    with pytest.raises(AssertionError, match="visit 0, but 1 calls above it"):
        check.check_step(revisited, *args)
    dropped = [dict(r) for r in rows]
    for r in dropped:
        if r["group_id"] == second[0]["group_id"]:
            r["group_id"], r["trained"], r["advantage"] = -1, False, 0.0
    with pytest.raises(AssertionError, match="is untrained but not a singleton"):
        check.check_step(dropped, *args)


def test_system_errors_on_the_command_line(
    cli,
    tiny_model_dir: Path,
    world: Path,
    tmp_path: Path,  # noqa: F811
) -> None:
    out = tmp_path / "out"
    res = cli("train", "--system", "examples/nope.py:Team", "--model", tiny_model_dir, "--output-dir", out)
    assert (res.returncode, res.stderr) == (2, "mhgpo: error: system: examples/nope.py: file not found\n")
    res = cli("demo", "--system", "examples/iterative_search.py:IterativeSearch", f"output_dir={out}")
    assert res.returncode == 2 and res.stderr.startswith("mhgpo: error: system: mhgpo demo runs the built-in team")
    res = cli("eval", "--system", "examples/iterative_search.py:IterativeSearch", "team.rounds=2", "--output-dir", out)
    assert res.returncode == 2 and res.stderr.startswith(
        "mhgpo: error: unknown config key team.rounds; valid keys here: team.format_penalty, team.max_answer_words"
    )
    assert not out.exists()
    # a method that raises during a rollout: one line naming file, line, class, method, question and agent
    broken = tmp_path / "broken.py"
    source = (REPO / "examples" / "solver_verifier.py").read_text()
    broken.write_text(
        source.replace(
            "        wrong, right = WRONG.search(output), RIGHT.search(output)",
            '        raise ZeroDivisionError("verdicts are hard")',
        )
    )
    line = next(i for i, t in enumerate(broken.read_text().splitlines(), 1) if "ZeroDivisionError" in t)
    dev = world / "dev.jsonl"
    first = json.loads(dev.read_text().splitlines()[0])["_id"]
    res = cli(
        "eval",
        "--system",
        "broken.py:SolverVerifier",
        "--model",
        tiny_model_dir,
        "--data",
        f"hotpotqa:{dev}",
        "--corpus",
        world / "corpus.jsonl",
        "--limit",
        2,
        "--output-dir",
        out,
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    errors = [t for t in res.stderr.splitlines() if t.startswith("mhgpo: error:")]
    assert errors == [
        f"mhgpo: error: broken.py:{line}: SolverVerifier.apply: ZeroDivisionError: verdicts are hard "
        f"(question {first}, agent verifier)"
    ]
    assert not out.exists()


def test_eval_writes_the_examples_predictions(cli, tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:  # noqa
    out = tmp_path / "eval"
    res = cli(
        "eval",
        "--system",
        "examples/solver_verifier.py:SolverVerifier",
        "--model",
        tiny_model_dir,
        "--data",
        f"hotpotqa:{world / 'dev.jsonl'}",
        "--corpus",
        world / "corpus.jsonl",
        "--limit",
        3,
        "--output-dir",
        out,
        "team.solver.max_new_tokens=6",
        "team.verifier.max_new_tokens=6",
    )
    assert res.returncode == 0, res.stderr
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(predictions) == metrics["n"] == 3
    assert metrics["f1"] == pytest.approx(100 * np.mean([p["f1"] for p in predictions]), abs=1e-9)
    for p in predictions:
        steps = p["trace"]["steps"]
        assert [s["agent"] for s in steps][:3] == ["retriever", "solver", "verifier"]
        assert p["trace"]["attempts"][-1] == p["prediction"] and "documents" not in p["trace"]
    assert metrics["system"] == "examples/solver_verifier.py:SolverVerifier"
    assert {"solver/answer_words", "verifier/reject_rate"} <= set(metrics)


def test_ask_shows_each_turn_of_the_planner(cli, tiny_model_dir: Path, world: Path) -> None:  # noqa: F811
    res = cli(
        "ask",
        "Where was Ann Lee born?",
        "--system",
        "examples/iterative_search.py:IterativeSearch",
        "--model",
        tiny_model_dir,
        "--corpus",
        world / "corpus.jsonl",
        "team.max_rounds=2",
        "team.planner.max_new_tokens=6",
    )
    assert res.returncode == 0, res.stderr
    planner_turns = res.stdout.count(" planner ")
    assert 1 <= planner_turns <= 2 and res.stdout.count("retriever (tool)") == planner_turns
    assert "query: Where was Ann Lee born?" in res.stdout and "action: " in res.stdout
