"""The rollout samplers as one table: where each forks, whether it over-samples, how its samples are grouped, and
which algorithms train with it. The config checks `sampler` against it and the rollout engine (`mhgpo.rl.rollout`)
reads its entry; a new sampler is one entry here (and its test).

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

FORKS = ("none", "chains", "every", "first", "drawn")


@dataclass(frozen=True)
class Sampler:
    name: str
    forks: str  # none | chains (G chains, no fork) | every (one chain per agent) | first | drawn (from rr_probs)
    oversample_terminal: bool = False  # the terminal agent samples G outputs per branch (its own group)
    fork_samples_only: bool = False  # only the G samples at the fork point train (IS: homogeneous groups)
    regroup_singletons: bool = False  # prefix calls of one sample are pooled across the batch (RR)
    algos: tuple[str, ...] = ()  # the algorithms that train with it (none: evaluation only)

    @property
    def groups(self) -> bool:
        """Whether its samples form groups (MHGPO, GRPO); `chains` gives each call an id of its own."""
        return self.forks not in ("none", "chains")


SAMPLERS: dict[str, Sampler] = {
    s.name: s
    for s in (
        Sampler("is", forks="every", fork_samples_only=True, algos=("mhgpo", "grpo")),
        Sampler("fof", forks="first", algos=("mhgpo", "grpo")),
        Sampler("rr", forks="drawn", regroup_singletons=True, algos=("mhgpo",)),
        Sampler("fof_os", forks="first", oversample_terminal=True, algos=("mhgpo",)),
        Sampler("chains", forks="chains", algos=("mappo", "ppo")),
        Sampler("none", forks="none"),
    )
}

TRAIN_SAMPLERS = tuple(name for name, s in SAMPLERS.items() if s.algos)  # `sampler` in a train config
GROUP_SAMPLERS = tuple(name for name, s in SAMPLERS.items() if s.groups)  # samplers that form groups


def sampler(name: str) -> Sampler:
    """The table's entry for `name` (ValueError naming the valid ones otherwise)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return SAMPLERS[name]
