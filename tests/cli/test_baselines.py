"""The baselines through the command line (mhgpo/cli/train.py, mhgpo/cli/main.py): `train --algo mappo`, `train
--system llm --algo grpo|ppo`, `eval --system llm|mas`, a row of experiments/rows.yaml trained by name at demo
scale, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, mhgpo_main, write_echo_world

from mhgpo.config import TrainConfig, load_config

ROWS_FILE = REPO / "experiments" / "rows.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_world(tmp_path_factory.mktemp("world"), seed=2, n_train=12, n_dev=3)


def small(world: Path, model_dir: Path, out: Path) -> list[str]:
    return [
        f"model={model_dir}",
        f"data=hotpotqa:{world / 'train_echo.jsonl'}",
        f"val_data=hotpotqa:{world / 'dev.jsonl'}",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        f"output_dir={out}",
        "steps=1",
        "questions_per_step=2",
        "group_size=2",
        "eval_every=1",
        "val_limit=2",
        "save_every=1",
        "lora.r=4",
        "search.rewriter.max_new_tokens=6",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=4",
    ]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]


def test_train_mappo_and_single_agent_grpo_and_ppo(world, tiny_model_dir, tmp_path, capsys) -> None:
    run = tmp_path / "mappo"
    assert mhgpo_main("train", "--algo", "mappo", *small(world, tiny_model_dir, run)) == 0
    assert "finished 1 steps" in capsys.readouterr().out
    cfg = load_config(TrainConfig, run / "config.yaml")
    assert (cfg.algo, cfg.sampler) == ("mappo", "chains")
    assert (run / "checkpoints" / "step_1" / "critic.safetensors").is_file()
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert {"critic/loss", "critic/explained_variance", "val/f1"} <= set(metrics) and metrics["actor_updated"] == 1.0
    llm = [r for r in records(run) if r["kind"] == "llm"]
    assert len(llm) == 2 * 2 * 3 and len({r["group_id"] for r in llm}) == 12  # G chains per question

    for algo, sampler in (("grpo", "fof"), ("ppo", "chains")):
        run = tmp_path / algo
        assert mhgpo_main("train", "--system", "llm", "--algo", algo, *small(world, tiny_model_dir, run)) == 0
        cfg = load_config(TrainConfig, run / "config.yaml")
        assert (cfg.system, cfg.algo, cfg.sampler) == ("llm", algo, sampler)
        rows = records(run)
        assert {r["agent"] for r in rows} == {"llm"} and len(rows) == 4  # 2 questions x G answers, no retrieval
        if algo == "grpo":  # two groups, each the G = 2 answers to one question
            by_group: dict[int, list[str]] = {}
            for r in rows:
                by_group.setdefault(r["group_id"], []).append(r["question_id"])
            assert sorted(len(set(q)) for q in by_group.values()) == [1, 1]
            assert sorted(len(q) for q in by_group.values()) == [2, 2]


def test_train_a_row_at_demo_scale(world, tiny_model_dir, tmp_path) -> None:
    run = tmp_path / "row"
    config = f"{ROWS_FILE}:fof_freeze_reranker"
    assert mhgpo_main("train", "--config", config, "--scale", "demo", *small(world, tiny_model_dir, run)) == 0
    cfg = load_config(TrainConfig, run / "config.yaml")
    assert (cfg.sampler, cfg.frozen_roles, cfg.lora.enabled, cfg.optim.lr) == ("fof", ["reranker"], True, 1e-4)
    rows = [r for r in records(run) if r["kind"] == "llm"]
    assert {r["agent"] for r in rows if not r["trained"]} == {"reranker"}
    assert {r["agent"] for r in rows if r["trained"]} == {"rewriter", "answerer"}


def test_eval_the_model_alone_and_the_untrained_team(world, tiny_model_dir, tmp_path) -> None:
    for system in ("llm", "mas"):
        out = tmp_path / system
        assert (
            mhgpo_main(
                "eval",
                "--system",
                system,
                "--model",
                tiny_model_dir,
                "--data",
                f"hotpotqa:{world / 'dev.jsonl'}",
                "--corpus",
                world / "corpus.jsonl",
                "--output-dir",
                out,
                "search.answerer.max_new_tokens=4",
                "search.rewriter.max_new_tokens=6",
                "search.reranker.max_new_tokens=4",
            )
            == 0
        )
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["n"] == 3 and metrics["system"] == system
        steps = [
            [s["agent"] for s in json.loads(line)["trace"]["steps"]]
            for line in (out / "predictions.jsonl").read_text().splitlines()
        ]
        want = ["llm"] if system == "llm" else ["rewriter", "retriever", "reranker", "answerer"]
        assert steps == [want] * 3


def test_cli_rejects_bad_baseline_settings(capsys) -> None:
    assert mhgpo_main("train", "--algo", "grpo", "--steps", "1") == 2
    assert "mhgpo: error: algo: grpo is the single-agent baseline" in capsys.readouterr().err
    assert mhgpo_main("train", "--algo", "mappo", "--sampler", "rr") == 2
    assert "mhgpo: error: sampler: mappo learns from independent chains" in capsys.readouterr().err
