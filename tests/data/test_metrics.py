"""Tests for mhgpo.data.metrics: the official HotpotQA answer metrics, by hand and by property."""

from __future__ import annotations

import re
import string
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mhgpo.data.metrics import (
    accuracy,
    best_over_aliases,
    exact_match,
    f1_score,
    normalize_answer,
    precision_recall_f1,
    score,
)

# --- reference: the official hotpot_evaluate_v1.py functions, transcribed -------------------------


def _ref_normalize(s: str) -> str:
    def remove_articles(text: str) -> str:
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text: str) -> str:
        return " ".join(text.split())

    def remove_punc(text: str) -> str:
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def _ref_f1(prediction: str, ground_truth: str) -> float:
    p, g = _ref_normalize(prediction), _ref_normalize(ground_truth)
    if p in ["yes", "no", "noanswer"] and p != g:
        return 0
    if g in ["yes", "no", "noanswer"] and p != g:
        return 0
    pt, gt = p.split(), g.split()
    common = Counter(pt) & Counter(gt)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pt)
    recall = 1.0 * num_same / len(gt)
    return (2 * precision * recall) / (precision + recall)


# --- normalization ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The  Quick, Brown Fox!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("the", ""),
        ("  ", ""),
        ("U.S.A.", "usa"),
        ("don't", "dont"),
        # punctuation goes before articles: "a-team" -> "ateam", which holds no article
        ("a-team", "ateam"),
        ("The Theatre", "theatre"),
        ("anthem of the ANTS", "anthem of ants"),
        ("tab\tand\nnewline", "tab and newline"),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


# --- F1 -----------------------------------------------------------------------------------------


def test_f1_identical_after_normalization() -> None:
    assert f1_score("The Beatles!", "beatles") == 1.0


def test_f1_partial_precision_two_thirds() -> None:
    # 2 shared tokens; precision 2/3, recall 1 -> F1 = 2*(2/3)/(5/3) = 0.8
    p, r, f = precision_recall_f1("Barack Obama president", "Barack Obama")
    assert p == pytest.approx(2 / 3)
    assert r == 1.0
    assert f == pytest.approx(0.8)


def test_f1_partial_recall_one_third() -> None:
    # precision 1, recall 1/3 -> F1 = 2*(1/3)/(4/3) = 0.5
    p, r, f = precision_recall_f1("Obama", "Barack Hussein Obama")
    assert (p, r) == (1.0, pytest.approx(1 / 3))
    assert f == pytest.approx(0.5)


def test_f1_counts_repeated_tokens_by_multiset_overlap() -> None:
    # pred tokens new,new,york vs gold new,york: overlap 2 -> P=2/3, R=1 -> 0.8
    assert f1_score("new new york", "new york") == pytest.approx(0.8)
    # pred new,new vs gold new,york,new: overlap 2 -> P=1, R=2/3 -> 0.8
    assert f1_score("new new", "new york new") == pytest.approx(0.8)


def test_f1_no_overlap_is_zero() -> None:
    assert f1_score("Paris", "London") == 0.0


def test_f1_articles_and_punctuation_do_not_count() -> None:
    # "the" is dropped from both sides: pred [city, of, paris] vs gold [paris] -> P=1/3, R=1 -> 0.5
    assert f1_score("The city of Paris.", "Paris") == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("yes", "yes indeed", 0.0),
        ("yes it is", "yes", 0.0),
        ("no", "no", 1.0),
        ("No.", "no", 1.0),
        ("yes", "no", 0.0),
        ("noanswer", "no answer", 0.0),
        ("no way", "no way", 1.0),
    ],
)
def test_f1_yes_no_rule(prediction: str, gold: str, expected: float) -> None:
    assert f1_score(prediction, gold) == expected


def test_f1_both_empty_is_zero_as_official() -> None:
    assert f1_score("", "") == 0.0
    assert f1_score("the", "a") == 0.0
    assert exact_match("the", "a") == 1.0


# --- EM and accuracy ----------------------------------------------------------------------------


def test_f1_ignores_order_but_accuracy_does_not() -> None:
    assert f1_score("york new", "new york") == 1.0
    assert exact_match("york new", "new york") == 0.0
    assert accuracy("york new", "new york") == 0.0


def test_exact_match() -> None:
    assert exact_match("The Beatles", "beatles") == 1.0
    assert exact_match("Beatles band", "beatles") == 0.0


@pytest.mark.parametrize(
    ("prediction", "gold", "expected"),
    [
        ("It was the Beatles, a band.", "The Beatles", 1.0),
        ("beatle", "beatles", 0.0),
        ("Beatles", "Beatles", 1.0),
        ("the answer is 1,000", "1000", 1.0),
        ("", "Paris", 0.0),
        # a gold answer that normalizes to nothing is covered only by an empty prediction
        ("anything at all", "The", 0.0),
        ("a", "The", 1.0),
    ],
)
def test_accuracy(prediction: str, gold: str, expected: float) -> None:
    assert accuracy(prediction, gold) == expected


# --- aliases and score -------------------------------------------------------------------------


def test_best_over_aliases_takes_the_max() -> None:
    answers = ["NYC", "New York City"]
    # vs "New York City": P=1, R=2/3 -> 0.8; vs "NYC": 0
    assert best_over_aliases(f1_score, "new york", answers) == pytest.approx(0.8)
    assert best_over_aliases(exact_match, "nyc", answers) == 1.0
    assert best_over_aliases(accuracy, "it is new york city", answers) == 1.0


def test_best_over_aliases_empty_is_zero() -> None:
    assert best_over_aliases(f1_score, "Paris", []) == 0.0
    assert score("Paris", []) == {"acc": 0.0, "em": 0.0, "f1": 0.0}


def test_best_over_aliases_accepts_a_single_string() -> None:
    assert best_over_aliases(exact_match, "paris", "Paris") == 1.0


def test_score_values() -> None:
    assert score("The city of Paris", ["Paris", "Paris, France"]) == {
        "acc": 1.0,
        "em": 0.0,
        # vs "Paris": [city, of, paris] vs [paris] -> 0.5; vs "Paris, France": P=1/3, R=1/2 -> 0.4
        "f1": pytest.approx(0.5),
    }
    assert score("nyc", ["New York City", "NYC"]) == {"acc": 1.0, "em": 1.0, "f1": 1.0}


# --- properties --------------------------------------------------------------------------------

_WORDS = ["a", "an", "the", "yes", "no", "noanswer", "New", "york", "city", "Paris,", "U.S.", "1,000", "-", "!!"]
answer_text = st.one_of(
    st.lists(st.sampled_from(_WORDS), max_size=6).map(" ".join),
    st.text(max_size=20),
)


@settings(max_examples=300, deadline=None)
@given(answer_text, answer_text)
def test_f1_matches_official_reference(prediction: str, gold: str) -> None:
    assert normalize_answer(prediction) == _ref_normalize(prediction)
    assert f1_score(prediction, gold) == pytest.approx(_ref_f1(prediction, gold))


@settings(max_examples=300, deadline=None)
@given(answer_text, answer_text)
def test_f1_symmetric_and_bounded(prediction: str, gold: str) -> None:
    f = f1_score(prediction, gold)
    assert 0.0 <= f <= 1.0
    assert f == pytest.approx(f1_score(gold, prediction))
    for metric in (exact_match, accuracy):
        assert metric(prediction, gold) in (0.0, 1.0)


@settings(max_examples=300, deadline=None)
@given(answer_text, answer_text)
def test_em_implies_f1_implies_acc(prediction: str, gold: str) -> None:
    em, f1, acc = exact_match(prediction, gold), f1_score(prediction, gold), accuracy(prediction, gold)
    if normalize_answer(gold):
        assert em <= f1
        if em == 1.0:
            assert f1 == 1.0
            assert acc == 1.0
    elif em == 1.0:
        assert acc == 1.0


@settings(max_examples=200, deadline=None)
@given(answer_text, st.lists(answer_text, max_size=4))
def test_score_is_max_over_aliases(prediction: str, answers: list[str]) -> None:
    result = score(prediction, answers)
    assert set(result) == {"acc", "em", "f1"}
    assert all(0.0 <= v <= 1.0 for v in result.values())
    assert result["f1"] == max((f1_score(prediction, a) for a in answers), default=0.0)
