"""The synthetic world's files (mhgpo/data/synth_files.py): byte-identical for a seed, UTF-8 JSON Lines with their
counts, the default world's folder in the cache, written once and replaced when partial."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mhgpo.data import synth, synth_files
from mhgpo.errors import InputError


def read_bytes(paths: dict[str, Path]) -> dict[str, bytes]:
    return {name: path.read_bytes() for name, path in paths.items()}


# --- writing a world ------------------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files_and_another_seed_differs(tmp_path: Path) -> None:
    first = read_bytes(synth_files.write_world(tmp_path / "a", seed=5, n_train=60, n_dev=20))
    second = read_bytes(synth_files.write_world(tmp_path / "b", seed=5, n_train=60, n_dev=20))
    other = read_bytes(synth_files.write_world(tmp_path / "c", seed=6, n_train=60, n_dev=20))
    assert set(first) == {"corpus", "train", "dev", "world"}
    assert first == second
    for name in ("corpus", "train", "dev"):
        assert first[name] != other[name]
    titles = {json.loads(line)["title"] for line in first["corpus"].decode("utf-8").splitlines()}
    other_titles = {json.loads(line)["title"] for line in other["corpus"].decode("utf-8").splitlines()}
    assert len(titles & other_titles) < len(titles) // 10  # a different world, not a reshuffle


def test_written_files_are_utf8_jsonl_with_counts(tmp_path: Path) -> None:
    paths = synth_files.write_world(tmp_path / "w", seed=1, n_train=30, n_dev=10)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == sorted(synth.FILES)  # no temporary files left
    rows = {
        name: [json.loads(line) for line in paths[name].read_text("utf-8").splitlines()]
        for name in ("corpus", "train", "dev")
    }
    meta = json.loads(paths["world"].read_text("utf-8"))
    assert meta == {"version": synth.VERSION, "seed": 1, "n_train": 30, "n_dev": 10, "n_passages": len(rows["corpus"])}
    assert (len(rows["train"]), len(rows["dev"])) == (30, 10)
    assert rows["train"] == synth.generate_world(seed=1, n_train=30, n_dev=10).train


def test_write_world_refuses_a_file_as_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError):
        synth_files.write_world(tmp_path / "file", n_train=5, n_dev=1)


# --- the cache --------------------------------------------------------------------------------------------


def test_default_world_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    assert synth_files.default_world_dir() == tmp_path / "world-seed0-v3"
    monkeypatch.delenv("MHGPO_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert synth_files.default_world_dir() == tmp_path / "home" / ".cache" / "mhgpo" / "world-seed0-v3"


def test_ensure_default_world_creates_once_then_reuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    folder = synth_files.ensure_default_world()
    assert folder == tmp_path / "cache" / "world-seed0-v3"
    assert sorted(p.name for p in folder.iterdir()) == sorted(synth.FILES)
    assert [p.name for p in folder.parent.iterdir()] == ["world-seed0-v3"]  # no temporary folder left
    meta = json.loads((folder / "world.json").read_text("utf-8"))
    assert (meta["seed"], meta["n_train"], meta["n_dev"]) == (
        0,
        synth.DEFAULT_N_TRAIN,
        synth.DEFAULT_N_DEV + synth.DEFAULT_MORE_DEV,
    )
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached world was generated again")

    monkeypatch.setattr(synth_files, "generate_world", fail)
    assert synth_files.ensure_default_world() == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps


def test_ensure_default_world_replaces_a_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    partial = tmp_path / "world-seed0-v3"
    partial.mkdir()
    (partial / "corpus.jsonl").write_text('{"id": "w0", "ti')
    folder = synth_files.ensure_default_world()
    assert folder == partial
    assert sorted(p.name for p in folder.iterdir()) == sorted(synth.FILES)
    assert len((folder / "dev.jsonl").read_text("utf-8").splitlines()) == synth.DEFAULT_N_DEV + synth.DEFAULT_MORE_DEV
    assert [p.name for p in tmp_path.iterdir()] == ["world-seed0-v3"]
