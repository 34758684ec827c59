"""One job of the harness: a warm start, a (row, seed), or an oracle's validation; run in a process of its own
(`python -m mhgpo.experiments.jobs JOB`, one thread) or in this one.

A (row, seed) is its row's config at the harness's scale with, in this order, the harness's budget (unless the row
has its own), the common `key=value` overrides, then the harness's keys: the seed, `val_limit`, validation at the
last step (and every `val_every` steps), a checkpoint every `SAVE_EVERY` steps, the warm start as the model. A
training row is `mhgpo train` (`mhgpo.run.pipeline.train`) stopped by its budget (or, for `ROW~OTHER`, by OTHER's
steps), with its final validation; a row that does not train is `mhgpo eval` of its validation. Each runs in
OUT/DATA/runs/ROW-seedS.partial/, renamed to OUT/DATA/runs/ROW-seedS when finished; the run is kept, so that
evaluations on other data sets (`--eval NAME=SPEC`: `mhgpo eval` of the run) can be added later without training
again. A row stopped mid-run (a signal, a killed process, a machine shut down) continues from the last checkpoint in
its partial folder when `mhgpo reproduce` runs it again, with the results of an uninterrupted row.

With `--val-every N` (`val_every` in the settings) a training row is also validated every N steps on its run's own
checkpoints, and its result keeps the curve (`val_curve`, `mhgpo.experiments.curves`) whose first point is the model
it starts from.

A warm start is trained once per seed and warm start config (an `mhgpo sft` run, the config's hash in its folder's
name) and shared by every row that starts from it; its time is not counted in the rows' budgets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from mhgpo.config import EvalConfig, TrainConfig, to_dict
from mhgpo.config.rows import RowTable, load_rows
from mhgpo.errors import InputError, RunError
from mhgpo.experiments.claims import ORACLE_ROW, ORACLES, oracle_key, split_key
from mhgpo.experiments.curves import curve, healthy, keep_start, question_record, start_point
from mhgpo.experiments.results import (
    MARKER,
    find_result,
    load_result,
    machine,
    result_path,
    result_problem,
    run_folder,
    waiting_lock,
)
from mhgpo.io import atomic_write_json, fsync_dir, read_json, remove_stale_temps

STEPS_CAP = 100_000  # the steps of a row with a budget: the budget ends it
SAVE_EVERY = 5  # a row's checkpoints: what a row stopped mid-run continues from
WARM_SAVE_EVERY = 10  # a warm start's (left out of its folder's hash: saving changes no weight)
# A warm start's keys that change none of its weights (where it is written, how often it saves, whether activations
# are recomputed: bit-identical either way), left out of its folder's name
UNHASHED = {"output_dir", "save_every", "keep_checkpoints", "report_to", "optim.gradient_checkpointing"}
PARTIAL = ".partial"  # OUT/DATA/runs/ROW-seedS.partial: a row's run while it trains


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # warm | row | oracle
    rows: str  # the table of rows' file
    folder: str  # the data folder
    key: str  # a table row (ROW or ROW~OTHER), the row a warm start is of, or an oracle's name
    seed: int
    settings: dict
    evals: dict = dataclasses.field(default_factory=dict)  # NAME -> data spec: evaluations on other data sets
    steps: int | None = None  # ROW~OTHER: the steps OTHER reached on this seed
    after: tuple[str, ...] = ()  # the names of the jobs (its warm start) that must finish before it starts

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Job:
        tree = json.loads(text)
        return cls(**{**tree, "after": tuple(tree.get("after", ()))})

    @property
    def name(self) -> str:
        """How logs and messages name the job."""
        return f"{self.kind}-{self.key}-seed{self.seed}".replace("/", "_")


# ------------------------------------------------------------------------------------------------ configs


def _overrides(table: RowTable, job: Job, row: str, run_dir: Path | str) -> list[str]:
    s = job.settings
    budget = [] if "budget_minutes" in table.row(row).overrides else [f"budget_minutes={s['minutes']}"]
    fixed = [f"seed={job.seed}", f"val_limit={s['val_limit']}", f"output_dir={run_dir}"]
    return [*budget, f"budget_clock={s['clock']}", *s["overrides"], *fixed]


def row_config(table: RowTable, job: Job, row: str, run_dir: Path | str) -> TrainConfig:
    """The config of `row` in `job` writing into `run_dir`: the row at the harness's scale with its budget, the
    common overrides, the seed and validation size (its warm start switch as the row has it)."""
    return table.config(row, job.settings.get("scale", "demo"), _overrides(table, job, row, run_dir))


def run_config(table: RowTable, job: Job, row: str, run_dir: Path | str) -> TrainConfig:
    """:func:`row_config` as the row runs: until its budget ends it (or for `job.steps` steps, without one),
    validated and saved at its last step, and from its warm start (trained beforehand) when it has one."""
    plain = row_config(table, job, row, run_dir)
    extra = [f"eval_every={job.settings.get('val_every') or STEPS_CAP}", f"save_every={SAVE_EVERY}"]
    extra += [f"steps={job.steps}", "budget_minutes=null"] if job.steps else [f"steps={STEPS_CAP}"]
    if plain.warm_start.enabled:
        warm = warm_start_folder(plain, Path(job.folder))
        if not finished(warm):
            raise RunError(f"{warm}: the warm start of {row} (seed {job.seed}) is not trained")
        # a relative path: the run stores it relative to its folder's parent, so OUT may move
        extra += ["warm_start.enabled=false", f"model={os.path.relpath(warm)}"]
    overrides = [*_overrides(table, job, row, run_dir), *extra]
    return table.config(row, job.settings.get("scale", "demo"), overrides)


def warm_start_folder(cfg: TrainConfig, folder: Path) -> Path:
    """Where the warm start of the row config `cfg` is: its system, seed and a hash of its `mhgpo sft` config's
    values that differ from the defaults (so that a key added to the config, at its default, names the same
    folder), :data:`UNHASHED` left out."""
    from mhgpo.config import SFTConfig

    tree = _leaves(to_dict(_warm_start_config(cfg, Path("warm_start"))))
    defaults = _leaves(to_dict(SFTConfig()))
    tree = {k: v for k, v in tree.items() if k not in UNHASHED and (k not in defaults or defaults[k] != v)}
    digest = hashlib.sha1(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:8]
    tag = "" if cfg.system == "mas" else "".join(c if c.isalnum() else "_" for c in cfg.system) + "-"
    return folder / f"warm_start-{tag}seed{cfg.seed}-{digest}"


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict's values by dotted key."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _warm_start_config(cfg: TrainConfig, out: Path) -> Any:
    from mhgpo.run.pipeline import warm_start_config

    return warm_start_config(cfg, out)


def finished(folder: Path) -> bool:
    """Whether `folder` is a finished run or warm start of the harness (it holds its record)."""
    return (folder / MARKER).is_file() and not folder.is_symlink()


def _marker(folder: Path) -> dict | None:
    """The harness's record in `folder`; None when there is no folder. A folder without one was not made by the
    harness (it makes its runs in temporary folders and renames them when finished): refused, never removed."""
    if not folder.exists() and not folder.is_symlink():
        return None
    if not finished(folder):
        raise InputError(
            f"{folder}: exists, and is not a finished run of mhgpo reproduce (no {MARKER}); it is left as it "
            f"is: move it away or use another --out"
        )
    record = read_json(folder / MARKER)
    if not isinstance(record, dict) or (record.get("row") != "warm_start" and result_problem(record)):
        why = result_problem(record) if isinstance(record, dict) else "not a JSON object"
        raise InputError(f"{folder / MARKER}: not a record of mhgpo reproduce ({why}); move the folder away")
    return record


def _make_row(final: Path, build: Any) -> dict:
    """Run `build(partial) -> record` in `final`'s partial folder (:data:`PARTIAL`: kept when the row or warm start
    stops, so that the next run continues it), write the record into it and rename it to `final`. The caller holds
    its lock."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final, "experiment")  # (the temporary folders rows trained in before they had a partial one)
    partial = final.with_name(final.name + PARTIAL)
    if partial.is_symlink():
        raise InputError(f"{partial}: a link; the harness writes its runs itself (move it away)")
    record = build(partial)
    atomic_write_json(partial / MARKER, record)
    os.rename(partial, final)
    fsync_dir(final.parent)
    return record


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _minutes(since: tuple[float, float]) -> dict[str, float]:
    wall, cpu = _clock()
    return {"minutes": (wall - since[0]) / 60, "cpu_minutes": (cpu - since[1]) / 60}


# --------------------------------------------------------------------------------------------------- jobs


def run_warm(job: Job) -> dict:
    """Train the warm start of `job.key`'s row for `job.seed` (once: a finished one is kept); its record."""
    table = load_rows(job.rows)
    cfg = row_config(table, job, job.key, "x")
    final = warm_start_folder(cfg, Path(job.folder))
    with waiting_lock(final.parent, final.name):
        done = _marker(final)
        if done is not None:
            return done

        def build(partial: Path) -> dict:
            since = _clock()
            sft = _warm_start_config(cfg, partial)
            from mhgpo.run.warm_start import resume_sft, run_sft

            sft = dataclasses.replace(sft, save_every=WARM_SAVE_EVERY, keep_checkpoints=1)
            _start_or_continue(partial, lambda: run_sft(sft, progress=False), resume_sft)
            spent = _minutes(since)
            return {"row": "warm_start", "seed": job.seed, "system": cfg.system, "steps": sft.steps, **spent}

        return _make_row(final, build)


def run_row(job: Job) -> dict:
    """Run (row, seed) unless its result is there, then its missing evaluations on other data sets; its result."""
    table = load_rows(job.rows)
    row, _ = split_key(job.key)
    folder, final = Path(job.folder), run_folder(Path(job.folder), job.key, job.seed)
    with waiting_lock(folder, final.name):
        result = find_result(folder, job.key, job.seed, job.settings)
        if result is None:
            result = _marker(final)  # trained, its result not copied yet
            if result is not None and result.get("settings") != job.settings:
                raise InputError(f"{final}: ran with {json.dumps(result.get('settings'))}; use another --out")
            if result is None:
                result = _make_row(final, lambda partial: _run(table, job, row, partial, final))
            atomic_write_json(result_path(folder, job.key, job.seed), result)
        check_row(result, table, row, result_path(folder, job.key, job.seed))
        return evaluate_elsewhere(table, job, result, final)


def check_row(result: dict, table: RowTable, row: str, path: Path) -> None:
    """A result whose row has changed in the table since it ran is refused (results of the earlier scripts, which
    named a row by its overrides, record none)."""
    if "overrides" in result and result["overrides"] != table.row(row).overrides:
        raise InputError(
            f"{path}: row {row} ran with {json.dumps(result['overrides'])}, and {table.path} now gives it "
            f"{json.dumps(table.row(row).overrides)}; use another --out (or move the result away)"
        )


SITTINGS = "sittings.json"  # in a stopped row's folder: the minutes (wall, CPU) of its sittings so far


def _run(table: RowTable, job: Job, row: str, tmp: Path, final: Path) -> dict:
    """Train (or validate) `row` into `tmp`; its result record. A row stopped mid-way (Ctrl-C, a signal, an error)
    keeps its sitting's minutes in `tmp` (:data:`SITTINGS`), so that the record of the row continued from there
    counts every sitting's (`train_minutes`, `train_cpu_minutes`)."""
    since = _clock()
    try:
        return _sitting(table, job, row, tmp, final, since)
    except BaseException:
        if tmp.is_dir():
            atomic_write_json(tmp / SITTINGS, _spent_so_far(tmp, since))
        raise


def _spent_so_far(tmp: Path, since: tuple[float, float]) -> dict[str, float]:
    """This sitting's minutes (from ``since``) and those of the row's earlier sittings kept in `tmp`."""
    now = _minutes(since)
    try:
        earlier = read_json(tmp / SITTINGS)
        return {k: now[k] + float(earlier[k]) for k in now}
    except (InputError, ValueError, KeyError, TypeError):  # none kept (a first sitting), or unreadable: this one's
        return now


def _sitting(table: RowTable, job: Job, row: str, tmp: Path, final: Path, since: tuple[float, float]) -> dict:
    from mhgpo.rl.policy import peak_memory_mb

    cfg = run_config(table, job, row, tmp)
    curve_of: dict[str, Any] = {}
    if table.row(row).train:
        from mhgpo.runtime.runlog import read_metrics

        start = start_point(cfg, Path(job.folder)) if job.settings.get("val_every") else None
        from mhgpo.run.pipeline import resume, train

        trainer = _start_or_continue(tmp, lambda: train(cfg, progress=False), resume)
        res = trainer.last_eval[1] if trainer.last_eval and trainer.last_eval[0] == trainer.step else None
        if res is None:  # continued after its last step had been saved: validated again, the same greedy answers
            res = trainer.validate()
        own = {
            "steps": trainer.step,
            "stopped_on_budget": trainer.stopped_on_budget,
            "budget_minutes_used": trainer.budget.used / 60,
            "steps_cpu_minutes": trainer.cpu_seconds / 60,
            "steps_metrics": read_metrics(tmp),
        }
        if start is not None:
            curve_of = {
                "val_curve": curve(start, trainer.val_history, lambda step: _validation(tmp, step)),
                "start": {k: v for k, v in start.items() if k not in ("questions", "step", "cpu_minutes")},
                "start_questions": start["questions"],
            }
    else:
        from mhgpo.run.evaluate import run_evaluation

        resumed = (tmp / "eval_config.yaml").is_file()  # an evaluation stopped mid-way continues
        res = run_evaluation(_eval_config(cfg, cfg.model, tmp), resume=resumed, progress=False, desc=job.key)
        own = {"steps": 0, "steps_metrics": []}
        if job.settings.get("val_every"):  # the curves' step 0 of the rows starting from this model: this validation
            keep_start(cfg, Path(job.folder), res.metrics, res.predictions)
    spent = _spent_so_far(tmp, since)
    m = res.metrics
    record = {
        "row": job.key,
        "seed": job.seed,
        "system": cfg.system,
        **{k: v for k, v in own.items() if k != "steps_metrics"},
        "budget_minutes": cfg.budget_minutes,
        "questions_per_step": cfg.questions_per_step,
        "train_minutes": spent["minutes"],
        "train_cpu_minutes": spent["cpu_minutes"],
        "val_f1": m["f1"],
        "val_em": m["em"],
        "val_acc": m["acc"],
        "val_n": m["n"],
        "peak_mb": peak_memory_mb(),
        "machine": machine(),
        "settings": job.settings,
        "overrides": table.row(row).overrides,
        "run": final.relative_to(Path(job.folder)).as_posix(),
        **{k: v for k, v in m.items() if "/" in k},
        "healthy": healthy(m),  # formats as a healthy warm start has them (mhgpo.experiments.curves.HEALTH)
        **curve_of,
        "steps_metrics": own["steps_metrics"],
        "val_questions": [question_record(p, ("f1", "acc")) for p in res.predictions],
        "ood": {},
    }
    if job.steps:
        record["steps_of"] = split_key(job.key)[1]
    return record


def _validation(run_dir: Path, step: int) -> list[dict] | None:
    """The per-question results of `run_dir`'s validation at `step` (None: the run kept none)."""
    from mhgpo.io import read_jsonl
    from mhgpo.runtime.runlog import validation_path

    path = validation_path(run_dir, step)
    if not path.is_file():
        return None
    rows, cut_short = read_jsonl(path)
    return None if cut_short else rows


def _start_or_continue(run_dir: Path, start: Any, resume: Any) -> Any:
    """`start()` (a new run into `run_dir`), or, when `run_dir` holds a checkpoint (a row or warm start stopped
    mid-run), `resume(run_dir)` from there; a folder without one (stopped before its first checkpoint) is started
    again."""
    import shutil

    from mhgpo.model.checkpoint import list_checkpoints

    if run_dir.is_dir() and list_checkpoints(run_dir):
        print(f"{run_dir}: continuing from {list_checkpoints(run_dir)[-1].name}", flush=True)
        return resume(run_dir, progress=False)
    if run_dir.exists() and not run_dir.is_symlink():
        shutil.rmtree(run_dir)
    return start()


def _eval_config(cfg: TrainConfig, model: str, out: Path, data: str | None = None) -> EvalConfig:
    """The validation of `cfg` (or the same on `data`) of `model`, written into `out`."""
    from mhgpo.run.setup import validation_config

    ev = validation_config(cfg, model)
    return dataclasses.replace(ev, data=data or ev.data, output_dir=str(out))


def evaluate_elsewhere(table: RowTable, job: Job, result: dict, final: Path) -> dict:
    """The (row, seed)'s evaluations on the other data sets of `job.evals` that its result lacks, each `mhgpo eval`
    of the kept run (or of the model a row without training validates) into RUN/eval-NAME, added to its result."""
    from mhgpo.run.evaluate import run_evaluation

    limit = job.settings["val_limit"]
    ood = dict(result.get("ood") or {})
    todo = {n: s for n, s in job.evals.items() if (ood.get(n) or {}).get("data") != s or ood[n].get("limit") != limit}
    if not todo:
        return result
    if not finished(final):
        print(f"{job.key} seed {job.seed}: no run folder kept ({final}): evaluating it elsewhere needs it run again")
        return result
    row, _ = split_key(job.key)
    cfg = run_config(table, job, row, final)
    model = str(final.resolve()) if table.row(row).train else cfg.model
    for name, spec in todo.items():
        out = final / f"eval-{name}"
        saved = out / "eval_config.yaml"
        if saved.is_file() and read_saved_data(saved) != spec:
            raise InputError(f"{out}: an evaluation of {read_saved_data(saved)}, not {spec}; name --eval another")
        res = run_evaluation(_eval_config(cfg, model, out, spec), resume=saved.is_file(), progress=False, desc=name)
        m = res.metrics
        ood[name] = {"data": spec, "limit": limit, "f1": m["f1"], "em": m["em"], "acc": m["acc"], "n": m["n"]}
        result = {**result, "ood": ood}
        atomic_write_json(final / MARKER, result)
        atomic_write_json(result_path(Path(job.folder), job.key, job.seed), result)
    return result


def read_saved_data(path: Path) -> str | None:
    """The `data` of a kept evaluation's config (read within the config files' bounds)."""
    import yaml

    from mhgpo.config.load import read_yaml

    try:
        tree = read_yaml(path) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InputError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    return tree.get("data") if isinstance(tree, dict) else None


def run_oracle(job: Job) -> dict | None:
    """The warm-started team of `job.seed` validated with the roles of oracle `job.key` replaced by their gold
    output; None for the `context` oracle on validation records without paragraphs (left out)."""
    from mhgpo.data.spec import load_data
    from mhgpo.run.evaluate import evaluate_validation

    folder = Path(job.folder)
    path = result_path(folder, oracle_key(job.key), job.seed)
    with waiting_lock(folder, path.stem):
        done = load_result(path, job.settings)
        if done is not None:
            return done
        table = load_rows(job.rows)
        roles = ORACLES[job.key][0]
        cfg = run_config(table, job, ORACLE_ROW, folder / "x")
        examples = {e.id: e for e in load_data(cfg.val_data)}
        if "context" in roles and not any(
            any(found) for e in list(examples.values())[: cfg.val_limit] for found in e.supporting_context
        ):
            print(f"oracle {job.key}: left out, the validation records carry no paragraphs", flush=True)
            return None
        result = evaluate_validation(cfg, cfg.model, desc=f"oracle {job.key} seed {job.seed}", oracle=roles)
        record = oracle_record(job, result, examples)
        atomic_write_json(path, record)
        return record


def oracle_record(job: Job, result: Any, examples: dict) -> dict:
    """One oracle's validation as a result: metrics, gold recall retrieved / shown, LLM calls per question."""
    import numpy as np

    preds = result.predictions

    def recall(key: str) -> float | None:
        shares = [
            len(set(examples[p["id"]].supporting_titles) & set(p["trace"].get(key) or []))
            / len(set(examples[p["id"]].supporting_titles))
            for p in preds
            if examples[p["id"]].supporting_titles
        ]
        return 100 * float(np.mean(shares)) if shares else None

    calls = sum(1 for p in preds for step in p["trace"]["steps"] if "tool" not in step)
    m = result.metrics
    return {
        "row": oracle_key(job.key),
        "seed": job.seed,
        "steps": 0,
        "val_f1": m["f1"],
        "val_em": m["em"],
        "val_acc": m["acc"],
        "val_n": m["n"],
        "recall_retrieved": recall("retrieved_titles"),
        "recall_shown": recall("selected_titles"),
        "llm_calls": calls / max(len(preds), 1),
        "machine": machine(),
        "settings": job.settings,
    }


RUNNERS = {"warm": run_warm, "row": run_row, "oracle": run_oracle}


def run_job(job: Job) -> Any:
    return RUNNERS[job.kind](job)


def main(argv: list[str] | None = None) -> int:
    """`python -m mhgpo.experiments.jobs JOB` (a job as JSON), as the runner starts each job."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    run_job(Job.from_json((argv or sys.argv[1:])[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
