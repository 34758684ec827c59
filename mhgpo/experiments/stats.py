"""Numbers from results: mean ± std over seeds, per-question training figures, paired differences and the verdict.

Verdict rule (`verdict`): per seed, d = row − compared row; with n ≥ 2 seeds, the difference is *within noise* when
|mean d| ≤ std d (sample std) or ≤ what one validation question can move the metric (100 / questions validated), or
when the 95% bootstrap interval of the per-(seed, question) differences holds 0 (results that kept their questions'
scores), otherwise its sign is our direction; `>` / `<` agree with that sign, `≥` / `≤` also with within noise, `≈` only with
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


def verdict(direction: str, diffs: list[float], resolution: float = 0.0, questions: list[float] | None = None) -> str:
    """agrees / disagrees / within noise (|mean| ≤ the larger of the paired differences' std and `resolution`, the
    most one validation question can move the metric; or, given the per-(seed, question) differences `questions`,
    their 95% bootstrap interval holding 0) / n/a (fewer than 2 seeds). Non-finite differences are left out."""
    diffs = [d for d in diffs if math.isfinite(d)]
    questions = [q for q in questions or [] if math.isfinite(q)]
    if len(diffs) < 2:
        return "n/a (1 seed)" if diffs else "not run"
    m, s = mean_std(diffs)
    ours = "≈" if abs(m) <= max(s, resolution) + 1e-9 else (">" if m > 0 else "<")  # F1s are sums of floats
    if ours != "≈" and questions:
        _, low, high = paired_bootstrap(questions)
        ours = ours if (low > 0 if ours == ">" else high < 0) else "≈"
    if ours in AGREES[direction]:
        return "agrees"
    return "within noise" if ours == "≈" else "disagrees"


def question_diffs(by_row: Results, row: str, than: str, key: str = "f1") -> list[float]:
    """row − than per validation question, over the seeds both ran (same seed: same warm start, data order and
    questions), for the results that kept their questions' scores."""
    a, b = by_row.get(row, {}), by_row.get(than, {})
    out: list[float] = []
    for seed in sorted(set(a) & set(b)):
        if a[seed].get("val_questions") and b[seed].get("val_questions"):
            out += paired_questions(a[seed]["val_questions"], b[seed]["val_questions"], key)
    return out


def ood_f1(result: dict, names: list[str]) -> float | None:
    """The mean F1 over the other (out-of-domain) data sets `names` the run was evaluated on, as the paper's OOD
    average (None unless the result has all of them)."""
    ood = result.get("ood") or {}
    if not names or any(name not in ood for name in names):
        return None
    return float(np.mean([ood[name]["f1"] for name in names]))


def paired_questions(after: list[dict], before: list[dict], key: str = "f1") -> list[float]:
    """after − before on `key` per question both validated (matched by question id), in `after`'s order."""
    earlier = {q["id"]: q[key] for q in before}
    return [float(q[key]) - float(earlier[q["id"]]) for q in after if q["id"] in earlier]


def paired_bootstrap(diffs: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The mean of per-question paired differences and its 95% percentile-bootstrap interval (questions resampled
    with replacement `draws` times, seeded): (mean, low, high)."""
    d = np.asarray(diffs, dtype=np.float64)  # (Q,)
    if d.size == 0:
        raise ValueError("no paired questions")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(draws, d.size))].mean(axis=1)  # (draws,)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(d.mean()), float(low), float(high)


def sign_test(diffs: list[float]) -> tuple[int, int, float]:
    """Questions better and worse (ties left out) and the two-sided sign test's p-value (exact binomial, p = 1/2)."""
    from math import comb

    up, down = sum(x > 1e-9 for x in diffs), sum(x < -1e-9 for x in diffs)
    n, k = up + down, min(up, down)
    if n == 0:
        return 0, 0, 1.0
    p = sum(comb(n, i) for i in range(k + 1)) / 2**n
    return up, down, min(1.0, 2 * p)
