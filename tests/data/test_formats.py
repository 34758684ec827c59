"""The file formats of mhgpo/data/formats.py: JSON Lines / JSON array readers, the HotpotQA layout, generic JSONL,
and corpora (JSONL, DPR TSV, the context corpus). The 2WikiMultihopQA and MuSiQue layouts:
test_formats_2wiki_musique.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import hotpot_record, write_jsonl, write_lines

from mhgpo.data.formats import (
    context_corpus,
    corpus_file,
    load_corpus_jsonl,
    load_corpus_tsv,
    load_generic,
    load_hotpotqa,
    read_corpus,
    read_json_array,
    read_jsonl,
    read_records,
)
from mhgpo.data.records import Example, Passage
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError

# --- readers ------------------------------------------------------------------------------------


def test_read_jsonl_yields_line_numbers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "a.jsonl", ['{"x": 1}', "", "   ", '{"x": 2}'])
    assert list(read_jsonl(path)) == [(1, {"x": 1}), (4, {"x": 2})]


def test_read_jsonl_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as err:
        list(read_jsonl(path))
    assert str(err.value) == f"{path}: file not found"


def test_read_jsonl_bad_json_names_path_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", ['{"x": 1}', '{"x": 2}', '{"x": 3,,}'])
    with pytest.raises(InputError) as err:
        list(read_jsonl(path))
    assert str(err.value).startswith(f"{path}:3: invalid JSON (")


def test_read_jsonl_non_object_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "list.jsonl", ['{"x": 1}', "[1, 2]"])
    with pytest.raises(InputError) as err:
        list(read_jsonl(path))
    assert str(err.value) == f"{path}:2: expected a JSON object, got list"


def test_read_json_array_and_errors_name_index(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps([{"a": 1}, {"a": 2}]), encoding="utf-8")
    assert list(read_json_array(good)) == [(0, {"a": 1}), (1, {"a": 2})]

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"a": 1}, {"a": 2}, "oops"]), encoding="utf-8")
    with pytest.raises(InputError) as err:
        list(read_json_array(bad))
    assert str(err.value) == f"{bad}[2]: expected a JSON object, got str"


def test_read_json_array_invalid_json_names_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"a": 1},\n  {"a": }\n]\n', encoding="utf-8")
    with pytest.raises(InputError) as err:
        list(read_json_array(path))
    assert str(err.value).startswith(f"{path}:3: invalid JSON (")


def test_read_records_detects_format_by_first_char(tmp_path: Path) -> None:
    array = tmp_path / "data.jsonl"  # the extension does not matter
    array.write_text('\n  [{"a": 1}, {"a": 2}]', encoding="utf-8")
    assert list(read_records(array)) == [(f"{array}[0]", {"a": 1}), (f"{array}[1]", {"a": 2})]

    lines = write_lines(tmp_path / "data.json", ['{"a": 1}', '{"a": 2}'])
    assert list(read_records(lines)) == [(f"{lines}:1", {"a": 1}), (f"{lines}:2", {"a": 2})]


def test_read_records_tolerates_utf8_bom(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": "\xc3\xa9"}\n')
    assert list(read_records(path)) == [(f"{path}:1", {"a": "é"})]


def test_read_records_invalid_utf8_names_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "\xe9"}\n')
    with pytest.raises(InputError) as err:
        list(read_records(path))
    assert str(err.value).startswith(f"{path}:2: not valid UTF-8")


# --- HotpotQA -----------------------------------------------------------------------------------


def test_load_hotpotqa_jsonl(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "dev.jsonl", [json.dumps(hotpot_record("q-1")), json.dumps(hotpot_record("q-2"))])
    examples = load_hotpotqa(path)
    assert [e.id for e in examples] == ["q-1", "q-2"]
    first = examples[0]
    assert first == Example(
        id="q-1",
        question="Which city hosts the museum founded by Ada Stone?",
        answers=("Lisbon",),
        type="bridge",
        supporting_titles=("Ada Stone", "Stone Museum"),
        context=(
            ("Ada Stone", "Ada Stone was a painter. She founded the Stone Museum."),
            ("Stone Museum", "The Stone Museum is in Lisbon. It opened in 1901."),
            ("Ada Stone", "Ada Stone was born in 1850."),
        ),
        supporting_context=((0, 2), (1,)),
    )


def test_load_hotpotqa_json_array_and_id_key(tmp_path: Path) -> None:
    rec = hotpot_record()
    del rec["_id"]
    rec["id"] = "plain-id"
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([rec]), encoding="utf-8")
    (example,) = load_hotpotqa(path)
    assert example.id == "plain-id"
    assert example.answers == ("Lisbon",)


def test_load_hotpotqa_defaults_for_optional_keys(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "min.jsonl", ['{"question": "Q?", "answer": ["A", "Alias"]}'] * 2)
    examples = load_hotpotqa(path)
    assert [e.id for e in examples] == ["q0", "q1"]
    assert examples[0].answers == ("A", "Alias")
    assert (examples[0].type, examples[0].supporting_titles, examples[0].context) == ("", (), ())


def test_load_hotpotqa_column_layout(tmp_path: Path) -> None:
    rec = hotpot_record(
        context={"title": ["T1", "T2"], "sentences": [["One.", "Two."], ["Three."]]},
        supporting_facts={"title": ["T2", "T1", "T2"], "sent_id": [0, 1, 0]},
    )
    path = write_lines(tmp_path / "cols.jsonl", [json.dumps(rec)])
    (example,) = load_hotpotqa(path)
    assert example.context == (("T1", "One. Two."), ("T2", "Three."))
    assert example.supporting_titles == ("T2", "T1")


def test_load_hotpotqa_bad_json_on_line_3(tmp_path: Path) -> None:
    lines = [json.dumps(hotpot_record("a")), json.dumps(hotpot_record("b")), '{"_id": "c", "question": ']
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    message = str(err.value)
    assert str(path) in message
    assert f"{path}:3:" in message


@pytest.mark.parametrize("key", ["answer", "question"])
def test_load_hotpotqa_missing_key_names_key_and_line(tmp_path: Path, key: str) -> None:
    broken = hotpot_record("b")
    del broken[key]
    path = write_lines(tmp_path / "missing.jsonl", [json.dumps(hotpot_record("a")), json.dumps(broken)])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:2: missing key '{key}'"


def test_load_hotpotqa_missing_key_in_array_names_index(tmp_path: Path) -> None:
    broken = hotpot_record("b")
    del broken["answer"]
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([hotpot_record("a"), broken]), encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}[1]: missing key 'answer'"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"answer": 42}, "'answer' must be a string, got int"),
        ({"answer": "  "}, "'answer' is empty"),
        ({"context": [["only a title"]]}, "'context' must be a list of [title, sentences] pairs"),
        ({"context": [["T", [1, 2]]]}, "'context' paragraph 'T' must hold a list of sentences"),
        ({"supporting_facts": [[3, 0]]}, "'supporting_facts' must be a list of [title, sentence_id] pairs"),
    ],
)
def test_load_hotpotqa_malformed_fields(tmp_path: Path, overrides: dict, expected: str) -> None:
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(hotpot_record(**overrides))])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:1: {expected}"


def test_load_hotpotqa_duplicate_id(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "dup.jsonl", [json.dumps(hotpot_record("x")), json.dumps(hotpot_record("x"))])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:2: duplicate id 'x' (first at {path}:1)"


def test_load_hotpotqa_empty_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}: no questions in file"


def test_sentences_without_leading_spaces_are_joined_with_one_space(tmp_path: Path) -> None:
    rec = hotpot_record(context=[["T", ["First.", " Second.", "Third. ", "Fourth."]]])
    path = write_lines(tmp_path / "s.jsonl", [json.dumps(rec)])
    (example,) = load_hotpotqa(path)
    assert example.context == (("T", "First. Second. Third. Fourth."),)


# --- HotpotQA: fewer than 10 paragraphs, supporting_context -----------------------------------------


def test_hotpotqa_supporting_context_with_two_paragraphs_and_a_missing_title(tmp_path: Path) -> None:
    record = {
        "_id": "h",
        "question": "Q?",
        "answer": "yes",
        "type": "comparison",
        "supporting_facts": [["B", 0], ["Gone", 0], ["A", 1]],
        "context": [["A", ["a0.", " a1."]], ["B", ["b0."]]],
    }
    (example,) = load_hotpotqa(write_jsonl(tmp_path / "h.jsonl", [record]))
    assert example.supporting_titles == ("B", "Gone", "A")
    assert example.supporting_context == ((1,), (), (0,))
    assert example.context == (("A", "a0. a1."), ("B", "b0."))


# --- generic JSONL ------------------------------------------------------------------------------


def test_generic_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "g.jsonl",
        [
            {"id": 7, "question": "Who?", "answers": ["Ada", "Ada Stone"]},
            {
                "question": "What?",
                "answers": "Oslo",
                "type": "bridge",
                "supporting_titles": ["Oslo"],
                "context": [{"title": "Oslo", "text": "Oslo is a city."}, ["Bergen", ["Bergen is", " rainy."]]],
            },
        ],
    )
    first, second = load_data(f"jsonl:{path}")
    assert first == Example(id="7", question="Who?", answers=("Ada", "Ada Stone"))
    assert second == Example(
        id="q1",
        question="What?",
        answers=("Oslo",),
        type="bridge",
        supporting_titles=("Oslo",),
        context=(("Oslo", "Oslo is a city."), ("Bergen", "Bergen is rainy.")),
        supporting_context=((0,),),
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": "x", "question": "Q?", "answer": "A"}', "missing key 'answers'"),
        ('{"id": "x", "answers": ["A"]}', "missing key 'question'"),
        ('{"id": "x", "question": "Q?", "answers": [""]}', "'answers' is empty"),
        ('{"id": "x", "question": "Q?", "answers": [1]}', "'answers' must be a string, got int"),
        (
            '{"id": "x", "question": "Q?", "answers": ["A"], "supporting_titles": [1]}',
            "'supporting_titles' must be a list of titles",
        ),
        ('{"id": "x", "question": "Q?", "answers": ["A"]', "invalid JSON (Expecting ',' delimiter at column 47)"),
    ],
)
def test_generic_jsonl_bad_records(tmp_path: Path, line: str, expected: str) -> None:
    path = write_jsonl(tmp_path / "g.jsonl", ['{"id": "ok", "question": "Q?", "answers": ["A"]}', line])
    with pytest.raises(InputError) as err:
        load_generic(path)
    assert str(err.value) == f"{path}:2: {expected}"


# --- corpora ------------------------------------------------------------------------------------


def test_load_corpus_jsonl(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "corpus.jsonl",
        ['{"id": "p1", "title": "A", "text": "alpha"}', '{"id": 7, "title": "B", "text": "beta"}'],
    )
    assert load_corpus_jsonl(path) == [Passage("p1", "A", "alpha"), Passage("7", "B", "beta")]


@pytest.mark.parametrize("key", ["id", "title", "text"])
def test_load_corpus_jsonl_missing_key(tmp_path: Path, key: str) -> None:
    good = {"id": "p1", "title": "A", "text": "alpha"}
    bad = {"id": "p2", "title": "B", "text": "beta"}
    del bad[key]
    path = write_lines(tmp_path / "c.jsonl", [json.dumps(good), "", json.dumps(bad)])
    with pytest.raises(InputError) as err:
        load_corpus_jsonl(path)
    assert str(err.value) == f"{path}:3: missing key '{key}'"


def test_load_corpus_jsonl_duplicate_and_bad_json(tmp_path: Path) -> None:
    row = '{"id": "p1", "title": "A", "text": "alpha"}'
    dup = write_lines(tmp_path / "dup.jsonl", [row, row])
    with pytest.raises(InputError, match=r":2: duplicate id 'p1'"):
        load_corpus_jsonl(dup)
    bad = write_lines(tmp_path / "bad.jsonl", [row, "{not json"])
    with pytest.raises(InputError) as err:
        load_corpus_jsonl(bad)
    assert str(err.value).startswith(f"{bad}:2: invalid JSON (")


def test_context_corpus_dedupes_in_first_seen_order() -> None:
    a = Example("1", "q", ("a",), context=(("T1", "x"), ("T2", "y"), ("T1", "z")))
    b = Example("2", "q", ("a",), context=(("T2", "y"), ("T3", "w"), ("T1", "x")))
    assert context_corpus([a, b]) == [
        Passage("ctx0", "T1", "x"),
        Passage("ctx1", "T2", "y"),
        Passage("ctx2", "T1", "z"),
        Passage("ctx3", "T3", "w"),
    ]
    assert context_corpus([]) == []


DPR_TSV = (
    "id\ttext\ttitle\n"
    '1\t"Aaron ( or ; ""Ahärôn"") is a prophet."\tAaron\n'
    "2\tThe Ark was built by Noah.\tNoah's Ark\n"
    "\n"
    '3\t"A text with a\ttab inside quotes"\tTabs\n'
)


def test_dpr_tsv_corpus(tmp_path: Path) -> None:
    path = tmp_path / "psgs_w100.tsv"
    path.write_text(DPR_TSV, encoding="utf-8")
    expected = [
        Passage("1", "Aaron", 'Aaron ( or ; "Ahärôn") is a prophet.'),
        Passage("2", "Noah's Ark", "The Ark was built by Noah."),
        Passage("3", "Tabs", "A text with a\ttab inside quotes"),
    ]
    assert load_corpus_tsv(path) == expected
    assert read_corpus(str(path)) == expected
    assert read_corpus(f"tsv:{path}") == expected
    reordered = tmp_path / "other.txt"
    reordered.write_text("title\tid\ttext\nAaron\t1\tA prophet.\n", encoding="utf-8")
    assert read_corpus(f"tsv:{reordered}") == [Passage("1", "Aaron", "A prophet.")]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("id\ttext\n1\tx\n", ":1: the header must name the columns id, text and title (missing title)"),
        ("id\ttext\ttitle\n1\tx\tX\n2\ty\n", ":3: expected 3 tab-separated fields, got 2"),
        ("id\ttext\ttitle\n1\tx\tX\n\t\ty\n", ":3: empty 'id'"),
        ("id\ttext\ttitle\n1\tx\tX\n1\ty\tY\n", ":3: duplicate id '1' (first at {path}:2)"),
        ("", ":1: the header must name the columns id, text and title (missing id, text, title)"),
    ],
)
def test_dpr_tsv_errors_name_the_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as err:
        load_corpus_tsv(path)
    assert str(err.value) == f"{path}{expected.format(path=path)}"


def test_dpr_tsv_invalid_utf8_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "latin.tsv"
    path.write_bytes(b"id\ttext\ttitle\n1\tok\tA\n2\tcaf\xe9\tB\n")
    with pytest.raises(InputError) as err:
        load_corpus_tsv(path)
    assert str(err.value) == f"{path}:3: not valid UTF-8"
    with pytest.raises(InputError, match=r"file not found$"):
        load_corpus_tsv(tmp_path / "absent.tsv")


def test_corpus_file_dispatch(tmp_path: Path) -> None:
    assert corpus_file(f"jsonl:{tmp_path}/c.tsv") == (tmp_path / "c.tsv", load_corpus_jsonl)
    assert corpus_file(f"{tmp_path}/c.TSV") == (tmp_path / "c.TSV", load_corpus_tsv)
    assert corpus_file(f"{tmp_path}/c.jsonl") == (tmp_path / "c.jsonl", load_corpus_jsonl)
