"""Tests for mhgpo.data.forms: question forms, the constant an answer is, and F1 by form."""

from __future__ import annotations

import pytest

from mhgpo.data.forms import form_line, form_metrics, is_form_metric, picked, question_form, side


@pytest.mark.parametrize(
    ("question", "answers", "form"),
    [
        ("Are Laleli Mosque and Esma Sultan Mansion in the same neighbourhood?", ["no"], "yes_no"),
        ("Were both born in Oslo?", ["Yes."], "yes_no"),  # normalised: punctuation and case
        ("Who was born first, Chester Bennington or Mikael Stanne?", ["Chester Bennington"], "choice"),
        ("Who was born first, Chester Bennington or Mikael Stanne?", ["Bengt Mikael Stanne"], "choice"),  # 2 of 3
        ("Which band, Letters to Cleo or Screaming Trees, had more members?", ["Letters to Cleo"], "choice"),
        ("Who was born first David Draiman or Terry Kath?", ["David Michael Draiman"], "choice"),  # no comma
        ("Which film came out first, Sleep, My Love or The More The Merrier?", ["Sleep, My Love"], "choice"),
        ("Which came first, Hollow Star or Hollow Stars?", ["Hollow Stars"], "choice"),  # near twins
        ("What profession do John Landis and Gore Verbinski have in common?", ["director"], "other"),  # no " or "
        ("Is the city of Lyon's founder a soldier or a poet?", ["Lucius Munatius Plancus"], "other"),  # not an option
        ("Who directed the film whose composer wrote Tosca?", ["Ada Brun"], "other"),
        ("Who directed it?", [], "other"),  # no gold answer
    ],
)
def test_a_questions_form_comes_from_the_question_and_its_first_gold_answer(question, answers, form):
    assert question_form(question, answers) == form


def test_the_side_of_an_option_is_where_most_of_its_words_are():
    q = "Which came first, Hollow Star or Hollow Stars?"
    assert side("Hollow Star", q) == "first" and side("hollow stars", q) == "second"
    assert side("Hollow", q) is None  # on both sides equally
    assert side("Stars of the sea", q) is None  # fewer than half of its words on either side
    assert side("", q) is None and side("Hollow Star", "Which came first?") is None
    assert question_form("Who is older, Ann Lee or Bo Lee?", "Bo Lee") == "choice"  # one answer as a string


def test_the_constant_an_answer_is():
    yes_no = ("Were both born in Oslo?", ["yes"])
    choice = ("Who was born first, Ann Berg or Bo Lund?", ["Bo Lund"])
    assert picked(*yes_no, "Yes") == "yes" and picked(*yes_no, "no.") == "no" and picked(*yes_no, "Oslo") is None
    assert picked(*choice, "Ann Berg") == "first" and picked(*choice, "bo lund") == "second"
    assert picked(*choice, "Carl") is None and picked(*choice, "") is None
    assert picked("Who wrote Tosca?", ["Ada Brun"], "Ada Brun") is None  # another form: no constant


def _p(question: str, gold: str, prediction: str, f1: float, qtype: str = "") -> dict:
    return {
        "question": question,
        "answers": [gold],
        "prediction": prediction,
        "f1": f1,
        **({"type": qtype} if qtype else {}),
    }


def test_f1_by_form_with_the_share_of_each_constant_answer():
    rows = [
        _p("Were both born in Oslo?", "yes", "yes", 1.0, "comparison"),
        _p("Were both born in Rome?", "no", "yes", 0.0, "comparison"),
        _p("Were both born in Bergen?", "no", "maybe", 0.0, "comparison"),
        _p("Who was born first, Ann Berg or Bo Lund?", "Bo Lund", "Bo Lund", 1.0, "comparison"),
        _p("Who was born first, Cy Moe or Di Ness?", "Cy Moe", "Di Ness", 0.0, "comparison"),
        _p("Who wrote Tosca?", "Ada Brun", "Ada", 0.5, "bridge"),
        _p("Who wrote Aida?", "Ada Brun", "Ada Brun", 1.0),  # no type: left out of the types
    ]
    m = form_metrics(rows)
    assert m == {
        "form/yes_no/n": 3,
        "form/yes_no/f1": pytest.approx(100 / 3),
        "form/choice/n": 2,
        "form/choice/f1": 50.0,
        "form/other/n": 2,
        "form/other/f1": 75.0,
        "form/yes_no/yes_share": pytest.approx(2 / 3),
        "form/choice/second_share": 1.0,
        "type/bridge/n": 1,
        "type/bridge/f1": 50.0,
        "type/comparison/n": 5,
        "type/comparison/f1": 40.0,
    }
    assert all(is_form_metric(k) for k in m) and not is_form_metric("reranker/invalid_rate")
    assert form_line(m) == "yes/no 3 q F1 33.3 ('yes' 0.67) · choice 2 q F1 50.0 (second 1.00) · other 2 q F1 75.0"
    only_other = form_metrics(rows[-2:])
    assert only_other == {"form/other/n": 2, "form/other/f1": 75.0, "type/bridge/n": 1, "type/bridge/f1": 50.0}
    assert form_line(only_other) == "other 2 q F1 75.0"
    assert form_metrics([]) == {} and form_line({}) == ""
