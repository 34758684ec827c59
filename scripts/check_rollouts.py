"""Check a run directory's rollout records against MHGPO's invariants and print what was checked.

    python scripts/check_rollouts.py RUN_DIR [--group-size G] [--aggr mean]

Per step file: every non-leaf node's `reward_shared` is the Aggr of its direct successors'; `reward =
reward_shared + reward_specific` (or without the penalty when the run had penalties off); each node's `visit` is
the number of calls of its agent above it on its path; group ids: every trained group has one agent and 2..G
members (exactly G for the built-in teams, whose paths never end early) and is either all the nodes of one
(question, fork, agent, visit) (of one parent, for FoF(os)'s over-sampled groups) or, under RR, G singletons
regrouped; an untrained node of a role that trains is a singleton that could not be grouped (all but the forked
samples under IS); advantages equal (R - mean) / (std + 1e-6) within each group id. Exits non-zero on the first
violation.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import yaml


def _visits(by_id: dict[tuple, dict]) -> dict[tuple, int]:
    """Each node's visit recomputed from its path: how many ancestors have its agent."""
    out = {}
    for key, r in by_id.items():
        n, parent = 0, by_id.get((key[0], r["parent_id"]))
        while parent is not None:
            n += parent["agent"] == r["agent"]
            parent = by_id.get((key[0], parent["parent_id"]))
        out[key] = n
    return out


def check_groups(
    rows: list[dict], group_size: int, sampler: str, exact: bool, frozen: set[str], within_role: bool = True
) -> dict[str, int]:
    """The group-id invariants above; returns how many groups of each kind were seen."""
    llm = [r for r in rows if r["kind"] == "llm"]
    key = {id(r): (r["question_id"], r.get("fork", 0), r["agent"], r["visit"]) for r in llm}
    by_key, by_parent = defaultdict(list), defaultdict(list)
    for r in llm:
        by_key[key[id(r)]].append(r)
        by_parent[(r["question_id"], r["parent_id"], r["agent"], r["visit"])].append(r)
    kinds: Counter = Counter()
    for gid, members in _groups(rows).items():
        assert all(m["kind"] == "llm" for m in members), f"group {gid} holds a tool node"
        size = len(members)
        assert 2 <= size <= group_size, f"group {gid} has {size} members, expected 2..{group_size}"
        assert not exact or size == group_size, f"group {gid} has {size} members, expected {group_size}"
        ids = sorted(id(m) for m in members)
        keys = {key[id(m)] for m in members}
        parents = {(m["question_id"], m["parent_id"], m["agent"], m["visit"]) for m in members}
        if len(keys) == 1 and sorted(map(id, by_key[next(iter(keys))])) == ids:
            kinds["per visit"] += 1
        elif sampler == "fof_os" and len(parents) == 1 and sorted(map(id, by_parent[next(iter(parents))])) == ids:
            kinds["over-sampled"] += 1
        else:
            assert sampler == "rr", f"group {gid} is not all the nodes of one (question, fork, agent, visit): {keys}"
            assert size == group_size, f"regrouped group {gid} has {size} members, expected {group_size}"
            assert all(len(by_key[key[id(m)]]) == 1 for m in members), f"regrouped group {gid} holds a non-singleton"
            assert not within_role or len({m["agent"] for m in members}) == 1, f"regrouped group {gid} mixes agents"
            kinds["regrouped"] += 1
    if sampler != "is":
        for r in llm:
            if not r["trained"] and r["agent"] not in frozen:
                assert len(by_key[key[id(r)]]) == 1, (
                    f"node {r['node_id']} of {r['question_id']} ({r['agent']}, visit "
                    f"{r['visit']}) is untrained but not a singleton"
                )
    return dict(kinds)


def check_step(
    rows: list[dict],
    group_size: int,
    aggr: str,
    penalties: bool,
    sampler: str = "fof",
    exact: bool = True,
    frozen: set[str] = frozenset(),
    within_role: bool = True,
) -> dict:
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
    for key, visit in _visits(by_id).items():
        r = by_id[key]
        r.setdefault("visit", visit)  # records written before visits were recorded
        assert r["visit"] == visit, f"node {key} ({r['agent']}): visit {r['visit']}, but {visit} calls above it"
    summary: dict = {}
    if sampler == "chains":  # every call is its own id (the critic is the baseline): no groups to check
        assert all(r["trained"] for r in rows if r["kind"] == "llm" and r["agent"] not in frozen)
    else:
        summary["groups"] = check_groups(rows, group_size, sampler, exact, frozen, within_role)
        for gid, members in _groups(rows).items():
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
    visits = {}
    for r in rows:
        visits[r["agent"]] = max(visits.get(r["agent"], 0), r["visit"] + 1)
    summary.update(questions=len(calls), llm_calls_per_question=sorted(set(calls.values())), most_visits=visits)
    return summary


def _groups(rows: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if r["trained"]:
            groups[r["group_id"]].append(r)
    return groups


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
    exact = cfg.get("system", "mas") in ("mas", "llm")
    frozen_roles = set(cfg.get("frozen_roles") or [])
    files = sorted((run / "rollouts").glob("step_*.jsonl"))
    if not files:
        print(f"{run}: no rollout files", file=sys.stderr)
        return 1
    for f in files:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        trained_roles = cfg.get("train_roles")
        untrained = {r["agent"] for r in rows} - set(trained_roles) if trained_roles is not None else set()
        frozen = frozen_roles | untrained
        try:
            summary = check_step(
                rows,
                group_size,
                aggr,
                cfg["reward"]["penalties"],
                cfg.get("sampler") or "fof",
                exact,
                frozen,
                cfg.get("regroup_within_role", True),
            )
        except AssertionError as e:
            print(f"{f}: FAILED: {e}", file=sys.stderr)
            return 1
        print(f"{f.name}: ok  {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
