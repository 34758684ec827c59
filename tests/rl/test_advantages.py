"""Reward propagation, composite rewards, group advantages and singleton regrouping."""

from __future__ import annotations

import numpy as np
import pytest

from mhgpo.rl.advantages import (
    AGGREGATORS,
    aggregated,
    drop_zero_variance,
    gae,
    group_advantages,
    propagate_rewards,
    regroup_singletons,
    rr_pool_keys,
    terminal_token_rewards,
    total_rewards,
    whiten,
)
from mhgpo.rl.reference import (
    drop_zero_variance_reference,
    gae_reference,
    group_advantages_reference,
    propagate_rewards_reference,
)

NAN = float("nan")

# --- hand-built trees --------------------------------------------------------------------------------------
# FoF chain, G=4 forks at the Rewriter: Rewriter -> Retriever (tool) -> Reranker -> Answerer.
# branch b: nodes 4b (Rewriter, root), 4b+1 (tool), 4b+2 (Reranker), 4b+3 (Answerer, leaf).
CHAIN_PARENTS = np.array([-1, 0, 1, 2, -1, 4, 5, 6, -1, 8, 9, 10, -1, 12, 13, 14])
CHAIN_TERMINAL = np.array([9, 9, 9, 0.8, 9, 9, 9, 0.0, 9, 9, 9, 1.0, 9, 9, 9, 0.5], dtype=float)
CHAIN_EXPECTED = np.repeat([0.8, 0.0, 1.0, 0.5], 4)  # one child everywhere: every Aggr passes it through

# FoF(os): two Rewriter roots (0, 1) -> tools (2, 3) -> Rerankers (4, 5) -> 4 Answerers each (6-9, 10-13).
OS_PARENTS = np.array([-1, -1, 0, 1, 2, 3, 4, 4, 4, 4, 5, 5, 5, 5])
OS_TERMINAL = np.array([NAN] * 6 + [1.0, 0.0, 0.5, 0.5, 0.2, 0.4, 0.4, 0.6])
OS_EXPECTED = {
    "mean": [0.5, 0.4, 0.5, 0.4, 0.5, 0.4],
    "max": [1.0, 0.6, 1.0, 0.6, 1.0, 0.6],
    "min": [0.0, 0.2, 0.0, 0.2, 0.0, 0.2],
}

# Loop: Rewriter 0 -> tool 1 -> Reranker forked G=2 (2, 3) -> Rewriter again (4, 5) -> tools (6, 7)
# -> Answerer 8 under 6; Answerers 9, 10, 11 under 7 (over-sampled).
LOOP_PARENTS = np.array([-1, 0, 1, 1, 2, 3, 4, 5, 6, 7, 7, 7])
LOOP_TERMINAL = np.array([99.0] * 8 + [0.9, 0.0, 0.3, 0.6])  # 99 at non-leaves must be ignored
LOOP_EXPECTED = {
    # node 0..7; mean of means at node 1: (0.9 + 0.3) / 2 = 0.6 (not the leaf mean 0.45)
    "mean": [0.6, 0.6, 0.9, 0.3, 0.9, 0.3, 0.9, 0.3],
    "max": [0.9, 0.9, 0.9, 0.6, 0.9, 0.6, 0.9, 0.6],
    "min": [0.0, 0.0, 0.9, 0.0, 0.9, 0.0, 0.9, 0.0],
}


@pytest.mark.parametrize("fn", [propagate_rewards, propagate_rewards_reference])
@pytest.mark.parametrize("aggr", AGGREGATORS)
def test_chain_passes_reward_through(fn, aggr):
    out = fn(CHAIN_PARENTS, CHAIN_TERMINAL, aggr, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, CHAIN_EXPECTED)


@pytest.mark.parametrize("fn", [propagate_rewards, propagate_rewards_reference])
@pytest.mark.parametrize("aggr", ["mean", "max", "min"])
def test_oversampled_tree(fn, aggr):
    out = fn(OS_PARENTS, OS_TERMINAL, aggr)
    np.testing.assert_allclose(out[:6], OS_EXPECTED[aggr], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(out[6:], OS_TERMINAL[6:])


@pytest.mark.parametrize("fn", [propagate_rewards, propagate_rewards_reference])
@pytest.mark.parametrize("aggr", ["mean", "max", "min"])
def test_loop_tree(fn, aggr):
    out = fn(LOOP_PARENTS, LOOP_TERMINAL, aggr)
    np.testing.assert_allclose(out[:8], LOOP_EXPECTED[aggr], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(out[8:], LOOP_TERMINAL[8:])


@pytest.mark.parametrize("fn", [propagate_rewards, propagate_rewards_reference])
def test_rand_takes_one_child_value(fn):
    for seed in range(20):
        out = fn(LOOP_PARENTS, LOOP_TERMINAL, "rand", rng=np.random.default_rng(seed))
        assert out[7] in (0.0, 0.3, 0.6)
        assert out[5] == out[7] and out[3] == out[5]
        assert out[2] == 0.9
        assert out[1] in (out[2], out[3]) and out[0] == out[1]


def test_rand_is_uniform_over_children():
    rng = np.random.default_rng(123)
    picks = [propagate_rewards(LOOP_PARENTS, LOOP_TERMINAL, "rand", rng=rng)[7] for _ in range(6000)]
    freq = [np.mean(np.isclose(picks, v)) for v in (0.0, 0.3, 0.6)]
    np.testing.assert_allclose(freq, [1 / 3] * 3, atol=0.03)


def test_aggregated_marks_the_nodes_above_differing_leaves():
    np.testing.assert_array_equal(aggregated(CHAIN_PARENTS, CHAIN_TERMINAL), np.zeros(16, dtype=bool))
    np.testing.assert_array_equal(aggregated(OS_PARENTS, OS_TERMINAL), [True] * 6 + [False] * 8)
    np.testing.assert_array_equal(
        aggregated(LOOP_PARENTS, LOOP_TERMINAL), [True, True, False, True, False, True, False, True] + [False] * 4
    )
    same = OS_TERMINAL.copy()
    same[10:] = 0.4  # the second Reranker's Answerers agree: its branch is the same under every aggregator
    np.testing.assert_array_equal(aggregated(OS_PARENTS, same), [True, False, True, False, True, False] + [False] * 8)


def _random_forest(rng: np.random.Generator, n: int) -> np.ndarray:
    parents = np.empty(n, dtype=np.int64)
    for i in range(n):
        roll = rng.random()
        if i == 0 or roll < 0.05:
            parents[i] = -1
        elif roll < 0.5:
            parents[i] = i - 1  # long chains
        else:
            parents[i] = rng.integers(max(0, i - 6), i)  # bushy fan-out
    return parents


@pytest.mark.parametrize("aggr", AGGREGATORS)
def test_vectorised_propagation_matches_reference(aggr):
    rng = np.random.default_rng(2024)
    for trial in range(300):
        n = int(rng.integers(1, 80))
        parents = _random_forest(rng, n)
        terminal = rng.normal(size=n)
        fast = propagate_rewards(parents, terminal, aggr, rng=np.random.default_rng(trial))
        slow = propagate_rewards_reference(parents, terminal, aggr, rng=np.random.default_rng(trial))
        np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


def test_rand_consumes_rng_identically():
    parents, terminal = LOOP_PARENTS, LOOP_TERMINAL
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    propagate_rewards(parents, terminal, "rand", rng=rng_a)
    propagate_rewards_reference(parents, terminal, "rand", rng=rng_b)
    assert rng_a.random() == rng_b.random()


def test_propagation_rejects_bad_input():
    with pytest.raises(ValueError, match="parents"):
        propagate_rewards(np.array([-1, 2, 0]), np.zeros(3))
    with pytest.raises(ValueError, match="aggr"):
        propagate_rewards(np.array([-1, 0]), np.zeros(2), "median")
    with pytest.raises(ValueError, match="rng"):
        propagate_rewards(np.array([-1, 0]), np.zeros(2), "rand")
    with pytest.raises(ValueError, match="leaf"):
        propagate_rewards(np.array([-1, 0]), np.array([0.0, NAN]))
    assert propagate_rewards(np.zeros(0, dtype=int), np.zeros(0)).shape == (0,)


def test_penalties_added_after_propagation_only():
    shared = propagate_rewards(LOOP_PARENTS, LOOP_TERMINAL, "mean")
    penalties = np.zeros(12)
    penalties[7] = -0.5  # a tool-level penalty must not reach nodes 5, 3, 1, 0
    penalties[10] = -1.0  # an Answerer penalty must not reach node 7
    r = total_rewards(shared, penalties)
    np.testing.assert_allclose(r[[0, 1, 3, 5]], [0.6, 0.6, 0.3, 0.3], rtol=0, atol=1e-15)
    np.testing.assert_allclose(r[[7, 10]], [0.3 - 0.5, 0.3 - 1.0], rtol=0, atol=1e-15)
    np.testing.assert_array_equal(total_rewards(shared, penalties, use_penalties=False), shared)


# --- group advantages --------------------------------------------------------------------------------------
def test_advantages_by_hand():
    rewards = np.array([1.0, 0.0, 0.5, 0.5, 99.0, 3.0, 1.0, 0.1, 0.1, 0.1])
    groups = np.array([4, 4, 4, 4, -1, 7, 7, 2, 2, 2])
    for fn in (group_advantages, group_advantages_reference):
        adv, stats = fn(rewards, groups)
        # group 4: mean 0.5, unbiased std sqrt(0.5 / 3); group 7: mean 2, std sqrt(2); group 2: constant
        expected = [1.2247418713989375, -1.2247418713989375, 0, 0, 0, 0.7071062811869011, -0.7071062811869011, 0, 0, 0]
        np.testing.assert_allclose(adv, expected, rtol=0, atol=1e-12)
        assert stats == {"n_groups": 3, "n_zero_variance_groups": 1, "n_untrained": 1}
        assert np.all(adv[7:] == 0.0)  # exactly zero although the float mean of 0.1s is not 0.1


def test_advantages_unbiased_std_matches_torch():
    torch = pytest.importorskip("torch")
    r = np.array([0.3, 0.9, 0.1, 0.7, 0.2])
    adv, _ = group_advantages(r, np.zeros(5, dtype=int), eps=0.0)
    t = torch.tensor(r)
    np.testing.assert_allclose(adv, ((t - t.mean()) / t.std()).numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fn", [group_advantages, group_advantages_reference])
def test_advantages_reject_singleton_group(fn):
    with pytest.raises(ValueError, match="size 1"):
        fn(np.array([1.0, 0.0, 0.5]), np.array([0, 0, 3]))


def test_advantages_all_untrained():
    adv, stats = group_advantages(np.array([1.0, 2.0]), np.array([-1, -1]))
    np.testing.assert_array_equal(adv, [0.0, 0.0])
    assert stats == {"n_groups": 0, "n_zero_variance_groups": 0, "n_untrained": 2}


def test_vectorised_advantages_match_reference():
    rng = np.random.default_rng(7)
    for _ in range(200):
        n_groups = int(rng.integers(1, 12))
        sizes = rng.integers(2, 7, size=n_groups)
        groups = np.concatenate([np.full(s, g * 3 + 1) for g, s in enumerate(sizes)])
        groups = np.concatenate([groups, np.full(int(rng.integers(0, 4)), -1)])
        rng.shuffle(groups)
        if rng.random() < 0.3:  # few distinct values: ties and zero-variance groups
            rewards = rng.choice([0.0, 0.25, 1.0], size=groups.shape[0])
        else:
            rewards = rng.normal(size=groups.shape[0])
        for scale in (True, False):  # the paper's Eq. adv, and the unscaled R - mean_g of `mhgpo_mean`
            fast, fast_stats = group_advantages(rewards, groups, scale=scale)
            slow, slow_stats = group_advantages_reference(rewards, groups, scale=scale)
            np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)
            assert fast_stats == slow_stats


def test_unscaled_advantages_keep_the_rewards_spread():
    """`mhgpo_mean`: a group whose rewards differ by 0.05 pushes 20x less than one whose differ by 1; the std
    scaling gives both the same push."""
    rewards = np.array([0.0, 0.05, 0.0, 1.0])
    groups = np.array([0, 0, 1, 1])
    unscaled, _ = group_advantages(rewards, groups, scale=False)
    np.testing.assert_allclose(unscaled, [-0.025, 0.025, -0.5, 0.5], rtol=0, atol=1e-15)
    scaled, _ = group_advantages(rewards, groups)
    np.testing.assert_allclose(scaled[:2], scaled[2:], rtol=1e-4)  # (eps = 1e-6 against stds of 0.035 and 0.71)


def test_the_mhgpo_mean_scheme_trains_the_samplers_groups_unscaled():
    from fakes import rollout

    from mhgpo.rl.rewards import assign_rewards

    a, _, _ = rollout("fof", n_questions=3)
    b, _, _ = rollout("fof", n_questions=3)
    assign_rewards(a, "mean", True, np.random.default_rng(0))
    assign_rewards(b, "mean", True, np.random.default_rng(0), scheme="mhgpo_mean")
    assert [n.group_id for n in a.nodes] == [n.group_id for n in b.nodes]
    ids = np.array([n.group_id for n in b.nodes])
    expected, _ = group_advantages(np.array([n.reward for n in b.nodes]), ids, scale=False)
    assert [n.advantage for n in b.nodes] == expected.tolist() and any(n.advantage != 0 for n in b.nodes)


# --- regrouping (Round-Robin singletons) -------------------------------------------------------------------
def _rr_batch():
    # groups 0-2: FoF groups of 4 (kept); 10-20: singletons (prefix agents of questions forked later); -1 kept
    groups = np.array([0] * 4 + [1] * 4 + [2] * 4 + list(range(10, 21)) + [-1])
    roles = np.array(["answerer"] * 12 + ["rewriter"] * 6 + ["reranker"] * 5 + ["answerer"])
    return groups, roles


def test_regroup_within_role():
    groups, roles = _rr_batch()
    out, dropped = regroup_singletons(groups, roles, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(out[:12], groups[:12])
    assert out[-1] == -1
    new = out[12:23]
    assert dropped == 2 + 1  # rewriter 6 = 4 + 2, reranker 5 = 4 + 1
    assert np.sum(new == -1) == dropped
    new_ids, sizes = np.unique(new[new >= 0], return_counts=True)
    assert sizes.tolist() == [4, 4] and np.all(new_ids > 20)
    for g in new_ids:
        assert len(set(roles[out == g])) == 1


def test_regroup_across_roles_can_mix():
    groups, roles = _rr_batch()
    mixed = False
    for seed in range(10):
        keys = rr_pool_keys("all", roles.tolist(), [None] * len(roles))
        out, dropped = regroup_singletons(groups, keys, 4, np.random.default_rng(seed))
        assert dropped == 11 - 8
        new_ids, sizes = np.unique(out[12:23][out[12:23] >= 0], return_counts=True)
        assert sizes.tolist() == [4, 4] and np.all(new_ids > 20)
        mixed |= any(len(set(roles[out == g])) > 1 for g in new_ids)
    assert mixed


def test_regroup_by_fork_point_pools_only_singletons_of_one_role_and_fork_agent():
    groups, roles = _rr_batch()
    # the rewriter singletons: 4 from questions forked at the answerer, 2 at the reranker; the reranker's: 5 at
    # the answerer (a reranker singleton comes from a question forked after it)
    forks = ["rewriter"] * 12 + ["answerer"] * 4 + ["reranker"] * 2 + ["answerer"] * 5 + ["answerer"]
    keys = rr_pool_keys("fork", roles.tolist(), forks)
    for seed in range(5):
        out, dropped = regroup_singletons(groups, keys, 4, np.random.default_rng(seed))
        assert dropped == 0 + 2 + 1  # rewriter@answerer 4 = 4, rewriter@reranker 2 < 4, reranker@answerer 5 = 4 + 1
        np.testing.assert_array_equal(out[16:18], [-1, -1])  # the two reranker-forked rewriter singletons
        new_ids = np.unique(out[12:23][out[12:23] >= 0])
        assert len(new_ids) == 2
        for g in new_ids:
            members = np.flatnonzero(out == g)
            assert len(members) == 4 and len({keys[i] for i in members}) == 1
    by_role, dropped_by_role = regroup_singletons(
        groups, rr_pool_keys("role", roles.tolist(), forks), 4, np.random.default_rng(0)
    )
    assert dropped_by_role == 2 + 1  # role pools: rewriter 6 = 4 + 2 (across fork points), reranker 5 = 4 + 1
    with pytest.raises(ValueError, match="fork, role or all"):
        rr_pool_keys("agent", ["a"], [None])


def test_regroup_is_deterministic_and_seed_dependent():
    groups, roles = _rr_batch()
    a, _ = regroup_singletons(groups, roles, 2, np.random.default_rng(3))
    b, _ = regroup_singletons(groups, roles, 2, np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    outs = {tuple(regroup_singletons(groups, roles, 2, np.random.default_rng(s))[0]) for s in range(10)}
    assert len(outs) > 1


def test_regroup_nothing_to_do_and_bad_size():
    groups = np.array([0, 0, 5, 5, -1])
    out, dropped = regroup_singletons(groups, ["a"] * 5, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(out, groups)
    assert dropped == 0
    with pytest.raises(ValueError, match="group_size"):
        regroup_singletons(groups, ["a"] * 5, 1, np.random.default_rng(0))


def test_regrouped_batch_feeds_advantages():
    groups, roles = _rr_batch()
    out, _ = regroup_singletons(groups, roles, 4, np.random.default_rng(1))
    adv, stats = group_advantages(np.random.default_rng(1).normal(size=out.shape[0]), out)
    assert stats["n_groups"] == 5 and stats["n_untrained"] == 4
    assert np.all(adv[out == -1] == 0.0)


# --- MAPPO / PPO: GAE within an output ----------------------------------------------------------------------
# Two outputs, right-padded to T=3: values V (padding holds garbage), reward R at each output's last token.
GAE_VALUES = np.array([[0.5, 0.2, -0.1], [0.3, 7.0, 7.0]])
GAE_MASK = np.array([[True, True, True], [True, False, False]])
GAE_R = np.array([1.0, -0.5])


def test_terminal_token_rewards_by_hand():
    r = terminal_token_rewards(np.array([1.0, -0.5, 2.0]), np.array([3, 1, 0]), width=4)
    np.testing.assert_array_equal(r, [[0, 0, 1.0, 0], [-0.5, 0, 0, 0], [0, 0, 0, 0]])
    assert terminal_token_rewards(np.array([1.0]), np.array([2])).shape == (1, 2)


@pytest.mark.parametrize(
    ("gamma", "lam", "adv0", "ret0"),
    [
        # gamma=1, lam=0.95: delta = [0.2-0.5, -0.1-0.2, 1-(-0.1)] = [-0.3, -0.3, 1.1];
        # A2 = 1.1, A1 = -0.3 + 0.95*1.1 = 0.745, A0 = -0.3 + 0.95*0.745 = 0.40775; returns = A + V
        (1.0, 0.95, [0.40775, 0.745, 1.1], [0.90775, 0.945, 1.0]),
        # gamma=0.9, lam=0.5: delta = [0.18-0.5, -0.09-0.2, 1.1] = [-0.32, -0.29, 1.1];
        # A1 = -0.29 + 0.45*1.1 = 0.205, A0 = -0.32 + 0.45*0.205 = -0.22775
        (0.9, 0.5, [-0.22775, 0.205, 1.1], [0.27225, 0.405, 1.0]),
    ],
)
def test_gae_by_hand(gamma, lam, adv0, ret0):
    rewards = terminal_token_rewards(GAE_R, GAE_MASK.sum(axis=1), width=3)
    adv, ret = gae(rewards, GAE_VALUES, GAE_MASK, gamma, lam)
    np.testing.assert_allclose(adv[0], adv0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ret[0], ret0, rtol=0, atol=1e-12)
    # a one-token output: delta = R - V = -0.5 - 0.3; its padding stays 0 whatever the values there
    np.testing.assert_allclose(adv[1], [-0.8, 0.0, 0.0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(ret[1], [-0.5, 0.0, 0.0], rtol=0, atol=1e-12)


def _ragged(seed: int, b: int = 9, t_max: int = 7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t_max + 1, size=b)
    mask = np.arange(lengths.max())[None, :] < lengths[:, None]  # (B, T)
    values = np.where(mask, rng.normal(size=mask.shape), 99.0)  # padding must not matter
    rewards = np.where(mask, rng.normal(size=mask.shape), -99.0)  # dense rewards: the general formula
    return rewards, values, mask, lengths


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.7), (1.0, 0.0), (0.5, 1.0)])
def test_gae_matches_reference_loop(seed, gamma, lam):
    rewards, values, mask, lengths = _ragged(seed)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    rows = lambda x: [list(x[i, :n]) for i, n in enumerate(lengths)]  # noqa: E731
    ref_adv, ref_ret = gae_reference(rows(rewards), rows(values), gamma, lam)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(adv[i, :n], ref_adv[i], rtol=0, atol=1e-12)
        np.testing.assert_allclose(ret[i, :n], ref_ret[i], rtol=0, atol=1e-12)
        assert np.all(adv[i, n:] == 0) and np.all(ret[i, n:] == 0)


def test_gae_limits():
    rewards, values, mask, _ = _ragged(7)
    # lambda = 1, gamma = 1: A_t = (sum of the rewards from t on) - V_t (Monte Carlo), returns = reward-to-go
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    to_go = np.flip(np.cumsum(np.flip(np.where(mask, rewards, 0), axis=1), axis=1), axis=1)
    np.testing.assert_allclose(ret, np.where(mask, to_go, 0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(adv, np.where(mask, to_go - values, 0), rtol=0, atol=1e-12)
    # lambda = 0: A_t = delta_t (one-step TD error)
    adv0, _ = gae(rewards, values, mask, 0.9, 0.0)
    v = np.where(mask, values, 0)
    v_next = np.concatenate([v[:, 1:], np.zeros((v.shape[0], 1))], axis=1)
    np.testing.assert_allclose(adv0, np.where(mask, rewards + 0.9 * v_next - v, 0), rtol=0, atol=1e-12)


def test_gae_rejects_bad_masks():
    with pytest.raises(ValueError, match="right-padded"):
        gae(np.zeros((1, 3)), np.zeros((1, 3)), np.array([[True, False, True]]))
    with pytest.raises(ValueError, match="shape"):
        gae(np.zeros((1, 3)), np.zeros((1, 2)), np.ones((1, 3), dtype=bool))


def test_whiten_over_the_masked_entries():
    x = np.array([[1.0, 2.0, 50.0], [3.0, 60.0, 70.0]])
    mask = np.array([[True, True, False], [True, False, False]])
    w = whiten(x, mask)
    # masked entries 1, 2, 3: mean 2, population std sqrt(2/3)
    np.testing.assert_allclose(w[mask], np.array([-1.0, 0.0, 1.0]) / (np.sqrt(2 / 3) + 1e-8), rtol=0, atol=1e-12)
    assert np.all(w[~mask] == 0)
    assert np.all(whiten(x, np.zeros_like(mask)) == 0)


def test_drop_zero_variance_by_hand():
    rewards = np.array([0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.2, 0.7, 3.0])
    ids = np.array([0, 0, 1, 1, 2, 2, -1, 3, 3])
    out, dropped = drop_zero_variance(rewards, ids)
    assert out.tolist() == [-1, -1, 1, 1, -1, -1, -1, 3, 3] and dropped == 2
    assert ids.tolist() == [0, 0, 1, 1, 2, 2, -1, 3, 3]  # the input is not changed


@pytest.mark.parametrize("seed", range(20))
def test_drop_zero_variance_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    ids = rng.integers(-1, 6, size=n)
    rewards = rng.choice([0.0, 0.5, 1.0], size=n)
    out, dropped = drop_zero_variance(rewards, ids)
    ref, ref_dropped = drop_zero_variance_reference(rewards, ids)
    assert out.tolist() == ref.tolist() and dropped == ref_dropped


# ---- advantage schemes: the groups advantages are normalised in (MHGPO's, agent-wise, prompt-agent-turn)


def test_scheme_groups_by_hand():
    from mhgpo.rl.advantages import scheme_groups

    #                 sampler ids, agents,                         prompts,          visits
    group_ids = np.array([0, 0, 1, 1, -1, 2, 2, 1])
    agents = np.array(["rw", "rw", "rr", "rr", "ans", "ans", "ans", "rr"])
    prompts = np.array([7, 7, 3, 4, 9, 5, 5, 3])
    visits = np.array([0, 0, 0, 0, 0, 0, 1, 0])
    ids, dropped = scheme_groups("mhgpo", group_ids, agents, prompts, visits)
    assert ids.tolist() == group_ids.tolist() and dropped == 0
    ids, dropped = scheme_groups("agent", group_ids, agents, prompts, visits)
    assert ids.tolist() == [0, 0, 1, 1, -1, 2, 2, 1] and dropped == 0  # ans: the untrained sample stays out
    ids, dropped = scheme_groups("prompt_agent_turn", group_ids, agents, prompts, visits)
    # (7, rw, 0) × 2 → group 0; (3, rr, 0) × 2 (samples 2 and 7) → group 1; (4, rr), (5, ans, 0), (5, ans, 1): alone
    assert ids.tolist() == [0, 0, 1, -1, -1, -1, -1, 1] and dropped == 3
    with pytest.raises(ValueError, match="unknown advantage scheme 'x'"):
        scheme_groups("x", group_ids, agents, prompts, visits)


@pytest.mark.parametrize("scheme", ["mhgpo", "agent", "prompt_agent_turn"])
@pytest.mark.parametrize("seed", range(25))
def test_scheme_groups_equal_the_reference(scheme, seed):
    from mhgpo.rl.advantages import scheme_groups
    from mhgpo.rl.reference import scheme_groups_reference

    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    group_ids = rng.integers(-1, 6, n)
    agents = rng.choice(["rewriter", "reranker", "answerer"], n)
    prompts = rng.integers(0, 5, n)
    visits = rng.integers(0, 2, n)
    fast, dropped = scheme_groups(scheme, group_ids, agents, prompts, visits)
    slow, dropped_ref = scheme_groups_reference(
        scheme, group_ids.tolist(), agents.tolist(), prompts.tolist(), visits.tolist()
    )
    assert fast.tolist() == slow and dropped == dropped_ref
    if scheme != "mhgpo":  # every kept group has at least two samples; ids numbered 0..K-1 by first appearance
        kept = fast[fast >= 0]
        assert all(np.sum(kept == g) >= 2 for g in np.unique(kept))
        assert list(dict.fromkeys(kept.tolist())) == list(range(len(set(kept.tolist()))))
