"""Per-agent behaviour statistics of a batch of rollout nodes (what each agent is doing, not how well)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from mhgpo.rl.tree import Node
from mhgpo.team.workflow import Call, Workflow, breaks_format


def call_record(node: Node) -> dict[str, Any]:
    """What the behaviour measures need of one LLM call (kept in each prediction's trace): a `Call` as a dict."""
    return {
        "agent": node.agent,
        "penalty": node.penalty,
        "output_tokens": len(node.output_ids),
        "info": node.info,
        "visit": node.visit,
        "output": node.output,
    }


def _call(n: Node | dict[str, Any]) -> Call:
    rec = n if isinstance(n, dict) else call_record(n)
    return Call(
        rec["agent"],
        rec.get("output", ""),
        float(rec["penalty"]),
        int(rec["output_tokens"]),
        int(rec.get("visit", 0)),
        dict(rec.get("info") or {}),
    )


def agent_behaviour(calls: Iterable[Node | dict[str, Any]], workflow: Workflow) -> dict[str, float]:
    """For every agent of `workflow` that was called: `<agent>/penalty_rate` (share of its outputs that break
    its format rule: :func:`breaks_format`), `<agent>/output_tokens` (mean output length), and the workflow's own
    measures (`workflow.behaviour(agent, calls)`, e.g. the default team's `rewriter/num_subqueries`). `calls` are rollout
    nodes (tool nodes are skipped) or their :func:`call_record`s (an evaluation's prediction lines)."""
    by_agent: dict[str, list[Call]] = defaultdict(list)
    for n in calls:
        if isinstance(n, dict) or n.kind == "llm":
            call = _call(n)
            by_agent[call.agent].append(call)
    out: dict[str, float] = {}
    for agent in workflow.agents:
        mine = by_agent.get(agent, [])
        if not mine:
            continue
        out[f"{agent}/penalty_rate"] = float(np.mean([breaks_format(c) for c in mine]))
        out[f"{agent}/output_tokens"] = float(np.mean([c.output_tokens for c in mine]))
        for name, value in workflow.behaviour(agent, mine).items():
            out[f"{agent}/{name}"] = float(value)
    return out
