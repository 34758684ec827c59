"""The paper's rows at two scales: `mhgpo train --config experiments/<row>.yaml [--scale demo]`.

A row's YAML file (`experiments/`) holds the paper's setting (model, data, batch, learning rates, token budgets)
and the row's algorithm switches (algo, system, sampler, group size, roles, Aggr, penalties, ...). `--scale demo`
keeps every switch and takes the *scale* keys below from the packaged demo config (`mhgpo/config/demo.yaml`: the
default model on the synthetic world, few steps, small batches, short generations, LoRA), so that any row runs on
a CPU in minutes; its run directory gets a `-demo` suffix. `key=value` overrides still apply last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mhgpo.config import TrainConfig, demo_config_path, load_config, to_dict

SCALES = ("demo",)

# What `--scale demo` replaces: how big the run is, not what it does. Everything else is the row's.
SCALE_KEYS = (
    "model",
    "data",
    "val_data",
    "retrieval",
    "steps",
    "questions_per_step",
    "eval_every",
    "val_limit",
    "eval_batch_size",
    "gen_batch_size",
    "save_every",
    "keep_checkpoints",
    "search.snippet_words",
    "search.rewriter",
    "search.reranker",
    "search.answerer",
    "optim.lr",
    "optim.warmup_steps",
    "optim.schedule",
    "optim.micro_batch_tokens",
    "optim.logprob_chunk",
    "optim.gradient_checkpointing",
    "lora.enabled",
    "lora.r",
    "lora.alpha",
    "lora.dropout",
    "lora.target_modules",
    "critic.lr",
    "critic.warmup_steps",
    "warm_start.steps",
    "warm_start.batch_size",
    "warm_start.lr",
    "warm_start.limit",
)


def _get(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        node = node[part]
    node[last] = value


def scaled_tree(row: str | Path | None, scale: str) -> dict[str, Any]:
    """The row's resolved config as a dict, with its `SCALE_KEYS` taken from the `scale` config; feed it to
    `load_config(TrainConfig, None, overrides, base=...)`. Errors in the row file name the file and key."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r} (choose one of: {', '.join(SCALES)})")
    tree = to_dict(load_config(TrainConfig, row))
    small = to_dict(load_config(TrainConfig, demo_config_path()))
    for key in SCALE_KEYS:
        _set(tree, key, _get(small, key))
    tree["output_dir"] = f"{tree['output_dir']}-{scale}"
    return tree
