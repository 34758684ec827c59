"""The learning curves' part of the page: for each data set whose rows kept a curve (`mhgpo reproduce --val-every`),
a plot of validation F1 against step and against CPU minutes (each row's mean over seeds, each seed thin, the warm
start's band across seeds), and per row a table of its seeds: the warm start (healthy or not), F1 at each validated
step, the paired change over its start question by question (mean, 95% bootstrap interval, sign test), and its CPU
hours; then the verdict per row.

Verdict (`curve_verdict`): a row *rises* when on every seed its end is above its start by more than the questions'
noise (the paired bootstrap interval above 0), *falls* when below it on every seed, else *flat within noise*; the same
again on the questions on which each start's team already worked (no agent broke its format, and every gold passage
the Reranker was shown it passed on: `format_broken` false and `gold_dropped` 0 in its per-question records), which
says what RL added to a working team there, the rest of a gain being a repair of broken formats or dropped passages;
and again on the questions no constant answer scores (neither yes/no nor "..., A or B?": `mhgpo.data.forms`), where
the records say the forms: a team that answers "yes" to every yes/no question and the second name to every choice
gains there without reading, so only these questions' change is reasoning learned; a row on a broken warm start
(`mhgpo.experiments.curves.healthy`) is named as a repair, not as learning. Per row, a second table gives F1 by
question form from start to end, with the share of each constant answer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhgpo.experiments.stats import Results, fmt, paired_bootstrap, paired_questions, sign_test


def curve_rows(by_row: Results) -> dict[str, dict[int, dict]]:
    """The rows whose results kept a curve (and their start's questions)."""
    return {
        row: found
        for row, seeds in by_row.items()
        if (found := {s: r for s, r in seeds.items() if r.get("val_curve") and r.get("start_questions")})
    }


def served(result: dict) -> list[dict] | None:
    """The start's questions on which its team already worked: every gold passage it was shown, it passed on
    (`gold_dropped` 0, :func:`mhgpo.experiments.curves.gold_dropped`), and no agent broke its format
    (`format_broken`, where recorded); None where the start's records do not count the gold passages."""
    start = result["start_questions"]
    if not start or any("gold_dropped" not in q for q in start):
        return None
    return [q for q in start if q["gold_dropped"] == 0 and not q.get("format_broken", False)]


def seed_change(result: dict, where: list[dict] | None = None) -> tuple[float, float, float, tuple[int, int, float]]:
    """A result's end against its start, question by question (on the start's questions ``where`` when given):
    (mean Δ F1 in points, low, high, (better, worse, p)); a question's F1 is kept as a fraction."""
    start = result["start_questions"] if where is None else where
    diffs = [100 * d for d in paired_questions(result["val_questions"], start)]
    return (*paired_bootstrap(diffs), sign_test(diffs))


def _word(changes: list[tuple[float, float, float, tuple[int, int, float]]]) -> str:
    if all(low > 0 for _, low, _, _ in changes):
        return "rises on every seed"
    if all(high < 0 for _, _, high, _ in changes):
        return "falls on every seed"
    return "flat within noise"


def curve_verdict(results: list[dict]) -> str:
    """rises / falls / flat within noise over the seeds (see the module's docstring), on all the questions and, where
    the starts count the gold passages their team dropped, on the questions on which each start worked (what RL
    added to a team that worked there; the rest of a gain is a repair), and, where the records say the forms, on the
    questions no constant answer scores; `repair` where a start was broken."""
    word = _word([seed_change(r) for r in results])
    subsets = [served(r) for r in results]
    if all(subsets):
        word += "; where the start worked: " + _word([seed_change(r, where) for r, where in zip(results, subsets)])
    others = [other_change(r) for r in results]
    if all(c is not None for c in others):
        word += "; on the questions no constant answer scores: " + _word(others)
        worked = [other_change(r, worked=True) for r in results]
        if all(c is not None for c in worked):
            word += ", on those where the start worked: " + _word(worked)
    broken = any((r.get("start") or {}).get("healthy") is False for r in results)
    return word + (" (from a broken warm start: a repair)" if broken else "")


def by_form(questions: list[dict], form: str) -> list[dict]:
    """The per-question records of one question form (`form`: `mhgpo.data.forms.question_form`)."""
    return [q for q in questions if q.get("form") == form]


def has_forms(result: dict) -> bool:
    """Whether a result's start and end records say each question's form (results of older versions do not)."""
    return all("form" in q for q in result["start_questions"]) and all("form" in q for q in result["val_questions"])


def other_change(result: dict, worked: bool = False) -> tuple[float, float, float, tuple[int, int, float]] | None:
    """:func:`seed_change` on the questions of form `other` (neither yes/no nor "A or B?": where no constant answer
    scores), with `worked` only those of them on which the start worked (:func:`served`); None where the result
    does not say the forms (or, with `worked`, the gold passages dropped) or has no such question."""
    if not has_forms(result):
        return None
    start = served(result) if worked else result["start_questions"]
    where = by_form(start, "other") if start is not None else []
    return seed_change(result, where) if where else None


def _share(questions: list[dict], word: str) -> str:
    """The share of `questions` whose answer is the constant `word` ("—" where the records do not say it: results
    filled in from the questions alone)."""
    if any("picked" not in q for q in questions):
        return "—"
    return f"{sum(q['picked'] == word for q in questions) / len(questions):.2f}"


def _mean_f1(questions: list[dict]) -> str:
    return f"{100 * sum(float(q['f1']) for q in questions) / len(questions):.1f}"


def form_table(row: str, found: dict[int, dict]) -> list[str]:
    """One row's per-seed F1 by question form, start → end: on yes/no questions with the share answered "yes", on
    "A or B?" questions with the share answered B (a constant scores ~50 on both), on the rest (where no constant
    scores) with the paired change; empty when no seed's result says the forms."""
    seeds = {seed: r for seed, r in sorted(found.items()) if has_forms(r)}
    if not seeds:
        return []
    head = ["seed", "yes/no F1", "answered 'yes'", "A or B? F1", "answered B", "other F1", "Δ other [95% CI]"]
    head += ["+/− (p)", "Δ other where the start worked [95% CI] (questions)"]
    lines = [f"`{row}` by question form, start → end:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seed, r in seeds.items():
        start, end = r["start_questions"], r["val_questions"]
        cells = [str(seed)]
        for form, word in (("yes_no", "yes"), ("choice", "second")):
            a, b = by_form(start, form), by_form(end, form)
            if a and b:
                shares = _share(a, word), _share(b, word)
                cells += [f"{_mean_f1(a)} → {_mean_f1(b)} ({len(a)})", "—" if "—" in shares else " → ".join(shares)]
            else:
                cells += ["—", "—"]
        a, b = by_form(start, "other"), by_form(end, "other")
        change = other_change(r)
        if a and b and change is not None:
            mean, low, high, (up, down, p) = change
            cells += [f"{_mean_f1(a)} → {_mean_f1(b)} ({len(a)})", f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]"]
            cells.append(f"{up}/{down} ({p:.2g})")
        else:
            cells += ["—", "—", "—"]
        worked = other_change(r, worked=True)
        if worked is not None:
            mean, low, high, (up, down, _) = worked
            where = by_form(served(r) or [], "other")
            cells.append(f"{mean:+.1f} [{low:+.1f}, {high:+.1f}] ({len(where)}; {up}/{down})")
        else:
            cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _step_columns(found: dict[int, dict]) -> list[int]:
    """The steps validated on the way (every point but each seed's last): seeds stopped by a CPU budget end at
    different steps, so their ends share one column instead of one column each."""
    return sorted({p["step"] for r in found.values() for p in r["val_curve"][:-1]})


def row_table(row: str, found: dict[int, dict]) -> list[str]:
    """One row's per-seed table: start, F1 at each validated step, the paired change, CPU hours."""
    steps = _step_columns(found)
    head = ["seed", "warm start healthy", *(f"step {s}" for s in steps)]
    head += ["end (step)", "Δ F1 end − start [95% CI]", "+/− (p)"]
    kept = {seed: served(r) for seed, r in found.items()}
    if any(kept.values()):
        head.append("Δ where the start worked [95% CI] (questions)")
    lines = [f"`{row}`: {curve_verdict(list(found.values()))}", "", "| " + " | ".join([*head, "CPU h"]) + " |"]
    lines.append("|" + "---|" * (len(head) + 1))
    for seed, r in sorted(found.items()):
        at = {p["step"]: p for p in r["val_curve"][:-1]}
        end = r["val_curve"][-1]
        mean, low, high, (up, down, p) = seed_change(r)
        health = {True: "yes", False: "no", None: "—"}[(r.get("start") or {}).get("healthy")]
        cells = [str(seed), health, *(_cell(at[s]) if s in at else "" for s in steps), f"{_cell(end)} ({end['step']})"]
        cells += [f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]", f"{up}/{down} ({p:.2g})"]
        if any(kept.values()):
            where = kept[seed]
            if where:
                m, lo, hi, _ = seed_change(r, where)
                cells.append(f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}] ({len(where)})")
            else:
                cells.append("—")
        cells.append(f"{r['val_curve'][-1]['cpu_minutes'] / 60:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    ends = [r["val_f1"] - r["val_curve"][0]["f1"] for r in found.values()]
    lines += ["", f"Mean over seeds of end − start: {fmt(ends)} F1.", ""]
    return lines


def _cell(point: dict) -> str:
    """A point's F1, and its paired change over the start with the interval where the run kept its questions."""
    if "paired" not in point:
        return f"{point['f1']:.1f}"
    mean, low, high = point["paired"]
    return f"{point['f1']:.1f} ({mean:+.1f} [{low:+.1f}, {high:+.1f}])"


def plot_curves(found_by_row: dict[str, dict[int, dict]], path: Path, title: str) -> Path:
    """Validation F1 against step and against CPU minutes: per row its seeds (thin) and their mean (thick, at the
    steps every seed validated), the warm start's band (min to max of step 0 over seeds) across both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    starts = [r["val_curve"][0]["f1"] for found in found_by_row.values() for r in found.values()]
    for ax in axes:
        ax.axhspan(min(starts), max(starts), color="0.85", label="warm start (seeds' range)")
    for row, found in found_by_row.items():
        color = None
        for r in found.values():
            xs = [p["step"] for p in r["val_curve"]]
            line = axes[0].plot(xs, [p["f1"] for p in r["val_curve"]], lw=0.8, alpha=0.5, color=color)[0]
            color = line.get_color()
            axes[1].plot([p["cpu_minutes"] for p in r["val_curve"]], [p["f1"] for p in r["val_curve"]], lw=0.8,
                         alpha=0.5, color=color)  # fmt: skip
        common = sorted(set.intersection(*({p["step"] for p in r["val_curve"]} for r in found.values())))
        mean = [float(np.mean([next(p["f1"] for p in r["val_curve"] if p["step"] == s) for r in found.values()]))
                for s in common]  # fmt: skip
        axes[0].plot(common, mean, lw=2.2, color=color, marker="o", label=f"{row} ({len(found)} seeds)")
    fig.suptitle(title)  # (the data set's, whole: too long for a panel's title)
    axes[0].set(title="validation F1 by step", xlabel="RL step", ylabel="F1 (%)")
    axes[1].set(title="by CPU minutes of training", xlabel="CPU minutes (rollouts and updates)", ylabel="F1 (%)")
    axes[0].legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def curves_markdown(by_data: list[tuple[str, str, Results]], images: Path | None, doc_dir: Path | None) -> str:
    """The page's curves part: per data set (`(folder name, title, results)`) with curves, the plot (written into
    `images` when given, linked relative to `doc_dir`) and each row's table; empty when no result kept a curve."""
    parts = []
    for name, title, by_row in by_data:
        found = curve_rows(by_row)
        if not found:
            continue
        parts += [f"### {title}", ""]
        if images is not None:
            png = plot_curves(found, Path(images) / f"curves-{name}.png", title)
            link = png.relative_to(doc_dir) if doc_dir is not None and png.is_relative_to(doc_dir) else png
            parts += [f"![validation F1 by step and by CPU minutes]({Path(link).as_posix()})", ""]
        for row, seeds in found.items():
            parts += row_table(row, seeds)
            parts += form_table(row, seeds)
    if not parts:
        return ""
    intro = (
        "## Learning curves\n\nEach row validated every few steps on its own checkpoints (`--val-every`), from the "
        "warm start it starts from (step 0), on the same questions; Δ is the end against the start, paired by "
        "question (95% bootstrap interval, sign test's better/worse and p); in brackets beside a step's F1, its "
        "own paired change over the start and interval, where the run kept that validation's questions; the last "
        "column, where the starts count the gold passages their team dropped, is the same change on the questions "
        "on which the start worked (no agent broke its format, every gold passage shown passed on): what RL added "
        "where the team already worked, the rest of a gain being a repair of broken formats or dropped passages. "
        "The second table of a row, where its records say each question's form, gives F1 by form from start to end: "
        'on yes/no questions and on "..., A or B?" choices (where a constant answer, "yes" or option B, scores '
        "about 50 without reading; with the share of answers that are that constant, where the records say it) and "
        "on the other questions, whose paired change, alone and where the start worked, no constant can make.\n"
    )
    return intro + "\n" + "\n".join(parts)
