"""Fault injection, as a careless or hostile user (or a crashing machine) would cause them: checkpoints killed
half-written (kill -9 at every point of a checkpoint write), a full disk, crafted files, run directories reused or
shared, report inputs that try to make structure, evaluations interrupted, and bad options. Every case must end
cleanly (one line, exit status 2, or a run that continues), lose nothing already finished, and execute nothing.

Commands run in-process through `mhgpo.cli.main.main` (what `python -m mhgpo` runs), unless a real process is the point.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_one_line_error,
    assert_same_run,
    cli,
    copy_run,
    snapshot,
    train_overrides,
    trainer_for,
)

import mhgpo.model.checkpoint as ck
from mhgpo.cli.main import main
from mhgpo.config import TrainConfig, load_config
from mhgpo.model.checkpoint import check_checkpoint, list_checkpoints, read_checkpoint
from mhgpo.model.statecodec import decode_rng_states, restore_rng_states, rng_states
from mhgpo.rl.trainer import Trainer
from mhgpo.run.pipeline import resume
from mhgpo.run.rundir import LOCK_FILE, RunLock
from mhgpo.runtime.runlog import read_metrics

# -------------------------------------------------------------------------------- kill -9 during a checkpoint


class KillSwitch:
    """Counts the file operations of a checkpoint write (`save_checkpoint`: each mkdir, file write, fsync, rename,
    tree removal) and SIGKILLs the process at the chosen one: before it, or, with `half`, half-way through it
    (a written file cut to half its size; a tree removal stopped after one file)."""

    def __init__(self, kill_at: int | None, half: bool, log: Path | None = None):
        self.kill_at, self.half, self.log = kill_at, half, log
        self.inside = False
        self.events: list[tuple[str, bool]] = []  # (operation, can stop half-way)

    def install(self, monkeypatch) -> None:
        import mhgpo.rl.trainer as trainer_module

        def wrap(name, real, path_arg=None):
            halvable = name == "rmtree" or path_arg is not None

            def hooked(*args, **kwargs):
                if self.inside and len(self.events) == self.kill_at:
                    if self.half and name == "rmtree":
                        next((p for p in Path(args[0]).rglob("*") if p.is_file()), Path("/nonexistent")).unlink(
                            missing_ok=True
                        )
                    elif self.half:
                        real(*args, **kwargs)
                        os.truncate(args[path_arg], Path(args[path_arg]).stat().st_size // 2)
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.inside:
                    self.events.append((name, halvable))
                return real(*args, **kwargs)

            return hooked

        monkeypatch.setattr(ck, "save_file", wrap("save_file", ck.save_file, 1))
        monkeypatch.setattr(ck, "write_synced", wrap("write_synced", ck.write_synced, 0))
        monkeypatch.setattr(ck, "fsync_file", wrap("fsync_file", ck.fsync_file))
        monkeypatch.setattr(ck, "fsync_dir", wrap("fsync_dir", ck.fsync_dir))
        monkeypatch.setattr(os, "rename", wrap("rename", os.rename))
        monkeypatch.setattr(os, "mkdir", wrap("mkdir", os.mkdir))
        monkeypatch.setattr(shutil, "rmtree", wrap("rmtree", shutil.rmtree))
        real_save = trainer_module.save_checkpoint

        def save(*args, **kwargs):
            self.inside = True
            try:
                return real_save(*args, **kwargs)
            finally:
                self.inside = False
                if self.log is not None:
                    self.log.write_text(json.dumps(self.events))

        monkeypatch.setattr(trainer_module, "save_checkpoint", save)


def squashed(text: str) -> str:
    """`text` without its whitespace: what the console said, whatever width it wrapped its lines at."""
    return "".join(text.split())


def save_in_child(trainer: Trainer, rng: dict, run_dir: Path, switch: KillSwitch) -> int:
    """Fork; the child saves `trainer`'s checkpoint into `run_dir` (holding its lock, as a run does) under `switch`,
    with every RNG as `rng` (the states when the step ended). Returns the child's wait status."""
    restore_rng_states(decode_rng_states(rng, trainer.rng), trainer.rng)
    trainer.run_dir = run_dir
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            switch.install(pytest.MonkeyPatch())
            RunLock(run_dir, "train").acquire()
            trainer.save()
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def test_kill_9_at_every_point_of_a_checkpoint_write_leaves_a_run_that_resumes_exactly(
    two_steps,
    reference_run,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    """A training process has finished step 3 (logged, rollouts written) and is killed (SIGKILL) inside the write
    of its checkpoint, once at every file operation of the write (and half-way through every file write and tree
    removal). After each kill: every `step_N/` left passes the checks, the newest is step_2 or step_3 and loads
    into the model, and `--resume` (taking over the dead process's lock) reproduces the uninterrupted run."""
    _, reference, _ = reference_run
    cfg = load_config(TrainConfig, two_steps / "config.yaml", ["steps=3", "eval_every=0", "save_every=0"])
    trainer = trainer_for(cfg, two_steps)
    trainer.restore(list_checkpoints(two_steps)[-1])
    step3 = copy_run(two_steps, tmp_path / "step3")  # step 3 run once, up to its checkpoint
    trainer.run_dir = step3
    trainer.run()
    rng = rng_states(trainer.rng)
    log = tmp_path / "events.json"
    status = save_in_child(trainer, rng, copy_run(step3, tmp_path / "count"), KillSwitch(None, False, log))
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    events = json.loads(log.read_text())
    assert {"mkdir", "save_file", "fsync_file", "write_synced", "fsync_dir", "rename", "rmtree"} <= {
        e for e, _ in events
    }
    points = [(i, False) for i in range(len(events))] + [(i, True) for i, (_, h) in enumerate(events) if h]
    outcomes = {"step_2": 0, "step_3": 0}
    for i, half in points:
        run_dir = copy_run(step3, tmp_path / f"kill{i}{'h' if half else ''}")
        status = save_in_child(trainer, rng, run_dir, KillSwitch(i, half))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (i, half, events[i])
        kept = list_checkpoints(run_dir)
        for p in kept:
            check_checkpoint(p)
        newest = kept[-1]
        assert newest.name in outcomes, (i, half, [p.name for p in kept])
        outcomes[newest.name] += 1
        read_checkpoint(newest, trainer.live())  # loads, and changes nothing
        capsys.readouterr()
        assert resume(run_dir, ["save_every=1"], progress=False).step == 3
        assert "taking over" in capsys.readouterr().err
        assert_same_run(run_dir, reference, upto=3)
        assert not (run_dir / LOCK_FILE).exists()
        assert [x.name for x in (run_dir / "checkpoints").iterdir() if x.name.startswith(".")] == []
    with capsys.disabled():
        print(
            f"\nkill -9 points tried: {len(points)} ({len(events)} file operations, "
            f"{len(points) - len(events)} of them also half-way); newest checkpoint after the kill: {outcomes}"
        )
    assert outcomes["step_2"] > 0 and outcomes["step_3"] > 0


# ----------------------------------------------------------------------------------------------- full disk


def test_full_disk_during_a_checkpoint_stops_the_run_and_keeps_the_previous_one(
    reference_run,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,
    monkeypatch,  # noqa: F811
) -> None:
    """The disk fills up while step 2's checkpoint is written (a write that stops half-way with ENOSPC): the run
    stops with one line naming the cause, the last checkpoint and how to continue; step_1 is intact, no temporary
    folder or lock is left, and once there is space again `--resume` reproduces the uninterrupted run."""
    import errno

    _, reference, _ = reference_run
    out = tmp_path / "full"
    real = ck.save_file
    calls = []

    def save_file(tensors, path):
        calls.append(path)
        if len(calls) == 3:  # step 1 writes 2 files; step 2's first one meets a full disk
            real(tensors, path)
            os.truncate(path, Path(path).stat().st_size // 2)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(tensors, path)

    monkeypatch.setattr(ck, "save_file", save_file)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out))
    assert_one_line_error(
        rc,
        err,
        r"could not write the checkpoint of step 2 \(No space left on device: "
        r"\S*\.tmp_step_2/model\.safetensors\); the run stops at step 2; its last "
        r"checkpoint is step_1; free space and continue with: mhgpo train --resume ",
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    check_checkpoint(out / "checkpoints" / "step_1")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert not (out / LOCK_FILE).exists()
    monkeypatch.setattr(ck, "save_file", real)
    rc, _, err = cli(capsys, "train", "--resume", out)
    assert rc == 0, err
    assert_same_run(out, reference)


def test_full_disk_on_a_real_tmpfs(reference_run, tiny_model_dir, world, tmpfs, capsys) -> None:  # noqa: F811
    """The same on a real file system: a 2 MiB tmpfs that is filled up while the run goes on."""
    disk = tmpfs
    _, reference, _ = reference_run
    out = disk / "run"
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, steps=2))
    assert rc == 0, err
    stat = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 12 * 1024))  # leave 12 KiB
    rc, _, err = cli(capsys, "train", "--resume", out, "steps=4")
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("mhgpo: error: ") and "No space left on device" in lines[-1], err
    with capsys.disabled():
        print(f"\ntmpfs full: {lines[-1]}")
    for p in list_checkpoints(out):
        check_checkpoint(p)
    assert list_checkpoints(out)[-1].name == "step_2"
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")] == []
    filler.unlink()
    rc, _, err = cli(capsys, "train", "--resume", out, "steps=4")
    assert rc == 0, err
    assert_same_run(out, reference)


# ---------------------------------------------------------------------------------------- crafted checkpoints


class Payload:
    """Unpickling this creates the marker file: what a crafted checkpoint would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_crafted_pickle_in_a_checkpoint_is_never_unpickled(two_steps, tmp_path, capsys) -> None:
    run = copy_run(two_steps, tmp_path / "crafted")
    marker = tmp_path / "EXECUTED"
    step = run / "checkpoints" / "step_2"
    torch.save({"optimizer": Payload(marker)}, step / "trainer.pt")
    torch.load(step / "trainer.pt", weights_only=False)  # the payload works: unpickling it runs code ...
    assert marker.exists()
    marker.unlink()
    (step / "state.json").write_text(json.dumps({"step": 2, "position": 4}))  # ... an earlier version's layout
    rc, _, err = cli(capsys, "train", "--resume", run)
    assert_one_line_error(
        rc,
        err,
        r"step_2/trainer\.pt: a checkpoint of an earlier mhgpo version, with pickled "
        r"optimiser state; mhgpo never unpickles files.*the previous complete checkpoint "
        r"is step_1: mhgpo train --resume \S+ --from-step 1$",
    )
    assert not marker.exists()
    pickle_as_tensors = step / "model.safetensors"
    pickle_as_tensors.write_bytes(pickle.dumps(Payload(marker)))  # a pickle under a safetensors name
    (step / "trainer.pt").unlink()
    rc, _, err = cli(capsys, "train", "--resume", run)
    assert rc == 2 and not marker.exists(), err
    sources = "\n".join(p.read_text() for p in (REPO / "mhgpo").glob("*.py"))
    assert "torch.load(" not in sources and "pickle.load" not in sources and "allow_pickle=True" not in sources


@pytest.mark.parametrize(
    "damage", ["truncated model", "missing optimizer", "bad json", "no state", "bad rng", "wrong shape"]
)
def test_a_damaged_checkpoint_names_the_file_and_the_previous_one(two_steps, tmp_path, capsys, damage) -> None:
    """Every file is checked before anything changes; the message names it and where to resume from instead,
    and `--from-step` resumes from there (the damaged later checkpoint is set aside, not deleted)."""
    run = copy_run(two_steps, tmp_path / "damaged")
    step = run / "checkpoints" / "step_2"
    if damage == "truncated model":
        model = step / "model.safetensors"
        os.truncate(model, model.stat().st_size - 7)
        pattern = r"step_2/model\.safetensors: \d+ bytes, but \d+ were written \(truncated or altered\)"
    elif damage == "missing optimizer":
        (step / "optimizer.safetensors").unlink()
        pattern = r"step_2/optimizer\.safetensors: missing"
    elif damage == "bad json":
        (step / "state.json").write_text('{"format": 2, "step": 2,')
        pattern = r"step_2/state\.json: unreadable or invalid JSON"
    elif damage == "no state":
        (step / "state.json").unlink()
        pattern = r"step_2/state\.json: missing"
    elif damage == "bad rng":
        state = json.loads((step / "state.json").read_text())
        state["rng"]["torch"] = "AAAA"
        (step / "state.json").write_text(json.dumps(state))
        pattern = r"step_2/state\.json: rng\.torch: 3 bytes, expected 5056"
    else:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(step / "model.safetensors"))
        name = sorted(tensors)[0]
        tensors[name] = torch.zeros(3, 3)
        save_file(tensors, str(step / "model.safetensors"))
        state = json.loads((step / "state.json").read_text())
        state["files"]["model.safetensors"] = (step / "model.safetensors").stat().st_size
        (step / "state.json").write_text(json.dumps(state))
        pattern = rf"step_2/model\.safetensors: {name} has shape \[3, 3\], the model's is \[\d+, \d+\]"
    damaged = snapshot(run)
    rc, _, err = cli(capsys, "train", "--resume", run)
    fallback = (
        ""
        if damage == "wrong shape"
        else r"; the previous complete checkpoint is step_1: mhgpo train "
        r"--resume \S+ --from-step 1"
    )
    assert_one_line_error(rc, err, pattern + r".*" + fallback + "$")
    assert snapshot(run) == damaged  # the failed resume changed nothing
    if damage == "truncated model":
        rc, out, err = cli(capsys, "train", "--resume", run, "--from-step", 1)
        assert rc == 0, err
        assert "later checkpoints (step_2) moved to" in out
        assert (run / "checkpoints" / "discarded" / "step_2" / "model.safetensors").is_file()
        assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_resume_with_another_lora_rank_names_the_mismatch_without_a_fallback(two_steps, tmp_path, capsys) -> None:
    run = copy_run(two_steps, tmp_path / "rank")
    rc, _, err = cli(capsys, "train", "--resume", run, "lora.r=2")  # on the command line: refused before loading
    assert_one_line_error(rc, err, rf"lora\.r: 2 here, but the run in {run} used 4; --resume continues the same run")
    config = run / "config.yaml"  # edited by hand: the checkpoint does not fit the model
    config.write_text(config.read_text().replace("\n  r: 4\n", "\n  r: 2\n"))
    rc, _, err = cli(capsys, "train", "--resume", run)
    assert_one_line_error(
        rc,
        err,
        r"step_2/model\.safetensors: \S+ has shape \[4, \d+\], the model's is \[2, \d+\] "
        r"\(another model or LoRA setting\?\)$",
    )


# ------------------------------------------------------------------------------------- run directory ownership


def test_train_refuses_a_directory_with_another_runs_files_and_changes_nothing(
    two_steps,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    """A folder with metrics, rollouts and evaluations but no checkpoint (before: wiped and reused)."""
    used = copy_run(two_steps, tmp_path / "used")
    shutil.rmtree(used / "checkpoints")
    (used / "eval_after").mkdir()
    (used / "eval_after" / "metrics.json").write_text("{}")
    before = snapshot(used)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, used))
    assert_one_line_error(
        rc,
        err,
        rf"{used} is not empty \(config\.yaml, eval_after/ \(metrics\.json\), "
        r"metrics\.jsonl \(2 lines\), rollouts/ \(step_000001\.jsonl, step_000002\.jsonl\), "
        r"tensorboard/ \(.*\)\) and holds no run to resume; pick another --output-dir$",
    )
    assert snapshot(used) == before
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, two_steps))
    assert_one_line_error(
        rc,
        err,
        rf"{two_steps} already holds a run \(checkpoints/ \(step_1, step_2\), .*\); "
        rf"continue it with: mhgpo train --resume {two_steps}, or pick another "
        r"--output-dir$",
    )
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, not_a_folder))
    assert_one_line_error(rc, err, r"file: exists and is not a folder$")


def test_a_second_run_into_the_same_directory_is_stopped_and_a_dead_owner_s_lock_is_taken_over(
    two_steps,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    run = copy_run(two_steps, tmp_path / "shared")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mhgpo.run.rundir import RunLock; "
            "RunLock(sys.argv[1], 'train').acquire(); print('locked', flush=True); time.sleep(600)",
            str(run),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        for args in (
            ["train", "--resume", run],
            ["eval", "--output-dir", run, "--data", "synthetic", "--model", "no-such-model"],
        ):
            rc, _, err = cli(capsys, *args)
            assert_one_line_error(
                rc,
                err,
                rf"{run} is in use by process {holder.pid} on \S+ \(mhgpo train, since "
                r"[\d-]+ [\d:]+\); wait for it to finish or pick another folder$",
            )
        assert snapshot(run) == before
    finally:
        holder.kill()  # SIGKILL: the lock file stays, its lock goes with the process
        holder.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid
    rc, out, err = cli(capsys, "train", "--resume", run, "steps=3", "eval_every=0")
    assert rc == 0, err
    assert f"taking over {run / LOCK_FILE}, left by process {holder.pid}" in err
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3] and not (run / LOCK_FILE).exists()


# --------------------------------------------------------------------------------------------------- report


def test_report_embeds_only_its_own_plots_and_escapes_text_from_runs(two_steps, tmp_path) -> None:
    """Questions and outputs that hold image, link, HTML and table syntax (and newlines to start a line)."""
    from mhgpo.run.report import build_report

    secret = tmp_path / "secret.png"
    secret.write_bytes(b"\x89PNG\r\n\x1a\nTOP-SECRET-BYTES")
    run = copy_run(two_steps, tmp_path / "hostile")
    hostile = (
        f"who?\n![x]({secret})\n<script>alert(1)</script> | cell | `tick` **bold** [link](file:///etc/"
        f"hostname) &amp; \\![y]({secret})"
    )
    path = run / "rollouts" / "step_000001.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["output"] = hostile if isinstance(r["output"], str) else r["output"]
        if "question" in r:
            r["question"], r["final_answer"], r["answers"] = hostile, hostile, [hostile]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "secret.png").write_bytes(secret.read_bytes())  # a PNG in the run folder that it did not write
    out = tmp_path / "report"
    md = build_report([run], out).read_text()
    page = (out / "report.html").read_text()
    import base64
    import re

    images = [line for line in md.splitlines() if line.startswith("![")]
    assert images and all(re.fullmatch(r"!\[[A-Za-z0-9 -]+\]\([a-z0-9_]+\.png\)", line) for line in images)
    assert not any(line.startswith(("<", "|", "#")) and "who" in line for line in md.splitlines())
    assert page.count("data:image/png;base64,") == len(images) == len(list(out.glob("*.png")))
    assert base64.b64encode(secret.read_bytes()).decode()[:16] not in page and "TOP-SECRET" not in page
    assert "<script>" not in page and "&lt;script&gt;" in page and "<a " not in page
    assert "who? ![x](" in page  # shown as text, on one line


# ----------------------------------------------------------------------------------------------------- eval


def eval_args(tiny_model_dir: Path, world: Path, out: Path, *extra: object) -> list[object]:  # noqa: F811
    return [
        "eval",
        "--data",
        f"hotpotqa:{world / 'train_echo.jsonl'}",
        "--corpus",
        world / "corpus.jsonl",
        "--model",
        tiny_model_dir,
        "--limit",
        8,
        "--batch-size",
        2,
        "--output-dir",
        out,
        "search.rewriter.max_new_tokens=8",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=4",
        *extra,
    ]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def full_eval(tmp_path_factory, tiny_model_dir, world) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("evals") / "full"
    assert main([str(a) for a in eval_args(tiny_model_dir, world, out)]) == 0
    return out


def assert_same_eval(got: Path, want: Path) -> None:
    assert read_rows(got / "predictions.jsonl") == read_rows(want / "predictions.jsonl")
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (got, want))
    for m in (a, b):
        m.pop("seconds"), m.pop("resumed", None)
    assert a == b


def interrupt_eval_at(monkeypatch, batch: int):
    """Make an evaluation's `batch`-th batch of rollouts raise KeyboardInterrupt (Ctrl-C); returns the undo."""
    import mhgpo.rl.evaluation as evaluate

    real, calls = evaluate.run_rollouts, []

    def run_rollouts(*args, **kwargs):
        calls.append(1)
        if len(calls) == batch:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate, "run_rollouts", run_rollouts)
    return lambda: monkeypatch.setattr(evaluate, "run_rollouts", real)


def test_ctrl_c_during_eval_keeps_the_finished_questions_and_resume_completes_them(
    full_eval,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,
    monkeypatch,  # noqa: F811
) -> None:
    out = tmp_path / "eval"
    restore = interrupt_eval_at(monkeypatch, 3)  # Ctrl-C during the third batch
    rc, _, err = cli(capsys, *eval_args(tiny_model_dir, world, out))
    assert rc == 130
    assert err.strip().splitlines()[-1] == (
        f"mhgpo: interrupted; 4 of 8 questions are in {out / 'predictions.jsonl'} "
        f"(continue with: mhgpo eval --resume {out})"
    )
    kept = read_rows(out / "predictions.jsonl")
    assert kept == read_rows(full_eval / "predictions.jsonl")[:4]
    assert sorted(p.name for p in out.iterdir()) == ["eval_config.yaml", "predictions.jsonl"]
    restore()
    with (out / "predictions.jsonl").open("a") as f:
        f.write('{"id": "cut sh')  # and a line cut short by a kill
    rc, stdout, err = cli(capsys, "eval", "--resume", out)
    assert rc == 0, err
    said = squashed(stdout)  # the console wraps its lines (long paths in the middle)
    assert squashed("4 already done") in said and squashed("4 from earlier sessions") in said
    assert json.loads((out / "metrics.json").read_text())["resumed"] == 4
    assert_same_eval(out, full_eval)


def test_eval_resume_refuses_lines_whose_question_changed(tiny_model_dir, world, tmp_path, capsys, monkeypatch) -> None:  # noqa: F811,E501
    """The metrics (F1 by question form among them) are computed from the finished lines' questions and answers:
    a line that changed them is refused, naming the file and line, and nothing is rewritten."""
    out = tmp_path / "eval"
    restore = interrupt_eval_at(monkeypatch, 2)  # Ctrl-C during the second batch
    assert cli(capsys, *eval_args(tiny_model_dir, world, out))[0] == 130
    restore()
    path = out / "predictions.jsonl"
    rows = read_rows(path)
    for change in ({"answers": ["yes"]}, {"question": "Who?"}, {"answers": 5}):
        planted = [dict(rows[0]), {**rows[1], **change}, *rows[2:]]
        path.write_text("".join(json.dumps(r) + "\n" for r in planted))
        before = path.read_bytes()
        rc, _, err = cli(capsys, "eval", "--resume", out)
        assert_one_line_error(rc, err, rf"{path}:2: question .* has another question or gold answers than the data's")
        assert path.read_bytes() == before and not (out / "metrics.json").exists()


def test_a_real_sigint_to_an_eval_process(tiny_model_dir, world, tmp_path, cache_dir) -> None:  # noqa: F811
    out = tmp_path / "eval"
    env = {**os.environ, "MHGPO_CACHE": str(cache_dir), "PYTHONPATH": str(REPO)}
    # longer answers make each question slower, so that the run is still going when the signal comes on a busy machine
    args = [str(a) for a in eval_args(tiny_model_dir, world, out, "search.answerer.max_new_tokens=64")]
    args[args.index("--limit") + 1], args[args.index("--batch-size") + 1] = "40", "1"
    # SIGINT back to its default in the child, as in a terminal: a test run started in the background by a
    # non-interactive shell ignores SIGINT, and a Python started with SIGINT ignored never sees Ctrl-C
    proc = subprocess.Popen(
        [sys.executable, "-m", "mhgpo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while (
            proc.poll() is None
            and time.monotonic() < deadline
            and not ((out / "predictions.jsonl").exists() and (out / "predictions.jsonl").read_text().count("\n") >= 2)
        ):
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    n = len(read_rows(out / "predictions.jsonl"))
    assert 2 <= n < 40 and "Traceback" not in stderr
    assert f"mhgpo: interrupted; {n} of 40 questions are in" in stderr and f"mhgpo eval --resume {out}" in stderr


def test_eval_resume_requires_the_same_config_and_eval_refuses_a_finished_one(
    full_eval,
    tiny_model_dir,
    world,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    before = snapshot(full_eval)
    rc, _, err = cli(capsys, "eval", "--resume", full_eval, "--limit", 9)
    assert_one_line_error(
        rc,
        err,
        rf"^mhgpo: error: limit: 9 here, but the evaluation in {full_eval} used 8; "
        r"--resume continues with the same config",
    )
    rc, _, err = cli(capsys, "eval", "--resume", full_eval, "search.top_k=5")
    assert_one_line_error(rc, err, r"^mhgpo: error: search\.top_k: 5 here, but .* used 3;")
    rc, _, err = cli(capsys, *eval_args(tiny_model_dir, world, full_eval))
    assert_one_line_error(rc, err, rf"{full_eval} already holds an evaluation; continue it with: mhgpo eval --resume")
    rc, _, err = cli(capsys, "eval", "--resume", tmp_path)
    assert_one_line_error(rc, err, rf"{tmp_path}: no evaluation to continue \(eval_config\.yaml is missing\)$")
    rc, out, err = cli(capsys, "eval", "--resume", full_eval)
    assert rc == 0 and squashed(f"{full_eval} is complete: all 8 questions are in") in squashed(out), err
    assert snapshot(full_eval) == before


# --------------------------------------------------------------------------------------- bad options, one line


def test_bad_options_end_with_one_line_before_anything_slow(
    world,
    tiny_model_dir,
    tmp_path,
    capsys,  # noqa: F811
) -> None:
    """Each with a model that does not exist: the option is refused before the model would load."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    no_model = ["--model", tmp_path / "no-such-model"]
    data = ["--data", f"hotpotqa:{world / 'dev.jsonl'}", "--corpus", world / "corpus.jsonl"]
    cases = {
        "eval into a file": (["eval", *data, *no_model, "--output-dir", a_file], r"a_file: exists and is not a folder"),
        "eval into a path under a file": (
            ["eval", *data, *no_model, "--output-dir", a_file / "x"],
            r"a_file/x: cannot create the folder \(Not a directory\)",
        ),
        "batch size 0": (
            ["eval", *data, *no_model, "--batch-size", 0],
            r"^mhgpo: error: batch_size: must be at least 1, got 0$",
        ),
        "limit -1": (["eval", *data, *no_model, "--limit", -1], r"limit: must be at least 1, got -1$"),
        "rr_probs": (
            ["train", *data, *no_model, "rr_probs=[1,1,1]"],
            r"rr_probs: expected non-negative probabilities "
            r"that sum to 1, got \[1\.0, 1\.0, 1\.0\] \(sum 3\)$",
        ),
        "temperature": (
            ["train", *data, *no_model, "search.answerer.temperature=0"],
            r"temperature: must be positive, got 0\.0$",
        ),
        "from-step alone": (["train", "--from-step", 2], r"--from-step: only with --resume RUN_DIR$"),
        "resume a non-run": (["train", "--resume", tmp_path], r"not a run directory \(no config\.yaml\)$"),
        "synth into a file": (["data", "synth", "--out", a_file], r"a_file: exists and is not a folder"),
        "synth under a file": (
            ["data", "synth", "--out", a_file / "w"],
            r"a_file/w: cannot create the output folder "
            r"\(Not a directory\)$",
        ),
        "synth 0 questions": (["data", "synth", "--out", tmp_path / "w", "--train", 0], r"--train: must be at least 1"),
        "report into a file": (["report", tmp_path, "--out", a_file], r"a_file: exists and is not a folder"),
        "report of nothing": (["report", tmp_path / "none"], r"none: not a run or evaluation directory$"),
        "index into a file": (
            ["index", "build", "--corpus", world / "corpus.jsonl", "--out", a_file],
            r"a_file: exists and is not a folder \(the index folder\)$",
        ),
        "recall into a file": (
            ["eval-retrieval", *data, "--output-dir", a_file / "r"],
            r"a_file/r: cannot create the output folder \(\S*a_file is not a folder\)$",
        ),
    }
    for name, (args, pattern) in cases.items():
        rc, out, err = cli(capsys, *args)
        assert_one_line_error(rc, err, pattern)
        assert out == "", name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing was written


def test_a_truncated_model_file_and_debug(tiny_model_dir, world, tmp_path, capsys) -> None:  # noqa: F811
    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    args = ["ask", "Who?", "--model", broken, "--corpus", world / "corpus.jsonl"]
    rc, _, err = cli(capsys, *args)
    assert_one_line_error(rc, err, r"Could not load model '\S*broken' .*incomplete metadata")
    with pytest.raises(Exception, match="incomplete metadata"):  # --debug: the exception itself, with its traceback
        main([str(a) for a in args] + ["--debug"])
    res = subprocess.run(
        [sys.executable, "-m", "mhgpo", "--debug", "data", "synth", "--out", weights],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr and "InputError" in res.stderr


def test_a_lock_file_planted_as_a_link_is_refused_and_its_target_untouched(tmp_path: Path, capsys) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "eval"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(target)
    with pytest.raises(Exception, match=r"mhgpo.lock: is a symbolic link"):
        RunLock(out, "eval").acquire()
    assert main(["eval", "--limit", "1", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "mhgpo: error:" in err and "is a symbolic link" in err and "Traceback" not in err
    assert target.read_text() == "keep me\n" and (out / LOCK_FILE).is_symlink()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=nan", "optim.lr"),
        ("optim.max_grad_norm=inf", "optim.max_grad_norm"),
        ("rr_probs=[nan, 0.5, 0.5]", "rr_probs[0]"),
        ("search.answerer.temperature=nan", "search.answerer.temperature"),
        ("optim.kl_beta=-inf", "optim.kl_beta"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_key(override: str, key: str, capsys) -> None:
    import re

    with pytest.raises(Exception, match="^" + re.escape(key) + ": expected a finite number"):
        load_config(TrainConfig, None, [override])
    assert main(["train", "--steps", "1", override]) == 2
    err = capsys.readouterr().err
    assert f"mhgpo: error: {key}: expected a finite number" in err and "Traceback" not in err
