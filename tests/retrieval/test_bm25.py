"""Tests for mhgpo.retrieval.bm25: BM25 search, batching, caching, saving and index reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CORPUS

from mhgpo.data.records import Passage
from mhgpo.errors import InputError
from mhgpo.retrieval.bm25 import BM25Retriever, corpus_fingerprint, load_or_build_bm25
from mhgpo.retrieval.build import open_index


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(CORPUS)


def ids(passages: list[Passage]) -> list[str]:
    return [p.id for p in passages]


# --- search -------------------------------------------------------------------------------------


def test_distinctive_query_ranks_its_passage_first(retriever: BM25Retriever) -> None:
    assert retriever.search("Zeppelin Quartz mineral Tromso", 3) == [CORPUS[6]]
    assert ids(retriever.search("Who composed the Glass Harbor symphony?", 3))[0] == "p3"


def test_title_is_indexed(retriever: BM25Retriever) -> None:
    # "Zeppelin" appears only in the title of p6
    assert ids(retriever.search("zeppelin", 5)) == ["p6"]


def test_only_passages_sharing_a_token_are_returned(retriever: BM25Retriever) -> None:
    # Oslo passage holds both "capital" and "norway" (and "Oslo" nowhere in the query); Lisbon only "capital"
    assert ids(retriever.search("capital of Norway", 5)) == ["p5", "p2"]


def test_k_limits_and_k_larger_than_corpus(retriever: BM25Retriever) -> None:
    assert ids(retriever.search("capital of Norway", 1)) == ["p5"]
    wide = retriever.search("stone museum lisbon oslo symphony", 100)
    assert sorted(ids(wide)) == ["p0", "p1", "p2", "p3", "p4", "p5"]
    assert len(retriever.search("capital", 1000)) == 2
    assert retriever.search("capital", 0) == []
    with pytest.raises(ValueError):
        retriever.search("capital", -1)


@pytest.mark.parametrize("query", ["", "   ", "the of and is", "?!", "xylophone"])
def test_empty_stopword_or_unknown_queries_return_nothing(retriever: BM25Retriever, query: str) -> None:
    assert retriever.search(query, 3) == []


def test_scores_are_ordered_best_first(retriever: BM25Retriever) -> None:
    # p0 mentions "Stone" three times (title + text), p1 twice: both match, p0 first
    assert ids(retriever.search("Ada Stone", 5)) == ["p0", "p1"]


def test_ties_keep_corpus_order() -> None:
    twins = [Passage("b", "Twin", "same words here"), Passage("a", "Twin", "same words here")]
    r = BM25Retriever.build(twins + [Passage("c", "Other", "unrelated")])
    assert ids(r.search("twin words", 5)) == ["b", "a"]


def test_empty_corpus() -> None:
    r = BM25Retriever.build([])
    assert len(r) == 0
    assert r.search("anything", 3) == []
    assert r.search_batch(["a", "b"], 3) == [[], []]


def test_batch_equals_individual_searches(retriever: BM25Retriever) -> None:
    queries = ["capital of Norway", "", "Ada Stone", "the", "glass harbor", "capital of Norway", "quartz"]
    fresh = BM25Retriever.build(CORPUS)
    batch = fresh.search_batch(queries, 3)
    assert batch == [BM25Retriever.build(CORPUS).search(q, 3) for q in queries]
    assert [ids(b) for b in batch] == [["p5", "p2"], [], ["p0", "p1"], [], ["p4", "p3"], ["p5", "p2"], ["p6"]]


def test_batch_makes_one_bm25s_call(monkeypatch: pytest.MonkeyPatch) -> None:
    r = BM25Retriever.build(CORPUS)
    calls: list[int] = []
    original = r._index.retrieve  # type: ignore[union-attr]

    def counting(query_tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(query_tokens))
        return original(query_tokens, *args, **kwargs)

    monkeypatch.setattr(r._index, "retrieve", counting)
    r.search_batch(["capital", "stone", "the", "capital", "glass"], 2)
    assert calls == [3]  # "the" has no index token; the repeated "capital" is searched once


# --- cache --------------------------------------------------------------------------------------


def test_cache_counts_hits_and_misses() -> None:
    r = BM25Retriever.build(CORPUS)
    first = r.search("capital of Norway", 2)
    assert tuple(r.cache_info()[:3]) == (0, 1, 1)
    assert r.search("capital of Norway", 2) == first
    assert tuple(r.cache_info()[:3]) == (1, 1, 1)
    r.search("capital of Norway", 3)  # another k is another key
    assert tuple(r.cache_info()[:3]) == (1, 2, 2)
    r.search_batch(["capital of Norway", "oslo", "oslo"], 2)
    info = r.cache_info()
    assert (info.hits, info.misses, info.size) == (3, 3, 3)
    r.cache_clear()
    assert tuple(r.cache_info()[:3]) == (0, 0, 0)


def test_cached_results_are_not_shared_mutable_lists() -> None:
    r = BM25Retriever.build(CORPUS)
    r.search("oslo", 2).clear()
    assert ids(r.search("oslo", 2)) == ["p5", "p4"]


def test_cache_is_bounded_lru() -> None:
    r = BM25Retriever.build(CORPUS, cache_size=2)
    for q in ["oslo", "lisbon", "oslo", "stone"]:  # "lisbon" is the least recently used when "stone" arrives
        r.search(q, 1)
    assert r.cache_info().size == 2
    r.search("oslo", 1)
    assert r.cache_info().hits == 2
    r.search("lisbon", 1)
    assert r.cache_info().misses == 4


# --- save / load --------------------------------------------------------------------------------


def test_save_and_load_give_identical_results(tmp_path: Path, retriever: BM25Retriever) -> None:
    retriever.save(tmp_path / "idx")
    loaded = BM25Retriever.load(tmp_path / "idx")
    assert loaded.passages == tuple(CORPUS)
    queries = ["capital of Norway", "Ada Stone", "glass harbor symphony", "the", "zeppelin", "museum 1901"]
    assert loaded.search_batch(queries, 4) == retriever.search_batch(queries, 4)
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text(encoding="utf-8"))
    assert meta["count"] == 7
    assert meta["sha256"] == corpus_fingerprint(CORPUS)["sha256"]
    lines = (tmp_path / "idx" / "passages.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[2]) == {"id": "p2", "title": "Lisbon", "text": "Lisbon is the capital of Portugal."}


def test_save_and_load_empty_corpus(tmp_path: Path) -> None:
    BM25Retriever.build([]).save(tmp_path / "e")
    assert BM25Retriever.load(tmp_path / "e").search("x", 2) == []


def test_load_errors(tmp_path: Path, retriever: BM25Retriever) -> None:
    with pytest.raises(InputError, match="not a BM25 index"):
        BM25Retriever.load(tmp_path / "missing")
    retriever.save(tmp_path / "idx")
    with open(tmp_path / "idx" / "passages.jsonl", "a", encoding="utf-8") as f:
        f.write('{"id": "extra", "title": "X", "text": "y"}\n')
    with pytest.raises(InputError, match="does not match meta.json"):
        BM25Retriever.load(tmp_path / "idx")


def test_fingerprint_depends_on_ids_titles_and_texts() -> None:
    base = corpus_fingerprint(CORPUS)
    assert base["count"] == 7 and len(base["sha256"]) == 64
    for changed in (Passage("px", "Oslo", CORPUS[5].text), Passage("p5", "Oslo!", CORPUS[5].text)):
        assert corpus_fingerprint(CORPUS[:5] + [changed] + CORPUS[6:])["sha256"] != base["sha256"]
    assert corpus_fingerprint(list(reversed(CORPUS)))["sha256"] != base["sha256"]


# --- load_or_build_bm25 -------------------------------------------------------------------------


def test_load_or_build_reuses_a_matching_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index_dir = tmp_path / "corpus.jsonl.bm25"
    built = load_or_build_bm25(CORPUS, index_dir)
    assert (index_dir / "meta.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl.bm25"]  # no temporary folder left

    def no_build(*args: object, **kwargs: object) -> BM25Retriever:
        raise AssertionError("the saved index should have been loaded")

    monkeypatch.setattr(BM25Retriever, "build", no_build)
    loaded = load_or_build_bm25(CORPUS, index_dir)
    assert loaded.search_batch(["oslo", "stone museum"], 3) == built.search_batch(["oslo", "stone museum"], 3)


def test_changed_corpus_invalidates_saved_index(tmp_path: Path) -> None:
    index_dir = tmp_path / "idx"
    load_or_build_bm25(CORPUS, index_dir)
    old_sha = json.loads((index_dir / "meta.json").read_text(encoding="utf-8"))["sha256"]
    changed = CORPUS[:6] + [Passage("p6", "Zeppelin Quartz", "A rare mineral found only near Bergen.")]
    r = load_or_build_bm25(changed, index_dir)
    assert ids(r.search("Bergen", 3)) == ["p6"]
    assert r.search("Tromso", 3) == []
    meta = json.loads((index_dir / "meta.json").read_text(encoding="utf-8"))
    assert meta["sha256"] == corpus_fingerprint(changed)["sha256"] != old_sha
    assert ids(BM25Retriever.load(index_dir).search("Bergen", 3)) == ["p6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]


def test_load_or_build_rebuilds_a_damaged_index(tmp_path: Path) -> None:
    index_dir = tmp_path / "idx"
    load_or_build_bm25(CORPUS, index_dir)
    for npy in index_dir.glob("*.npy"):
        npy.unlink()
    r = load_or_build_bm25(CORPUS, index_dir)
    assert ids(r.search("zeppelin", 2)) == ["p6"]
    assert ids(BM25Retriever.load(index_dir).search("zeppelin", 2)) == ["p6"]


def test_load_or_build_refuses_to_overwrite_other_folders(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me", encoding="utf-8")
    with pytest.raises(
        InputError,
        match=r"is not an index mhgpo wrote \(no mhgpo-index\.json\); refusing to write the "
        r"BM25 index there \(pick a new or empty folder\)$",
    ):
        load_or_build_bm25(CORPUS, folder)
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "keep me"


# --- open_index, JAX ------------------------------------------------------------------------------


def test_open_index_loads_a_saved_bm25_index_as_it_is(tmp_path: Path, retriever: BM25Retriever) -> None:
    retriever.save(tmp_path / "idx")
    opened = open_index(tmp_path / "idx")
    assert isinstance(opened, BM25Retriever) and opened.kind == "bm25"
    assert opened.passages == tuple(CORPUS) and opened.fingerprint == retriever.fingerprint
    with pytest.raises(InputError) as err:
        open_index(tmp_path / "nothing")
    assert str(err.value) == (
        f"{tmp_path / 'nothing'}: not an index (no readable meta.json); build one with `mhgpo index build`"
    )
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "meta.json").write_text('{"kind": "colbert"}', encoding="utf-8")
    with pytest.raises(InputError, match=r"odd: unknown index kind 'colbert' in meta.json$"):
        open_index(tmp_path / "odd")


@pytest.mark.parametrize("chosen", [None, "cuda"])
def test_jax_is_kept_off_the_gpu_unless_chosen(tmp_path: Path, chosen: str | None) -> None:
    """bm25s runs its top-k selection with JAX when JAX is installed; a stand-in `jax` records the platforms JAX
    would start on: the CPU (JAX on a GPU takes 75% of its memory at start), or the user's choice."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os\nPLATFORMS = os.environ.get('JAX_PLATFORMS')\n")
    (fake / "lax.py").write_text("def top_k(x, k):\n    return x[:k], list(range(k))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])])
    if chosen:
        env["JAX_PLATFORMS"] = chosen
    code = "import mhgpo.retrieval.bm25, bm25s.selection as s, jax; print(s.JAX_IS_AVAILABLE, jax.PLATFORMS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", chosen or "cpu"]
