"""Check a run directory's rollout records against MHGPO's invariants and print what was checked.

    python scripts/check_rollouts.py RUN_DIR [--group-size G] [--aggr mean]

Per step file: LLM calls per question; every trained group has G members; every non-leaf node's
`reward_shared` is the Aggr of its direct successors'; `reward = reward_shared + reward_specific` (or without
the penalty when the run had penalties off); advantages equal (R - mean) / (std + 1e-6) within each group id.
Exits non-zero on the first violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import yaml


def check_step(rows: list[dict], group_size: int, aggr: str, penalties: bool) -> dict[str, float]:
    by_id = {(r["question_id"], r["node_id"]): r for r in rows}
    children: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["parent_id"] >= 0:
            children[(r["question_id"], r["parent_id"])].append(r)
    op = {"mean": np.mean, "max": np.max, "min": np.min}.get(aggr)
    for key, r in by_id.items():
        kids = children.get(key)
        if kids and op is not None:
            expected = float(op([k["reward_shared"] for k in kids]))
            assert abs(r["reward_shared"] - expected) < 1e-9, f"node {key}: shared {r['reward_shared']} != {expected}"
        if not kids:
            assert abs(r["reward_shared"] - r["terminal_reward"]) < 1e-12, f"leaf {key}: shared != terminal"
        specific = r["reward_specific"] if penalties else 0.0
        assert abs(r["reward"] - (r["reward_shared"] + specific)) < 1e-9, f"node {key}: reward != shared + specific"
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if r["trained"]:
            groups[r["group_id"]].append(r)
    for gid, members in groups.items():
        assert len(members) == group_size, f"group {gid} has {len(members)} members, expected {group_size}"
        rewards = np.array([m["reward"] for m in members])
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        if np.ptp(rewards) == 0:
            expected = np.zeros_like(rewards)
        got = np.array([m["advantage"] for m in members])
        assert np.allclose(got, expected, atol=1e-9), f"group {gid}: advantages {got} != {expected}"
    for r in rows:
        if not r["trained"]:
            assert r["advantage"] == 0.0, f"untrained node {r['node_id']} has advantage {r['advantage']}"
    calls = Counter(r["question_id"] for r in rows if r["kind"] == "llm")
    return {"questions": len(calls), "llm_calls_per_question": sorted(set(calls.values())), "groups": len(groups)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--aggr")
    args = parser.parse_args()
    run = Path(args.run_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    group_size = args.group_size or cfg["group_size"]
    aggr = args.aggr or cfg["reward"]["aggr"]
    files = sorted((run / "rollouts").glob("step_*.jsonl"))
    if not files:
        print(f"{run}: no rollout files", file=sys.stderr)
        return 1
    for f in files:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        try:
            summary = check_step(rows, group_size, aggr, cfg["reward"]["penalties"])
        except AssertionError as e:
            print(f"{f}: FAILED: {e}", file=sys.stderr)
            return 1
        print(f"{f.name}: ok  {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
