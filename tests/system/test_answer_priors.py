"""benchmarks/answer_priors.py: the constant answers it counts, and its figures from prediction files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "answer_priors.py"


def _script():
    spec = importlib.util.spec_from_file_location("answer_priors", SCRIPT)
    module = sys.modules["answer_priors"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prediction(i: int, question: str, gold: str, said: str, selected: list[int], shown: int) -> dict:
    info = {"selected": selected, "gold": 2, "gold_selected": shown}
    steps = [{"agent": "rewriter", "info": {}}, {"agent": "reranker", "info": info}, {"agent": "answerer", "info": {}}]
    f1 = float(said.lower() == gold.lower())
    return {
        "id": f"q{i}",
        "question": question,
        "answers": [gold],
        "prediction": said,
        "f1": f1,
        "trace": {"steps": steps},
    }


def test_a_constant_answer_is_counted_and_the_shared_questions_compared(tmp_path, capsys):
    ap = _script()
    questions = [
        ("Are X and Y of the same nationality?", "yes"),
        ("Are Z and W of the same nationality?", "no"),
        ("Which was founded first, Ab or Cd?", "Ab"),
        ("Which was founded first, Ef or Gh?", "Gh"),
        ("Where was the author of K born?", "Lima"),
    ]
    start = [("no", [0, 3], 2), ("yes", [0, 3], 2), ("Cd", [0, 3], 2), ("Ef", [0, 1], 1), ("Lima", [0, 1], 2)]
    end = [("yes", [0, 1], 1), ("yes", [0, 1], 1), ("Cd", [0, 1], 1), ("Gh", [0, 1], 1), ("Lima", [0, 1], 2)]
    files = []
    for name, said in (("start", start), ("end", end)):
        rows = [_prediction(i, q, g, *s) for i, ((q, g), s) in enumerate(zip(questions, said))]
        if name == "end":
            rows.append(_prediction(9, "Only here?", "x", "x", [0], 0))  # not in the start: left out
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(path)
    rows = {r["id"]: r for r in (json.loads(line) for line in files[1].read_text().splitlines())}
    s = ap.summary(rows, [f"q{i}" for i in range(5)])
    assert s["f1_by_form"] == {"choice": (2, 50.0), "other": (1, 100.0), "yes_no": (2, 50.0)}  # the validation's forms
    assert (s["yes_share"], s["first_share"], s["second_share"]) == (1.0, 0.0, 1.0)
    assert s["reranker_top_selection"] == ([0, 1], 1.0) and s["gold_shown_per_question"] == 6 / 5
    assert ap.main([str(files[0]), str(files[1])]) == 0
    out = capsys.readouterr().out
    assert out.count("5 questions") == 2  # the end's sixth question is not the start's
    assert "F1 20.0" in out and "F1 60.0" in out
    assert "yes/no answered 'yes': 0.50" in out and "yes/no answered 'yes': 1.00" in out
    assert "the first name 0.50, the second 0.50" in out and "the first name 0.00, the second 1.00" in out
    assert "Reranker's most common selection [0, 3]: 0.60 of its calls" in out
