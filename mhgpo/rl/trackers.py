"""Experiment trackers beside `metrics.jsonl` (config key `report_to`, default `[tensorboard]`): TensorBoard,
Weights & Biases, MLflow and Trackio. Every row of metrics.jsonl goes to each chosen tracker at its step (the
numbers; a NaN, logged as null, is left out) and the run's config once, as the run's config or parameters.

Resuming: a tracker's run is continued where the tracker supports it. The ids are kept in the run directory's
`trackers.json` (written when a tracker run is created): W&B continues the run of that id (`resume="allow"`),
MLflow reopens the run of that id in the same tracking store, Trackio continues the run of that name;
TensorBoard drops the events after the checkpoint's step (`purge_step`), as before.

Where each writes: TensorBoard `RUN/tensorboard/`; W&B `RUN/wandb/` (online, or offline with `WANDB_MODE=offline`;
project `$WANDB_PROJECT`, default `mhgpo`); MLflow the store of `$MLFLOW_TRACKING_URI`, else a local SQLite store
`RUN/mlflow.db` with its artifacts in `RUN/mlflow-artifacts/` (experiment `$MLFLOW_EXPERIMENT_NAME`, default
`mhgpo`); Trackio its local database (`$TRACKIO_DIR`,
project `mhgpo`). The packages are optional extras: a chosen tracker that is not installed is named, with the extra
to install, before the run starts (`require_trackers`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any

from mhgpo.config.choices import TRACKERS, redact_urls
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_json

__all__ = ["IDS_FILE", "TRACKERS", "mlflow_key", "numeric", "open_trackers", "require_trackers"]

IDS_FILE = "trackers.json"
PROJECT = "mhgpo"
_MODULES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",), "trackio": ("trackio",)}
_LOCAL_MLFLOW = ("sqlalchemy", "alembic")  # MLflow's local store (SQLite in the run directory)


def require_trackers(names: list[str]) -> None:
    """InputError naming the first chosen tracker whose package is not installed, and the extra that installs it."""
    for name in names:
        if name not in TRACKERS:
            raise InputError(f"report_to: unknown tracker {name!r} (choose from {', '.join(TRACKERS)})")
        modules = _MODULES[name] + (
            _LOCAL_MLFLOW if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else ()
        )
        if any(importlib.util.find_spec(module) is None for module in modules):
            raise InputError(
                f"report_to: {name} is not installed; pip install 'mhgpo[{name}]' (or leave {name} out of report_to)"
            )


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, less `step` (nulls, NaN and text left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    }


def mlflow_key(key: str) -> str:
    """A metric name as MLflow accepts it (letters, digits, `_-. /`; anything else becomes `_`)."""
    return re.sub(r"[^\w\-. /]", "_", key)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


class _Ids:
    """`trackers.json`: what each tracker needs to continue its run."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / IDS_FILE
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.data = {}

    def get(self, name: str) -> dict[str, Any]:
        found = self.data.get(name)
        return dict(found) if isinstance(found, dict) else {}

    def put(self, name: str, value: dict[str, Any]) -> None:
        self.data[name] = value
        atomic_write_json(self.path, self.data)


class TensorBoardTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        import wandb

        known = ids.get("wandb")
        run_id = known.get("id") or uuid.uuid4().hex[:12]
        if not known:
            ids.put("wandb", {"id": run_id})
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config,
            reinit="create_new",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MlflowTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        from mlflow.tracking import MlflowClient

        known = ids.get("mlflow")
        import logging

        for name in ("mlflow.store.db.utils", "alembic"):  # the local store's "creating tables" lines
            logging.getLogger(name).setLevel(logging.WARNING)
        local = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        uri = known.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or local
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = known.get("run_id")
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        # the local store keeps its artifacts (config.json) in the run directory too, not under the working directory
        where = (run_dir / "mlflow-artifacts").resolve().as_uri() if uri == local else None
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name, where)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        ids.put("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        from mlflow.entities import Param

        params = [Param(k[:250], v[:6000]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


class TrackioTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        import trackio

        known = ids.get("trackio")
        self.project = known.get("project") or PROJECT
        self.name = known.get("name") or f"{run_dir.name}-{uuid.uuid4().hex[:6]}"
        if not known:
            ids.put("trackio", {"project": self.project, "name": self.name})
        self.run = trackio.init(
            project=self.project,
            name=self.name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish()


_CLASSES = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}


def open_trackers(names: list[str], run_dir: Path, resume_step: int, config: dict[str, Any]) -> list[Any]:
    """The trackers `names` asks for, each with its run started or continued; each has `log(step, metrics)` and
    `close(finished)`."""
    require_trackers(names)
    ids = _Ids(Path(run_dir))
    config = redact_urls(config)  # a retrieval service's password stays out of every tracker
    return [_CLASSES[name](Path(run_dir), resume_step, config, ids) for name in names]
