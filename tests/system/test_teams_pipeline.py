"""Workflows of one's own in the rest of the pipeline: the supervised warm start (`mhgpo sft --system FILE:Class`,
`warm_start.enabled` from the command line and from `mhgpo.train`) through the workflow's `demonstration`, a clear
refusal for a workflow without one, and the workflow's own reward as what the zero-variance filter and per-agent
adapters see."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

import mhgpo
from mhgpo.errors import InputError
from mhgpo.runtime.runlog import read_metrics
from mhgpo.team.loader import load_workflow_class

DUET = '''\
from dataclasses import dataclass

from mhgpo.config import AgentSampling
from mhgpo.team.workflow import State, StepResult, Workflow


def own_reward(answer: str, scale: float) -> float:
    return scale * (len(answer) % 7)


@dataclass
class DuetConfig:
    scale: float = 0.1
    max_new_tokens: int = 6


class Duet(Workflow):
    """`ask` writes a note, `say` answers from it; the reward is the team's own (never the F1)."""

    agents = ("ask", "say")
    config_class = DuetConfig

    def __init__(self, config):
        self.config = config

    def next_agent(self, state):
        return "ask" if "note" not in state else None if "answer" in state else "say"

    def build_prompt(self, state, agent):
        return [{"role": "user", "content": f"[{agent}] {state.example.question} {state.get('note', '')}"}]

    def apply(self, state, agent, output):
        return StepResult(state.with_values(**{"note" if agent == "ask" else "answer": output}))

    def final_answer(self, state):
        return state.get("answer", "")

    def reward(self, state, example):
        return own_reward(self.final_answer(state), self.config.scale)

    def sampling(self, agent):
        return AgentSampling(max_new_tokens=self.config.max_new_tokens)


class GoldDuet(Duet):
    def demonstration(self, state, agent):
        return state.example.question if agent == "ask" else state.example.answers[0]


class Flat(GoldDuet):
    def reward(self, state, example):
        return 0.25
'''


def own_reward(answer: str, scale: float) -> float:
    return scale * (len(answer) % 7)


@pytest.fixture
def duet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, holding `duet.py`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "duet.py").write_text(DUET)
    return tmp_path


def config(tiny_model_dir: Path, world: Path, out: Path, **extra) -> dict:  # noqa: F811
    return {
        "model": str(tiny_model_dir),
        "data": f"hotpotqa:{world / 'train_echo.jsonl'}",
        "output_dir": str(out),
        "steps": 1,
        "questions_per_step": 2,
        "group_size": 3,
        "eval_every": 0,
        "save_every": 1,
        "precision": "fp32",
        "lora": {"r": 4},
        "optim": {"lr": 0.01},
        "team": {"scale": 0.2},
        **extra,
    }


WARM = {"enabled": True, "steps": 2, "batch_size": 4, "limit": 3, "lr": 0.01, "format_limit": 1}


def leaves(run: Path, step: int = 1) -> list[dict]:
    rows = [json.loads(line) for line in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    return [r for r in rows if "terminal_reward" in r]


def test_the_api_warm_starts_a_team_of_ones_own_then_trains_it(duet: Path, tiny_model_dir: Path, world: Path) -> None:  # noqa: F811
    gold = load_workflow_class("duet.py:GoldDuet")
    run = mhgpo.train(config(tiny_model_dir, world, duet / "run", warm_start=WARM), workflow=gold, progress=False)
    warm = run / "warm_start"
    assert (warm / "checkpoints" / "step_2").is_dir()
    warm_cfg, run_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (warm, run))
    for cfg in (warm_cfg, run_cfg):  # the same team in both stages, named so that resume builds it again
        assert cfg["system"] == "duet.py:GoldDuet" and cfg["team"] == {"scale": 0.2, "max_new_tokens": 6}
    assert run_cfg["model"] == "run/warm_start"
    demos = json.loads((warm / "demonstrations.json").read_text())
    assert demos["questions"] == 3 and demos["demonstrations"] == {"ask": 3, "say": 3}
    metrics = read_metrics(warm)[-1]
    assert {"sft/ask/nll", "sft/say/nll", "sft/say/format_ok"} <= set(metrics)
    for leaf in leaves(run):  # RL after the warm start scores with the team's own reward
        assert leaf["terminal_reward"] == pytest.approx(own_reward(leaf["final_answer"], 0.2))


def test_a_warm_start_of_a_team_without_demonstrations_is_refused_before_anything_is_written(
    duet: Path,
    tiny_model_dir: Path,
    world: Path,
    cli,  # noqa: F811
) -> None:
    plain = load_workflow_class("duet.py:Duet")
    message = (
        r"duet\.py: Duet defines no demonstration\(state, agent\), the gold output of an agent that a warm "
        r"start \(mhgpo sft, warm_start\.enabled\) trains on"
    )
    with pytest.raises(InputError, match=f"^{message}$"):
        mhgpo.train(config(tiny_model_dir, world, duet / "api", warm_start=WARM), workflow=plain, progress=False)
    assert not (duet / "api").exists()
    common = ["--model", tiny_model_dir, "--data", f"hotpotqa:{world / 'train_echo.jsonl'}"]
    for args in (
        ["sft", "--system", "duet.py:Duet", *common, "--output-dir", "sft"],
        ["train", "--system", "duet.py:Duet", *common, "--output-dir", "rl", "warm_start.enabled=true"],
    ):
        res = cli(*args, cwd=duet)
        assert res.returncode == 2 and re.fullmatch(f"mhgpo: error: {message}\n", res.stderr), res.stderr
    assert not (duet / "sft").exists() and not (duet / "rl").exists()


def test_sft_takes_a_workflow_file_from_the_command_line_and_rl_starts_from_it(
    duet: Path,
    tiny_model_dir: Path,
    world: Path,
    cli,  # noqa: F811
) -> None:
    data = ["--data", f"hotpotqa:{world / 'train_echo.jsonl'}"]
    res = cli(
        "sft",
        "--system",
        "duet.py:GoldDuet",
        "--model",
        tiny_model_dir,
        *data,
        "--steps",
        1,
        "--batch-size",
        4,
        "--output-dir",
        "sft",
        "limit=4",
        "val_limit=0",
        "format_limit=0",
        "precision=fp32",
        "team.max_new_tokens=4",
        cwd=duet,
    )
    assert res.returncode == 0, res.stderr
    cfg = yaml.safe_load((duet / "sft" / "config.yaml").read_text())
    assert cfg["system"] == "duet.py:GoldDuet" and cfg["team"] == {"scale": 0.1, "max_new_tokens": 4}
    assert json.loads((duet / "sft" / "demonstrations.json").read_text())["demonstrations"] == {"ask": 4, "say": 4}
    res = cli(
        "train",
        "--system",
        "duet.py:GoldDuet",
        "--model",
        "sft",
        *data,
        "--steps",
        1,
        "--questions-per-step",
        2,
        "--group-size",
        2,
        "--output-dir",
        "rl",
        "eval_every=0",
        "lora.r=4",
        "precision=fp32",
        cwd=duet,
    )
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load((duet / "rl" / "config.yaml").read_text())["model"] == "sft"


def test_the_zero_variance_filter_sees_the_teams_own_reward(duet: Path, tiny_model_dir: Path, world: Path) -> None:  # noqa: F811
    extra = {"sampler": "fof", "filter_zero_variance": True, "filter_max_questions": 6}
    flat = mhgpo.train(
        config(tiny_model_dir, world, duet / "flat", **extra),
        workflow=load_workflow_class("duet.py:Flat"),
        progress=False,
    )
    m = read_metrics(flat)[0]  # one reward for every answer: no group is informative, the filter draws to the cap
    assert (m["groups"], m["groups/zero_variance_frac"], m["filter/questions"]) == (0, 1.0, 6)
    assert {leaf["terminal_reward"] for leaf in leaves(flat)} == {0.25}
    own = mhgpo.train(
        config(tiny_model_dir, world, duet / "own", **extra),
        workflow=load_workflow_class("duet.py:GoldDuet"),
        progress=False,
    )
    m = read_metrics(own)[0]
    rows = [json.loads(line) for line in (own / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    groups = defaultdict(list)
    for r in rows:
        if r["kind"] == "llm" and r["trained"]:
            groups[r["group_id"]].append(r["reward"])
    assert m["groups"] == len(groups) > 0 and all(len(set(v)) > 1 for v in groups.values())
    for leaf in leaves(own):
        assert leaf["terminal_reward"] == pytest.approx(own_reward(leaf["final_answer"], 0.2))


def test_a_per_role_run_of_a_team_of_ones_own_scores_with_its_reward(
    duet: Path, tiny_model_dir: Path, world: Path
) -> None:  # noqa: F811
    run = mhgpo.train(
        config(tiny_model_dir, world, duet / "roles", lora={"r": 4, "per_role": True}),
        workflow=load_workflow_class("duet.py:GoldDuet"),
        progress=False,
    )
    tensors = load_file(str(run / "checkpoints" / "step_1" / "model.safetensors"))
    assert {k.split(".lora_")[1].split(".")[1] for k in tensors} == {"ask", "say"}  # one adapter per agent
    found = leaves(run)
    assert len(found) == 2 * 3  # FoF: G answers per question
    for leaf in found:
        assert leaf["terminal_reward"] == pytest.approx(own_reward(leaf["final_answer"], 0.2))
    m = read_metrics(run)[0]
    assert m["reward/mean"] == pytest.approx(sum(leaf["terminal_reward"] for leaf in found) / len(found))
    assert m["ask/samples"] > 0 and m["say/samples"] > 0
