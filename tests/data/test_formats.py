"""Tests for the benchmark layouts of mhgpo.data.formats: 2WikiMultihopQA, MuSiQue, generic JSONL, DPR TSV corpora,
the context corpus, and the data specs (local files and the Hugging Face hub)."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from mhgpo.data import hub
from mhgpo.data.formats import (
    context_corpus,
    corpus_file,
    load_2wiki,
    load_corpus_jsonl,
    load_corpus_tsv,
    load_generic,
    load_hotpotqa,
    load_musique,
    read_corpus,
    read_musique,
)
from mhgpo.data.records import Example, Passage
from mhgpo.data.spec import DATA_SPECS, load_data, spec_path
from mhgpo.errors import InputError


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


# --- fixtures in the official layouts ------------------------------------------------------------


def twowiki_record(qid: str = "2w-1", **overrides: object) -> dict:
    """A 2WikiMultihopQA record of the later release (entity_ids, evidences_id, answer_id): a title repeated in
    `context` with the same text, and a supporting fact whose sentence index is past its paragraph's end."""
    record: dict = {
        "_id": qid,
        "type": "compositional",
        "question": "Where was the father of Carl Brant buried?",
        "context": [
            ["Carl Brant", ["Carl Brant (1870-1930) was a judge.", "His father was Otto Brant."]],
            ["Otto Brant", ["Otto Brant was a sailor.", "He was buried in Kiel."]],
            ["Kiel Harbour", ["Kiel Harbour is a port."]],
            ["Carl Brant", ["Carl Brant (1870-1930) was a judge.", "His father was Otto Brant."]],
        ],
        "supporting_facts": [["Carl Brant", 1], ["Otto Brant", 1], ["Otto Brant", 7]],
        "evidences": [["Carl Brant", "father", "Otto Brant"], ["Otto Brant", "place of burial", "Kiel"]],
        "answer": "Kiel",
        "entity_ids": "Q1_Q2",
        "evidences_id": [["Q1", "father", "Q2"], ["Q2", "place of burial", "Q3"]],
        "answer_id": "Q3",
    }
    record.update(overrides)
    return record


def musique_record(qid: str = "2hop__1_2", answerable: bool = True, **overrides: object) -> dict:
    """A MuSiQue record: two paragraphs share the title "Lumen Valley" (only one supports), aliases given."""
    record: dict = {
        "id": qid,
        "paragraphs": [
            {
                "idx": 0,
                "title": "Lumen Valley",
                "paragraph_text": "Lumen Valley is a wine region.",
                "is_supporting": False,
            },
            {
                "idx": 1,
                "title": "Ostrava Mills",
                "paragraph_text": "Ostrava Mills lies in Lumen Valley.",
                "is_supporting": True,
            },
            {
                "idx": 2,
                "title": "Lumen Valley",
                "paragraph_text": "The seat of Lumen Valley is Pella.",
                "is_supporting": True,
            },
        ],
        "question": "What is the seat of the region where Ostrava Mills lies?",
        "question_decomposition": [
            {"id": 1, "question": "Ostrava Mills >> located in", "answer": "Lumen Valley", "paragraph_support_idx": 1},
            {"id": 2, "question": "#1 >> seat", "answer": "Pella", "paragraph_support_idx": 2},
        ],
        "answer": "Pella",
        "answer_aliases": ["Pella town", "Pella"],
        "answerable": answerable,
    }
    record.update(overrides)
    return record


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


# --- data specs ---------------------------------------------------------------------------------


def test_every_local_spec_and_spec_path(tmp_path: Path) -> None:
    wiki = write_jsonl(tmp_path / "w.jsonl", [twowiki_record("w")])
    assert [e.id for e in load_data(f"hotpotqa:{wiki}")] == ["w"]  # the same layout
    assert [e.id for e in load_data(f" 2wiki:{wiki} ")] == ["w"]
    assert spec_path(f"musique:{wiki}") == wiki
    assert spec_path("synthetic:train") is None and spec_path("hotpotqa") is None
    with pytest.raises(InputError, match=r"^data spec 'musique:': missing PATH after 'musique:'$"):
        load_data("musique:")


@pytest.mark.parametrize("spec", ["squad:x.json", "wiki", "jsonl", "dev.jsonl"])
def test_unknown_specs_list_every_form(spec: str) -> None:
    with pytest.raises(InputError) as err:
        load_data(spec)
    assert str(err.value) == f"unknown data spec '{spec}'; accepted forms: " + ", ".join(DATA_SPECS)


@pytest.mark.parametrize("name", ["hotpotqa", "2wiki", "musique"])
def test_hub_specs_fail_fast_offline(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(InputError) as err:
        load_data(name)
    assert time.perf_counter() - started < 1.0
    assert str(err.value) == (
        f"{name}: the Hugging Face hub cannot be reached from this machine; pass a local file "
        f"instead, e.g. {hub.HUB_SOURCES[name].local_example}"
    )


def test_hub_unreachable_is_detected_within_the_probe_time(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    started = time.perf_counter()
    assert hub.hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - started < 1.5


@pytest.fixture
def fake_datasets(monkeypatch: pytest.MonkeyPatch) -> list:
    """A stand-in `datasets` module; the hub counts as reachable. Returns the list of load_dataset calls."""
    calls: list = []
    rows = {
        "hotpotqa/hotpot_qa": [
            {
                "id": "h1",
                "question": "Q?",
                "answer": "A",
                "type": "bridge",
                "level": "hard",
                "supporting_facts": {"title": ["T2"], "sent_id": [0]},
                "context": {"title": ["T1", "T2"], "sentences": [["One."], ["Two.", " Three."]]},
            }
        ],
        "framolfese/2WikiMultihopQA": [
            {
                "_id": "w1",
                "question": "Q?",
                "answer": "B",
                "type": "comparison",
                "supporting_facts": {"title": ["T1"], "sent_id": [3]},
                "context": {"title": ["T1"], "content": [["Four."]]},
            }
        ],
        "dgslibisey/MuSiQue": [musique_record("m1"), musique_record("m2", answerable=False)],
        "bad/repo": [{"_id": "ok", "question": "Q?", "answer": "A"}, {"_id": "x", "question": "Q?"}],
    }

    def load_dataset(repo: str, *args: str, split: str) -> list:
        calls.append((repo, *args, split))
        return rows[repo]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr(hub, "hub_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_SECONDS: True)
    return calls


def test_hub_specs_parse_the_hub_rows(fake_datasets: list) -> None:
    (h,) = load_data("hotpotqa")
    assert (h.id, h.answers, h.supporting_titles, h.supporting_context) == ("h1", ("A",), ("T2",), ((1,),))
    assert h.context == (("T1", "One."), ("T2", "Two. Three."))
    (w,) = load_data("2wiki")
    assert (w.id, w.context, w.supporting_context) == ("w1", (("T1", "Four."),), ((0,),))
    assert [m.id for m in load_data("musique")] == ["m1"]
    assert fake_datasets == [
        ("hotpotqa/hotpot_qa", "distractor", "validation"),
        ("framolfese/2WikiMultihopQA", "validation"),
        ("dgslibisey/MuSiQue", "validation"),
    ]


def test_hub_bad_row_names_the_repository_row(fake_datasets: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        hub.HUB_SOURCES,
        "hotpotqa",
        hub.HubSource("bad/repo", None, "validation", hub.hotpot_example, "hotpotqa:x.json"),
    )
    with pytest.raises(InputError, match=r"^bad/repo\[1\]: missing key 'answer'$"):
        load_data("hotpotqa")


# --- corpora ------------------------------------------------------------------------------------


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
