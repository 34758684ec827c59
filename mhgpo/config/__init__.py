"""Typed configuration: dataclasses, YAML files that are dumps of them, and `key=value` overrides.

Every entry point has one config dataclass (`EvalConfig`, `TrainConfig`, `SFTConfig`, `RetrievalEvalConfig`,
`IndexConfig`, `ServeConfig`). A YAML file is a (partial) dump of it; command-line overrides use dotted keys
(`search.top_k=5`, `optim.lr=1e-5`). Unknown keys and values of the wrong type are rejected with an `InputError`
that names the key (and the file when there is one).

This module gathers the config API: the loading machinery lives in `config_load.py`, the shared sections and the
evaluation configs in `config_eval.py`, the training configs in `config_train.py`, and the valid values of the
enumerated keys in `choices.py`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mhgpo.config.choices import ALGOS, CRITIC_ALGOS, PRECISIONS, RR_REGROUP, SINGLE_AGENT_ALGOS
from mhgpo.config.eval import (
    BUILT_IN,
    AgentSampling,
    EvalConfig,
    GenerationConfig,
    IndexConfig,
    RetrievalConfig,
    RetrievalEvalConfig,
    ServeConfig,
    SystemConfig,
    check_precision,
    check_system,
    is_custom,
)
from mhgpo.config.load import dump_config, from_dict, load_config, parse_override, to_dict
from mhgpo.config.train import (
    CRITIC_LR_FACTOR,
    CriticConfig,
    LoraConfig,
    OptimConfig,
    RewardConfig,
    SFTConfig,
    TrainConfig,
    WarmStartConfig,
    critic_lr,
    default_sampler,
)

__all__ = [
    "ALGOS",
    "BUILT_IN",
    "CRITIC_ALGOS",
    "CRITIC_LR_FACTOR",
    "PRECISIONS",
    "RR_REGROUP",
    "SINGLE_AGENT_ALGOS",
    "AgentSampling",
    "CriticConfig",
    "EvalConfig",
    "GenerationConfig",
    "IndexConfig",
    "LoraConfig",
    "OptimConfig",
    "RetrievalConfig",
    "RetrievalEvalConfig",
    "RewardConfig",
    "ServeConfig",
    "SFTConfig",
    "SystemConfig",
    "TrainConfig",
    "WarmStartConfig",
    "check_precision",
    "check_system",
    "critic_lr",
    "default_sampler",
    "demo_config_path",
    "dump_config",
    "from_dict",
    "is_custom",
    "load_config",
    "parse_override",
    "to_dict",
]


def demo_config_path() -> Path:
    """The embedded config of `mhgpo demo` (a copy is `configs/demo.yaml`)."""
    return Path(str(resources.files("mhgpo.config").joinpath("demo.yaml")))
