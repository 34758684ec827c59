"""Learning curves of the harness's rows: the validation at step 0 (the model a row starts from, validated once per
warm start and validation and shared by every row that starts from it; the warm start's own validation row is that
validation, :func:`keep_start`), the row's own validations every
`val_every` steps, and whether a warm start is healthy.

A curve (`val_curve` in a result) is a list of points `{"step", "cpu_minutes", "f1", "em", "acc"}` (and `forms`, F1
by question form: `mhgpo.data.forms`, where the validation reported it): step 0 is the
starting model (0 CPU minutes), each later point the run's checkpoint at that step, validated greedily on the same
questions, with the CPU minutes its steps' rollouts and updates had taken (validation, loading and checkpoints left
out: a row's machine time, comparable between rows). Its first point also carries the per-question F1 of the start,
so that a row's end can be compared with its start question by question (`mhgpo.experiments.stats`), and every later
point whose run kept its validation's questions (`RUN/validation/step_NNNNNN.jsonl`) its own paired change over the
start (`paired`).

A warm start is *healthy* (:func:`healthy`) when its greedy team writes invalid Reranker ids on at most 5% of the
validation questions, the Rewriter breaks its `### ... ###` format on at most 10% of them, and the Reranker passes on
at least 80% of the gold passages the retriever found (where the data names them): RL from a broken format first
repairs it, and from a Reranker that drops the second hop's passage first relearns to keep it, gains of another
kind, reported apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhgpo.config import TrainConfig, to_dict
from mhgpo.data.forms import is_form_metric, picked, question_form
from mhgpo.experiments.results import is_count, is_number, waiting_lock
from mhgpo.experiments.stats import paired_bootstrap, paired_questions
from mhgpo.io import atomic_write_json

STARTS = "starts"  # OUT/DATA/starts/: the step-0 validations, one per (starting model, validation)
HEALTH = {"reranker/invalid_rate": 0.05, "rewriter/penalty_rate": 0.1}  # the most a healthy warm start shows
HEALTH_LEAST = {"reranker/gold_recall": 0.8}  # the least it shows
SCORES = ("f1", "em", "acc")


def healthy(metrics: dict[str, Any]) -> bool | None:
    """Whether a validation's behaviour figures meet :data:`HEALTH` and :data:`HEALTH_LEAST`; None when it has none
    of them (a team without a Reranker or a Rewriter: nothing to judge). A figure it lacks is not judged."""
    most = [(k, b) for k, b in HEALTH.items() if isinstance(metrics.get(k), (int, float))]
    least = [(k, b) for k, b in HEALTH_LEAST.items() if isinstance(metrics.get(k), (int, float))]
    if not most and not least:
        return None
    return all(float(metrics[k]) <= b + 1e-12 for k, b in most) and all(
        float(metrics[k]) >= b - 1e-12 for k, b in least
    )


def start_key(cfg: TrainConfig, folder: Path) -> str:
    """The name of the step-0 validation of the row config `cfg`: its starting model (relative to the data folder
    `folder` where it is inside it) and a hash of its validation's settings."""
    from mhgpo.run.setup import validation_config

    model = Path(cfg.model)
    try:
        shown = model.resolve().relative_to(Path(folder).resolve()).as_posix()
    except ValueError:
        shown = cfg.model
    tree = to_dict(validation_config(cfg, shown))
    tree.pop("output_dir", None)
    digest = hashlib.sha1(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:10]
    tag = "".join(c if c.isalnum() or c in "-_" else "_" for c in Path(shown).name)[:60]
    return f"{tag}-{digest}"


def start_point(cfg: TrainConfig, folder: Path) -> dict:
    """The step-0 validation of the row config `cfg` (its `model` as it starts, validated as the row validates):
    read from OUT/DATA/starts/ when there, else run once (under a lock, so rows of one seed running at once share
    it) and kept there."""
    from mhgpo.run.evaluate import run_evaluation
    from mhgpo.run.setup import validation_config

    key = start_key(cfg, folder)
    path = Path(folder) / STARTS / f"{key}.json"
    with waiting_lock(folder, f"start-{key}"):
        found = read_start(path)
        if found is not None:
            return found
        out = Path(folder) / "runs" / f"start-{key}"
        ev = dataclasses.replace(validation_config(cfg, cfg.model), output_dir=str(out))
        res = run_evaluation(ev, resume=(out / "eval_config.yaml").is_file(), progress=False, desc="step 0")
        point = _point(cfg, res.metrics, res.predictions)
        atomic_write_json(path, point)
        return point


def _point(cfg: TrainConfig, metrics: dict[str, Any], predictions: list[dict]) -> dict:
    return {
        "step": 0,
        "cpu_minutes": 0.0,
        **{k: float(metrics[k]) for k in SCORES},
        "n": int(metrics["n"]),
        "model": Path(cfg.model).name,
        "behaviour": {k: float(v) for k, v in metrics.items() if "/" in k and not is_form_metric(k)},
        "forms": {k: float(v) for k, v in metrics.items() if is_form_metric(k)},
        "healthy": healthy(metrics),
        "questions": [question_record(p, ("f1",)) for p in predictions],
    }


def _steps(prediction: dict) -> list[dict] | None:
    """The steps of a prediction's trace (the dicts among them), or None where it has no such list."""
    trace = prediction.get("trace")
    steps = trace.get("steps") if isinstance(trace, dict) else None
    return [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else None


def gold_dropped(prediction: dict) -> int | None:
    """The gold passages a prediction's team was shown and did not pass on: over its trace's steps whose `info`
    counts `gold` (gold passages among the candidates) and `gold_selected` (those selected; the search system's
    Reranker), both whole numbers. None where no step counts them (another team, one whose `gold` means something
    else, data without supporting titles)."""
    infos = [s.get("info") for s in _steps(prediction) or []]
    counted = [i for i in infos if isinstance(i, dict) and is_count(i.get("gold")) and is_count(i.get("gold_selected"))]
    return sum(i["gold"] - i["gold_selected"] for i in counted) if counted else None


def format_broken(prediction: dict) -> bool | None:
    """Whether an agent of a prediction's team broke its format (a step with a format penalty below 0: the
    Rewriter's unclosed `### ... ###`, the Reranker's invalid ids, the Answerer past its length); None where no step
    records a penalty."""
    penalties = [s["penalty"] for s in _steps(prediction) or [] if is_number(s.get("penalty"))]
    return any(p < 0 for p in penalties) if penalties else None


def question_record(prediction: dict, scores: tuple[str, ...]) -> dict:
    """A prediction's per-question record in a result: its id, ``scores``, its question's form (`form`:
    :func:`mhgpo.data.forms.question_form`) and, on a comparison, the constant its answer is (`picked`: yes / no,
    first / second, or null), and, where its trace says them, the gold passages its team dropped
    (:func:`gold_dropped`) and whether it broke a format (:func:`format_broken`): a start's questions with neither
    are those on which its team already worked (`mhgpo.experiments.curve_page`)."""
    record = {"id": prediction["id"], **{k: prediction[k] for k in scores}}
    if isinstance(prediction.get("question"), str) and isinstance(prediction.get("answers"), list):
        record["form"] = question_form(prediction["question"], prediction["answers"])
        if record["form"] != "other":
            record["picked"] = picked(prediction["question"], prediction["answers"], prediction.get("prediction") or "")
    dropped, broken = gold_dropped(prediction), format_broken(prediction)
    if dropped is not None:
        record["gold_dropped"] = dropped
    if broken is not None:
        record["format_broken"] = broken
    return record


def keep_start(cfg: TrainConfig, folder: Path, metrics: dict[str, Any], predictions: list[dict]) -> Path:
    """Keep a validation of the starting model of the row config `cfg`, made as the row validates (the harness's
    row that validates the warm start itself), as that model's step-0 validation, unless one is kept already: the
    rows starting from it then do not validate it again (the same model, greedily, on the same questions: the same
    figures). Returns the file."""
    key = start_key(cfg, folder)
    path = Path(folder) / STARTS / f"{key}.json"
    with waiting_lock(folder, f"start-{key}"):
        if read_start(path) is None:
            atomic_write_json(path, _point(cfg, metrics, predictions))
    return path


def read_start(path: Path) -> dict | None:
    """A kept step-0 validation, or None when it is missing or unreadable (then it is run again)."""
    try:
        point = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(point, dict) or any(not isinstance(point.get(k), (int, float)) for k in SCORES):
        return None
    return point


def curve(start: dict, history: list[dict], questions: Callable[[int], list[dict] | None] | None = None) -> list[dict]:
    """A row's `val_curve`: its start (step 0, without the per-question figures) and a point per validation of its
    run (`Trainer.val_history`). ``questions(step)``: the per-question results of the run's validation at ``step``
    (None where the run kept none); a point that has them carries ``paired``, its change over the start question by
    question in F1 points: ``[mean, low, high]`` (95% paired bootstrap,
    :func:`~mhgpo.experiments.stats.paired_bootstrap`)."""
    first = {"step": 0, "cpu_minutes": 0.0, **{k: start[k] for k in SCORES}}
    if start.get("forms"):
        first["forms"] = dict(start["forms"])
    points = []
    for h in history:
        point = {"step": int(h["step"]), "cpu_minutes": float(h.get("cpu_minutes", 0.0))}
        point.update({k: h[f"val/{k}"] for k in SCORES})
        forms = {k[len("val/") :]: v for k, v in h.items() if is_form_metric(k[len("val/") :])}
        if forms:
            point["forms"] = forms
        found = questions(point["step"]) if questions is not None else None
        diffs = paired_questions(found, start["questions"]) if found else []
        if diffs:
            point["paired"] = [100 * x for x in paired_bootstrap(diffs)]
        points.append(point)
    return [first, *points]
