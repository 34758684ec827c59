"""The policy (mhgpo/rl/policy.py): its learning-rate warm-up and schedule; one LoRA adapter per agent
(`lora.per_role`): each agent generates with, and learns through, its own adapter; the reference is the base;
checkpoints, resume, loading a run, evaluation and export keep the agents apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_config
from safetensors.torch import load_file

from mhgpo.config import LoraConfig, OptimConfig, load_config
from mhgpo.errors import InputError
from mhgpo.model.generation import HFGenerator, SamplingParams
from mhgpo.model.logprobs import output_logprobs
from mhgpo.model.pretrained import encode_chat
from mhgpo.model.trained import load_model
from mhgpo.rl.policy import Policy, Sample, micro_batches
from mhgpo.run.pipeline import resume, train

ROLES = ("rewriter", "reranker", "answerer")


def per_role_policy(model_dir: Path, lr: float = 1e-2) -> tuple[Policy, object]:
    loaded = load_model(str(model_dir), device="cpu")
    torch.manual_seed(0)
    optim = OptimConfig(lr=lr, kl_beta=0.0, gradient_checkpointing=False, micro_batch_tokens=10_000)
    return Policy(
        loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4, per_role=True), 10, roles=ROLES
    ), loaded


def adapter_b(policy: Policy, role: str) -> list[torch.Tensor]:
    return [p.detach().clone() for n, p in policy.model.named_parameters() if f".lora_B.{role}." in n]


def sampled(policy: Policy, loaded, agent: str, n: int = 3, seed: int = 0) -> list[Sample]:
    """On-policy samples of `agent`: generated with its adapter, log-probs as the sampler recorded them."""
    gen = HFGenerator(policy.model, loaded.tokenizer, batch_size=4, select=policy.acting_as)
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Who wrote the novel Dune?"}])
    torch.manual_seed(seed)
    outs = gen.generate([prompt] * n, SamplingParams(8, 1.0, 1.0, agent))
    return [Sample(g.prompt_ids, g.output_ids, g.logprobs, float(i) - 1.0, agent) for i, g in enumerate(outs)]


def test_each_agent_learns_through_its_own_adapter_only(tiny_model_dir: Path) -> None:
    policy, loaded = per_role_policy(tiny_model_dir)
    assert len(policy.params) == 3 * len(
        [n for n, _ in policy.model.named_parameters() if ".lora_A.rewriter." in n or ".lora_B.rewriter." in n]
    )
    before = {r: adapter_b(policy, r) for r in ROLES}
    assert all(float(t.abs().max()) == 0.0 for r in ROLES for t in before[r])  # LoRA starts at the base
    policy.update(sampled(policy, loaded, "reranker"))
    after = {r: adapter_b(policy, r) for r in ROLES}
    assert any(float(t.abs().max()) > 0 for t in after["reranker"])
    for r in ("rewriter", "answerer"):  # untouched: no sample of theirs
        assert all(torch.equal(a, b) for a, b in zip(before[r], after[r]))
    with pytest.raises(ValueError, match="no adapter for agent 'planner'"):
        with policy.acting_as("planner"):
            pass


def test_sampler_and_trainer_agree_per_agent_and_the_reference_is_the_base(tiny_model_dir: Path) -> None:
    policy, loaded = per_role_policy(tiny_model_dir)
    policy.update(sampled(policy, loaded, "answerer"))  # the Answerer's adapter moves away from the base
    fresh = sampled(policy, loaded, "answerer", seed=1) + sampled(policy, loaded, "rewriter", seed=1)
    for s in fresh:  # what the sampler recorded is what the trainer recomputes, agent by agent
        logp, mask = policy.logprobs([s])
        torch.testing.assert_close(logp[0, : len(s.output_ids)], torch.tensor(s.old_logprobs), atol=1e-5, rtol=0)
    base = load_model(str(tiny_model_dir), device="cpu").model
    ref = policy.reference_logprobs(fresh)
    for s, r in zip(fresh, ref):
        with torch.no_grad():
            expected, _ = output_logprobs(base, [s.prompt_ids], [s.output_ids], pad_id=policy.pad_id)
        torch.testing.assert_close(r, expected[0, : len(s.output_ids)], atol=1e-5, rtol=0)
    answerer = [s for s in fresh if s.agent == "answerer"]
    as_rewriter = [Sample(s.prompt_ids, s.output_ids, s.old_logprobs, 0.0, "rewriter") for s in answerer]
    assert not torch.allclose(policy.logprobs(answerer)[0], policy.logprobs(as_rewriter)[0])  # different adapters


def test_micro_batches_by_agent_never_mix_agents() -> None:
    samples = [Sample([1] * (3 + i % 4), [2] * 2, [0.0] * 2, 0.0, ROLES[i % 3]) for i in range(20)]
    batches = micro_batches(samples, 64, by_agent=True)
    assert sorted(i for b in batches for i in b) == list(range(20))
    assert all(len({samples[i].agent for i in b}) == 1 for b in batches)
    assert any(len({samples[i].agent for i in b}) > 1 for b in micro_batches(samples, 64))


@pytest.fixture(scope="module")
def per_role_run(tmp_path_factory, tiny_model_dir, world):  # noqa: F811
    out = tmp_path_factory.mktemp("runs") / "per_role"
    trainer = train(
        make_config(tiny_model_dir, world, out, steps=2, save_every=1, precision="fp32", **{"lora.per_role": "true"}),
        progress=False,
    )
    return out, trainer


def test_a_per_role_run_saves_resumes_loads_and_exports_each_agent(
    per_role_run, tiny_model_dir, world, tmp_path, capsys
) -> None:  # noqa: F811
    from mhgpo.cli.main import main

    out, trainer = per_role_run
    tensors = load_file(str(out / "checkpoints" / "step_2" / "model.safetensors"))
    assert {k.split(".lora_")[1].split(".")[1] for k in tensors} == set(ROLES)
    # resume: the same run, continued from step 1
    part = tmp_path / "part"
    train(
        make_config(tiny_model_dir, world, part, steps=1, save_every=1, precision="fp32", **{"lora.per_role": "true"}),
        progress=False,
    )
    resume(part, ["steps=2"], progress=False)
    again = load_file(str(part / "checkpoints" / "step_2" / "model.safetensors"))
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)
    # evaluating the run loads every agent's adapter: the same answers as the trainer's own validation
    rc = main(
        [
            "eval",
            "--model",
            str(out),
            "--data",
            f"hotpotqa:{world / 'dev.jsonl'}",
            "--limit",
            "2",
            "--corpus",
            str(world / "corpus.jsonl"),
            "--output-dir",
            str(tmp_path / "ev"),
            "precision=fp32",
            "search.rewriter.max_new_tokens=8",
            "search.reranker.max_new_tokens=4",
            "search.answerer.max_new_tokens=4",
            "search.max_answer_words=1",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "ev" / "predictions.jsonl").read_text().splitlines()]
    in_process = trainer.last_eval[1].predictions
    assert [r["prediction"] for r in rows] == [p["prediction"] for p in in_process[:2]]
    # export: no single merged model; the shared weights in base/, each agent's adapter in its sub-folder
    assert main(["export", str(out), "--out", str(tmp_path / "exp")]) == 0
    assert sorted(p.name for p in (tmp_path / "exp").iterdir() if p.is_dir()) == sorted([*ROLES, "base"])
    assert "no single merged model" in (tmp_path / "exp" / "README.md").read_text()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp" / "base"))
    answerer = PeftModel.from_pretrained(base, str(tmp_path / "exp" / "answerer")).eval()
    loaded = load_model(str(out), device="cpu")
    probe = [encode_chat(loaded.tokenizer, [{"role": "user", "content": "Capital of France?"}])]
    with torch.no_grad(), loaded.select("answerer"):
        expected, _ = output_logprobs(loaded.model, probe, [[5, 6, 7]], pad_id=loaded.tokenizer.pad_token_id)
        got, _ = output_logprobs(answerer, probe, [[5, 6, 7]], pad_id=loaded.tokenizer.pad_token_id)
    assert torch.equal(got, expected)
    # `--model EXPORT` is the team again: the same answers as the run's
    rc = main(
        [
            "eval",
            "--model",
            str(tmp_path / "exp"),
            "--data",
            f"hotpotqa:{world / 'dev.jsonl'}",
            "--limit",
            "2",
            "--corpus",
            str(world / "corpus.jsonl"),
            "--output-dir",
            str(tmp_path / "ev-exp"),
            "precision=fp32",
            "search.rewriter.max_new_tokens=8",
            "search.reranker.max_new_tokens=4",
            "search.answerer.max_new_tokens=4",
            "search.max_answer_words=1",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    again = [json.loads(line) for line in (tmp_path / "ev-exp" / "predictions.jsonl").read_text().splitlines()]
    assert [r["trace"] for r in again] == [r["trace"] for r in rows]
    assert main(["export", str(out), "--out", str(tmp_path / "ad"), "--lora-only"]) == 0
    assert {p.name for p in (tmp_path / "ad").iterdir() if p.is_dir()} >= set(ROLES[1:])


def test_a_per_role_run_cannot_seed_another_run_nor_a_warm_start_be_per_role(
    per_role_run, tiny_model_dir, world, tmp_path
) -> None:  # noqa: F811
    from mhgpo.config import SFTConfig, load_config

    out, _ = per_role_run
    with pytest.raises(InputError, match="one adapter per agent"):
        train(make_config(out, world, tmp_path / "next"), progress=False)
    with pytest.raises(InputError, match="lora.per_role"):
        load_config(SFTConfig, None, ["lora.per_role=true"])


# ----------------------------------------------------------------------------------------------- the learning rate


def test_warm_up_starts_below_the_lr_and_reaches_it():
    from mhgpo.config import OptimConfig, TrainConfig
    from mhgpo.rl.policy import _lr_lambda

    assert [_lr_lambda(OptimConfig(warmup_steps=0), 10)(t) for t in range(2)] == [1.0, 1.0]
    assert [_lr_lambda(OptimConfig(warmup_steps=1), 10)(t) for t in range(3)] == [0.5, 1.0, 1.0]
    assert [_lr_lambda(OptimConfig(warmup_steps=3), 10)(t) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = _lr_lambda(OptimConfig(warmup_steps=2, schedule="cosine"), 6)
    assert [round(cosine(t), 6) for t in range(7)] == [
        round(1 / 3, 6),
        round(2 / 3, 6),
        1.0,
        0.853553,
        0.5,
        0.146447,
        0.0,
    ]
    with pytest.raises(InputError, match=r"optim\.warmup_steps: must be >= 0"):
        load_config(TrainConfig, None, ["optim.warmup_steps=-1"])


def test_the_logged_lr_is_the_one_the_update_applied(tiny_model_dir: Path) -> None:
    """With one warm-up step the first update runs at lr / 2 and logs it (it once logged the next update's lr);
    Adam's first step moves a weight by about lr, which tells the applied rate apart from the logged one."""
    loaded = load_model(str(tiny_model_dir), device="cpu")
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-2, kl_beta=0.0, warmup_steps=1, gradient_checkpointing=False, micro_batch_tokens=10_000)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10)
    samples = sampled(policy, loaded, "answerer")
    before = [p.detach().clone() for p in policy.params]
    first = policy.update(samples)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(policy.params, before))
    assert first["lr"] == pytest.approx(5e-3, rel=1e-12)
    assert moved == pytest.approx(5e-3, rel=1e-3)  # Adam's first step: lr * sign(gradient)
    assert policy.update(samples)["lr"] == pytest.approx(1e-2, rel=1e-12)


def test_a_learning_rate_per_role_moves_each_adapter_at_its_own_rate(tiny_model_dir: Path) -> None:
    """`optim.role_lr`: each role's adapter in its own parameter group; Adam's first step moves a weight by about
    its group's lr, and each role's applied rate is logged."""
    loaded = load_model(str(tiny_model_dir), device="cpu")
    torch.manual_seed(0)
    optim = OptimConfig(
        lr=1e-2, kl_beta=0.0, gradient_checkpointing=False, micro_batch_tokens=10_000, role_lr={"answerer": 1e-3}
    )
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4, per_role=True), 10, roles=ROLES)
    samples = sampled(policy, loaded, "reranker") + sampled(policy, loaded, "answerer")
    before = {r: adapter_b(policy, r) for r in ROLES}
    got = policy.update(samples)
    moved = {r: max(float((a - b).abs().max()) for a, b in zip(adapter_b(policy, r), before[r])) for r in ROLES}
    assert moved["reranker"] == pytest.approx(1e-2, rel=1e-3) and moved["answerer"] == pytest.approx(1e-3, rel=1e-3)
    assert moved["rewriter"] == 0.0  # no sample of its own
    assert (got["lr/rewriter"], got["lr/reranker"], got["lr/answerer"]) == (1e-2, 1e-2, 1e-3)
    with pytest.raises(ValueError, match="one adapter per role"):
        Policy(load_model(str(tiny_model_dir), device="cpu").model, 0, optim, LoraConfig(r=4), 10)


@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_the_entropy_bonus_is_the_whole_loss_when_advantages_are_zero(tiny_model_dir: Path, coef: float) -> None:
    """`optim.entropy_coef`: with every advantage 0 and no KL term the objective is - c * sum_i w_i sum_t H_it
    alone (w the step-wide token weights), the update raises the policy's entropy and logs its token mean; at c = 0
    nothing moves and no entropy is logged."""
    from mhgpo.rl.losses import token_weights
    from mhgpo.rl.reference import output_entropy_reference

    loaded = load_model(str(tiny_model_dir), device="cpu")
    torch.manual_seed(0)
    optim = OptimConfig(
        lr=1e-3, kl_beta=0.0, gradient_checkpointing=False, micro_batch_tokens=40, logprob_chunk=3, entropy_coef=coef
    )
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10)
    samples = sampled(policy, loaded, "answerer", n=4) + sampled(policy, loaded, "reranker", n=3, seed=1)
    for s in samples:
        s.advantage = 0.0

    def entropy() -> torch.Tensor:  # (N, T) by the slow reference, the trained adapter on
        with torch.no_grad():
            return output_entropy_reference(
                policy.model, [s.prompt_ids for s in samples], [s.output_ids for s in samples]
            )

    before, params = entropy(), [p.detach().clone() for p in policy.params]
    got = policy.update(samples)
    lengths = [len(s.output_ids) for s in samples]
    w = token_weights([s.agent for s in samples], lengths)  # (N,)
    if coef == 0:
        assert "entropy" not in got and got["loss"] == 0.0
        assert all(torch.equal(p.detach(), b) for p, b in zip(policy.params, params))
        return
    assert got["loss"] == pytest.approx(-coef * float((w[:, None] * before).sum()), rel=1e-5)
    assert got["entropy"] == pytest.approx(float(before.sum()) / sum(lengths), rel=1e-5)
    assert float((w[:, None] * entropy()).sum()) > float((w[:, None] * before).sum())


def test_role_lr_is_refused_without_an_adapter_per_role():
    from mhgpo.config import SFTConfig, TrainConfig

    with pytest.raises(InputError, match=r"optim\.role_lr: a learning rate per role needs an adapter per role"):
        load_config(TrainConfig, None, ["optim.role_lr.reranker=3e-5"])
    cfg = load_config(TrainConfig, None, ["optim.role_lr.reranker=3e-5", "lora.per_role=true"])
    assert cfg.optim.role_lr == {"reranker": 3e-5}
    with pytest.raises(InputError, match=r"optim\.role_lr\.reranker: must be positive, got -1.0"):
        load_config(TrainConfig, None, ["optim.role_lr.reranker=-1", "lora.per_role=true"])
    with pytest.raises(InputError, match=r"optim\.role_lr\.reranker: expected a number, got 'x'"):
        load_config(TrainConfig, None, ["optim.role_lr.reranker=x", "lora.per_role=true"])
    with pytest.raises(InputError, match=r"optim\.role_lr: a warm start trains one shared adapter"):
        load_config(SFTConfig, None, ["optim.role_lr.reranker=3e-5"])


def test_role_lr_naming_no_role_of_the_team_is_refused_before_loading(tiny_model_dir: Path, world: Path, tmp_path):
    from mhgpo.run.setup import settle

    cfg = make_config(
        tiny_model_dir, world, tmp_path / "r", **{"lora.per_role": "true", "optim.role_lr.critic": "1e-5"}
    )
    with pytest.raises(
        InputError, match=r"optim\.role_lr: unknown role 'critic' \(roles: rewriter, reranker, answerer\)"
    ):
        settle(cfg)
