"""Where mhgpo keeps things on disk (mhgpo/paths.py): an index folder next to a writable corpus, in the cache when
the corpus's folder is not writable, one per retriever."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhgpo.paths import index_dir_for
from mhgpo.retrieval import bm25 as retrieval

# --- index_dir_for ------------------------------------------------------------------------------


def test_index_dir_next_to_a_writable_corpus(tmp_path: Path) -> None:
    assert index_dir_for(tmp_path / "wiki.jsonl") == tmp_path / "wiki.jsonl.bm25"


def test_index_dir_in_cache_when_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retrieval.os, "access", lambda *args, **kwargs: False)
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    first = index_dir_for(tmp_path / "ro" / "wiki.jsonl")
    assert first.parent == tmp_path / "cache" / "indexes"
    assert len(first.name) == 16 and all(c in "0123456789abcdef" for c in first.name)
    assert index_dir_for(tmp_path / "ro" / "wiki.jsonl") == first
    assert index_dir_for(tmp_path / "ro" / "other.jsonl") != first

    monkeypatch.delenv("MHGPO_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        index_dir_for(tmp_path / "ro" / "wiki.jsonl") == tmp_path / "home" / ".cache" / "mhgpo" / "indexes" / first.name
    )


def test_index_dir_suffix_per_retriever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert index_dir_for(tmp_path / "wiki.tsv", "dense-minilm") == tmp_path / "wiki.tsv.dense-minilm"
    monkeypatch.setattr(retrieval.os, "access", lambda *args, **kwargs: False)
    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path / "cache"))
    assert index_dir_for(tmp_path / "wiki.tsv", "dense-x") != index_dir_for(tmp_path / "wiki.tsv")
