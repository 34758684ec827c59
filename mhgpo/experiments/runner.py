"""What is still to run, and the processes that run it: the warm starts, the (row, seed) jobs and the oracles, each
of these as soon as its warm start is trained, and the rows that take another row's steps (`ROW~OTHER`): with them
where that row's result is there already, after them where it is not; `parallel` processes at a time, one thread
each, each with its log in OUT/DATA/logs/. A job that fails does not stop the others (those that start from a warm
start that failed are not started); the run then ends with an error naming the jobs and their logs, and what
finished is kept for the next run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mhgpo.config.rows import RowTable
from mhgpo.errors import InputError, RunError
from mhgpo.experiments.claims import ORACLE_ROW, ORACLES, oracle_key, split_key
from mhgpo.experiments.jobs import Job, finished, row_config, run_job, warm_start_folder
from mhgpo.experiments.results import find_result, load_result, open_log, pin_settings, result_path
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


def subprocesses(jobs: list[Job], parallel: int, logs: Path) -> list[Job]:
    """Run `jobs` as `python -m mhgpo.experiments.jobs`, `parallel` at a time, each once its `after` jobs have
    finished; the jobs that failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    pending, running, failed = list(jobs), [], []
    while pending or running:
        while len(running) < max(parallel, 1) and (job := next_job(pending, [j for j, _ in running], failed)):
            with open_log(logs / f"{job.name}.log") as log:
                cmd = [sys.executable, "-m", "mhgpo.experiments.jobs", job.to_json()]
                running.append((job, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        time.sleep(1)
        for job, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((job, proc))
            status = "done" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            print(f"{status}: {job.kind} {job.key} seed {job.seed}", flush=True)
            if proc.returncode != 0:
                failed.append(job)
    return failed


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
    folder = prepare_output_dir(folder, "output folder")
    refuse_links(folder)  # everything in it is the harness's own: nothing is written through a link
    plan = Plan(table, folder, settings, evals)
    plain = [k for k in keys if not split_key(k)[1]]
    matched = [k for k in keys if split_key(k)[1]]
    warm = plan.warm_starts(plain + matched + ([oracle_key("none")] if oracles else []), seeds)
    pin_settings(folder, settings)
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


def check_evals(evals: list[str]) -> dict[str, str]:
    """`--eval NAME=SPEC` items as {NAME: SPEC}."""
    out = {}
    for item in evals:
        name, sep, spec = item.partition("=")
        if not sep or not spec or not name.replace("_", "").isalnum():
            raise InputError(f"--eval: expected NAME=SPEC (e.g. 2wiki=2wiki:data/2wiki/val.jsonl), got {item!r}")
        out[name] = spec
    return out
