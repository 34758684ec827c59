"""Shared-prefix packing: the layout, micro-batch cutting, and log-probs, values, losses and gradients equal to one row
per sample (fp32 to 1e-6, bf16-mixed within bfloat16's rounding) for the policy (LoRA, per-role
LoRA and full fine-tuning, with and without gradient checkpointing), its reference, the critic and the warm start's
cross-entropy."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from mhgpo.config import CriticConfig, LoraConfig, OptimConfig
from mhgpo.model.logprobs import backbone_and_head, output_logprobs
from mhgpo.model.modules import enable_gradient_checkpointing
from mhgpo.model.packing import MICRO_BATCH_COST, pack, segment_length, segments
from mhgpo.model.packing import micro_batches as pack_micro_batches
from mhgpo.model.trained import load_model
from mhgpo.rl.critic import Critic
from mhgpo.rl.policy import Policy, Sample, micro_batches
from mhgpo.rl.reference import output_logprobs_reference
from mhgpo.rl.sft import sft_update


def grouped_batch(seed: int = 0, vocab: int = 400) -> tuple[list[list[int]], list[list[int]]]:
    """Two forked groups (G = 4 and 3, ragged outputs, one empty, one of a single token) and two lone prompts."""
    rng = random.Random(seed)
    a, b, c, d = ([rng.randrange(4, vocab) for _ in range(n)] for n in (23, 11, 30, 2))
    prompts = [a, b, a, c, a, b, d, a, b]
    lengths = [5, 3, 1, 6, 0, 7, 4, 9, 2]
    outputs = [[rng.randrange(0, vocab) for _ in range(n)] for n in lengths]
    return prompts, outputs


def fresh(model_dir: Path, dtype: torch.dtype | None = None):
    return load_model(str(model_dir), device="cpu", dtype=dtype)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> None:
    """Every gradient within ``rel`` of the largest entry (a LoRA A has none before its B has moved off 0)."""
    assert a.keys() == b.keys() and a
    scale = max(float(g.abs().max()) for g in b.values())
    assert sum(float(g.abs().sum()) > 0 for g in b.values()) >= len(b) / 2
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rel, atol=rel * scale, msg=name)


# ------------------------------------------------------------------------------------------------- layout


def test_a_group_is_one_row_with_restarted_positions_and_sibling_blind_attention() -> None:
    p, q = [11, 12, 13], [21, 22]
    packed = pack([p, q, p], [[1, 2, 3], [4], [5, 6]], pad_id=0, style="bool")
    assert packed.input_ids.tolist() == [[11, 12, 13, 1, 2, 5], [21, 22, 0, 0, 0, 0]]  # last output tokens dropped
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]  # each output restarts after the prompt
    # predicting positions, sample order: sample 0 (3 tokens), sample 1 (1), sample 2 (2)
    assert list(zip(packed.rows.tolist(), packed.cols.tolist())) == [(0, 2), (0, 3), (0, 4), (1, 1), (0, 2), (0, 5)]
    mask = packed.attention_mask[0, 0]  # (L, L), query x key
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],  # output 0, token 0: the prompt and itself
            [1, 1, 1, 1, 1, 0],
            [1, 1, 1, 0, 0, 1],  # output 2's token: the prompt and itself, not its sibling
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    pad = packed.attention_mask[1, 0]
    assert torch.equal(pad[2:], torch.eye(6, dtype=torch.bool)[2:])  # padding attends to itself only
    additive = pack([p, q, p], [[1, 2, 3], [4], [5, 6]], pad_id=0, style="additive").attention_mask
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, packed.attention_mask)


def test_without_sharing_every_sample_keeps_its_own_row() -> None:
    packed = pack([[1, 2], [1, 2]], [[3, 4], [5]], pad_id=9, style=None)
    assert packed.input_ids.tolist() == [[1, 2, 3], [1, 2, 9]]
    assert packed.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    lone = pack([[1, 2], [3]], [[3, 4], [5, 6]], pad_id=9, style="bool")  # no prompt repeats: nothing to share
    assert lone.input_ids.tolist() == [[1, 2, 3], [3, 5, 9]] and lone.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_micro_batches_keep_groups_whole_split_large_ones_and_stay_within_the_budget() -> None:
    rng = random.Random(3)
    prompts, outputs, keys = [], [], []
    for g in range(12):
        prompt = [g] * rng.randrange(5, 40)
        for _ in range(rng.choice([1, 4, 4, 6])):
            prompts.append(prompt)
            outputs.append([1] * rng.randrange(1, 12))
            keys.append(g % 2)
    lens = [len(o) for o in outputs]
    for budget in (40, 64, 200, 10**6):
        batches = pack_micro_batches(prompts, lens, budget, keys)
        assert sorted(i for b in batches for i in b) == list(range(len(prompts)))
        for b in batches:
            assert len({keys[i] for i in b}) == 1
            segs: dict[tuple, list[int]] = {}
            for i in b:
                segs.setdefault(tuple(prompts[i]), []).append(i)
            lengths = [segment_length(len(p), [lens[i] for i in idx]) for p, idx in segs.items()]
            assert len(segs) * max(lengths) <= budget or len(segs) == 1
        for prompt in {tuple(p) for p in prompts}:  # a group fits the budget: it is in one micro-batch
            members = [i for i, p in enumerate(prompts) if tuple(p) == prompt]
            if segment_length(len(prompt), [lens[i] for i in members]) <= budget:
                assert sum(any(i in b for i in members) for b in batches) == 1
    assert len(pack_micro_batches(prompts, lens, 10**6, keys, least_padding=False)) == 2  # one per key
    assert len(pack_micro_batches(prompts, lens, 1, keys)) == len(prompts)


def _padded_cost(prompts, lens, batches) -> int:
    """Padded tokens of `batches` (rows × longest segment), each micro-batch counted MICRO_BATCH_COST more."""
    total = 0
    for b in batches:
        segs: dict[tuple, list[int]] = {}
        for i in b:
            segs.setdefault(tuple(prompts[i]), []).append(i)
        total += len(segs) * max(segment_length(len(p), [lens[i] for i in idx]) for p, idx in segs.items())
    return total + MICRO_BATCH_COST * len(batches)


def test_the_least_padded_cut_is_the_cheapest_of_every_cut_and_never_costs_more_than_filling_in_turn() -> None:
    """The default cut of the sorted segments has the fewest padded tokens (+ MICRO_BATCH_COST per micro-batch) of
    all cuts into runs within the budget (every cut enumerated on small cases), so never more than filling each
    micro-batch in turn; both keep the budget, keys and groups as above."""
    rng = random.Random(5)
    for _case in range(40):
        prompts, lens = [], []
        for g in range(rng.randrange(1, 9)):
            prompt = [g] * rng.randrange(20, 400)
            for _ in range(rng.choice([1, 2, 4])):
                prompts.append(prompt)
                lens.append(rng.randrange(1, 40))
        budget = rng.choice([512, 1024, 2048])
        best = pack_micro_batches(prompts, lens, budget)
        greedy = pack_micro_batches(prompts, lens, budget, least_padding=False)
        assert sorted(i for b in best for i in b) == list(range(len(prompts)))
        assert _padded_cost(prompts, lens, best) <= _padded_cost(prompts, lens, greedy)
        seg_lengths = sorted(
            segment_length(len(prompts[g[0]]), [lens[i] for i in g]) for g in segments(prompts)
        )  # (the groups fit these budgets whole)
        if len(seg_lengths) <= 10:  # every cut of the sorted lengths into contiguous runs
            n, cheapest = len(seg_lengths), None
            for mask in range(2 ** max(n - 1, 0)):
                cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
                runs = list(zip(cuts, cuts[1:]))
                if any(hi - lo > 1 and (hi - lo) * seg_lengths[hi - 1] > budget for lo, hi in runs):
                    continue
                cost = sum((hi - lo) * seg_lengths[hi - 1] + MICRO_BATCH_COST for lo, hi in runs)
                cheapest = cost if cheapest is None else min(cheapest, cost)
            assert _padded_cost(prompts, lens, best) == cheapest


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_logprobs_and_gradients_equal_one_row_per_sample(tiny_model_dir, attention, checkpointing) -> None:
    prompts, outputs = grouped_batch()
    model = fresh(tiny_model_dir).model
    model.config._attn_implementation = attention
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    weights = torch.linspace(0.5, 1.5, 9)  # (T,) a non-uniform loss
    results = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        logp, mask = output_logprobs(model, prompts, outputs, chunk_size=7, share=share)
        (logp * weights * mask).sum().backward()
        results.append((logp.detach(), mask, grads(model)))
    (shared, mask, g_shared), (alone, alone_mask, g_alone) = results
    assert torch.equal(mask, alone_mask)
    torch.testing.assert_close(shared, alone, rtol=1e-6, atol=1e-6)
    assert_grads_close(g_shared, g_alone, 1e-6)
    with torch.no_grad():
        ref, _ = output_logprobs_reference(model, prompts, outputs)
    torch.testing.assert_close(shared, ref, rtol=1e-6, atol=1e-5)


def test_the_prompt_is_computed_once_per_group(tiny_model_dir) -> None:
    prompts, outputs = grouped_batch()
    model = fresh(tiny_model_dir).model
    seen: list[tuple[int, ...]] = []
    embed = backbone_and_head(model)[0].embed_tokens
    handle = embed.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        output_logprobs(model, prompts, outputs)
        output_logprobs(model, prompts, outputs, share=False)
    handle.remove()
    (rows, width), (alone_rows, alone_width) = seen
    assert rows == 4  # the prompts a, b, c, d
    assert width == segment_length(23, [5, 1, 0, 9]) == segment_length(30, [6]) == 35  # a and its four outputs
    assert alone_rows == 9 and rows * width < 0.6 * alone_rows * alone_width


def test_bf16_mixed_shared_logprobs_agree_within_bfloat16_rounding(tiny_model_dir) -> None:
    prompts, outputs = grouped_batch(2)
    model = fresh(tiny_model_dir, dtype=torch.bfloat16).model
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        shared, mask = output_logprobs(model, prompts, outputs, share=True)
        alone, _ = output_logprobs(model, prompts, outputs, share=False)
    gaps = (shared - alone)[mask].abs()
    # bfloat16 matmuls over different shapes round differently: measured 5e-3 on average, 2.5e-2 at most
    assert float(gaps.mean()) < 2e-2 and float(gaps.max()) < 0.1


AGENTS = ["rewriter", "reranker", "rewriter", "answerer", "rewriter", "reranker", "answerer", "rewriter", "reranker"]


def group_samples(loaded) -> list[Sample]:
    """The grouped batch as samples of three agents (each prompt belongs to one agent), with old log-probs off the
    current policy's so that ratios clip."""
    prompts, outputs = grouped_batch(4, vocab=len(loaded.tokenizer))
    advantages = [0.5, -1.0, 1.2, 0.3, 0.0, 0.7, -0.4, -0.9, 0.2]
    with torch.no_grad():
        logp, _ = output_logprobs(loaded.model, prompts, outputs, share=False)
    return [
        Sample(p, o, [float(x) + 0.25 * (i % 3 - 1) for x in logp[i, : len(o)]], a, agent, reward=a)
        for i, (p, o, a, agent) in enumerate(zip(prompts, outputs, advantages, AGENTS))
    ]


def recording_steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Record every trainable gradient as the optimiser is about to step (the accumulated, clipped gradient)."""
    seen: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(grads(model)))  # step itself stays PyTorch's
    return seen


def assert_stats_close(a: dict[str, float], b: dict[str, float], rel: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if not key.startswith("seconds/"):  # (timings: the only figures that may differ)
            assert a[key] == pytest.approx(b[key], rel=rel, abs=rel), key


def policy_run(model_dir: Path, share: bool, lora: str, checkpointing: bool, precision: str = "fp32"):
    """An update of one epoch, then one of two (clipped ratios, a KL term): their stats and gradients, then the
    reference's log-probs and the weights."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" and lora != "full" else None
    loaded = fresh(model_dir, dtype)
    samples = group_samples(loaded)
    torch.manual_seed(0)
    optim = OptimConfig(
        lr=1e-2,
        kl_beta=0.1,
        micro_batch_tokens=60,
        share_prefix=share,
        ppo_epochs=1,
        gradient_checkpointing=checkpointing,
    )
    lora_cfg = LoraConfig(r=4, enabled=lora != "full", per_role=lora == "per_role")
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        optim,
        lora_cfg,
        10,
        precision=precision,
        roles=tuple(sorted(set(AGENTS))),
    )
    # plain SGD: Adam's first step turns the rounding noise of a near-zero gradient into a full step of either sign,
    # so the runs would no longer be comparable after it
    policy.optimizer = torch.optim.SGD(policy.params, lr=0.02)
    policy.scheduler = torch.optim.lr_scheduler.ConstantLR(policy.optimizer, factor=1.0)  # on the optimiser it steps
    seen = recording_steps(policy.optimizer, policy.model)
    stats = [policy.update(copy.deepcopy(samples))]
    optim.ppo_epochs = 2
    stats.append(policy.update(copy.deepcopy(samples)))
    ref = policy.reference_logprobs(samples)
    weights = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return stats, seen, ref, weights


@pytest.mark.parametrize(
    "lora,checkpointing", [("lora", False), ("lora", True), ("per_role", True), ("full", False), ("full", True)]
)
def test_a_policy_update_is_the_same_with_shared_prompts(tiny_model_dir, lora, checkpointing) -> None:
    """The first step's loss and statistics equal the unshared computation to 1e-6 in fp32, and every gradient to
    4e-6 of the largest (LoRA, per-role LoRA, full fine-tuning; measured at most 1.5e-6, per-role LoRA on a CPU with
    AVX2 only, whose float32 kernels sum in another order: under 1e-6 with AVX-512); the two steps after it, taken
    from weights that already differ by the first step's rounding, to 1e-5, and so do the weights at the end; the
    reference's log-probs to 1e-6."""
    shared = policy_run(tiny_model_dir, True, lora, checkpointing)
    alone = policy_run(tiny_model_dir, False, lora, checkpointing)
    (stats, seen, ref, weights), (stats_alone, seen_alone, ref_alone, weights_alone) = shared, alone
    assert_stats_close(stats[0], stats_alone[0], 1e-6)
    assert_stats_close(stats[1], stats_alone[1], 1e-5)
    assert stats[1]["clip_fraction"] > 0 and stats[1]["kl"] > 0
    assert len(seen) == len(seen_alone) == 3
    assert_grads_close(seen[0], seen_alone[0], 4e-6)
    for g, h in zip(seen[1:], seen_alone[1:]):
        assert_grads_close(g, h, 1e-5)
    for r, t in zip(ref, ref_alone):
        torch.testing.assert_close(r, t, rtol=1e-6, atol=1e-6)
    for name in weights:
        torch.testing.assert_close(weights[name], weights_alone[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("lora", ["lora", "full"])
def test_a_bf16_mixed_update_agrees_within_bfloat16_rounding(tiny_model_dir, lora) -> None:
    """bf16-mixed (float32 master weights, bfloat16 autocast; a bfloat16 base under LoRA): the shared and unshared
    rows multiply differently shaped matrices, so they round differently, and how much depends on the CPU's bfloat16
    kernels. The first step's gradients agree to 3e-2 of the largest entry, its gradient norm to 4e-2 relative, its
    mean ratio to 2^-8 relative (one bfloat16 step), its loss (a sum of terms of both signs, about 1e-2) to 8e-3.
    Measured at most: 4e-3, 2e-3, 1e-4, 7e-4 on a CPU with AMX; the ratio 2.1e-3 on one with AVX-512 bfloat16
    instructions only; 8e-3, 2.0e-2, 1.9e-4, 4.0e-3 under full fine-tuning on one with AVX2 only, whose kernels are
    the farthest from float32 (each of the two runs' gradients 1.6e-2 and 2.2e-2 of the largest entry from the
    float32 update's). A packing error (a wrong mask or position) moves them by the order of the entries themselves."""
    (stats, seen, _, _), (stats_alone, seen_alone, _, _) = (
        policy_run(tiny_model_dir, share, lora, True, "bf16-mixed") for share in (True, False)
    )
    assert stats[0]["loss"] == pytest.approx(stats_alone[0]["loss"], abs=8e-3)
    assert stats[0]["grad_norm"] == pytest.approx(stats_alone[0]["grad_norm"], rel=4e-2)
    assert stats[0]["ratio"] == pytest.approx(stats_alone[0]["ratio"], rel=2**-8)
    assert_grads_close(seen[0], seen_alone[0], 3e-2)


def critic_run(model_dir: Path, share: bool, lora: bool):
    loaded = fresh(model_dir)
    samples = group_samples(loaded)
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-2, micro_batch_tokens=60, share_prefix=share)
    critic = Critic(
        loaded.model, loaded.tokenizer.pad_token_id, CriticConfig(lr=1e-2), optim, LoraConfig(r=4, enabled=lora)
    )
    critic.optimizer = torch.optim.SGD([p for p in critic.model.parameters() if p.requires_grad], lr=0.1)  # as above
    seen = recording_steps(critic.optimizer, critic.model)
    estimate = critic.estimate(samples)
    before = [s.old_values for s in samples]
    update = critic.update(samples)
    return estimate, before, update, seen, critic.values(samples)


@pytest.mark.parametrize("lora", [True, False])
def test_the_critic_reads_and_learns_the_same_with_shared_prompts(tiny_model_dir, lora) -> None:
    shared, alone = critic_run(tiny_model_dir, True, lora), critic_run(tiny_model_dir, False, lora)
    assert_stats_close(shared[0], alone[0], 1e-6)
    for a, b in zip(shared[1], alone[1]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)
    assert_stats_close(shared[2], alone[2], 1e-6)
    for g, h in zip(shared[3], alone[3]):
        assert_grads_close(g, h, 1e-6)
    for a, b in zip(shared[4], alone[4]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_the_warm_start_loss_and_step_are_the_same_with_shared_prompts(tiny_model_dir) -> None:
    out = []
    for share in (True, False):
        loaded = fresh(tiny_model_dir)
        samples = group_samples(loaded)
        torch.manual_seed(0)
        optim = OptimConfig(lr=1e-2, micro_batch_tokens=60, share_prefix=share)
        policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10, keep_reference=False)
        seen = recording_steps(policy.optimizer, policy.model)
        out.append((sft_update(policy, samples), seen))
    assert_stats_close(out[0][0], out[1][0], 1e-6)
    assert_grads_close(out[0][1][0], out[1][1][0], 1e-6)


def test_policy_micro_batches_share_prompts_by_agent() -> None:
    samples = [Sample([7] * 30, [1] * 4, [0.0] * 4, 0.0, "a") for _ in range(4)]
    samples += [Sample([7] * 30, [1] * 4, [0.0] * 4, 0.0, "b") for _ in range(4)]
    shared = micro_batches(samples, 50)  # one segment of 30 + 8 × 3 tokens would not fit: pieces of 6 and 2
    assert sorted(len(b) for b in shared) == [2, 6]
    assert all(len({samples[i].agent for i in b}) == 1 for b in micro_batches(samples, 10**4, by_agent=True))
    assert len(micro_batches(samples, 10**4)) == 1 and len(micro_batches(samples, 10**4, by_agent=True)) == 2
    assert len(micro_batches(samples, 40, share=False)) == 8


def test_no_sharing_where_the_attention_takes_no_custom_mask_or_slides() -> None:
    from types import SimpleNamespace

    from mhgpo.model.packing import mask_style

    assert mask_style(SimpleNamespace(_attn_implementation="sdpa")) == "bool"
    assert mask_style(SimpleNamespace(_attn_implementation="eager")) == "additive"
    assert mask_style(SimpleNamespace(_attn_implementation="flash_attention_2")) is None
    assert mask_style(SimpleNamespace(_attn_implementation="sdpa", sliding_window=4096)) is None
    assert (
        mask_style(SimpleNamespace(_attn_implementation="sdpa", layer_types=["full_attention", "sliding_attention"]))
        is None
    )


def test_the_least_padded_cut_leaves_the_warm_start_step_and_the_update_as_filling_in_turn(
    tiny_model_dir, monkeypatch
) -> None:
    """The micro-batches of the least padded cut hold other samples together than those filled in turn: a
    warm-start step, then an RL update (clipped ratios, a KL term), give the same loss and statistics and the same
    accumulated gradients to float32 rounding (1e-6: rows padded to other widths, the micro-batches' sums added in
    another order)."""
    import mhgpo.model.packing as packing

    cut = packing.micro_batches
    runs = []
    for least in (True, False):
        monkeypatch.setattr(packing, "micro_batches", lambda *a, least=least, **k: cut(*a, **k, least_padding=least))
        loaded = fresh(tiny_model_dir)
        samples = group_samples(loaded)
        seen_batches = micro_batches(samples, 80, share=False)
        torch.manual_seed(0)
        optim = OptimConfig(lr=1e-2, micro_batch_tokens=80, kl_beta=0.1, share_prefix=False)
        policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10, keep_reference=False)
        seen = recording_steps(policy.optimizer, policy.model)
        warm = sft_update(policy, samples)
        update = policy.update(samples)
        runs.append((seen_batches, warm, update, seen))
    assert runs[0][0] != runs[1][0]  # the cuts differ on this batch
    for k in (1, 2):
        assert_stats_close(runs[0][k], runs[1][k], 1e-6)
    for a, b in zip(runs[0][3], runs[1][3], strict=True):
        assert_grads_close(a, b, 1e-6)
