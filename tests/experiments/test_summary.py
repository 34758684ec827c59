"""The README's results table is the one the results kept with the project give (`mhgpo.experiments.summary`): a
figure in it cannot go stale, and its cells are the page's statistics of the same results."""

from __future__ import annotations

from pathlib import Path

from mhgpo.experiments.summary import ROWS, readme_table, summary_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_results_table_is_what_the_kept_results_give():
    expected = readme_table(ROOT / "experiments" / "results")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert expected in readme, (
        "README.md's results table is not what experiments/results gives; put this table in its place:\n" + expected
    )


def _results(f1: dict[str, list[float]], wiki: dict[str, list[float]]) -> dict:
    settings = {"minutes": 10.0, "clock": "cpu", "val_limit": 100, "overrides": ["data=hotpotqa:t.jsonl"]}
    return {
        row: {
            seed: {
                "row": row,
                "seed": seed,
                "val_f1": v,
                "val_n": 100,
                "settings": settings,
                "ood": {n: {"f1": wiki[row][seed] + k} for k, n in enumerate(("2wiki", "musique"))},
            }
            for seed, v in enumerate(values)
        }
        for row, values in f1.items()
    }


def test_each_cell_from_the_results_by_hand():
    rows = [r for r, _ in ROWS]
    f1 = {r: [20.0, 22.0, 24.0] for r in rows} | {"warm_is": [25.0, 27.0, 29.0], "warm_rr": [20.5, 21.0, 25.5]}
    wiki = {r: [10.0, 10.0, 10.0] for r in rows} | {"warm_is": [10.0, 12.0, 14.0]}
    lines = summary_table(_results(f1, wiki)).split("\n")
    assert lines[0] == (
        "| team | seeds | F1 | Δ F1 vs warm start | OOD avg F1 (2wiki, musique) | Δ OOD F1 vs warm start |"
    )
    by_name = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    names = dict(ROWS)
    # F1 22 ± 2; OOD: 2wiki 10, MuSiQue 11, their mean 10.5
    assert by_name[names["warm"]].endswith("| 3 | 22.0 ± 2.0 | — | 10.5 ± 0.0 | — |")
    # IS − warm: 5, 5, 5 → 5 ± 0, above; OOD 10.5, 12.5, 14.5 − 10.5 → 2 ± 2: |2| ≤ 2, within noise
    assert by_name[names["warm_is"]].endswith(
        "| 3 | 27.0 ± 2.0 | 5.0 ± 0.0 (above) | 12.5 ± 2.0 | 2.0 ± 2.0 (within noise) |"
    )
    # RR − warm: 0.5, −1, 1.5 → 0.33 ± 1.26: within noise
    assert "| 0.3 ± 1.3 (within noise) |" in by_name[names["warm_rr"]]
