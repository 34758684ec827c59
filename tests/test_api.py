"""The Python API (`mhgpo.train`, `mhgpo.evaluate`) with a workflow of one's own: training and evaluating a
workflow class or instance, failures in training (errors.jsonl, max_failures, the saved step, resume), resuming
an interrupted evaluation; importing the package stays light."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mhgpo.errors import InputError
from mhgpo.rl.trainer import TooManyFailures
from mhgpo.run.pipeline import resume
from mhgpo.team.loader import WorkflowError, display_path
from mhgpo.team.workflow import State, StepResult, Workflow

REPO = Path(__file__).resolve().parents[1]


def here() -> str:
    """How the errors name this file: relative to the working directory."""
    return display_path(__file__)


# --------------------------------------------------------------- a workflow that fails on the questions it is told


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
    assert cfg["system"] == "test_api:Parrot" and cfg["team"] == {"fail_on": [], "max_new_tokens": 4}
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
    assert {k: saved[k] for k in result.metrics} == result.metrics and saved["system"] == "test_api:Parrot"
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
