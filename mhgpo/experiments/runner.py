"""What is still to run, and the processes that run it: the warm starts, the (row, seed) jobs and the oracles, each
of these as soon as its warm start is trained, and the rows that take another row's steps (`ROW~OTHER`): with them
where that row's result is there already, after them where it is not; `parallel` processes at a time, one thread
each, each with its log in OUT/DATA/logs/. A job that fails does not stop the others (those that start from a warm
start that failed are not started); the run then ends with an error naming the jobs and their logs, and what
finished is kept for the next run."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mhgpo.config.load import shown
from mhgpo.config.rows import RowTable
from mhgpo.errors import InputError, RunError
from mhgpo.experiments.claims import ORACLE_ROW, ORACLES, oracle_key, split_key
from mhgpo.experiments.jobs import Job, finished, row_config, run_job, warm_start_folder
from mhgpo.experiments.results import (
    SETTINGS,
    find_result,
    is_oracle,
    load_result,
    open_log,
    pin_settings,
    result_path,
    service_env,
    unpin_unused,
)
from mhgpo.io import prepare_output_dir
from mhgpo.run.rundir import refuse_links

Runner = Callable[[list[Job], int, Path], list[Job]]  # (jobs, parallel, logs folder) -> the jobs that failed


def next_job(pending: list[Job], running: list[Job], failed: list[Job]) -> Job | None:
    """The first of `pending` whose `after` jobs are neither pending, running nor failed, taken out of `pending`;
    those after a failed job are moved to `failed` (not started). None when every pending job waits."""
    for job in list(pending):
        if any(j.name in job.after for j in failed):
            pending.remove(job)
            failed.append(job)
            print(f"not started: {job.kind} {job.key} seed {job.seed} (its warm start failed)", flush=True)
        elif not any(j.name in job.after for j in pending + running):
            pending.remove(job)
            return job
    return None


# How a job process starts. `python -m` and `-c` put the working folder first on sys.path, so that a `mhgpo/` or a
# `yaml.py` in the folder reproduce runs in would run inside every job: the job's first statement takes that entry
# out, and puts back the folder this process imported mhgpo from unless mhgpo is found there anyway.
_BOOT = """import sys
if not getattr(sys.flags, "safe_path", False): del sys.path[0]
import importlib.util, os
origin = sys.argv.pop(1)
spec = importlib.util.find_spec("mhgpo")
if spec is None or not spec.origin or os.path.realpath(spec.origin) != origin:
    sys.path.insert(0, os.path.dirname(os.path.dirname(origin)))
from mhgpo.experiments.jobs import main
sys.exit(main(sys.argv[1:]))
"""


def job_command(job: Job) -> list[str]:
    """The command line of a job's process: this Python, the mhgpo package this process runs, the job as JSON."""
    package = Path(__file__).resolve().parents[1] / "__init__.py"  # (the package's own file, as mhgpo.__file__)
    return [sys.executable, "-c", _BOOT, os.path.realpath(package), job.to_json()]


# Passed on to the running jobs, which save and stop on SIGINT and SIGTERM; a hang-up of the terminal (SIGHUP, which
# does not reach the jobs in their own process groups) is passed on as SIGTERM.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def subprocesses(jobs: list[Job], parallel: int, logs: Path) -> list[Job]:
    """Run `jobs` as processes of their own (:func:`job_command`), `parallel` at a time, each once its `after` jobs
    have finished; the jobs that failed. SIGINT or SIGTERM (or SIGHUP) sent to this process is passed on to the jobs
    (each in a process group of its own, so that a terminal's Ctrl-C reaches it once, through this process); no job
    starts after it, and once the running ones have ended RunError says so; again: passed on again (a job then
    stops without saving)."""
    pool = _Processes(logs)
    pending, failed = list(jobs), []
    with _forwarding(pool.stops):
        try:
            while pool.running or (pending and not pool.stops):
                while not pool.stops and len(pool.running) < max(parallel, 1):
                    job = next_job(pending, [j for j, _ in pool.running], failed)
                    if job is None:
                        break
                    pool.start(job)
                pool.forward()
                time.sleep(0.2 if pool.stops else 1)
                failed += pool.ended()
        except BaseException:  # this process fails: its jobs stop too (and save), none is left running alone
            pool.stop()
            raise
    if pool.stops:
        raise RunError(
            f"stopped by {signal.Signals(pool.stops[0]).name}: the running jobs were passed it and have ended, "
            f"{len(pending)} not started; what finished is kept in {logs.parent}: the same command continues"
        )
    return failed


class _Processes:
    """The running job processes of :func:`subprocesses`, and the signals this process got meanwhile."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.running: list[tuple[Job, subprocess.Popen]] = []
        self.stops: list[int] = []  # the signals received, in order
        self.sent = 0  # how many of them were passed on

    def start(self, job: Job) -> None:
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        with open_log(self.logs / f"{job.name}.log") as log:
            cmd = job_command(job)
            env = {**self.env, **service_env(job.settings["overrides"])}
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, **group
            )
        self.running.append((job, proc))

    def forward(self) -> None:
        """Pass the signals received since the last call on to the running jobs (each signal once)."""
        if len(self.stops) == self.sent:
            return
        sig = signal.SIGTERM if self.stops[-1] == signal.SIGHUP else self.stops[-1]
        for _, proc in self.running:
            if proc.poll() is None:
                proc.send_signal(sig)
        if not self.sent:
            print(f"{signal.Signals(self.stops[0]).name}: stopping the {len(self.running)} running jobs", flush=True)
        self.sent = len(self.stops)

    def ended(self) -> list[Job]:
        """Take the jobs that have ended out of `running`, printing a line each; those that failed."""
        failed = []
        for job, proc in list(self.running):
            if proc.poll() is None:
                continue
            self.running.remove((job, proc))
            status = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            print(f"{status}: {job.kind} {job.key} seed {job.seed}", flush=True)
            if proc.returncode != 0:
                failed.append(job)
        return failed

    def stop(self) -> None:
        """SIGTERM to every running job, and wait for them to end."""
        for _, proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in self.running:
            proc.wait()


@contextmanager
def _forwarding(stops: list[int]) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM are noted in `stops` (for :func:`subprocesses` to pass on) instead
    of stopping this process; outside the main thread, signals keep their handlers."""
    old = {}
    for sig in FORWARDED:
        try:
            old[sig] = signal.signal(sig, lambda signum, frame: stops.append(signum))
        except ValueError:  # not the main thread
            pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def in_process(jobs: list[Job], parallel: int, logs: Path) -> list[Job]:
    """Run `jobs` one after the other in this process, in their order (each after its `after` jobs; tests; a job's
    error is raised)."""
    for job in jobs:
        run_job(job)
    return []


class Plan:
    """The jobs of a set of (row, seed) results not finished yet in a data folder, in the order they can run."""

    def __init__(self, table: RowTable, folder: Path, settings: dict, evals: dict[str, str]):
        self.table, self.folder, self.settings, self.evals = table, folder, settings, evals
        self.training: dict[Path, str] = {}  # warm start folder -> the name of the job that trains it

    def job(self, kind: str, key: str, seed: int, steps: int | None = None) -> Job:
        """The job; a row's or an oracle's starts after the job training its warm start, if one does."""
        evals = self.evals if kind == "row" else {}
        job = Job(kind, str(self.table.path), str(self.folder), key, seed, self.settings, evals, steps)
        if kind == "warm" or not self.training:
            return job
        row = ORACLE_ROW if kind == "oracle" else split_key(key)[0]
        cfg = row_config(self.table, job, row, "x")
        warm = self.training.get(warm_start_folder(cfg, self.folder)) if cfg.warm_start.enabled else None
        return dataclasses.replace(job, after=(warm,)) if warm else job

    def todo(self, key: str, seed: int) -> bool:
        """Whether (key, seed) has no result, or lacks an evaluation asked for."""
        result = find_result(self.folder, key, seed, self.settings)
        if result is None:
            return True
        ood = result.get("ood") or {}
        return any((ood.get(n) or {}).get("data") != spec for n, spec in self.evals.items())

    def warm_starts(self, keys: list[str], seeds: list[int]) -> list[Job]:
        """One job per warm start that an unfinished row (or an oracle) starts from and that is not trained."""
        jobs = []
        for key in keys:
            row = ORACLE_ROW if key.startswith(oracle_key("")) else split_key(key)[0]
            for seed in seeds:
                job = self.job("warm", row, seed)
                cfg = row_config(self.table, job, row, "x")
                if not cfg.warm_start.enabled or not (key.startswith(oracle_key("")) or self.todo(key, seed)):
                    continue
                folder = warm_start_folder(cfg, self.folder)
                if folder not in self.training and not finished(folder):
                    self.training[folder] = job.name
                    jobs.append(job)
        return jobs

    def rows(self, keys: list[str], seeds: list[int]) -> list[Job]:
        return [self.job("row", k, s) for k in keys for s in seeds if self.todo(k, s)]

    def matched(self, keys: list[str], seeds: list[int]) -> list[Job]:
        """`ROW~OTHER` jobs, with OTHER's steps on each seed (OTHER's results must be there)."""
        jobs = []
        for key in keys:
            other = split_key(key)[1]
            for seed in seeds:
                if not self.todo(key, seed):
                    continue
                found = find_result(self.folder, other, seed, self.settings)
                if found is not None and found["steps"] > 0:
                    jobs.append(self.job("row", key, seed, found["steps"]))
        return jobs

    def oracles(self, seeds: list[int]) -> list[Job]:
        return [
            self.job("oracle", name, s)
            for s in seeds
            for name in ORACLES
            if load_result(result_path(self.folder, oracle_key(name), s), self.settings) is None
        ]


def run_rows(
    table: RowTable,
    keys: list[str],
    seeds: list[int],
    folder: Path,
    settings: dict,
    parallel: int,
    evals: dict[str, str] | None = None,
    oracles: bool = False,
    runner: Runner | None = None,
) -> dict[str, dict[int, dict]]:
    """Every (key, seed) result under `settings` in the data folder `folder` (and, with `oracles`, each oracle's
    validation of each seed's warm start): the finished ones read, the others run by `runner` (default
    :func:`subprocesses`), `parallel` at a time. `evals`: NAME -> data spec of the evaluations on other data sets
    each result gets. A row `ROW~OTHER` runs OTHER too, and itself for the steps OTHER made on the seed: in the first
    queue where OTHER's result is there already, after every other job where it is not."""
    runner = runner or subprocesses
    evals = evals or {}
    for key in keys:
        row, other = split_key(key)
        for name in (row, other) if other else (row,):
            table.row(name)
    keys = list(dict.fromkeys([*keys, *(split_key(k)[1] for k in keys if split_key(k)[1])]))
    if Path(folder).is_symlink():
        raise InputError(
            f"{folder}: is a link; the harness writes only into a data folder of its own (remove the link, or use "
            f"another --out)"
        )
    folder = prepare_output_dir(folder, "output folder")
    refuse_links(folder)  # everything in it is the harness's own: nothing is written through a link
    plan = Plan(table, folder, settings, evals)
    plain = [k for k in keys if not split_key(k)[1]]
    matched = [k for k in keys if split_key(k)[1]]
    warm = plan.warm_starts(plain + matched + ([oracle_key("none")] if oracles else []), seeds)
    check_models(plan, keys + ([oracle_key("none")] if oracles else []), seeds[0])
    fresh = not (folder / SETTINGS).exists()
    pin_settings(folder, settings)
    try:
        return _run(plan, keys, seeds, parallel, runner, warm, oracles)
    except BaseException:
        if fresh:  # nothing finished: the settings are not pinned (a run with others may use the folder)
            unpin_unused(folder)
        raise


def _run(
    plan: Plan, keys: list[str], seeds: list[int], parallel: int, runner: Runner, warm: list[Job], oracles: bool
) -> dict[str, dict[int, dict]]:
    folder, settings = plan.folder, plan.settings
    plain = [k for k in keys if not split_key(k)[1]]
    matched = [k for k in keys if split_key(k)[1]]
    done = sum(not plan.todo(k, s) for k in keys for s in seeds)
    if done:
        print(f"{done} finished results in {folder} reused", flush=True)
    logs = folder / "logs"
    ready = plan.matched(matched, seeds)  # their reference's result is there: no need to wait for the rest
    first = warm + plan.rows(plain, seeds) + (plan.oracles(seeds) if oracles else []) + ready
    failed = runner(first, parallel, logs)
    names = {j.name for j in ready}
    failed += runner([j for j in plan.matched(matched, seeds) if j.name not in names], parallel, logs)
    results = {k: {s: r for s in seeds if (r := find_result(folder, k, s, settings))} for k in keys}
    missing = [f"{k} seed {s}" for k in keys for s in seeds if s not in results[k]]
    if failed or missing:
        names = ", ".join(str(log) for j in failed if (log := logs / f"{j.name}.log").is_file())
        raise RunError(
            f"no result for {', '.join(missing) or 'some evaluations'}" + (f"; see {names}" if names else "")
        )
    return results


def check_models(plan: Plan, keys: list[str], seed: int) -> None:
    """The model (or warm start model) of each row of `keys` names a model: refused before the data folder's
    settings are pinned, not in every job."""
    from mhgpo.run.setup import check_model

    for row in dict.fromkeys(ORACLE_ROW if is_oracle(k) else split_key(k)[0] for k in keys):
        job = plan.job("warm", row, seed)
        cfg = row_config(plan.table, job, row, plan.folder / "x")
        key = "warm_start.model" if cfg.warm_start.enabled and cfg.warm_start.model else "model"
        spec = cfg.warm_start.model if key == "warm_start.model" else cfg.model
        check_model(f"{row}: {key}", spec, plan.folder / "x")


def check_evals(evals: list[str]) -> dict[str, str]:
    """`--eval NAME=SPEC` items as {NAME: SPEC}."""
    out = {}
    for item in evals:
        name, sep, spec = item.partition("=")
        if not sep or not spec or not name.replace("_", "").isalnum() or not name.isascii():
            raise InputError(f"--eval: expected NAME=SPEC (e.g. 2wiki=2wiki:data/2wiki/val.jsonl), got {shown(item)}")
        if name in out:
            raise InputError(f"--eval: {name} given twice")
        out[name] = spec
    return out
