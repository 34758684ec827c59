"""Evaluation: the team answers a set of questions with greedy decoding, breadth-first in batches.

An evaluation folder holds `eval_config.yaml`, `predictions.jsonl` (one line per question with the gold answers,
the prediction and each agent's trace; `mhgpo eval` appends each batch as it finishes) and, at the end,
`metrics.json` (n, acc, em, f1 in percent, seconds, per-agent behaviour, F1 by question form:
`mhgpo.data.forms`). The metrics are computed from the
prediction lines alone, so an evaluation continued with `mhgpo eval --resume` scores the questions of every session.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mhgpo.config.eval import MAX_PROMPT_TOKENS
from mhgpo.data.forms import form_metrics
from mhgpo.data.metrics import score
from mhgpo.data.records import Example
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_json, atomic_write_jsonl, read_jsonl
from mhgpo.model import wire
from mhgpo.model.generation import Generator
from mhgpo.rl.behaviour import agent_behaviour, call_record
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import Node, RolloutSpec
from mhgpo.team.workflow import Workflow

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
CONFIG = "eval_config.yaml"


@dataclass
class EvalResult:
    metrics: dict[str, float]
    predictions: list[dict[str, Any]]
    failures: list[Any] = field(default_factory=list)  # RolloutFailure of questions left out (on_error="skip")
    complete_before: bool = False  # resumed, with nothing left to do: metrics are the saved ones


wire.register(EvalResult)  # (gathered from the ranks of a data-parallel validation)


def chain_record(example: Example, chain: list[Node]) -> dict[str, Any]:
    """One predictions.jsonl line from the nodes of a one-chain rollout (in order); `type` where the data gives the
    question one."""
    leaf = chain[-1]
    prediction = leaf.final_answer or ""
    s = score(prediction, example.answers)
    trace = dict(leaf.trace or {})
    trace["steps"] = [
        {**call_record(n), "output": n.output} if n.kind == "llm" else {"agent": n.agent, "tool": n.info} for n in chain
    ]
    record = {"id": example.id, "question": example.question, "answers": list(example.answers)}
    if example.type:
        record["type"] = example.type
    return {**record, "prediction": prediction, "acc": s["acc"], "em": s["em"], "f1": s["f1"], "trace": trace}


def evaluate_examples(
    examples: list[Example],
    workflow: Workflow,
    generator: Generator,
    encode: Callable[[list[dict[str, str]]], list[int]],
    batch_size: int = 32,
    progress: bool = True,
    desc: str = "eval",
    on_batch: Callable[[list[dict[str, Any]]], None] | None = None,
    on_error: str = "raise",
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    pipeline: bool = False,
) -> EvalResult:
    """Greedy, one chain per question, `batch_size` questions breadth-first at a time; `on_batch` receives each
    batch's prediction records as soon as the batch is finished. A question whose rollout fails in a workflow
    method stops the evaluation (`on_error="raise"`) or is left out of the metrics and returned in `failures`
    (`on_error="skip"`); so does a question whose prompt is longer than `max_prompt_tokens`. `pipeline`: tool
    calls and rewards worked out while later generation batches run (`rollout.pipeline`, `mhgpo.rl.pipeline`)."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    rng = np.random.default_rng(0)
    predictions: list[dict[str, Any]] = []
    failures: list[Any] = []
    spec = RolloutSpec(sampler="none", greedy=True, max_prompt_tokens=max_prompt_tokens)
    with tqdm(total=len(examples), desc=desc, unit="q", disable=not progress, dynamic_ncols=True) as bar:
        for lo in range(0, len(examples), batch_size):
            chunk = examples[lo : lo + batch_size]
            batch = run_rollouts(chunk, workflow, generator, encode, spec, rng, on_error=on_error, pipeline=pipeline)
            failures.extend(batch.failures)
            chains: list[list[Node]] = [[] for _ in batch.examples]
            for n in batch.nodes:
                chains[n.question_index].append(n)
            rows = [chain_record(ex, chain) for ex, chain in zip(batch.examples, chains)]
            if on_batch is not None:
                on_batch(rows)
            predictions.extend(rows)
            bar.update(len(chunk))
            if predictions:
                bar.set_postfix(f1=f"{100 * float(np.mean([p['f1'] for p in predictions])):.1f}")
    return _result(predictions, failures, workflow, time.perf_counter() - start)


def evaluate_on_ranks(
    examples: list[Example],
    workflow: Workflow,
    generator: Generator,
    encode: Callable[[list[dict[str, str]]], list[int]],
    batch_size: int,
    ranks: Any,
    **options: Any,
) -> EvalResult:
    """:func:`evaluate_examples` on the ranks of a data-parallel run: each rank its share of `examples`, the results
    gathered in order (one process: all of them); `options` as `evaluate_examples` takes them."""
    if ranks.world == 1:
        return evaluate_examples(examples, workflow, generator, encode, batch_size, **options)
    start = time.perf_counter()
    mine = evaluate_examples(ranks.share(examples), workflow, generator, encode, batch_size, **options)
    return merge_results(ranks.gather(mine), workflow, time.perf_counter() - start)


def merge_results(results: list[EvalResult], workflow: Workflow, seconds: float) -> EvalResult:
    """One result of the questions of `results` (shares of one set, in order; each rank's of a data-parallel
    run): predictions and failures together, the metrics computed again over all of them."""
    return _result(
        [p for r in results for p in r.predictions], [f for r in results for f in r.failures], workflow, seconds
    )


def _result(predictions: list[dict[str, Any]], failures: list[Any], workflow: Workflow, seconds: float) -> EvalResult:
    metrics = summarise(predictions, workflow, seconds)
    if failures:
        metrics["failed"] = len(failures)
    return EvalResult(metrics, predictions, failures)


def summarise(predictions: list[dict[str, Any]], workflow: Workflow, seconds: float) -> dict[str, float]:
    """n, Acc / EM / F1 (percent), each agent's behaviour (`agent_behaviour`) and F1 by question form
    (`mhgpo.data.forms.form_metrics`), from prediction records."""
    metrics: dict[str, float] = {"n": len(predictions)}
    for key in ("acc", "em", "f1"):
        metrics[key] = 100 * float(np.mean([p[key] for p in predictions])) if predictions else 0.0
    metrics["seconds"] = seconds
    calls = [s for p in predictions for s in p["trace"]["steps"] if "tool" not in s]
    metrics.update(agent_behaviour(calls, workflow))
    metrics.update(form_metrics(predictions))
    return metrics


def finished_predictions(folder: Path, examples: list[Example]) -> list[dict[str, Any]]:
    """The prediction records an interrupted evaluation in `folder` finished, checked against the questions being
    evaluated: their ids, questions and gold answers (the metrics, F1 by question form included, are computed from
    these lines); a last line cut short by a killed process is dropped from the file."""
    path = Path(folder) / PREDICTIONS
    rows, cut = read_jsonl(path)
    if cut:
        atomic_write_jsonl(path, rows)
    known = {e.id: e for e in examples}
    seen: set[str] = set()
    kept = []
    for number, row in enumerate(rows, 1):
        steps = row.get("trace", {}).get("steps") if isinstance(row.get("trace"), dict) else None
        if not isinstance(steps, list) or any("tool" not in s and "output_tokens" not in s for s in steps):
            raise InputError(
                f"{path}:{number}: not a prediction record of this mhgpo version; start a new "
                f"evaluation with another --output-dir"
            )
        if row.get("id") not in known:
            raise InputError(
                f"{path}:{number}: question id {row.get('id')!r} is not among the questions being evaluated"
            )
        asked = known[row["id"]]
        if row.get("question") != asked.question or row.get("answers") != list(asked.answers):
            raise InputError(
                f"{path}:{number}: question {row['id']!r} has another question or gold answers than the data's; "
                f"start a new evaluation with another --output-dir"
            )
        if asked.type and "type" not in row:  # (a line of a version that did not write it)
            row["type"] = asked.type
        if row["id"] not in seen:
            seen.add(row["id"])
            kept.append(row)
    return kept


def write_eval(result: EvalResult, output_dir: Path, extra: dict[str, Any] | None = None) -> None:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(output_dir / "predictions.jsonl", result.predictions)
    atomic_write_json(output_dir / "metrics.json", {**result.metrics, **(extra or {})})


def metrics_table(rows: dict[str, dict[str, float]], title: str = "") -> Any:
    """A rich table: one row per named result, columns n / Acc / EM / F1."""
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("", "n", "Acc", "EM", "F1"):
        table.add_column(col, justify="right" if col else "left")
    for name, m in rows.items():
        table.add_row(name, str(int(m["n"])), f"{m['acc']:.1f}", f"{m['em']:.1f}", f"{m['f1']:.1f}")
    return table
