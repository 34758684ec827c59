"""Typed configuration: dataclasses, YAML files that are dumps of them, and `key=value` overrides.

Every entry point has one config dataclass (`EvalConfig`, `TrainConfig`, `SFTConfig`, `RetrievalEvalConfig`,
`IndexConfig`, `ServeConfig`); the keys that the first three share are those of their base classes (`TeamRunConfig`,
and `TrainingRunConfig` for training and the warm start), which `carry_over` copies from one config to another. A YAML file is a (partial) dump of it; command-line overrides use dotted keys
(`search.top_k=5`, `optim.lr=1e-5`). Unknown keys and values of the wrong type are rejected with an `InputError`
that names the key (and the file when there is one).

This module gathers the config API: the loading machinery lives in `load.py`, the shared sections and the evaluation
configs in `eval.py`, the training configs in `train.py`, the valid values of the enumerated keys in `choices.py`,
and the extension axes' tables in `samplers.py` (the rollout samplers) and `tables.py` (algorithms, advantage
schemes, policy losses, generation engines).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mhgpo.config.choices import PRECISIONS, RR_REGROUP
from mhgpo.config.eval import (
    BUILT_IN,
    AgentSampling,
    EvalConfig,
    GenerationConfig,
    IndexConfig,
    RetrievalConfig,
    RetrievalEvalConfig,
    SearchConfig,
    ServeConfig,
    TeamRunConfig,
    carry_over,
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
    RolloutConfig,
    SFTConfig,
    TrainConfig,
    TrainingRunConfig,
    WarmStartConfig,
    critic_lr,
    default_sampler,
    rollout_pipelined,
)

__all__ = [
    "BUILT_IN",
    "CRITIC_LR_FACTOR",
    "PRECISIONS",
    "RR_REGROUP",
    "AgentSampling",
    "CriticConfig",
    "RolloutConfig",
    "EvalConfig",
    "GenerationConfig",
    "IndexConfig",
    "LoraConfig",
    "OptimConfig",
    "RetrievalConfig",
    "RetrievalEvalConfig",
    "RewardConfig",
    "SearchConfig",
    "ServeConfig",
    "SFTConfig",
    "TeamRunConfig",
    "TrainConfig",
    "TrainingRunConfig",
    "WarmStartConfig",
    "carry_over",
    "check_precision",
    "check_system",
    "critic_lr",
    "default_sampler",
    "rollout_pipelined",
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
