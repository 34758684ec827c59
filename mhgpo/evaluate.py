"""Evaluation: the team answers a set of questions with greedy decoding, breadth-first in batches.

Writes `metrics.json` (n, acc, em, f1 in percent, seconds, per-agent behaviour) and `predictions.jsonl` (one line
per question with the gold answers, the prediction and each agent's trace), both atomically.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mhgpo.behaviour import agent_behaviour
from mhgpo.generation import Generator
from mhgpo.io import atomic_write_json, atomic_write_jsonl
from mhgpo.metrics import score
from mhgpo.records import Example
from mhgpo.rollout import Node, RolloutSpec, run_rollouts
from mhgpo.workflow import Workflow


@dataclass
class EvalResult:
    metrics: dict[str, float]
    predictions: list[dict[str, Any]]


def chain_record(example: Example, chain: list[Node]) -> dict[str, Any]:
    """One predictions.jsonl line from the nodes of a one-chain rollout (in order)."""
    leaf = chain[-1]
    prediction = leaf.final_answer or ""
    s = score(prediction, example.answers)
    trace = dict(leaf.trace or {})
    trace["steps"] = [
        {"agent": n.agent, "output": n.output} if n.kind == "llm" else {"agent": n.agent, "tool": n.info}
        for n in chain
    ]
    return {
        "id": example.id,
        "question": example.question,
        "answers": list(example.answers),
        "prediction": prediction,
        "acc": s["acc"],
        "em": s["em"],
        "f1": s["f1"],
        "trace": trace,
    }


def evaluate_examples(
    examples: list[Example],
    workflow: Workflow,
    generator: Generator,
    encode: Callable[[list[dict[str, str]]], list[int]],
    batch_size: int = 32,
    progress: bool = True,
    desc: str = "eval",
) -> EvalResult:
    """Greedy, one chain per question, `batch_size` questions breadth-first at a time."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    rng = np.random.default_rng(0)
    predictions: list[dict[str, Any]] = []
    all_nodes: list[Node] = []
    spec = RolloutSpec(sampler="none", greedy=True)
    bar = tqdm(total=len(examples), desc=desc, unit="q", disable=not progress, dynamic_ncols=True)
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        batch = run_rollouts(chunk, workflow, generator, encode, spec, rng)
        chains: list[list[Node]] = [[] for _ in chunk]
        for n in batch.nodes:
            chains[n.question_index].append(n)
        predictions.extend(chain_record(ex, chain) for ex, chain in zip(chunk, chains))
        all_nodes.extend(batch.nodes)
        bar.update(len(chunk))
        f1 = 100 * float(np.mean([p["f1"] for p in predictions]))
        bar.set_postfix(f1=f"{f1:.1f}")
    bar.close()
    metrics: dict[str, float] = {
        "n": len(predictions),
        "acc": 100 * float(np.mean([p["acc"] for p in predictions])),
        "em": 100 * float(np.mean([p["em"] for p in predictions])),
        "f1": 100 * float(np.mean([p["f1"] for p in predictions])),
        "seconds": time.perf_counter() - start,
    }
    metrics.update(agent_behaviour(all_nodes, workflow.agents))
    return EvalResult(metrics, predictions)


def write_eval(result: EvalResult, output_dir: Path, extra: dict[str, Any] | None = None) -> None:
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_jsonl(output_dir / "predictions.jsonl", result.predictions)
    atomic_write_json(output_dir / "metrics.json", {**result.metrics, **(extra or {})})


def metrics_table(rows: dict[str, dict[str, float]], title: str = "") -> "Any":
    """A rich table: one row per named result, columns n / Acc / EM / F1."""
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("", "n", "Acc", "EM", "F1"):
        table.add_column(col, justify="right" if col else "left")
    for name, m in rows.items():
        table.add_row(name, str(int(m["n"])), f"{m['acc']:.1f}", f"{m['em']:.1f}", f"{m['f1']:.1f}")
    return table
