"""Numbers from results: mean ± std over seeds, per-question training figures, paired differences and the verdict.

Verdict rule (`verdict`): per seed, d = row − compared row; with n ≥ 2 seeds, the difference is *within noise* when
|mean d| ≤ std d (sample std) or ≤ what one validation question can move the metric (100 / questions validated),
otherwise its sign is our direction; `>` / `<` agree with that sign, `≥` / `≤` also with within noise, `≈` only with
within noise; one seed gives no noise estimate (`n/a`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mhgpo.experiments.claims import AGREES, Claim

Results = dict[str, dict[int, dict]]  # {row: {seed: result}} of one data folder


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof 1; None for one value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def fmt(values: list[float], digits: int = 1) -> str:
    """`mean ± std` (sample std) of `values`; the mean alone for one value; — for none. NaN and infinite values are
    left out, and counted: `(1 not finite)`."""
    finite = [v for v in values if math.isfinite(v)]
    left = f" ({len(values) - len(finite)} not finite)" if len(finite) < len(values) else ""
    if not finite:
        return "—" + left
    m, s = mean_std(finite)
    return (f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}") + left


def per_question(result: dict, key: str) -> float | None:
    """A training metric summed over the row's steps per question drawn (None for a row without steps or one run
    before the metric was logged)."""
    steps = result.get("steps_metrics") or []
    if not any(key in m for m in steps):
        return None
    questions = sum(m.get("filter/questions", result["questions_per_step"]) for m in steps)
    return sum(m.get(key, 0.0) for m in steps) / questions


def seconds_per_step(result: dict) -> float | None:
    """Mean rollout + update seconds of the row's steps (model loading and validation left out)."""
    steps = result.get("steps_metrics") or []
    if not steps:
        return None
    return float(np.mean([m.get("seconds/rollout", 0.0) + m.get("seconds/train", 0.0) for m in steps]))


def metric(result: dict, key: str) -> float | None:
    """A result's value of a claim's metric: a stored key, or `llm_calls` per training question."""
    return per_question(result, "llm_calls") if key == "llm_calls" else result.get(key)


def paired(
    by_row: Results, row: str, than: str, key: str | Callable[[dict], float | None] = "val_f1", finite: bool = True
) -> list[float]:
    """row − than on `key` (a claim's metric, or a function of a result), per seed that both have (same seed: same
    warm start and data order); a NaN or infinite difference left out unless not `finite`."""
    of = key if callable(key) else (lambda result: metric(result, key))
    a, b = by_row.get(row, {}), by_row.get(than, {})
    diffs = [(of(a[s]), of(b[s])) for s in sorted(set(a) & set(b))]
    found = [x - y for x, y in diffs if x is not None and y is not None]
    return [d for d in found if math.isfinite(d)] if finite else found


def resolution(by_row: Results, claim: Claim) -> float:
    """The most one validation question moves a claim's validation metric (F1, Acc: 100 / questions validated, on
    the fewest any of its two rows validated); 0 for a cost metric."""
    if claim.metric == "llm_calls":
        return 0.0
    ns = [r["val_n"] for row in (claim.row, claim.than) for r in by_row.get(row, {}).values() if r.get("val_n")]
    return 100.0 / min(ns) if ns else 0.0


def verdict(direction: str, diffs: list[float], resolution: float = 0.0) -> str:
    """agrees / disagrees / within noise (|mean| ≤ the larger of the paired differences' std and `resolution`, the
    most one validation question can move the metric) / n/a (fewer than 2 seeds)."""
    diffs = [d for d in diffs if math.isfinite(d)]
    if len(diffs) < 2:
        return "n/a (1 seed)" if diffs else "not run"
    m, s = mean_std(diffs)
    ours = "≈" if abs(m) <= max(s, resolution) + 1e-9 else (">" if m > 0 else "<")  # F1s are sums of floats
    if ours in AGREES[direction]:
        return "agrees"
    return "within noise" if ours == "≈" else "disagrees"


def ood_f1(result: dict, names: list[str]) -> float | None:
    """The mean F1 over the other (out-of-domain) data sets `names` the run was evaluated on, as the paper's OOD
    average (None unless the result has all of them)."""
    ood = result.get("ood") or {}
    if not names or any(name not in ood for name in names):
        return None
    return float(np.mean([ood[name]["f1"] for name in names]))
