"""The valid values of the enumerated config keys that are plain lists, in one place: the config validation, the
CLI's `choices` and the modules that dispatch on them all read these tuples. The keys whose values are extension
points read their tables instead: `sampler` (`mhgpo/config/samplers.py`); `algo`, `advantage`, `optim.loss` and
`generation.engine` (`mhgpo/config/tables.py`)."""

from __future__ import annotations

SYSTEMS = ("mas", "llm")  # the built-in teams; any other `system` names a workflow class (mhgpo/team/loader.py)
RR_REGROUP = ("fork", "role", "all")
AGGREGATORS = ("mean", "max", "min", "rand")  # reward.aggr
SCHEDULES = ("constant", "cosine")  # optim.schedule
REFERENCES = ("init", "base")  # the KL term's reference policy
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")  # the `precision` key: see mhgpo/model/precision.py
RETRIEVERS = ("bm25", "dense")  # retrieval.retriever (or the URL of a retrieval service: is_retriever_url)
INDEX_TYPES = ("flat", "hnsw")  # retrieval.index_type (dense)
QUERIES = ("question", "rewriter")  # eval-retrieval's query
EXPORT_DTYPES = ("float32", "bfloat16")  # mhgpo export --dtype
OLD_LOGPROBS = ("trainer", "engine")  # optim.old_logprobs: whose log-probs the ratio divides by
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # report_to (mhgpo/rl/trackers.py)
BUDGET_CLOCKS = ("cpu", "wall")  # budget_clock: the process's CPU time or wall time (mhgpo/rl/budget.py)


def is_retriever_url(value: str) -> bool:
    """True for `http://HOST[:PORT]/PATH` and `https://...`: a retrieval service (mhgpo/retrieval/http.py)."""
    return value.startswith(("http://", "https://"))


def one_of(values: tuple[str, ...]) -> str:
    """`a, b or c`: the valid values as an error message lists them."""
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0]
