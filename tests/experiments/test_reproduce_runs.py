"""`mhgpo reproduce` on the tiny model: rows trained from a shared warm start until their budget (the clock advanced
50 s by each update), a row run for another's steps, the untrained and warm-started teams validated, each kept run
evaluated on another data set, the results reused by a second run, the page; and the job processes themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import write_echo_world

from mhgpo.experiments import jobs, runner
from mhgpo.experiments.results import collect, data_folders, result_path, run_folder
from mhgpo.experiments.stats import paired_bootstrap, paired_questions
from mhgpo.rl.trainer import Trainer
from mhgpo.runtime import budget as budget_module

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
    [folder] = data_folders(out)
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
    assert "## steps\n" in page and "| `warm_mappo~warm_rr` | 1 | 3.0 |" in page

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
    [folder] = data_folders(out)
    assert collect(folder)["untrained"][0]["val_n"] == 2
    assert (folder / "logs" / "row-untrained-seed0.log").is_file()
    assert mhgpo(*args, "--minutes", "5", *small(world, tiny_model_dir)) == 2  # another budget, the same OUT
    assert "holds results run with" in capsys.readouterr().err


def _budget_clock(monkeypatch, stop_at: int | None = None) -> dict:
    """Each update advances the budget's clock 50 s; with `stop_at`, the update of that step raises Ctrl-C once
    (before its weights change), as a signal would stop the row there."""
    clock = {"t": 0.0, "stopped": False}
    monkeypatch.setitem(budget_module.CLOCKS, "cpu", lambda: clock["t"])
    learn = Trainer.learn

    def timed_learn(self, samples, metrics):
        if stop_at is not None and self.step + 1 == stop_at and not clock["stopped"]:
            clock["stopped"] = True
            raise KeyboardInterrupt
        clock["t"] += 50.0
        return learn(self, samples, metrics)

    monkeypatch.setattr(Trainer, "learn", timed_learn)
    monkeypatch.setattr(runner, "subprocesses", runner.in_process)
    return clock


def _curve_run(world: Path, model: Path, out: Path) -> int:
    args = ["reproduce", "--rows", "warm_rr", "--seeds", "0", "--minutes", "3.5", "--val-limit", "2"]
    return mhgpo(*args, "--val-every", "2", "--out", out, *small(world, model))


def test_a_row_validated_every_n_steps_keeps_its_curve(world, tiny_model_dir, tmp_path, monkeypatch) -> None:
    _budget_clock(monkeypatch)
    out = tmp_path / "out"
    assert _curve_run(world, tiny_model_dir, out) == 0
    [folder] = data_folders(out)
    rr = collect(folder)["warm_rr"][0]
    assert rr["steps"] == 4 and rr["settings"]["val_every"] == 2  # 4 × 50 s fill 3.5 minutes
    curve = rr["val_curve"]
    assert [p["step"] for p in curve] == [0, 2, 4]
    assert set(curve[0]) == {"step", "cpu_minutes", "f1", "em", "acc", "forms"}  # F1 by question form
    validated = [m for m in rr["steps_metrics"] if "val/f1" in m]
    assert [p["forms"] for p in curve[1:]] == [
        {k[len("val/") :]: v for k, v in m.items() if k.startswith(("val/form/", "val/type/"))} for m in validated
    ]
    assert sum(curve[2]["forms"].get(f"form/{f}/n", 0) for f in ("yes_no", "choice", "other")) == 2
    assert curve[0]["cpu_minutes"] == 0.0 < curve[1]["cpu_minutes"] < curve[2]["cpu_minutes"]
    assert curve[2]["cpu_minutes"] == pytest.approx(rr["steps_cpu_minutes"], rel=1e-9)
    assert (curve[-1]["f1"], curve[-1]["acc"], curve[-1]["em"]) == (rr["val_f1"], rr["val_acc"], rr["val_em"])
    # each later point's change over the start, question by question, from the run's validation at that step
    for point in curve[1:]:
        kept = (folder / rr["run"] / "validation" / f"step_{point['step']:06d}.jsonl").read_text().splitlines()
        diffs = paired_questions([json.loads(x) for x in kept], rr["start_questions"])
        assert len(diffs) == 2 and point["paired"] == [100 * x for x in paired_bootstrap(diffs)]
    assert [q["f1"] for q in rr["val_questions"]] == [json.loads(x)["f1"] for x in kept]
    # step 0 is the warm start, validated once, kept in starts/ and shared by every row starting from it
    [start_file] = (folder / "starts").iterdir()
    start = json.loads(start_file.read_text())
    assert start["model"].startswith("warm_start-seed0-") and start["n"] == 2
    assert (curve[0]["f1"], curve[0]["acc"]) == (start["f1"], start["acc"])
    assert rr["start_questions"] == start["questions"] and len(start["questions"]) == 2
    assert rr["start"]["healthy"] == start["healthy"] and "reranker/invalid_rate" in rr["start"]["behaviour"]
    # the warm start's own validation row gives the same figures (the same model, greedily, on the same questions)
    assert mhgpo("reproduce", "--rows", "warm", "--seeds", "0", "--minutes", "3.5", "--val-limit", "2",
                 "--val-every", "2", "--out", out, *small(world, tiny_model_dir)) == 0  # fmt: skip
    warm = collect(folder)["warm"][0]
    assert (warm["val_f1"], warm["val_acc"]) == (start["f1"], start["acc"]) and "val_curve" not in warm
    assert [start_file] == list((folder / "starts").iterdir())  # (its validation is the same start: kept once)
    assert (
        warm["healthy"]
        == start["healthy"]
        == (
            warm["reranker/invalid_rate"] <= 0.05
            and warm["rewriter/penalty_rate"] <= 0.1
            and warm.get("reranker/gold_recall", 1.0) >= 0.8
        )
    )
    # the page's curves part: the plot beside the page, the row's per-seed line with its paired change
    page = (out / "reproduction.md").read_text()
    assert "## Learning curves" in page and "![validation F1 by step and by CPU minutes](images/curves-" in page
    assert [p.suffix for p in (out / "images").iterdir()] == [".png"]
    head = "| seed | warm start healthy | step 0 | step 2 | end (step) | Δ F1 end − start [95% CI] | +/− (p) | CPU h |"
    assert head in page
    health = {True: "yes", False: "no", None: "—"}[start["healthy"]]
    cells = [f"{curve[0]['f1']:.1f}"]
    cells += [
        f"{p['f1']:.1f} ({p['paired'][0]:+.1f} [{p['paired'][1]:+.1f}, {p['paired'][2]:+.1f}])" for p in curve[1:]
    ]
    cells[-1] += f" ({curve[-1]['step']})"  # the last point is the end column's, with its step
    assert f"| 0 | {health} | {' | '.join(cells)} | " in page


def test_the_warm_starts_own_validation_row_is_the_rows_step_0(world, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The warm row first (--val-every): its validation is kept as the step 0 of the rows that start from that warm
    start, which then do not validate it again."""
    _budget_clock(monkeypatch)
    out = tmp_path / "out"
    assert mhgpo("reproduce", "--rows", "warm", "--seeds", "0", "--minutes", "3.5", "--val-limit", "2",
                 "--val-every", "2", "--out", out, *small(world, tiny_model_dir)) == 0  # fmt: skip
    [folder] = data_folders(out)
    warm = collect(folder)["warm"][0]
    [start_file] = (folder / "starts").iterdir()
    start = json.loads(start_file.read_text())
    assert (start["f1"], start["acc"], start["em"], start["n"]) == (warm["val_f1"], warm["val_acc"], warm["val_em"], 2)
    assert start["questions"] == [{k: v for k, v in q.items() if k != "acc"} for q in warm["val_questions"]]
    assert all(isinstance(q["gold_dropped"], int) for q in start["questions"])  # the world names the gold passages
    assert all(isinstance(q["format_broken"], bool) for q in start["questions"])  # the agents record their penalties
    assert (
        start["healthy"] == warm["healthy"]
        and start["behaviour"]["reranker/invalid_rate"] == warm["reranker/invalid_rate"]
    )
    assert _curve_run(world, tiny_model_dir, out) == 0
    assert not list((folder / "runs").glob("start-*"))  # step 0 not validated again
    rr = collect(folder)["warm_rr"][0]
    assert rr["val_curve"][0]["f1"] == warm["val_f1"] and rr["start_questions"] == start["questions"]
    assert [start_file] == list((folder / "starts").iterdir())


def test_a_row_stopped_mid_run_continues_to_the_same_result(world, tiny_model_dir, tmp_path, monkeypatch) -> None:
    _budget_clock(monkeypatch)
    ticks = iter(range(0, 10**6, 60))  # each reading of the harness's clocks a minute after the one before
    monkeypatch.setattr(jobs, "_clock", lambda: (float(next(ticks)),) * 2)
    whole = tmp_path / "whole"
    assert _curve_run(world, tiny_model_dir, whole) == 0
    _budget_clock(monkeypatch, stop_at=4)  # stopped in step 4: steps 1-3 done, step 3 saved on the way out
    cut = tmp_path / "cut"
    assert _curve_run(world, tiny_model_dir, cut) != 0
    [folder] = [p for p in cut.iterdir() if p.is_dir()]  # (no settings pinned: no job finished)
    partial = run_folder(folder, "warm_rr", 0).with_name("warm_rr-seed0.partial")
    assert [p.name for p in (partial / "checkpoints").iterdir()] == ["step_3"]
    assert not result_path(folder, "warm_rr", 0).exists()
    assert json.loads((partial / jobs.SITTINGS).read_text()) == {"minutes": 1.0, "cpu_minutes": 1.0}
    assert _curve_run(world, tiny_model_dir, cut) == 0  # run again: continues from step 3
    assert not partial.exists()
    a = collect(data_folders(whole)[0])["warm_rr"][0]
    b = collect(folder)["warm_rr"][0]
    timing = ("seconds/", "memory/")
    for key in ("steps", "val_f1", "val_acc", "val_questions", "start_questions", "budget_minutes_used"):
        assert a[key] == b[key], key
    # the row's minutes: one a sitting (the clock read once at its start, once at its end), both sittings counted
    assert (a["train_minutes"], a["train_cpu_minutes"]) == (1.0, 1.0)
    assert (b["train_minutes"], b["train_cpu_minutes"]) == (2.0, 2.0)
    assert [{k: p[k] for k in ("step", "f1", "em", "acc")} for p in a["val_curve"]] == [
        {k: p[k] for k in ("step", "f1", "em", "acc")} for p in b["val_curve"]
    ]
    strip = [{k: v for k, v in m.items() if not k.startswith(timing)} for m in a["steps_metrics"]]
    assert strip == [{k: v for k, v in m.items() if not k.startswith(timing)} for m in b["steps_metrics"]]


def test_a_warm_start_stopped_mid_way_continues_to_the_same_weights(world, tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from mhgpo.experiments import jobs
    from mhgpo.rl.sft import SFTTrainer

    monkeypatch.setattr(runner, "subprocesses", runner.in_process)
    monkeypatch.setattr(jobs, "WARM_SAVE_EVERY", 1)
    learn, stopped = SFTTrainer.learn, {"done": False}

    def stop_at_2(self, samples, metrics):
        if self.step + 1 == 2 and stopping and not stopped["done"]:
            stopped["done"] = True
            raise KeyboardInterrupt
        return learn(self, samples, metrics)

    monkeypatch.setattr(SFTTrainer, "learn", stop_at_2)
    args = ["reproduce", "--rows", "warm", "--seeds", "0", "--val-limit", "2"]
    stopping = False
    assert mhgpo(*args, "--out", tmp_path / "whole", *small(world, tiny_model_dir)) == 0
    stopping = True
    assert mhgpo(*args, "--out", tmp_path / "cut", *small(world, tiny_model_dir)) != 0
    [folder] = [p for p in (tmp_path / "cut").iterdir() if p.is_dir()]  # (no settings pinned: no job finished)
    [partial] = folder.glob("warm_start-seed0-*.partial")
    assert [p.name for p in (partial / "checkpoints").iterdir()] == ["step_1"]
    assert mhgpo(*args, "--out", tmp_path / "cut", *small(world, tiny_model_dir)) == 0  # continues from step 1
    assert not partial.exists()

    def weights(out: Path) -> dict:
        [warm] = [p for p in data_folders(out)[0].glob("warm_start-seed0-*") if p.is_dir()]
        return load_file(str(warm / "checkpoints" / "step_2" / "model.safetensors"))

    a, b = weights(tmp_path / "whole"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole, cut = collect(data_folders(tmp_path / "whole")[0]), collect(folder)
    assert whole["warm"][0]["val_questions"] == cut["warm"][0]["val_questions"]
