"""Experiment trackers beside `metrics.jsonl` (config key `report_to`, default `[tensorboard]`): TensorBoard,
Weights & Biases, MLflow and Trackio. Every row of metrics.jsonl goes to each chosen tracker at its step (the
numbers; a NaN, logged as null, is left out) and the run's config once, as the run's config or parameters.

Where each writes comes from the run folder and the user's environment only, never from a file in the run folder
(a run folder may come from someone else, or be a copy): TensorBoard `RUN/tensorboard/`; W&B `RUN/wandb/` (online,
or offline with `WANDB_MODE=offline`; project `$WANDB_PROJECT`, default `mhgpo`); MLflow the store of
`$MLFLOW_TRACKING_URI`, else a local SQLite store `RUN/mlflow.db` with its artifacts in `RUN/mlflow-artifacts/`
(experiment `$MLFLOW_EXPERIMENT_NAME`, default `mhgpo`); Trackio its local database (`$TRACKIO_DIR`, project
`mhgpo`). The local stores are found from the run folder each time the run opens, so a moved or copied run writes
into its own.

Resuming: `RUN/trackers.json` keeps each tracker's run id (a short token of letters, digits, `_` and `-`), nothing
else: W&B continues the run of that id (`resume="allow"`), MLflow reopens the run of that id in its store (a new
run when the store has none of that id in the experiment), Trackio continues the run of that name; TensorBoard
drops the events after the checkpoint's step (`purge_step`). Anything else in the file (an address, a path, an id
that is not such a token, a file that is a link or too big) is ignored with one warning line.

A tracker never stops a run: one that fails to start, log or close (a network error, a full disk) is left out for
the rest of the run with one warning line naming it and the error (`Trackers`). What can be checked cheaply is
checked before the run loads anything (`require_trackers`): the packages, W&B's key, MLflow's tracking URI.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import stat
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

from mhgpo.config.choices import TRACKERS, redact_urls
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_json

__all__ = [
    "IDS_FILE",
    "TRACKERS",
    "Trackers",
    "mlflow_key",
    "numeric",
    "one_line",
    "open_trackers",
    "read_ids",
    "require_trackers",
]

IDS_FILE = "trackers.json"
PROJECT = "mhgpo"
ID_KEYS = {"wandb": "id", "mlflow": "run_id", "trackio": "name"}  # the one key of each tracker in trackers.json
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # an opaque run id: no separators, dots or spaces
MAX_IDS_BYTES = 64 * 1024  # a trackers.json holds a few ids; a bigger one is not read
_MODULES = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow",), "trackio": ("trackio",)}
_LOCAL_MLFLOW = ("sqlalchemy", "alembic")  # MLflow's local store (SQLite in the run directory)
_WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
_WANDB_NO_KEY = ("offline", "disabled", "dryrun")  # modes that log nothing to a server
_SQLITE_SIDE_FILES = ("mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm")  # SQLite writes these beside the store
_MLFLOW_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "uc")


# ------------------------------------------------------------------------------------ checks before the run


def require_trackers(names: list[str]) -> None:
    """InputError (one line) for the first chosen tracker that cannot work, checked without importing the trackers
    or contacting anything, so that a run fails before it loads its data and model rather than after: a tracker
    that is unknown or not installed (named with the extra that installs it), W&B online without a key, MLflow with
    a `MLFLOW_TRACKING_URI` that does not parse. Call it once, on the process that logs, before anything slow."""
    for name in names:
        if name not in TRACKERS:
            raise InputError(f"report_to: unknown tracker {name!r} (choose from {', '.join(TRACKERS)})")
        modules = _MODULES[name] + (_LOCAL_MLFLOW if name == "mlflow" and not _mlflow_uri() else ())
        if any(importlib.util.find_spec(module) is None for module in modules):
            raise InputError(
                f"report_to: {name} is not installed; pip install 'mhgpo[{name}]' (or leave {name} out of report_to)"
            )
        problem = _wandb_problem() if name == "wandb" else _mlflow_problem() if name == "mlflow" else None
        if problem:
            raise InputError(f"report_to: {name}: {problem} (or leave {name} out of report_to)")


def _wandb_problem() -> str | None:
    """Why W&B cannot log (its mode is not one W&B knows, or it logs online without a key), else None."""
    mode = os.environ.get("WANDB_MODE") or "online"
    if mode not in _WANDB_MODES:
        return f"WANDB_MODE={one_line(mode, 40)!r} is not a W&B mode ({', '.join(_WANDB_MODES[:3])})"
    if mode in _WANDB_NO_KEY or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    base = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        host = urlsplit(base).hostname
    except ValueError:
        host = None
    if not host:
        return f"WANDB_BASE_URL={one_line(base, 80)!r} is not a URL"
    if _netrc_has(host):
        return None
    return (
        f"no API key for {host} (set WANDB_API_KEY, or run `wandb login`, which keeps it in the netrc file), "
        f"or log offline into the run folder with WANDB_MODE=offline"
    )


def _netrc_has(host: str) -> bool:
    """Whether the netrc file (`$NETRC`, else `~/.netrc` or `~/_netrc`), as W&B reads it, has a password for
    `host` (an unreadable or malformed file has none)."""
    import netrc

    path = Path(os.environ["NETRC"]).expanduser() if os.environ.get("NETRC") else Path("~/.netrc").expanduser()
    if not os.environ.get("NETRC") and not path.exists() and Path("~/_netrc").expanduser().exists():
        path = Path("~/_netrc").expanduser()
    try:
        found = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError, UnicodeDecodeError):
        return False
    return bool(found and found[2])


def _mlflow_uri() -> str | None:
    return os.environ.get("MLFLOW_TRACKING_URI") or None


def _mlflow_problem() -> str | None:
    """Why `MLFLOW_TRACKING_URI` (when set) is not a tracking URI MLflow can use, else None."""
    uri = _mlflow_uri()
    if uri is None:
        return None
    shown = f"MLFLOW_TRACKING_URI={one_line(uri, 120)!r}"
    try:
        parts = urlsplit(uri)
        host = parts.hostname
    except ValueError as e:
        return f"{shown} does not parse ({e})"
    scheme = parts.scheme.split("+")[0]  # (sqlalchemy's `postgresql+psycopg2`)
    if (scheme == "" and "://" in uri) or (scheme not in _MLFLOW_SCHEMES and not scheme.startswith("databricks")):
        return f"{shown} is not a tracking URI (http(s)://HOST, a database URI, file:PATH or a folder)"
    if scheme in ("http", "https") and not host:
        return f"{shown} names no host"
    if scheme == "sqlite" and parts.path in ("", "/"):
        return f"{shown} names no database file (sqlite:///PATH)"
    return None


# ------------------------------------------------------------------------------------------------- values


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


_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s/@]+@")


def one_line(text: str, limit: int = 300) -> str:
    """`text` made safe to print on one line: the user and password of a URL (`scheme://USER:SECRET@host`)
    masked, every character that is not printable (line breaks, terminal escapes) written as its escape, and cut
    to `limit` characters."""
    text = _CREDENTIALS.sub(r"\1***@", text)
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


def _describe(error: BaseException) -> str:
    text = one_line(str(error))
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _warn(text: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(f"mhgpo: warning: {text}", file=sys.stderr)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
    return out


# ------------------------------------------------------------------------------------- the run ids on disk


def read_ids(path: Path) -> tuple[dict[str, str], list[str]]:
    """The run ids of `trackers.json` ({tracker: id}) and what was ignored in it, as short phrases. Read only when
    it is a regular file (not a link, folder or pipe) of at most MAX_IDS_BYTES holding a JSON object; of each
    tracker's entry only its id key (`ID_KEYS`) is read, and only a value that `RUN_ID` matches whole."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return {}, []
    except OSError as e:
        return {}, [f"cannot be read ({_describe(e)})"]
    if stat.S_ISLNK(info.st_mode):
        return {}, ["is a link (not followed)"]
    if not stat.S_ISREG(info.st_mode):
        return {}, ["is not a file"]
    if info.st_size > MAX_IDS_BYTES:
        return {}, [f"is {info.st_size} bytes, more than {MAX_IDS_BYTES}"]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = json.loads(f.read(MAX_IDS_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return {}, [f"is not JSON ({_describe(e)})"]
    if not isinstance(data, dict):
        return {}, ["is not a JSON object"]
    ids: dict[str, str] = {}
    ignored: list[str] = []
    for name, entry in data.items():
        key = ID_KEYS.get(name)
        if key is None or not isinstance(entry, dict):
            ignored.append(one_line(str(name), 40))
            continue
        ignored += [f"{one_line(name)}.{one_line(str(k), 40)}" for k in entry if k != key]
        value = entry.get(key)
        if isinstance(value, str) and RUN_ID.fullmatch(value):
            ids[name] = value
        elif key in entry:
            ignored.append(f"{name}.{key} {one_line(repr(value), 40)} (not a run id)")
    return ids, ignored


class _Ids:
    """`trackers.json`: the run id of each tracker, so that a resumed run continues it (see `read_ids`)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / IDS_FILE
        self.data, ignored = read_ids(self.path)
        if ignored:
            shown = ", ".join(ignored[:4]) + (f" and {len(ignored) - 4} more" if len(ignored) > 4 else "")
            _warn(
                f"{self.path}: {shown}: ignored; the file keeps only run ids (letters, digits, _ and -), and the "
                f"trackers write in the run folder or where the environment says"
            )

    def get(self, name: str) -> str | None:
        return self.data.get(name)

    def put(self, name: str, run_id: str) -> None:
        """Keep `run_id` for a resumed run; a file that cannot be written is a warning (a resumed run then starts
        a new tracker run)."""
        self.data[name] = run_id
        try:
            atomic_write_json(self.path, {k: {ID_KEYS[k]: v} for k, v in self.data.items()})
        except OSError as e:
            _warn(f"{self.path}: cannot be written ({_describe(e)}); a resumed run starts a new {name} run")


def _new_id(prefix: str = "") -> str:
    """A fresh run id that `RUN_ID` matches (`prefix`: the run folder's name, its other characters made `_`)."""
    token = uuid.uuid4().hex[:12]
    prefix = re.sub(r"[^A-Za-z0-9_-]", "_", prefix)[:48]
    return f"{prefix}-{token}" if prefix and prefix[0].isalnum() else token


def _local(run_dir: Path, *names: str) -> list[Path]:
    """The paths `names` in the run folder, refused (RuntimeError) when one is a link, or a file with other hard
    links: a tracker's local store is written through, and must not reach outside the run."""
    paths = [run_dir / name for name in names]
    for path in paths:
        if path.is_symlink():
            raise RuntimeError(f"{path} is a link; a tracker writes only inside the run folder")
        if path.is_file() and path.stat().st_nlink > 1:
            raise RuntimeError(f"{path} has other hard links; a tracker writes only inside the run folder")
    return paths


def _inside(run_dir: Path, uri: str) -> bool:
    """Whether the artifact location `uri` (file:// URI or path) is a folder in the run folder."""
    parts = urlsplit(uri)
    if parts.scheme not in ("", "file"):
        return False
    return Path(url2pathname(parts.path)).resolve().is_relative_to(run_dir)


# ----------------------------------------------------------------------------------------------- trackers


class TensorBoardTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        from torch.utils.tensorboard import SummaryWriter

        (folder,) = _local(run_dir, "tensorboard")
        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, resume_step: int, config: dict[str, Any], ids: _Ids) -> None:
        import wandb

        _local(run_dir, "wandb")
        run_id = ids.get("wandb")
        if run_id is None:
            run_id = _new_id()
            ids.put("wandb", run_id)
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
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("alembic").setLevel(logging.WARNING)  # the local store's "creating tables" lines
        # (and the store's errors, logged with a traceback: the error is the one line of `Trackers` instead)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
        uri = _mlflow_uri()
        self.local = uri is None
        if self.local:  # the run's own store, found from the run folder now (a copied run writes into its copy)
            db, artifacts, *_ = _local(run_dir, "mlflow.db", "mlflow-artifacts", *_SQLITE_SIDE_FILES)
            uri = f"sqlite:///{db}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(name, artifacts.as_uri() if self.local else None)
        )
        self.run_id = self._reopen(ids.get("mlflow"), experiment_id, uri)
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        run = self.client.create_run(experiment_id, run_name=run_dir.name)
        self.run_id = run.info.run_id
        ids.put("mlflow", self.run_id)
        self._log_config(config, run_dir, run.info.artifact_uri)

    def _reopen(self, run_id: str | None, experiment_id: str, uri: str) -> str | None:
        """`run_id` when the store holds that run in `experiment_id`, else None (a new run is started)."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is not None and run.info.experiment_id == experiment_id:
            return run_id
        _warn(f"mlflow: the store {one_line(uri)} has no run {run_id} in its experiment; a new run is started")
        return None

    def _log_config(self, config: dict[str, Any], run_dir: Path, artifact_uri: str) -> None:
        """The config as parameters, and as `config.json` when the artifacts stay in the run folder (a local store
        whose experiment keeps them elsewhere, such as a copied run's, gets the parameters alone)."""
        from mlflow.entities import Param

        params = [Param(k[:250], v[:6000]) for k, v in _flatten(config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        if self.local and not _inside(run_dir, artifact_uri):
            _warn(
                f"mlflow: the local store keeps artifacts at {one_line(artifact_uri)}, outside the run folder "
                f"(a copied run?); config.json is not written there (the config is in the run's parameters)"
            )
            return
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

        name = ids.get("trackio")
        if name is None:
            name = _new_id(run_dir.name)
            ids.put("trackio", name)
        self.run = trackio.init(
            project=PROJECT,
            name=name,
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


class Trackers:
    """A run's open trackers. One that fails (to log or close: a network error, a full disk) is left out for the
    rest of the run with one warning line naming it and the error; a tracker never stops a run, and metrics.jsonl
    and the checkpoints go on. (An interrupt, KeyboardInterrupt, is not a failure: it goes on up.)"""

    def __init__(self, opened: dict[str, Any]) -> None:
        self.opened = opened  # {name: tracker}, less those that failed

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, tracker in list(self.opened.items()):
            try:
                tracker.log(step, metrics)
            except Exception as e:
                del self.opened[name]
                _warn(
                    f"report_to: {name} failed at step {step} ({_describe(e)}); it is left out for the rest of the "
                    f"run (metrics.jsonl and checkpoints go on)"
                )

    def close(self, finished: bool) -> None:
        """Close each tracker's run (`finished`: the run reached its last step, else it was stopped)."""
        for name, tracker in list(self.opened.items()):
            del self.opened[name]
            try:
                tracker.close(finished)
            except Exception as e:
                _warn(f"report_to: {name} failed to close its run ({_describe(e)}); metrics.jsonl holds every step")


def open_trackers(names: list[str], run_dir: Path, resume_step: int, config: dict[str, Any]) -> Trackers:
    """The trackers `names` asks for, each with its run started or continued (`resume_step`: the checkpoint's step).
    A tracker that fails to start is left out with one warning line; an unknown name is an InputError."""
    for name in names:
        if name not in TRACKERS:
            raise InputError(f"report_to: unknown tracker {name!r} (choose from {', '.join(TRACKERS)})")
    run_dir = Path(run_dir).resolve()
    ids = _Ids(run_dir) if names else None
    config = redact_urls(config)  # a retrieval service's password stays out of every tracker
    opened: dict[str, Any] = {}
    for name in names:
        try:
            opened[name] = _CLASSES[name](run_dir, resume_step, config, ids)
        except Exception as e:
            _warn(
                f"report_to: {name} failed to start ({_describe(e)}); the run goes on without it (metrics.jsonl "
                f"and checkpoints go on)"
            )
    return Trackers(opened)
