"""The reference of every config key, `docs/config.md`, made from the config dataclasses:
`python -m mhgpo.config.reference > docs/config.md`.

Each key's one-line meaning is the string that follows its field in the class body (an attribute docstring); its
type and default come from the dataclass, its valid values from :func:`valid_values`: the choice tables
(`mhgpo/config/choices.py`, `samplers.py`, `tables.py`) for a key that is a choice, the bounds the configs'
`validate` enforces for a number (tests check each bound against `validate`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any

from mhgpo import config as c
from mhgpo.config import choices as ch
from mhgpo.config.eval import MAX_RETRIES
from mhgpo.config.samplers import train_samplers
from mhgpo.config.tables import ADVANTAGE_SCHEMES, ALGORITHMS, ENGINES, POLICY_LOSSES

# The configs of the entry points, in the reference's order, with the commands that read them.
CONFIGS: tuple[tuple[type, str], ...] = (
    (c.TrainConfig, "mhgpo train, mhgpo demo"),
    (c.EvalConfig, "mhgpo eval, mhgpo ask"),
    (c.SFTConfig, "mhgpo sft"),
    (c.RetrievalEvalConfig, "mhgpo eval-retrieval"),
    (c.IndexConfig, "mhgpo index build"),
    (c.ServeConfig, "mhgpo serve-retriever"),
)


@dataclasses.dataclass(frozen=True)
class Bound:
    """The range `validate` enforces for a number: `low` (or above it, `open_low`) to `high`; None: unbounded."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '≥'} {self.low:g}"
        if self.low is None:
            return f"{'<' if self.open_high else '≤'} {self.high:g}"
        return f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


AT_LEAST_1, AT_LEAST_0, POSITIVE, UNIT, SHARE = (
    Bound(1),
    Bound(0),
    Bound(0, open_low=True),
    Bound(0, 1),
    Bound(0, 1, True),
)

# One entry of `valid_values`: the choices (a tuple), a bound, or a sentence; several are joined with "; ".
Valid = tuple[str, ...] | Bound | str


def valid_values() -> dict[type, dict[str, list[Valid]]]:
    """The valid values of each config class's keys that have fewer than their type allows (read from the tables
    now, so that an entry registered in a table shows)."""
    counts = dict.fromkeys
    return {
        c.AgentSampling: {"max_new_tokens": [AT_LEAST_1], "temperature": [POSITIVE], "top_p": [SHARE]},
        c.GenerationConfig: {
            "engine": [tuple(ENGINES)],
            "kv_cache_gb": [POSITIVE],
            "gpu_memory_utilization": [SHARE],
            "sync_check": [AT_LEAST_0],
            "sync_tolerance": [POSITIVE],
            "server_urls": ["http(s)://HOST:PORT URLs, at least one under engine=vllm_server (none otherwise)"],
            "server_timeout": [POSITIVE],
        },
        c.RolloutConfig: {"max_staleness": [("0", "1"), "1 needs generation.engine=vllm_server, LoRA and one process"]},
        c.SearchConfig: counts(
            ("top_k", "max_candidates", "snippet_words", "snippet_chars")
            + ("max_subqueries", "max_query_chars", "max_answer_words"),
            [AT_LEAST_1],
        ),
        c.RetrievalConfig: {
            "corpus": ["`context` or a corpus file (PATH.jsonl, PATH.tsv, jsonl:PATH, tsv:PATH)"],
            "retriever": [ch.RETRIEVERS, "or the URL of a retrieval service (http://HOST:PORT/PATH, https://...)"],
            "index": ["a folder; not with a retrieval service"],
            "index_type": [ch.INDEX_TYPES],
            **counts(("batch_size", "request_queries", "max_answer_bytes", "max_passage_chars"), [AT_LEAST_1]),
            "timeout": [POSITIVE],
            "retries": [Bound(0, MAX_RETRIES)],
            "total_timeout": [POSITIVE],
        },
        c.TeamRunConfig: {
            "system": [ch.SYSTEMS, "or a workflow class: PATH.py:Class or module.path:Class"],
            "precision": [ch.PRECISIONS],
            "gen_batch_size": [AT_LEAST_1],
            "max_prompt_tokens": [AT_LEAST_1],
        },
        c.EvalConfig: {
            "limit": [AT_LEAST_1],
            "batch_size": [AT_LEAST_1],
            "oracle": ["role names of the team; context"],
        },
        c.RetrievalEvalConfig: {
            "ks": ["a non-empty list of numbers ≥ 1"],
            "query": [ch.QUERIES],
            "precision": [ch.PRECISIONS],
            "limit": [AT_LEAST_1],
            "gen_batch_size": [AT_LEAST_1],
            "max_prompt_tokens": [AT_LEAST_1],
        },
        c.ServeConfig: {
            "port": [Bound(1, 65535)],
            **counts(("max_queries", "max_passages", "max_query_chars"), [AT_LEAST_1]),
            "max_topk": [AT_LEAST_1, "at least default_topk"],
            **counts(("max_body_bytes", "max_connections"), [AT_LEAST_1]),
            "default_topk": [AT_LEAST_1, "at most max_topk"],
            "max_header_bytes": [Bound(1024)],
            "cache_bytes": [AT_LEAST_0],
            **counts(("header_timeout", "body_timeout", "keep_alive"), [POSITIVE]),
            "retrieval": ["retriever: bm25 or dense"],
        },
        c.RewardConfig: {"aggr": [ch.AGGREGATORS]},
        c.OptimConfig: {
            "lr": [POSITIVE],
            **counts(("weight_decay", "warmup_steps", "kl_beta", "entropy_coef"), [AT_LEAST_0]),
            "schedule": [ch.SCHEDULES],
            **counts(("max_grad_norm", "clip_eps"), [POSITIVE]),
            **counts(("ppo_epochs", "micro_batch_tokens", "logprob_chunk"), [AT_LEAST_1]),
            "old_logprobs": [ch.OLD_LOGPROBS],
            "loss": [tuple(POLICY_LOSSES), "icepop: with a separate engine and old_logprobs=trainer"],
            "engine_is_cap": [
                Bound(1),
                "with a separate engine (generation.engine=vllm or vllm_server) and old_logprobs=trainer",
            ],
            "role_lr": ["{role: lr}: the team's roles, each lr > 0; with lora.per_role (RL runs only)"],
        },
        c.LoraConfig: {"r": [AT_LEAST_1], "alpha": [POSITIVE], "dropout": [Bound(0, 1, open_high=True)]},
        c.CriticConfig: {
            "lr": [POSITIVE],
            "warmup_steps": [AT_LEAST_0],
            "gamma": [UNIT],
            "lam": [UNIT],
            "value_clip": [POSITIVE],
        },
        c.WarmStartConfig: {
            **counts(("steps", "batch_size", "limit"), [AT_LEAST_1]),
            "lr": [POSITIVE],
            "schedule": [ch.SCHEDULES],
            **counts(("warmup_steps", "format_limit"), [AT_LEAST_0]),
        },
        c.TrainingRunConfig: {
            "report_to": [ch.TRACKERS, "each at most once"],
            "eval_batch_size": [AT_LEAST_1],
            "max_rounds": [AT_LEAST_1],
            "max_failures": [AT_LEAST_0],
        },
        c.TrainConfig: {
            "algo": [tuple(ALGORITHMS)],
            "sampler": [train_samplers(), "one the algorithm trains with (mhgpo/config/samplers.py)"],
            **counts(("steps", "questions_per_step", "val_limit"), [AT_LEAST_1]),
            "budget_minutes": [POSITIVE],
            "budget_clock": [ch.BUDGET_CLOCKS],
            "group_size": [Bound(2), "1 for an algorithm with a critic (mappo, ppo)"],
            "rr_probs": ["non-negative, summing to 1 (within 1e-6)"],
            "rr_regroup": [ch.RR_REGROUP],
            "advantage": [tuple(ADVANTAGE_SCHEMES), "mhgpo for an algorithm with a critic"],
            "filter_zero_variance": ["not for an algorithm with a critic"],
            "filter_max_questions": ["at least questions_per_step"],
            **counts(("eval_every", "save_every", "keep_checkpoints"), [AT_LEAST_0]),
            "reference": [ch.REFERENCES],
        },
        c.SFTConfig: {
            **counts(("steps", "batch_size", "limit"), [AT_LEAST_1]),
            **counts(("eval_every", "val_limit", "format_limit", "save_every"), [AT_LEAST_0]),
            "lora": ["per_role: false (one shared adapter)"],
        },
    }


# ------------------------------------------------------------------------------------------------ the fields


def own_help(cls: type) -> dict[str, str]:
    """The meaning of each field `cls` declares itself: the string that follows it, on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    found = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = " ".join(after.value.value.split())
    return found


def field_help(cls: type) -> dict[str, str]:
    """The meaning of each field of `cls`, where it has one: its own class's, else a base class's."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            found.update(own_help(klass))
    return {f.name: found[f.name] for f in dataclasses.fields(cls) if f.name in found}


def field_valid(cls: type, name: str, table: dict[type, dict[str, list[Valid]]]) -> list[Valid]:
    """The valid values of `cls`'s field `name`: the entries of its class and its base classes, nearest first."""
    return [v for klass in cls.__mro__ for v in table.get(klass, {}).get(name, [])]


def config_classes() -> list[type]:
    """Every config class the entry points use: theirs and their sections', each once, in reference order."""
    found: list[type] = []
    for cls, _ in CONFIGS:
        for _, section in sections(cls()):
            if type(section) not in found:
                found.append(type(section))
    return found


def sections(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """`obj` (a config) and its sections, nested ones included, with their dotted paths, `obj`'s own keys first."""
    yield path, obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from sections(value, f"{path}{f.name}.")


# ------------------------------------------------------------------------------------------------- rendering


def type_name(tp: Any) -> str:
    """A field's type as the reference names it: `int`, `str | null`, `list[str]`, `mapping`, `section`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as YAML writes it: null, true, [a, b], {} (a section's defaults are in its own table)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def valid_text(entries: list[Valid]) -> str:
    return "; ".join(", ".join(f"`{v}`" for v in e) if isinstance(e, tuple) else str(e) for e in entries)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(x for x in heading.lower() if x.isalnum() or x in " -_")
    return kept.replace(" ", "-")


def table(cls: type, occurrences: list[tuple[str, str, Any]], slots: dict[str, str], valid: dict) -> str:
    """The rows of config class `cls` as it stands at `occurrences` ((commands, path, instance) each, one slot):
    a key, its type, default (each different one with where), valid values and meaning; a section's row links to
    its table (`slots`: a section's path to its heading)."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    prefix = slot_of(occurrences)
    rows = ["| key | type | default | valid values | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        values = [(where, path, getattr(obj, f.name)) for where, path, obj in occurrences]
        if dataclasses.is_dataclass(hints[f.name]):
            heading = slots[occurrences[0][1] + f.name + "."]
            default = f"[{heading}](#{anchor(heading)})"
        else:
            default = _defaults(values)
        cells = (f"`{prefix}{f.name}`", type_name(hints[f.name]), default, valid_text(field_valid(cls, f.name, valid)))
        rows.append("| " + " | ".join(_cell(x) for x in (*cells, helps[f.name])) + " |")
    return "\n".join(rows)


def slot_of(occurrences: list[tuple[str, str, Any]]) -> str:
    """The key prefix of a section's table: its path (`optim.`), or with ROLE for the agent it configures."""
    paths = list(dict.fromkeys(path for _, path, _ in occurrences))
    if len(paths) == 1:
        return paths[0]
    return paths[0].rstrip(".").rpartition(".")[0] + ".ROLE."


def _defaults(values: list[tuple[str, str, Any]]) -> str:
    distinct: dict[str, list[str]] = {}
    for where, path, value in values:
        distinct.setdefault(yaml_value(value), []).append(where if len({p for _, p, _ in values}) == 1 else path[:-1])
    if len(distinct) == 1:
        return f"`{next(iter(distinct))}`"
    return ", ".join(f"`{v}` ({', '.join(dict.fromkeys(w))})" for v, w in distinct.items())


HEADER = """# Config reference

Every key of every config, made from the config dataclasses in `mhgpo/config/` by
`python -m mhgpo.config.reference > docs/config.md` (edit the code, not this page: a test compares the two). A
YAML config file is a (partial) dump of its command's config; any key can be set on the command line with a
trailing `key=value` (`optim.lr=5e-4`, `search.rewriter.top_p=0.95`); how they combine, and the flags that are
shortcuts for keys, are in [cli.md](cli.md#configs). Valid values: the choices of a key that is one, the range a
number must lie in (`≥ 1`, `(0, 1]`); `null` where the type allows it means what the key's meaning says.
"""


def render() -> str:
    """docs/config.md."""
    valid = valid_values()
    found: dict[tuple[type, str], list[tuple[str, str, Any]]] = {}  # (class, parent path): where it stands
    for cls, commands in CONFIGS:
        for path, obj in sections(cls()):
            if path:
                parent = path.rstrip(".").rpartition(".")[0]
                found.setdefault((type(obj), parent), []).append((commands.split(", ")[0], path, obj))
    slots: dict[str, str] = {}  # a section's path: the heading of its table
    for group in found.values():
        for _, path, _ in group:
            slots[path] = slot_of(group).rstrip(".")
    out = [HEADER]
    headings = [f"{', '.join(f'`{x}`' for x in commands.split(', '))}: `{cls.__name__}`" for cls, commands in CONFIGS]
    out.append("\n".join(f"- [{h.replace('`', '')}](#{anchor(h)})" for h in headings))
    out.append("- [Sections](#sections)\n")
    for (cls, commands), heading in zip(CONFIGS, headings):
        out.append(f"## {heading}\n\n{_doc(cls)}\n")
        out.append(table(cls, [(commands, "", cls())], slots, valid) + "\n")
    out.append("## Sections\n\nThe sections of the configs above, each once, with its defaults where they differ.\n")
    for cls in config_classes():
        for (klass, _), group in found.items():
            if klass is cls:
                paths = ", ".join(f"`{p.rstrip('.')}`" for p in dict.fromkeys(path for _, path, _ in group))
                out.append(f"### {slot_of(group).rstrip('.')}\n\n{paths} ({cls.__name__}): {_doc(cls)}\n")
                out.append(table(cls, group, slots, valid) + "\n")
    return "\n".join(out)


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
