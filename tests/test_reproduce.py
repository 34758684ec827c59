"""benchmarks/reproduce.py: its tables load as real configs, its document's numbers, and resumption (no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mhgpo.config import TrainConfig, demo_config_path, load_config

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


rp = _load("reproduce")
ca = rp.ca
SETTINGS = {"minutes": 0.5, "clock": "cpu", "val_limit": 4, "overrides": []}


@pytest.mark.parametrize("name", list(rp.TABLES))
def test_table_rows_load_as_train_configs(tmp_path, name):
    table = rp.TABLES[name]
    assert table.reference in table.rows
    for claim in table.claims:
        assert claim.row in table.rows and claim.than in table.rows and claim.direction in rp.AGREES
    for row in table.rows:
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            ca.row_settings(row, 1, 4, tmp_path, ["questions_per_step=2"], str(tmp_path / "run")),
        )
        warm, algo, _ = ca.parse_row(row)
        assert (cfg.seed, cfg.val_limit, cfg.questions_per_step, cfg.warm_start.enabled) == (1, 4, 2, False)
        expected_model = str(ca.warm_start_dir(tmp_path, 1, ca.row_system(row)).resolve()) if warm else "smollm2-135m"
        assert cfg.model == expected_model
        if algo == "grpo":
            assert (cfg.system, cfg.algo, cfg.sampler) == ("llm", "grpo", "fof")
            assert ca.warm_start_dir(tmp_path, 1, "llm").name == "warm_start-llm-seed1"
        elif algo is not None:
            assert cfg.system == "mas" and cfg.algo == ("mappo" if algo == "mappo" else "mhgpo")
            assert cfg.sampler == ("chains" if algo == "mappo" else algo)
        own = dict(kv.split("=", 1) for kv in ca.row_overrides(row))
        assert cfg.reward.aggr == own.get("reward.aggr", "mean")
        assert cfg.reward.penalties == (own.get("reward.penalties") != "false")
        assert cfg.train_roles == ([own["train_roles"][1:-1]] if "train_roles" in own else None)
        assert cfg.frozen_roles == ([own["frozen_roles"][1:-1]] if "frozen_roles" in own else [])
        assert cfg.advantage == own.get("advantage", "mhgpo")


def test_table_rows_shared_once_and_unknown_table_refused(capsys):
    rows = rp.table_rows(["algorithms", "aggregators", "reward"])
    assert len(rows) == len(set(rows)) and rows.count("warm+rr") == 1 and "warm+mappo@reward.penalties=false" in rows
    with pytest.raises(SystemExit):
        rp.main(["--table", "algorithms,nope", "--out", "unused"])
    assert "unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rp.main(["--table", "aggregators", "--rows", "warm+rr,warm+mappo", "--out", "unused"])
    assert "--rows: warm+mappo not in the tables' rows" in capsys.readouterr().err


def _result(
    row: str, seed: int, f1: float, acc: float = 50.0, steps: list[dict] | None = None, peak: float = 1000.0
) -> dict:
    return {
        "row": row,
        "seed": seed,
        "steps": len(steps or []),
        "val_f1": f1,
        "val_acc": acc,
        "val_n": 100,
        "questions_per_step": 4,
        "peak_mb": peak,
        "settings": SETTINGS,
        "steps_metrics": steps or [],
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "gpu": None},
    }


STEPS = [
    {"llm_calls": 40.0, "samples": 30.0, "seconds/rollout": 2.0, "seconds/train": 1.0},
    {"llm_calls": 24.0, "samples": 18.0, "seconds/rollout": 4.0, "seconds/train": 1.0},
]
AGGREGATED = [{**m, "aggregated_samples": 4.0} for m in STEPS]  # a row run since the metric is logged
FILTERED = [
    {"llm_calls": 60.0, "samples": 20.0, "filter/questions": 12.0, "seconds/rollout": 5.0, "seconds/train": 1.0}
]


def _write_fixture(out: Path) -> None:
    f1 = {
        "warm+rr": [40, 50, 45],
        "warm+rr@reward.aggr=max": [30, 52, 41],
        "warm+rr@reward.aggr=min": [20, 30, 25],
        "warm+rr@reward.aggr=rand": [50, 60, 56],
    }
    for row, values in f1.items():
        for seed, v in enumerate(values):
            steps = FILTERED if row.endswith("min") else AGGREGATED if row.endswith("rand") else STEPS
            (ca.result_path(out, row, seed)).write_text(
                json.dumps(_result(row, seed, v, 40.0 + seed, steps, 1000.0 + 100 * seed))
            )
    ca.result_path(out, "warm+fof", 0).write_text('{"row": "warm+fof", "seed": 0, "val_f')  # cut short


def test_document_numbers_from_fixture_results(tmp_path):
    out = tmp_path / "out"
    (out / "synthetic").mkdir(parents=True)
    (out / "synthetic" / "settings.json").write_text(json.dumps(SETTINGS))
    _write_fixture(out / "synthetic")
    text = rp.write_doc(out, tmp_path / "doc.md", "runs/reproduce")
    assert (tmp_path / "doc.md").read_text() == text
    section = text.split("## aggregators")[1].split("\n## ")[0]
    assert "### synthetic world (synthetic:train, validated on synthetic:dev)" in section
    assert (
        "Command: `python benchmarks/reproduce.py --table aggregators --seeds 0,1,2 --minutes 0.5 --clock cpu "
        "--val-limit 4 --parallel 2 --out runs/reproduce`"
    ) in section
    assert "Machine: Test CPU 9000, 2 cores. Seeds: 0, 1, 2. Budget: 0.5 cpu minutes" in section
    # F1 40/50/45: 45 ± 5; Acc 40/41/42: 41 ± 1; steps 2; s/step (3 + 5)/2 = 4; peak 1000/1100/1200;
    # LLM calls (40 + 24) / (2 steps × 4 questions) = 8, samples 48 / 8 = 6
    # aggregated samples: (4 + 4) / 8 = 1 on the rand row; — on the rows whose steps never logged them
    assert "| trained samples / question | aggregated samples / question |" in section
    assert (
        "| `warm+rr` | 3 | 2.0 ± 0.0 | 45.0 ± 5.0 | 41.0 ± 1.0 | — | 4.0 ± 0.0 | 1100 ± 100 | 8.00 ± 0.00 | "
        "6.00 ± 0.00 | — |"
    ) in section
    assert "| 8.00 ± 0.00 | 6.00 ± 0.00 | 1.00 ± 0.00 |" in section.split("`warm+rr@reward.aggr=rand`")[1]
    # max − mean per seed: −10, 2, −4 → −4 ± 6; min: one filtered step of 12 questions: 60/12 = 5 calls, 20/12 samples
    assert "| `warm+rr@reward.aggr=max` | 3 | 2.0 ± 0.0 | 41.0 ± 11.0 | 41.0 ± 1.0 | -4.0 ± 6.0 |" in section
    assert (
        "| `warm+rr@reward.aggr=min` | 3 | 1.0 ± 0.0 | 25.0 ± 5.0 | 41.0 ± 1.0 | -20.0 ± 0.0 | 6.0 ± 0.0 | "
        "1100 ± 100 | 5.00 ± 0.00 | 1.67 ± 0.00 |"
    ) in section
    # mean − max: 10, −2, 4 → 4 ± 6, |4| ≤ 6: within noise, which ≥ accepts; mean − min 20 ± 0: >, agrees;
    # mean − rand: −10, −10, −11 → −10.33 ± 0.58: <, disagrees
    assert "| mean aggr ≥ max (RR) | `warm+rr` ≥ `warm+rr@reward.aggr=max` (val F1) | 4.00 ± 6.00 | agrees |" in section
    assert (
        "| mean aggr ≥ min (RR) | `warm+rr` ≥ `warm+rr@reward.aggr=min` (val F1) | 20.00 ± 0.00 | agrees |" in section
    )
    assert (
        "| mean aggr ≥ rand (RR) | `warm+rr` ≥ `warm+rr@reward.aggr=rand` (val F1) | -10.33 ± 0.58 | disagrees |"
        in section
    )
    roles = text.split("## roles:")[1].split("\n## ")[0]  # no results (the cut-short warm+fof file is not one): not run
    assert "**Not run.**" in roles and "--table roles --seeds 0,1,2 --minutes 10 --clock cpu --val-limit 100" in roles
    assert "±" not in roles
    algorithms = text.split("## algorithms:")[1].split("\n## ")[0]  # warm+rr is its own row: partial, the rest named
    assert "**Partial**: missing " in algorithms
    assert "warm+mappo seed 0, warm+mappo seed 1, warm+mappo seed 2" in algorithms
    assert "| `warm+rr` | 3 | 2.0 ± 0.0 | 45.0 ± 5.0 |" in algorithms and "warm+rr seed" not in algorithms
    assert ("| MHGPO > MAPPO | `warm+rr` > `warm+mappo` (val F1) | — | not run |") in algorithms
    for name in ("reward", "groups", "recipes"):  # they share warm+rr with an earlier table, none of their own ran
        other = text.split(f"## {name}:")[1].split("\n## ")[0]
        assert "**Not run.**" in other and "±" not in other and f"--table {name} --seeds 0,1,2" in other
    assert [rp.own_rows(rp.TABLES[n]) for n in ("reward", "recipes")] == [
        ["warm+rr@reward.penalties=false", "warm+mappo@reward.penalties=false"],
        [rp.RERANKER_RECIPE, rp.RECIPE_CONTROL],
    ]
    assert rp.own_rows(rp.TABLES["algorithms"]) == list(rp.TABLES["algorithms"].rows)


def test_a_row_s_own_budget():
    assert ca.row_minutes(rp.RERANKER_RECIPE, 10.0) == 30.0 and ca.row_minutes("warm+rr", 10.0) == 10.0
    assert ca.row_overrides(rp.RERANKER_RECIPE) == ["train_roles=[reranker]"]  # not a config key
    assert ca.label(rp.RERANKER_RECIPE) == "warm start + MHGPO-RR [30 min, train_roles=[reranker]]"
    for bad, match in (
        ("warm+rr@budget=soon", "budget=soon is not a positive number"),
        ("warm+rr@budget=0", "budget=0 is not a positive number"),
        ("warm@budget=30", "this row trains nothing"),
    ):
        with pytest.raises(ValueError, match=match):
            ca.parse_row(bad)
    assert ca.split_rows([f"warm,{rp.RERANKER_RECIPE}"]) == [f"warm,{rp.RERANKER_RECIPE}"]  # one item with @: one row
    assert ca.split_rows(["warm,warm+rr", rp.RERANKER_RECIPE]) == ["warm", "warm+rr", rp.RERANKER_RECIPE]


def test_compare_summary_names_each_row_s_training_minutes():
    results = [_result("warm", 0, 20.0), _result("warm+rr", 0, 22.0), _result(rp.RERANKER_RECIPE, 0, 26.0)]
    for r in results:
        r["val_em"] = 10.0
    lines = ca.summary(results, 10.0, "cpu").splitlines()
    assert lines[0].startswith("validation after 10 cpu min of training each, or a row's own budget")
    assert lines[2].startswith("| run | cpu min | seeds | steps | val F1 |")
    assert lines[4].startswith("| warm start only | — | 1 | 0.0 | 20.0 | 10.0 | 50.0 |")
    assert lines[5].startswith("| warm start + MHGPO-RR | 10 | 1 |")
    assert lines[6].startswith("| warm start + MHGPO-RR [30 min, train_roles=[reranker]] | 30 | 1 |")


def test_a_budget_row_s_part_names_its_minutes(tmp_path):
    out = tmp_path / "out"
    (out / "synthetic").mkdir(parents=True)
    (out / "synthetic" / "settings.json").write_text(json.dumps(SETTINGS))
    for row, f1 in (
        ("warm", [20.0, 24.0]),
        ("warm+rr", [22.0, 25.0]),
        (rp.RERANKER_RECIPE, [26.0, 30.0]),
        (rp.RECIPE_CONTROL, [23.0, 28.0]),
    ):
        for seed, v in enumerate(f1):
            ca.result_path(out / "synthetic", row, seed).write_text(json.dumps(_result(row, seed, v)))
    text = rp.write_doc(out, tmp_path / "doc.md", "runs/reproduce")
    recipes = text.split("## recipes:")[1].split("\n## ")[0]
    assert (
        f"Budget: 0.5 cpu minutes of training per row (`{rp.RERANKER_RECIPE}`: 30; `{rp.RECIPE_CONTROL}`: 30), "
        "4 validation"
    ) in recipes
    # recipe − warm: 6, 6 → 6 ± 0 (>: agrees); recipe − warm+rr: 4, 5 → 4.5 ± 0.71
    assert (f"| `{rp.RERANKER_RECIPE}` | 2 | 0.0 ± 0.0 | 28.0 ± 2.8 | 50.0 ± 0.0 | 6.0 ± 0.0 |") in recipes
    assert f"`{rp.RERANKER_RECIPE}` > `warm+rr` (val F1) | 4.50 ± 0.71 | agrees |" in recipes
    # recipe − control: 3, 2 → 2.5 ± 0.71 (>: agrees)
    assert f"`{rp.RERANKER_RECIPE}` > `{rp.RECIPE_CONTROL}` (val F1) | 2.50 ± 0.71 | agrees |" in recipes
    assert "Not run on" not in recipes


def test_verdict_rule():
    assert rp.verdict(">", [3.0, 5.0]) == "agrees"  # 4 ± 1.41
    assert rp.verdict(">", [1.0, -1.5]) == "within noise"  # -0.25 ± 1.77
    assert rp.verdict(">", [-3.0, -5.0]) == "disagrees"
    assert rp.verdict("≈", [1.0, -1.5]) == "agrees" and rp.verdict("≈", [3.0, 5.0]) == "disagrees"
    assert rp.verdict("<", [-3.0, -5.0]) == "agrees" and rp.verdict("≤", [1.0, -1.5]) == "agrees"
    assert rp.verdict("≥", [-3.0, -5.0]) == "disagrees"
    assert rp.verdict(">", [1.0, 1.0]) == "agrees"  # std 0, mean 1
    assert rp.verdict(">", [4.0]) == "n/a (1 seed)" and rp.verdict(">", []) == "not run"
    # one question of 100 moves F1 by at most 1 point: a smaller mean difference decides nothing, whatever its std
    assert rp.verdict(">", [-0.9, -1.0], resolution=1.0) == "within noise"
    assert rp.verdict(">", [-2.0, -2.2], resolution=1.0) == "disagrees"
    # a mean exactly at the bound, as F1s summed in floating point give it, is at the bound
    assert (
        rp.verdict(
            ">",
            [
                57.33333333333333 - 57.33333333333333,
                49.33333333333333 - 50.33333333333334,
                17.333333333333336 - 19.333333333333332,
            ],
            resolution=1.0,
        )
        == "within noise"
    )
    claim = rp.Claim("a", ">", "b", "p")
    by_row = {"a": {0: {"val_n": 100}, 1: {"val_n": 100}}, "b": {0: {"val_n": 50}}}
    assert rp.resolution(by_row, claim) == 2.0 and rp.resolution({}, claim) == 0.0
    assert rp.resolution(by_row, rp.Claim("a", "<", "b", "p", "llm_calls")) == 0.0


def _fake_runner(out: Path, calls: list[list[list[str]]]):
    def runner(jobs: list[list[str]], parallel: int, log: Path) -> list[dict]:
        calls.append(jobs)
        done = []
        for job in jobs:
            seed = int(job[job.index("--seed") + 1])
            if job[0] == "--warm":
                system = job[job.index("--system") + 1]
                folder = ca.warm_start_dir(out, seed, system)
                folder.mkdir(exist_ok=True)
                res = {
                    "row": "warm_start",
                    "seed": seed,
                    "system": system,
                    "steps": 1,
                    "minutes": 0.1,
                    "val_f1": None,
                    "val_acc": None,
                    "settings": {"overrides": []},
                }
                ca.atomic_write_json(folder / "done.json", res)
            else:
                res = _result(job[1], seed, 11.0)
                ca.atomic_write_json(ca.result_path(out, job[1], seed), res)
            done.append(res)
        return done

    return runner


def test_resumption_skips_finished_and_reruns_cut_short(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ca.result_path(out, "warm", 0).write_text(json.dumps(_result("warm", 0, 33.0)))  # finished
    ca.result_path(out, "warm+rr", 0).write_text('{"row": "warm+rr", "seed": 0, "steps": 3, "val')  # cut short
    ca.warm_start_dir(out, 0).mkdir()  # an interrupted warm start: no done.json
    calls: list = []
    results = ca.run_rows(["untrained", "warm", "warm+rr"], [0], out, SETTINGS, 1, runner=_fake_runner(out, calls))
    warm_jobs, row_jobs = calls
    assert [j[:5] for j in warm_jobs] == [["--warm", "--seed", "0", "--system", "mas"]]
    assert [j[:4] for j in row_jobs] == [["--one", "untrained", "--seed", "0"], ["--one", "warm+rr", "--seed", "0"]]
    assert [(r["row"], r["val_f1"]) for r in results] == [("untrained", 11.0), ("warm", 33.0), ("warm+rr", 11.0)]
    calls.clear()  # everything finished now: nothing runs again
    again = ca.run_rows(["untrained", "warm", "warm+rr"], [0], out, SETTINGS, 1, runner=_fake_runner(out, calls))
    assert calls == [] and again == results
    calls.clear()  # a new row from the finished warm start: no warm start job
    ca.run_rows(["warm+grpo", "warm+mappo"], [0], out, SETTINGS, 1, runner=_fake_runner(out, calls))
    assert [[j[:5] for j in jobs] for jobs in calls] == [
        [["--warm", "--seed", "0", "--system", "llm"]],
        [["--one", "warm+grpo", "--seed", "0", "--out"], ["--one", "warm+mappo", "--seed", "0", "--out"]],
    ]


def test_results_under_other_settings_are_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    ca.result_path(out, "warm", 0).write_text(json.dumps(_result("warm", 0, 33.0)))
    with pytest.raises(SystemExit, match="use another --out"):
        ca.run_rows(["warm"], [0], out, {**SETTINGS, "minutes": 10.0}, 1, runner=_fake_runner(out, []))
    calls: list = []
    ca.run_rows(["untrained"], [0], out, SETTINGS, 1, runner=_fake_runner(out, calls))  # OUT pinned to SETTINGS
    assert json.loads((out / "settings.json").read_text()) == SETTINGS and len(calls) == 1
    with pytest.raises(SystemExit, match="use another --out"):  # a row not run yet, under another budget
        ca.run_rows(["warm+mappo"], [0], out, {**SETTINGS, "val_limit": 8}, 1, runner=_fake_runner(out, calls))
    assert len(calls) == 1


def test_data_options():
    assert rp.data_overrides("synthetic", None) == []
    assert rp.data_overrides("hotpotqa:a.jsonl", "hotpotqa:b.jsonl") == [
        "data=hotpotqa:a.jsonl",
        "val_data=hotpotqa:b.jsonl",
    ]
    with pytest.raises(ValueError, match="--val-data SPEC"):
        rp.data_overrides("hotpotqa:a.jsonl", None)


def test_a_warm_start_being_trained_elsewhere_is_waited_for_not_removed(tmp_path, monkeypatch):
    """Two comparisons into one OUT: the second waits on the first's lock, then takes its finished warm start
    (before the lock, it found the folder without done.json, removed it and broke the first's training)."""
    import fcntl
    import threading

    out, common = tmp_path / "out", ["precision=fp32"]
    folder = ca.warm_start_dir(out, 0, "llm")
    (folder / "checkpoints").mkdir(parents=True)  # the first comparison's warm start, still training
    results: list[dict] = []
    asked, flock = threading.Event(), fcntl.flock

    def recorded(f, op):
        if threading.current_thread() is not threading.main_thread():
            asked.set()  # the second comparison asks for the lock
        return flock(f, op)

    monkeypatch.setattr(fcntl, "flock", recorded)
    with open(folder.with_name(folder.name + ".lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        second = threading.Thread(target=lambda: results.append(ca.run_warm_start(out, 0, common, "llm")))
        second.start()
        assert asked.wait(timeout=30)
        assert second.is_alive() and (folder / "checkpoints").is_dir()  # waiting, nothing removed
        done = {
            "row": "warm_start",
            "seed": 0,
            "system": "llm",
            "steps": 1,
            "minutes": 0.1,
            "cpu_minutes": 0.1,
            "val_f1": None,
            "val_acc": None,
            "settings": {"overrides": common},
        }
        (folder / "done.json").write_text(json.dumps(done))  # the first finishes and lets go
    second.join(timeout=30)
    assert not second.is_alive() and results == [done] and (folder / "checkpoints").is_dir()


def test_single_agent_row_runs_from_its_own_warm_start_on_a_tiny_model(tiny_model_dir, world, tmp_path):
    from helpers import train_overrides

    fixed = ("sampler=", "output_dir=", "steps=", "eval_every=", "save_every=", "val_limit=")
    common = [kv for kv in train_overrides(tiny_model_dir, world, tmp_path / "unused") if not kv.startswith(fixed)]
    common += [
        "warm_start.steps=1",
        "warm_start.batch_size=2",
        "warm_start.limit=4",
        "precision=fp32",
        "search.snippet_words=8",
        "search.max_candidates=4",
    ]
    out = tmp_path / "out"
    partial = ca.warm_start_dir(out, 0, "llm")  # an interrupted warm start: no done.json; trained again
    partial.mkdir(parents=True)
    (partial / "leftover").write_text("x")
    warm = ca.run_warm_start(out, 0, common, "llm")
    assert not (partial / "leftover").exists() and (partial / "checkpoints").is_dir()
    assert json.loads((partial / "done.json").read_text()) == warm and warm["system"] == "llm"
    assert ca.run_warm_start(out, 0, common, "llm") == warm  # finished: not trained again
    # the row's own budget (0.6 ms) rules, not the comparison's hour; the first step is always taken
    result = ca.one("warm+grpo@budget=1e-5", 0, 60.0, "cpu", 2, out, common)
    saved = ca.load_result(ca.result_path(out, "warm+grpo@budget=1e-5", 0), ca.settings_of(60.0, "cpu", 2, common))
    assert saved["budget_minutes"] == 1e-5
    assert saved == {**result, "steps_metrics": saved["steps_metrics"], "val_questions": saved["val_questions"]}
    # each validation question's score, for tests paired by question; they average to the row's F1 / Acc
    questions = saved["val_questions"]
    assert len(questions) == 2 and len({q["id"] for q in questions}) == 2
    assert sum(q["f1"] for q in questions) / 2 * 100 == pytest.approx(saved["val_f1"], abs=1e-9)
    assert sum(q["acc"] for q in questions) / 2 * 100 == pytest.approx(saved["val_acc"], abs=1e-9)
    # where GRPO started: the model alone from the same warm start, validated without training
    start = ca.one(rp.SINGLE_WARM, 0, 60.0, "cpu", 2, out, common)
    assert start["system"] == "llm" and start["steps"] == 0 and start["val_n"] == 2
    assert ca.label(rp.SINGLE_WARM) == "warm start only [system=llm]"
    assert (saved["system"], saved["steps"], saved["val_n"], saved["questions_per_step"]) == ("llm", 1, 2, 2)
    (step,) = saved["steps_metrics"]
    # one agent, FoF: group_size (2) answers of each of the step's 2 questions, every one trained
    assert (step["llm_calls"], step["samples"]) == (4.0, 4.0) and step["memory/peak_mb"] > 0
    assert rp.per_question(saved, "llm_calls") == 2.0 and saved["machine"]["cores"] >= 1


def test_data_folders_and_their_commands(tmp_path):
    assert rp.data_tag("synthetic", None) == "synthetic"
    tag = rp.data_tag("hotpotqa:a/train.jsonl", "hotpotqa:a/val.jsonl")
    assert tag.startswith("hotpotqa-") and tag != rp.data_tag("hotpotqa:b/train.jsonl", "hotpotqa:b/val.jsonl")
    out = tmp_path / "out"
    real = {**SETTINGS, "overrides": ["data=hotpotqa:a/train.jsonl", "val_data=hotpotqa:a/val.jsonl", "steps=3"]}
    for folder, settings, f1 in ((out / tag, real, [20.0, 22.0]), (out / "synthetic", SETTINGS, [40.0, 44.0])):
        folder.mkdir(parents=True)
        (folder / "settings.json").write_text(json.dumps(settings))
        for seed, v in enumerate(f1):
            ca.result_path(folder, "warm+rr", seed).write_text(
                json.dumps({**_result("warm+rr", seed, v), "settings": settings})
            )
    (out / "stray").mkdir()  # no settings.json: not a data folder
    assert [p.name for p in rp.data_folders(out)] == ["synthetic", tag]
    section = rp.write_doc(out, tmp_path / "doc.md", "runs/reproduce").split("## algorithms")[1].split("\n## ")[0]
    synthetic, real_part = section.split("### ")[1:]
    assert synthetic.startswith("synthetic world") and "| `warm+rr` | 2 | 0.0 ± 0.0 | 42.0 ± 2.8 |" in synthetic
    assert real_part.startswith("hotpotqa:a/train.jsonl, validated on hotpotqa:a/val.jsonl")
    assert (
        "--parallel 2 --data hotpotqa:a/train.jsonl --val-data hotpotqa:a/val.jsonl --out runs/reproduce steps=3`"
    ) in real_part
    assert "| `warm+rr` | 2 | 0.0 ± 0.0 | 21.0 ± 1.4 |" in real_part


class _Eval:
    def __init__(self, predictions, f1):
        self.predictions = predictions
        self.metrics = {"f1": f1, "em": f1 / 2, "acc": f1 + 10, "n": len(predictions)}


def _prediction(qid, retrieved, shown, llm_steps):
    steps = [{"agent": "retriever", "tool": {}}] + [{"agent": "a", "output": "x"}] * llm_steps
    return {"id": qid, "trace": {"retrieved_titles": retrieved, "selected_titles": shown, "steps": steps}}


def test_oracle_results_and_their_table(tmp_path):
    from mhgpo.data.records import Example

    examples = {
        "q1": Example("q1", "?", ("a",), supporting_titles=("A", "B")),
        "q2": Example("q2", "?", ("b",), supporting_titles=("C",)),
        "q3": Example("q3", "?", ("c",)),
    }  # no gold titles: left out of the recall
    folder = tmp_path / "out" / "synthetic"
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps(SETTINGS))
    for seed, (none_f1, context_f1) in enumerate(((10.0, 50.0), (20.0, 56.0))):
        none = rp.oracle_result(
            "none",
            seed,
            _Eval(
                [
                    _prediction("q1", ["A", "X"], ["X"], 3),
                    _prediction("q2", ["C"], ["C"], 3),
                    _prediction("q3", [], [], 3),
                ],
                none_f1,
            ),
            examples,
            SETTINGS,
        )
        context = rp.oracle_result(
            "context",
            seed,
            _Eval(
                [
                    _prediction("q1", ["A", "B"], ["A", "B"], 1),
                    _prediction("q2", ["C"], ["C"], 1),
                    _prediction("q3", [], [], 1),
                ],
                context_f1,
            ),
            examples,
            SETTINGS,
        )
        for name, res in (("none", none), ("context", context)):
            ca.atomic_write_json(ca.result_path(folder, rp.oracle_row(name), seed), res)
    # recall retrieved: (1/2 + 1) / 2 = 75; shown: (0 + 1) / 2 = 50; 3 LLM calls per question
    assert (none["recall_retrieved"], none["recall_shown"], none["llm_calls"]) == (75.0, 50.0, 3.0)
    section = rp.write_doc(tmp_path / "out", tmp_path / "doc.md", "runs/reproduce").split("## oracles:")[1]
    assert "| `none` | 2 | 15.0 ± 7.1 | 25.0 ± 7.1 | 7.5 ± 3.5 | — | 75.0 ± 0.0 | 50.0 ± 0.0 | 3.00 ± 0.00 |" in section
    # context − none per seed: 40, 36 → 38 ± 2.8
    assert (
        "| `context` | 2 | 53.0 ± 4.2 | 63.0 ± 4.2 | 26.5 ± 2.1 | 38.0 ± 2.8 | 100.0 ± 0.0 | 100.0 ± 0.0 | "
        "1.00 ± 0.00 |"
    ) in section
    assert "| `reranker` | 0 |" in section and "--table oracles --seeds 0,1" in section


def test_oracles_run_on_the_warm_start_of_a_tiny_model(tiny_model_dir, world, tmp_path, monkeypatch):
    from helpers import train_overrides

    fixed = ("sampler=", "output_dir=", "steps=", "eval_every=", "save_every=", "val_limit=")
    common = [kv for kv in train_overrides(tiny_model_dir, world, tmp_path / "unused") if not kv.startswith(fixed)]
    common += [
        "warm_start.steps=1",
        "warm_start.batch_size=2",
        "warm_start.limit=4",
        "precision=fp32",
        "search.snippet_words=8",
        "search.max_candidates=4",
    ]
    folder = tmp_path / "out" / "synthetic"
    settings = ca.settings_of(0.0, "cpu", 3, common)

    def in_process(jobs, parallel, log):  # the warm start and the warm row, here instead of in subprocesses
        return [
            ca.run_warm_start(folder, 0, common)
            if job[0] == "--warm"
            else ca.one("warm", 0, 0.0, "cpu", 3, folder, common)
            for job in jobs
        ]

    monkeypatch.setattr(ca, "run_all", in_process)
    rp.run_oracles(folder, [0], settings, 1)
    by_row = rp.collect(folder)
    results = {name: by_row[rp.oracle_row(name)][0] for name in rp.ORACLES}
    assert results["none"]["val_f1"] == by_row["warm"][0]["val_f1"]  # the same validation as the warm row
    assert results["none"]["llm_calls"] == 3.0 and results["rewriter"]["llm_calls"] == 2.0
    assert results["reranker"]["llm_calls"] == 2.0 and results["context"]["llm_calls"] == 1.0
    assert results["context"]["recall_shown"] == 100.0 == results["context"]["recall_retrieved"]
    assert all(r["val_n"] == 3 for r in results.values())


def test_the_context_oracle_needs_records_that_carry_their_paragraphs(world, tmp_path):
    rows = [json.loads(line) for line in (world / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({**r, "context": []}) + "\n" for r in rows), encoding="utf-8")

    def settings(val: Path) -> dict:
        return {**SETTINGS, "overrides": [f"data=hotpotqa:{world / 'train.jsonl'}", f"val_data=hotpotqa:{val}"]}

    assert rp.has_gold_paragraphs(settings(world / "dev.jsonl"))
    assert not rp.has_gold_paragraphs(settings(bare))
