"""A table of experiment rows (`experiments/rows.yaml`): a base config, named rows of overrides, and scales.

A row is the base config (the paper's setting, `configs/paper_hotpotqa.yaml`) with its overrides (dotted keys, as
on the command line) and nothing else; `train: false` marks a row that is validated without RL (the untrained
team, a warm start alone) and `label` names a row that is not an algorithm's (an algorithm's label is
`mhgpo.config.tables.algo_label`'s). A scale (`demo`: the size of `mhgpo demo`) replaces the keys that make a run
big (model, data, steps, batch, tokens, LoRA, ...) by those of its config, and keeps every switch; a row's own
overrides apply after it. The table file names its base and a scale's config relative to itself.

`mhgpo train --config experiments/rows.yaml:ROW [--scale demo]` trains a row (its run folder `runs/ROW[-demo]`),
`mhgpo eval --config experiments/rows.yaml:ROW` validates one, and `mhgpo reproduce` runs rows over seeds.
Errors name the table file and the row.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mhgpo.config.load import from_dict, load_config, lookup, read_mapping, read_yaml, set_key, to_dict
from mhgpo.config.tables import algo_label
from mhgpo.config.train import TrainConfig
from mhgpo.errors import InputError

TABLE_KEYS = ("base", "scales", "recipe", "rows")  # `recipe`: overrides the rows merge (a YAML anchor)
ROW_KEYS = ("train", "label")  # a row's own keys besides its overrides
ROW_NAME = re.compile(r"[a-z0-9_]+")
# what a computed label already says (or a recipe row's setting): not repeated in its brackets
LABELLED = ("algo", "sampler", "system", "warm_start.enabled", "search.reranker_penalty")


@dataclass(frozen=True)
class Scale:
    name: str
    config: Path  # the config whose values of `keys` the scale takes
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted key -> value
    train: bool = True
    label: str | None = None


@dataclass(frozen=True)
class RowTable:
    path: Path
    base: Path
    scales: dict[str, Scale]
    rows: dict[str, Row]

    def row(self, name: str) -> Row:
        """The row `name` (InputError naming the table and its rows otherwise)."""
        if name not in self.rows:
            raise InputError(f"{self.path}: no row {name!r} (rows: {', '.join(self.rows)})")
        return self.rows[name]

    def scale(self, name: str | None) -> Scale | None:
        if name is None:
            return None
        if name not in self.scales:
            raise InputError(f"--scale: {self.path} has no scale {name!r} (scales: {', '.join(self.scales)})")
        return self.scales[name]

    def tree(self, name: str, scale: str | None = None) -> dict[str, Any]:
        """The row's config as a nested dict: the base, the scale's keys, the row's overrides; its run folder
        `runs/ROW` (`runs/ROW-SCALE` at a scale)."""
        row, sc = self.row(name), self.scale(scale)
        tree = read_mapping(self.base)
        if sc is not None:
            small = to_dict(load_config(TrainConfig, sc.config))
            for key in sc.keys:
                set_key(tree, key, copy.deepcopy(lookup(small, key)))
        for key, value in row.overrides.items():
            set_key(tree, key, copy.deepcopy(value))
        tree["output_dir"] = f"runs/{name}" + (f"-{scale}" if scale else "")
        return tree

    def config(self, name: str, scale: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
        """The row's training config at `scale`, with `overrides` (`key=value`) last; a row that does not load
        raises InputError naming the table and the row."""
        tree = self.tree(name, scale)
        try:
            from_dict(TrainConfig, copy.deepcopy(tree))
        except InputError as e:
            raise InputError(f"{self.path}: row {name}: {e}") from None
        return load_config(TrainConfig, None, overrides, base=tree)

    def label(self, name: str) -> str:
        """How reports name the row: its `label`, or `[warm start + ]ALGO` (`algo_label`) and its other
        overrides: `warm start + MHGPO-RR [reward.aggr=max]`."""
        row = self.row(name)
        if row.label:
            return row.label
        cfg = self.config(name)
        text = ("warm start + " if cfg.warm_start.enabled else "") + algo_label(cfg.algo, cfg.sampler)
        extra = [f"{k}={_shown(v)}" for k, v in row.overrides.items() if k not in LABELLED]
        return text + (f" [{', '.join(extra)}]" if extra else "")


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return str(value)


def is_row_table(path: Path) -> bool:
    """Whether the YAML file `path` is a table of rows (its top level has `base` and `rows`)."""
    try:
        tree = read_yaml(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, InputError):
        return False
    return isinstance(tree, dict) and {"base", "rows"} <= set(tree)


def load_rows(path: str | Path) -> RowTable:
    """The table of rows in `path`; a malformed entry raises InputError naming the file and the entry."""
    path = Path(path)
    tree = read_mapping(path)
    unknown = [k for k in tree if k not in TABLE_KEYS]
    if unknown or "base" not in tree or not isinstance(tree.get("rows"), dict):
        what = f"unknown key {unknown[0]!r}" if unknown else "expected `base` and a mapping of `rows`"
        raise InputError(f"{path}: {what} (a table of rows has {', '.join(TABLE_KEYS)})")
    base = path.parent / str(tree["base"])
    if not base.is_file():
        raise InputError(f"{path}: base: {base} is not a file")
    scales = {name: _scale(path, name, entry) for name, entry in (tree.get("scales") or {}).items()}
    rows = {name: _row(path, name, entry) for name, entry in tree["rows"].items()}
    return RowTable(path, base, scales, rows)


def _scale(path: Path, name: str, entry: Any) -> Scale:
    from mhgpo.config import demo_config_path

    if not isinstance(entry, dict) or not isinstance(entry.get("keys"), list) or "config" not in entry:
        raise InputError(f"{path}: scale {name}: expected `config` (demo, or a file) and a list of `keys`")
    config = demo_config_path() if entry["config"] == "demo" else path.parent / str(entry["config"])
    return Scale(str(name), config, tuple(str(k) for k in entry["keys"]))


def _row(path: Path, name: Any, entry: Any) -> Row:
    if not isinstance(name, str) or not ROW_NAME.fullmatch(name):
        raise InputError(f"{path}: row {name!r}: a row's name is lower-case letters, digits and _")
    entry = {} if entry is None else entry
    if not isinstance(entry, dict):
        raise InputError(f"{path}: row {name}: expected a mapping of overrides, got {entry!r}")
    train, label = entry.get("train", True), entry.get("label")
    if not isinstance(train, bool):
        raise InputError(f"{path}: row {name}: train: expected true or false, got {train!r}")
    if label is not None and not isinstance(label, str):
        raise InputError(f"{path}: row {name}: label: expected a string, got {label!r}")
    overrides = {str(k): v for k, v in entry.items() if k not in ROW_KEYS}
    return Row(name, overrides, train, label)


def row_spec(config: str | Path | None, scale: str | None = None) -> tuple[RowTable, str] | None:
    """`FILE.yaml:ROW` (a row of a table of rows) as the table and the row's name; None for any other config. The
    table itself without a row is refused, naming its rows, and so is a `scale` without a row."""
    spec = _row_spec(config)
    if spec is None and scale:
        raise InputError("--scale: only with a row of a table of rows (--config experiments/rows.yaml:ROW)")
    return spec


def _row_spec(config: str | Path | None) -> tuple[RowTable, str] | None:
    if config is None:
        return None
    text = str(config)
    path, sep, name = text.rpartition(":")
    if sep and path and Path(path).is_file() and is_row_table(Path(path)):
        table = load_rows(path)
        table.row(name)
        return table, name
    if Path(text).is_file() and is_row_table(Path(text)):
        table = load_rows(text)
        raise InputError(f"{text}: a table of rows; name one: --config {text}:ROW (rows: {', '.join(table.rows)})")
    return None
