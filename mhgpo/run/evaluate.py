"""One evaluation routine for the command line (`mhgpo eval`) and the Python API (`mhgpo.evaluate`).

With an output folder, an evaluation is checked and locked before anything slow starts; `eval_config.yaml` and each
finished batch of questions go to `predictions.jsonl` as they finish, and `metrics.json` is written at the end,
computed from the prediction lines (so an evaluation continued with `resume` scores the questions of every session).
A folder that already holds an evaluation is refused unless it is being resumed; a resumed evaluation runs with the
saved config, and a value that differs from it is refused, naming the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhgpo.config import EvalConfig, dump_config, load_config, rollout_pipelined, to_dict
from mhgpo.config.eval import is_custom
from mhgpo.config.load import first_difference, lookup, merge_trees, names_key, read_mapping
from mhgpo.errors import InputError
from mhgpo.io import append_jsonl, read_json, read_jsonl
from mhgpo.model.pretrained import AGENTS_KIND, RUN_CONFIG, TRAINED_KINDS, ModelNotFoundError, resolve_model
from mhgpo.model.trained import model_record, resolve_trained
from mhgpo.rl.evaluation import (
    CONFIG,
    METRICS,
    PREDICTIONS,
    EvalResult,
    evaluate_examples,
    finished_predictions,
    summarise,
    write_eval,
)
from mhgpo.run.rundir import RunLock, refuse_links
from mhgpo.run.setup import build_generation, settle
from mhgpo.team.build import load_examples
from mhgpo.team.loader import refuse_untrusted_code


class EvalInterrupted(KeyboardInterrupt):
    """Ctrl-C during an evaluation; ``message`` says what was kept and how to continue."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


TEAM_KEYS = ("system", "team", "search", "max_prompt_tokens")  # what makes a trained team's prompts and behaviour
TEAM_FILE = "mhgpo_team.yaml"  # an export's copy of its run's team settings
EXPORT_KINDS = ("directory", AGENTS_KIND)  # the folders `mhgpo export` writes


def team_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The :data:`TEAM_KEYS` of a run's config tree. A workflow class (`system: PATH.py:Class`) is left out, with its
    `team:` section: code is imported only when the command line names it."""
    keys = [k for k in TEAM_KEYS if k in config]
    if is_custom(str(config.get("system", ""))):
        keys = [k for k in keys if k not in ("system", "team")]
    return {k: config[k] for k in keys}


def trained_team(model: str) -> tuple[dict[str, Any], Path] | None:
    """The team settings (:func:`team_settings`) that the trained `model` was trained with, and the file they were
    read from: a run directory's or checkpoint's config.yaml, or an export's :data:`TEAM_FILE`. None for any other
    model (or one that cannot be found or resolved: loading it says why)."""
    try:
        source = resolve_model(model)
        if source.kind not in TRAINED_KINDS:
            file = Path(source.location) / TEAM_FILE
            return (team_settings(read_mapping(file)), file) if source.kind in EXPORT_KINDS and file.is_file() else None
        stage = resolve_trained(Path(source.location), source.kind).last
    except ModelNotFoundError:  # told where the model loads, after the cheaper checks of the data and the output
        return None
    return team_settings(stage.config), stage.run_dir / RUN_CONFIG


def eval_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: dict[str, Any] | None = None,
    cls: type = EvalConfig,
) -> tuple[Any, Path | None]:
    """An evaluation's config, a `cls` (defaults ← `base` ← YAML `path` ← `overrides`). When its `model` is a trained
    run, the team settings it was trained with (:func:`trained_team`, those that `cls` has) come first, under the
    rest: the team is evaluated as it was trained unless the caller says otherwise. Also returns the file they were
    read from (None when no setting came from one)."""
    cfg = load_config(cls, path, overrides, base=base)
    found = trained_team(cfg.model)
    if found is None:
        return cfg, None
    team, origin = found
    fields = {f.name for f in dataclasses.fields(cls)}
    team = {k: v for k, v in team.items() if k in fields}
    try:
        return load_config(cls, path, overrides, base=merge_trees(team, base or {})), origin
    except InputError as err:
        raise InputError(f"{origin}: {err}") from None


def resumed_config(
    folder: Path,
    path: str | Path | None = None,
    overrides: list[str] = (),
    base: dict[str, Any] | None = None,
    trust_code: bool = True,
) -> EvalConfig:
    """The config of the evaluation saved in `folder`, which `path`, `base` and `overrides` may repeat but not
    change (the first differing key is named). A saved workflow class (`system: PATH.py:Class`) is refused unless
    `trust_code` or `path`/`overrides`/`base` name the system again (the command line passes `--trust-code`; the
    Python API's explicit `resume=True` is the caller's own opt-in)."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise InputError(f"{folder}: no evaluation to continue ({CONFIG} is missing)")
    saved = load_config(EvalConfig, folder / CONFIG)
    refuse_untrusted_code(
        saved.system,
        folder / CONFIG,
        trust_code or names_key(path, overrides, "system") or "system" in (base or {}),
        "mhgpo eval",
    )
    saved.output_dir = str(folder)
    tree = to_dict(saved)
    merged = {**tree, **(base or {})}
    cfg = load_config(EvalConfig, path, list(overrides) + [f"output_dir={folder}"], base=merged)
    key = first_difference(tree, to_dict(cfg))
    if key is not None:
        old, new = lookup(tree, key), lookup(to_dict(cfg), key)
        raise InputError(
            f"{key}: {new!r} here, but the evaluation in {folder} used {old!r}; --resume continues "
            f"with the same config (leave {key} out, or start a new evaluation in another folder)"
        )
    return cfg


def _interrupted(out: Path | None, total: int) -> EvalInterrupted:
    kept = len(read_jsonl(out / PREDICTIONS)[0]) if out is not None else 0  # what reached the file
    if out is None:
        return EvalInterrupted("interrupted; nothing was kept (no --output-dir)")
    if not kept:
        return EvalInterrupted("interrupted before the first batch finished; nothing to keep")
    return EvalInterrupted(
        f"interrupted; {kept} of {total} questions are in {out / PREDICTIONS} "
        f"(continue with: mhgpo eval --resume {out})"
    )


def run_evaluation(
    cfg: EvalConfig,
    workflow: Any = None,
    *,
    resume: bool = False,
    progress: bool = True,
    say: Callable[[str], None] = lambda text: None,
    status: Callable[[str], Any] | None = None,
    desc: str = "eval",
    reason: str | None = None,
) -> EvalResult:
    """Evaluate the team `cfg` names (or `workflow`: a `Workflow` class or instance) greedily on `cfg.data`.

    With `cfg.output_dir`, the folder is locked, each finished batch is appended to it, and `resume` continues an
    evaluation saved there (the finished questions are skipped; `metrics["resumed"]` counts them). `say` receives
    one-line progress notes, `status(text)` (a context manager, e.g. rich's `Console.status`) wraps the slow
    loading steps, `desc` names the progress bar, `reason` why the precision is what it is (a run's validation: its
    run's reason). Ctrl-C raises `EvalInterrupted`, whose message says what was kept."""
    from contextlib import nullcontext

    status = status or (lambda text: nullcontext())
    examples = load_examples(cfg.data, cfg.limit)
    out = Path(cfg.output_dir).expanduser() if cfg.output_dir else None
    if resume and out is None:
        raise InputError("output_dir: resuming an evaluation needs the folder it was saved in")
    lock = RunLock(out, "eval").acquire() if out is not None else None  # before anything slow
    try:
        done: list[dict] = []
        if out is not None:  # what it appends to or replaces is the folder's own
            refuse_links(out, None if resume else (CONFIG, PREDICTIONS, METRICS))
        if resume:
            done = finished_predictions(out, examples)
        elif out is not None and any((out / name).exists() for name in (CONFIG, PREDICTIONS, METRICS)):
            raise InputError(
                f"{out} already holds an evaluation; continue it with: mhgpo eval --resume {out}, or "
                f"pick another --output-dir"
            )
        finished = {row["id"] for row in done}
        todo = [e for e in examples if e.id not in finished]
        if resume and not todo and (out / METRICS).exists():
            say(f"{out} is complete: all {len(examples)} questions are in {out / PREDICTIONS}")
            return EvalResult(read_json(out / METRICS), done, complete_before=True)
        job = settle(cfg, workflow, reason=reason)
        cfg = job.cfg

        def keep(rows: list[dict]) -> None:
            if not (out / CONFIG).exists():
                dump_config(cfg, out / CONFIG)
            append_jsonl(out / PREDICTIONS, rows, f"continue with: mhgpo eval --resume {out}")
            done.extend(rows)

        with status(f"loading {cfg.model} ..."):
            gen = build_generation(job)
        say(
            f"[dim]{len(examples)} questions from {cfg.data}"
            + (f" ({len(examples) - len(todo)} already done)" if resume else "")
            + f"; model {gen.loaded.name} on {gen.loaded.device}, {cfg.precision}[/]"
        )
        try:
            result = evaluate_examples(
                todo,
                gen.workflow,
                gen.generator,
                gen.encode,
                cfg.batch_size,
                progress=progress,
                desc=desc,
                on_batch=keep if out is not None else None,
                max_prompt_tokens=cfg.max_prompt_tokens,
                pipeline=rollout_pipelined(cfg),
            )
        except KeyboardInterrupt:
            raise _interrupted(out, len(examples)) from None
        finally:
            gen.close()
        order = {e.id: i for i, e in enumerate(examples)}
        rows = sorted(done, key=lambda r: order[r["id"]]) if out is not None else result.predictions
        metrics = summarise(rows, gen.workflow, result.metrics["seconds"])
        if len(rows) > len(result.predictions):
            metrics["resumed"] = len(rows) - len(result.predictions)  # finished in earlier sessions
        if out is not None:
            if not (out / CONFIG).exists():
                dump_config(cfg, out / CONFIG)
            write_eval(
                EvalResult(metrics, rows),
                out,
                {"data": cfg.data, "model": cfg.model, "system": cfg.system, **model_record(gen.loaded)},
            )
        return EvalResult(metrics, rows, result.failures)
    finally:
        if lock is not None:
            lock.release()


def evaluate_validation(
    cfg: Any,
    model: str,
    desc: str = "eval",
    oracle: tuple[str, ...] | list[str] = (),
    workflow: Any = None,
    reason: str | None = None,
) -> EvalResult:
    """A training config's validation (`val_data`, its first `val_limit` questions, the run's team, generation and
    precision settings) of `model` as it is, as an evaluation job of its own (the model loaded, then released);
    `oracle`: roles that give their gold output instead (mhgpo/team/oracle.py). `mhgpo demo` validates its untrained
    team so; `reason` as for :func:`run_evaluation`."""
    from mhgpo.run.setup import validation_config

    return run_evaluation(validation_config(cfg, model, oracle), workflow, progress=True, desc=desc, reason=reason)
