"""`mhgpo reproduce` on the tiny model: rows trained from a shared warm start until their budget (the clock advanced
50 s by each update), a row run for another's steps, the untrained and warm-started teams validated, each kept run
evaluated on another data set, the results reused by a second run, the page; and the job processes themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_echo_world

from mhgpo.experiments import runner
from mhgpo.experiments.results import collect, result_path, run_folder
from mhgpo.rl import budget as budget_module
from mhgpo.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_world(tmp_path_factory.mktemp("world"), seed=5, n_train=12, n_dev=3)


def small(world: Path, model: Path) -> list[str]:
    return [
        "--data",
        f"hotpotqa:{world / 'train_echo.jsonl'}",
        "--val-data",
        f"hotpotqa:{world / 'dev.jsonl'}",
        "--rows-file",
        str(ROOT / "experiments" / "rows.yaml"),
        f"model={model}",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        "precision=fp32",
        "questions_per_step=2",
        "group_size=2",
        "lora.r=4",
        "optim.lr=0.01",
        "warm_start.steps=2",
        "warm_start.batch_size=4",
        "search.rewriter.max_new_tokens=8",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=4",
        "report_to=[]",
    ]


def mhgpo(*args: object) -> int:
    from mhgpo.cli.main import main

    return main([str(a) for a in args])


def test_rows_from_a_shared_warm_start_for_a_budget(world, tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    clock = {"t": 0.0}
    monkeypatch.setitem(budget_module.CLOCKS, "cpu", lambda: clock["t"])
    learn = Trainer.learn

    def timed_learn(self, samples, metrics):
        clock["t"] += 50.0
        return learn(self, samples, metrics)

    monkeypatch.setattr(Trainer, "learn", timed_learn)
    ran: list = []

    def in_process(jobs, parallel, logs):
        ran.extend((j.kind, j.key) for j in jobs)
        return runner.in_process(jobs, parallel, logs)

    monkeypatch.setattr(runner, "subprocesses", in_process)
    out = tmp_path / "out"
    rows = ["untrained", "warm", "warm_rr", "warm_mappo~warm_rr"]
    eval_spec = f"dev2=hotpotqa:{world / 'dev.jsonl'}"
    args = ["reproduce", "--rows", ",".join(rows), "--seeds", "0", "--minutes", "2.5", "--val-limit", "2"]
    assert mhgpo(*args, "--eval", eval_spec, "--out", out, *small(world, tiny_model_dir)) == 0
    assert ran == [("warm", "warm"), *(("row", r) for r in rows)]  # one warm start, shared
    assert f"wrote {out / 'reproduction.md'}" in capsys.readouterr().out
    [folder] = [p for p in out.iterdir() if p.is_dir()]
    results = {k: v[0] for k, v in collect(folder).items()}
    assert set(results) == set(rows)
    rr, matched = results["warm_rr"], results["warm_mappo~warm_rr"]
    assert (rr["steps"], rr["stopped_on_budget"], rr["budget_minutes_used"]) == (3, True, 2.5)  # 50 + 50 + 50 s
    assert (matched["steps"], matched["stopped_on_budget"], matched["steps_of"]) == (3, False, "warm_rr")
    assert (results["warm"]["steps"], results["untrained"]["steps"]) == (0, 0)
    assert [m["step"] for m in rr["steps_metrics"]] == [1, 2, 3] and rr["steps_metrics"][-1]["budget/stopped"] == 1.0
    run = run_folder(folder, "warm_rr", 0)
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_3"]  # the run is kept: its last step
    config = (run / "config.yaml").read_text()
    assert "model: ../warm_start-seed0-" in config and "budget_minutes: 2.5" in config
    # the kept run evaluated on another data set: here the validation set again, so the same F1 as at its last step
    for key in rows:
        ood = results[key]["ood"]["dev2"]
        assert (ood["n"], ood["limit"], ood["f1"]) == (2, 2, results[key]["val_f1"]), key
        assert (run_folder(folder, key, 0) / "eval-dev2" / "metrics.json").is_file()
    page = (out / "reproduction.md").read_text()
    assert "--eval dev2=" in page and "| dev2 F1 | Δ OOD F1 vs warm_rr (paired) |" in page
    assert "## steps:" in page and "| `warm_mappo~warm_rr` | 1 | 3.0 |" in page

    ran.clear()  # everything is there: nothing runs, the page is written again
    assert mhgpo(*args, "--eval", eval_spec, "--out", out, *small(world, tiny_model_dir)) == 0
    assert ran == [] and json.loads(result_path(folder, "warm_rr", 0).read_text()) == rr
    assert mhgpo("reproduce", "--doc-only", "--out", out, "--doc", tmp_path / "page.md") == 0
    assert (tmp_path / "page.md").read_text() == page


def test_jobs_run_in_processes_of_their_own(world, tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    args = ["reproduce", "--rows", "untrained", "--seeds", "0", "--val-limit", "2", "--out", out]
    assert mhgpo(*args, *small(world, tiny_model_dir)) == 0
    assert "done: row untrained seed 0" in capsys.readouterr().out
    [folder] = [p for p in out.iterdir() if p.is_dir()]
    assert collect(folder)["untrained"][0]["val_n"] == 2
    assert (folder / "logs" / "row-untrained-seed0.log").is_file()
    assert mhgpo(*args, "--minutes", "5", *small(world, tiny_model_dir)) == 2  # another budget, the same OUT
    assert "holds results run with" in capsys.readouterr().err
