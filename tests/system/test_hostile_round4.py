"""Hostile inputs, round 4: `mhgpo reproduce` (its job processes, its output folder, its result files and page,
signals sent to it), the config loader and the settled config. Each case must end with one `mhgpo: error:` line (or
do what was asked), run no code it was not asked to, and lose nothing already done.

No model is loaded: the jobs are fakes, or jobs whose result is there already.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import assert_one_line_error, cli

from mhgpo.config import TrainConfig, load_config
from mhgpo.config.rows import load_rows
from mhgpo.errors import InputError, RunError
from mhgpo.experiments import runner
from mhgpo.experiments.jobs import Job
from mhgpo.experiments.results import result_path
from mhgpo.io import atomic_write_json

ROOT = Path(__file__).resolve().parents[2]
TABLE = load_rows(ROOT / "experiments" / "rows.yaml")
SETTINGS = {"minutes": 0.5, "clock": "cpu", "val_limit": 4, "overrides": []}


def result(row: str, seed: int, f1: float = 20.0, **more) -> dict:
    """A finished result of `row` as a job writes it."""
    return {
        "row": row,
        "seed": seed,
        "steps": 3,
        "val_f1": f1,
        "val_acc": 50.0,
        "val_n": 4,
        "questions_per_step": 4,
        "settings": SETTINGS,
        "overrides": TABLE.row(row).overrides,
        "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None},
        "steps_metrics": [],
        **more,
    }


# --------------------------------------------------------------------------------------------- job processes

PLANTED = "from pathlib import Path\nPath(__file__).resolve().parent.joinpath('IMPORTED-{name}').write_text('ran')\n"


def test_a_job_imports_the_mhgpo_of_reproduce_not_code_in_the_working_folder(tmp_path, monkeypatch, capsys) -> None:
    """`python -m` puts the working folder first on sys.path: a `mhgpo/` package or a `yaml.py` where reproduce runs
    would run inside every job. The job starts without that entry, from the mhgpo this process imported."""
    cwd = tmp_path / "cwd"
    (cwd / "mhgpo").mkdir(parents=True)
    (cwd / "mhgpo" / "__init__.py").write_text(PLANTED.format(name="mhgpo").replace(".parent.", ".parent.parent."))
    for name in ("yaml", "numpy", "importlib"):
        (cwd / f"{name}.py").write_text(PLANTED.format(name=name))
    out = tmp_path / "out"
    atomic_write_json(result_path(out, "untrained", 0), result("untrained", 0))  # the job reads it and ends
    monkeypatch.chdir(cwd)
    job = Job("row", str(TABLE.path), str(out), "untrained", 0, SETTINGS)
    assert runner.subprocesses([job], 1, out / "logs") == [], (out / "logs" / f"{job.name}.log").read_text()
    assert "done: row untrained seed 0" in capsys.readouterr().out
    assert sorted(p.name for p in cwd.iterdir() if p.name.startswith("IMPORTED")) == []
    # (the planted files are live: the job as it was started, `python -m mhgpo.experiments.jobs`, runs one)
    subprocess.run([sys.executable, "-m", "mhgpo.experiments.jobs", job.to_json()], capture_output=True, check=False)
    assert (cwd / "IMPORTED-mhgpo").is_file()


def test_a_job_imports_the_same_mhgpo_where_its_own_path_finds_another_or_none(tmp_path) -> None:
    """reproduce run from a source checkout (mhgpo found through the working folder or PYTHONPATH, another one or
    none installed): the job imports the mhgpo reproduce runs, from the folder it came from."""
    import mhgpo

    job = Job("row", "rows.yaml", "out", "untrained", 0, SETTINGS)
    cmd = runner.job_command(job)
    boot = cmd[2].split("from mhgpo.experiments.jobs import main")[0]
    probe = [*cmd[:2], boot + "import mhgpo; print(mhgpo.__file__)"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(tmp_path)  # mhgpo is not there
    shown = subprocess.run([*probe, *cmd[3:]], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.splitlines()[0] == os.path.realpath(mhgpo.__file__)


# ------------------------------------------------------------------------------------------------------ signals

FAKE_JOB = """
import os, signal, sys, time
from pathlib import Path
marks, name = Path(sys.argv[1]), sys.argv[2]
def stop(signum, frame):
    (marks / f"{name}.stopped").write_text(str(signum))
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
(marks / f"{name}.started").write_text(f"{os.getpid()} {os.getpgid(0)}")
time.sleep(60)
(marks / f"{name}.finished").write_text("")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_reproduce_alone_stops_its_jobs_and_waits_for_them(tmp_path, monkeypatch, capsys, sig) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(runner, "job_command", lambda job: [sys.executable, "-c", FAKE_JOB, str(marks), job.name])
    jobs = [Job("row", "rows.yaml", str(tmp_path), f"row{i}", 0, SETTINGS) for i in range(3)]
    before = signal.getsignal(sig)

    def send() -> None:  # once the first two jobs run: the signal, to this process alone
        deadline = time.monotonic() + 30
        while len(list(marks.glob("*.started"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    with pytest.raises(
        RunError, match=rf"stopped by {sig.name}: the running jobs were passed it and have ended, 1 not"
    ):
        runner.subprocesses(jobs, 2, tmp_path / "logs")
    started = {p.stem: p.read_text().split() for p in marks.glob("*.started")}
    assert sorted(started) == [jobs[0].name, jobs[1].name]  # the third never started
    for name, (pid, group) in started.items():
        passed = signal.SIGTERM if sig == signal.SIGHUP else sig  # (a hang-up: the jobs save on SIGTERM)
        assert (marks / f"{name}.stopped").read_text() == str(int(passed))  # passed on, once; each job ended on it
        assert int(group) != os.getpgrp()  # a group of its own: a terminal's Ctrl-C reaches it only through reproduce
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    assert not list(marks.glob("*.finished")) and signal.getsignal(sig) == before
    out = capsys.readouterr().out
    assert f"{sig.name}: stopping the 2 running jobs" in out and out.count("failed (exit 3)") == 2


def test_reproduce_sent_sigterm_alone_passes_it_on_and_ends_with_one_line(tmp_path) -> None:
    """`mhgpo reproduce` in a process of its own (its jobs fakes that save on the signal), sent SIGTERM alone."""
    marks = tmp_path / "marks"
    marks.mkdir()
    script = (
        "import sys\nfrom mhgpo.experiments import runner\n"
        f"runner.job_command = lambda job: [sys.executable, '-c', {FAKE_JOB!r}, {str(marks)!r}, job.name]\n"
        "from mhgpo.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    args = ["reproduce", "--rows", "untrained", "--seeds", "0,1", "--rows-file", TABLE.path, "--out", tmp_path / "out"]
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while len(list(marks.glob("*.started"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert_one_line_error(proc.returncode, err, r"stopped by SIGTERM: the running jobs were passed it and have ended")
    assert sorted(p.name for p in marks.iterdir() if not p.name.endswith(".started")) == [
        "row-untrained-seed0.stopped",
        "row-untrained-seed1.stopped",
    ]


# --------------------------------------------------------------------------------------------------- YAML files


def laughs(levels: int = 9, key: str = "model") -> str:
    """A few hundred bytes of nested aliases under `key` that stand for 9**levels strings."""
    lines = ['  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghijklmnop"
    for prev, name in zip(names[: levels - 1], names[1:levels]):
        lines.append(f"  {name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return f"{key}:\n" + "\n".join(lines) + "\n"


HOSTILE_YAML = {
    "laughs": (laughs(), r"its aliases \(\*name\) expand it beyond 100000 values; refused"),
    "itself": ("model: &a [1, *a]\n", r"an alias \(\*name\) inside the value it names"),
    "deep": ("model: " + "[" * 3000 + "]" * 3000 + "\n", r"nested too deeply \(at most 100 levels\)"),
    "large": ("# " + "x" * (1 << 20) + "\nmodel: m\n", r"more than 1048576 characters; refused"),
    "twice": ("steps: 1\nlora:\n  r: 4\nsteps: 2\n", r"key 'steps' given twice in one mapping"),
    "bytes": (b"model: \xff\xfe\n", r"invalid YAML \('utf-8' codec can't decode byte 0xff"),
}


@pytest.mark.parametrize("case", list(HOSTILE_YAML))
def test_a_hostile_config_file_is_refused_at_once_with_one_line(tmp_path, capsys, case) -> None:
    text, message = HOSTILE_YAML[case]
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    start = time.perf_counter()
    rc, _, err = cli(capsys, "train", "--config", path, "--output-dir", tmp_path / "run")
    assert time.perf_counter() - start < 10
    where = ":4" if case == "twice" else ""  # (the line of the second)
    assert_one_line_error(rc, err, rf"^mhgpo: error: {path}{where}: {message}")
    assert not (tmp_path / "run").exists()


def test_nested_aliases_in_a_runs_config_are_refused_by_eval_train_resume_and_report(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step_1").mkdir(parents=True)
    (run / "config.yaml").write_text(laughs())
    for args in (["eval", "--model", run], ["train", "--resume", run], ["report", run]):
        rc, _, err = cli(capsys, *args)
        assert_one_line_error(rc, err, rf"^mhgpo: error: {run / 'config.yaml'}: its aliases \(\*name\) expand it")


def test_nested_aliases_in_an_override_are_refused(tmp_path, capsys) -> None:
    value = "[&a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for prev, name in zip("abcd", "bcde"):
        value += f", &{name} [" + ", ".join([f"*{prev}"] * 10) + "]"
    rc, _, err = cli(capsys, "train", f"tags={value}]", "--output-dir", tmp_path / "run")
    assert_one_line_error(rc, err, r"^mhgpo: error: override tags: its aliases \(\*name\) expand it beyond")


def test_an_error_never_repeats_a_huge_value(tmp_path, capsys) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model: [" + ", ".join(["1234567890"] * 50_000) + "]\n")
    rc, _, err = cli(capsys, "train", "--config", path, "--output-dir", tmp_path / "run")
    assert_one_line_error(
        rc, err, r"model: expected a string, got \[1234567890, (1234567890, ){8}1234567890, \.\.\.\]$"
    )
    assert len(err) < 300
    with pytest.raises(InputError) as caught:
        load_config(TrainConfig, None, ["steps=" + "x" * 100_000])
    assert str(caught.value).startswith("steps: expected an integer, got 'xxx") and len(str(caught.value)) < 300


def test_a_fifo_as_the_table_of_rows_is_refused_not_waited_on(tmp_path, capsys) -> None:
    fifo = tmp_path / "rows.yaml"
    os.mkfifo(fifo)

    def hung(signum, frame):
        raise TimeoutError("waited on the fifo")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        rc, _, err = cli(capsys, "reproduce", "--doc-only", "--rows-file", fifo, "--out", tmp_path / "out")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert_one_line_error(rc, err, rf"^mhgpo: error: {fifo}: not a regular file")


# ------------------------------------------------------------------------------- reproduce's output folder and flags


def failing(jobs, parallel, logs):
    """A runner whose every job fails (writing nothing)."""
    return list(jobs)


def reproduce(capsys, out: Path, *more: object) -> tuple[int, str, str]:
    return cli(
        capsys, "reproduce", "--rows", "untrained", "--seeds", "0", "--rows-file", TABLE.path, "--out", out, *more
    )


def test_a_data_folder_that_is_a_link_is_refused(tmp_path, capsys) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "synthetic").symlink_to(elsewhere)
    rc, _, err = reproduce(capsys, out)
    assert_one_line_error(rc, err, rf"{out / 'synthetic'}: is a link; the harness writes only into a data folder")
    assert list(elsewhere.iterdir()) == []


def test_data_without_its_kind_names_a_folder_inside_out(tmp_path, capsys, monkeypatch) -> None:
    from mhgpo.experiments.results import data_tag

    monkeypatch.setattr(runner, "subprocesses", failing)
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a" / "b")
    out = Path("out")
    rc, _, err = reproduce(capsys, out, "--data", "../../x.jsonl", "--val-data", "../../y.jsonl")
    assert_one_line_error(rc, err, r"no result for untrained seed 0")
    tag = data_tag("../../x.jsonl", "../../y.jsonl")
    assert "/" not in tag and tag.startswith("______x_jsonl-")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "a",
        "a/b",
        "a/b/out",
        f"a/b/out/{tag}",
    ]


def test_settings_are_not_pinned_by_a_run_whose_every_job_failed(tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(runner, "subprocesses", failing)
    rc, _, err = reproduce(capsys, out, "--minutes", "1")
    assert_one_line_error(rc, err, r"no result for untrained seed 0")
    assert not (out / "synthetic" / "settings.json").exists()

    def writes(jobs, parallel, logs):
        atomic_write_json(result_path(out / "synthetic", "untrained", 0), result("untrained", 0, settings=settings))
        return []

    settings = {**SETTINGS, "minutes": 2.0, "val_limit": 100}
    monkeypatch.setattr(runner, "subprocesses", writes)
    rc, _, err = reproduce(capsys, out, "--minutes", "2")  # other settings: not refused, the folder holds nothing
    assert rc == 0, err
    assert json.loads((out / "synthetic" / "settings.json").read_text()) == settings
    monkeypatch.setattr(runner, "subprocesses", failing)
    rc, _, err = reproduce(capsys, out, "--minutes", "2", "--seeds", "1")  # a failure now keeps the pinned settings
    assert rc == 2 and json.loads((out / "synthetic" / "settings.json").read_text()) == settings


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seeds", "0,-1"], r"--seeds: a seed is between 0 and 4294967295 \(2\*\*32 - 1\), got -1"),
        (["--seeds", "4294967296"], r"--seeds: a seed is between 0 and 4294967295"),
        (["--seeds", ",".join(map(str, range(1001)))], r"--seeds: 1001 seeds; at most 1000 in one command"),
        (["--seeds", "0,x" + "9" * 5000], r"--seeds: expected comma-separated integers, got '0,x9+\.\.\.9+'$"),
        (["--minutes", "nan"], r"--minutes: expected a positive number of minutes, got nan"),
        (["--minutes", "inf"], r"--minutes: expected a positive number of minutes, got inf"),
        (["--minutes", "0"], r"--minutes: expected a positive number of minutes, got 0.0"),
        (["--parallel", "0"], r"--parallel: must be at least 1, got 0"),
        (["--val-limit", "-3"], r"--val-limit: must be at least 1, got -3"),
    ],
)
def test_flags_no_row_could_run_with_are_refused_before_anything_is_written(tmp_path, capsys, flags, message) -> None:
    rc, _, err = reproduce(capsys, tmp_path / "out", *flags)
    assert_one_line_error(rc, err, message)
    assert not (tmp_path / "out").exists()


def test_a_seed_given_twice_runs_once(tmp_path, capsys, monkeypatch) -> None:
    ran: list = []
    monkeypatch.setattr(runner, "subprocesses", lambda jobs, parallel, logs: ran.extend(jobs) or list(jobs))
    reproduce(capsys, tmp_path / "out", "--seeds", "3,3,1,3")
    assert [(j.key, j.seed) for j in ran] == [("untrained", 3), ("untrained", 1)]


def test_a_row_whose_model_names_nothing_is_refused_before_settings_are_pinned(tmp_path, capsys) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for model in (tmp_path / "nothing", tmp_path / "loop"):
        rc, _, err = reproduce(capsys, tmp_path / "out", f"model={model}")
        assert_one_line_error(rc, err, rf"untrained: model: Could not load model '{model}'")
        assert not (tmp_path / "out" / "synthetic" / "settings.json").exists()


# --------------------------------------------------------------------------------------------- the settled config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model={bad}"], r"model: Could not load model '.*nothing'"),
        (["warm_start.enabled=true", "warm_start.model={bad}"], r"warm_start.model: Could not load model '.*nothing'"),
        (["warm_start.enabled=true", "model={loop}"], r"model: Could not load model '.*loop'"),
        (["seed=-1"], r"seed: must be between 0 and 4294967295 \(2\*\*32 - 1\), got -1"),
        (["seed=4294967296"], r"seed: must be between 0 and 4294967295"),
    ],
)
def test_a_run_that_could_never_start_leaves_no_folder(tmp_path, capsys, overrides, message) -> None:
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    given = [o.format(bad=tmp_path / "nothing", loop=tmp_path / "loop") for o in overrides]
    rc, _, err = cli(capsys, "train", *given, "report_to=[]", "--output-dir", tmp_path / "run")
    assert_one_line_error(rc, err, message)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ passwords

RECORDING_JOB = """
import json, os, sys
from pathlib import Path
marks, job = Path(sys.argv[1]), json.loads(sys.argv[-1])
(marks / "env").write_text(os.environ.get("MHGPO_RETRIEVER_AUTH", ""))
(marks / "argv").write_text(json.dumps(sys.argv))
result = {"row": job["key"], "seed": job["seed"], "steps": 0, "val_f1": 1.0, "val_acc": 1.0, "val_n": 4,
          "settings": job["settings"], "machine": {"cpu": "Test CPU", "cores": 2, "gpu": None}}
Path(job["folder"], f"{job['key']}-seed{job['seed']}.json").write_text(json.dumps(result))
"""


def test_a_retrieval_service_password_reaches_the_job_and_nothing_it_records(tmp_path, capsys, monkeypatch) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(
        runner, "job_command", lambda job: [sys.executable, "-c", RECORDING_JOB, str(marks), job.to_json()]
    )
    monkeypatch.delenv("MHGPO_RETRIEVER_AUTH", raising=False)
    out = tmp_path / "out"
    url = "http://alice:s3cr3t-pw@127.0.0.1:9/retrieve"
    rc, stdout, err = reproduce(capsys, out, f"retrieval.retriever={url}")
    assert rc == 0, err
    assert (marks / "env").read_text() == "alice:s3cr3t-pw"  # the job gets it from its environment
    assert "s3cr3t" not in (marks / "argv").read_text()  # not from its command line
    assert "retrieval.retriever=http://alice:***@127.0.0.1:9/retrieve" in (marks / "argv").read_text()
    assert "s3cr3t" not in stdout + err
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"settings.json", "untrained-seed0.json", "reproduction.md"}
    assert [p for p in files if b"s3cr3t" in p.read_bytes()] == []
    assert "retrieval.retriever=http://alice:***@127.0.0.1:9/retrieve" in (out / "reproduction.md").read_text()


def test_a_password_under_a_key_that_cannot_take_one_is_refused(tmp_path, capsys) -> None:
    rc, _, err = reproduce(capsys, tmp_path / "out", "tags=[x]", "data=http://bob:hunter2@host/x.jsonl")
    assert_one_line_error(rc, err, r"data: http://bob:\*\*\*@host/x.jsonl carries a password, which the results")
    assert "hunter2" not in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- result files, the page

REWARD = ("warm_rr", "warm_rr_final_only", "warm_mappo", "warm_mappo_final_only")  # the reward table's rows


def results_folder(out: Path, settings: dict | None = None, **by_seed: float) -> Path:
    """OUT/synthetic with the reward table's every row on seeds 0, 1, 2 (F1 10 + seed, 20 + seed for warm_rr)."""
    folder = out / "synthetic"
    folder.mkdir(parents=True)
    atomic_write_json(folder / "settings.json", settings or SETTINGS)
    for row in REWARD:
        for seed in (0, 1, 2):
            f1 = (20.0 if row == "warm_rr" else 10.0) + seed
            atomic_write_json(result_path(folder, row, seed), result(row, seed, f1, settings=settings or SETTINGS))
    return folder


def reward_part(text: str) -> str:
    return text.split("## reward\n")[1].split("\n## ")[0]


def test_hostile_result_files_are_left_out_each_named_in_one_line(tmp_path, capsys) -> None:
    from mhgpo.experiments.page import write_page

    out = tmp_path / "out"
    folder = results_folder(out)
    good = json.loads(result_path(folder, "warm_rr", 0).read_text())
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({**good, "seed": 3}))
    bad = {
        "warm_rr-seed3.json": None,  # a link (to a good result elsewhere): not followed
        "warm_rr-seed4.json": json.dumps({**good, "seed": 4, "val_f1": "90"}),
        "warm_rr-seed5.json": json.dumps({**good, "seed": "5"}),
        "warm_rr-seed6.json": json.dumps({**good, "seed": 6, "settings": "mine"}),
        "warm_rr-seed7.json": json.dumps({**good, "seed": 7, "steps_metrics": [{"llm_calls": "many"}]}),
        "warm_rr-seed8.json": json.dumps({**good, "seed": 8, "ood": {"x": {"data": "d", "f1": None}}}),
        "warm_rr-seed9.json": json.dumps({**good, "seed": 9})[:-1] + ', "val_f1": 99.0}',  # a key twice
        "warm_rr-seed10.json": '{"row": ' * 100_000,  # nested too deeply for the parser
        "warm_rr-seed11.json": json.dumps({**good, "seed": 11}).encode().replace(b"Test CPU", b"\xff\xfe"),
        "warm_rr-seed12.json": json.dumps({**good, "seed": 12, "settings": {**SETTINGS, "minutes": 99.0}}),
        "warm_rr-seed13.json": "fifo",
        "warm_rr-seed14.json": "folder",
        "warm_rr-seed15.json": "large",
        "warm_rr-seed16.json": json.dumps({**good, "seed": 16, "val_curve": [{"step": 0, "f1": "x"}]}),
        "warm_rr-seed17.json": json.dumps({**good, "seed": 17, "start_questions": [{"id": 1, "f1": 0.5}]}),
        "warm_rr-seed18.json": json.dumps({**good, "seed": 18, "val_questions": "all"}),
        "warm_rr-seed19.json": json.dumps({**good, "seed": 19, "healthy": "yes"}),
    }
    for name, content in bad.items():
        path = folder / name
        if content is None:
            path.symlink_to(elsewhere)
        elif content == "fifo":
            os.mkfifo(path)
        elif content == "folder":
            path.mkdir()
        elif content == "large":
            with path.open("wb") as f:
                f.truncate(65 << 20)  # (sparse)
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    capsys.readouterr()
    text = write_page(out, tmp_path / "page.md", "out")
    err = capsys.readouterr().err.splitlines()
    named = [line.removeprefix("mhgpo: left out ").split(": ", 1) for line in err]
    assert sorted(path for path, _ in named) == sorted(str(folder / name) for name in bad), err
    reasons = {path.rsplit("-seed", 1)[1]: why for path, why in named}
    assert reasons["3.json"].startswith("is a link")
    assert reasons["4.json"] == "val_f1: expected a number, got '90'"
    assert reasons["9.json"] == "the key 'val_f1' given twice"
    assert reasons["10.json"] == "nested too deeply"
    assert reasons["11.json"].startswith("not UTF-8 text")
    assert reasons["12.json"] == "it ran under other settings than " + f"{folder}'s"
    assert reasons["13.json"] == reasons["14.json"] == "not a regular file"
    assert reasons["15.json"].startswith("68157440 bytes, more than the 67108864")
    assert reasons["16.json"].startswith("val_curve: expected a learning curve")  # the curves part reads these
    assert reasons["17.json"].startswith("start_questions: expected a list of per-question scores")
    assert reasons["18.json"] == "val_questions: expected a list of per-question scores, got 'all'"
    assert reasons["19.json"] == "healthy: expected true, false or null, got 'yes'"
    assert "| `warm_rr` | 3 | 3.0 ± 0.0 | 21.0 ± 1.0 |" in reward_part(text)  # seeds 0, 1, 2 alone


def test_strings_from_result_files_cannot_change_the_page(tmp_path) -> None:
    from mhgpo.experiments.page import code, md, page

    settings = {**SETTINGS, "overrides": ["data=x`y|z<b>", "val_data=v]](http://e)", "tags=[`a``]"]}
    out = tmp_path / "out"
    folder = results_folder(out, settings)
    evil = {"cpu": "<img src=x onerror=alert(1)> | [x](http://e) **b**", "cores": 2, "gpu": "G\n\n## injected"}
    for seed in (0, 1, 2):
        path = result_path(folder, "warm_rr", seed)
        res = json.loads(path.read_text())
        ood = {"a|b<script>": {"data": "d`|", "f1": 1.0}}
        atomic_write_json(path, {**res, "machine": evil, "ood": ood})
    text = reward_part(page(out, "out"))
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("Command: "))  # (code: shown as is)
    assert not re.search(r"(?<!\\)(<img|<script|<b>|\]\()", prose)  # only escaped
    assert "\n## injected" not in text
    assert r"\<img src=x onerror=alert(1)\> \| \[x\](http://e) \*\*b\*\*, 2 cores, G \#\# injected" in text
    assert "### x\\`y\\|z\\<b\\>, validated on v\\]\\](http://e)" in text
    tables = [line for line in text.splitlines() if line.startswith("| `warm_rr` |")]
    headers = [line for line in text.splitlines() if line.startswith("| row |")]
    assert len(tables) == len(headers) == 3  # in domain, out of domain, cost
    for table, header in zip(tables, headers):  # no cell added
        assert len(re.findall(r"(?<!\\)\|", table)) == len(re.findall(r"(?<!\\)\|", header))
    assert "a\\|b\\<script\\> F1" in headers[1]  # the out-of-domain table's
    command = [line for line in text.splitlines() if line.startswith("Command: ")][0]
    assert command.startswith("Command: ```mhgpo reproduce --table reward") and command.endswith(" tags=[`a``]```")
    assert md("a\nb|c") == "a b\\|c" and code("x`y") == "``x`y``" and code("`x") == "`` `x ``"


def test_a_nan_result_gets_no_verdict_and_is_noted(tmp_path) -> None:
    from mhgpo.experiments.page import page

    out = tmp_path / "out"
    folder = results_folder(out)
    path = result_path(folder, "warm_rr", 2)
    path.write_text(path.read_text().replace('"val_f1": 22.0', '"val_f1": NaN'))
    text = reward_part(page(out, "out"))
    assert "| `warm_rr` | 3 | 3.0 ± 0.0 | 20.5 ± 0.7 (1 not finite) |" in text
    assert "| 10.00 ± 0.00 | within noise (1 seed with a NaN or infinite result left out) |" in text
    path.write_text(path.read_text().replace('"val_f1": NaN', '"val_f1": Infinity'))
    assert "within noise (1 seed with a NaN or infinite result left out)" in reward_part(page(out, "out"))


# ------------------------------------------------------------------------------------------ more of reproduce's input


def test_a_page_that_would_replace_a_result_or_a_folder_is_refused(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    folder = results_folder(out)
    before = result_path(folder, "warm_rr", 0).read_bytes()
    rc, _, err = cli(capsys, "reproduce", "--doc-only", "--out", out, "--doc", result_path(folder, "warm_rr", 0))
    assert_one_line_error(rc, err, rf"--doc \S+: inside the data folder {folder}, whose files are the results")
    assert result_path(folder, "warm_rr", 0).read_bytes() == before
    rc, _, err = cli(capsys, "reproduce", "--doc-only", "--out", out, "--doc", tmp_path)
    assert_one_line_error(rc, err, rf"--doc {tmp_path}: is a folder; name the page's file")
    (tmp_path / "file").write_text("mine\n")
    rc, _, err = cli(capsys, "reproduce", "--doc-only", "--out", tmp_path / "file")
    assert_one_line_error(rc, err, rf"{tmp_path / 'file'}: exists and is not a folder \(the results' folder, --out\)")
    assert (tmp_path / "file").read_text() == "mine\n"


def test_an_evaluation_named_twice_or_not_in_ascii_is_refused(tmp_path, capsys) -> None:
    for evals, message in (
        (["a=x", "a=y"], r"--eval: a given twice"),
        (["２wiki=x"], r"--eval: expected NAME=SPEC \(e.g. 2wiki=2wiki:data/2wiki/val.jsonl\), got '２wiki=x'"),
    ):
        rc, _, err = reproduce(capsys, tmp_path / "out", *(f for e in evals for f in ("--eval", e)))
        assert_one_line_error(rc, err, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", ['["not", "settings"]', '{"minutes": "10"}', "{oops", '{"a": 1, "a": 2}'])
def test_a_settings_file_that_is_not_one_is_named_in_one_line(tmp_path, capsys, content) -> None:
    out = tmp_path / "out"
    (out / "synthetic").mkdir(parents=True)
    (out / "synthetic" / "settings.json").write_text(content)
    rc, _, err = reproduce(capsys, out)
    assert_one_line_error(rc, err, rf"{out / 'synthetic' / 'settings.json'}: not the settings of mhgpo reproduce")
    assert (out / "synthetic" / "settings.json").read_text() == content


def test_a_result_under_another_rows_or_seeds_name_counts_for_neither(tmp_path, capsys) -> None:
    from mhgpo.experiments.results import collect, find_result

    folder = results_folder(tmp_path / "out")
    copied = result_path(folder, "warm_mappo", 5)
    copied.write_bytes(result_path(folder, "warm_rr", 0).read_bytes())  # warm_rr seed 0's, under another name
    capsys.readouterr()
    found = collect(folder)
    assert sorted(found["warm_rr"]) == [0, 1, 2] and sorted(found["warm_mappo"]) == [0, 1, 2]
    assert capsys.readouterr().err == (
        f"mhgpo: left out {copied}: it holds 'warm_rr' seed 0, which is not what its name says\n"
    )
    assert find_result(folder, "warm_mappo", 5, SETTINGS) is None  # not finished: run (and written) again
