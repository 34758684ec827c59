"""Rewards and advantages of MHGPO: backward reward propagation, composite rewards, group-relative
advantages and the regrouping of singleton samples; and, for the MAPPO / PPO baselines, GAE within an output.

All functions are pure: NumPy arrays in, NumPy arrays out, no state. Rollouts are trees stored as a parent
array: node ``i`` has parent ``parents[i]`` (``-1`` for a root) and nodes are numbered so that
``parents[i] < i``. A leaf is a node without children. Each vectorised function has a slow loop version (suffix
``_reference``) in `mhgpo/rl/reference.py` that the tests compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mhgpo.config.choices import AGGREGATORS
from mhgpo.config.tables import ADVANTAGE_SCHEMES, load_function


def check_tree(parents: np.ndarray, terminal: np.ndarray, aggr: str, rng: np.random.Generator | None) -> None:
    if parents.ndim != 1 or terminal.shape != parents.shape:
        raise ValueError(f"parents and terminal must both have shape (N,), got {parents.shape} and {terminal.shape}")
    if not np.issubdtype(parents.dtype, np.integer):
        raise ValueError(f"parents must hold integers, got dtype {parents.dtype}")
    idx = np.arange(parents.shape[0])
    if np.any(parents < -1) or np.any(parents >= idx):
        raise ValueError("parents must satisfy -1 <= parents[i] < i (roots are -1, parents come before children)")
    if aggr not in AGGREGATORS:
        raise ValueError(f"aggr must be one of {AGGREGATORS}, got {aggr!r}")
    if aggr == "rand" and rng is None:
        raise ValueError("aggr='rand' needs an rng (np.random.Generator) so that runs are reproducible")


def _child_counts(parents: np.ndarray) -> np.ndarray:
    n = parents.shape[0]
    return np.bincount(parents[parents >= 0], minlength=n)  # (N,) number of direct children


def check_leaf_values(terminal: np.ndarray, is_leaf: np.ndarray) -> None:
    if not np.all(np.isfinite(terminal[is_leaf])):
        raise ValueError("terminal rewards must be finite at every leaf")


def propagate_rewards(
    parents: np.ndarray,
    terminal: np.ndarray,
    aggr: str = "mean",
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Shared reward of every node of a rollout forest by backward propagation, paper Eq. (aggr).

    ``R_shared[leaf] = terminal[leaf]``; for a non-leaf ``R_shared[k] = Aggr({R_shared[j] : parents[j] == k})``
    over its DIRECT children, Aggr in {mean, max, min, rand}. ``terminal`` values at non-leaves are ignored
    (they may be NaN). Tool nodes are ordinary nodes: with one child they pass the reward through.

    ``rand`` draws exactly one ``rng.random(n_internal)`` (``n_internal`` = number of non-leaf nodes); the
    k-th non-leaf node in increasing node index picks its ``floor(u_k * c)``-th child, children sorted by node
    index (``c`` = its number of children). The reference consumes the rng the same way, so both agree given
    the same seed. No rng is used for the other aggregators.

    Vectorised: node depths by pointer jumping, then one pass per depth level from the deepest, aggregating
    each level into its parents with ``np.add.at`` / ``np.maximum.at`` / ``np.minimum.at``.

    Departures from the paper: the paper writes Aggr over the successor *agents*; here it is over the direct
    successor *nodes* of the tree, tool nodes included (a tool has one child and passes the reward through),
    which is the same thing for the paper's pipelines.
    """
    parents = np.asarray(parents)
    terminal = np.asarray(terminal, dtype=np.float64)
    check_tree(parents, terminal, aggr, rng)
    n = parents.shape[0]
    n_children = _child_counts(parents)  # (N,)
    is_leaf = n_children == 0  # (N,)
    check_leaf_values(terminal, is_leaf)
    if n == 0:
        return np.zeros(0, dtype=np.float64)

    # Depth of every node by pointer jumping: O(log depth) vectorised steps.
    depth = (parents >= 0).astype(np.int64)  # (N,) distance to `jump`
    jump = parents.copy()  # (N,) an ancestor of each node, -1 once the root is passed
    while np.any(jump >= 0):
        has = jump >= 0  # (N,)
        target = np.where(has, jump, 0)  # (N,) safe index
        depth = depth + np.where(has, depth[target], 0)  # (N,)
        jump = np.where(has, jump[target], -1)  # (N,)

    shared = np.where(is_leaf, terminal, np.nan)  # (N,)

    if aggr == "rand":
        internal = np.flatnonzero(~is_leaf)  # (I,) in increasing node index
        u = rng.random(internal.shape[0])  # (I,) one draw per internal node
        pick = np.minimum(np.floor(u * n_children[internal]).astype(np.int64), n_children[internal] - 1)  # (I,)
        non_root = np.flatnonzero(parents >= 0)  # (M,)
        by_parent = non_root[np.argsort(parents[non_root], kind="stable")]  # (M,) children grouped by parent
        first = np.concatenate([[0], np.cumsum(n_children)[:-1]])  # (N,) offset of each node's children
        chosen = np.full(n, -1, dtype=np.int64)  # (N,) the child whose reward a node takes
        chosen[internal] = by_parent[first[internal] + pick]  # (I,)

    init = {"mean": 0.0, "max": -np.inf, "min": np.inf, "rand": 0.0}[aggr]
    acc = np.full(n, init)  # (N,) running aggregate over the children processed so far
    for d in range(int(depth.max()), 0, -1):
        level = np.flatnonzero(depth == d)  # (L,) nodes at depth d; all their values are final
        par = parents[level]  # (L,)
        if aggr == "mean":
            np.add.at(acc, par, shared[level])
        elif aggr == "max":
            np.maximum.at(acc, par, shared[level])
        elif aggr == "min":
            np.minimum.at(acc, par, shared[level])
        done = np.unique(par)  # (P,) parents at depth d-1: every child of theirs is at depth d
        if aggr == "mean":
            shared[done] = acc[done] / n_children[done]  # (P,)
        elif aggr == "rand":
            shared[done] = shared[chosen[done]]  # (P,)
        else:
            shared[done] = acc[done]  # (P,)
    return shared


def aggregated(parents: np.ndarray, terminal: np.ndarray) -> np.ndarray:
    """(N,) bool: the nodes whose shared reward the aggregator decides, those whose leaves below hold different
    terminal rewards (their max and min differ). Every aggregator gives the other nodes the same reward."""
    return propagate_rewards(parents, terminal, "max") > propagate_rewards(parents, terminal, "min")


def total_rewards(shared: np.ndarray, penalties: np.ndarray, use_penalties: bool = True) -> np.ndarray:
    """Composite reward ``R = R_shared + R_spe`` of paper Section 3.1 (after Eq. aggr).

    ``penalties`` are the agent-specific rewards (0 where none applies). They are added after propagation
    and never propagate. ``use_penalties=False`` gives the final-only-reward ablation (``R = R_shared``).
    """
    shared = np.asarray(shared, dtype=np.float64)
    penalties = np.asarray(penalties, dtype=np.float64)
    if shared.shape != penalties.shape:
        raise ValueError(f"shared and penalties must have the same shape, got {shared.shape} and {penalties.shape}")
    return shared + penalties if use_penalties else shared.copy()


def check_groups(rewards: np.ndarray, group_ids: np.ndarray) -> None:
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both have shape (N,), got {rewards.shape} and {group_ids.shape}")
    if not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"group_ids must hold integers, got dtype {group_ids.dtype}")
    if np.any(group_ids < -1):
        raise ValueError("group ids must be >= 0, or -1 for a sample that is not trained")
    if not np.all(np.isfinite(rewards[group_ids >= 0])):
        raise ValueError("rewards of trained samples must be finite")


def group_advantages(
    rewards: np.ndarray, group_ids: np.ndarray, eps: float = 1e-6, scale: bool = True
) -> tuple[np.ndarray, dict]:
    """Group-relative advantage, paper Eq. (adv): ``A = (R - mean_g) / (std_g + eps)``; with ``scale=False``
    ``A = R - mean_g`` (Dr. GRPO's unscaled advantage: the push grows with the rewards' spread in the group).

    ``std_g`` is the unbiased sample standard deviation (``ddof=1``, as ``torch.std``) over the samples whose
    group id equals this sample's. Samples with group id -1 are not trained and get ``A = 0``. A group of size
    1 raises ``ValueError``: regroup or drop singletons first (:func:`regroup_singletons`).

    Returns ``(A (N,), stats)`` with ``stats = {"n_groups", "n_zero_variance_groups", "n_untrained"}``.

    Departures from the paper: ``eps`` in the denominator (the paper divides by std alone). A group whose
    rewards are all equal is a zero-variance group: its advantages are set to exactly 0 (the floating-point
    mean of equal values can differ from them by one rounding, which would otherwise leave ``A`` at
    ``~1e-10``) and it is counted.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    check_groups(rewards, group_ids)
    adv = np.zeros_like(rewards)  # (N,)
    trained = np.flatnonzero(group_ids >= 0)  # (M,)
    stats = {"n_groups": 0, "n_zero_variance_groups": 0, "n_untrained": int(rewards.shape[0] - trained.shape[0])}
    if trained.shape[0] == 0:
        return adv, stats
    r = rewards[trained]  # (M,)
    uniq, inv, size = np.unique(group_ids[trained], return_inverse=True, return_counts=True)  # (K,) (M,) (K,)
    inv = inv.reshape(-1)  # (M,)
    if np.any(size == 1):
        raise ValueError(f"group(s) of size 1 cannot be normalised: ids {uniq[size == 1][:10].tolist()}")
    mean = np.bincount(inv, weights=r) / size  # (K,)
    dev = r - mean[inv]  # (M,)
    std = np.sqrt(np.bincount(inv, weights=dev * dev) / (size - 1))  # (K,) unbiased
    r_max = np.full(uniq.shape[0], -np.inf)  # (K,)
    r_min = np.full(uniq.shape[0], np.inf)  # (K,)
    np.maximum.at(r_max, inv, r)
    np.minimum.at(r_min, inv, r)
    constant = r_max == r_min  # (K,) zero-variance groups
    adv[trained] = np.where(constant[inv], 0.0, dev / (std[inv] + eps) if scale else dev)  # (M,)
    stats["n_groups"] = int(uniq.shape[0])
    stats["n_zero_variance_groups"] = int(constant.sum())
    return adv, stats


def drop_zero_variance(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Untrain the groups whose rewards are all equal (DAPO's dynamic-sampling filter): they carry no gradient
    but would count in the loss's means. Returns ``(new_group_ids (N,), n_dropped_groups)``: -1 for the members
    of a zero-variance group, other ids unchanged. Not in the paper (a switch: ``filter_zero_variance``)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    group_ids = np.asarray(group_ids)
    check_groups(rewards, group_ids)
    out = group_ids.copy()
    trained = np.flatnonzero(group_ids >= 0)  # (M,)
    if trained.shape[0] == 0:
        return out, 0
    uniq, inv = np.unique(group_ids[trained], return_inverse=True)  # (K,) (M,)
    inv = inv.reshape(-1)
    r_max = np.full(uniq.shape[0], -np.inf)  # (K,)
    r_min = np.full(uniq.shape[0], np.inf)  # (K,)
    np.maximum.at(r_max, inv, rewards[trained])
    np.minimum.at(r_min, inv, rewards[trained])
    constant = r_max == r_min  # (K,)
    out[trained[constant[inv]]] = -1
    return out, int(constant.sum())


def regroup_singletons(
    group_ids: np.ndarray,
    pool_keys: Sequence[str] | np.ndarray,
    group_size: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int]:
    """Regroup samples whose group id occurs exactly once: the group reassignment of paper Algorithm 3 (Round-Robin).

    Singletons are pooled by ``pool_keys`` (one string per sample; only singletons' keys matter): each pool, in
    increasing sample index, is shuffled with one ``rng.permutation`` call, pools taken in sorted key order, and
    partitioned into groups of ``group_size``; each full group gets a fresh id, greater than every id in
    ``group_ids``. Singletons that cannot fill a group get -1 (not trained); their number is returned. Ids that
    occur more than once, and -1, are left alone. The trainer's keys (`rr_regroup`, see
    :func:`rr_pool_keys`):

    - ``fork`` (default): the role and the agent its question forked at. The paper's §3.2: a prefix rollout of
      agent j < i is grouped "with other samples in the same batch that also fork at i".
    - ``role``: the role alone, so prefix rollouts of one role are pooled across fork points.
    - ``all``: one pool, as Algorithm 3 reads (it does not look at roles or fork points); groups may mix roles.

    Returns ``(new_group_ids (N,), n_dropped)``.

    Departures from the paper: groups of ``group_size`` as in Algorithm 3, where §3.2 speaks of one group of
    ``floor(p_i * batch_size)``; new ids are ``max(group_ids) + 1 + i`` instead of ``i + |P_valid|``, which can
    collide with existing ids.
    """
    group_ids = np.asarray(group_ids)
    keys = np.asarray(pool_keys, dtype=object)
    if group_ids.ndim != 1 or keys.shape != group_ids.shape:
        raise ValueError(f"group_ids and pool_keys must both have shape (N,), got {group_ids.shape} and {keys.shape}")
    if not np.issubdtype(group_ids.dtype, np.integer):
        raise ValueError(f"group_ids must hold integers, got dtype {group_ids.dtype}")
    if np.any(group_ids < -1):
        raise ValueError("group ids must be >= 0, or -1 for a sample that is not trained")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (a group of one has no relative advantage), got {group_size}")
    out = group_ids.copy()
    if group_ids.shape[0] == 0:
        return out, 0
    ids, counts = np.unique(group_ids, return_counts=True)  # (K,) (K,)
    single_ids = ids[(counts == 1) & (ids >= 0)]  # (S,)
    singletons = np.flatnonzero(np.isin(group_ids, single_ids))  # (S,) sample indices, increasing
    pools = [singletons[keys[singletons] == key] for key in sorted(set(keys[singletons].tolist()))]
    next_id = int(group_ids.max()) + 1 if group_ids.max() >= 0 else 0
    dropped = 0
    for pool in pools:
        shuffled = pool[rng.permutation(pool.shape[0])]  # (P,)
        n_full = shuffled.shape[0] // group_size
        full = shuffled[: n_full * group_size]  # (n_full * G,)
        out[full] = next_id + np.arange(full.shape[0]) // group_size  # (n_full * G,)
        out[shuffled[n_full * group_size :]] = -1
        dropped += int(shuffled.shape[0] - full.shape[0])
        next_id += n_full
    return out, dropped


def rr_pool_keys(mode: str, roles: Sequence[str], fork_agents: Sequence[str | None]) -> list[str]:
    """The pool key of each sample for :func:`regroup_singletons`: ``mode`` is ``fork`` (role and the agent the
    sample's question forked at), ``role`` or ``all``."""
    if len(roles) != len(fork_agents):
        raise ValueError(f"{len(roles)} roles but {len(fork_agents)} fork agents")
    if mode == "fork":
        return [f"{role}@{fork}" for role, fork in zip(roles, fork_agents)]
    if mode == "role":
        return [str(role) for role in roles]
    if mode == "all":
        return [""] * len(roles)
    raise ValueError(f"unknown regrouping {mode!r}: expected fork, role or all")


# ------------------------------------------------------------------------------------- MAPPO / PPO: GAE


def _check_token_arrays(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray) -> None:
    if rewards.ndim != 2 or values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards, values and mask must have shape (B, T), got {rewards.shape}, {values.shape}, {mask.shape}"
        )
    lengths = mask.sum(axis=1)  # (B,)
    if np.any(mask != (np.arange(mask.shape[1])[None, :] < lengths[:, None])):
        raise ValueError("mask must be right-padded: True on each row's first |o_i| positions only")


def terminal_token_rewards(rewards: np.ndarray, lengths: np.ndarray, width: int | None = None) -> np.ndarray:
    """Per-token rewards of MAPPO / PPO: each sample's reward ``R_i`` at its last output token, 0 elsewhere.

    ``rewards`` (B,) are the agents' composite rewards (propagated shared reward + penalty, paper Eq. aggr);
    ``lengths`` (B,) the output lengths. Returns (B, T), ``T = width or max(lengths)``. A sample with no token
    has nowhere to put its reward (its row is all 0).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(lengths, dtype=np.int64)
    t = int(width if width is not None else (lengths.max() if lengths.size else 0))
    out = np.zeros((rewards.shape[0], t))  # (B, T)
    rows = np.flatnonzero(lengths > 0)  # (B',)
    out[rows, lengths[rows] - 1] = rewards[rows]  # (B',)
    return out


def gae(
    rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float = 1.0, lam: float = 0.95
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation within each output (paper §2, Eq. of ``hat A_t``).

    ``delta_l = R_l + gamma V_{l+1} - V_l``, ``A_t = sum_{l>=0} (gamma lam)^l delta_{t+l}``, and the value
    targets ``returns = A + V``. Each row is one output (one agent's episode); the state after its last token is
    terminal (``V_{|o|} = 0``), so nothing is bootstrapped across agents: an agent's reward ``R`` already holds
    what its successors earned (backward propagation). Vectorised over the batch, one backward pass over T.

    Args:
        rewards: (B, T) per-token rewards (:func:`terminal_token_rewards`).
        values: (B, T) the critic's values ``V_t`` at the output positions (the state before token t).
        mask: (B, T) bool, right-padded: True on each row's output tokens.

    Returns ``(advantages (B, T), returns (B, T))``, 0 on padding. Padding in ``rewards``/``values`` is ignored.

    Departures from the paper: none in the formula; the per-output episode and the terminal value 0 are this
    implementation's reading of "GAE within each output" for a multi-agent rollout.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    _check_token_arrays(rewards, values, mask)
    r = np.where(mask, rewards, 0.0)  # (B, T)
    v = np.where(mask, values, 0.0)  # (B, T)
    v_next = np.concatenate([v[:, 1:], np.zeros((v.shape[0], 1))], axis=1)  # (B, T) 0 after the last token
    delta = np.where(mask, r + gamma * v_next - v, 0.0)  # (B, T)
    adv = np.zeros_like(delta)  # (B, T)
    running = np.zeros(delta.shape[0])  # (B,) A_{t+1}; 0 on padding, so each row starts at its last token
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running  # (B,)
        adv[:, t] = running
    return adv, np.where(mask, adv + v, 0.0)


def whiten(x: np.ndarray, mask: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """``(x - mean) / (std + eps)`` over the masked entries of the whole step (population std); 0 elsewhere.

    Used on MAPPO / PPO advantages (``critic.whiten``), as PPO implementations for LLMs do; computed once over the
    step so that the update does not depend on the micro-batch cut. A step with no masked entry returns zeros.
    """
    x = np.asarray(x, dtype=np.float64)
    mask = np.asarray(mask, dtype=bool)
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have the same shape, got {x.shape} and {mask.shape}")
    if not mask.any():
        return np.zeros_like(x)
    mean = x[mask].mean()
    std = x[mask].std()
    return np.where(mask, (x - mean) / (std + eps), 0.0)


def agent_keys(agents: np.ndarray, prompt_keys: np.ndarray, visits: np.ndarray) -> np.ndarray:
    """Group keys of ``advantage=agent``: one group per agent across the step (agent-wise normalisation, as
    Dr.MAS does). (N,) arrays in, (N, 1) integer keys out."""
    return np.stack([np.unique(agents, return_inverse=True)[1].reshape(-1)], axis=1)  # (N, 1)


def prompt_agent_turn_keys(agents: np.ndarray, prompt_keys: np.ndarray, visits: np.ndarray) -> np.ndarray:
    """Group keys of ``advantage=prompt_agent_turn``: samples with the same prompt, agent and visit (AT-GRPO-style
    homogeneous groups). (N,) arrays in, (N, 3) integer keys out."""
    return np.stack(
        [
            np.unique(prompt_keys, return_inverse=True)[1].reshape(-1),
            np.unique(agents, return_inverse=True)[1].reshape(-1),
            np.asarray(visits),
        ],
        axis=1,
    )  # (N, 3)


def scheme_groups(
    scheme: str, group_ids: np.ndarray, agents: np.ndarray, prompt_keys: np.ndarray, visits: np.ndarray
) -> tuple[np.ndarray, int]:
    """The groups an advantage scheme (`mhgpo.config.tables.ADVANTAGE_SCHEMES`) normalises over, among the trained
    samples (``group_ids >= 0``).

    - ``mhgpo``: the sampler's group ids as they are (heterogeneous groups: paper Eq. adv).
    - any other scheme: the samples whose keys (the scheme's function of ``agents``, ``prompt_keys``, ``visits``)
      are equal form one group, e.g. ``agent`` (:func:`agent_keys`) or ``prompt_agent_turn``
      (:func:`prompt_agent_turn_keys`); a sample that no other sample shares its keys with forms a group of one,
      which is not trained.

    ``agents``, ``prompt_keys`` (any hashable id of the prompt, e.g. its token ids as a tuple's hash index) and
    ``visits`` are (N,) arrays aligned with ``group_ids``. Returns ``(ids (N,), dropped)``: new group ids (``-1``:
    not trained, numbered in order of first appearance) and how many trained samples were left in groups of one.
    """
    if scheme not in ADVANTAGE_SCHEMES:
        raise ValueError(f"unknown advantage scheme {scheme!r}")
    group_ids = np.asarray(group_ids, dtype=np.int64)
    if ADVANTAGE_SCHEMES[scheme].keys is None:
        return group_ids.copy(), 0
    trained = group_ids >= 0  # (N,)
    keys = load_function(ADVANTAGE_SCHEMES[scheme].keys)(
        np.asarray(agents), np.asarray(prompt_keys), np.asarray(visits)
    )
    out = np.full(group_ids.shape[0], -1, dtype=np.int64)  # (N,)
    idx = np.flatnonzero(trained)  # (M,)
    if idx.shape[0] == 0:
        return out, 0
    _, first, inv, size = np.unique(keys[idx], axis=0, return_index=True, return_inverse=True, return_counts=True)
    inv = inv.reshape(-1)  # (M,) group of each trained sample
    kept = np.flatnonzero(size >= 2)  # (K',) groups of two or more
    new_id = np.full(size.shape[0], -1, dtype=np.int64)  # (K,)
    new_id[kept[np.argsort(first[kept])]] = np.arange(kept.shape[0])  # numbered by first appearance
    out[idx] = new_id[inv]
    keep = size[inv] >= 2  # (M,)
    return out, int((~keep).sum())
