"""Precision on the tiny model: `auto` resolution, float32 master weights under bf16-mixed (bfloat16 autocast runs on
CPU too) against pure bf16, the MAPPO critic's dtypes, sampler / trainer log-probabilities under each precision, and
dropout switched off in the recomputed log-probabilities while gradient checkpointing still recomputes."""

from __future__ import annotations

import json
import shutil
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from helpers import count_forward_calls, hand_samples, mappo_config, ragged, samples_of, trainer_for
from helpers import mappo_world as world  # noqa: F401  (a fixture: this module's world)

from mhgpo.config import LoraConfig, OptimConfig, TrainConfig, load_config
from mhgpo.errors import InputError
from mhgpo.model import precision as prec
from mhgpo.model.generation import HFGenerator, SamplingParams
from mhgpo.model.logprobs import backbone_and_head
from mhgpo.model.modules import no_dropout
from mhgpo.model.precision import resolve_precision, weight_dtype
from mhgpo.model.pretrained import encode_chat
from mhgpo.model.trained import load_model
from mhgpo.rl.policy import Policy, Sample, micro_batches, reference_segments

QUESTIONS = ["Who wrote the novel Dune?", "What is the capital of France?", "hi", "Which river flows through Cairo?"]


# ------------------------------------------------------------------------------------------- resolution


def test_auto_is_bf16_mixed_on_cuda_and_on_cpus_with_bf16_instructions_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # (a cap in the caller's environment has its own test)
        monkeypatch.delenv(name, raising=False)
    for found in ("AMX", "AVX-512 BF16"):
        monkeypatch.setattr(prec, "cpu_bf16_matmul", lambda found=found: found)
        assert resolve_precision("auto", "cpu") == (
            "bf16-mixed",
            f"auto: CPU with bfloat16 matrix instructions ({found})",
        )
    monkeypatch.setattr(prec, "AUTO_MIXED_ON_BF16_CPU", False)  # the switch that keeps CPUs on fp32
    assert resolve_precision("auto", "cpu")[0] == "fp32"
    monkeypatch.setattr(prec, "AUTO_MIXED_ON_BF16_CPU", True)
    monkeypatch.setattr(prec, "cpu_bf16_matmul", lambda: None)
    assert resolve_precision("auto", "cpu") == (
        "fp32",
        "auto: this CPU has no bfloat16 matrix instructions (AMX, AVX-512 BF16)",
    )
    for bf16_gpu, want in ((True, "bf16-mixed"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda bf16_gpu=bf16_gpu: bf16_gpu)
        assert resolve_precision("auto", "cuda")[0] == want
    for value in ("fp32", "bf16-mixed", "bf16"):
        assert resolve_precision(value, "cpu") == (value, "set in the config")
    with pytest.raises(ValueError, match="precision"):
        resolve_precision("fp16", "cpu")
    with pytest.raises(InputError, match=r"^precision: expected auto, fp32, bf16-mixed, bf16, got 'half'"):
        load_config(TrainConfig, None, ["precision=half"])


def test_bf16_instruction_detection_agrees_with_the_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(" ".join(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    amx = "amx_tile" in flags and "amx_bf16" in flags
    expected = ["AMX"] if amx else []
    expected += ["AVX-512 BF16"] if "avx512_bf16" in flags else []
    assert prec.cpu_bf16_instructions() == expected


@pytest.mark.parametrize(
    ("env", "found", "want"),
    [
        ({}, ["AMX", "AVX-512 BF16"], "AMX"),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ["AMX", "AVX-512 BF16"], "AVX-512 BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_amx"}, ["AMX", "AVX-512 BF16"], "AMX"),
        ({"ONEDNN_MAX_CPU_ISA": "AVX10_1_512"}, ["AVX-512 BF16"], "AVX-512 BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, ["AMX", "AVX-512 BF16"], None),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, ["AVX-512 BF16"], None),
        ({"DNNL_MAX_CPU_ISA": "AVX2"}, ["AVX-512 BF16"], None),
        ({"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}, ["AVX-512 BF16"], "AVX-512 BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "DEFAULT"}, ["AVX-512 BF16"], "AVX-512 BF16"),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, [], None),
    ],
)
def test_a_onednn_isa_cap_below_the_bf16_instructions_makes_auto_fp32(
    monkeypatch: pytest.MonkeyPatch, env: dict, found: list, want: str | None
) -> None:
    """oneDNN computes bfloat16 products without AVX-512 BF16 / AMX when ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA)
    caps it below them, slower than float32: `auto` then picks fp32 and says why."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(prec, "cpu_bf16_instructions", lambda: list(found))
    assert prec.cpu_bf16_matmul() == want
    precision, reason = resolve_precision("auto", "cpu")
    if want is not None:
        assert (precision, reason) == ("bf16-mixed", f"auto: CPU with bfloat16 matrix instructions ({want})")
    elif found:
        (name, value), *_ = env.items()
        assert (precision, reason) == (
            "fp32",
            f"auto: {name}={value} keeps oneDNN from this CPU's bfloat16 matrix instructions",
        )
    else:
        assert (precision, reason) == ("fp32", "auto: this CPU has no bfloat16 matrix instructions (AMX, AVX-512 BF16)")


def test_weights_are_stored_float32_unless_frozen_under_bf16_mixed_or_pure_bf16() -> None:
    table = {(p, t): weight_dtype(p, t) for p in ("fp32", "bf16-mixed", "bf16") for t in (True, False)}
    assert table == {
        ("fp32", True): torch.float32,
        ("fp32", False): torch.float32,
        ("bf16-mixed", True): torch.float32,
        ("bf16-mixed", False): torch.bfloat16,
        ("bf16", True): torch.bfloat16,
        ("bf16", False): torch.bfloat16,
    }


# ------------------------------------------------------------------------------------ small updates survive


def changed_after_updates(model_dir: Path, precision: str, updates: int = 3) -> tuple[int, int, Policy]:
    """Full fine-tuning at the paper's lr 5e-7: how many parameters differ from the initial weights after
    `updates` updates (the same samples each time), of how many."""
    loaded = load_model(str(model_dir), device="cpu", dtype=weight_dtype(precision, trainable=True))
    samples = hand_samples(load_model(str(model_dir), device="cpu"))
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        OptimConfig(lr=5e-7),
        LoraConfig(enabled=False),
        10,
        precision=precision,
    )
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    for _ in range(updates):
        assert policy.update(samples)["grad_norm"] > 0
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in policy.model.named_parameters())
    return changed, sum(p.numel() for p in before.values()), policy


def test_bf16_mixed_keeps_updates_of_5e_7_that_pure_bf16_rounds_away(tiny_model_dir: Path) -> None:
    fp32, total, _ = changed_after_updates(tiny_model_dir, "fp32")
    mixed, _, policy = changed_after_updates(tiny_model_dir, "bf16-mixed")
    pure, _, pure_policy = changed_after_updates(tiny_model_dir, "bf16")
    assert fp32 > total / 2  # the parameters with a non-zero gradient (unused token embeddings get none)
    assert abs(mixed - fp32) <= 0.01 * fp32  # the float32 master weights take every step
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())
    states = [s for s in policy.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.bfloat16 for p in pure_policy.model.parameters())
    assert pure < 0.01 * fp32  # pure bfloat16 loses almost every update at this lr


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_mappo_trains_a_critic_adapter_in_the_precision_asked(tiny_model_dir, world, tmp_path, precision) -> None:
    run = tmp_path / "run"
    cfg = mappo_config(tiny_model_dir, world, run, steps=1, precision=precision, **{"lora.enabled": True})
    trainer = trainer_for(cfg, run)
    team = trainer.setup
    critic = team.critic.model
    trainable = {n: p for n, p in critic.named_parameters() if p.requires_grad}
    frozen = [p for p in critic.parameters() if not p.requires_grad]
    assert any(".lora_B." in n for n in trainable) and "value_head.weight" in trainable
    master = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert all(p.dtype == master for p in trainable.values())  # adapter and value head: master weights
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # the shared frozen base
    actor = [p for p in team.policy.model.parameters() if p.requires_grad]
    assert actor and all(p.dtype == master for p in actor)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    trainer.run()
    assert [n for n, p in trainable.items() if ".lora_B." in n and torch.equal(p, before[n])] == []
    assert not torch.equal(trainable["value_head.weight"], before["value_head.weight"])
    assert load_config(TrainConfig, run / "config.yaml").precision == precision


# ------------------------------------------------------------------------ sampler and trainer agree


def on_policy(policy: Policy, loaded, seed: int = 0) -> list[Sample]:
    """Samples generated by the policy itself (its recorded log-probs as the old ones), alternating advantages."""
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS] * 2
    torch.manual_seed(seed)
    generator = HFGenerator(policy.model, loaded.tokenizer, batch_size=4, precision=policy.precision)
    generations = generator.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0))
    return [
        Sample(g.prompt_ids, g.output_ids, g.logprobs, 1.0 if i % 2 else -1.0, "a") for i, g in enumerate(generations)
    ]


def logprob_gaps(policy: Policy, samples: list[Sample]) -> torch.Tensor:
    """|trainer's log-prob - sampler's| of every output token, computed as the update computes them."""
    with no_dropout(policy.model):
        logp, mask = policy._logprobs(policy.model, samples)
    assert logp.requires_grad  # gradients flow with dropout off
    return torch.cat(
        [(logp[i, : len(s.output_ids)].detach() - torch.tensor(s.old_logprobs)).abs() for i, s in enumerate(samples)]
    )


@pytest.mark.parametrize("lora", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_on_policy_ratio_is_one_under_each_precision(tiny_model_dir: Path, precision: str, lora: bool) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype=weight_dtype(precision, trainable=not lora))
    torch.manual_seed(0)
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        OptimConfig(lr=1e-2),
        LoraConfig(r=4, enabled=lora),
        10,
        precision=precision,
    )
    assert policy.update(on_policy(policy, loaded))["grad_norm"] > 0  # the policy moves away from its start
    samples = on_policy(policy, loaded, seed=1)
    gaps = logprob_gaps(policy, samples)
    stats = policy.update(samples)
    if precision == "fp32":  # the same float32 computation, with and without the KV cache
        assert float(gaps.max()) < 1e-5
        assert stats["ratio"] == pytest.approx(1.0, abs=1e-6) and stats["clip_fraction"] == 0.0
    else:  # bfloat16 matmuls: the cached and uncached computations round differently, by a bf16 ulp or so
        assert float(gaps.mean()) < 4e-3 and float(gaps.max()) < 0.05  # measured: 2e-3 and 0.025 at most
        assert stats["ratio"] == pytest.approx(1.0, abs=1e-3) and stats["clip_fraction"] == 0.0


def test_bf16_mixed_update_without_peft_input_casts_gives_the_same_bits(tiny_model_dir, monkeypatch) -> None:
    """Under bf16-mixed the update and the reference pass run with peft's cast of each LoRA layer's input up to its
    float32 weights off (the autocast matmul casts it back): the same log-probs, loss and gradients, bit for bit."""
    import mhgpo.rl.policy as policy_module

    def one_update(casting_off: bool) -> tuple[list[torch.Tensor], dict[str, float], dict[str, torch.Tensor]]:
        if not casting_off:
            monkeypatch.setattr(policy_module, "disable_input_dtype_casting", lambda model, active: nullcontext())
        loaded = load_model(str(tiny_model_dir), device="cpu", dtype=weight_dtype("bf16-mixed", trainable=False))
        samples = hand_samples(load_model(str(tiny_model_dir), device="cpu"), offsets=True)
        torch.manual_seed(0)
        optim = OptimConfig(lr=1e-2, kl_beta=0.05, micro_batch_tokens=64, gradient_checkpointing=False)
        policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=4), 10, precision="bf16-mixed")
        policy.update(samples)  # the adapter moves off zero: the reference and the policy differ
        seen = {}
        real_loss = policy.loss

        def loss(*args, **kwargs):
            seen.setdefault("logp", []).append(args[0].detach().clone())
            return real_loss(*args, **kwargs)

        policy.loss = loss
        ref = policy.reference_logprobs(samples)
        stats = policy.update(samples)
        monkeypatch.undo()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return ref + seen["logp"], stats, grads

    ref_off, stats_off, grads_off = one_update(casting_off=True)
    ref_on, stats_on, grads_on = one_update(casting_off=False)
    assert len(ref_off) == len(ref_on) and all(torch.equal(a, b) for a, b in zip(ref_off, ref_on))
    untimed = [{k: v for k, v in st.items() if not k.startswith("seconds/")} for st in (stats_off, stats_on)]
    assert untimed[0] == untimed[1] and stats_off["kl"] > 0
    assert grads_off.keys() == grads_on.keys() and grads_off
    assert all(torch.equal(grads_off[n], grads_on[n]) for n in grads_off)


# ------------------------------------------------------------------------------ generation pinned


@pytest.fixture(scope="module")
def opinionated_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a generation_config.json that asks for sampling with its own settings."""
    folder = tmp_path_factory.mktemp("opinionated") / "model"
    shutil.copytree(tiny_model_dir, folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.update(
        do_sample=True, temperature=0.6, repetition_penalty=1.3, top_k=3, min_new_tokens=6, no_repeat_ngram_size=2
    )
    path.write_text(json.dumps(config))
    return folder


def _generate(model_dir: Path, params: SamplingParams, seed: int = 0):
    loaded = load_model(str(model_dir), device="cpu")
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    torch.manual_seed(seed)
    return loaded, HFGenerator(loaded.model, loaded.tokenizer, batch_size=2).generate(prompts, params)


def test_a_models_own_generation_config_never_reaches_decoding(tiny_model_dir, opinionated_model_dir) -> None:
    from mhgpo.model.logprobs import output_logprobs

    loaded, greedy = _generate(opinionated_model_dir, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert loaded.model.generation_config.repetition_penalty == 1.3  # the model's config is there, and kept
    _, plain = _generate(tiny_model_dir, SamplingParams(max_new_tokens=12, temperature=0.0))
    assert [g.output_ids for g in greedy] == [g.output_ids for g in plain]
    assert any(g.finished and len(g.output_ids) < 6 for g in greedy)  # min_new_tokens=6 did not apply
    with torch.no_grad():
        for g in greedy:  # greedy: every token is the argmax of the plain logits
            logits = loaded.model(input_ids=torch.tensor([g.prompt_ids + g.output_ids])).logits[0]  # (L, V)
            steps = logits[len(g.prompt_ids) - 1 : -1].argmax(dim=-1).tolist()  # (|o|,)
            assert steps == g.output_ids

    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=1.0)
    loaded, sampled = _generate(opinionated_model_dir, params, seed=3)
    _, plain = _generate(tiny_model_dir, params, seed=3)
    assert [g.output_ids for g in sampled] == [g.output_ids for g in plain]  # the same draws from the same law
    assert [g.logprobs for g in sampled] == [g.logprobs for g in plain]
    with torch.no_grad():
        logp, _ = output_logprobs(
            loaded.model,
            [g.prompt_ids for g in sampled],
            [g.output_ids for g in sampled],
            pad_id=loaded.tokenizer.pad_token_id,
        )
    # sampled at T = 1 from the raw logits: the trainer's log-probs, to float32's rounding of two computations of the
    # same logits (decoding with a KV cache, one forward pass): up to 2.4e-6 apart on a CPU with AVX2 only, where a
    # repetition penalty or a temperature left on would move them by tenths
    for row, g in enumerate(sampled):
        assert g.logprobs == pytest.approx(logp[row, : len(g.output_ids)].tolist(), abs=1e-5, rel=0)


# ----------------------------------------------------------------------------------------- dropout off


@pytest.fixture(scope="module")
def dropout_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with attention dropout 0.1 (functional dropout that reads `self.training`)."""
    folder = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_policy_ratio_is_one_with_dropout_after_an_update(dropout_model_dir: Path, checkpointing: bool) -> None:
    loaded = load_model(str(dropout_model_dir), device="cpu")
    calls = count_forward_calls(backbone_and_head(loaded.model)[0].layers[0].mlp)
    torch.manual_seed(0)
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        OptimConfig(lr=1e-2, kl_beta=0.05, micro_batch_tokens=256, gradient_checkpointing=checkpointing),
        LoraConfig(r=4, dropout=0.1),
        10,
        precision="fp32",
    )
    assert policy.update(on_policy(policy, loaded))["grad_norm"] > 0
    assert all(torch.count_nonzero(p) > 0 for n, p in policy.model.named_parameters() if ".lora_B." in n)
    samples = on_policy(policy, loaded, seed=1)
    assert float(logprob_gaps(policy, samples).max()) < 1e-5
    policy.model.train()  # what the update computed before: dropout on in the adapters and the attention
    with torch.no_grad():
        noisy, _ = policy._logprobs(policy.model, samples)
    policy.model.eval()
    assert float((noisy[0, : len(samples[0].output_ids)] - torch.tensor(samples[0].old_logprobs)).abs().max()) > 1e-3
    n = len(micro_batches(samples, 256))
    # the reference pass (kl_beta > 0) cuts each segment (the samples of one prompt) on its own
    n_ref = sum(len(micro_batches([samples[i] for i in seg], 256)) for seg in reference_segments(samples))
    calls[0] = 0
    stats = policy.update(samples)
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-6) and stats["clip_fraction"] == 0.0
    # the reference's forwards and one training forward per micro-batch, plus, with checkpointing, the
    # recomputation in the backward: the decoder layers were still in train mode for it
    assert n_ref > n and calls[0] == n_ref + (2 * n if checkpointing else n)
    assert not policy.model.training  # the modes are restored (eval, as the sampler left them)


def test_no_dropout_keeps_checkpointing_layers_training_and_restores_every_mode(dropout_model_dir: Path) -> None:
    loaded = load_model(str(dropout_model_dir), device="cpu")
    policy = Policy(
        loaded.model,
        loaded.tokenizer.pad_token_id,
        OptimConfig(gradient_checkpointing=True),
        LoraConfig(r=4, dropout=0.1),
        10,
    )
    model = policy.model
    model.train()
    model.get_base_model().model.layers[1].dropout_rate = 0.3  # a rate a layer holds itself (OPT-style layers)
    with no_dropout(model):
        layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        decoder_layers = list(model.get_base_model().model.layers)
        assert all(any(m is layer for m in layers) for layer in decoder_layers) and all(m.training for m in layers)
        assert [m for m in model.modules() if m.training and m not in layers] == []
        assert model.get_base_model().model.layers[1].dropout_rate == 0.0
    assert all(m.training for m in model.modules())
    assert model.get_base_model().model.layers[1].dropout_rate == 0.3


def test_the_critic_update_reads_values_with_dropout_off(dropout_model_dir: Path) -> None:
    from mhgpo.config import CriticConfig
    from mhgpo.rl.critic import Critic

    loaded = load_model(str(dropout_model_dir), device="cpu")
    torch.manual_seed(0)
    critic = Critic(loaded.model, 0, CriticConfig(lr=1e-2), OptimConfig(ppo_epochs=2), LoraConfig(r=4, dropout=0.1))
    samples = samples_of(*ragged())
    critic.estimate(samples)
    critic.update(samples)  # a non-zero adapter, so that its dropout would show
    critic.estimate(samples)  # the rollout-time values (no gradient, eval mode)
    seen = []
    values = critic.model.values

    def spy(*args, **kwargs):
        out = values(*args, **kwargs)
        seen.append((out[0].detach().clone(), out[0].requires_grad))
        return out

    critic.model.values = spy
    critic.update(samples)
    [idx] = micro_batches(samples, critic.optim.micro_batch_tokens)
    first, requires_grad = seen[0]  # the first epoch's values, before any optimiser step
    assert requires_grad
    for row, i in enumerate(idx):
        old = torch.tensor(samples[i].old_values, dtype=torch.float32)
        torch.testing.assert_close(first[row, : len(old)], old, rtol=0, atol=1e-6)


def test_commands_print_the_resolved_precision_and_record_it(tiny_model_dir, world, tmp_path, capsys) -> None:
    from mhgpo.cli.main import main
    from mhgpo.config import EvalConfig

    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--data",
                f"hotpotqa:{world / 'dev.jsonl'}",
                "--corpus",
                str(world / "corpus.jsonl"),
                "--limit",
                "1",
                "--output-dir",
                str(out),
                "search.rewriter.max_new_tokens=4",
                "search.reranker.max_new_tokens=4",
                "search.answerer.max_new_tokens=4",
            ]
        )
        == 0
    )
    resolved, reason = resolve_precision("auto")
    assert f"mhgpo: precision {resolved} ({reason})" in capsys.readouterr().err
    assert load_config(EvalConfig, out / "eval_config.yaml").precision == resolved
