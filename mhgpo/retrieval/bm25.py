"""Retrieval over a passage corpus: the shared result cache, BM25 (`bm25s`), and saved indexes.

`CachedRetriever` is the base of every retriever (BM25 here, dense in `mhgpo.retrieval.dense`): `search` and
`search_batch` go through one LRU cache keyed by (query, k), so repeated sub-queries are searched once; each
retriever owns its cache, so a cached result is keyed by (retriever, query, k). Subclasses implement only
`_search_scored(queries, k)` for distinct queries that are not cached (passages with their scores).

BM25: each passage is indexed as `title + " " + text`, lowercased, split into word tokens, with English stop
words removed; tokens are stemmed with PyStemmer's English stemmer when that package is installed (it is
optional). Only passages that share at least one token with the query are returned (a query of stop words alone
finds nothing), best score first.

Saved indexes are folders with `meta.json` (kind, corpus fingerprint, settings), `passages.jsonl`, the index files
and, written last, `mhgpo-index.json`, the marker that lists the files mhgpo wrote: only a folder with that marker
(or an index of an earlier version that holds nothing else) is replaced by a later save; other folders are refused
unless `overwrite`, and even then only the index files are written into them. `load_or_build_bm25` reuses a folder
whose meta matches and rebuilds it otherwise (written to a temporary folder, then moved into place).
`mhgpo/retrieval/build.py` opens any saved index as it is (`open_index`) and `mhgpo/paths.py` says where the index of a
corpus file lives (`index_dir_for`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Union

import bm25s
import numpy as np

from mhgpo.data.formats import load_corpus_jsonl
from mhgpo.data.records import Passage
from mhgpo.errors import InputError
from mhgpo.io import remove_stale_temps, temp_path

__all__ = [
    "BM25Retriever",
    "CacheInfo",
    "CachedRetriever",
    "corpus_fingerprint",
    "load_or_build_bm25",
    "read_meta",
    "save_index",
]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

META_FILE = "meta.json"
MARKER_FILE = "mhgpo-index.json"  # written by mhgpo alone, last: the folder is an index mhgpo made (index_files)
MARKER_FORMAT = 1
PASSAGES_FILE = "passages.jsonl"
INDEX_FORMAT = 1
STOPWORDS = "en"
# The files mhgpo's indexes are made of (bm25s's files, the passages, meta.json, a dense index's FAISS file): the only
# names a save replaces or removes on the word of a marker, and all that an index saved before markers existed holds.
INDEX_FILES = frozenset(
    {
        "meta.json",
        "passages.jsonl",
        "index.faiss",
        "params.index.json",
        "vocab.index.json",
        "data.csc.index.npy",
        "indices.csc.index.npy",
        "indptr.csc.index.npy",
    }
)
DEFAULT_CACHE_SIZE = 65536
DEFAULT_CACHE_BYTES = 256 << 20  # the result cache's bytes (its queries, and passages it holds alone), at most
ENTRY_BYTES = 200  # a cache entry's own objects (key tuple, ordered-dict node, tuple of hits), about


class CacheInfo(NamedTuple):
    """Counters of the (query, k) result cache; `nbytes`: about how many bytes it holds (at most `maxbytes`)."""

    hits: int
    misses: int
    size: int
    maxsize: int
    nbytes: int = 0
    maxbytes: int = DEFAULT_CACHE_BYTES


def corpus_fingerprint(passages: Sequence[Passage]) -> dict[str, Any]:
    """`{"count": N, "sha256": HEX}` over the ids, titles and texts of `passages`, in order."""
    digest = hashlib.sha256()
    for p in passages:
        digest.update(json.dumps([p.id, p.title, p.text], ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return {"count": len(passages), "sha256": digest.hexdigest()}


def write_passages(passages: Sequence[Passage], path: Path) -> None:
    """`passages.jsonl` of a saved index: one `{id, title, text}` a line."""
    with open(path, "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "title": p.title, "text": p.text}, ensure_ascii=False) + "\n")


def read_index_passages(directory: Path, meta: dict[str, Any]) -> list[Passage]:
    """The passages of a saved index, checked against the fingerprint in its meta."""
    passages = load_corpus_jsonl(directory / PASSAGES_FILE) if meta.get("count") else []
    if corpus_fingerprint(passages) != {"count": meta.get("count"), "sha256": meta.get("sha256")}:
        raise InputError(f"{directory}: {PASSAGES_FILE} does not match {META_FILE}; delete the folder to rebuild")
    return passages


# --- the shared result cache --------------------------------------------------------------------


class CachedRetriever:
    """Base class of the retrievers: `search`/`search_batch` through an LRU cache keyed by (query, k).

    Subclasses set `passages` and `kind`, and implement `_search_scored(queries, k)` (or `_search_uncached`, when
    they have no scores), which gets each distinct uncached query of a batch once and returns its passages, best
    first.
    """

    kind = ""
    passages: tuple[Passage, ...]
    fingerprint: dict[str, Any]

    def __init__(
        self, passages: Sequence[Passage], cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES
    ) -> None:
        self.passages = tuple(passages)
        self.fingerprint = corpus_fingerprint(self.passages)
        self._cache: OrderedDict[tuple[str, int], tuple[Passage, ...]] = OrderedDict()
        self._cache_size, self._cache_bytes = cache_size, cache_bytes
        self._entry_sizes: dict[tuple[str, int], int] = {}  # bytes of each entry (`_entry_bytes`)
        self._cache_used = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, query: str, k: int) -> list[Passage]:
        """The top `k` passages for `query`."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """`search` for each query; the queries not in the cache are searched together, each once."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        results: list[tuple[Passage, ...] | None] = [None] * len(queries)
        todo: dict[str, list[int]] = {}
        with self._lock:
            for i, query in enumerate(queries):
                if query in todo:  # repeated within this batch: searched once
                    self._hits += 1
                    todo[query].append(i)
                    continue
                cached = self._cache_get((query, k))
                if cached is not None:
                    self._hits += 1
                    results[i] = cached
                else:
                    self._misses += 1
                    todo[query] = [i]
        found = self._search_uncached(list(todo), k) if todo else []
        with self._lock:
            for (query, positions), hits in zip(todo.items(), found):
                self._cache_put((query, k), hits)
                for i in positions:
                    results[i] = hits
        return [list(r or ()) for r in results]

    def cache_info(self) -> CacheInfo:
        """Hits, misses and size of the (query, k) result cache."""
        with self._lock:
            return CacheInfo(
                self._hits, self._misses, len(self._cache), self._cache_size, self._cache_used, self._cache_bytes
            )

    def cache_clear(self) -> None:
        """Empty the result cache and reset its counters."""
        with self._lock:
            self._cache.clear()
            self._entry_sizes.clear()
            self._hits = self._misses = self._cache_used = 0

    def bound_cache(self, max_bytes: int) -> None:
        """Let the result cache hold at most about `max_bytes` (0: cache nothing); the oldest entries go first."""
        with self._lock:
            self._cache_bytes = max_bytes
            self._evict()

    def _entry_bytes(self, key: tuple[str, int], hits: tuple[Passage, ...]) -> int:
        """About how many bytes a cache entry holds: its query and a reference per passage (a local retriever's
        passages are its corpus's, held anyway; a retriever whose passages come from elsewhere counts them)."""
        return ENTRY_BYTES + sys.getsizeof(key[0]) + 8 * len(hits)

    def _cache_get(self, key: tuple[str, int]) -> tuple[Passage, ...] | None:
        hits = self._cache.get(key)
        if hits is not None:
            self._cache.move_to_end(key)
        return hits

    def _cache_put(self, key: tuple[str, int], hits: tuple[Passage, ...]) -> None:
        size = self._entry_bytes(key, hits)
        if self._cache_size <= 0 or size > self._cache_bytes:
            return
        self._cache_used += size - self._entry_sizes.get(key, 0)
        self._entry_sizes[key] = size
        self._cache[key] = hits
        self._cache.move_to_end(key)
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used entries until the cache is within its entries and bytes."""
        while self._cache and (len(self._cache) > self._cache_size or self._cache_used > self._cache_bytes):
            key, _ = self._cache.popitem(last=False)
            self._cache_used -= self._entry_sizes.pop(key)

    def search_scored(self, queries: Sequence[str], k: int) -> list[list[tuple[Passage, float]]]:
        """The top `k` passages of each query with their scores, best first (not cached: a retrieval service
        answers with scores when asked)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return [list(found) for found in self._search_scored(list(queries), k)] if queries else []

    def _search_uncached(self, queries: list[str], k: int) -> list[tuple[Passage, ...]]:
        """The passages of `_search_scored` without their scores."""
        return [tuple(p for p, _ in found) for found in self._search_scored(queries, k)]

    def _search_scored(self, queries: list[str], k: int) -> list[tuple[tuple[Passage, float], ...]]:
        raise NotImplementedError

    def save(self, directory: PathLike) -> None:
        raise NotImplementedError


# --- BM25 ---------------------------------------------------------------------------------------


def _stemmer() -> Any | None:
    """PyStemmer's English stemmer when installed, else None."""
    try:
        import Stemmer  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Stemmer.Stemmer("english")


def _tokenizer_config(stemmer: Any | None, k1: float, b: float) -> dict[str, Any]:
    return {"stopwords": STOPWORDS, "stemmer": "english" if stemmer is not None else None, "k1": k1, "b": b}


def _doc_text(passage: Passage) -> str:
    return f"{passage.title} {passage.text}"


class BM25Retriever(CachedRetriever):
    """BM25 search over a fixed list of passages, with the shared (query, k) result cache."""

    kind = "bm25"

    def __init__(
        self,
        passages: Sequence[Passage],
        index: bm25s.BM25 | None,
        stemmer: Any | None = None,
        *,
        k1: float = 1.5,
        b: float = 0.75,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """Wrap an already built `bm25s` index (None for an empty corpus); use `build` or `load`."""
        super().__init__(passages, cache_size)
        self._index = index
        self._stemmer = stemmer
        self.k1, self.b = k1, b

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        *,
        k1: float = 1.5,
        b: float = 0.75,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> BM25Retriever:
        """Index `passages` (title + text of each)."""
        stemmer = _stemmer()
        index = None
        if passages:
            tokens = bm25s.tokenize(
                [_doc_text(p) for p in passages], stopwords=STOPWORDS, stemmer=stemmer, show_progress=False
            )
            index = bm25s.BM25(k1=k1, b=b)
            index.index(tokens, show_progress=False)
        return cls(passages, index, stemmer, k1=k1, b=b, cache_size=cache_size)

    def meta(self) -> dict[str, Any]:
        """What `save` writes to meta.json: format, corpus fingerprint and tokenizer settings."""
        return {"format": INDEX_FORMAT, **self.fingerprint, **_tokenizer_config(self._stemmer, self.k1, self.b)}

    def save(self, directory: PathLike) -> None:
        """Write the bm25s index, passages.jsonl, meta.json and (last) mhgpo's marker into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self._index is not None:
            self._index.save(str(directory), show_progress=False)
        write_passages(self.passages, directory / PASSAGES_FILE)
        write_meta(directory, self.meta(), self.kind)

    @classmethod
    def load(cls, directory: PathLike, *, cache_size: int = DEFAULT_CACHE_SIZE) -> BM25Retriever:
        """Load an index written by `save`; InputError if it is missing, incomplete or inconsistent."""
        directory = Path(directory)
        meta = read_meta(directory)
        if meta is None:
            raise InputError(f"{directory}: not a BM25 index (no readable {META_FILE})")
        return cls._from_meta(directory, read_index_passages(directory, meta), meta, cache_size)

    @classmethod
    def _from_meta(
        cls, directory: Path, passages: Sequence[Passage], meta: dict[str, Any], cache_size: int
    ) -> BM25Retriever:
        stemmer = _stemmer() if meta.get("stemmer") else None
        if meta.get("stemmer") and stemmer is None:
            raise InputError(f"{directory}: index was built with PyStemmer, which is not installed")
        k1, b = float(meta.get("k1", 1.5)), float(meta.get("b", 0.75))
        index = None
        if passages:
            try:
                index = bm25s.BM25.load(str(directory), show_progress=False)
            except (OSError, ValueError, KeyError) as err:
                raise InputError(f"{directory}: cannot load the bm25s index ({err})") from None
            if int(index.scores["num_docs"]) != len(passages):
                raise InputError(
                    f"{directory}: index holds {index.scores['num_docs']} documents, expected {len(passages)}"
                )
        return cls(passages, index, stemmer, k1=k1, b=b, cache_size=cache_size)

    # --- search ---------------------------------------------------------------------------------

    def search(self, query: str, k: int) -> list[Passage]:
        """The top `k` passages for `query` (fewer when fewer share a token with it)."""
        return self.search_batch([query], k)[0]

    def _query_tokens(self, queries: list[str]) -> list[list[str]]:
        """Query tokens that occur in the index vocabulary (possibly none)."""
        assert self._index is not None
        tokens = bm25s.tokenize(
            queries, stopwords=STOPWORDS, stemmer=self._stemmer, return_ids=False, show_progress=False
        )
        vocab = self._index.vocab_dict
        return [[t for t in query if t and t in vocab] for query in tokens]

    def _search_scored(self, queries: list[str], k: int) -> list[tuple[tuple[Passage, float], ...]]:
        """All queries scored in one bm25s call."""
        if not queries or k == 0 or self._index is None:
            return [() for _ in queries]
        tokens = self._query_tokens(queries)
        live = [i for i, t in enumerate(tokens) if t]
        found: list[tuple[tuple[Passage, float], ...]] = [() for _ in queries]
        if not live:
            return found
        k_eff = min(k, len(self.passages))
        docs, scores = self._index.retrieve([tokens[i] for i in live], k=k_eff, show_progress=False)
        for row, i in enumerate(live):
            found[i] = self._ranked(np.asarray(docs[row]), np.asarray(scores[row]))
        return found

    def _ranked(self, docs: np.ndarray, scores: np.ndarray) -> tuple[tuple[Passage, float], ...]:
        """Passages with a positive score and their scores, best first (ties by corpus order)."""
        pairs = sorted((-float(s), int(d)) for d, s in zip(docs, scores) if s > 0)
        return tuple((self.passages[d], -s) for s, d in pairs)


# --- on-disk indexes ----------------------------------------------------------------------------


def read_meta(directory: PathLike) -> dict[str, Any] | None:
    """The meta.json of a saved index, or None when it is absent or unreadable."""
    try:
        meta = json.loads((Path(directory) / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def index_kind(meta: dict[str, Any]) -> str:
    """The retriever a saved index is for (indexes written before kinds were recorded are BM25)."""
    return str(meta.get("kind", "bm25"))


def _expected_meta(passages: Sequence[Passage], k1: float, b: float) -> dict[str, Any]:
    return {"format": INDEX_FORMAT, **corpus_fingerprint(passages), **_tokenizer_config(_stemmer(), k1, b)}


def write_meta(directory: Path, meta: dict[str, Any], kind: str) -> None:
    """Finish saving an index into `directory`: meta.json, then the marker that says mhgpo wrote the folder and
    lists its files (the only files a later save may replace or remove there)."""
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    files = sorted(p.name for p in directory.iterdir() if p.name != MARKER_FILE)
    marker = {"mhgpo_index": MARKER_FORMAT, "kind": kind, "files": files}
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def index_files(directory: Path) -> set[str] | None:
    """The names of the files mhgpo wrote in the index folder `directory`, or None when it is not an index mhgpo
    wrote. Its marker (a plain file, not a link) lists them (only names of `INDEX_FILES` count, so a forged marker
    cannot claim a user's files); a folder saved before markers existed counts when its
    meta.json has mhgpo's fields and it holds nothing but the files mhgpo writes. A `meta.json` alone proves
    nothing: any folder may hold one."""
    marker = directory / MARKER_FILE
    if marker.is_symlink() or not marker.is_file():
        return _legacy_index_files(directory)
    try:
        tree = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(tree, dict)
        or tree.get("mhgpo_index") != MARKER_FORMAT
        or not isinstance(tree.get("files"), list)
    ):
        return None
    return {name for name in tree["files"] if name in INDEX_FILES} | {MARKER_FILE}


def _legacy_index_files(directory: Path) -> set[str] | None:
    meta = read_meta(directory) if not (directory / META_FILE).is_symlink() else None
    if meta is None or not isinstance(meta.get("format"), int) or not {"count", "sha256"} <= set(meta):
        return None
    entries = list(directory.iterdir())
    if any(p.name not in INDEX_FILES or p.is_symlink() or not p.is_file() for p in entries):
        return None
    return {p.name for p in entries}


def _install(tmp: Path, target: Path, ours: set[str] | None) -> None:
    """Move the freshly saved index `tmp` to `target`. A folder that holds only mhgpo's files (or nothing) is
    replaced whole (renamed aside, then deleted); otherwise only the index files are replaced one by one, the
    stale ones that mhgpo's marker lists are removed, and every other file in the folder is left alone."""
    if not target.exists():
        os.replace(tmp, target)
        return
    entries = {p.name for p in target.iterdir()}
    if not entries or (ours is not None and entries <= ours):
        old = temp_path(target)  # a build killed here leaves it for the next build to remove
        old.mkdir()
        os.replace(target, old / "index")
        try:
            os.replace(tmp, target)
        finally:
            shutil.rmtree(old, ignore_errors=True)
        return
    new = {p.name for p in tmp.iterdir()}
    for name in (MARKER_FILE, META_FILE):  # an index cut short here is no longer loadable, nor taken for ours
        if name in entries and not (target / name).is_dir():
            (target / name).unlink()
    for name in sorted(new - {MARKER_FILE, META_FILE}) + [META_FILE, MARKER_FILE]:
        if (target / name).is_dir() and not (target / name).is_symlink():
            raise InputError(f"{target / name}: a folder is in the way of the index file {name}")
        os.replace(tmp / name, target / name)  # a link there is replaced, never followed
    for name in sorted((ours or set()) - new):
        if (target / name).is_symlink() or (target / name).is_file():
            (target / name).unlink()


def check_index_target(index_dir: Path, kind: str = "retrieval", overwrite: bool | None = None) -> set[str] | None:
    """Raise InputError unless `index_dir` is absent, empty, an index mhgpo wrote (which saving replaces) or
    `overwrite` is set (then only mhgpo's index files in it are replaced); return the files mhgpo wrote there.
    `overwrite=None`: the caller offers no way to overwrite (the message does not suggest one)."""
    index_dir = Path(index_dir)
    if index_dir.is_symlink():
        raise InputError(f"{index_dir}: is a link; pass the folder it points to as the {kind} index folder")
    if not index_dir.exists():
        return None
    if not index_dir.is_dir():
        raise InputError(f"{index_dir}: exists and is not a folder (the {kind} index folder)")
    ours = index_files(index_dir)
    if ours is None and not overwrite and any(index_dir.iterdir()):
        offer = (
            ""
            if overwrite is None
            else (", or pass --overwrite to write the index files into it, leaving its other files alone")
        )
        raise InputError(
            f"{index_dir}: holds files and is not an index mhgpo wrote (no {MARKER_FILE}); refusing to "
            f"write the {kind} index there (pick a new or empty folder{offer})"
        )
    return ours


def save_index(retriever: CachedRetriever, index_dir: PathLike, label: str = "", overwrite: bool | None = None) -> None:
    """Save `retriever` into `index_dir` through a temporary folder beside it: a new or empty folder, or one that
    holds an index mhgpo wrote and nothing else, is replaced atomically; with `overwrite`, or when other files are
    there beside mhgpo's index, only the index files are replaced. A folder that holds anything else and is not an
    index mhgpo wrote is left alone (InputError) unless `overwrite`."""
    index_dir = Path(index_dir)
    ours = check_index_target(index_dir, label or retriever.kind, overwrite)
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(index_dir, "index build")
    tmp = temp_path(index_dir)
    tmp.mkdir()
    try:
        retriever.save(tmp)
        _install(tmp, index_dir, ours)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_or_warn(retriever: CachedRetriever, index_dir: Path, label: str) -> None:
    """`save_index`, with a warning instead of an error when the disk refuses (the index still works in memory)."""
    try:
        save_index(retriever, index_dir, label)
    except OSError as err:
        log.warning("could not save the %s index to %s (%s); using it in memory", label, index_dir, err)


def load_or_build_bm25(
    passages: Sequence[Passage], index_dir: PathLike, *, k1: float = 1.5, b: float = 0.75
) -> BM25Retriever:
    """Load the index in `index_dir` if it was built from these passages with these settings;
    otherwise build one and save it there (written to a temporary folder, then renamed)."""
    index_dir = Path(index_dir)
    meta = read_meta(index_dir)
    if meta == _expected_meta(passages, k1, b):
        try:
            return BM25Retriever._from_meta(index_dir, passages, meta, DEFAULT_CACHE_SIZE)
        except InputError as err:
            log.warning("rebuilding the BM25 index: %s", err)
    retriever = BM25Retriever.build(passages, k1=k1, b=b)
    save_or_warn(retriever, index_dir, "BM25")
    return retriever
