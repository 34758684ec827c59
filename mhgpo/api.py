"""The Python API: `mhgpo.train` and `mhgpo.evaluate`, for the default team or a `Workflow` of one's own.

    import mhgpo
    run_dir = mhgpo.train({"steps": 20, "team": {"max_rounds": 3}}, workflow=IterativeSearch)
    result = mhgpo.evaluate({"data": "synthetic:dev", "limit": 50}, workflow=IterativeSearch)

`config` is a config object (`TrainConfig`, `EvalConfig`), a dict of its keys (nested sections as dicts), the
path of a YAML file, or None for the defaults; `overrides` are `key=value` strings applied last, as on the
command line. See docs/python-api.md.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from mhgpo.errors import InputError


def _load(cls: type, config: Any, overrides: list[str] | tuple[str, ...], workflow: Any) -> Any:
    """`config` (object, dict, YAML path or None) as a checked `cls`; a given workflow names `system` before the
    checks, so that the defaults that depend on it (the sampler) are the workflow's."""
    from mhgpo.config import load_config

    return load_config(cls, *_parts(cls, config, overrides, workflow))


def _parts(
    cls: type, config: Any, overrides: list[str] | tuple[str, ...], workflow: Any
) -> tuple[Any, list[str], dict[str, Any] | None]:
    """`load_config`'s YAML path, overrides and base for `config` (see :func:`_load`)."""
    from mhgpo.config import to_dict
    from mhgpo.team.loader import system_spec
    from mhgpo.team.workflow import Workflow

    path, base = None, None
    if isinstance(config, cls):
        base = to_dict(config)
    elif isinstance(config, dict):
        base = config
    elif isinstance(config, (str, Path)):
        path = config
    elif config is not None:
        raise InputError(f"config: expected a {cls.__name__}, a dict, a YAML path or None, got {type(config).__name__}")
    extra = list(overrides)
    if isinstance(workflow, Workflow) or (inspect.isclass(workflow) and issubclass(workflow, Workflow)):
        spec = system_spec(workflow if inspect.isclass(workflow) else type(workflow))
        extra.append(f"system={json.dumps(spec)}")
    elif isinstance(workflow, str):
        extra.append(f"system={json.dumps(workflow)}")
    return path, extra, base


def train(
    config: Any = None, workflow: Any = None, *, overrides: list[str] | tuple[str, ...] = (), progress: bool = True
) -> Path:
    """Train a team with MHGPO (or the baseline `config` names), after a supervised warm start when
    `warm_start.enabled` (the workflow's `demonstration` gives the gold outputs); returns the run directory
    (`output_dir`), which holds config.yaml, metrics.jsonl, rollouts/, checkpoints/, warm_start/ (the warm start's
    run) and, when rollouts failed, errors.jsonl. The run is continued with `mhgpo train --resume RUN`.

    `workflow`: None (the team `config`'s `system` names), a `Workflow` subclass (built from the config's `team`
    section and, when its constructor asks, the configured retriever), a built `Workflow` instance, or a
    `PATH.py:Class` / `module.path:Class` string."""
    from mhgpo.config import TrainConfig
    from mhgpo.run.pipeline import train as run_training

    cfg = _load(TrainConfig, config, overrides, workflow)
    trainer = run_training(cfg, progress=progress, workflow=None if isinstance(workflow, str) else workflow)
    return trainer.run_dir


def evaluate(
    config: Any = None,
    workflow: Any = None,
    *,
    overrides: list[str] | tuple[str, ...] = (),
    progress: bool = True,
    resume: bool = False,
) -> Any:
    """Greedy evaluation of a team on `data` (the first `limit` questions); returns an `EvalResult`: `.metrics`
    (n, acc, em, f1 in percent, seconds, per-agent behaviour) and `.predictions` (one dict per question). A trained
    run as `model` is evaluated with the team settings it was trained with (`system`, `team`, `search`,
    `max_prompt_tokens` from its config.yaml) where a dict or YAML `config` and `overrides` do not set them. With
    `output_dir` set, eval_config.yaml and each finished batch of predictions.jsonl are written there as they finish,
    and metrics.json at the end; a folder that already holds an evaluation is refused unless `resume=True`, which
    continues it with its saved config (the given config may repeat it, not change it). Ctrl-C raises
    `mhgpo.run.evaluate.EvalInterrupted` (a KeyboardInterrupt) after what finished is saved. A question whose
    rollout fails in the workflow stops the evaluation with a `WorkflowError` naming file, class and method."""
    from mhgpo.config import EvalConfig, load_config, to_dict
    from mhgpo.run.evaluate import eval_config, resumed_config, run_evaluation

    parts = _parts(EvalConfig, config, overrides, workflow)
    cfg = load_config(EvalConfig, *parts) if resume else eval_config(*parts)[0]
    if resume:
        if not cfg.output_dir:
            raise InputError("output_dir: resume=True continues the evaluation saved in output_dir; none is set")
        given = {k: v for k, v in to_dict(cfg).items() if k != "output_dir"}
        defaults = {k: v for k, v in to_dict(EvalConfig()).items() if k != "output_dir"}
        changed = {k: v for k, v in given.items() if v != defaults.get(k)}  # what the caller set
        cfg = resumed_config(Path(cfg.output_dir), base=changed)
    return run_evaluation(cfg, None if isinstance(workflow, str) else workflow, resume=resume, progress=progress)
