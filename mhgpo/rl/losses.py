"""The MHGPO policy loss, paper Eq. (target), as pure functions.

The objective averages tokens within a sample, samples within an agent, and agents:
``J = (1/n) sum_k (1/G_k) sum_i (1/|o_i|) sum_t [min(r A, clip(r, 1-eps, 1+eps) A) - beta KL_k3]``.
:func:`token_weights` folds the three means into one weight per sample,
``w_i = 1 / (n_agents_present * N_agent(i) * |o_i|)``, computed once over the whole step, so that the loss of
a micro-batch is its partial sum and the step loss is the sum over micro-batches, whatever the cut.
`mhgpo.rl.reference.mhgpo_policy_loss_reference` is the formula written as loops, for the tests.

The same objective with per-token advantages is the actor loss of MAPPO / PPO; their critic is trained with
the clipped value loss :func:`value_loss` (its loops: `mhgpo.rl.reference.value_loss_reference`), under the same
weights.

When a separate engine sampled the outputs (``generation.engine=vllm``), :func:`engine_is_weight` is the truncated
importance weight of each token on the engine / trainer mismatch (`optim.engine_is_cap`), which multiplies the
clipped surrogate term.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
import torch
from torch import Tensor


def _as_numpy(x: Sequence | np.ndarray | Tensor) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def token_weights(
    agent_of_sample: Sequence[Hashable] | np.ndarray | Tensor,
    lengths: Sequence[int] | np.ndarray | Tensor,
    trained: Sequence[bool] | np.ndarray | Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token weight of each sample of one optimisation step, the three means of paper Eq. (target).

    ``w_i = 1 / (n_agents_present * N_agent(i) * |o_i|)`` where ``n_agents_present`` is the number of distinct
    agents among the trained samples of the step and ``N_agent(i)`` the number of trained samples of sample
    i's agent (the paper's ``n`` and ``G_k``). Untrained samples (``trained[i]`` False, e.g. group id -1) get
    weight 0. ``sum_i w_i * |o_i| == 1`` over the trained samples with at least one token.

    Args:
        agent_of_sample: (B,) the agent (name or int) of every sample in the WHOLE step.
        lengths: (B,) the number of output tokens ``|o_i|`` (the mask's row sums).
        trained: (B,) bool, default all True.

    Returns: (B,) tensor of weights.

    Departures from the paper: ``n`` counts the agents present in the step rather than all agents of the
    system (an agent with no trained sample in the step has nothing to average). A trained sample with zero
    output tokens counts in ``N_agent`` and gets weight 0 (its empty token mean is taken as 0).
    """
    agents = _as_numpy(agent_of_sample)
    lens = _as_numpy(lengths).astype(np.int64)
    mask = np.ones(lens.shape, dtype=bool) if trained is None else _as_numpy(trained).astype(bool)
    if agents.ndim != 1 or lens.shape != agents.shape or mask.shape != agents.shape:
        raise ValueError(
            f"agent_of_sample, lengths and trained must have shape (B,), got {agents.shape}, {lens.shape}, {mask.shape}"
        )
    if np.any(lens < 0):
        raise ValueError("lengths must be >= 0")
    weights = np.zeros(lens.shape, dtype=np.float64)  # (B,)
    if not mask.any():
        return torch.as_tensor(weights, dtype=dtype)
    _, inv, per_agent = np.unique(agents[mask], return_inverse=True, return_counts=True)  # (M,) (n,)
    inv = inv.reshape(-1)  # (M,)
    n_agents = per_agent.shape[0]
    denom = n_agents * per_agent[inv] * lens[mask]  # (M,)
    weights[mask] = np.where(lens[mask] > 0, 1.0 / np.maximum(denom, 1), 0.0)  # (M,)
    return torch.as_tensor(weights, dtype=dtype)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of ``KL(pi_theta || pi_ref)`` (Schulman, "Approximating KL divergence").

    ``exp(ref - logp) - (ref - logp) - 1``, computed as ``expm1(d) - d`` for accuracy near 0; ``>= 0``, and 0
    where the two log-probs are equal. Same shape as the inputs. No clamping of ``d``.
    """
    d = ref_logp - logp  # (B, T)
    return torch.expm1(d) - d  # (B, T)


def engine_is_weight(old_logp: Tensor, engine_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """The truncated importance weight of each token on the engine / trainer mismatch (TIS, token level, as verl's
    ``rollout_is=token`` with ``rollout_is_threshold`` and TRL's ``vllm_importance_sampling_correction`` with its
    cap): ``rho = min(exp(old_logp - engine_logp), cap)``, where ``old_logp`` is the trainer's log-prob of a token
    before the update and ``engine_logp`` the engine's, which sampled it. Same shape as the inputs; no gradient
    (both are constants). Returns ``(rho, clipped)``, ``clipped`` True where the cap bit."""
    log_rho = (old_logp - engine_logp).detach()  # (B, T)
    clipped = log_rho > math.log(cap)  # (B, T)
    return torch.exp(torch.clamp(log_rho, max=math.log(cap))), clipped  # (B, T) (B, T)


def mhgpo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    weights: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.001,
    engine_logp: Tensor | None = None,
    is_cap: float | None = None,
    pg_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """MHGPO clipped surrogate with k3 KL penalty, paper Eq. (target), negated for minimisation.

    ``loss = -sum_{i,t} mask * w_i * [rho * min(r A_i, clip(r, 1-eps, 1+eps) A_i) - beta * KL_k3]`` with
    ``r = exp(logp - old_logp)`` and ``rho = 1``, or, given ``engine_logp`` and ``is_cap``, the truncated importance
    weight :func:`engine_is_weight` (the KL term is not weighted, as in verl and TRL). With the step-wide
    ``weights`` of :func:`token_weights` this is the micro-batch's share of the step loss: summing it over any cut
    of the step into micro-batches gives the same number (and gradient).

    Args:
        logp: (B, T) log-probs of the output tokens under the current policy (requires grad).
        old_logp: (B, T) log-probs under the sampling policy.
        ref_logp: (B, T) log-probs under the reference policy, or None (then ``beta`` must be 0).
        advantages: (B,) one advantage per sample, broadcast to its tokens (MHGPO, GRPO), or (B, T) one per
            token (MAPPO / PPO: GAE, :func:`mhgpo.rl.advantages.gae`).
        weights: (B,) per-token weight of each sample (:func:`token_weights`).
        mask: (B, T) 1/True on output tokens, 0/False on prompt and padding.
        engine_logp: (B, T) log-probs under the engine that sampled the outputs, or None (no importance weight).
        is_cap: the importance weight's cap (given with ``engine_logp``, at least 1).
        pg_mask: (B, T) the tokens whose policy-gradient term counts (None: every token of ``mask``); the KL term
            counts on every token of ``mask`` (:func:`icepop_policy_loss` masks the tokens it drops).

    Returns ``(loss, stats)``: ``loss`` a scalar tensor; ``stats`` detached floats, unweighted means over the
    masked tokens of this micro-batch: ``clip_fraction`` (tokens where the clipped term is strictly smaller,
    so clipping zeroes the gradient), ``ratio`` (mean r), ``kl`` (mean k3, only when ``ref_logp`` is given),
    ``is_weight`` and ``is_clipped`` (mean rho and the share of tokens whose weight the cap bit, only with
    ``engine_logp``), and ``n_tokens`` (to combine micro-batch stats).

    Departures from the paper: none in the objective; the per-token weights express its three means.
    Masked positions never reach ``exp`` (their log-ratio is set to 0), so padding may hold any value.
    """
    if logp.ndim != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(
            f"logp, old_logp and mask must have shape (B, T), got {logp.shape}, {old_logp.shape}, {mask.shape}"
        )
    if ref_logp is not None and ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp must have shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape) or weights.shape != logp.shape[:1]:
        raise ValueError(
            f"advantages must have shape ({logp.shape[0]},) or {tuple(logp.shape)} and weights ({logp.shape[0]},), "
            f"got {tuple(advantages.shape)}, {tuple(weights.shape)}"
        )
    if beta != 0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (the reference policy's log-probs)")
    if (engine_logp is None) != (is_cap is None):
        raise ValueError("engine_logp and is_cap go together (the importance weight needs both)")
    if engine_logp is not None and (engine_logp.shape != logp.shape or is_cap < 1):
        raise ValueError(
            f"engine_logp must have shape {tuple(logp.shape)} and is_cap be >= 1, got "
            f"{tuple(engine_logp.shape)} and {is_cap}"
        )
    if pg_mask is not None and pg_mask.shape != logp.shape:
        raise ValueError(f"pg_mask must have shape {tuple(logp.shape)}, got {tuple(pg_mask.shape)}")
    mask = mask.bool()  # (B, T)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    log_ratio = torch.where(mask, logp - old_logp, zero)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.to(logp.dtype)  # (B, T), or (B,) broadcast to every token:
    adv = adv[:, None] if adv.ndim == 1 else torch.where(mask, adv, zero)  # (B, 1) or (B, T)
    surr = ratio * adv  # (B, T)
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv  # (B, T)
    objective = torch.minimum(surr, surr_clipped)  # (B, T)
    rho = clipped = None
    if engine_logp is not None:
        rho, clipped = engine_is_weight(
            torch.where(mask, old_logp, zero), torch.where(mask, engine_logp.to(logp.dtype), zero), is_cap
        )  # (B, T) (B, T)
        objective = rho * objective  # (B, T)
    if pg_mask is not None:
        objective = torch.where(pg_mask.bool(), objective, zero)  # (B, T)
    kl = None
    if ref_logp is not None:
        kl = k3_kl(torch.where(mask, logp, zero), torch.where(mask, ref_logp, zero))  # (B, T)
        if beta != 0:
            objective = objective - beta * kl  # (B, T)
    per_token = torch.where(mask, objective, zero) * weights.to(logp.dtype)[:, None]  # (B, T)
    loss = -per_token.sum()  # ()

    with torch.no_grad():
        n_tokens = int(mask.sum())
        denom = max(n_tokens, 1)
        stats = {
            "clip_fraction": float(((surr_clipped < surr) & mask).sum()) / denom,
            "ratio": float(torch.where(mask, ratio, zero).sum()) / denom,
            "n_tokens": float(n_tokens),
        }
        if kl is not None:
            stats["kl"] = float(torch.where(mask, kl, zero).sum()) / denom
        if rho is not None:
            stats["is_weight"] = float(torch.where(mask, rho, zero).sum()) / denom
            stats["is_clipped"] = float((clipped & mask).sum()) / denom
    return loss, stats


ICEPOP_BAND = (0.5, 5.0)  # IcePop's band of the trainer / sampler probability ratio: tokens outside it are masked


def icepop_mask(old_logp: Tensor, engine_logp: Tensor, band: tuple[float, float] = ICEPOP_BAND) -> Tensor:
    """IcePop's token mask: True where the trainer / sampler probability ratio ``k = exp(old_logp - engine_logp)``
    lies in ``band`` (both ends kept), False where the two engines disagree too much (the token is not trained).
    ``old_logp``: the trainer's log-prob before the update; ``engine_logp``: the sampler's. Same shape, bool."""
    log_k = (old_logp - engine_logp).detach()  # (B, T)
    return (log_k >= math.log(band[0])) & (log_k <= math.log(band[1]))  # (B, T)


def icepop_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    weights: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.001,
    engine_logp: Tensor | None = None,
    is_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The MHGPO objective (:func:`mhgpo_policy_loss`) with IcePop's mask on the sampler / trainer mismatch: a
    token whose ratio ``exp(old_logp - engine_logp)`` (trainer before the update / sampler) leaves
    :data:`ICEPOP_BAND` contributes no policy-gradient term (its KL term stays); the others are trained as by the
    clipped objective (with ``is_cap``, also weighted by the truncated importance weight). ``engine_logp`` is
    required: (B, T) the sampler's log-probs. Its stats add ``is_masked``, the share of the micro-batch's tokens
    the mask dropped."""
    if engine_logp is None:
        raise ValueError("icepop needs engine_logp (the sampler's log-probs)")
    if engine_logp.shape != logp.shape or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise ValueError(f"engine_logp, old_logp and mask must have shape {tuple(logp.shape)}")
    keep = icepop_mask(old_logp, engine_logp.to(old_logp.dtype))  # (B, T)
    extra = {"engine_logp": engine_logp, "is_cap": is_cap} if is_cap is not None else {}
    loss, stats = mhgpo_policy_loss(
        logp, old_logp, ref_logp, advantages, weights, mask, clip_eps, beta, pg_mask=keep, **extra
    )
    m = mask.bool()  # (B, T)
    stats["is_masked"] = float((m & ~keep).sum()) / max(int(m.sum()), 1)
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    weights: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss of PPO (the critic's loss in MAPPO / PPO; the paper's §2 critic ``V_phi``).

    ``loss = sum_{i,t} mask * w_i * 0.5 * max((V - G)^2, (V_clip - G)^2)`` with
    ``V_clip = V_old + clip(V - V_old, -eps, eps)``: the new value may not move further than ``eps`` from the
    rollout-time value ``V_old`` to lower the loss (Schulman et al., PPO2 / MAPPO's value clipping).
    With the step-wide :func:`token_weights` this is the same token / sample / agent mean as the policy loss,
    and summing it over any cut of the step into micro-batches gives the step loss.

    Args:
        values: (B, T) the critic's current values at the output positions (requires grad).
        old_values: (B, T) the values at rollout time (before this step's critic update).
        returns: (B, T) the value targets ``G = A_GAE + V_old`` (:func:`mhgpo.rl.advantages.gae`).
        weights: (B,) per-token weight of each sample.
        mask: (B, T) True on output tokens.

    Returns ``(loss, stats)``; stats are unweighted means over the masked tokens: ``value_clip_fraction``
    (tokens where the clipped term is the larger, so the gradient is zero), ``value_mean``, ``n_tokens``.

    Departures from the paper: the paper names a critic but no value loss; this is the usual clipped one.
    """
    if values.ndim != 2 or old_values.shape != values.shape or returns.shape != values.shape:
        raise ValueError(
            f"values, old_values and returns must have shape (B, T), got {tuple(values.shape)}, "
            f"{tuple(old_values.shape)}, {tuple(returns.shape)}"
        )
    if mask.shape != values.shape or weights.shape != values.shape[:1]:
        raise ValueError(
            f"mask must have shape {tuple(values.shape)} and weights ({values.shape[0]},), got "
            f"{tuple(mask.shape)}, {tuple(weights.shape)}"
        )
    mask = mask.bool()  # (B, T)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)  # (B, T)
    v_old = torch.where(mask, old_values.to(values.dtype), zero)  # (B, T)
    g = torch.where(mask, returns.to(values.dtype), zero)  # (B, T)
    v_clipped = v_old + torch.clamp(v - v_old, -clip_eps, clip_eps)  # (B, T)
    unclipped = (v - g) ** 2  # (B, T)
    clipped = (v_clipped - g) ** 2  # (B, T)
    per_token = 0.5 * torch.maximum(unclipped, clipped)  # (B, T)
    loss = (torch.where(mask, per_token, zero) * weights.to(values.dtype)[:, None]).sum()  # ()
    with torch.no_grad():
        n_tokens = int(mask.sum())
        denom = max(n_tokens, 1)
        stats = {
            "value_clip_fraction": float(((clipped > unclipped) & mask).sum()) / denom,
            "value_mean": float(v.sum()) / denom,
            "n_tokens": float(n_tokens),
        }
    return loss, stats
