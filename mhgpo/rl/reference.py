"""The paper's equations as plain loops: slow, obviously correct versions of the vectorised functions, which the
tests compare them with (the same inputs, the same outputs to floating-point precision).

| reference | fast version | paper |
|---|---|---|
| :func:`propagate_rewards_reference` | `mhgpo.rl.advantages.propagate_rewards` | Eq. (aggr): backward propagation |
| :func:`group_advantages_reference` | `mhgpo.rl.advantages.group_advantages` | Eq. (adv): group normalisation |
| :func:`drop_zero_variance_reference` | `mhgpo.rl.advantages.drop_zero_variance` | (zero-variance groups) |
| :func:`scheme_groups_reference` | `mhgpo.rl.advantages.scheme_groups` | (the peers' advantage groups) |
| :func:`gae_reference` | `mhgpo.rl.advantages.gae` | GAE of the MAPPO / PPO baselines |
| :func:`mhgpo_policy_loss_reference` | `mhgpo.rl.losses.mhgpo_policy_loss` | Eq. (target): the clipped objective |
| :func:`value_loss_reference` | `mhgpo.rl.losses.value_loss` | the critic's clipped value loss |
| :func:`output_logprobs_reference` | `mhgpo.model.logprobs.output_logprobs` | log π of each output token |
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mhgpo.model.logprobs import check_pairs
from mhgpo.model.precision import module_device
from mhgpo.rl.advantages import check_groups, check_leaf_values, check_tree


def propagate_rewards_reference(
    parents: np.ndarray,
    terminal: np.ndarray,
    aggr: str = "mean",
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Loop version of :func:`propagate_rewards` (same contract, same use of ``rng``), for the tests."""
    parents = np.asarray(parents)
    terminal = np.asarray(terminal, dtype=np.float64)
    check_tree(parents, terminal, aggr, rng)
    n = parents.shape[0]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        if parents[i] >= 0:
            children[int(parents[i])].append(i)  # appended in increasing index
    check_leaf_values(terminal, np.array([not c for c in children], dtype=bool))
    internal = [k for k in range(n) if children[k]]
    u = rng.random(len(internal)) if aggr == "rand" else None
    pick = {
        k: (min(int(u[j] * len(children[k])), len(children[k]) - 1) if u is not None else 0)
        for j, k in enumerate(internal)
    }

    shared = [float("nan")] * n
    for k in reversed(range(n)):  # children have larger indices, so they are done first
        if not children[k]:
            shared[k] = float(terminal[k])
            continue
        values = [shared[j] for j in children[k]]
        if aggr == "mean":
            shared[k] = sum(values) / len(values)
        elif aggr == "max":
            shared[k] = max(values)
        elif aggr == "min":
            shared[k] = min(values)
        else:
            shared[k] = values[pick[k]]
    return np.array(shared, dtype=np.float64)


def group_advantages_reference(
    rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6, scale: bool = True
) -> tuple[np.ndarray, dict]:
    """Loop version of :func:`group_advantages`, for the tests."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    check_groups(rewards, group_ids)
    adv = np.zeros_like(rewards)
    stats = {"n_groups": 0, "n_zero_variance_groups": 0, "n_untrained": int(np.sum(group_ids == -1))}
    for g in sorted({int(x) for x in group_ids if x >= 0}):
        members = [i for i in range(rewards.shape[0]) if group_ids[i] == g]
        values = [float(rewards[i]) for i in members]
        if len(values) == 1:
            raise ValueError(f"group(s) of size 1 cannot be normalised: ids [{g}]")
        stats["n_groups"] += 1
        if max(values) == min(values):
            stats["n_zero_variance_groups"] += 1
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        for i, v in zip(members, values):
            adv[i] = (v - mean) / (std + eps) if scale else v - mean
    return adv, stats


def drop_zero_variance_reference(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Loop version of :func:`drop_zero_variance`, for the tests."""
    out = np.asarray(group_ids).copy()
    dropped = 0
    for g in sorted({int(x) for x in out if x >= 0}):
        members = [i for i in range(out.shape[0]) if group_ids[i] == g]
        if len({float(rewards[i]) for i in members}) == 1:
            dropped += 1
            for i in members:
                out[i] = -1
    return out, dropped


def gae_reference(
    rewards: list[list[float]], values: list[list[float]], gamma: float = 1.0, lam: float = 0.95
) -> tuple[list[list[float]], list[list[float]]]:
    """Loop version of :func:`gae` over ragged per-output lists, straight from the sum's definition, for the tests."""
    advantages, returns = [], []
    for r, v in zip(rewards, values):
        n = len(r)
        delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
        a = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
        advantages.append(a)
        returns.append([a[t] + v[t] for t in range(n)])
    return advantages, returns


def scheme_groups_reference(
    scheme: str, group_ids: Sequence[int], agents: Sequence[str], prompt_keys: Sequence, visits: Sequence[int]
) -> tuple[list[int], int]:
    """Loop version of :func:`scheme_groups`, for the tests."""
    if scheme == "mhgpo":
        return list(group_ids), 0
    key_of = {"agent": lambda i: (agents[i],), "prompt_agent_turn": lambda i: (prompt_keys[i], agents[i], visits[i])}
    if scheme not in key_of:
        raise ValueError(f"unknown advantage scheme {scheme!r}")
    members: dict[tuple, list[int]] = {}
    for i, g in enumerate(group_ids):
        if g >= 0:
            members.setdefault(key_of[scheme](i), []).append(i)
    out, dropped, next_id = [-1] * len(group_ids), 0, 0
    for key in sorted(members, key=lambda k: members[k][0]):
        if len(members[key]) < 2:
            dropped += len(members[key])
            continue
        for i in members[key]:
            out[i] = next_id
        next_id += 1
    return out, dropped


def mhgpo_policy_loss_reference(
    logp: Sequence[Tensor],
    old_logp: Sequence[Tensor],
    ref_logp: Sequence[Tensor] | None,
    advantages: Sequence[float] | Sequence[Tensor],
    agent_of_sample: Sequence[Hashable],
    clip_eps: float = 0.2,
    beta: float = 0.001,
    engine_logp: Sequence[Tensor] | None = None,
    is_cap: float | None = None,
) -> Tensor:
    """Paper Eq. (target) negated, written as loops over per-sample lists, for the tests.

    ``advantages[i]`` is a float (one per sample) or a 1-D tensor (one per output token of sample i).

    ``-(1/n) sum_k (1/G_k) sum_{i in k} (1/|o_i|) sum_t [rho min(r A, clip(r) A) - beta KL_k3]`` over the given
    samples (pass only the trained ones), ``rho = min(exp(old - engine), cap)`` given ``engine_logp`` and
    ``is_cap``, else 1. ``logp[i]`` etc. are 1-D tensors of sample i's output tokens. The KL and the importance
    weight are written out here (not `mhgpo.rl.losses.k3_kl`, `engine_is_weight`) so that the test checks them too.
    """
    samples_of: dict[Hashable, list[int]] = {}
    for i, agent in enumerate(agent_of_sample):
        samples_of.setdefault(agent, []).append(i)
    n = len(samples_of)
    total = torch.zeros((), dtype=torch.float64)
    for samples in samples_of.values():
        agent_sum = torch.zeros((), dtype=torch.float64)
        for i in samples:
            length = len(logp[i])
            if length == 0:
                continue
            sample_sum = torch.zeros((), dtype=torch.float64)
            for t in range(length):
                r = torch.exp(logp[i][t] - old_logp[i][t])
                a_i = advantages[i]
                per_token = isinstance(a_i, (list, tuple)) or (isinstance(a_i, Tensor) and a_i.ndim == 1)
                a = float(a_i[t]) if per_token else float(a_i)
                term = torch.minimum(r * a, torch.clamp(r, 1 - clip_eps, 1 + clip_eps) * a)
                if engine_logp is not None:
                    term = term * min(math.exp(float(old_logp[i][t]) - float(engine_logp[i][t])), is_cap)
                if ref_logp is not None:
                    d = ref_logp[i][t] - logp[i][t]
                    term = term - beta * (torch.exp(d) - d - 1)
                sample_sum = sample_sum + term
            agent_sum = agent_sum + sample_sum / length
        total = total + agent_sum / len(samples)
    return -total / n


def value_loss_reference(
    values: Sequence[Tensor],
    old_values: Sequence[Tensor],
    returns: Sequence[Tensor],
    agent_of_sample: Sequence[Hashable],
    clip_eps: float = 0.2,
) -> Tensor:
    """:func:`value_loss` written as loops over per-sample 1-D tensors (token mean, sample mean per agent, mean
    over agents), for the tests."""
    samples_of: dict[Hashable, list[int]] = {}
    for i, agent in enumerate(agent_of_sample):
        samples_of.setdefault(agent, []).append(i)
    total = torch.zeros((), dtype=torch.float64)
    for samples in samples_of.values():
        agent_sum = torch.zeros((), dtype=torch.float64)
        for i in samples:
            length = len(values[i])
            if length == 0:
                continue
            sample_sum = torch.zeros((), dtype=torch.float64)
            for t in range(length):
                v, v_old, g = values[i][t], float(old_values[i][t]), float(returns[i][t])
                delta = min(max(v - v_old, -clip_eps), clip_eps)  # clip(V - V_old) as a tensor op on v
                v_clip = v_old + delta
                sample_sum = sample_sum + 0.5 * max((v - g) ** 2, (v_clip - g) ** 2)
            agent_sum = agent_sum + sample_sum / length
        total = total + agent_sum / len(samples)
    return total / len(samples_of)


def output_logprobs_reference(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`output_logprobs`, computed one sample at a time with a full forward pass and
    a full log-softmax over every position. Slow; for tests."""
    check_pairs(prompts, outputs, temperature)
    device = module_device(model)
    batch = len(prompts)
    t_out = max((len(o) for o in outputs), default=0)
    logp = torch.zeros((batch, t_out), dtype=torch.float32, device=device)  # (B, T_out)
    mask = torch.zeros((batch, t_out), dtype=torch.bool, device=device)  # (B, T_out)
    for row, (prompt, out) in enumerate(zip(prompts, outputs)):
        if not out:
            continue
        ids = torch.tensor([list(prompt) + list(out)], dtype=torch.long, device=device)  # (1, L)
        logits = model(input_ids=ids).logits.float()  # (1, L, V)
        all_logp = torch.log_softmax(logits / temperature, dim=-1)[0]  # (L, V)
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(out), device=device)  # (T,)
        targets = torch.tensor(out, dtype=torch.long, device=device)  # (T,)
        logp[row, : len(out)] = all_logp[positions, targets]  # (T,)
        mask[row, : len(out)] = True
    return logp, mask


def output_entropy_reference(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float = 1.0,
) -> torch.Tensor:
    """The entropy term of :func:`mhgpo.model.logprobs.output_logprobs_entropy`, one sample at a time from a full
    forward pass: ``-sum_v p_v log p_v`` of ``softmax(logits / T)`` at each output position, (B, T_out), 0 past a
    sample's output. Slow; for tests."""
    check_pairs(prompts, outputs, temperature)
    t_out = max((len(o) for o in outputs), default=0)
    entropy = torch.zeros((len(prompts), t_out), dtype=torch.float32, device=module_device(model))  # (B, T_out)
    for row, (prompt, out) in enumerate(zip(prompts, outputs)):
        if not out:
            continue
        ids = torch.tensor([list(prompt) + list(out)], dtype=torch.long, device=entropy.device)  # (1, L)
        logits = model(input_ids=ids).logits.float()[0, len(prompt) - 1 : len(prompt) - 1 + len(out)]  # (T, V)
        p = torch.softmax(logits / temperature, dim=-1)  # (T, V)
        entropy[row, : len(out)] = -(p * torch.log(p)).nansum(-1)  # (T,); 0 log 0 = 0
    return entropy
