"""mhgpo.experiments without a model: the tables name rows that load, the page's numbers from results (those of the
earlier comparison scripts included), the verdict rule, what is still to run, and the output folder's guards."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from mhgpo.config.rows import load_rows
from mhgpo.errors import InputError
from mhgpo.experiments import claims, runner
from mhgpo.experiments.jobs import MARKER, Job, row_config, run_config, run_row, warm_start_folder
from mhgpo.experiments.page import page, write_page
from mhgpo.experiments.results import LEGACY_ROWS, collect, result_path, run_folder, settings_of
from mhgpo.experiments.stats import resolution, verdict
from mhgpo.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[2]
TABLE = load_rows(ROOT / "experiments" / "rows.yaml")
SETTINGS = {"minutes": 0.5, "clock": "cpu", "val_limit": 4, "overrides": []}


def job(key: str, seed: int = 1, folder: Path = Path("out"), **settings) -> Job:
    return Job("row", str(TABLE.path), str(folder), key, seed, {**SETTINGS, **settings})


@pytest.mark.parametrize("name", list(claims.TABLES))
def test_table_rows_are_rows_of_the_table_and_load(tmp_path, name):
    table = claims.TABLES[name]
    assert table.reference in table.rows and len(set(table.rows)) == len(table.rows)
    for claim in table.claims:
        assert claim.row in table.rows and claim.than in table.rows and claim.direction in claims.AGREES
    for key in table.rows:
        row, other = claims.split_key(key)
        assert row in TABLE.rows and (other is None or other in table.rows)
        cfg = row_config(TABLE, job(key, overrides=["questions_per_step=2"]), row, tmp_path / "run")
        assert (cfg.seed, cfg.val_limit, cfg.questions_per_step, cfg.model) == (1, 4, 2, "smollm2-135m")
        assert cfg.budget_minutes == TABLE.row(row).overrides.get("budget_minutes", 0.5)
        assert cfg.warm_start.enabled == key.startswith("warm")


def test_rows_that_fitted_more_steps_than_their_reference_also_run_for_its_steps():
    roles, groups = claims.TABLES["roles"], claims.TABLES["groups"]
    matched = ["only_rewriter", "only_reranker", "only_answerer", "freeze_reranker"]
    assert [k for k in roles.rows if "~" in k] == [f"warm_fof_{r}~warm_fof" for r in matched]
    assert [(c.row, c.direction, c.than, c.paper) for c in roles.claims[-5:]] == [
        ("warm_fof", "≥", "warm_fof_freeze_answerer", "all roles ≥ answerer frozen"),
        *(
            ("warm_fof", "≥", f"warm_fof_{r}~warm_fof", f"(not the paper's) all roles ≥ {role} {how} at equal steps")
            for r, role, how in zip(
                matched, ["rewriter", "reranker", "answerer", "reranker"], ["alone"] * 3 + ["frozen"], strict=True
            )
        ),
    ]
    assert groups.rows[-1] == "warm_rr_groups_prompt_agent_turn~warm_rr"
    assert groups.claims[-1].than == groups.rows[-1] and groups.claims[-1].paper.endswith("at equal steps")


def test_a_row_runs_from_its_warm_start_until_its_budget_or_for_anothers_steps(tmp_path):
    warm = warm_start_folder(row_config(TABLE, job("warm_rr", folder=tmp_path), "warm_rr", "x"), tmp_path)
    (warm / MARKER).parent.mkdir()
    (warm / MARKER).write_text("{}")
    cfg = run_config(TABLE, job("warm_rr", folder=tmp_path), "warm_rr", tmp_path / "run")
    assert (Path(cfg.model).resolve(), cfg.warm_start.enabled, cfg.steps, cfg.budget_minutes) == (
        warm,
        False,
        100_000,
        0.5,
    )
    assert (cfg.eval_every, cfg.save_every) == (100_000, 5)  # validated at the last step only, saved every 5 steps
    curve = run_config(TABLE, job("warm_rr", folder=tmp_path, val_every=25), "warm_rr", tmp_path / "run")
    assert (curve.eval_every, curve.save_every) == (25, 5)  # --val-every: its curve
    matched = Job("row", str(TABLE.path), str(tmp_path), "warm_mappo~warm_rr", 1, SETTINGS, {}, 7)
    cfg = run_config(TABLE, matched, "warm_mappo", tmp_path / "run")
    assert (cfg.algo, cfg.steps, cfg.budget_minutes, Path(cfg.model).resolve()) == ("mappo", 7, None, warm)
    own = run_config(TABLE, job("warm_rr_30min", folder=tmp_path), "warm_rr_30min", tmp_path / "run")
    assert own.budget_minutes == 30.0  # a row's own budget beats the harness's
    other = warm_start_folder(row_config(TABLE, job("warm_grpo", folder=tmp_path), "warm_grpo", "x"), tmp_path)
    assert other != warm and other.name.startswith("warm_start-llm-seed1-")  # the single agent's own warm start
    same = [warm_start_folder(row_config(TABLE, job(r, folder=tmp_path), r, "x"), tmp_path) for r in claims.MHGPO_ROWS]
    assert set(same) == {warm}  # every team row of a seed shares one warm start


def _result(row: str, seed: int, f1: float, acc: float = 50.0, steps: list[dict] | None = None, **more) -> dict:
    return {
        "row": row,
        "seed": seed,
        "steps": len(steps or []),
        "val_f1": f1,
        "val_acc": acc,
        "val_n": 100,
        "questions_per_step": 4,
        "peak_mb": 1000.0,
        "settings": SETTINGS,
        "steps_metrics": steps or [],
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "gpu": None},
        **more,
    }


STEPS = [
    {"llm_calls": 40.0, "samples": 30.0, "seconds/rollout": 2.0, "seconds/train": 1.0},
    {"llm_calls": 24.0, "samples": 18.0, "seconds/rollout": 4.0, "seconds/train": 1.0},
]
AGGREGATED = [{**m, "aggregated_samples": 4.0} for m in STEPS]  # a row run since the metric is logged
FILTERED = [
    {"llm_calls": 60.0, "samples": 20.0, "filter/questions": 12.0, "seconds/rollout": 5.0, "seconds/train": 1.0}
]


def _synthetic(out: Path) -> Path:
    folder = out / "synthetic"
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps(SETTINGS))
    return folder


def test_page_numbers_from_the_earlier_scripts_results(tmp_path):
    """Results as the earlier comparison scripts wrote them (rows named by their overrides, in files named after
    them) give the page's numbers under the rows' names here."""
    folder = _synthetic(tmp_path / "out")
    f1 = {
        "warm+fof_os": [40, 50, 45],
        "warm+fof_os@reward.aggr=max": [30, 52, 41],
        "warm+fof_os@reward.aggr=min": [20, 30, 25],
        "warm+fof_os@reward.aggr=rand": [50, 60, 56],
    }
    for row, values in f1.items():
        for seed, v in enumerate(values):
            steps = FILTERED if row.endswith("min") else AGGREGATED if row.endswith("rand") else STEPS
            result = _result(row, seed, v, 40.0 + seed, steps, peak_mb=1000.0 + 100 * seed)
            result_path(folder, row, seed).write_text(json.dumps(result))
    result_path(folder, "warm+fof", 0).write_text('{"row": "warm+fof", "seed": 0, "val_f')  # cut short
    assert (folder / "warm+fof_os__reward.aggr=max-seed0.json").is_file()  # the earlier scripts' file names
    text = write_page(tmp_path / "out", tmp_path / "doc.md", "runs/reproduce", TABLE)
    assert (tmp_path / "doc.md").read_text() == text
    section = text.split("## aggregators\n")[1].split("\n## ")[0]
    assert "### synthetic world (synthetic:train, validated on synthetic:dev)" in section
    assert (
        "Command: `mhgpo reproduce --table aggregators --seeds 0,1,2 --minutes 0.5 --clock cpu "
        "--val-limit 4 --parallel 2 --out runs/reproduce`"
    ) in section
    assert "Machine: Test CPU 9000, 2 cores. Seeds: 0, 1, 2. Budget: 0.5 cpu minutes" in section
    # F1 40/50/45: 45 ± 5; Acc 40/41/42: 41 ± 1; steps 2; s/step (3 + 5)/2 = 4; peak 1000/1100/1200;
    # LLM calls (40 + 24) / (2 steps × 4 questions) = 8, samples 48 / 8 = 6
    # aggregated samples: (4 + 4) / 8 = 1 on the rand row; — on the rows whose steps never logged them
    assert "| trained samples / question | aggregated samples / question |" in section
    # a row's in-domain cells in one table, its cost's in another (the page's tables are not wider than that)
    assert "| `warm_fof_os` | 3 | 2.0 ± 0.0 | 45.0 ± 5.0 | 41.0 ± 1.0 | — |" in section
    assert "| `warm_fof_os` | 4.0 ± 0.0 | 1100 ± 100 | 8.00 ± 0.00 | 6.00 ± 0.00 | — |" in section
    assert "| `warm_fof_os_aggr_rand` | 4.0 ± 0.0 | 1100 ± 100 | 8.00 ± 0.00 | 6.00 ± 0.00 | 1.00 ± 0.00 |" in section
    # max − mean per seed: −10, 2, −4 → −4 ± 6; min: one filtered step of 12 questions: 60/12 = 5 calls, 20/12 samples
    assert "| `warm_fof_os_aggr_max` | 3 | 2.0 ± 0.0 | 41.0 ± 11.0 | 41.0 ± 1.0 | -4.0 ± 6.0 |" in section
    assert "| `warm_fof_os_aggr_min` | 3 | 1.0 ± 0.0 | 25.0 ± 5.0 | 41.0 ± 1.0 | -20.0 ± 0.0 |" in section
    assert "| `warm_fof_os_aggr_min` | 6.0 ± 0.0 | 1100 ± 100 | 5.00 ± 0.00 | 1.67 ± 0.00 |" in section
    # mean − max: 10, −2, 4 → 4 ± 6, |4| ≤ 6: within noise, which ≥ accepts; mean − min 20 ± 0: >, agrees;
    # mean − rand: −10, −10, −11 → −10.33 ± 0.58: <, disagrees
    aggr = "| mean aggr ≥ {0} (FoF(os)) | `warm_fof_os` ≥ `warm_fof_os_aggr_{0}` (val F1) | {1} |"
    assert aggr.format("max", "4.00 ± 6.00 | agrees") in section
    assert aggr.format("min", "20.00 ± 0.00 | agrees") in section
    assert aggr.format("rand", "-10.33 ± 0.58 | disagrees") in section
    assert "(RR)" not in section  # RR trains no aggregated sample at 4 questions a step: not this table's test
    roles = text.split("## roles\n")[1].split("\n## ")[
        0
    ]  # no results (the cut-short warm+fof file is not one): not run
    assert "**Not run.**" in roles and "--table roles --seeds 0,1,2 --minutes 10 --clock cpu --val-limit 100" in roles
    assert "±" not in roles
    algorithms = text.split("## algorithms\n")[1].split("\n## ")[0]  # warm_fof_os is its own row: partial
    assert "**Partial**: missing " in algorithms
    assert "warm_mappo seed 0, warm_mappo seed 1, warm_mappo seed 2" in algorithms
    assert "| `warm_fof_os` | 3 | 2.0 ± 0.0 | 45.0 ± 5.0 |" in algorithms and "warm_fof_os seed" not in algorithms
    assert "| MHGPO > MAPPO | `warm_fof_os` > `warm_mappo` (val F1) | — | not run |" in algorithms
    for name in ("reward", "groups", "recipes", "steps"):  # no row of theirs ran
        other = text.split(f"## {name}\n")[1].split("\n## ")[0]
        assert "**Not run.**" in other and "±" not in other and f"--table {name} --seeds 0,1,2" in other
    assert [claims.own_rows(claims.TABLES[n]) for n in ("aggregators", "reward", "recipes", "steps")] == [
        [  # each aggregator in the same budget and for the mean's steps (a step's CPU time varies between machines)
            *(f"{s}_aggr_{a}" + m for s in ("warm_fof_os",) for m in ("", f"~{s}") for a in ("max", "min", "rand"))
        ],
        ["warm_rr_final_only", "warm_mappo_final_only"],
        [claims.RERANKER_RECIPE, claims.RECIPE_CONTROL, "warm_rr_30min~warm_rr_reranker_30min"],
        ["warm_mappo~warm_rr", "warm_mappo~warm_is"],  # MAPPO for the steps of each sampler it is set against
    ]
    assert set(collect(folder)) == {
        "warm_fof_os",
        "warm_fof_os_aggr_max",
        "warm_fof_os_aggr_min",
        "warm_fof_os_aggr_rand",
    }


def test_a_row_with_a_budget_of_its_own_and_other_data_sets(tmp_path):
    folder = _synthetic(tmp_path / "out")

    def ood(wiki: float, musique: float) -> dict:
        return {
            name: {"data": f"{name}:val.jsonl", "limit": 4, "f1": f1, "em": 0.0, "acc": 0.0, "n": 4}
            for name, f1 in (("2wiki", wiki), ("musique", musique))
        }

    same = [ood(10.0, 4.0), ood(12.0, 6.0)]  # OOD averages 7 and 9
    for row, f1, other in (
        ("warm", [20.0, 24.0], same),
        ("warm_rr", [22.0, 25.0], same),
        (claims.RERANKER_RECIPE, [26.0, 30.0], [ood(14.0, 6.0), ood(12.0, 8.0)]),  # 10 and 10
        (claims.RECIPE_CONTROL, [23.0, 28.0], same),
    ):
        for seed, v in enumerate(f1):
            atomic_write_json(result_path(folder, row, seed), _result(row, seed, v, ood=other[seed]))
    text = page(tmp_path / "out", "runs/reproduce", TABLE)
    recipes = text.split("## recipes\n")[1].split("\n## ")[0]
    assert (
        f"Budget: 0.5 cpu minutes of training per row (`{claims.RERANKER_RECIPE}`: 30; `{claims.RECIPE_CONTROL}`: "
        "30), 4 validation"
    ) in recipes
    assert "--out runs/reproduce --eval 2wiki=2wiki:val.jsonl --eval musique=musique:val.jsonl`" in recipes
    # recipe − warm: 6, 6 → 6 ± 0 (>: agrees); 2wiki 14, 12; MuSiQue 6, 8; their (OOD) average 10, 10 against the
    # warm start's 7, 9: 3, 1 → 2 ± 1.4
    assert "| row | 2wiki F1 | musique F1 | OOD avg F1 (2wiki, musique) | Δ OOD F1 vs warm (paired) |\n" in recipes
    # in domain, out of domain and cost in three tables, each row's cells in each
    recipe = f"| `{claims.RERANKER_RECIPE}` |"
    assert f"{recipe} 2 | 0.0 ± 0.0 | 28.0 ± 2.8 | 50.0 ± 0.0 | 6.0 ± 0.0 |" in recipes
    assert f"{recipe} 13.0 ± 1.4 | 7.0 ± 1.4 | 10.0 ± 0.0 | 2.0 ± 1.4 |" in recipes
    assert f"{recipe} — | 1000 ± 0 | — | — |" in recipes
    assert "| `warm` | 2 | 0.0 ± 0.0 | 22.0 ± 2.8 | 50.0 ± 0.0 | — |" in recipes
    assert "| `warm` | 11.0 ± 1.4 | 5.0 ± 1.4 | 8.0 ± 1.4 | — |" in recipes
    assert "| row | seeds | steps | val F1 | val Acc | Δ F1 vs warm (paired) |\n" in recipes
    assert "| row | s / step | peak MB | LLM calls / question | trained samples / question |\n" in recipes
    assert f"`{claims.RERANKER_RECIPE}` > `warm_rr` (val F1) | 4.50 ± 0.71 | agrees |" in recipes
    assert f"`{claims.RERANKER_RECIPE}` > `{claims.RECIPE_CONTROL}` (val F1) | 2.50 ± 0.71 | agrees |" in recipes
    assert "Not run on" not in recipes


def test_verdict_rule():
    assert verdict(">", [3.0, 5.0]) == "agrees"  # 4 ± 1.41
    assert verdict(">", [1.0, -1.5]) == "within noise"  # -0.25 ± 1.77
    assert verdict(">", [-3.0, -5.0]) == "disagrees"
    assert verdict("≈", [1.0, -1.5]) == "agrees" and verdict("≈", [3.0, 5.0]) == "disagrees"
    assert verdict("<", [-3.0, -5.0]) == "agrees" and verdict("≤", [1.0, -1.5]) == "agrees"
    assert verdict("≥", [-3.0, -5.0]) == "disagrees"
    assert verdict(">", [1.0, 1.0]) == "agrees"  # std 0, mean 1
    assert verdict(">", [4.0]) == "n/a (1 seed)" and verdict(">", []) == "not run"
    # one question of 100 moves F1 by at most 1 point: a smaller mean difference decides nothing, whatever its std
    assert verdict(">", [-0.9, -1.0], resolution=1.0) == "within noise"
    assert verdict(">", [-2.0, -2.2], resolution=1.0) == "disagrees"
    # a mean exactly at the bound, as F1s summed in floating point give it, is at the bound
    diffs = [
        57.33333333333333 - 57.33333333333333,
        49.33333333333333 - 50.33333333333334,
        17.333333333333336 - 19.333333333333332,
    ]
    assert verdict(">", diffs, resolution=1.0) == "within noise"
    # the seeds agree, but over the questions the change is a few answers each way: within noise
    few = [100.0, 100.0, 100.0, -100.0, -100.0] + [0.0] * 95
    assert verdict(">", [3.0, 5.0], questions=few) == "within noise"
    many = [100.0] * 12 + [0.0] * 88  # 12 better answers, none worse
    assert verdict(">", [3.0, 5.0], questions=many) == "agrees"
    assert verdict(">", [-3.0, -5.0], questions=[-x for x in many]) == "disagrees"
    claim = claims.Claim("a", ">", "b", "p")
    by_row = {"a": {0: {"val_n": 100}, 1: {"val_n": 100}}, "b": {0: {"val_n": 50}}}
    assert resolution(by_row, claim) == 2.0 and resolution({}, claim) == 0.0
    assert resolution(by_row, claims.Claim("a", "<", "b", "p", "llm_calls")) == 0.0


def test_legacy_rows_are_rows_of_the_table(tmp_path):
    assert set(LEGACY_ROWS.values()) <= set(TABLE.rows)
    assert claims.table_rows(["algorithms", "aggregators"]).count("warm_fof_os") == 1
    atomic_write_json(result_path(tmp_path, "warm+rr", 0), _result("warm+rr", 0, 1.0))
    atomic_write_json(result_path(tmp_path, "warm+rr", 1), _result("warm+rr", 1, 2.0))
    atomic_write_json(result_path(tmp_path, "warm_rr", 0), _result("warm_rr", 0, 3.0))  # its own name first
    assert {s: r["val_f1"] for s, r in collect(tmp_path)["warm_rr"].items()} == {0: 3.0, 1: 2.0}


def _fake(out: Path, calls: list[list[Job]]):
    """A runner that writes what each job would: a warm start's record, a row's result."""

    def run(jobs: list[Job], parallel: int, logs: Path) -> list[Job]:
        calls.append(jobs)
        for j in jobs:
            if j.kind == "warm":
                folder = warm_start_folder(row_config(TABLE, j, j.key, "x"), out)
                folder.mkdir()
                atomic_write_json(folder / MARKER, {"row": "warm_start"})
            else:
                steps = [{"llm_calls": 1.0}] * (j.steps or 3)
                own = {"overrides": TABLE.row(claims.split_key(j.key)[0]).overrides}
                atomic_write_json(result_path(out, j.key, j.seed), _result(j.key, j.seed, 11.0, steps=steps, **own))
        return []

    return run


def test_resumption_skips_finished_results_and_runs_the_rest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    atomic_write_json(result_path(out, "warm", 0), _result("warm", 0, 33.0))  # finished
    result_path(out, "warm_rr", 0).write_text('{"row": "warm_rr", "seed": 0, "steps": 3, "val')  # cut short
    calls: list = []
    keys = ["untrained", "warm", "warm_rr", "warm_mappo~warm_rr"]
    results = runner.run_rows(TABLE, keys, [0], out, SETTINGS, 1, runner=_fake(out, calls))
    first, matched = calls  # the warm start and the rows in one queue, each row after its warm start
    warm = "warm-warm_rr-seed0"  # one warm start for every team row
    assert [(j.kind, j.key, j.after) for j in first] == [
        ("warm", "warm_rr", ()),
        ("row", "untrained", ()),
        ("row", "warm_rr", (warm,)),
    ]
    assert first[0].name == warm
    assert [(j.key, j.steps) for j in matched] == [("warm_mappo~warm_rr", 3)]  # warm_rr's steps on seed 0
    assert {k: r[0]["val_f1"] for k, r in results.items()} == {k: 33.0 if k == "warm" else 11.0 for k in keys}
    calls.clear()  # everything finished now: nothing runs again
    assert runner.run_rows(TABLE, keys, [0], out, SETTINGS, 1, runner=_fake(out, calls)) == results
    assert calls == [[], []]
    calls.clear()  # a row of the single agent: its own warm start
    runner.run_rows(TABLE, ["warm_grpo"], [0], out, SETTINGS, 1, runner=_fake(out, calls))
    assert [[(j.kind, j.key, j.after) for j in jobs] for jobs in calls] == [
        [("warm", "warm_grpo", ()), ("row", "warm_grpo", ("warm-warm_grpo-seed0",))],
        [],
    ]
    calls.clear()  # an evaluation on another data set asked for: the finished rows run again (for it alone), their
    # warm start trained already: no job to wait for
    runner.run_rows(TABLE, ["warm_rr"], [0], out, SETTINGS, 1, {"2wiki": "2wiki:x"}, runner=_fake(out, calls))
    assert [[(j.key, j.evals, j.after) for j in jobs] for jobs in calls] == [
        [("warm_rr", {"2wiki": "2wiki:x"}, ())],
        [],
    ]


def test_a_matched_row_whose_reference_is_finished_goes_in_the_first_queue(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    steps = [{"llm_calls": 1.0}] * 5
    atomic_write_json(result_path(out, "warm_rr", 0), _result("warm_rr", 0, 20.0, steps=steps))  # seed 0 finished
    calls: list = []
    keys = ["warm_rr", "warm_mappo~warm_rr"]
    runner.run_rows(TABLE, keys, [0, 1], out, SETTINGS, 2, runner=_fake(out, calls))
    first, second = calls
    assert [(j.kind, j.key, j.seed, j.steps, j.after) for j in first] == [
        ("warm", "warm_rr", 1, None, ()),
        ("warm", "warm_mappo", 0, None, ()),  # the same warm start as warm_rr's: only the matched row needs it
        ("row", "warm_rr", 1, None, ("warm-warm_rr-seed1",)),
        ("row", "warm_mappo~warm_rr", 0, 5, ("warm-warm_mappo-seed0",)),  # warm_rr's 5 steps on seed 0
    ]
    assert [(j.key, j.seed, j.steps) for j in second] == [("warm_mappo~warm_rr", 1, 3)]  # after warm_rr's seed 1


def _job(kind: str, key: str, seed: int, after: tuple[str, ...] = ()) -> Job:
    return Job(kind, "rows.yaml", "out", key, seed, SETTINGS, after=after)


def test_a_job_starts_once_its_warm_start_has_finished_and_others_go_first(capsys):
    w0, w1 = _job("warm", "warm_rr", 0), _job("warm", "warm_rr", 1)
    r0, r1 = _job("row", "warm_rr", 0, (w0.name,)), _job("row", "warm_rr", 1, (w1.name,))
    plain = _job("row", "untrained", 0)
    pending, failed = [w0, w1, r0, r1, plain], []
    assert runner.next_job(pending, [], failed) == w0
    assert runner.next_job(pending, [w0], failed) == w1
    assert runner.next_job(pending, [w0, w1], failed) == plain  # r0 and r1 wait for their warm starts
    assert runner.next_job(pending, [w0, w1], failed) is None and pending == [r0, r1]
    assert runner.next_job(pending, [w0], failed) == r1  # w1 finished: r1 goes before r0
    failed.append(w0)  # w0 failed: r0 is not started, and counts as failed
    assert runner.next_job(pending, [r1], failed) is None
    assert pending == [] and failed == [w0, r0]
    assert "not started: row warm_rr seed 0 (its warm start failed)" in capsys.readouterr().out
    # a job after one that is not in this queue (trained by an earlier run) starts at once
    assert runner.next_job([r0], [], []) == r0


def test_a_job_keeps_what_it_waits_for_through_json():
    job = _job("row", "warm_rr", 2, ("warm-warm_rr-seed2",))
    assert Job.from_json(job.to_json()) == job


def test_results_under_other_settings_or_of_a_changed_row_are_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    atomic_write_json(result_path(out, "warm", 0), _result("warm", 0, 33.0))
    with pytest.raises(InputError, match="use another --out"):
        runner.run_rows(TABLE, ["warm"], [0], out, {**SETTINGS, "minutes": 10.0}, 1, runner=_fake(out, []))
    calls: list = []
    runner.run_rows(TABLE, ["untrained"], [0], out, SETTINGS, 1, runner=_fake(out, calls))  # OUT pinned to SETTINGS
    assert json.loads((out / "settings.json").read_text()) == SETTINGS and len(calls[0]) == 1
    with pytest.raises(InputError, match="use another --out"):  # a row not run yet, under another budget
        runner.run_rows(TABLE, ["warm_mappo"], [0], out, {**SETTINGS, "val_limit": 8}, 1, runner=_fake(out, calls))
    changed = _result("warm_rr", 0, 20.0, overrides={"reward.aggr": "max"})
    atomic_write_json(result_path(out, "warm_rr", 0), changed)
    with pytest.raises(InputError, match=r"row warm_rr ran with \{\"reward.aggr\": \"max\"\}, and .*rows.yaml now"):
        run_row(Job("row", str(TABLE.path), str(out), "warm_rr", 0, SETTINGS))
    with pytest.raises(InputError, match="no row 'warm_nope'"):
        runner.run_rows(TABLE, ["warm_nope"], [0], out, SETTINGS, 1, runner=_fake(out, calls))
    with pytest.raises(InputError, match=r"--eval: expected NAME=SPEC"):
        runner.check_evals(["2wiki"])
    assert settings_of(10, "cpu", 100, []) == {"minutes": 10, "clock": "cpu", "val_limit": 100, "overrides": []}


def test_the_harness_never_removes_or_writes_through_what_it_did_not_make(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    # a folder of the user's where a warm start would go: refused, left as it is
    cfg = row_config(TABLE, job("warm_rr", seed=0, folder=out), "warm_rr", "x")
    mine = warm_start_folder(cfg, out)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    from mhgpo.experiments.jobs import run_warm

    with pytest.raises(InputError, match=r"is not a finished run of mhgpo reproduce .*left as it is"):
        run_warm(Job("warm", str(TABLE.path), str(out), "warm_rr", 0, SETTINGS))
    assert (mine / "notes.txt").read_text() == "mine"
    # a folder of the user's where a row's run would go: refused, left as it is
    run = run_folder(out, "untrained", 0)
    run.mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    with pytest.raises(InputError, match=r"is not a finished run of mhgpo reproduce"):
        run_row(Job("row", str(TABLE.path), str(out), "untrained", 0, SETTINGS))
    assert (run / "metrics.json").read_text() == "{}"
    # links planted in the output folder (a log, a lock, a result) are refused before anything is written
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the harness's")
    for planted in (out / "logs" / "row-untrained-seed0.log", out / ".locks" / "x.lock", result_path(out, "warm", 0)):
        planted.parent.mkdir(parents=True, exist_ok=True)
        planted.symlink_to(elsewhere)
        with pytest.raises(InputError, match="is a link"):
            runner.run_rows(TABLE, ["untrained"], [0], out, SETTINGS, 1, runner=_fake(out, []))
        planted.unlink()
    assert elsewhere.read_text() == "not the harness's" and not (out / "settings.json").exists()
    # the page replaces a link in its place, and writes nothing through it
    doc = tmp_path / "doc.md"
    doc.symlink_to(elsewhere)
    write_page(out, doc, "runs/reproduce", TABLE)
    assert not doc.is_symlink() and elsewhere.read_text() == "not the harness's"
    # a temporary run folder of a dead process of this host is the harness's own: removed before the row runs again
    from mhgpo.io import temp_path

    dead = temp_path(run_folder(out, "warm", 0))
    dead = dead.with_name(dead.name.replace(f"-{os.getpid()}-", "-999999999-"))
    dead.mkdir(parents=True)
    live = temp_path(run_folder(out, "warm", 0))
    live.mkdir()
    from mhgpo.experiments import jobs as jobs_module

    def fail(*args):
        raise RuntimeError("stop here")

    monkeypatch.setattr(jobs_module, "_run", fail)
    monkeypatch.setattr(jobs_module, "run_config", lambda *a: None)
    with pytest.raises(RuntimeError, match="stop here"):
        run_row(Job("row", str(TABLE.path), str(out), "warm", 0, SETTINGS))
    assert not dead.exists() and live.exists()  # (this process's own is alive)


def test_a_page_keeps_the_parts_whose_results_are_not_in_the_output_folder(tmp_path):
    """Writing the page over an earlier one keeps each part that no result here replaces (results run elsewhere,
    or before they were kept with the project), marked so; a part with results here is written from them."""
    from mhgpo.experiments.page import CARRIED

    folder = _synthetic(tmp_path / "out")
    for row in claims.TABLES["reward"].rows:  # the reward table's every row and seed: its part is complete here
        for seed, v in enumerate([40, 50, 45]):
            result_path(folder, row, seed).write_text(json.dumps(_result(row, seed, v)))
    earlier = "\n".join(
        [
            "# Reproduction",
            "## roles: Role-wise training",
            "### synthetic world (synthetic:train, validated on synthetic:dev)",
            "",
            "Machine: Old CPU, 2 cores. Seeds: 0, 1, 2.",
            "",
            "| `warm_fof` | 3 | 57.3 |",
            "## reward: Composite reward",
            "### synthetic world (synthetic:train, validated on synthetic:dev)",
            "",
            "Machine: Old CPU, 2 cores.",
            "",
            "| `warm_rr_final_only` | 3 | 99.9 |",
            "## steps: at equal steps",
            "",
            "**Not run.** Command:",
        ]
    )
    doc = tmp_path / "doc.md"
    doc.write_text(earlier)
    text = write_page(tmp_path / "out", doc, "runs/reproduce", TABLE)
    roles = text.split("## roles\n")[1].split("\n## ")[0]
    assert f"{CARRIED}\n\nMachine: Old CPU, 2 cores. Seeds: 0, 1, 2.\n\n| `warm_fof` | 3 | 57.3 |" in roles
    assert "**Not run.**" not in roles
    reward = text.split("## reward\n")[1].split("\n## ")[0]  # results here: written from them, not carried
    assert "99.9" not in reward and CARRIED not in reward and "Test CPU 9000" in reward
    assert write_page(tmp_path / "out", doc, "runs/reproduce", TABLE) == text  # written again: the same page


def test_a_part_run_only_in_part_does_not_replace_a_complete_one(tmp_path):
    """Results that fill a table's part only in part (rows it shares with another table, fewer seeds) leave the
    earlier page's complete part for that data set as it was, marked with how many of its results are here; they
    replace a part that was partial too, and a part they complete."""
    from mhgpo.experiments.page import CARRIED_PARTIAL, PARTIAL

    folder = _synthetic(tmp_path / "out")
    for row in ("warm_rr", "warm_rr_groups_agent"):  # two of the groups table's 4 rows, one of them its own
        for seed, v in enumerate([40, 50, 45]):
            result_path(folder, row, seed).write_text(json.dumps(_result(row, seed, v)))
    part = "### synthetic world (synthetic:train, validated on synthetic:dev)"
    complete = "Machine: Old CPU, 2 cores. Seeds: 0, 1, 2.\n\n| `warm_rr_groups_agent` | 3 | 57.3 |"
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join(["# Reproduction", "## groups: Advantage groups", part, "", complete]))
    text = write_page(tmp_path / "out", doc, "runs/reproduce", TABLE)
    groups = text.split("## groups\n")[1].split("\n## ")[0]
    assert f"{part}\n\n{CARRIED_PARTIAL.format(found=6, needed=12)}\n\n{complete}\n" in groups
    assert PARTIAL not in groups and "Test CPU 9000" not in groups
    assert write_page(tmp_path / "out", doc, "runs/reproduce", TABLE) == text  # written again: the same page

    doc.write_text("\n".join(["# Reproduction", "## groups: Advantage groups", part, "", f"{complete} {PARTIAL}"]))
    groups = write_page(tmp_path / "out", doc, "runs/reproduce", TABLE).split("## groups\n")[1].split("\n## ")[0]
    assert "57.3" not in groups  # a part partial here replaces a part that was partial too
    assert f"{PARTIAL}: missing warm_rr_groups_prompt_agent_turn seed 0" in groups

    doc.write_text("\n".join(["# Reproduction", "## groups: Advantage groups", part, "", complete]))
    for row in claims.TABLES["groups"].rows:
        for seed, v in enumerate([41, 51, 46]):
            if row not in ("warm_rr", "warm_rr_groups_agent"):
                result_path(folder, row, seed).write_text(json.dumps(_result(row, seed, v)))
    groups = write_page(tmp_path / "out", doc, "runs/reproduce", TABLE).split("## groups\n")[1].split("\n## ")[0]
    assert "57.3" not in groups and "Carried over" not in groups and PARTIAL not in groups
    assert "Test CPU 9000" in groups  # complete here: written from the results


def test_a_carried_part_in_the_earlier_layout_is_shown_in_todays_tables(tmp_path):
    """A part carried over from a page written before the headings were shortened and the row tables split (`## roles:
    TITLE`; one table of every column) is found under its table's name and data set and shown as a part of its own
    is: in domain, out of domain and cost in tables of their own, every cell as it was; the verdicts as they were."""
    from mhgpo.experiments.page import CARRIED, previous_parts

    _synthetic(tmp_path / "out")
    part = "### synthetic world (synthetic:train, validated on synthetic:dev)"
    head = "| row | seeds | steps | val F1 | val Acc | Δ F1 vs warm_fof (paired) | s / step | peak MB | 2wiki F1 | Δ OOD F1 vs warm_fof (paired) |"
    rows = [
        "| `warm_fof` | 3 | 5.7 ± 0.6 | 46.0 ± 16.3 | 45.7 ± 16.3 | — | 100.2 ± 3.7 | 2903 ± 224 | 9.1 ± 0.1 | — |",
        "| `warm_fof_only_reranker` | 3 | 9.0 | 55.6 | 55.3 | 9.6 | 60.5 | 2700 | 9.5 | 0.4 |",
    ]
    verdicts = (
        "| paper | comparison | ours (paired, mean ± std) | verdict |\n|---|---|---|---|\n| a | b | 1.00 | agrees |"
    )
    body = f"Machine: Old CPU, 2 cores.\n\n{head}\n|{'---|' * 10}\n" + "\n".join(rows) + f"\n\n{verdicts}"
    doc = tmp_path / "doc.md"
    earlier = "\n".join(["# Reproduction", "## roles: Role-wise training (MHGPO-FoF): every role ...", part, "", body])
    doc.write_text(earlier)
    text = write_page(tmp_path / "out", doc, "runs/reproduce", TABLE)
    roles = text.split("## roles\n")[1].split("\n## ")[0]
    assert f"{part}\n\n{CARRIED}\n\nMachine: Old CPU, 2 cores.\n\n" in roles
    assert (
        "| row | seeds | steps | val F1 | val Acc | Δ F1 vs warm_fof (paired) |\n|---|---|---|---|---|---|\n"
        "| `warm_fof` | 3 | 5.7 ± 0.6 | 46.0 ± 16.3 | 45.7 ± 16.3 | — |\n"
        "| `warm_fof_only_reranker` | 3 | 9.0 | 55.6 | 55.3 | 9.6 |\n\n"
        "| row | 2wiki F1 | Δ OOD F1 vs warm_fof (paired) |\n|---|---|---|\n"
        "| `warm_fof` | 9.1 ± 0.1 | — |\n| `warm_fof_only_reranker` | 9.5 | 0.4 |\n\n"
        "| row | s / step | peak MB |\n|---|---|---|\n"
        "| `warm_fof` | 100.2 ± 3.7 | 2903 ± 224 |\n| `warm_fof_only_reranker` | 60.5 | 2700 |\n\n"
        f"{verdicts}\n"
    ) in roles
    assert write_page(tmp_path / "out", doc, "runs/reproduce", TABLE) == text  # written again: the same page
    assert set(previous_parts(text)["roles"]) == set(previous_parts(earlier)["roles"])  # keyed alike in both layouts


def test_the_reproduction_page_is_what_the_harness_writes_from_the_kept_results():
    """docs/reproduction.md is the page `mhgpo reproduce --doc-only --doc docs/reproduction.md` writes from
    experiments/results (its parts without results there kept, and marked so): no figure on it is edited by hand."""
    root = Path(__file__).resolve().parents[2]
    committed = (root / "docs" / "reproduction.md").read_text(encoding="utf-8")
    rows = load_rows(root / "experiments" / "rows.yaml")
    assert page(root / "experiments" / "results", "experiments/results", rows, committed) == committed


# ------------------------------------------------------------------------------------ per-question paired statistics


def test_paired_questions_match_by_id():
    from mhgpo.experiments.stats import paired_questions

    before = [{"id": "a", "f1": 50.0}, {"id": "b", "f1": 0.0}, {"id": "c", "f1": 100.0}]
    after = [{"id": "c", "f1": 100.0}, {"id": "a", "f1": 100.0}, {"id": "z", "f1": 10.0}]
    assert paired_questions(after, before) == [0.0, 50.0]


def test_paired_bootstrap_against_a_direct_computation():
    import numpy as np

    from mhgpo.experiments.stats import paired_bootstrap

    diffs = [0.0, 100.0, -50.0, 0.0, 100.0, 0.0, 0.0, 25.0]
    mean, low, high = paired_bootstrap(diffs, draws=500, seed=3)
    rng = np.random.default_rng(3)
    d = np.array(diffs)
    means = [d[rng.integers(0, 8, size=8)].mean() for _ in range(500)]  # one draw of questions at a time
    assert mean == 21.875
    assert (low, high) == (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))
    assert low < mean < high
    assert paired_bootstrap([2.0] * 5) == (2.0, 2.0, 2.0)  # no spread: no interval
    with pytest.raises(ValueError):
        paired_bootstrap([])


def test_sign_test_counts_and_exact_p():
    from mhgpo.experiments.stats import sign_test

    assert sign_test([1.0, 2.0, 0.0, -1.0]) == (2, 1, 1.0)
    assert sign_test([5.0] * 6) == (6, 0, 2 / 64)  # 2 * (1/2)^6
    up, down, p = sign_test([1.0] * 9 + [-1.0] * 1)
    assert (up, down) == (9, 1) and p == pytest.approx(2 * 11 / 1024, rel=1e-12)
    assert sign_test([0.0, 0.0]) == (0, 0, 1.0)


def test_question_diffs_pair_by_seed_and_question():
    from mhgpo.experiments.stats import question_diffs

    q = lambda *f1s: [{"id": f"q{i}", "f1": f, "acc": f} for i, f in enumerate(f1s)]  # noqa: E731
    by_row = {
        "a": {0: {"val_questions": q(1.0, 0.5)}, 1: {"val_questions": q(0.0, 1.0)}, 2: {"val_questions": q(1.0)}},
        "b": {0: {"val_questions": q(0.0, 0.5)}, 1: {"val_questions": q(1.0, 1.0)}, 3: {"val_questions": q(0.0)}},
    }
    assert question_diffs(by_row, "a", "b") == [1.0, 0.0, -1.0, 0.0]  # seeds 0 and 1 only
    assert question_diffs({"a": {0: {}}, "b": {0: {}}}, "a", "b") == []  # results without their questions


def test_a_healthy_warm_start_is_judged_on_both_formats_and_the_gold_passages_kept():
    from mhgpo.experiments.curves import healthy

    bounds = {"reranker/invalid_rate": 0.05, "rewriter/penalty_rate": 0.1, "reranker/gold_recall": 0.8}
    assert healthy(bounds) is True  # the bounds themselves
    assert healthy({**bounds, "reranker/invalid_rate": 0.06}) is False
    assert healthy({**bounds, "rewriter/penalty_rate": 0.11}) is False
    assert healthy({**bounds, "reranker/gold_recall": 0.79}) is False  # formats kept, the second hop dropped
    assert healthy({"reranker/invalid_rate": 0.0}) is True  # a team without a Rewriter, data without gold titles
    assert healthy({"reranker/gold_recall": 0.5}) is False  # judged on the figure it has
    assert healthy({"f1": 50.0}) is None  # none of them: nothing to judge


def test_a_curve_point_carries_its_paired_change_over_the_start_where_its_questions_were_kept():
    from mhgpo.experiments.curves import curve
    from mhgpo.experiments.stats import paired_bootstrap

    start = {
        "f1": 50.0,
        "em": 50.0,
        "acc": 50.0,
        "questions": [{"id": q, "f1": f} for q, f in zip("abcd", (1, 0, 0.5, 1))],
    }
    history = [{"step": s, "val/f1": 60.0, "val/em": 55.0, "val/acc": 60.0, "cpu_minutes": s / 2} for s in (2, 4)]
    kept = {4: [{"id": q, "f1": f} for q, f in zip("dcbx", (1, 1, 0.25, 0))]}  # "x": not in the start, left out
    points = curve(start, history, kept.get)
    assert [p["step"] for p in points] == [0, 2, 4] and "paired" not in points[1]  # step 2: no questions kept
    assert points[2]["paired"] == [100 * x for x in paired_bootstrap([0.0, 0.5, 0.25])]  # d, c, b against the start
    assert curve(start, history) == [{k: v for k, v in p.items() if k != "paired"} for p in points]


def _prediction(qid: str, f1: float, *reranked: tuple[int, int], rewriter_penalty: float | None = None) -> dict:
    """A prediction whose trace has a Reranker step per ``(gold shown, gold selected)``, after a Rewriter step (with
    its format penalty when given)."""
    steps = [{"agent": "rewriter", "info": {"queries": ["q"]}}]
    if rewriter_penalty is not None:
        steps[0]["penalty"] = rewriter_penalty
    steps += [{"agent": "reranker", "info": {"selected": [0], "gold": g, "gold_selected": k}} for g, k in reranked]
    return {"id": qid, "f1": f1, "acc": f1, "trace": {"steps": steps}}


def test_a_questions_record_counts_the_gold_passages_its_team_dropped_and_its_broken_formats():
    from mhgpo.experiments.curves import format_broken, gold_dropped, question_record

    assert gold_dropped(_prediction("a", 1.0, (2, 1))) == 1
    assert gold_dropped(_prediction("a", 1.0, (2, 2), (1, 0))) == 1  # summed over the Reranker's steps
    assert gold_dropped(_prediction("a", 1.0, (0, 0))) == 0  # no gold shown: nothing dropped
    assert gold_dropped(_prediction("a", 1.0)) is None  # no step counts them
    assert gold_dropped({"id": "a", "f1": 1.0}) is None  # no trace
    odd = _prediction("a", 1.0, (2, 1))  # a team of one's own whose `gold` is the gold answer: not counted
    odd["trace"]["steps"][1]["info"]["gold"] = "Paris"
    assert gold_dropped(odd) is None
    assert gold_dropped({"id": "a", "trace": {"steps": "none"}}) is None and gold_dropped({"trace": [1]}) is None
    assert question_record(_prediction("a", 0.5, (2, 1)), ("f1", "acc")) == {
        "id": "a",
        "f1": 0.5,
        "acc": 0.5,
        "gold_dropped": 1,
    }
    assert question_record(_prediction("b", 0.5), ("f1",)) == {"id": "b", "f1": 0.5}
    assert format_broken(_prediction("a", 1.0, rewriter_penalty=-0.5)) is True
    assert format_broken(_prediction("a", 1.0, rewriter_penalty=0.0)) is False
    assert format_broken(_prediction("a", 1.0)) is None  # no step records a penalty
    odd = _prediction("a", 1.0, rewriter_penalty=0.0)
    odd["trace"]["steps"][0]["penalty"] = "none"  # not a number: not a penalty
    assert format_broken(odd) is None and format_broken({"trace": {"steps": None}}) is None
    assert question_record(_prediction("c", 0.0, (1, 1), rewriter_penalty=-0.5), ("f1",)) == {
        "id": "c",
        "f1": 0.0,
        "gold_dropped": 0,
        "format_broken": True,
    }
    # with its question and gold answers: the question's form, and on a comparison the constant its answer is
    asked = {"question": "Who came first, Ann Berg or Bo Lund?", "answers": ["Ann Berg"], "prediction": "Bo Lund"}
    assert question_record({**_prediction("d", 0.0), **asked}, ("f1",)) == {
        "id": "d",
        "f1": 0.0,
        "form": "choice",
        "picked": "second",
    }
    asked = {"question": "Were both born in Oslo?", "answers": ["no"], "prediction": "Oslo"}
    assert question_record({**_prediction("e", 0.0), **asked}, ("f1",))["picked"] is None  # neither constant
    asked = {"question": "Who wrote Tosca?", "answers": ["Ada Brun"], "prediction": "Ada"}
    assert question_record({**_prediction("f", 0.5), **asked}, ("f1",)) == {"id": "f", "f1": 0.5, "form": "other"}


def _curve_result(start: list[tuple[float, int | None]], end: list[float], broken: int = 0) -> dict:
    """A row's result: its start's questions (F1, gold dropped; the first ``broken`` with a format broken) and its
    end's F1 on the same questions."""
    start_q = [
        {"id": f"q{i}", "f1": f, **({"gold_dropped": d} if d is not None else {})} for i, (f, d) in enumerate(start)
    ]
    for q in start_q[:broken]:
        q["format_broken"] = True
    return {
        "start_questions": start_q,
        "val_questions": [{"id": f"q{i}", "f1": f} for i, f in enumerate(end)],
        "val_f1": 100 * sum(end) / len(end),
        "val_curve": [
            {"step": 0, "cpu_minutes": 0.0, "f1": 100 * sum(f for f, _ in start) / len(start)},
            {"step": 50, "cpu_minutes": 60.0, "f1": 100 * sum(end) / len(end)},
        ],  # fmt: skip
    }


def test_a_curves_verdict_tells_a_gain_where_the_start_worked_from_a_repair():
    from mhgpo.experiments.curve_page import curve_verdict, row_table, seed_change

    # 20 questions the start served (gold_dropped 0), unchanged at the end; 20 it dropped a passage on, all repaired
    repair = _curve_result([(1.0, 0)] * 10 + [(0.0, 0)] * 10 + [(0.0, 1)] * 20, [1.0] * 10 + [0.0] * 10 + [1.0] * 20)
    mean, low, high, (up, down, _) = seed_change(repair)
    assert mean == 50.0 and 0 < low < 50.0 < high and (up, down) == (20, 0)  # in F1 points, not fractions
    assert seed_change(repair, [q for q in repair["start_questions"] if q["gold_dropped"] == 0])[:3] == (0.0, 0.0, 0.0)
    assert curve_verdict([repair, repair]) == ("rises on every seed; where the start worked: flat within noise")
    # a gain on the questions the start served as well: 15 of its 20 wrong answers right at the end
    learned = _curve_result([(0.0, 0)] * 20 + [(0.0, 1)] * 20, [1.0] * 15 + [0.0] * 5 + [1.0] * 20)
    assert curve_verdict([learned, repair]).endswith("where the start worked: flat within noise")
    assert curve_verdict([learned, learned]) == ("rises on every seed; where the start worked: rises on every seed")
    table = "\n".join(row_table("warm_is", {0: learned, 1: repair}))
    assert "| 0 | — | 0.0 | 87.5 (50) | +87.5 [" in table and "| 35/0 (" in table
    assert "Δ where the start worked [95% CI] (questions)" in table
    assert table.count("(20) |") == 2 and "| +75.0 [" in table and "| +0.0 [+0.0, +0.0] (20) |" in table
    # the questions on which the start broke a format are not where it worked: learned's gain there is a repair
    broke = _curve_result([(0.0, 0)] * 20 + [(0.0, 1)] * 20, [1.0] * 15 + [0.0] * 5 + [1.0] * 20, broken=15)
    assert curve_verdict([broke, broke]).endswith("where the start worked: flat within noise")
    assert "| +0.0 [+0.0, +0.0] (5) |" in "\n".join(row_table("warm_is", {0: broke}))
    # starts without the count (an earlier record, another team): the verdict and the table on all questions only
    bare = _curve_result([(0.0, None)] * 4, [1.0] * 4)
    assert curve_verdict([bare, bare]) == "rises on every seed"
    assert "where the start worked" not in "\n".join(row_table("warm_is", {0: bare}))
    # seeds a CPU budget stopped at different steps: one column per step validated on the way, their ends in one
    early, late = copy.deepcopy(bare), copy.deepcopy(bare)
    early["val_curve"] = [{"step": s, "cpu_minutes": s, "f1": f} for s, f in [(0, 0.0), (25, 40.0), (44, 60.0)]]
    late["val_curve"] = [
        {"step": s, "cpu_minutes": s, "f1": f} for s, f in [(0, 0.0), (25, 50.0), (50, 70.0), (51, 80.0)]
    ]
    lines = row_table("warm_is", {0: early, 1: late})
    assert lines[2].startswith("| seed | warm start healthy | step 0 | step 25 | step 50 | end (step) | Δ F1 end")
    assert lines[4].startswith("| 0 | — | 0.0 | 40.0 |  | 60.0 (44) | +100.0 [")
    assert lines[5].startswith("| 1 | — | 0.0 | 50.0 | 70.0 | 80.0 (51) | +100.0 [")


def _form_result() -> dict:
    """A row whose whole gain is constant answers: 10 yes/no questions (gold yes, no, ...) answered wrong at the
    start and "yes" at the end, 10 choices (gold first, second, ...) answered with neither name at the start and the
    second at the end, 20 other questions unchanged."""
    yes_no = [("yes_no", g, "no" if g == "yes" else "yes", "yes") for g in ("yes", "no") * 5]
    choice = [("choice", g, None, "second") for g in ("first", "second") * 5]
    start, end = [], []
    for i, (form, gold, before, after) in enumerate(yes_no + choice):
        start.append({"id": f"q{i}", "f1": float(before == gold), "form": form, "picked": before})
        end.append({"id": f"q{i}", "f1": float(after == gold), "form": form, "picked": after})
    start += [{"id": f"o{i}", "f1": 0.5, "form": "other"} for i in range(20)]
    end += [{"id": f"o{i}", "f1": 0.5, "form": "other"} for i in range(20)]
    result = _curve_result([(q["f1"], None) for q in start], [q["f1"] for q in end])
    result["start_questions"], result["val_questions"] = start, end
    return result


def test_a_curves_verdict_reads_the_questions_no_constant_answer_scores_apart():
    from mhgpo.experiments.curve_page import curve_verdict, form_table, other_change

    constant = _form_result()
    assert other_change(constant)[:3] == (0.0, 0.0, 0.0) and other_change(constant, worked=True) is None
    assert curve_verdict([constant, constant]) == (
        "rises on every seed; on the questions no constant answer scores: flat within noise"
    )
    lines = form_table("warm_is", {0: constant})
    assert lines[0] == "`warm_is` by question form, start → end:"
    assert lines[4] == (
        "| 0 | 0.0 → 50.0 (10) | 0.50 → 1.00 | 0.0 → 50.0 (10) | 0.00 → 1.00 | 50.0 → 50.0 (20) "
        "| +0.0 [+0.0, +0.0] | 0/0 (1) | — |"
    )
    # where the start's records count the gold passages dropped: the same on those where the start worked
    for q in constant["start_questions"]:
        q["gold_dropped"] = int(q["id"] == "o0")
    constant["val_questions"][20]["f1"] = 1.0  # o0: a repaired question, not where the start worked
    constant["val_questions"][21]["f1"] = 1.0  # o1: the start worked there
    assert curve_verdict([constant]).endswith("on those where the start worked: flat within noise")  # [+0.0, ...]
    assert form_table("warm_is", {0: constant})[4].endswith("| +2.6 [+0.0, +7.9] (19; 1/0) |")  # 50 points / 19
    # results that do not say the forms (older versions; filled in from the questions without `picked`)
    bare = _curve_result([(0.0, None)] * 4, [1.0] * 4)
    assert form_table("warm_is", {0: bare}) == [] and curve_verdict([bare]) == "rises on every seed"
    for q in constant["start_questions"] + constant["val_questions"]:
        q.pop("picked", None)
    assert "| 0.0 → 50.0 (10) | — | 0.0 → 50.0 (10) | — |" in form_table("warm_is", {0: constant})[4]


def test_a_kept_run_whose_record_or_evaluation_config_is_not_one_is_named(tmp_path):
    from mhgpo.experiments.jobs import read_saved_data

    final = run_folder(tmp_path, "warm", 0)
    final.mkdir(parents=True)
    (final / MARKER).write_text("[1, 2]")
    with pytest.raises(InputError, match=r"experiment\.json: not a record of mhgpo reproduce \(not a JSON object\)"):
        run_row(Job("row", str(TABLE.path), str(tmp_path), "warm", 0, SETTINGS))
    (final / MARKER).write_text(json.dumps({"row": "warm", "seed": "0"}))
    with pytest.raises(InputError, match=r"experiment\.json: not a record of mhgpo reproduce"):
        run_row(Job("row", str(TABLE.path), str(tmp_path), "warm", 0, SETTINGS))
    saved = tmp_path / "eval_config.yaml"
    saved.write_text("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdef", "bcdefg")
    ))  # fmt: skip
    with pytest.raises(InputError, match="eval_config.yaml"):
        read_saved_data(saved)
    saved.write_text("data: hotpotqa:x.json\n")
    assert read_saved_data(saved) == "hotpotqa:x.json"


def test_a_warm_start_folder_is_named_by_the_values_that_differ_from_the_defaults(tmp_path, monkeypatch):
    """A key added to the config at its default (as `optim.role_lr` was) names the same folder; a value changed
    names another."""
    import dataclasses

    from mhgpo.config import SFTConfig
    from mhgpo.experiments import jobs

    cfg = row_config(TABLE, job("warm_rr", folder=tmp_path), "warm_rr", "x")
    named = warm_start_folder(cfg, tmp_path)
    original = jobs._warm_start_config

    @dataclasses.dataclass
    class Grown(SFTConfig):  # the warm start's config with one key more, at its default
        new_key: int = 7

    with monkeypatch.context() as m:
        m.setattr(jobs, "_warm_start_config", lambda c, out: Grown(**dataclasses.asdict(original(c, out))))
        m.setattr("mhgpo.config.SFTConfig", Grown)
        assert warm_start_folder(cfg, tmp_path) == named
    other = row_config(TABLE, job("warm_rr", folder=tmp_path, overrides=["warm_start.steps=72"]), "warm_rr", "x")
    assert warm_start_folder(other, tmp_path) != named
    for same in ("optim.gradient_checkpointing=true", "optim.gradient_checkpointing=false"):  # weights bit-identical
        again = row_config(TABLE, job("warm_rr", folder=tmp_path, overrides=[same]), "warm_rr", "x")
        assert warm_start_folder(again, tmp_path) == named
