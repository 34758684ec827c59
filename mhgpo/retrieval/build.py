"""Builds the retriever a config asks for: the corpus of a data set, its index (a saved one reused when it matches,
else built and saved), an index folder opened as it is, or a retrieval service at a URL."""

from __future__ import annotations

from pathlib import Path

from mhgpo.config import RetrievalConfig
from mhgpo.config.choices import RETRIEVERS, is_retriever_url
from mhgpo.data.formats import context_corpus, load_corpus_jsonl
from mhgpo.data.records import Passage
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError
from mhgpo.paths import context_index_dir, index_dir_for


def _index_suffix(retrieval: RetrievalConfig) -> str:
    """How the index folder of a corpus is named for this retriever: `bm25`, or `dense-<encoder>[-hnsw]`."""
    if retrieval.retriever != "dense":
        return "bm25"
    from mhgpo.retrieval.dense import encoder_slug

    kind = "" if retrieval.index_type == "flat" else f"-{retrieval.index_type}"
    return f"dense-{encoder_slug(retrieval.model)}{kind}"


def load_corpus(data_spec: str, retrieval: RetrievalConfig) -> tuple[list[Passage], Path]:
    """The passages to search and the folder where their index lives (`retrieval.index` when set).

    `retrieval.corpus` names a file (JSONL, or DPR TSV) or `context`; when it is unset, the synthetic world brings
    its own corpus and other data its own paragraphs (the "context corpus", the offline stand-in for Wikipedia).
    """
    from mhgpo.data.formats import corpus_file
    from mhgpo.data.spec import spec_path

    suffix = _index_suffix(retrieval)
    chosen = Path(retrieval.index).expanduser() if retrieval.index else None
    if retrieval.corpus and retrieval.corpus != "context":
        path, reader = corpus_file(retrieval.corpus)
        return reader(path), chosen or index_dir_for(path, suffix)
    if data_spec.split(":")[0] == "synthetic" and retrieval.corpus != "context":
        from mhgpo.data.synth_files import ensure_default_world

        path = ensure_default_world() / "corpus.jsonl"
        return load_corpus_jsonl(path), chosen or index_dir_for(path, suffix)
    source = spec_path(data_spec)
    passages = context_corpus(load_data(data_spec))
    if not passages:
        raise InputError(f"{data_spec}: the records have no context paragraphs to retrieve from; pass --corpus FILE")
    return passages, chosen or context_index_dir(str(Path(source).resolve() if source else data_spec), suffix)


def open_index(directory: Path | str):
    """Load the saved index in `directory` as it is (BM25 or dense, as its meta.json says)."""
    from mhgpo.retrieval.bm25 import META_FILE, BM25Retriever, index_kind, read_meta

    directory = Path(directory)
    meta = read_meta(directory)
    if meta is None:
        raise InputError(f"{directory}: not an index (no readable {META_FILE}); build one with `mhgpo index build`")
    kind = index_kind(meta)
    if kind == "bm25":
        return BM25Retriever.load(directory)
    if kind == "dense":
        from mhgpo.retrieval.dense import DenseRetriever

        return DenseRetriever.load(directory)
    raise InputError(f"{directory}: unknown index kind {kind!r} in {META_FILE}")


def _open_built_index(data_spec: str, retrieval: RetrievalConfig):
    """The index in `retrieval.index`, loaded as it is, after checking it fits the retriever and corpus asked for."""
    from mhgpo.retrieval.bm25 import corpus_fingerprint

    retriever = open_index(Path(retrieval.index).expanduser())
    if retriever.kind != retrieval.retriever:
        raise InputError(
            f"retrieval.index: {retrieval.index} holds a {retriever.kind} index, but "
            f"retrieval.retriever is {retrieval.retriever!r}; pass --retriever {retriever.kind}"
        )
    if retrieval.corpus:
        passages, _ = load_corpus(data_spec, retrieval)
        if corpus_fingerprint(passages) != retriever.fingerprint:
            raise InputError(
                f"retrieval.index: {retrieval.index} was built from another corpus than "
                f"{retrieval.corpus!r} ({retriever.fingerprint['count']} passages, not {len(passages)}); "
                f"rebuild it with `mhgpo index build` or leave out --index"
            )
    return retriever


def build_retriever(data_spec: str, retrieval: RetrievalConfig):
    """The retriever `retrieval` asks for over the corpus of `data_spec`: a built index in `retrieval.index` is
    loaded as it is; otherwise the corpus's saved index is reused when it matches, or built and saved. A URL
    (`http://HOST:PORT/retrieve`) is a retrieval service (`mhgpo.retrieval.http`)."""
    from mhgpo.retrieval.bm25 import load_or_build_bm25, read_meta

    if is_retriever_url(retrieval.retriever):
        return open_service(retrieval)
    if retrieval.retriever not in RETRIEVERS:
        raise InputError(
            f"retrieval.retriever: unknown retriever {retrieval.retriever!r} (available: {', '.join(RETRIEVERS)})"
        )
    if retrieval.index and read_meta(Path(retrieval.index).expanduser()) is not None:
        return _open_built_index(data_spec, retrieval)
    passages, index_dir = load_corpus(data_spec, retrieval)
    if retrieval.retriever == "dense":
        from mhgpo.retrieval.dense import load_or_build_dense

        return load_or_build_dense(
            passages, index_dir, retrieval.model, index_type=retrieval.index_type, batch_size=retrieval.batch_size
        )
    return load_or_build_bm25(passages, index_dir)


def open_service(retrieval: RetrievalConfig):
    """The retrieval service at the URL `retrieval.retriever`, probed with one small request (so that an
    unreachable or foreign server is named before any model loads). Its password, redacted in the config, comes
    from where the URL was given (or `$MHGPO_RETRIEVER_AUTH`: `service_auth`)."""
    from mhgpo.config.eval import service_auth
    from mhgpo.retrieval.http import HTTPRetriever

    retriever = HTTPRetriever(
        retrieval.retriever,
        request_queries=retrieval.request_queries,
        timeout=retrieval.timeout,
        retries=retrieval.retries,
        total_timeout=retrieval.total_timeout,
        max_answer_bytes=retrieval.max_answer_bytes,
        max_passage_chars=retrieval.max_passage_chars,
        auth=service_auth(retrieval.retriever),
    )
    retriever.probe()
    return retriever
