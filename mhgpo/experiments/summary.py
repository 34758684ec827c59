"""The README's one results table, from the results kept with the project: the HotpotQA part's warm start and the RL
rows a reader starts from (each row's validation F1 and out-of-domain average over seeds, and its change over the warm
start paired by seed), so that the README shows the figures of docs/reproduction.md without retyping them
(`tests/experiments/test_summary.py` holds the README's table equal to this one).
"""

from __future__ import annotations

from pathlib import Path

from mhgpo.experiments.claims import Claim
from mhgpo.experiments.results import collect, data_folders, data_specs
from mhgpo.experiments.stats import Results, fmt, ood_f1, paired, resolution, verdict

# (row, how the README names it); every row of one data folder, each from its seed's warm start
ROWS = (
    ("untrained", "untrained"),
    ("warm", "warm start (36 steps on gold traces)"),
    ("warm_is", "+ MHGPO-IS, 10 CPU minutes (the recipe)"),
    ("warm_rr", "+ MHGPO-RR, 10 CPU minutes"),
    ("warm_mappo", "+ MAPPO, 10 CPU minutes"),
    ("warm_rr_reranker_30min", "+ MHGPO-RR on the Reranker alone, 30 CPU minutes"),
)
REFERENCE = "warm"
DATA = "hotpotqa"  # the data set of the folder the table is made from


def summary_folder(out: Path, data: str = DATA) -> Path:
    """The data folder of OUT whose results trained on `data` (its --data SPEC's kind)."""
    for folder in data_folders(out):
        by_row = collect(folder)
        settings = next((r["settings"] for seeds in by_row.values() for r in seeds.values()), None)
        if settings and data_specs(settings["overrides"]).get("data", "").startswith(f"{data}:"):
            return folder
    raise FileNotFoundError(f"no results trained on {data} in {out}")


def summary_table(by_row: Results) -> str:
    """The table: per row its seeds, F1 and out-of-domain average F1 (mean ± std), and both against the warm start
    (paired by seed, mean ± std): above or below it, or within noise by the page's rule."""
    evals = sorted({name for seeds in by_row.values() for r in seeds.values() for name in r.get("ood") or {}})

    def ood(r: dict) -> float | None:
        return ood_f1(r, evals)

    lines = [
        f"| team | seeds | F1 | Δ F1 vs warm start | OOD avg F1 ({', '.join(evals)}) | Δ OOD F1 vs warm start |",
        "|---|---|---|---|---|---|",
    ]
    for row, name in ROWS:
        rs = list(by_row.get(row, {}).values())
        f1, out = [r["val_f1"] for r in rs], [v for v in map(ood, rs) if v is not None]
        cells = [name, str(len(rs)), fmt(f1)]
        for key in ("val_f1", ood):
            diffs = paired(by_row, row, REFERENCE, key)
            cells += ["—"] if row == REFERENCE else [f"{fmt(diffs)} ({_word(by_row, row, diffs)})"]
            if key == "val_f1":
                cells.append(fmt(out))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _word(by_row: Results, row: str, diffs: list[float]) -> str:
    """above / below / within noise: the page's verdict of `row > warm start` in words."""
    said = verdict(">", diffs, resolution(by_row, Claim(row, ">", REFERENCE, "")))
    return {"agrees": "above", "disagrees": "below"}.get(said, said)


def readme_table(out: Path) -> str:
    """The README's table from OUT (`experiments/results`)."""
    return summary_table(collect(summary_folder(out)))
