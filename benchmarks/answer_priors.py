"""Whether a validation's gain is reasoning or a constant answer: F1 by question form, and how often the team
gives the one answer a form allows without reading.

A comparison question has an answer a team can give without its passages: "yes" or "no" to a yes/no question, the
first or the second of the two names of a "..., A or B?" question. Each is right on about half of them (the
synthetic world balances both; HotpotQA's comparisons are near it), so a policy that answers "yes" to every yes/no
question, or the second name to every choice, scores about 50 F1 there with no information. RL from F1 finds that
where the team's answers were worse than a constant. This reads prediction files (`mhgpo eval --output-dir DIR`'s
`DIR/predictions.jsonl`, or a run's own `RUN/validation/step_NNNNNN.jsonl`) and prints, per file, on the questions
all of them share:

- F1 by form (`mhgpo.data.forms.question_form`, as validations report it): `yes_no` (gold answer yes or no),
  `choice` (two options around the question's last " or ", the gold one of them), `other` (the rest: bridge
  questions);
- on yes/no questions the share of answers "yes"; on choice questions the shares naming the first and the second;
- the Reranker's most common selection and its share, and the gold passages it passed on per question (from the
  predictions' traces, where they count them).

    python benchmarks/answer_priors.py START/predictions.jsonl END/predictions.jsonl

docs/learning.md ("Learning curves at length") has its figures for MHGPO-RR seeds 0 and 1.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mhgpo.data.forms import picked, question_form  # noqa: E402


def reranker_info(prediction: dict) -> dict:
    steps = (prediction.get("trace") or {}).get("steps") or []
    return next((s.get("info") or {} for s in steps if s.get("agent") == "reranker"), {})


def summary(rows: dict[str, dict], ids: list[str]) -> dict:
    f1: dict[str, list[float]] = defaultdict(list)
    said = Counter()
    selections, gold_shown, traced = Counter(), 0, 0
    for i in ids:
        p = rows[i]
        kind = question_form(p["question"], p["answers"])
        f1[kind].append(float(p["f1"]))
        said[picked(p["question"], p["answers"], p.get("prediction") or "")] += 1
        info = reranker_info(p)
        if "selected" in info:
            selections[tuple(info["selected"])] += 1
        if "gold_selected" in info:
            gold_shown += info["gold_selected"]
            traced += 1
    n = {k: len(v) for k, v in f1.items()}
    out = {
        "questions": len(ids),
        "f1": 100 * sum(sum(v) for v in f1.values()) / max(len(ids), 1),
        "f1_by_form": {k: (n[k], 100 * sum(v) / n[k]) for k, v in sorted(f1.items())},
        "yes_share": said["yes"] / n["yes_no"] if n.get("yes_no") else None,
        "first_share": said["first"] / n["choice"] if n.get("choice") else None,
        "second_share": said["second"] / n["choice"] if n.get("choice") else None,
    }
    if selections:
        top, count = selections.most_common(1)[0]
        out["reranker_top_selection"] = (list(top), count / sum(selections.values()))
    if traced:
        out["gold_shown_per_question"] = gold_shown / traced
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("predictions", nargs="+", help="prediction files (JSON Lines), e.g. a start's and an end's")
    args = ap.parse_args(argv)
    from mhgpo.io import read_jsonl

    files = {}
    for path in args.predictions:
        rows, _ = read_jsonl(Path(path))
        files[path] = {r["id"]: r for r in rows}
    ids = [i for i in files[args.predictions[0]] if all(i in f for f in files.values())]
    for path, rows in files.items():
        s = summary(rows, ids)
        print(path)
        print(f"  {s['questions']} questions, F1 {s['f1']:.1f}")
        for kind, (n, f) in s["f1_by_form"].items():
            print(f"  {kind:7s} {n:4d} questions  F1 {f:5.1f}")
        if s["yes_share"] is not None:
            print(f"  yes/no answered 'yes': {s['yes_share']:.2f}")
        if s["first_share"] is not None:
            print(f"  choice answered with the first name {s['first_share']:.2f}, the second {s['second_share']:.2f}")
        if "reranker_top_selection" in s:
            top, share = s["reranker_top_selection"]
            print(f"  Reranker's most common selection {top}: {share:.2f} of its calls")
        if "gold_shown_per_question" in s:
            print(f"  gold passages shown to the Answerer per question {s['gold_shown_per_question']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
