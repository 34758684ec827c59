"""Per-agent behaviour statistics of a batch of rollout nodes (what each agent is doing, not how well)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import numpy as np

from mhgpo.rollout import Node


def agent_behaviour(nodes: Iterable[Node], agents: Iterable[str]) -> dict[str, float]:
    """`<agent>/penalty_rate` for every agent, plus the search system's own measures when its agents appear:
    `rewriter/num_subqueries`, `reranker/num_selected`, `reranker/invalid_rate`, `answerer/answer_words`."""
    by_agent: dict[str, list[Node]] = defaultdict(list)
    for n in nodes:
        if n.kind == "llm":
            by_agent[n.agent].append(n)
    out: dict[str, float] = {}
    for agent in agents:
        calls = by_agent.get(agent, [])
        if not calls:
            continue
        out[f"{agent}/penalty_rate"] = float(np.mean([n.penalty < 0 for n in calls]))
        out[f"{agent}/output_tokens"] = float(np.mean([len(n.output_ids) for n in calls]))
        if agent == "rewriter":
            out["rewriter/num_subqueries"] = float(np.mean([len(n.info.get("queries", [])) for n in calls]))
        elif agent == "reranker":
            out["reranker/num_selected"] = float(np.mean([len(n.info.get("selected", [])) for n in calls]))
            out["reranker/invalid_rate"] = float(np.mean([n.penalty < 0 for n in calls]))
        elif agent in ("answerer", "llm"):
            out[f"{agent}/answer_words"] = float(np.mean([len(n.info.get("answer", "").split()) for n in calls]))
    return out
