"""Tests for mhgpo.data.formats: JSON Lines / JSON array readers, HotpotQA loading, data specs, corpora."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from mhgpo.data.formats import (
    context_corpus,
    load_corpus_jsonl,
    load_hotpotqa,
    read_json_array,
    read_jsonl,
    read_records,
)
from mhgpo.data.records import Example, Passage
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError


def _record(qid: str = "q-1", **overrides: object) -> dict:
    """A small HotpotQA-layout record: 3 paragraphs (fewer than the usual 10), one title repeated."""
    record: dict = {
        "_id": qid,
        "question": "Which city hosts the museum founded by Ada Stone?",
        "answer": "Lisbon",
        "type": "bridge",
        "supporting_facts": [["Ada Stone", 0], ["Ada Stone", 1], ["Stone Museum", 0]],
        "context": [
            ["Ada Stone", [" Ada Stone was a painter.", " She founded the Stone Museum."]],
            ["Stone Museum", ["The Stone Museum is in Lisbon.", "It opened in 1901."]],
            ["Ada Stone", [" Ada Stone was born in 1850."]],
        ],
    }
    record.update(overrides)
    return record


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- readers ------------------------------------------------------------------------------------


def test_read_jsonl_yields_line_numbers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "a.jsonl", ['{"x": 1}', "", "   ", '{"x": 2}'])
    assert list(read_jsonl(path)) == [(1, {"x": 1}), (4, {"x": 2})]


def test_read_jsonl_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as err:
        list(read_jsonl(path))
    assert str(err.value) == f"{path}: file not found"


def test_read_jsonl_bad_json_names_path_and_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", ['{"x": 1}', '{"x": 2}', '{"x": 3,,}'])
    with pytest.raises(InputError) as err:
        list(read_jsonl(path))
    assert str(err.value).startswith(f"{path}:3: invalid JSON (")


def test_read_jsonl_non_object_line(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "list.jsonl", ['{"x": 1}', "[1, 2]"])
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

    lines = _write_jsonl(tmp_path / "data.json", ['{"a": 1}', '{"a": 2}'])
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
    path = _write_jsonl(tmp_path / "dev.jsonl", [json.dumps(_record("q-1")), json.dumps(_record("q-2"))])
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
    rec = _record()
    del rec["_id"]
    rec["id"] = "plain-id"
    path = tmp_path / "dev.json"
    path.write_text(json.dumps([rec]), encoding="utf-8")
    (example,) = load_hotpotqa(path)
    assert example.id == "plain-id"
    assert example.answers == ("Lisbon",)


def test_load_hotpotqa_defaults_for_optional_keys(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "min.jsonl", ['{"question": "Q?", "answer": ["A", "Alias"]}'] * 2)
    examples = load_hotpotqa(path)
    assert [e.id for e in examples] == ["q0", "q1"]
    assert examples[0].answers == ("A", "Alias")
    assert (examples[0].type, examples[0].supporting_titles, examples[0].context) == ("", (), ())


def test_load_hotpotqa_column_layout(tmp_path: Path) -> None:
    rec = _record(
        context={"title": ["T1", "T2"], "sentences": [["One.", "Two."], ["Three."]]},
        supporting_facts={"title": ["T2", "T1", "T2"], "sent_id": [0, 1, 0]},
    )
    path = _write_jsonl(tmp_path / "cols.jsonl", [json.dumps(rec)])
    (example,) = load_hotpotqa(path)
    assert example.context == (("T1", "One. Two."), ("T2", "Three."))
    assert example.supporting_titles == ("T2", "T1")


def test_load_hotpotqa_bad_json_on_line_3(tmp_path: Path) -> None:
    lines = [json.dumps(_record("a")), json.dumps(_record("b")), '{"_id": "c", "question": ']
    path = _write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    message = str(err.value)
    assert str(path) in message
    assert f"{path}:3:" in message


@pytest.mark.parametrize("key", ["answer", "question"])
def test_load_hotpotqa_missing_key_names_key_and_line(tmp_path: Path, key: str) -> None:
    broken = _record("b")
    del broken[key]
    path = _write_jsonl(tmp_path / "missing.jsonl", [json.dumps(_record("a")), json.dumps(broken)])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:2: missing key '{key}'"


def test_load_hotpotqa_missing_key_in_array_names_index(tmp_path: Path) -> None:
    broken = _record("b")
    del broken["answer"]
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([_record("a"), broken]), encoding="utf-8")
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
    path = _write_jsonl(tmp_path / "m.jsonl", [json.dumps(_record(**overrides))])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:1: {expected}"


def test_load_hotpotqa_duplicate_id(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "dup.jsonl", [json.dumps(_record("x")), json.dumps(_record("x"))])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}:2: duplicate id 'x' (first at {path}:1)"


def test_load_hotpotqa_empty_file(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(InputError) as err:
        load_hotpotqa(path)
    assert str(err.value) == f"{path}: no questions in file"


def test_sentences_without_leading_spaces_are_joined_with_one_space(tmp_path: Path) -> None:
    rec = _record(context=[["T", ["First.", " Second.", "Third. ", "Fourth."]]])
    path = _write_jsonl(tmp_path / "s.jsonl", [json.dumps(rec)])
    (example,) = load_hotpotqa(path)
    assert example.context == (("T", "First. Second. Third. Fourth."),)


# --- data specs ---------------------------------------------------------------------------------


@pytest.fixture
def fake_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for mhgpo.data.synth_files whose default world is a folder with train/dev files."""
    world = tmp_path / "world"
    world.mkdir()
    _write_jsonl(world / "train.jsonl", [json.dumps(_record("t1")), json.dumps(_record("t2"))])
    _write_jsonl(world / "dev.jsonl", [json.dumps(_record("d1"))])
    fake = types.ModuleType("mhgpo.data.synth_files")
    fake.ensure_default_world = lambda: world  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mhgpo.data.synth_files", fake)
    import mhgpo.data

    monkeypatch.setattr(mhgpo.data, "synth_files", fake, raising=False)
    return world


def test_load_data_synthetic_specs(fake_world: Path) -> None:
    assert [e.id for e in load_data("synthetic")] == ["d1"]
    assert [e.id for e in load_data()] == ["d1"]
    assert [e.id for e in load_data("synthetic:dev")] == ["d1"]
    assert [e.id for e in load_data("synthetic:train")] == ["t1", "t2"]


def test_load_data_hotpotqa_spec(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "h.jsonl", [json.dumps(_record("h1"))])
    assert [e.id for e in load_data(f"hotpotqa:{path}")] == ["h1"]


def test_load_data_hotpotqa_spec_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(InputError) as err:
        load_data(f"hotpotqa:{path}")
    assert str(err.value) == f"{path}: file not found"


@pytest.mark.parametrize("spec", ["squad:x.json", "synthetic:test", "", "dev.jsonl"])
def test_load_data_unknown_spec_lists_forms(spec: str) -> None:
    with pytest.raises(InputError) as err:
        load_data(spec)
    message = str(err.value)
    for form in ("synthetic", "synthetic:train", "synthetic:dev", "hotpotqa:PATH"):
        assert form in message


def test_load_data_hotpotqa_spec_without_path() -> None:
    with pytest.raises(InputError, match="missing PATH"):
        load_data("hotpotqa:")


# --- corpora ------------------------------------------------------------------------------------


def test_load_corpus_jsonl(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "corpus.jsonl",
        ['{"id": "p1", "title": "A", "text": "alpha"}', '{"id": 7, "title": "B", "text": "beta"}'],
    )
    assert load_corpus_jsonl(path) == [Passage("p1", "A", "alpha"), Passage("7", "B", "beta")]


@pytest.mark.parametrize("key", ["id", "title", "text"])
def test_load_corpus_jsonl_missing_key(tmp_path: Path, key: str) -> None:
    good = {"id": "p1", "title": "A", "text": "alpha"}
    bad = {"id": "p2", "title": "B", "text": "beta"}
    del bad[key]
    path = _write_jsonl(tmp_path / "c.jsonl", [json.dumps(good), "", json.dumps(bad)])
    with pytest.raises(InputError) as err:
        load_corpus_jsonl(path)
    assert str(err.value) == f"{path}:3: missing key '{key}'"


def test_load_corpus_jsonl_duplicate_and_bad_json(tmp_path: Path) -> None:
    row = '{"id": "p1", "title": "A", "text": "alpha"}'
    dup = _write_jsonl(tmp_path / "dup.jsonl", [row, row])
    with pytest.raises(InputError, match=r":2: duplicate id 'p1'"):
        load_corpus_jsonl(dup)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [row, "{not json"])
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
