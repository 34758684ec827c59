"""F1 by question form: whether a team reads comparison questions or gives the answer their form allows.

A comparison question has answers a team can give without reading its passages: "yes" or "no" to a yes/no
question, the first or the second of the two names of an "..., A or B?" question. Each is right on about half of
them (the synthetic world balances both; HotpotQA's and 2WikiMultihopQA's comparisons are near it), so a team that
answers "yes" to every yes/no question, or the second name to every choice, scores about 50 F1 there with no
information, and RL from F1 finds that constant where the team's comparison answers were worse than a coin. F1 over
all questions cannot tell it from learning; F1 by form, beside the share of each constant answer, can.

The forms (:func:`question_form`, from the question and its gold answers alone, so any data set has them):

- ``yes_no``: a gold answer is "yes" or "no";
- ``choice``: the question names two options around its last " or " and the gold answer is one of them (most of
  its words on one side of that " or ": "Who was born first, A or B?" -> A or B, "Which band, A or B, had ...");
- ``other``: the rest (bridge questions, the reasoning proper).

:func:`picked` says which constant an answer is (``yes`` / ``no``; ``first`` / ``second``), :func:`form_metrics`
the figures an evaluation reports (`form/<form>/n`, `form/<form>/f1`, `form/yes_no/yes_share`,
`form/choice/second_share`; and `type/<type>/n`, `type/<type>/f1` by the data set's own question type where the
records carry one: HotpotQA's bridge / comparison, 2WikiMultihopQA's four, MuSiQue's hop counts).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from mhgpo.data.metrics import normalize_answer

FORMS = ("yes_no", "choice", "other")
PREFIXES = ("form/", "type/")  # metric keys of this module (not an agent's behaviour)


def _options(question: str) -> tuple[list[str], list[str]] | None:
    """The words before and after a question's last " or " (normalised), or None when it has none."""
    text = question.strip().rstrip("?").strip()
    at = text.lower().rfind(" or ")
    if at < 0:
        return None
    return normalize_answer(text[:at]).split(), normalize_answer(text[at + 4 :]).split()


def side(text: str, question: str) -> str | None:
    """``first`` or ``second``: the side of the question's last " or " that holds most of `text`'s words (at least
    half of them, and more than the other side); None when neither does or the question has no " or "."""
    options = _options(question)
    words = normalize_answer(text).split()
    if options is None or not words:
        return None
    before, after = (set(o) for o in options)
    hits = sum(w in before for w in words), sum(w in after for w in words)
    if hits[0] == hits[1] or 2 * max(hits) < len(words):
        return None
    return "first" if hits[0] > hits[1] else "second"


def _yes_no(text: str) -> str | None:
    norm = normalize_answer(text)
    return norm if norm in ("yes", "no") else None


def question_form(question: str, answers: Sequence[str]) -> str:
    """``yes_no``, ``choice`` or ``other`` (the module's docstring); the first gold answer decides."""
    if isinstance(answers, str):
        answers = (answers,)
    gold = answers[0] if answers else ""
    if _yes_no(gold):
        return "yes_no"
    return "choice" if side(gold, question) else "other"


def picked(question: str, answers: Sequence[str], prediction: str) -> str | None:
    """The constant an answer is: ``yes`` / ``no`` on a yes/no question, ``first`` / ``second`` on a choice (the
    option it names); None on other questions or when it is neither."""
    form = question_form(question, answers)
    if form == "yes_no":
        return _yes_no(prediction)
    if form == "choice":
        return side(prediction, question)
    return None


def form_metrics(predictions: Iterable[dict[str, Any]]) -> dict[str, float]:
    """From prediction records (`question`, `answers`, `prediction`, `f1`; `type` where the data has one): for each
    form present `form/<form>/n` and `form/<form>/f1` (percent), `form/yes_no/yes_share` (answers "yes", of the
    yes/no questions) and `form/choice/second_share` (answers naming the second option, of the choices); and by the
    records' `type`, where at least one has one, `type/<type>/n` and `type/<type>/f1`."""
    f1: dict[str, list[float]] = defaultdict(list)
    by_type: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    for p in predictions:
        form = question_form(p["question"], p["answers"])
        f1[form].append(float(p["f1"]))
        said = picked(p["question"], p["answers"], p.get("prediction") or "")
        if said:
            counts[said] += 1
        if p.get("type"):
            by_type[str(p["type"])].append(float(p["f1"]))
    out: dict[str, float] = {}
    for form in FORMS:
        if f1[form]:
            out[f"form/{form}/n"] = len(f1[form])
            out[f"form/{form}/f1"] = 100 * sum(f1[form]) / len(f1[form])
    if f1["yes_no"]:
        out["form/yes_no/yes_share"] = counts["yes"] / len(f1["yes_no"])
    if f1["choice"]:
        out["form/choice/second_share"] = counts["second"] / len(f1["choice"])
    for name, values in sorted(by_type.items()):
        out[f"type/{name}/n"] = len(values)
        out[f"type/{name}/f1"] = 100 * sum(values) / len(values)
    return out


def is_form_metric(key: str) -> bool:
    """Whether a metric key is one of :func:`form_metrics`'s (kept apart from the agents' behaviour)."""
    return key.startswith(PREFIXES)


def form_line(metrics: dict[str, Any]) -> str:
    """One line of an evaluation's F1 by form, e.g. ``yes/no 40 q F1 50.0 ('yes' 1.00) · choice 35 q F1 61.9
    (second 0.97) · other 125 q F1 67.5``; empty when the metrics have none."""
    parts = []
    for form, label, share, word in (
        ("yes_no", "yes/no", "yes_share", "'yes'"),
        ("choice", "choice", "second_share", "second"),
        ("other", "other", None, None),
    ):
        if f"form/{form}/n" not in metrics:
            continue
        part = f"{label} {int(metrics[f'form/{form}/n'])} q F1 {metrics[f'form/{form}/f1']:.1f}"
        if share and f"form/{form}/{share}" in metrics:
            part += f" ({word} {metrics[f'form/{form}/{share}']:.2f})"
        parts.append(part)
    return " · ".join(parts)
