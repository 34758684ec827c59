"""The MHGPO policy loss: agreement with the paper's formula, micro-batch invariance, gradients, clipping, KL."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhgpo.rl.losses import engine_is_weight, k3_kl, mhgpo_policy_loss, token_weights, value_loss
from mhgpo.rl.reference import mhgpo_policy_loss_reference, value_loss_reference

AGENTS = ["rewriter", "reranker", "answerer"]


def _batch(seed: int, b: int = 13, t_max: int = 9, n_agents: int = 3):
    """Random ragged step, right-padded to (B, T) with garbage in the padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t_max + 1, (b,), generator=g)
    t = int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3  # (B, T)
    logp = old + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)  # ratios around 1, some clipped
    ref = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    logp = torch.where(mask, logp, torch.full_like(logp, -1e4))  # padding must not matter
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    agents = [AGENTS[int(i)] for i in torch.randint(0, n_agents, (b,), generator=g)]
    return logp, old, ref, adv, agents, lengths, mask


def _rows(x: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    return [x[i, : int(n)] for i, n in enumerate(lengths)]


def test_token_weights_by_hand():
    w = token_weights(["a", "a", "b", "c"], [2, 4, 5, 1], trained=[True, True, True, False], dtype=torch.float64)
    # 2 agents present (c untrained); a: 2 samples -> 1/(2*2*2), 1/(2*2*4); b: 1/(2*1*5)
    torch.testing.assert_close(w, torch.tensor([0.125, 0.0625, 0.1, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    w_int = token_weights(np.array([0, 0, 1]), torch.tensor([2, 4, 5]), dtype=torch.float64)
    torch.testing.assert_close(w_int, w[:3], rtol=0, atol=1e-15)


def test_token_weights_sum_to_one_over_tokens():
    _, _, _, _, agents, lengths, _ = _batch(3, b=40)
    w = token_weights(agents, lengths, dtype=torch.float64)
    assert abs(float((w * lengths).sum()) - 1.0) < 1e-12


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("beta", [0.0, 0.001, 0.5])
def test_loss_matches_reference(seed, beta):
    logp, old, ref, adv, agents, lengths, mask = _batch(seed)
    w = token_weights(agents, lengths, dtype=torch.float64)
    loss, _ = mhgpo_policy_loss(logp, old, ref, adv, w, mask, clip_eps=0.2, beta=beta)
    expected = mhgpo_policy_loss_reference(
        _rows(logp, lengths), _rows(old, lengths), _rows(ref, lengths), adv.tolist(), agents, 0.2, beta
    )
    assert abs(float(loss) - float(expected)) < 1e-6
    assert abs(float(loss) - float(expected)) < 1e-12  # float64 all the way: far tighter in fact


def _engine(old: torch.Tensor, seed: int) -> torch.Tensor:
    """The log-probs of an engine that sampled the outputs: the trainer's old ones moved by up to ±1.5, so that
    some importance weights pass the cap of 2 (log 2 = 0.69) and some are far below 1."""
    g = torch.Generator().manual_seed(seed + 1000)
    return old + 3 * (torch.rand(old.shape, generator=g, dtype=torch.float64) - 0.5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("cap", [1.0, 2.0, 1e9])
def test_loss_with_the_engine_importance_weight_matches_reference(seed, beta, cap):
    logp, old, ref, adv, agents, lengths, mask = _batch(seed)
    engine = _engine(old, seed)
    w = token_weights(agents, lengths, dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    loss, stats = mhgpo_policy_loss(x, old, ref, adv, w, mask, 0.2, beta, engine, cap)
    y = logp.clone().requires_grad_(True)
    expected = mhgpo_policy_loss_reference(
        _rows(y, lengths), _rows(old, lengths), _rows(ref, lengths), adv.tolist(), agents, 0.2, beta,
        _rows(engine, lengths), cap,
    )  # fmt: skip
    assert abs(float(loss) - float(expected)) < 1e-12
    loss.backward()
    expected.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    rho = torch.minimum(torch.exp(old - engine), torch.tensor(cap, dtype=torch.float64))  # (B, T)
    if beta == 0:  # each token's policy-gradient term is the plain one times its weight
        z = logp.clone().requires_grad_(True)
        mhgpo_policy_loss(z, old, ref, adv, w, mask, 0.2, beta)[0].backward()
        torch.testing.assert_close(x.grad, rho * z.grad, rtol=0, atol=1e-12)
        assert not torch.allclose(x.grad, z.grad)
    assert abs(stats["is_weight"] - float(rho[mask].mean())) < 1e-12
    assert stats["is_clipped"] == float((torch.exp(old - engine)[mask] > cap).double().mean())
    assert stats["is_clipped"] == 0.0 if cap == 1e9 else 0 < stats["is_clipped"] < 1


def test_the_engine_weight_is_truncated_and_carries_no_gradient():
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    engine = torch.tensor([[-1.0, -3.0, -0.1]], dtype=torch.float64, requires_grad=True)
    rho, clipped = engine_is_weight(old, engine, 2.0)
    # exp(0) = 1; exp(1) = 2.72 capped at 2; exp(-0.4) = 0.67
    torch.testing.assert_close(rho, torch.tensor([[1.0, 2.0, float(np.exp(-0.4))]], dtype=torch.float64))
    assert clipped.tolist() == [[False, True, False]] and not rho.requires_grad
    # on-policy (the engine's log-probs are the trainer's): the weight is 1 and the loss the plain one
    logp, old_b, ref, adv, agents, lengths, mask = _batch(5)
    w = token_weights(agents, lengths, dtype=torch.float64)
    with_weight, stats = mhgpo_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001, old_b.clone(), 2.0)
    plain, _ = mhgpo_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001)
    assert float(with_weight) == float(plain) and stats["is_weight"] == 1.0 and stats["is_clipped"] == 0.0
    with pytest.raises(ValueError, match="engine_logp and is_cap go together"):
        mhgpo_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001, old_b)
    with pytest.raises(ValueError, match="is_cap be >= 1"):
        mhgpo_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001, old_b, 0.5)


def test_untrained_samples_do_not_count():
    logp, old, ref, adv, agents, lengths, mask = _batch(11, b=10)
    trained = torch.tensor([True, False] * 5)
    w = token_weights(agents, lengths, trained=trained, dtype=torch.float64)
    loss, _ = mhgpo_policy_loss(logp, old, ref, adv, w, mask)
    keep = [i for i in range(10) if trained[i]]
    expected = mhgpo_policy_loss_reference(
        [logp[i, : lengths[i]] for i in keep],
        [old[i, : lengths[i]] for i in keep],
        [ref[i, : lengths[i]] for i in keep],
        [float(adv[i]) for i in keep],
        [agents[i] for i in keep],
    )
    assert abs(float(loss) - float(expected)) < 1e-12


@pytest.mark.parametrize("cuts", [[13], [1] * 13, [5, 8], [2, 3, 7, 1], [12, 1]])
def test_loss_invariant_to_micro_batching(cuts):
    logp, old, ref, adv, agents, lengths, mask = _batch(21)
    w = token_weights(agents, lengths, dtype=torch.float64)  # once, over the whole step
    full, _ = mhgpo_policy_loss(logp, old, ref, adv, w, mask)
    parts, start = [], 0
    for size in cuts:
        sl = slice(start, start + size)
        t = int(lengths[sl].max())  # each micro-batch padded to its own length
        part, _ = mhgpo_policy_loss(logp[sl, :t], old[sl, :t], ref[sl, :t], adv[sl], w[sl], mask[sl, :t])
        parts.append(part)
        start += size
    assert start == 13
    assert abs(float(sum(parts)) - float(full)) < 1e-6
    assert abs(float(sum(parts)) - float(full)) < 1e-12


def test_micro_batch_gradients_accumulate_to_full_gradient():
    logp, old, ref, adv, agents, lengths, mask = _batch(22)
    w = token_weights(agents, lengths, dtype=torch.float64)
    x_full = logp.clone().requires_grad_(True)
    mhgpo_policy_loss(x_full, old, ref, adv, w, mask)[0].backward()
    x_parts = logp.clone().requires_grad_(True)
    for sl in (slice(0, 4), slice(4, 13)):
        mhgpo_policy_loss(x_parts[sl], old[sl], ref[sl], adv[sl], w[sl], mask[sl])[0].backward()
    torch.testing.assert_close(x_parts.grad, x_full.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_gradient_matches_reference_autograd(seed):
    logp, old, ref, adv, agents, lengths, mask = _batch(seed + 100)
    w = token_weights(agents, lengths, dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    mhgpo_policy_loss(x, old, ref, adv, w, mask, beta=0.05)[0].backward()
    y = logp.clone().requires_grad_(True)
    mhgpo_policy_loss_reference(
        _rows(y, lengths), _rows(old, lengths), _rows(ref, lengths), adv.tolist(), agents, 0.2, 0.05
    ).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    assert torch.all(x.grad[~mask] == 0)
    assert torch.any(x.grad[mask] != 0)


def _one_token(logp: float, old: float, adv: float, beta: float = 0.0, ref: float | None = None):
    x = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    ref_t = None if ref is None else torch.tensor([[ref]], dtype=torch.float64)
    loss, stats = mhgpo_policy_loss(
        x,
        torch.tensor([[old]], dtype=torch.float64),
        ref_t,
        torch.tensor([adv], dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_eps=0.2,
        beta=beta,
    )
    loss.backward()
    return float(loss.detach()), float(x.grad), stats


def test_clipping_zeroes_gradient():
    r = 1.5  # > 1 + eps
    loss, grad, stats = _one_token(np.log(r), 0.0, adv=2.0)
    assert grad == 0.0 and loss == pytest.approx(-1.2 * 2.0, abs=1e-12) and stats["clip_fraction"] == 1.0
    loss, grad, stats = _one_token(np.log(0.5), 0.0, adv=-1.0)  # A < 0 and r < 1 - eps
    assert grad == 0.0 and loss == pytest.approx(0.8, abs=1e-12) and stats["clip_fraction"] == 1.0
    # on the other side of the clip range the unclipped term is the minimum: gradient -A * r
    loss, grad, stats = _one_token(np.log(1.5), 0.0, adv=-1.0)
    assert grad == pytest.approx(1.5, abs=1e-12) and loss == pytest.approx(1.5, abs=1e-12)
    assert stats["clip_fraction"] == 0.0
    _, grad, _ = _one_token(np.log(1.1), 0.0, adv=2.0)  # inside the range
    assert grad == pytest.approx(-2.2, abs=1e-12)


def test_beta_zero_removes_kl():
    logp, old, ref, adv, agents, lengths, mask = _batch(5)
    w = token_weights(agents, lengths, dtype=torch.float64)
    with_ref, stats = mhgpo_policy_loss(logp, old, ref, adv, w, mask, beta=0.0)
    without_ref, stats_none = mhgpo_policy_loss(logp, old, None, adv, w, mask, beta=0.0)
    assert float(with_ref) == float(without_ref)
    assert stats["kl"] > 0 and "kl" not in stats_none
    with_kl, _ = mhgpo_policy_loss(logp, old, ref, adv, w, mask, beta=0.1)
    kl_term = float((torch.where(mask, k3_kl(logp, ref), 0.0) * w[:, None]).sum())  # padding gives inf
    assert abs(float(with_kl) - float(with_ref) - 0.1 * kl_term) < 1e-12
    with pytest.raises(ValueError, match="ref_logp"):
        mhgpo_policy_loss(logp, old, None, adv, w, mask, beta=0.1)


def test_k3_nonnegative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    kl = k3_kl(logp, ref)
    assert torch.all(kl >= 0)
    d = ref - logp
    torch.testing.assert_close(kl, torch.exp(d) - d - 1, rtol=1e-12, atol=1e-12)
    assert torch.all(k3_kl(logp, logp) == 0)
    # hand value: logp = 0, ref = log 2 -> 2 - log 2 - 1
    assert float(k3_kl(torch.tensor(0.0, dtype=torch.float64), torch.tensor(np.log(2.0)))) == pytest.approx(
        0.30685281944005466, abs=1e-15
    )
    small = k3_kl(torch.zeros(3, dtype=torch.float32), torch.tensor([1e-4, -1e-4, 1e-6]))
    assert torch.all(small >= 0)


def test_stats_are_token_means_over_the_mask():
    logp = torch.log(torch.tensor([[1.5, 1.0, 9.0], [0.9, 1.1, 9.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [True, True, False]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    _, stats = mhgpo_policy_loss(
        logp, old, old, torch.tensor([1.0, 1.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64), mask
    )
    assert stats["n_tokens"] == 4.0
    assert stats["clip_fraction"] == pytest.approx(0.25, abs=1e-12)  # only r = 1.5 with A > 0 is clipped
    assert stats["ratio"] == pytest.approx((1.5 + 1.0 + 0.9 + 1.1) / 4, abs=1e-12)
    kl = [1 / 1.5 + np.log(1.5) - 1, 0.0, 1 / 0.9 + np.log(0.9) - 1, 1 / 1.1 + np.log(1.1) - 1]
    assert stats["kl"] == pytest.approx(float(np.mean(kl)), abs=1e-12)


def test_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        mhgpo_policy_loss(x, torch.zeros(2, 4), None, torch.zeros(2), torch.zeros(2), torch.ones(2, 3), beta=0.0)
    with pytest.raises(ValueError, match="advantages"):
        mhgpo_policy_loss(x, x, None, torch.zeros(3), torch.zeros(2), torch.ones(2, 3), beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        token_weights(["a", "b"], [1, 2, 3])


# ------------------------------------------------------------------- per-token advantages (MAPPO / PPO actor)


@pytest.mark.parametrize("seed", range(4))
def test_per_token_advantages_match_reference_and_gradient(seed):
    logp, old, ref, _, agents, lengths, mask = _batch(seed + 200)
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(logp.shape, generator=g, dtype=torch.float64)  # (B, T)
    adv = torch.where(mask, adv, torch.full_like(adv, float("nan")))  # padding must not matter
    w = token_weights(agents, lengths, dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    loss, _ = mhgpo_policy_loss(x, old, ref, adv, w, mask, beta=0.05)
    loss.backward()
    y = logp.clone().requires_grad_(True)
    expected = mhgpo_policy_loss_reference(
        _rows(y, lengths), _rows(old, lengths), _rows(ref, lengths), _rows(adv, lengths), agents, 0.2, 0.05
    )
    expected.backward()
    assert abs(float(loss.detach()) - float(expected.detach())) < 1e-12
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


def test_per_sample_advantages_equal_their_per_token_broadcast():
    logp, old, ref, adv, agents, lengths, mask = _batch(31)
    w = token_weights(agents, lengths, dtype=torch.float64)
    per_sample, _ = mhgpo_policy_loss(logp, old, ref, adv, w, mask)
    per_token, _ = mhgpo_policy_loss(logp, old, ref, adv[:, None].expand(logp.shape).clone(), w, mask)
    assert float(per_sample) == float(per_token)
    with pytest.raises(ValueError, match=r"advantages must have shape \(13,\) or \(13, "):
        mhgpo_policy_loss(logp, old, ref, adv[:, None], w, mask)


# --------------------------------------------------------------------------------- the critic's value loss


def _values_batch(seed: int, b: int = 11, t_max: int = 6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t_max + 1, (b,), generator=g)
    t = int(lengths.max())
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T)
    old = torch.randn(b, t, generator=g, dtype=torch.float64)
    values = old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)  # some moves beyond the clip range
    returns = old + torch.randn(b, t, generator=g, dtype=torch.float64)
    values = torch.where(mask, values, torch.full_like(values, 1e4))  # padding must not matter
    agents = [AGENTS[int(i)] for i in torch.randint(0, 3, (b,), generator=g)]
    return values, old, returns, agents, lengths, mask


def _one_value(v: float, v_old: float, g: float):
    x = torch.tensor([[v]], dtype=torch.float64, requires_grad=True)
    loss, stats = value_loss(
        x,
        torch.tensor([[v_old]], dtype=torch.float64),
        torch.tensor([[g]], dtype=torch.float64),
        torch.ones(1, dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
        clip_eps=0.2,
    )
    loss.backward()
    return float(loss.detach()), float(x.grad), stats["value_clip_fraction"]


def test_value_loss_clipping_by_hand():
    # V moved 0.5 towards G=1 from V_old=0: V_clip = 0.2, (0.2-1)^2 = 0.64 > (0.5-1)^2 = 0.25 -> clipped, no gradient
    assert _one_value(0.5, 0.0, 1.0) == (pytest.approx(0.32, abs=1e-12), 0.0, 1.0)
    # overshooting G: (1.5-1)^2 = 0.25 < (0.2-1)^2 = 0.64 -> clipped too
    assert _one_value(1.5, 0.0, 1.0) == (pytest.approx(0.32, abs=1e-12), 0.0, 1.0)
    # inside the range: V_clip = V, loss 0.5 (V-G)^2, gradient V - G
    loss, grad, frac = _one_value(0.1, 0.0, 1.0)
    assert (loss, grad, frac) == (pytest.approx(0.405, abs=1e-12), pytest.approx(-0.9, abs=1e-12), 0.0)
    # moved 0.5 away from G: the unclipped term is the larger and keeps its gradient
    loss, grad, frac = _one_value(-0.5, 0.0, 1.0)
    assert (loss, grad, frac) == (pytest.approx(1.125, abs=1e-12), pytest.approx(-1.5, abs=1e-12), 0.0)


@pytest.mark.parametrize("seed", range(4))
def test_value_loss_matches_reference_and_gradient(seed):
    values, old, returns, agents, lengths, mask = _values_batch(seed)
    w = token_weights(agents, lengths, dtype=torch.float64)
    x = values.clone().requires_grad_(True)
    loss, stats = value_loss(x, old, returns, w, mask, clip_eps=0.2)
    loss.backward()
    y = values.clone().requires_grad_(True)
    expected = value_loss_reference(_rows(y, lengths), _rows(old, lengths), _rows(returns, lengths), agents, 0.2)
    expected.backward()
    assert abs(float(loss.detach()) - float(expected.detach())) < 1e-12
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    assert torch.all(x.grad[~mask] == 0)
    assert 0.0 < stats["value_clip_fraction"] < 1.0 and stats["n_tokens"] == float(lengths.sum())


def test_value_loss_invariant_to_micro_batching():
    values, old, returns, agents, lengths, mask = _values_batch(9)
    w = token_weights(agents, lengths, dtype=torch.float64)
    full, _ = value_loss(values, old, returns, w, mask)
    parts = 0.0
    for sl in (slice(0, 3), slice(3, 4), slice(4, 11)):
        t = int(lengths[sl].max())
        parts += float(value_loss(values[sl, :t], old[sl, :t], returns[sl, :t], w[sl], mask[sl, :t])[0])
    assert abs(parts - float(full)) < 1e-12


def test_value_loss_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        value_loss(x, torch.zeros(2, 4), x, torch.ones(2), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="weights"):
        value_loss(x, x, x, torch.ones(3), torch.ones(2, 3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------------- IcePop


def _icepop_reference(logp, old, ref, engine, adv, agents, lengths, eps, beta):
    """The IcePop objective as loops over agents, samples and tokens: a token whose trainer / sampler ratio
    exp(old - engine) leaves [0.5, 5] has no policy-gradient term (its KL term stays)."""
    total = 0.0
    present = sorted(set(agents))
    for agent in present:
        mine = [i for i, a in enumerate(agents) if a == agent]
        for i in mine:
            n = int(lengths[i])
            s = 0.0
            for t in range(n):
                r = torch.exp(logp[i, t] - old[i, t])
                k = float(torch.exp(old[i, t] - engine[i, t]))
                term = torch.minimum(r * adv[i], torch.clamp(r, 1 - eps, 1 + eps) * adv[i])
                term = term if 0.5 <= k <= 5.0 else 0.0 * term
                d = ref[i, t] - logp[i, t]
                s = s + term - beta * (torch.exp(d) - d - 1)
            total = total + s / n / len(mine)
    return -total / len(present)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_icepop_matches_its_formula_and_masks_the_tokens_outside_the_band(seed, beta):
    from mhgpo.rl.losses import icepop_policy_loss

    logp, old, ref, adv, agents, lengths, mask = _batch(seed)
    g = torch.Generator().manual_seed(100 + seed)
    engine = old + 1.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)  # ratios well outside [0.5, 5]
    w = token_weights(agents, lengths, dtype=torch.float64)
    x = logp.clone().requires_grad_(True)
    loss, stats = icepop_policy_loss(x, old, ref, adv, w, mask, 0.2, beta, engine)
    y = logp.clone().requires_grad_(True)
    expected = _icepop_reference(y, old, ref, engine, adv, agents, lengths, 0.2, beta)
    assert abs(float(loss) - float(expected)) < 1e-12
    loss.backward()
    expected.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    k = torch.exp(old - engine)  # (B, T)
    outside = mask & ((k < 0.5) | (k > 5.0))
    assert stats["is_masked"] == float(outside.sum()) / float(mask.sum())
    assert 0.2 < stats["is_masked"] < 0.8
    if beta == 0:  # a masked token carries no gradient; a kept one the plain objective's
        assert bool((x.grad[outside] == 0).all())
        z = logp.clone().requires_grad_(True)
        mhgpo_policy_loss(z, old, ref, adv, w, mask, 0.2, beta)[0].backward()
        kept = mask & ~outside
        torch.testing.assert_close(x.grad[kept], z.grad[kept], rtol=0, atol=1e-15)


def test_icepop_band_ends_are_kept_and_on_policy_it_is_the_clipped_loss():
    from mhgpo.rl.losses import icepop_mask, icepop_policy_loss

    old = torch.zeros(1, 5, dtype=torch.float64)
    engine = -torch.log(torch.tensor([[0.5, 0.49, 5.0, 5.01, 1.0]], dtype=torch.float64))  # k = exp(old - engine)
    assert icepop_mask(old, engine).tolist() == [[True, False, True, False, True]]
    logp, old_b, ref, adv, agents, lengths, mask = _batch(3)
    w = token_weights(agents, lengths, dtype=torch.float64)
    ice, stats = icepop_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001, old_b.clone())
    plain, _ = mhgpo_policy_loss(logp, old_b, ref, adv, w, mask, 0.2, 0.001)
    assert float(ice) == float(plain) and stats["is_masked"] == 0.0
    with pytest.raises(ValueError, match="icepop needs engine_logp"):
        icepop_policy_loss(logp, old_b, ref, adv, w, mask)


def test_the_effective_sample_size_of_importance_weights():
    from mhgpo.rl.engine_sync import effective_sample_size

    assert effective_sample_size(np.ones(7)) == 1.0
    assert effective_sample_size(np.array([1.0, 0.0, 0.0, 0.0])) == 0.25
    assert effective_sample_size(np.array([2.0, 1.0])) == pytest.approx(9 / 10)
    assert effective_sample_size(np.zeros(0)) == 1.0
