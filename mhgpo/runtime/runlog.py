"""The run directory's logs: `metrics.jsonl` (one line per step, flushed to disk when the step ends), the same
scalars in the trackers of `report_to` (TensorBoard events by default; `mhgpo.runtime.trackers`),
`rollouts/step_NNNNNN.jsonl` (one line per rollout node) and `errors.jsonl` (one line per question whose rollout
failed in a workflow method, with the traceback)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mhgpo.io import append_text, atomic_write_jsonl, read_jsonl


class RunLog:
    """metrics.jsonl and the experiment trackers (`report_to`: see `mhgpo.runtime.trackers`) of rank 0. A tracker that
    fails is left out with a warning and the run goes on; an append that metrics.jsonl refuses stops it."""

    def __init__(
        self,
        run_dir: Path,
        resume_step: int = 0,
        tensorboard: bool = True,
        report_to: list[str] | None = None,
        config: dict[str, Any] | None = None,
    ):
        from mhgpo.runtime.trackers import open_trackers

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.errors_path = self.run_dir / "errors.jsonl"
        self._truncate_after(resume_step)
        names = list(report_to) if report_to is not None else (["tensorboard"] if tensorboard else [])
        self.trackers = open_trackers(names, self.run_dir, resume_step, config or {})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mhgpo.runtime.trackers import numeric

        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        append_text(self.metrics_path, json.dumps(row) + "\n", self._then(step))
        self.trackers.log(step, numeric(row))  # (a tracker that fails is left out, with a warning)

    def error(self, step: int, record: dict[str, Any]) -> None:
        append_text(self.errors_path, json.dumps({"step": step, **record}, ensure_ascii=False) + "\n", self._then(step))

    def _then(self, step: int) -> str:
        """What a failed append leaves: the run stops before step `step` is saved; its checkpoints are kept."""
        return (
            f"the run stops before step {step} is saved; free space and continue with: mhgpo train --resume "
            f"{self.run_dir}"
        )

    def close(self, finished: bool = True) -> None:
        """Close the trackers (`finished`: the run reached its last step, else it was stopped)."""
        self.trackers.close(finished)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop the lines (metrics, errors) and rollout records of steps after the checkpoint (they will
        be run again), and a last line cut short by a killed process."""
        for log in (self.metrics_path, self.errors_path):
            rows, cut = read_jsonl(log)
            keep = [r for r in rows if r.get("step", 0) <= step]
            if cut or len(keep) != len(rows):
                atomic_write_jsonl(log, keep)
        for path in (self.run_dir / "rollouts").glob("step_*.jsonl"):
            if path.stem[5:].isdigit() and int(path.stem[5:]) > step:
                path.unlink()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of `metrics.jsonl` (a last line cut short by a killed process left out)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")[0]


class NoLog:
    """The run log of a rank other than 0 in a data-parallel run: rank 0 writes the logs."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def error(self, step: int, record: dict[str, Any]) -> None:
        pass

    def close(self, finished: bool = True) -> None:
        pass


def validation_path(run_dir: Path, step: int) -> Path:
    """`validation/step_NNNNNN.jsonl`: the questions of the validation after step `step`'s update."""
    return Path(run_dir) / "validation" / f"step_{step:06d}.jsonl"


def write_validation(run_dir: Path, step: int, predictions: list[dict[str, Any]]) -> Path:
    """The validation after step `step`'s update, one line per question as `mhgpo eval` writes its
    `predictions.jsonl` (id, question, answers, prediction, acc, em, f1, the team's trace)."""
    path = validation_path(run_dir, step)
    atomic_write_jsonl(path, predictions)
    return path


def write_rollouts(run_dir: Path, step: int, records: list[dict[str, Any]]) -> Path:
    """`rollouts/step_NNNNNN.jsonl`: step `step`'s records, one line per rollout node."""
    path = Path(run_dir) / "rollouts" / f"step_{step:06d}.jsonl"
    atomic_write_jsonl(path, records)
    return path
