"""Trackers against a hostile or damaged run folder, and failing trackers: a run's trackers write only inside the
run folder or where the environment says (never where a file in the folder says), and a tracker that fails is one
warning line while the run goes on (the checks before the model loads are in tests/runtime/test_trackers.py). Every
test lists the files around the run before and after (`Sandbox`) and lets nothing reach the network (`no_network`):
W&B's and MLflow's network failures are fakes (their functions monkeypatched)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from mhgpo.runtime.runlog import RunLog, read_metrics
from mhgpo.runtime.trackers import IDS_FILE, MAX_IDS_BYTES, one_line, read_ids

ROWS = {1: {"loss": 0.5, "reward/mean": 0.25}, 2: {"loss": 0.25, "reward/mean": 0.5}, 3: {"loss": 0.125}}
LEFT_OUT = "it is left out for the rest of the run (metrics.jsonl and checkpoints go on)"


# ------------------------------------------------------------------------------ the filesystem and the network


def listing(root: Path, skip: tuple[Path, ...]) -> dict[str, tuple]:
    """Every entry under `root` but the folders `skip`: links by their target, files by size and content hash."""
    out: dict[str, tuple] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(folder, d) not in skip]
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                out[key] = ("link", os.readlink(path))
            elif path.is_file():
                out[key] = ("file", path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                out[key] = ("dir",) if path.is_dir() else ("other",)
    return out


class Sandbox:
    """The filesystem around a run: `run/` (the run folder), `cwd/` (the working folder), `outside/` (where a
    hostile folder points), `env/` (what the environment names: HOME, W&B's and Trackio's folders). `written()`:
    what changed since the start outside `run/` and `env/`, and its bytes."""

    def __init__(self, root: Path) -> None:
        self.root, self.run, self.cwd, self.outside, self.env = (
            root,
            root / "run",
            root / "cwd",
            root / "outside",
            root / "env",
        )
        for folder in (self.cwd, self.outside, self.env / "home"):
            folder.mkdir(parents=True)
        (self.outside / "victim.txt").write_text("someone else's file\n")
        self.skip = [self.run, self.env]
        self.start: dict[str, tuple] = {}

    def snapshot(self) -> None:
        self.start = listing(self.root, tuple(self.skip))

    def written(self) -> tuple[list[str], int]:
        now = listing(self.root, tuple(self.skip))
        changed = sorted(k for k in set(now) | set(self.start) if now.get(k) != self.start.get(k))
        size = sum(now[k][1] for k in changed if k in now and now[k][0] == "file")
        return changed, size

    def assert_nothing_outside(self) -> None:
        assert self.written() == ([], 0)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    box = Sandbox(tmp_path)
    env = {
        "HOME": box.env / "home",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": box.env / "wandb-config",
        "WANDB_CACHE_DIR": box.env / "wandb-cache",
        "WANDB_DATA_DIR": box.env / "wandb-data",
        "TRACKIO_DIR": box.env / "trackio",
        "NETRC": box.env / "netrc",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_TRACKING_TOKEN": "the-users-secret-token",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.chdir(box.cwd)
    box.snapshot()
    return box


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Connections and name lookups beyond this machine refused and recorded; none may be tried."""
    tried: list = []
    local = ("localhost", "127.0.0.1", "::1", None)
    connect, lookup = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in local:
            tried.append(address)
            raise OSError(errno.ENETUNREACH, "the tests reach no network")
        return connect(self, address)

    def guarded_lookup(host, *args, **kwargs):
        if host not in local:
            tried.append(host)
            raise socket.gaierror(socket.EAI_NONAME, "the tests reach no network")
        return lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_lookup)
    yield tried
    assert tried == []


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store (its tables made once: MLflow takes seconds to make them), to copy in place."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def clean(err: str) -> list[str]:
    """The warning lines of stderr (W&B's and Trackio's own chatter aside), after checking that it holds no
    traceback."""
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("mhgpo: warning: ")]


def write_steps(run_dir: Path, names: list[str], steps: range, resume_step: int = 0) -> None:
    log = RunLog(run_dir, resume_step=resume_step, report_to=names, config={"seed": 1, "optim": {"lr": 0.01}})
    for step in steps:
        log.log(step, ROWS[step])
    log.close(finished=False)


def tensorboard_steps(run_dir: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")]


def mlflow_steps(uri: str, run_id: str) -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss"))


def local_uri(run_dir: Path) -> str:
    return f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"


def saved_ids(run_dir: Path) -> dict:
    return json.loads((run_dir / IDS_FILE).read_text())


# ------------------------------------------------------------------------------------- where trackers write


@pytest.mark.parametrize(
    "planted",
    ["sqlite:///{outside}/evil.db", "http://attacker.example:5000", "file://{outside}/mlruns", "./mlruns"],
)
def test_a_planted_tracking_uri_is_ignored_and_the_run_writes_into_itself(
    planted, sandbox, mlflow_store, monkeypatch, capsys
) -> None:
    """A trackers.json that names a store (the format of earlier versions, or an attacker's) chooses nothing: the
    resumed run writes into its own store; no database outside, no ./mlruns, no request to the address (and so
    the user's MLFLOW_TRACKING_TOKEN goes nowhere)."""
    run = sandbox.run
    run.mkdir()
    shutil.copy(mlflow_store, run / "mlflow.db")
    uri = planted.format(outside=sandbox.outside)
    ids = {"mlflow": {"run_id": "0123456789abcdef", "tracking_uri": uri}, "trackio": {"project": "../../outside"}}
    (run / IDS_FILE).write_text(json.dumps(ids))
    write_steps(run, ["mlflow"], range(1, 3))
    warnings = clean(capsys.readouterr().err)
    assert warnings[0] == (
        f"mhgpo: warning: {run / IDS_FILE}: mlflow.tracking_uri, trackio.project: ignored; the file keeps only run "
        f"ids (letters, digits, _ and -), and the trackers write in the run folder or where the environment says"
    )
    assert warnings[1] == (
        f"mhgpo: warning: mlflow: the store {local_uri(run)} has no run 0123456789abcdef in its experiment; a new "
        f"run is started"
    )
    assert len(warnings) == 2
    run_id = saved_ids(run)["mlflow"]["run_id"]
    assert saved_ids(run) == {"mlflow": {"run_id": run_id}}
    assert mlflow_steps(local_uri(run), run_id) == [1, 2]
    assert (run / "mlflow-artifacts").is_dir()
    sandbox.assert_nothing_outside()


def test_a_resumed_run_with_a_planted_trackers_json_writes_only_into_itself(
    tiny_model_dir, world, sandbox, capsys
) -> None:
    """The attack end to end: a run folder whose trackers.json points W&B, MLflow and Trackio elsewhere (a
    database outside, an http address) is resumed; every tracker writes where the run and the environment say."""
    from helpers import make_config

    from mhgpo.run.pipeline import resume, train

    names = ["tensorboard", "mlflow", "trackio"]
    cfg = make_config(tiny_model_dir, world, sandbox.run, steps=1, eval_every=0, report_to=json.dumps(names))
    train(cfg, progress=False)
    first = saved_ids(sandbox.run)
    planted = {
        "mlflow": {"run_id": first["mlflow"]["run_id"], "tracking_uri": "http://attacker.example/"},
        "trackio": {"project": "../../../outside", "name": "../../outside/x"},
        "wandb": {"id": "a/../../b"},
        "tensorboard": {"logdir": str(sandbox.outside)},
    }
    (sandbox.run / IDS_FILE).write_text(json.dumps(planted))
    capsys.readouterr()
    resume(sandbox.run, ["steps=2"], progress=False)
    warnings = clean(capsys.readouterr().err)
    assert len(warnings) == 1 and warnings[0].startswith(
        f"mhgpo: warning: {sandbox.run.resolve() / IDS_FILE}: mlflow.tracking_uri, trackio.project, trackio.name "
        f"'../../outside/x' (not a run id), wandb.id 'a/../../b' (not a run id) and 1 more: ignored;"
    )
    assert [r["step"] for r in read_metrics(sandbox.run)] == [1, 2]
    assert mlflow_steps(local_uri(sandbox.run), first["mlflow"]["run_id"]) == [1, 2]  # the same MLflow run
    assert tensorboard_steps(sandbox.run) == [1, 2]
    kept = saved_ids(sandbox.run)
    assert kept["mlflow"] == first["mlflow"] and set(kept) == {"mlflow", "trackio"}
    assert kept["trackio"]["name"] != first["trackio"]["name"]  # (its name was replaced: a new Trackio run)
    sandbox.assert_nothing_outside()


def test_a_copied_run_writes_into_its_copy_and_never_into_the_original(sandbox, mlflow_store, capsys) -> None:
    """The local store is found from the run folder when the run opens: a copy, resumed, continues its own copy
    of the MLflow run; a copy without trackers.json starts a new run in its copy, and its experiment's artifact
    folder (the original's, recorded in the copied database) receives nothing."""
    original = sandbox.outside / "original"
    original.mkdir()
    shutil.copy(mlflow_store, original / "mlflow.db")
    write_steps(original, ["mlflow", "tensorboard"], range(1, 3))
    run_id = saved_ids(original)["mlflow"]["run_id"]
    shutil.copytree(original, sandbox.run)
    sandbox.snapshot()  # (the original is now part of what must not change)

    write_steps(sandbox.run, ["mlflow", "tensorboard"], range(3, 4), resume_step=2)
    assert mlflow_steps(local_uri(sandbox.run), run_id) == [1, 2, 3]
    assert tensorboard_steps(sandbox.run) == [1, 2, 3]
    assert clean(capsys.readouterr().err) == []

    (sandbox.run / IDS_FILE).unlink()
    write_steps(sandbox.run, ["mlflow"], range(1, 2))
    new_id = saved_ids(sandbox.run)["mlflow"]["run_id"]
    assert new_id != run_id and mlflow_steps(local_uri(sandbox.run), new_id) == [1]
    (warning,) = clean(capsys.readouterr().err)
    assert warning.startswith(f"mhgpo: warning: mlflow: the local store keeps artifacts at file://{original}/")
    assert warning.endswith("config.json is not written there (the config is in the run's parameters)")
    assert mlflow_steps(local_uri(original), run_id) == [1, 2]
    sandbox.assert_nothing_outside()


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_the_store_the_environment_names_is_used_inside_or_outside_the_run(
    where, sandbox, mlflow_store, monkeypatch, capsys
) -> None:
    """MLFLOW_TRACKING_URI, the user's choice, is where MLflow writes (the experiment the user made there keeps
    the artifacts), and trackers.json keeps the run id alone."""
    from mlflow.tracking import MlflowClient

    folder = sandbox.env if where == "outside" else sandbox.run
    folder.mkdir(exist_ok=True)
    uri = f"sqlite:///{folder / 'store.db'}"
    shutil.copy(mlflow_store, folder / "store.db")
    MlflowClient(tracking_uri=uri).create_experiment("team", (folder / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    sandbox.snapshot()
    write_steps(sandbox.run, ["mlflow"], range(1, 3))
    write_steps(sandbox.run, ["mlflow"], range(3, 4), resume_step=2)
    run_id = saved_ids(sandbox.run)["mlflow"]["run_id"]
    assert saved_ids(sandbox.run) == {"mlflow": {"run_id": run_id}}
    assert mlflow_steps(uri, run_id) == [1, 2, 3]
    assert not (sandbox.run / "mlflow.db").exists()
    assert [p.name for p in (folder / "artifacts").glob("*/artifacts/config.json")] == ["config.json"]
    assert clean(capsys.readouterr().err) == []
    sandbox.assert_nothing_outside()


@pytest.mark.parametrize("planted", ["mlflow.db", "mlflow.db-journal", "mlflow-artifacts", "tensorboard", "wandb"])
def test_a_local_store_planted_as_a_link_drops_the_tracker_and_writes_nothing_outside(planted, sandbox, capsys) -> None:
    name = "mlflow" if planted.startswith("mlflow") else planted
    target = sandbox.outside / "victim.txt"
    if "." not in planted:  # a folder
        target = sandbox.outside / "folder"
        target.mkdir()
    sandbox.run.mkdir()
    (sandbox.run / planted).symlink_to(target)
    sandbox.snapshot()
    write_steps(sandbox.run, [name, "tensorboard" if name != "tensorboard" else "trackio"], range(1, 3))
    warnings = clean(capsys.readouterr().err)
    assert warnings == [
        f"mhgpo: warning: report_to: {name} failed to start (RuntimeError: {sandbox.run / planted} is a link; a "
        f"tracker writes only inside the run folder); the run goes on without it (metrics.jsonl and checkpoints "
        f"go on)"
    ]
    assert [r["step"] for r in read_metrics(sandbox.run)] == [1, 2]
    sandbox.assert_nothing_outside()


def test_a_store_hard_linked_to_a_file_outside_is_not_written(sandbox, mlflow_store, capsys) -> None:
    shared = sandbox.outside / "shared.db"
    shutil.copy(mlflow_store, shared)
    sandbox.run.mkdir()
    os.link(shared, sandbox.run / "mlflow.db")
    sandbox.snapshot()
    write_steps(sandbox.run, ["mlflow"], range(1, 2))
    (warning,) = clean(capsys.readouterr().err)
    assert "mlflow.db has other hard links; a tracker writes only inside the run folder" in warning
    sandbox.assert_nothing_outside()


# -------------------------------------------------------------------------------------- trackers.json itself


def plant(path: Path, kind: str, outside: Path) -> str:
    """Make `path` a hostile trackers.json of `kind`; returns what read_ids must say of it."""
    valid = json.dumps({"wandb": {"id": "outsiderun01"}})
    if kind == "link":
        (outside / "ids.json").write_text(valid)
        path.symlink_to(outside / "ids.json")
        return "is a link (not followed)"
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
        return "is a link (not followed)"
    if kind == "folder":
        path.mkdir()
        (path / "x").write_text(valid)
        return "is not a file"
    if kind == "fifo":
        os.mkfifo(path)
        return "is not a file"
    if kind == "huge":
        path.write_text(valid[:-1] + ', "pad": "' + "x" * MAX_IDS_BYTES + '"}')
        return f"is {path.stat().st_size} bytes, more than {MAX_IDS_BYTES}"
    content = {
        "not JSON": b"wandb: {id: run1}",
        "not UTF-8": b'{"wandb": {"id": "\xff\xfe"}}',
        "deeply nested": b"[" * 60000 + b"]" * 60000,
        "a list": b'[{"wandb": {"id": "run1"}}]',
        "null": b"null",
        "empty": b"",
    }[kind]
    if kind == "deeply nested":
        content = content[: MAX_IDS_BYTES // 2] + content[-MAX_IDS_BYTES // 2 :]
    path.write_bytes(content)
    return "is not a JSON object" if kind in ("a list", "null") else "is not JSON ("


KINDS = ["link", "link to /dev/zero", "folder", "fifo", "huge", "not JSON", "not UTF-8", "deeply nested", "a list"]


@pytest.mark.parametrize("kind", [*KINDS, "null", "empty"])
def test_a_trackers_json_that_is_not_a_small_json_file_is_ignored_unread(kind, tmp_path) -> None:
    said = plant(tmp_path / IDS_FILE, kind, tmp_path)
    ids, ignored = read_ids(tmp_path / IDS_FILE)
    assert ids == {} and len(ignored) == 1 and ignored[0].startswith(said)
    assert "\n" not in ignored[0] and len(ignored[0]) < 400


@pytest.mark.parametrize("kind", ["link", "folder", "fifo", "huge", "deeply nested"])
def test_a_run_with_such_a_trackers_json_goes_on_with_new_tracker_runs(kind, sandbox, capsys) -> None:
    """W&B (offline) starts a new run; the file, when it is not a folder, is replaced by one holding the new id
    (a link is replaced, not written through); a folder that cannot be replaced is one more warning."""
    sandbox.run.mkdir()
    said = plant(sandbox.run / IDS_FILE, kind, sandbox.outside)
    sandbox.snapshot()
    write_steps(sandbox.run, ["wandb", "tensorboard"], range(1, 3))
    warnings = clean(capsys.readouterr().err)
    assert warnings[0].startswith(f"mhgpo: warning: {sandbox.run / IDS_FILE}: {said}")
    assert len(warnings) == (2 if kind == "folder" else 1)
    if kind == "folder":
        assert warnings[1].startswith(f"mhgpo: warning: {sandbox.run / IDS_FILE}: cannot be written (")
        assert warnings[1].endswith("a resumed run starts a new wandb run")
    else:
        assert not (sandbox.run / IDS_FILE).is_symlink()
        assert saved_ids(sandbox.run)["wandb"]["id"] not in ("outsiderun01", "run1")
    assert len(list((sandbox.run / "wandb").glob("offline-run-*"))) == 1
    assert tensorboard_steps(sandbox.run) == [1, 2]
    sandbox.assert_nothing_outside()


BAD_IDS = ["../../evil", "a/b", "a\\b", "..", ".", "", "-x", "x" * 65, "a b", "é", "a\x00b", "~root", 7, None, ["x"]]


@pytest.mark.parametrize("value", BAD_IDS, ids=[repr(v)[:20] for v in BAD_IDS])
def test_an_id_that_is_not_a_short_token_is_ignored(value, tmp_path) -> None:
    (tmp_path / IDS_FILE).write_text(json.dumps({"wandb": {"id": value}, "mlflow": {"run_id": "ab12_cd-34"}}))
    ids, ignored = read_ids(tmp_path / IDS_FILE)
    assert ids == {"mlflow": "ab12_cd-34"}
    assert ignored == [f"wandb.id {one_line(repr(value), 40)} (not a run id)"]


def test_ids_with_path_separators_send_no_tracker_outside(sandbox, mlflow_store, capsys) -> None:
    """Hostile ids for every tracker at once: each starts a new run inside the run folder (Trackio in its
    database, which the environment names), and the new ids replace them."""
    sandbox.run.mkdir()
    shutil.copy(mlflow_store, sandbox.run / "mlflow.db")
    (sandbox.outside / "x").mkdir()
    hostile = "../../outside/x"
    ids = {"wandb": {"id": hostile}, "mlflow": {"run_id": hostile}, "trackio": {"name": hostile}}
    (sandbox.run / IDS_FILE).write_text(json.dumps(ids))
    sandbox.snapshot()
    write_steps(sandbox.run, ["wandb", "mlflow", "trackio"], range(1, 3))
    (warning,) = clean(capsys.readouterr().err)
    assert warning.count("(not a run id)") == 3
    kept = saved_ids(sandbox.run)
    assert sorted(kept) == ["mlflow", "trackio", "wandb"] and hostile not in json.dumps(kept)
    assert kept["trackio"]["name"].startswith("run-")
    assert mlflow_steps(local_uri(sandbox.run), kept["mlflow"]["run_id"]) == [1, 2]
    sandbox.assert_nothing_outside()


# --------------------------------------------------------------------------------------- failing trackers


class Flaky:
    """Raises `error` from the wrapped method at `step` (every call when None)."""

    def __init__(self, monkeypatch, owner, method: str, error: BaseException, step: int | None = None) -> None:
        real = getattr(owner, method)

        def flaky(*args, **kwargs):
            if step is None or _step_of(args, kwargs) == step:
                raise error
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, method, flaky)


def _step_of(args, kwargs) -> int | None:
    if "step" in kwargs:
        return kwargs["step"]
    metrics = kwargs.get("metrics") or (args[2] if len(args) > 2 and isinstance(args[2], list) else None)
    if metrics:  # MLflow's log_batch: Metric objects
        return metrics[0].step
    return args[-1] if args and isinstance(args[-1], int) else None


NETWORK = (
    "API request to https://user:secret@mlflow.example/api/2.0/mlflow/runs/log-batch failed with exception "
    "HTTPSConnectionPool(host='mlflow.example', port=443): Max retries exceeded\n\x1b[31mFAKE\x1b[0m"
)


def fault(name: str, phase: str, monkeypatch) -> BaseException:
    """Make tracker `name` fail at `phase` (start, log at step 2, close) the way its library fails; the error."""
    import requests

    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        error = OSError(errno.ENOSPC, "No space left on device")
        owner, method = SummaryWriter, {"start": "__init__", "log": "add_scalar", "close": "close"}[phase]
    elif name == "wandb":
        import wandb
        from wandb.sdk.wandb_run import Run

        error = wandb.errors.CommError("Network error (ConnectTimeout), entering retry loop.")
        owner, method = {"start": (wandb, "init"), "log": (Run, "log"), "close": (Run, "finish")}[phase]
    elif name == "mlflow":
        from mlflow.tracking import MlflowClient

        error = requests.exceptions.ConnectionError(NETWORK)
        owner = MlflowClient
        method = {"start": "get_experiment_by_name", "log": "log_batch", "close": "set_terminated"}[phase]
    else:
        import trackio
        from trackio.run import Run

        error = OSError(errno.EIO, "Input/output error")
        owner, method = {"start": (trackio, "init"), "log": (Run, "log"), "close": (Run, "finish")}[phase]
    Flaky(monkeypatch, owner, method, error, step=2 if phase == "log" else None)
    return error


@pytest.mark.parametrize("phase", ["start", "log", "close"])
@pytest.mark.parametrize("name", ["tensorboard", "wandb", "mlflow", "trackio"])
def test_a_failing_tracker_is_one_warning_line_and_the_others_and_metrics_go_on(
    name, phase, sandbox, mlflow_store, monkeypatch, capsys
) -> None:
    other = "tensorboard" if name != "tensorboard" else "trackio"
    sandbox.run.mkdir()
    shutil.copy(mlflow_store, sandbox.run / "mlflow.db")
    error = fault(name, phase, monkeypatch)
    write_steps(sandbox.run, [name, other], range(1, 4))
    what = {"start": "failed to start", "log": "failed at step 2", "close": "failed to close its run"}[phase]
    then = {
        "start": "the run goes on without it (metrics.jsonl and checkpoints go on)",
        "log": LEFT_OUT,
        "close": "metrics.jsonl holds every step",
    }[phase]
    err = capsys.readouterr().err
    assert clean(err) == [
        f"mhgpo: warning: report_to: {name} {what} ({type(error).__name__}: {one_line(str(error))}); {then}"
    ]
    assert "secret" not in err and "\x1b" not in err  # (MLflow's error names a URL with a password, and escapes)
    assert [r["step"] for r in read_metrics(sandbox.run)] == [1, 2, 3]
    if name == "tensorboard" and phase != "start":
        assert tensorboard_steps(sandbox.run) == ([1] if phase == "log" else [1, 2, 3])
    elif name != "tensorboard":
        assert tensorboard_steps(sandbox.run) == [1, 2, 3]  # the other tracker goes on
    if name == "mlflow" and phase != "start":
        assert mlflow_steps(local_uri(sandbox.run), saved_ids(sandbox.run)["mlflow"]["run_id"]) == (
            [1] if phase == "log" else [1, 2, 3]
        )
    sandbox.assert_nothing_outside()


def test_the_warning_is_escaped_and_masks_credentials() -> None:
    text = one_line(NETWORK + " sqlite://a:b@c/ \r\u202e\udcff")
    assert text == (
        "API request to https://***@mlflow.example/api/2.0/mlflow/runs/log-batch failed with exception "
        "HTTPSConnectionPool(host='mlflow.example', port=443): Max retries exceeded\\n\\x1b[31mFAKE\\x1b[0m "
        "sqlite://***@c/ \\r\\u202e\\udcff"
    )
    assert one_line("x" * 1000) == "x" * 300 + "..."


def test_an_interrupt_in_a_tracker_is_not_swallowed(sandbox, monkeypatch) -> None:
    from torch.utils.tensorboard import SummaryWriter

    Flaky(monkeypatch, SummaryWriter, "add_scalar", KeyboardInterrupt(), step=2)
    log = RunLog(sandbox.run, report_to=["tensorboard"])
    log.log(1, ROWS[1])
    with pytest.raises(KeyboardInterrupt):
        log.log(2, ROWS[2])
    log.close()


def test_a_full_disk_under_the_store_drops_the_tracker(sandbox, mlflow_store, tmpfs, monkeypatch, capsys) -> None:
    """A real full disk: MLflow's store (named by the environment) on a 2 MiB tmpfs that fills after the run
    opened; the SQLite error is the warning, and TensorBoard and metrics.jsonl go on."""
    from mlflow.tracking import MlflowClient

    sandbox.skip.append(tmpfs)  # (the store the environment names)
    uri = f"sqlite:///{tmpfs / 'store.db'}"
    shutil.copy(mlflow_store, tmpfs / "store.db")
    MlflowClient(tracking_uri=uri).create_experiment("mhgpo", (tmpfs / "artifacts").as_uri())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    log = RunLog(sandbox.run, report_to=["mlflow", "tensorboard"], config={"seed": 1})
    log.log(1, ROWS[1])
    fd = os.open(tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # the disk fills
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    log.log(2, {f"metric_{i}": float(i) for i in range(2000)} | ROWS[2])
    log.log(3, ROWS[3])
    log.close()
    (warning,) = clean(capsys.readouterr().err)
    assert warning.startswith("mhgpo: warning: report_to: mlflow failed at step 2 (MlflowException: ")
    assert "full" in warning and warning.endswith(LEFT_OUT)
    assert [r["step"] for r in read_metrics(sandbox.run)] == [1, 2, 3]
    assert tensorboard_steps(sandbox.run) == [1, 2, 3]
    sandbox.assert_nothing_outside()


def test_a_run_whose_trackers_fail_finishes_with_every_step_logged_and_saved(
    tiny_model_dir, world, sandbox, monkeypatch, capsys
) -> None:
    """A real short run (tiny model, 3 steps, a checkpoint every step): W&B online cannot reach its server at
    start, MLflow's server goes away at step 2, Trackio fails to close; TensorBoard works. The run finishes, one
    warning line each, metrics.jsonl holds every step and every due checkpoint is saved."""
    from helpers import make_config

    from mhgpo.model.checkpoint import list_checkpoints
    from mhgpo.run.pipeline import train

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    errors = {name: fault(name, phase, monkeypatch) for name, phase in (("wandb", "start"), ("mlflow", "log"))}
    errors["trackio"] = fault("trackio", "close", monkeypatch)
    names = ["tensorboard", "wandb", "mlflow", "trackio"]
    cfg = make_config(tiny_model_dir, world, sandbox.run, steps=3, keep_checkpoints=3, report_to=json.dumps(names))
    trainer = train(cfg, progress=False)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out
    assert clean(captured.err) == [
        f"mhgpo: warning: report_to: wandb failed to start (CommError: {one_line(str(errors['wandb']))}); the run "
        f"goes on without it (metrics.jsonl and checkpoints go on)",
        f"mhgpo: warning: report_to: mlflow failed at step 2 (ConnectionError: {one_line(str(errors['mlflow']))}); "
        f"{LEFT_OUT}",
        f"mhgpo: warning: report_to: trackio failed to close its run (OSError: {one_line(str(errors['trackio']))}); "
        f"metrics.jsonl holds every step",
    ]
    assert trainer.step == 3
    rows = read_metrics(sandbox.run)
    assert [r["step"] for r in rows] == [1, 2, 3] and "val/f1" in rows[1]
    assert [p.name for p in list_checkpoints(sandbox.run)] == ["step_1", "step_2", "step_3"]
    assert tensorboard_steps(sandbox.run) == [1, 2, 3]
    assert mlflow_steps(local_uri(sandbox.run), saved_ids(sandbox.run)["mlflow"]["run_id"]) == [1]
    sandbox.assert_nothing_outside()
