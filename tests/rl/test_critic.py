"""The MAPPO / PPO critic on the tiny model: where it reads values, what it shares with the actor, GAE on real
samples, its update, the warm-up (critic learns, actor does not), and checkpoint / resume with the critic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import count_forward_calls, mappo_config, ragged, samples_of, trainer_for
from helpers import mappo_world as world  # noqa: F401  (a fixture: this module's world)

from mhgpo.config import CriticConfig, LoraConfig, OptimConfig, TrainConfig, load_config
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.model.trained import load_model
from mhgpo.rl.advantages import gae, terminal_token_rewards, whiten
from mhgpo.rl.critic import Critic, build_value_model
from mhgpo.rl.policy import micro_batches
from mhgpo.run.pipeline import resume, train
from mhgpo.runtime.runlog import read_metrics

VOLATILE = ("seconds/", "memory/")


@pytest.fixture()
def model(tiny_model_dir: Path):
    return load_model(str(tiny_model_dir), device="cpu").model


def test_values_are_read_at_the_state_before_each_output_token(model) -> None:
    critic = build_value_model(model, LoraConfig(r=4))
    prompts, outputs = ragged()
    with torch.no_grad():
        values, mask = critic.values(prompts, outputs, pad_id=0)
    assert values.shape == mask.shape == (4, 9)
    assert mask.sum(dim=1).tolist() == [5, 9, 1, 3] and (values[~mask] == 0).all()
    for row, (p, o) in enumerate(zip(prompts, outputs)):  # one sample at a time, no padding
        with torch.no_grad():
            hidden = model.model(input_ids=torch.tensor([p + o])).last_hidden_state[0]  # (L, H); LoRA B = 0
            want = critic.value_head(hidden[len(p) - 1 : len(p) - 1 + len(o)]).squeeze(-1)  # (|o|,)
        torch.testing.assert_close(values[row, : len(o)], want, rtol=0, atol=1e-5)


def test_lora_critic_shares_the_base_weights_and_trains_only_its_adapter_and_head(model) -> None:
    critic = build_value_model(model, LoraConfig(r=4))
    base = dict(model.named_parameters())
    q_critic = critic.backbone.layers[0].self_attn.q_proj
    assert q_critic.base_layer.weight is base["model.layers.0.self_attn.q_proj.weight"]  # same tensor: no copy
    assert critic.backbone.embed_tokens.weight is base["model.embed_tokens.weight"]
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in critic.named_parameters() if ".lora_" in n or n.startswith("value_head.")}
    assert len(trainable) == 2 * 7 * 2 + 2  # A and B of 7 projections x 2 layers, and the head's weight and bias
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.startswith("model."))  # frozen base
    shared_bytes = sum(p.numel() for n, p in critic.named_parameters() if n not in trainable)
    assert shared_bytes == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model."))


def test_lora_critic_with_a_base_of_its_own_copies_it_frozen_and_computes_the_same_values(model) -> None:
    shared = build_value_model(model, LoraConfig(r=4))
    own = build_value_model(model, LoraConfig(r=4), own_base=True)
    base = {p.data_ptr() for p in model.parameters()}
    assert not {p.data_ptr() for p in own.parameters()} & base  # a copy: the memory of one more model
    assert {n for n, p in own.named_parameters() if p.requires_grad} == {
        n for n, p in shared.named_parameters() if p.requires_grad
    }  # the same adapter and head train
    own.load_state_dict(shared.state_dict())  # the same adapter and head weights: the same values
    prompts, outputs = ragged()
    with torch.no_grad():
        a, mask = shared.values(prompts, outputs, pad_id=0)
        b, _ = own.values(prompts, outputs, pad_id=0)
    assert torch.equal(a[mask], b[mask])
    assert load_config(TrainConfig, None, ["critic.own_base=true"]).critic.own_base


def test_full_critic_is_an_independent_copy(model) -> None:
    critic = build_value_model(model, LoraConfig(enabled=False))
    assert all(p.requires_grad for p in critic.parameters())
    ours = {p.data_ptr() for p in critic.parameters()}
    assert not ours & {p.data_ptr() for p in model.parameters()}
    with pytest.raises(ValueError, match="before the policy"):
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model

        build_value_model(get_peft_model(model, PeftLoraConfig(r=2, target_modules=["q_proj"])), LoraConfig())


def test_estimate_fills_gae_from_the_rollout_time_values_and_update_moves_only_the_critic(model) -> None:
    torch.manual_seed(0)
    cfg = CriticConfig(lr=1e-3, gamma=1.0, lam=0.95)
    critic = Critic(model, 0, cfg, OptimConfig(micro_batch_tokens=24), LoraConfig(r=4))
    prompts, outputs = ragged(1)
    samples = samples_of(prompts, outputs)
    old = critic.values(samples)
    stats = critic.estimate(samples)
    lengths = np.array([len(o) for o in outputs])
    mask = np.arange(9)[None, :] < lengths[:, None]
    values = np.zeros(mask.shape)
    for i, v in enumerate(old):
        values[i, : len(v)] = v
    adv, ret = gae(terminal_token_rewards(np.array([s.reward for s in samples]), lengths, 9), values, mask, 1.0, 0.95)
    adv_w = whiten(adv, mask)
    for i, s in enumerate(samples):
        np.testing.assert_allclose(s.old_values, values[i, : lengths[i]], rtol=0, atol=0)
        np.testing.assert_allclose(s.returns, ret[i, : lengths[i]], rtol=0, atol=1e-12)
        np.testing.assert_allclose(s.advantage, adv_w[i, : lengths[i]], rtol=0, atol=1e-12)
        assert s.returns[-1] == pytest.approx(s.reward, abs=1e-12)  # the last token's target is R itself
    assert stats["critic/advantage_mean"] == pytest.approx(float(adv[mask].mean()), abs=1e-12)

    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head_before = critic.model.value_head.weight.detach().clone()
    losses = [critic.update(samples)["critic/loss"] for _ in range(4)]
    assert not torch.equal(critic.model.value_head.weight, head_before)
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters())  # shared base untouched
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]  # same targets: the loss goes down


@pytest.mark.parametrize("lora", [True, False])
def test_gradient_checkpointing_recomputes_the_critic_and_keeps_its_loss_and_gradients(
    tiny_model_dir: Path, lora: bool
) -> None:
    from mhgpo.model.logprobs import backbone_and_head

    results = []
    for checkpointing in (False, True):
        plain = load_model(str(tiny_model_dir), device="cpu").model
        torch.manual_seed(0)  # the same value head and adapter in both runs
        critic = Critic(
            plain,
            0,
            CriticConfig(lr=1e-3),
            OptimConfig(micro_batch_tokens=24, gradient_checkpointing=checkpointing),
            LoraConfig(enabled=lora, r=4),
        )
        calls = count_forward_calls(critic.model.backbone.layers[0].mlp)  # inside a decoder layer
        samples = samples_of(*ragged(2))
        critic.estimate(samples)  # no-grad values: one forward per micro-batch
        before = calls[0]
        stats = critic.update(samples)
        grads = {n: p.grad.clone() for n, p in critic.model.named_parameters() if p.requires_grad}
        results.append((before, calls[0] - before, stats, grads))
        assert not backbone_and_head(plain)[0].layers[0].gradient_checkpointing  # the actor's model: its own switch
    (est_off, upd_off, stats_off, grads_off), (est_on, upd_on, stats_on, grads_on) = results
    n = len(micro_batches([s for s in samples_of(*ragged(2))], 24))
    assert n > 1 and est_off == est_on == n
    assert upd_off == n and upd_on == 2 * n  # forward, and with checkpointing the recomputation in the backward
    assert stats_on["critic/loss"] == pytest.approx(stats_off["critic/loss"], abs=1e-7)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_update_needs_estimated_samples(model) -> None:
    critic = Critic(model, 0, CriticConfig(), OptimConfig(), LoraConfig(r=4))
    with pytest.raises(ValueError, match="estimate"):
        critic.update(samples_of(*ragged()))


# ------------------------------------------------------------------------------------------- in the trainer


def test_during_warm_up_the_critic_learns_and_the_actor_does_not(tiny_model_dir, world, tmp_path) -> None:
    cfg = mappo_config(tiny_model_dir, world, tmp_path / "run", steps=2)
    assert cfg.sampler == "chains"
    trainer = trainer_for(cfg, tmp_path / "run")
    actor, critic = trainer.setup.policy.model, trainer.setup.critic.model
    actor_params = {n: p for n, p in actor.named_parameters() if p.requires_grad}
    critic_params = {n: p for n, p in critic.named_parameters() if p.requires_grad}
    actor_before = {n: p.detach().clone() for n, p in actor_params.items()}
    critic_before = {n: p.detach().clone() for n, p in critic_params.items()}

    m1 = trainer.train_step()  # step 1: the critic's warm-up
    assert m1["actor_updated"] == 0.0 and "loss" not in m1 and m1["critic/grad_norm"] > 0
    assert all(p.grad is None for p in actor_params.values())  # no gradient ever reached the actor
    assert all(torch.equal(p, actor_before[n]) for n, p in actor_params.items())
    head_grad = critic_params["value_head.weight"].grad
    assert head_grad is not None and torch.count_nonzero(head_grad) > 0
    lora_b = [n for n in critic_params if ".lora_B." in n]
    assert lora_b and all(torch.count_nonzero(critic_params[n].grad) > 0 for n in lora_b)
    assert [n for n in critic_params if torch.equal(critic_params[n], critic_before[n])] == [
        n for n in critic_params if ".lora_A." in n
    ]  # B = 0 leaves A's gradient 0 on the first step only

    m2 = trainer.train_step()  # step 2: both learn
    assert m2["actor_updated"] == 1.0 and m2["grad_norm"] > 0
    assert [n for n, p in actor_params.items() if ".lora_B." in n and torch.equal(p, actor_before[n])] == []
    batch = trainer._last_batch
    trained = [n for n in batch.llm_nodes() if n.trained]
    assert len(trained) == 2 * 2 * 3 and len({n.group_id for n in trained}) == 12  # G chains, no groups


def test_mappo_resume_restores_the_critic(tiny_model_dir, world, tmp_path) -> None:
    reference = tmp_path / "reference"
    train(mappo_config(tiny_model_dir, world, reference), progress=False)
    step = reference / "checkpoints" / "step_3"
    assert sorted(p.name for p in step.iterdir()) == [
        "critic.safetensors",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]
    from safetensors.torch import load_file

    optimizer = load_file(str(step / "optimizer.safetensors"))
    state = json.loads((step / "state.json").read_text())
    assert set(state["optimizers"]) == {"actor", "critic"}
    assert any(k.startswith("critic/") for k in optimizer) and any(k.startswith("actor/") for k in optimizer)

    out = tmp_path / "resumed"
    train(mappo_config(tiny_model_dir, world, out, steps=1), progress=False)
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    assert resume(out, ["steps=3"], progress=False).step == 3

    def comparable(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in read_metrics(run)]

    assert comparable(out) == comparable(reference)
    assert [r["actor_updated"] for r in read_metrics(out)] == [0.0, 1.0, 1.0]

    for name in ("model.safetensors", "critic.safetensors"):
        a, b = load_file(str(out / "checkpoints/step_3" / name)), load_file(str(step / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
