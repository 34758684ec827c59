"""Per-agent behaviour statistics of a batch of rollout nodes (what each agent is doing, not how well)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

from mhgpo.rollout import Node


def call_record(node: Node) -> dict[str, Any]:
    """What the behaviour measures need of one LLM call (kept in each prediction's trace)."""
    return {"agent": node.agent, "penalty": node.penalty, "output_tokens": len(node.output_ids), "info": node.info}


def agent_behaviour(calls: Iterable[Node | dict[str, Any]], agents: Iterable[str]) -> dict[str, float]:
    """`<agent>/penalty_rate` for every agent, plus the search system's own measures when its agents appear:
    `rewriter/num_subqueries`, `reranker/num_selected`, `reranker/invalid_rate`, `answerer/answer_words`.
    `calls` are rollout nodes (tool nodes are skipped) or their :func:`call_record`s."""
    by_agent: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for n in calls:
        if isinstance(n, dict) or n.kind == "llm":
            rec = n if isinstance(n, dict) else call_record(n)
            by_agent[rec["agent"]].append(rec)
    out: dict[str, float] = {}
    for agent in agents:
        recs = by_agent.get(agent, [])
        if not recs:
            continue
        out[f"{agent}/penalty_rate"] = float(np.mean([r["penalty"] < 0 for r in recs]))
        out[f"{agent}/output_tokens"] = float(np.mean([r["output_tokens"] for r in recs]))
        if agent == "rewriter":
            out["rewriter/num_subqueries"] = float(np.mean([len(r["info"].get("queries", [])) for r in recs]))
        elif agent == "reranker":
            out["reranker/num_selected"] = float(np.mean([len(r["info"].get("selected", [])) for r in recs]))
            out["reranker/invalid_rate"] = float(np.mean([r["penalty"] < 0 for r in recs]))
        elif agent in ("answerer", "llm"):
            out[f"{agent}/answer_words"] = float(np.mean([len(r["info"].get("answer", "").split()) for r in recs]))
    return out
