"""Answer metrics for multi-hop QA, following the official HotpotQA evaluation script.

`normalize_answer` lowercases, removes punctuation, removes the articles a/an/the and collapses
white space, in that order (as `hotpot_evaluate_v1.py` does). `f1_score` and `exact_match` are the
official token-level F1 and exact match; `accuracy` is "cover" accuracy: the normalized gold answer
appears inside the normalized prediction. Every metric returns a float in [0, 1]; gold aliases are
handled by taking the best score over them (`best_over_aliases`, `score`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

__all__ = [
    "normalize_answer",
    "f1_score",
    "precision_recall_f1",
    "exact_match",
    "accuracy",
    "best_over_aliases",
    "score",
]

Metric = Callable[[str, str], float]

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
# Answers that the official script only credits when matched exactly.
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})


def _lower(text: str) -> str:
    return text.lower()


def _remove_punc(text: str) -> str:
    return "".join(ch for ch in text if ch not in _PUNCTUATION)


def _remove_articles(text: str) -> str:
    return _ARTICLES.sub(" ", text)


def _white_space_fix(text: str) -> str:
    return " ".join(text.split())


def normalize_answer(s: str) -> str:
    """Official HotpotQA normalization: lower -> remove punctuation -> remove articles -> fix white space."""
    return _white_space_fix(_remove_articles(_remove_punc(_lower(s))))


def precision_recall_f1(prediction: str, gold: str) -> tuple[float, float, float]:
    """Official token-level (precision, recall, f1) of `prediction` against one `gold` answer.

    If either normalized side is yes/no/noanswer and the two differ, all three are 0. Two answers that
    both normalize to nothing share no token and score 0 (as in the official script).
    """
    pred_norm = normalize_answer(prediction)
    gold_norm = normalize_answer(gold)
    if pred_norm != gold_norm and (pred_norm in _SPECIAL_ANSWERS or gold_norm in _SPECIAL_ANSWERS):
        return 0.0, 0.0, 0.0
    pred_tokens = pred_norm.split()
    gold_tokens = gold_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0, 0.0, 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return precision, recall, 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str) -> float:
    """Official HotpotQA token-level F1 in [0, 1]."""
    return precision_recall_f1(prediction, gold)[2]


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the normalized prediction equals the normalized gold answer, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def accuracy(prediction: str, gold: str) -> float:
    """1.0 if the normalized gold answer is a substring of the normalized prediction, else 0.0.

    A gold answer that normalizes to nothing (e.g. "The") would be a substring of everything; it only
    counts as covered by a prediction that also normalizes to nothing.
    """
    pred_norm = normalize_answer(prediction)
    gold_norm = normalize_answer(gold)
    if not gold_norm:
        return float(not pred_norm)
    return float(gold_norm in pred_norm)


def best_over_aliases(metric: Metric, prediction: str, answers: Sequence[str]) -> float:
    """The best `metric(prediction, alias)` over the gold aliases; 0.0 when there are none."""
    if isinstance(answers, str):
        answers = (answers,)
    return max((metric(prediction, alias) for alias in answers), default=0.0)


def score(prediction: str, answers: Sequence[str]) -> dict[str, float]:
    """Accuracy, exact match and F1 of `prediction`, each the best over the gold `answers`."""
    return {
        "acc": best_over_aliases(accuracy, prediction, answers),
        "em": best_over_aliases(exact_match, prediction, answers),
        "f1": best_over_aliases(f1_score, prediction, answers),
    }
