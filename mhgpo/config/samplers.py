"""The rollout samplers as one table: where each forks, whether it over-samples, how its samples are grouped, and
which algorithms train with it. The config checks `sampler` against it, the rollout engine (`mhgpo.rl.rollout`) and
the grouping (`mhgpo.rl.grouping`) read its entry; a new sampler is one entry here (and its test).

Which algorithms train with a sampler follows from the two tables (:func:`trains_with`): an algorithm with a critic
(`mhgpo/config/tables.py`) learns from samples that form no groups (`chains`), the others from the samplers that
form groups; a single-agent algorithm not from those that need a team of several agents (`team_only`).

| name | forks | over-samples | trains | singletons | algorithms |
|---|---|---|---|---|---|
| `is` | a chain per agent, forked at it | no | the forked agent's G samples | dropped | mhgpo, grpo |
| `fof` | at the first agent called | no | every sample | dropped | mhgpo, grpo |
| `rr` | at an agent drawn from `rr_probs` | no | every sample | regrouped across the batch | mhgpo |
| `fof_os` | at the first agent called | the terminal agent: G per branch | every sample | dropped | mhgpo |
| `chains` | never: G independent chains | no | every sample, each its own id | — | mappo, ppo |
| `none` | never: one chain | no | nothing (evaluation) | — | — |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORKS = ("none", "chains", "every", "first", "drawn")


@dataclass(frozen=True)
class Sampler:
    name: str
    forks: str  # none | chains (G chains, no fork) | every (one chain per agent) | first | drawn (from rr_probs)
    oversample_terminal: bool = False  # the terminal agent samples G outputs per branch (its own group)
    fork_samples_only: bool = False  # only the G samples at the fork point train (IS: homogeneous groups)
    regroup_singletons: bool = False  # prefix calls of one sample are pooled across the batch (RR)
    team_only: bool = False  # needs several agents (a fork drawn among them, a terminal agent after others)
    label: str = ""  # how an algorithm's label names it (MHGPO-RR)

    @property
    def groups(self) -> bool:
        """Whether its samples form groups (MHGPO, GRPO); `chains` gives each call an id of its own."""
        return self.forks not in ("none", "chains")

    @property
    def trains(self) -> bool:
        """Whether its samples train at all (`none` is one greedy chain: evaluation)."""
        return self.forks != "none"


SAMPLERS: dict[str, Sampler] = {
    s.name: s
    for s in (
        Sampler("is", forks="every", fork_samples_only=True, label="IS"),
        Sampler("fof", forks="first", label="FoF"),
        Sampler("rr", forks="drawn", regroup_singletons=True, team_only=True, label="RR"),
        Sampler("fof_os", forks="first", oversample_terminal=True, team_only=True, label="FoF(os)"),
        Sampler("chains", forks="chains"),
        Sampler("none", forks="none"),
    )
}


def sampler(name: str) -> Sampler:
    """The table's entry for `name` (ValueError naming the valid ones otherwise)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def trains_with(algorithm: Any, entry: Sampler) -> bool:
    """Whether an algorithm (an entry of `mhgpo.config.tables.ALGORITHMS`) trains on `entry`'s samples."""
    if not entry.trains or entry.groups == algorithm.critic:
        return False
    return not (algorithm.single_agent and entry.team_only)


def train_samplers() -> tuple[str, ...]:
    """The values of `sampler` in a train config (every sampler whose samples train), in table order."""
    return tuple(name for name, s in SAMPLERS.items() if s.trains)


def group_samplers() -> tuple[str, ...]:
    """The samplers whose samples form groups (MHGPO, GRPO)."""
    return tuple(name for name, s in SAMPLERS.items() if s.groups)
