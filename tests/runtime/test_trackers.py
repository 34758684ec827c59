"""Experiment trackers (`report_to`): each tracker's local run (W&B offline, MLflow's local SQLite store, Trackio's
local database, TensorBoard events) holds exactly the values of metrics.jsonl at their steps, and the run's config;
a resumed run continues the same tracker run; a tracker that is not installed, W&B without a key and an MLflow URI
that does not parse are named before the model loads (the hostile cases are in tests/system/test_trackers_hostile.py)."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from mhgpo.cli.main import main
from mhgpo.config import TrainConfig, from_dict
from mhgpo.errors import InputError
from mhgpo.runtime.runlog import RunLog, read_metrics
from mhgpo.runtime.trackers import IDS_FILE, mlflow_key, numeric, one_line, require_trackers

INSTALLED = [name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name) is not None]


@pytest.fixture(autouse=True)
def offline_trackers(tmp_path_factory, monkeypatch):
    """W&B offline, MLflow's local store in the run directory, Trackio's database in a scratch folder."""
    scratch = tmp_path_factory.mktemp("trackers")
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": scratch / "wandb-config",
        "WANDB_CACHE_DIR": scratch / "wandb-cache",
        "WANDB_DATA_DIR": scratch / "wandb-data",
        "TRACKIO_DIR": scratch / "trackio",
    }.items():
        monkeypatch.setenv(key, str(value))
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)


# ----------------------------------------------------------------------------------- the trackers' local runs


def wandb_records(run_dir: Path) -> list:
    """The records of the run's offline W&B files (`wandb/offline-run-*/run-*.wandb`, in order): W&B's
    record log, blocks of 32 KiB holding chunks of protobuf `Record`s behind a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data = Path(path).read_bytes()
        assert data[:4] == b":W&B"
        pos, buf = 7, b""
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:
                break
            buf += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a full record, or the last chunk of one
                record = pb.Record()
                record.ParseFromString(buf)
                records.append(record)
                buf = b""
    return records


def wandb_history(run_dir: Path, sessions: int) -> tuple[dict[int, dict[str, float]], set[str], dict]:
    """{step: metrics}, the run ids and the config of the run's offline W&B files, once W&B's service process has
    written the `sessions` files (one per start or resumption) to their ends (the `exit` record): it writes them
    after `finish()` returns."""
    import time

    deadline = time.monotonic() + 60
    records = wandb_records(run_dir)
    while sum(r.WhichOneof("record_type") == "exit" for r in records) < sessions and time.monotonic() < deadline:
        time.sleep(0.2)
        records = wandb_records(run_dir)
    assert sum(r.WhichOneof("record_type") == "exit" for r in records) == sessions
    history, ids, config = {}, set(), {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            ids.add(record.run.run_id)
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history, ids, config


def mlflow_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{(run_dir / 'mlflow.db').resolve()}")
    run = client.get_run(run_id)
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run_id, key):
            assert m.step not in history or key not in history[m.step], f"{key} logged twice at step {m.step}"
            history.setdefault(m.step, {})[key] = m.value
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(run_dir / "dl"))).read_text())
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(run_dir.resolve())
    return history, {
        "params": run.data.params,
        "status": run.info.status,
        "config": config,
        "runs": len(client.search_runs([run.info.experiment_id])),
    }


def trackio_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict]:
    from trackio.sqlite_storage import SQLiteStorage

    name = json.loads((run_dir / IDS_FILE).read_text())["trackio"]["name"]
    logs = SQLiteStorage.get_logs("mhgpo", name)
    history = {row["step"]: {k: v for k, v in row.items() if k not in ("step", "timestamp")} for row in logs}
    assert len(history) == len(logs), "a step logged twice"
    return history, SQLiteStorage.get_run_config("mhgpo", name)


def expected(run_dir: Path, key=lambda k: k) -> dict[int, dict[str, float]]:
    return {row["step"]: {key(k): v for k, v in numeric(row).items()} for row in read_metrics(run_dir)}


def within(part: dict, whole: dict) -> bool:
    """Every key of `part` is in `whole` with the same value (sections compared key by key)."""
    return all(
        k in whole and (within(v, whole[k]) if isinstance(v, dict) and isinstance(whole[k], dict) else whole[k] == v)
        for k, v in part.items()
    )


def assert_tracker_holds_metrics(name: str, run_dir: Path, config: dict, sessions: int = 1) -> None:
    """The tracker's local run holds exactly metrics.jsonl's numbers at their steps, and the config (`sessions`:
    how many times the run was started or resumed)."""
    if name == "wandb":
        history, ids, logged_config = wandb_history(run_dir, sessions)
        assert ids == {json.loads((run_dir / IDS_FILE).read_text())["wandb"]["id"]}  # one run, continued
        assert history == expected(run_dir)
        assert within(config, logged_config)
    elif name == "mlflow":
        history, info = mlflow_history(run_dir)
        assert history == expected(run_dir, mlflow_key)
        assert info["runs"] == 1
        assert info["params"]["seed"] == json.dumps(config["seed"])
        assert info["params"]["optim.lr"] == json.dumps(config["optim"]["lr"])
        assert within(config, info["config"])
    elif name == "trackio":
        history, logged_config = trackio_history(run_dir)
        assert history == expected(run_dir)
        assert within(config, logged_config)
    elif name == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run_dir / "tensorboard"))
        acc.Reload()
        want = expected(run_dir)
        for key in acc.Tags()["scalars"]:
            got = {e.step: e.value for e in acc.Scalars(key)}
            assert got == {s: pytest.approx(m[key], rel=1e-6) for s, m in want.items() if key in m}, key
        assert set(acc.Tags()["scalars"]) == {k for m in want.values() for k in m}


# ------------------------------------------------------------------------------------------------ run logs


ROWS = [
    {"loss": 0.25, "reward/mean": 0.5, "val/f1": float("nan"), "rewriter/num_subqueries": 2},
    {"loss": -0.125, "reward/mean": 0.75, "val/f1": 33.3333333333, "odd key(%)": 1e-9},
    {"loss": 0.1, "reward/mean": 1.0 / 3.0, "memory/peak_mb": 1234.5},
    {"loss": 0.2, "reward/mean": 0.0, "val/f1": 50.0},
    {"loss": 0.3, "reward/mean": 1.0},
]


@pytest.mark.parametrize("name", ["tensorboard", *INSTALLED])
def test_the_tracker_holds_the_metrics_and_a_resumed_log_continues_its_run(name, tmp_path) -> None:
    config = {"seed": 3, "optim": {"lr": 0.001}, "report_to": [name]}
    run_dir = tmp_path / "run"
    log = RunLog(run_dir, report_to=[name], config=config)
    for step, row in enumerate(ROWS[:3], start=1):
        log.log(step, row)
    log.close(finished=False)
    first = json.loads((run_dir / IDS_FILE).read_text()) if name != "tensorboard" else {}
    assert_tracker_holds_metrics(name, run_dir, config)

    log = RunLog(run_dir, resume_step=3, report_to=[name], config=config)  # the run goes on after step 3
    for step, row in enumerate(ROWS[3:], start=4):
        log.log(step, row)
    log.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    if name != "tensorboard":
        assert json.loads((run_dir / IDS_FILE).read_text()) == first  # the same tracker run
    assert_tracker_holds_metrics(name, run_dir, config, sessions=2)
    if name == "mlflow":
        assert mlflow_history(run_dir)[1]["status"] == "FINISHED"
    assert math.isnan(ROWS[0]["val/f1"])  # (left out of every tracker: metrics.jsonl holds null)


# ------------------------------------------------------------------------------------------------ training


def test_a_run_and_its_resumption_report_to_every_installed_tracker(tiny_model_dir, world, tmp_path) -> None:
    from helpers import make_config

    from mhgpo.config import to_dict
    from mhgpo.run.pipeline import resume, train

    out = tmp_path / "run"
    names = ["tensorboard", *INSTALLED]
    cfg = make_config(tiny_model_dir, world, out, steps=2, report_to=json.dumps(names))
    train(cfg, progress=False)
    ids = json.loads((out / IDS_FILE).read_text()) if INSTALLED else {}
    assert sorted(ids) == sorted(INSTALLED) and (out / IDS_FILE).exists() == bool(INSTALLED)
    resume(out, ["steps=3"], progress=False)
    assert (json.loads((out / IDS_FILE).read_text()) if INSTALLED else {}) == ids
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and "val/f1" in rows[1] and "reward/mean" in rows[2]
    config = {k: v for k, v in to_dict(cfg).items() if k in ("seed", "algo", "group_size")}
    config["optim"] = {"lr": cfg.optim.lr}
    for name in names:
        assert_tracker_holds_metrics(name, out, config, sessions=2)


# ----------------------------------------------------------------------------------------------- bad input


def test_report_to_names_only_known_trackers_once() -> None:
    assert from_dict(TrainConfig, {}).report_to == ["tensorboard"]
    assert from_dict(TrainConfig, {"report_to": []}).report_to == []
    for value, message in (
        (
            ["neptune"],
            "report_to: unknown tracker 'neptune' (choose from tensorboard, wandb, "
            "mlflow, trackio; [] for metrics.jsonl alone)",
        ),
        (["mlflow", "mlflow"], "report_to: ['mlflow', 'mlflow'] names a tracker twice"),
    ):
        with pytest.raises(InputError) as err:
            from_dict(TrainConfig, {"report_to": value})
        assert str(err.value) == message


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_a_tracker_that_is_not_installed_is_one_line_naming_its_extra_before_the_model_loads(
    name, tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    from helpers import train_overrides

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: None if mod == name else real(mod, *a))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mhgpo.model.trained.initial_weights", no_model)
    out = tmp_path / "run"
    rc = main(["train", *train_overrides(tiny_model_dir, world, out), f"report_to=[tensorboard,{name}]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (
        f"mhgpo: error: report_to: {name} is not installed; pip install 'mhgpo[{name}]' "
        f"(or leave {name} out of report_to)"
    )
    assert not (out / "checkpoints").exists()


@pytest.fixture
def no_credentials(tmp_path, monkeypatch) -> Path:
    """No W&B key anywhere (an empty home, NETRC naming a file that is not there), W&B online, no MLflow URI."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def test_wandb_online_without_a_key_is_refused_before_the_model_loads(
    tiny_model_dir, world, no_credentials, monkeypatch, capsys
) -> None:
    from helpers import train_overrides

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mhgpo.model.trained.initial_weights", no_model)
    out = no_credentials / "run"
    rc = main(["train", *train_overrides(tiny_model_dir, world, out), "report_to=[tensorboard,wandb]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (
        "mhgpo: error: report_to: wandb: no API key for api.wandb.ai (set WANDB_API_KEY, or run `wandb login`, "
        "which keeps it in the netrc file), or log offline into the run folder with WANDB_MODE=offline (or leave "
        "wandb out of report_to)"
    )
    assert not (out / "checkpoints").exists()


WANDB_CASES = {
    "a key in the environment": ({"WANDB_API_KEY": "k" * 40}, "", None),
    "offline": ({"WANDB_MODE": "offline"}, "", None),
    "disabled": ({"WANDB_MODE": "disabled"}, "", None),
    "an identity token file": ({"WANDB_IDENTITY_TOKEN_FILE": "token.jwt"}, "", None),
    "the netrc": ({}, "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n", None),
    "the netrc of a server of one's own": (
        {"WANDB_BASE_URL": "https://wandb.corp.example"},
        "machine wandb.corp.example login user password kkkk\n",
        None,
    ),
    "no key": ({}, "", "no API key for api.wandb.ai"),
    "an empty key": ({"WANDB_API_KEY": ""}, "", "no API key for api.wandb.ai"),
    "the netrc of another host": ({}, "machine example.com login u password p\n", "no API key for api.wandb.ai"),
    "a malformed netrc": ({}, "machine api.wandb.ai login\n", "no API key for api.wandb.ai"),
    "a netrc that is not text": ({}, b"\xff\xfe\x00machine", "no API key for api.wandb.ai"),
    "a misspelt mode": ({"WANDB_MODE": "ofline"}, "", "WANDB_MODE='ofline' is not a W&B mode"),
    "a base URL that is no URL": ({"WANDB_BASE_URL": "http://[::1"}, "", "WANDB_BASE_URL='http://[::1' is not a URL"),
}


@pytest.mark.parametrize("case", list(WANDB_CASES))
def test_wandb_needs_a_key_or_offline_mode(case, no_credentials, monkeypatch) -> None:
    env, netrc, problem = WANDB_CASES[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if netrc:
        (no_credentials / "netrc").write_bytes(netrc if isinstance(netrc, bytes) else netrc.encode())
    if problem is None:
        require_trackers(["wandb"])
        return
    with pytest.raises(InputError) as err:
        require_trackers(["wandb"])
    assert str(err.value).startswith(f"report_to: wandb: {problem}")
    assert str(err.value).endswith("(or leave wandb out of report_to)") and "\n" not in str(err.value)


BAD_URIS = {
    "http://": "names no host",
    "https://:5000/": "names no host",
    "http://user:secret@/x": "names no host",
    "http://[::1": "does not parse",
    "ht!tp://x": "is not a tracking URI",
    "foo://x": "is not a tracking URI",
    "sqlite://": "names no database file",
    "sqlite:///": "names no database file",
}
GOOD_URIS = [
    "http://mlflow.example:5000",
    "https://mlflow.example/prefix",
    "sqlite:////abs/mlflow.db",
    "postgresql+psycopg2://u:p@db.example/mlflow",
    "file:///abs/mlruns",
    "/abs/mlruns",
    "databricks",
    "databricks://profile",
]


@pytest.mark.parametrize("uri", list(BAD_URIS) + GOOD_URIS)
def test_mlflow_needs_a_tracking_uri_that_parses(uri, no_credentials, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    if uri in GOOD_URIS:
        require_trackers(["mlflow"])
        return
    with pytest.raises(InputError) as err:
        require_trackers(["mlflow"])
    shown = one_line(uri)
    assert str(err.value).startswith(f"report_to: mlflow: MLFLOW_TRACKING_URI={shown!r} {BAD_URIS[uri]}")
    assert "secret" not in str(err.value)


def test_the_checks_import_no_tracker(no_credentials) -> None:
    """require_trackers is cheap: the trackers' packages are looked up, not imported."""
    code = (
        "import sys; from mhgpo.runtime.trackers import require_trackers; "
        "require_trackers(['tensorboard', 'wandb', 'mlflow', 'trackio']); "
        "print(sorted(m for m in ('wandb', 'mlflow', 'trackio', 'tensorboard') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "WANDB_MODE": "offline"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
