"""Builds what the commands share from their configs: the data, the corpus, the retriever and the team."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from mhgpo.config import RetrievalConfig, SystemConfig
from mhgpo.data import context_corpus, load_corpus_jsonl, load_data
from mhgpo.records import Example, InputError, Passage
from mhgpo.workflow import Workflow

SYSTEMS = ("mas", "llm")


def cache_dir() -> Path:
    return Path(os.environ.get("MHGPO_CACHE") or Path.home() / ".cache" / "mhgpo")


def _spec_path(spec: str) -> Path | None:
    kind, _, path = spec.partition(":")
    return Path(path) if path and kind != "synthetic" else None


def load_corpus(data_spec: str, retrieval: RetrievalConfig) -> tuple[list[Passage], Path]:
    """The passages to search and the folder where their index lives.

    `retrieval.corpus` (a JSONL file) wins; else the synthetic world's corpus; else the paragraphs of the
    data file itself (the offline stand-in for Wikipedia).
    """
    if retrieval.corpus and retrieval.corpus != "context":
        path = Path(retrieval.corpus)
        passages = load_corpus_jsonl(path)
        return passages, Path(retrieval.index) if retrieval.index else _index_dir(path)
    if data_spec.split(":")[0] == "synthetic" and retrieval.corpus != "context":
        from mhgpo.synth import ensure_default_world

        path = ensure_default_world() / "corpus.jsonl"
        return load_corpus_jsonl(path), Path(retrieval.index) if retrieval.index else _index_dir(path)
    source = _spec_path(data_spec)
    passages = context_corpus(load_data(data_spec))
    if not passages:
        raise InputError(f"{data_spec}: the records have no context paragraphs to retrieve from; pass --corpus FILE")
    key = hashlib.sha256(str(Path(source).resolve() if source else data_spec).encode()).hexdigest()[:16]
    return passages, Path(retrieval.index) if retrieval.index else cache_dir() / "indexes" / f"context-{key}"


def _index_dir(corpus_path: Path) -> Path:
    from mhgpo.retrieval import index_dir_for

    return index_dir_for(corpus_path)


def build_retriever(data_spec: str, retrieval: RetrievalConfig):
    from mhgpo.retrieval import load_or_build_bm25

    if retrieval.retriever != "bm25":
        raise InputError(f"retrieval.retriever: unknown retriever {retrieval.retriever!r} (available: bm25)")
    passages, index_dir = load_corpus(data_spec, retrieval)
    return load_or_build_bm25(passages, index_dir)


def build_workflow(system: str, data_spec: str, retrieval: RetrievalConfig, search: SystemConfig) -> Workflow:
    from mhgpo.search_system import LLMOnly, SearchSystem

    if system == "mas":
        return SearchSystem(build_retriever(data_spec, retrieval), search)
    if system == "llm":
        return LLMOnly(search)
    raise InputError(f"system: unknown system {system!r} (choose one of: {', '.join(SYSTEMS)})")


def load_examples(spec: str, limit: int | None = None) -> list[Example]:
    examples = load_data(spec)
    if limit is not None:
        if limit <= 0:
            raise InputError(f"limit: must be positive, got {limit}")
        examples = examples[:limit]
    if not examples:
        raise InputError(f"{spec}: no questions found")
    return examples
