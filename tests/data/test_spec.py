"""Data specs (mhgpo/data/spec.py): `synthetic`, `hotpotqa:PATH` and the other local forms, their paths, and the
errors that list every form."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from helpers import hotpot_record, twowiki_record, write_jsonl, write_lines

from mhgpo.data.spec import DATA_SPECS, load_data, spec_path
from mhgpo.errors import InputError


@pytest.fixture
def fake_world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for mhgpo.data.synth_files whose default world is a folder with train/dev files."""
    world = tmp_path / "world"
    world.mkdir()
    write_lines(world / "train.jsonl", [json.dumps(hotpot_record("t1")), json.dumps(hotpot_record("t2"))])
    write_lines(world / "dev.jsonl", [json.dumps(hotpot_record("d1"))])
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
    path = write_lines(tmp_path / "h.jsonl", [json.dumps(hotpot_record("h1"))])
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
