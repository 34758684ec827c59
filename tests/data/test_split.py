"""`mhgpo data split`: disjoint parts drawn with a seed, the original records in the file's own layout, the same bytes
for the same seed, and one-line errors for impossible requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mhgpo.cli.main import main
from mhgpo.data.formats import load_musique
from mhgpo.data.spec import load_data
from mhgpo.data.split import split_data
from mhgpo.errors import InputError


def hotpot_records(n: int) -> list[dict]:
    """HotpotQA-layout records with unicode, nested context and an extra key that the loader ignores."""
    return [
        {
            "_id": f"h{i}",
            "question": f"Which city did person {i} visit in 19{i:02d}?",
            "answer": f"Zürich {i}",
            "type": "bridge",
            "level": "hard",
            "supporting_facts": [[f"P{i}", 0]],
            "context": [[f"P{i}", [f"Person {i} went to Zürich.", " It was cold."]], ["Other", ["Nothing."]]],
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_parts_are_disjoint_seeded_original_records_in_file_order(tmp_path: Path, capsys) -> None:
    records = hotpot_records(30)
    source = write_jsonl(tmp_path / "dev.jsonl", records)
    out = tmp_path / "split"
    assert (
        main(["data", "split", "--data", f"hotpotqa:{source}", "--out", str(out), "--sizes", "12,8", "--seed", "3"])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        f"train: 12 records, --data hotpotqa:{out / 'train.jsonl'}",
        f"val: 8 records, --data hotpotqa:{out / 'val.jsonl'}",
    ]
    train, val = read_jsonl(out / "train.jsonl"), read_jsonl(out / "val.jsonl")
    assert (len(train), len(val)) == (12, 8)
    ids = [r["_id"] for r in records]
    for part in (train, val):
        assert all(r == records[ids.index(r["_id"])] for r in part)  # the original records, extra keys included
        assert [ids.index(r["_id"]) for r in part] == sorted(ids.index(r["_id"]) for r in part)  # file order
    assert not {r["_id"] for r in train} & {r["_id"] for r in val}
    assert [e.id for e in load_data(f"hotpotqa:{out / 'val.jsonl'}")] == [r["_id"] for r in val]
    assert json.loads((out / "split.json").read_text()) == {
        "source": str(source),
        "layout": "hotpotqa",
        "seed": 3,
        "questions": 30,
        "parts": {"train": 12, "val": 8},
    }

    again, other = tmp_path / "again", tmp_path / "other"
    split_data(f"hotpotqa:{source}", again, [12, 8], seed=3)
    split_data(f"hotpotqa:{source}", other, [12, 8], seed=4)
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()
    assert (again / "val.jsonl").read_bytes() == (out / "val.jsonl").read_bytes()
    assert (other / "train.jsonl").read_bytes() != (out / "train.jsonl").read_bytes()


def test_musique_parts_hold_answerable_questions_only_and_names_can_be_given(tmp_path: Path) -> None:
    rows = [
        {
            "id": f"2hop__{i}",
            "question": f"Q{i}?",
            "answer": f"A{i}",
            "answer_aliases": [],
            "answerable": i % 3 != 0,
            "paragraphs": [{"title": "T", "paragraph_text": "x", "is_supporting": True}],
        }
        for i in range(12)
    ]
    source = write_jsonl(tmp_path / "musique.jsonl", rows)
    parts = split_data(f"musique:{source}", tmp_path / "m", [4, 2, 2], seed=0, names=["a", "b", "c"])
    assert {name: count for name, (_, count) in parts.items()} == {"a": 4, "b": 2, "c": 2}
    chosen = [r for name in "abc" for r in read_jsonl(tmp_path / "m" / f"{name}.jsonl")]
    assert len({r["id"] for r in chosen}) == 8 and all(r["answerable"] for r in chosen)
    assert {e.id for e in load_musique(tmp_path / "m" / "a.jsonl")} == {
        r["id"] for r in read_jsonl(tmp_path / "m" / "a.jsonl")
    }


@pytest.mark.parametrize(
    ("sizes", "names", "message"),
    [
        ([8, 4], None, r"--sizes: 12 records asked for, but \S+dev\.jsonl holds 10 questions"),
        ([0, 4], None, r"--sizes: expected positive numbers"),
        ([2, 2], ["train", "train"], r"--names: expected 2 distinct file names"),
        ([1, 1, 1, 1], None, r"--names: 4 parts need names"),
    ],
)
def test_impossible_splits_are_refused_before_writing(tmp_path: Path, sizes, names, message) -> None:
    source = write_jsonl(tmp_path / "dev.jsonl", hotpot_records(10))
    with pytest.raises(InputError, match=message):
        split_data(f"hotpotqa:{source}", tmp_path / "out", sizes, names=names)
    assert not (tmp_path / "out").exists()


def test_split_needs_a_local_file(tmp_path: Path, capsys) -> None:
    assert main(["data", "split", "--data", "hotpotqa", "--out", str(tmp_path / "o"), "--sizes", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "mhgpo: error: data spec 'hotpotqa': a local file is needed here (hotpotqa:PATH)"
    )
    assert main(["data", "split", "--data", "hotpotqa:x", "--out", str(tmp_path / "o"), "--sizes", "1,a"]) == 2
    assert "--sizes: expected comma-separated integers, got '1,a'" in capsys.readouterr().err
