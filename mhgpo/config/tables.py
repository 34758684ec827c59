"""The extension axes besides the samplers (`mhgpo/config/samplers.py`), each a table: the algorithms, the advantage
schemes, the policy losses and the generation engines. The config checks its keys against them and the layers above
read their entries; an entry names its function lazily (``"module:function"``, imported where it is used), so a new
algorithm, scheme, loss or engine is one entry here plus its function, and nothing else changes.

| table | config key | entry | its function |
|---|---|---|---|
| :data:`ALGORITHMS` | `algo` | critic or not, single agent or team, default sampler, loss, label | — |
| :data:`ADVANTAGE_SCHEMES` | `advantage` | the groups advantages are normalised in | the samples' group keys |
| :data:`POLICY_LOSSES` | `optim.loss` (null: the algorithm's) | the policy objective | the loss of a micro-batch |
| :data:`ENGINES` | `generation.engine` | who samples the rollouts | a builder of the generator |

Tests register unseen entries in these dicts (and remove them afterwards) to show that one entry is enough.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mhgpo.config.samplers import SAMPLERS, sampler


def load_function(ref: str) -> Callable[..., Any]:
    """The function an entry names as ``"package.module:function"``, imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------ algorithms


@dataclass(frozen=True)
class Algorithm:
    name: str
    label: str  # how reports, the CLI and the benchmarks name it
    critic: bool = False  # actor-critic: advantages from a learned value model's GAE (mhgpo/rl/critic.py)
    single_agent: bool = False  # an "LLM + RL" baseline: the model alone (system=llm)
    sampler: str = "fof"  # the default sampler
    team_sampler: str | None = None  # the default sampler on the built-in team (system=mas), if another
    loss: str = "clipped"  # the default policy loss (POLICY_LOSSES)
    label_sampler: bool = False  # the label names the sampler too (MHGPO-RR)

    def default_sampler(self, system: str) -> str:
        return self.team_sampler if self.team_sampler and system == "mas" else self.sampler


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("mhgpo", "MHGPO", team_sampler="rr", label_sampler=True),
        Algorithm("grpo", "GRPO", single_agent=True),
        Algorithm("mappo", "MAPPO", critic=True, sampler="chains"),
        Algorithm("ppo", "PPO", critic=True, single_agent=True, sampler="chains"),
    )
}


def algorithm(name: str) -> Algorithm:
    """The table's entry for `name` (ValueError naming the valid ones otherwise)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def algo_label(algo: str, sampler_name: str | None = None) -> str:
    """The display name of an algorithm run with a sampler: ``MHGPO-RR``, ``MHGPO-FoF(os)``, ``GRPO``, ``MAPPO``;
    one spelling for the CLI, the reports, the exported model cards and the benchmarks."""
    entry = ALGORITHMS.get(algo)
    if entry is None:
        return str(algo).upper()
    if entry.label_sampler and sampler_name in SAMPLERS and sampler(sampler_name).label:
        return f"{entry.label}-{sampler(sampler_name).label}"
    return entry.label


# --------------------------------------------------------------------------------------- advantage schemes


@dataclass(frozen=True)
class AdvantageScheme:
    """The groups advantages are normalised in. ``keys``: None keeps the sampler's group ids (MHGPO's heterogeneous
    groups); else ``"module:function"`` of ``keys(agents (N,), prompt_keys (N,), visits (N,)) -> (N, k)`` integer
    keys, samples with equal keys forming one group (a group of one is not trained). ``scale``: divide by the
    group's std (paper Eq. adv); without it ``A = R - mean_g`` (Dr. GRPO), so that a group whose rewards differ by
    0.05 F1 pushes 20× less than one whose rewards differ by 1."""

    name: str
    keys: str | None
    summary: str
    scale: bool = True


ADVANTAGE_SCHEMES: dict[str, AdvantageScheme] = {
    s.name: s
    for s in (
        AdvantageScheme("mhgpo", None, "the sampler's groups, heterogeneous downstream of the fork (paper Eq. adv)"),
        AdvantageScheme(
            "mhgpo_mean", None, "the sampler's groups, A = R - mean_g without the std (Dr. GRPO)", scale=False
        ),
        AdvantageScheme("agent", "mhgpo.rl.advantages:agent_keys", "one group per agent across the step (Dr.MAS)"),
        AdvantageScheme(
            "prompt_agent_turn",
            "mhgpo.rl.advantages:prompt_agent_turn_keys",
            "the same prompt, agent and visit (AT-GRPO); singletons untrained",
        ),
    )
}


# ----------------------------------------------------------------------------------------------- losses


@dataclass(frozen=True)
class PolicyLoss:
    """A policy objective: ``function(logp, old_logp, ref_logp, advantages, weights, mask, clip_eps, kl_beta)``
    returns the micro-batch's loss (already weighted by the step-wide token weights) and its statistics
    (``n_tokens`` and any of ``kl``, ``clip_fraction``, ``ratio``); with `optim.engine_is_cap` it is also given
    ``engine_logp=`` and ``is_cap=`` (the truncated importance weight); see `mhgpo.rl.losses.mhgpo_policy_loss`.
    ``engine``: the objective needs the sampler's log-probs (``engine_logp=``) whatever the cap: a separate engine
    and `optim.old_logprobs=trainer`; ``stats``: the statistics it adds, averaged over the update's tokens."""

    name: str
    function: str
    summary: str
    engine: bool = False
    stats: tuple[str, ...] = ()


POLICY_LOSSES: dict[str, PolicyLoss] = {
    loss.name: loss
    for loss in (
        PolicyLoss(
            "clipped",
            "mhgpo.rl.losses:mhgpo_policy_loss",
            "min(r·A, clip(r, 1-ε, 1+ε)·A) - β·KL_k3 per token (paper Eq. target)",
        ),
        PolicyLoss(
            "icepop",
            "mhgpo.rl.losses:icepop_policy_loss",
            "the clipped objective, a token's policy-gradient term dropped when its trainer / sampler probability "
            "ratio leaves [0.5, 5] (IcePop)",
            engine=True,
            stats=("is_masked",),
        ),
    )
}


# ----------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    """Who samples the agents' outputs. ``build``: ``"module:function"`` of the builder, called with keyword
    arguments (``model``, ``loaded``, ``spec``, ``generation``, ``precision``, ``seed``, ``batch_size``,
    ``select``, ``lora_rank``, ``adapters``, ``scratch``, ``ranks``; each builder takes those it needs and ``**_``).
    ``separate``: it holds a copy of the weights of its own, built on the initial weights before the policy wraps
    them and handed the new weights after every update (`mhgpo.rl.engine_sync`), one per rank under several; else it
    samples from the training model itself. ``require``: ``"module:function"`` that raises a one-line error when it
    is not installed. ``full_weights``: full fine-tuning's weights can be handed to it (else training needs LoRA).
    ``remote``: it samples in other processes (servers), so that rollouts may overlap the update
    (`rollout.max_staleness`)."""

    name: str
    build: str
    separate: bool = False
    require: str | None = None
    full_weights: bool = True
    remote: bool = False


ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("hf", "mhgpo.model.generation:build_hf_generator"),
        Engine(
            "vllm",
            "mhgpo.model.vllm_engine:build_vllm_generator",
            separate=True,
            require="mhgpo.model.vllm_engine:require_vllm",
        ),
        Engine(
            "vllm_server",
            "mhgpo.model.vllm_server:build_server_generator",
            separate=True,
            remote=True,
        ),
    )
}
