"""Builds what the commands share from their configs: the data, the corpus, the retriever and the team."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mhgpo.config import BUILT_IN, RetrievalConfig, SearchConfig, is_custom
from mhgpo.config.choices import RETRIEVERS, is_retriever_url
from mhgpo.data.formats import context_corpus, load_corpus_jsonl
from mhgpo.data.records import Example, Passage
from mhgpo.data.spec import load_data
from mhgpo.errors import InputError
from mhgpo.paths import context_index_dir, index_dir_for
from mhgpo.team.loader import (
    check_workflow_class,
    construct,
    load_workflow_class,
    system_spec,
    team_config,
    team_section,
)
from mhgpo.team.workflow import Workflow


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


@dataclass(frozen=True)
class Team:
    """The team of a run or an evaluation, resolved once where the command or API call starts and passed down:
    `source` is what `build_workflow` builds from (a built-in team's name, a `Workflow` class or a built instance);
    `system` and `section` are the `system` and resolved `team` section the config records."""

    source: Any
    system: str
    section: dict[str, Any]

    @property
    def agents(self) -> tuple[str, ...]:
        """The team's LLM agents, known before it is built (a class's `agents`, or a built instance's)."""
        if isinstance(self.source, str):
            from mhgpo.team.search_system import LLMOnly, SearchSystem

            return tuple({"mas": SearchSystem, "llm": LLMOnly}[self.source].agents)
        return tuple(self.source.agents)


def resolve_team(cfg: Any, workflow: Any = None) -> Team:
    """The team of `cfg` (a train, sft or eval config): what `cfg.system` and `cfg.team` name, or `workflow`: None
    (what `cfg.system` names), a `Workflow` subclass, a built instance (used as it is; its `config`, when it is an
    instance of its `config_class`, is the team section), or a `Team` already resolved (returned as it is). The
    section is the resolved one (every field of the config class), as config.yaml shows it; `cfg` is not changed."""
    if isinstance(workflow, Team):
        return workflow
    if isinstance(workflow, Workflow):
        cls = type(workflow)
        check_workflow_class(cls)
        config = getattr(workflow, "config", None)
        own = dataclasses.asdict(config) if cls.config_class and isinstance(config, cls.config_class) else {}
        if cfg.team and cfg.team != own:  # (the instance's own section: settled by an earlier call)
            raise InputError(
                f"team.{sorted(cfg.team)[0]}: the workflow was passed already built; set its config "
                f"when constructing it"
            )
        return Team(workflow, system_spec(cls), own)
    if workflow is not None:
        if not (inspect.isclass(workflow) and issubclass(workflow, Workflow)):
            raise InputError(f"workflow: expected a Workflow subclass or instance, got {workflow!r}")
        check_workflow_class(workflow)
        return Team(workflow, system_spec(workflow), team_section(workflow, cfg.team))
    if is_custom(cfg.system):
        cls = load_workflow_class(cfg.system)
        return Team(cls, cfg.system, team_section(cls, cfg.team))
    return Team(cfg.system, cfg.system, dict(cfg.team))


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


def build_workflow(
    system: Any, data_spec: str, retrieval: RetrievalConfig, search: SearchConfig, team: dict[str, Any] | None = None
) -> Workflow:
    """The team `system` names: `mas` (the default team over the data's corpus), `llm` (the model alone), a
    workflow class (`PATH.py:Class`, `module.path:Class`, or the class itself) built from its `team` section and,
    when its constructor asks, the retriever; a built `Workflow` is returned as it is."""
    from mhgpo.team.search_system import LLMOnly, SearchSystem

    if isinstance(system, Workflow):
        return system
    if isinstance(system, str) and not is_custom(system):
        if system == "mas":
            return SearchSystem(build_retriever(data_spec, retrieval), search)
        if system == "llm":
            return LLMOnly(search)
        raise InputError(
            f"system: unknown system {system!r} (choose one of: {', '.join(BUILT_IN)}, or a workflow "
            f"class PATH.py:Class)"
        )
    cls = load_workflow_class(system) if isinstance(system, str) else system
    return construct(cls, team_config(cls, team), lambda: build_retriever(data_spec, retrieval))


def load_examples(spec: str, limit: int | None = None) -> list[Example]:
    examples = load_data(spec)
    if limit is not None:
        if limit <= 0:
            raise InputError(f"limit: must be positive, got {limit}")
        examples = examples[:limit]
    if not examples:
        raise InputError(f"{spec}: no questions found")
    return examples
