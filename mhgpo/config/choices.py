"""The valid values of the enumerated config keys that are plain lists, in one place: the config validation, the
CLI's `choices` and the modules that dispatch on them all read these tuples. The keys whose values are extension
points read their tables instead: `sampler` (`mhgpo/config/samplers.py`); `algo`, `advantage`, `optim.loss` and
`generation.engine` (`mhgpo/config/tables.py`)."""

from __future__ import annotations

import re
from typing import Any

SYSTEMS = ("mas", "llm")  # the built-in teams; any other `system` names a workflow class (mhgpo/team/loader.py)
RR_REGROUP = ("fork", "role", "all")
AGGREGATORS = ("mean", "max", "min", "rand")  # reward.aggr
SCHEDULES = ("constant", "cosine")  # optim.schedule
SFT_WEIGHTINGS = ("output", "token")  # warm_start.loss_weighting, mhgpo sft's loss_weighting
REFERENCES = ("init", "base")  # the KL term's reference policy
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")  # the `precision` key: see mhgpo/model/precision.py
RETRIEVERS = ("bm25", "dense")  # retrieval.retriever (or the URL of a retrieval service: is_retriever_url)
INDEX_TYPES = ("flat", "hnsw")  # retrieval.index_type (dense)
QUERIES = ("question", "rewriter")  # eval-retrieval's query
EXPORT_DTYPES = ("float32", "bfloat16")  # mhgpo export --dtype
OLD_LOGPROBS = ("trainer", "engine")  # optim.old_logprobs: whose log-probs the ratio divides by
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")  # report_to (mhgpo/runtime/trackers.py)
BUDGET_CLOCKS = ("cpu", "wall")  # budget_clock: the process's CPU time or wall time (mhgpo/runtime/budget.py)


def is_retriever_url(value: str) -> bool:
    """True for `http://HOST[:PORT]/PATH` and `https://...`: a retrieval service (mhgpo/retrieval/http.py)."""
    return value.startswith(("http://", "https://"))


REDACTED = "***"  # what stands for a URL's password wherever the URL is recorded or printed


def split_userinfo(url: str) -> tuple[str, str, str]:
    """`(userinfo, url without it, redacted url)` of `scheme://USERINFO@host/...` (the userinfo is what precedes
    the last `@` of the authority, as urllib and requests read it); `("", url, url)` without one. The redacted URL
    keeps the user name: `user:***@` (a userinfo without a password may be a token: `***@`)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", url, url
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return "", url, url
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:{REDACTED}" if colon else REDACTED
    return userinfo, f"{scheme}://{host}{rest[end:]}", f"{scheme}://{shown}@{host}{rest[end:]}"


def redact_url(url: str) -> str:
    """`url` with the password of its userinfo replaced by `***` (see `split_userinfo`)."""
    return split_userinfo(url)[2]


_URL_USERINFO = re.compile(r"[A-Za-z][\w+.-]*://[^\s/?#'\"]*@")  # a URL's start, up to its userinfo's last @


def redact_text(text: str) -> str:
    """`text` (a message) with the userinfo of every URL in it redacted as `redact_url` does."""
    return _URL_USERINFO.sub(lambda m: redact_url(m.group(0)), text)


def redact_urls(tree: Any) -> Any:
    """A config tree (nested dicts and lists, as `to_dict` makes it) with the password of every URL that has one
    redacted (`user:password@` becomes `user:***@`), for what writes a config (config.yaml, the trackers). (The
    retrieval service's URL is redacted when the config is read, a token alone included: `RetrievalConfig`.)"""
    if isinstance(tree, dict):
        return {k: redact_urls(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(redact_urls(v) for v in tree)
    if isinstance(tree, str) and "://" in tree and ":" in split_userinfo(tree)[0]:
        return redact_url(tree)
    return tree


def one_of(values: tuple[str, ...]) -> str:
    """`a, b or c`: the valid values as an error message lists them."""
    return f"{', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else values[0]
