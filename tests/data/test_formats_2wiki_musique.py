"""The benchmark layouts of mhgpo/data/formats.py that HotpotQA's loader does not read: 2WikiMultihopQA
(a title repeated in the context, supporting facts past a paragraph's end) and MuSiQue (aliases, gold paragraphs,
unanswerable records)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import musique_record, twowiki_record, write_jsonl

from mhgpo.data.formats import (
    context_corpus,
    load_2wiki,
    load_musique,
    read_musique,
)
from mhgpo.data.records import Example, Passage
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError

# --- 2WikiMultihopQA ------------------------------------------------------------------------------


def test_2wiki_json_array_repeated_title_and_out_of_range_sentence(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([twowiki_record("a"), twowiki_record("b", type="comparison")], indent=1))
    first, second = load_2wiki(path)
    assert first == Example(
        id="a",
        question="Where was the father of Carl Brant buried?",
        answers=("Kiel",),
        type="compositional",
        supporting_titles=("Carl Brant", "Otto Brant"),
        context=(
            ("Carl Brant", "Carl Brant (1870-1930) was a judge. His father was Otto Brant."),
            ("Otto Brant", "Otto Brant was a sailor. He was buried in Kiel."),
            ("Kiel Harbour", "Kiel Harbour is a port."),
            ("Carl Brant", "Carl Brant (1870-1930) was a judge. His father was Otto Brant."),
        ),
        supporting_context=((0, 3), (1,)),
    )
    assert second.type == "comparison"


def test_2wiki_jsonl_and_the_context_corpus_keeps_one_copy_of_a_repeated_paragraph(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "dev.jsonl", [twowiki_record("a"), twowiki_record("b")])
    examples = load_data(f"2wiki:{path}")
    assert [e.id for e in examples] == ["a", "b"]
    assert [(p.id, p.title) for p in context_corpus(examples)] == [
        ("ctx0", "Carl Brant"),
        ("ctx1", "Otto Brant"),
        ("ctx2", "Kiel Harbour"),
    ]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"answer": None}, "missing key 'answer'"),
        ({"question": ""}, "'question' is empty"),
        ({"context": [["Carl Brant"]]}, "'context' must be a list of [title, sentences] pairs"),
        ({"supporting_facts": [[7, 1]]}, "'supporting_facts' must be a list of [title, sentence_id] pairs"),
    ],
)
def test_2wiki_bad_records_name_path_and_line(tmp_path: Path, change: dict, expected: str) -> None:
    bad = twowiki_record("b", **change)
    path = write_jsonl(tmp_path / "bad.jsonl", [twowiki_record("a"), bad])
    with pytest.raises(InputError) as err:
        load_2wiki(path)
    assert str(err.value) == f"{path}:2: {expected}"


def test_2wiki_bad_json_in_array_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text('[\n{"question": "Q?", "answer": "A"},\n{"question": "Q2?" "answer": "B"}\n]\n')
    with pytest.raises(InputError) as err:
        load_2wiki(path)
    assert str(err.value).startswith(f"{path}:3: invalid JSON (Expecting ',' delimiter")


# --- MuSiQue ------------------------------------------------------------------------------------


def test_musique_answers_aliases_gold_paragraphs_and_skipped_unanswerable(tmp_path: Path) -> None:
    rows = [
        musique_record("2hop__1_2"),
        musique_record("2hop__9_9", answerable=False, answer=""),
        musique_record("3hop1__4_5_6", answer_aliases=[]),
    ]
    path = write_jsonl(tmp_path / "musique.jsonl", rows)
    examples, skipped = read_musique(path)
    assert skipped == 1
    assert [e.id for e in examples] == ["2hop__1_2", "3hop1__4_5_6"]
    first = examples[0]
    assert first.answers == ("Pella", "Pella town")
    assert first.type == "2hop" and examples[1].type == "3hop1"
    assert first.supporting_titles == ("Ostrava Mills", "Lumen Valley")
    assert first.supporting_context == ((1,), (2,))
    assert first.context[0] == ("Lumen Valley", "Lumen Valley is a wine region.")
    assert examples[1].answers == ("Pella",)


def test_musique_spec_logs_the_skipped_count(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [musique_record("a"), musique_record("b", answerable=False)])
    with caplog.at_level("WARNING", logger="mhgpo.data.formats"):
        assert [e.id for e in load_data(f"musique:{path}")] == ["a"]
    assert caplog.messages == [f"{path}: skipped 1 unanswerable record(s)"]


def test_musique_only_unanswerable_records(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [musique_record("a", answerable=False)])
    with pytest.raises(InputError) as err:
        load_musique(path)
    assert str(err.value) == f"{path}: no answerable questions in file"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"paragraphs": None}, "missing key 'paragraphs'"),
        ({"paragraphs": "text"}, "'paragraphs' must be a list of objects"),
        ({"paragraphs": [{"idx": 0, "title": "T"}]}, "paragraphs[0]: missing key 'paragraph_text'"),
        (
            {"paragraphs": [{"idx": 0, "title": 3, "paragraph_text": "x"}]},
            "paragraphs[0]: 'title' must be a string, got int",
        ),
        ({"paragraphs": [[0, "T", "x"]]}, "paragraphs[0]: expected an object, got list"),
        ({"answer_aliases": "Pella"}, "'answer_aliases' must be a list of strings"),
        ({"answer": None}, "missing key 'answer'"),
    ],
)
def test_musique_bad_records_name_path_and_line(tmp_path: Path, change: dict, expected: str) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [musique_record("a"), "", musique_record("b", **change)])
    with pytest.raises(InputError) as err:
        load_musique(path)
    assert str(err.value) == f"{path}:3: {expected}"


def test_musique_context_corpus_keeps_paragraphs_that_share_a_title(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", [musique_record("a"), musique_record("b")])
    assert context_corpus(load_musique(path)) == [
        Passage("ctx0", "Lumen Valley", "Lumen Valley is a wine region."),
        Passage("ctx1", "Ostrava Mills", "Ostrava Mills lies in Lumen Valley."),
        Passage("ctx2", "Lumen Valley", "The seat of Lumen Valley is Pella."),
    ]
