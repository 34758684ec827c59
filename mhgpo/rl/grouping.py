"""Group ids from the sampler (`mhgpo/config/samplers.py`): the samples of one agent (at its k-th visit) under one
question and one fork form one group (homogeneous at the fork agent, heterogeneous downstream); FoF(os)'s terminal
samples of one input form one group. Groups of size 1 never train: RR regroups them (by role and fork agent by
default, `rr_regroup`), the other samplers drop and count them. `chains` gives every LLM call an id of its own: it
marks the sample as trained, it is not a group."""

from __future__ import annotations

from collections import Counter

import numpy as np

from mhgpo.config.samplers import sampler as sampler_entry
from mhgpo.rl.advantages import regroup_singletons, rr_pool_keys
from mhgpo.rl.tree import Node, RolloutBatch, RolloutSpec


def assign_groups(batch: RolloutBatch, spec: RolloutSpec, rng: np.random.Generator) -> None:
    """Group ids of the batch's trees (:func:`_assign_groups`: RR pools its singletons across all its questions),
    their counts in its stats, and FoF's fork agents (the first agent each question called)."""
    batch.stats = {**_assign_groups(batch.nodes, spec, spec.width, rng, batch.fork_agents), **batch.stats}
    if sampler_entry(spec.sampler).forks == "first":
        batch.fork_agents = [[_first_llm_agent(batch.nodes, q)] for q in range(len(batch.examples))]


def _first_llm_agent(nodes: list[Node], q: int) -> str | None:
    return next((n.agent for n in nodes if n.question_index == q and n.kind == "llm"), None)


def _assign_groups(
    nodes: list[Node], spec: RolloutSpec, G: int, rng: np.random.Generator, fork_agents: list[list[str | None]]
) -> dict[str, float]:
    """Turn group keys into integer group ids; drop (or, for RR, regroup) singletons. Returns counts."""
    llm = [n for n in nodes if n.kind == "llm"]
    entry = sampler_entry(spec.sampler)
    if entry.forks == "none" or not llm:
        return {"groups": 0.0, "singletons_dropped": 0.0, "samples": 0.0}
    if entry.forks == "chains":  # every call trains on its own (the critic, not a group, gives its baseline)
        for i, n in enumerate(llm):
            n.group_id = i
        return {"groups": 0.0, "singletons_dropped": 0.0, "samples": float(len(llm))}
    keep = [n for n in llm if n.fork_sample] if entry.fork_samples_only else llm
    sizes = Counter(n.group_key for n in keep)
    ids: dict[tuple, int] = {}
    group_ids = np.full(len(keep), -1, dtype=np.int64)
    for i, n in enumerate(keep):
        group_ids[i] = ids.setdefault(n.group_key, len(ids))
    dropped = 0
    if entry.regroup_singletons:
        keys = rr_pool_keys(
            spec.rr_regroup, [n.agent for n in keep], [fork_agents[n.question_index][0] for n in keep]
        )  # RR: one fork agent per question
        group_ids, dropped = regroup_singletons(group_ids, keys, G, rng)
    else:
        for i, n in enumerate(keep):
            if sizes[n.group_key] < 2:
                group_ids[i] = -1
                dropped += 1
    # renumber to 0..K-1 in order of first appearance
    remap: dict[int, int] = {}
    for n, g in zip(keep, group_ids):
        n.group_id = -1 if g < 0 else remap.setdefault(int(g), len(remap))
    return {
        "groups": float(len(remap)),
        "singletons_dropped": float(dropped),
        "samples": float(sum(1 for n in keep if n.group_id >= 0)),
    }
