"""The training side, in-process on the tiny model: one MHGPO update (LoRA and full fine-tuning), the reference
policy, micro-batch invariance, the run directory, exact resume, interruption (Ctrl-C / SIGTERM), config errors.

The training questions are synthetic-world questions whose gold answer is rewritten to "assistant": the tiny
model mostly says "assistant" and "user", so the leaves' F1 differs within groups and advantages are non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_same_run,
    count_forward_calls,
    fresh_model,
    hand_samples,
    make_config,
    param_snapshot,
    train_overrides,
    trainer_for,
)

from mhgpo.config import LoraConfig, OptimConfig, TrainConfig, load_config
from mhgpo.errors import InputError
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.model.logprobs import backbone_and_head, output_logprobs
from mhgpo.rl.policy import Policy, Sample, micro_batches, reference_segments
from mhgpo.run.pipeline import resume, train
from mhgpo.runtime.runlog import read_metrics

# ------------------------------------------------------------------------------------ one update, by hand


def base_logprobs(model_dir: Path, samples: list[Sample]) -> list[torch.Tensor]:
    """Log-probs of the samples' outputs under a freshly loaded copy of the initial model, one segment (the samples
    of one prompt) per forward, as the reference pass computes them."""
    loaded = fresh_model(model_dir)
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    for segment in reference_segments(samples):
        with torch.no_grad():
            logp, mask = output_logprobs(
                loaded.model,
                [samples[i].prompt_ids for i in segment],
                [samples[i].output_ids for i in segment],
                pad_id=loaded.tokenizer.pad_token_id,
            )
        for row, i in enumerate(segment):
            out[i] = logp[row, : int(mask[row].sum())]
    return out


def test_lora_update_changes_b_first_then_a_and_nothing_else(tiny_model_dir: Path) -> None:
    loaded = fresh_model(tiny_model_dir)
    samples = hand_samples(loaded)
    torch.manual_seed(0)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, OptimConfig(lr=1e-3), LoraConfig(r=4), 10)
    before = param_snapshot(policy.model)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    a_names = sorted(n for n in trainable if ".lora_A." in n)
    b_names = sorted(n for n in trainable if ".lora_B." in n)
    # 7 target projections x 2 layers, one A and one B each; nothing else trains
    assert len(a_names) == len(b_names) == 14
    assert trainable == set(a_names) | set(b_names)
    assert all(torch.count_nonzero(before[n]) == 0 for n in b_names)  # LoRA B starts at zero

    stats = policy.update(samples)
    assert stats["grad_norm"] > 0
    after1 = param_snapshot(policy.model)
    # step 1: B moves everywhere; dL/dA = B^T (...) is exactly zero while B == 0, so Adam leaves A untouched
    assert [n for n in b_names if torch.equal(after1[n], before[n])] == []
    assert [n for n in a_names if not torch.equal(after1[n], before[n])] == []

    policy.update(samples)
    after2 = param_snapshot(policy.model)
    assert [n for n in a_names if torch.equal(after2[n], after1[n])] == []
    assert [n for n in b_names if torch.equal(after2[n], after1[n])] == []
    frozen_changed = [n for n in before if n not in trainable and not torch.equal(after2[n], before[n])]
    assert frozen_changed == []

    # the reference is the base model (adapter disabled): identical to a fresh copy of the initial weights
    ref = policy.reference_logprobs(samples)
    base = base_logprobs(tiny_model_dir, samples)
    assert all(torch.equal(r, b) for r, b in zip(ref, base))
    with torch.no_grad():
        current, mask = output_logprobs(
            policy.model,
            [s.prompt_ids for s in samples],
            [s.output_ids for s in samples],
            pad_id=loaded.tokenizer.pad_token_id,
        )
    assert float((current[mask.bool()] - torch.cat(base)).abs().max()) > 1e-4  # the policy itself has moved


def test_full_finetune_update_changes_every_parameter_and_keeps_a_frozen_reference(tiny_model_dir: Path) -> None:
    loaded = fresh_model(tiny_model_dir)
    samples = hand_samples(loaded)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, OptimConfig(lr=1e-3), LoraConfig(enabled=False), 10)
    before = param_snapshot(policy.model)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable == list(before)  # full fine-tuning: every parameter trains
    ref_before = param_snapshot(policy.ref_model)

    policy.update(samples)
    after = param_snapshot(policy.model)
    assert [n for n in trainable if torch.equal(after[n], before[n])] == []

    policy.update(samples)
    assert all(not p.requires_grad for p in policy.ref_model.parameters())
    ref_after = param_snapshot(policy.ref_model)
    assert [n for n in ref_before if not torch.equal(ref_before[n], ref_after[n])] == []
    assert [n for n in ref_before if not torch.equal(ref_before[n], before[n])] == []
    ref, base = policy.reference_logprobs(samples), base_logprobs(tiny_model_dir, samples)
    assert all(torch.equal(r, b) for r, b in zip(ref, base))


def test_loss_and_gradient_do_not_depend_on_the_micro_batch_cut(tiny_model_dir: Path) -> None:
    optim = dict(lr=1e-3, kl_beta=0.05, max_grad_norm=1e9, clip_eps=0.2)
    results = []
    for max_tokens in (1, 10**6):
        loaded = fresh_model(tiny_model_dir)
        samples = hand_samples(loaded, offsets=True)
        policy = Policy(
            loaded.model,
            loaded.tokenizer.pad_token_id,
            OptimConfig(micro_batch_tokens=max_tokens, **optim),
            LoraConfig(enabled=False),
            10,
        )
        with torch.no_grad():  # move the reference away from the policy, so that the KL term counts too
            for p in policy.ref_model.parameters():
                p.mul_(1.05)
        results.append((policy, samples, policy.update(samples)))
    (p_many, samples, s_many), (p_one, _, s_one) = results
    assert len(micro_batches(samples, 1)) == len(samples)
    assert len(micro_batches(samples, 10**6)) == 1
    assert s_many["clip_fraction"] > 0  # the offsets push some ratios out of [0.8, 1.2]
    assert s_many["kl"] > 1e-4
    assert s_one["loss"] != 0.0
    assert abs(s_many["loss"] - s_one["loss"]) <= 1e-6
    assert s_many["clip_fraction"] == pytest.approx(s_one["clip_fraction"], abs=1e-12)
    assert s_many["kl"] == pytest.approx(s_one["kl"], abs=1e-6)
    assert s_many["grad_norm"] == pytest.approx(s_one["grad_norm"], rel=1e-5)
    grads_many = {n: p.grad for n, p in p_many.model.named_parameters()}
    grads_one = {n: p.grad for n, p in p_one.model.named_parameters()}
    assert all(g is not None for g in grads_one.values())
    for name, g in grads_one.items():
        torch.testing.assert_close(grads_many[name], g, rtol=1e-5, atol=1e-6, msg=name)  # float32 sums


# ------------------------------------------------------------------------------------------ the run folder

STEP_KEYS = [
    "step",
    "reward/mean",
    "kl",
    "clip_fraction",
    "loss",
    "grad_norm",
    "samples",
    "groups",
    "singletons_dropped",
    "zero_variance_groups",
    "llm_calls",
    "tokens_generated",
    "seconds/rollout",
    "seconds/train",
    "seconds/reference",
    "seconds/cpu_steps",
    "memory/peak_mb",
]
AGENT_KEYS = [
    f"{a}/{k}" for a in ("rewriter", "reranker", "answerer") for k in ("reward", "penalty", "advantage_abs", "entropy")
]
VAL_KEYS = ["val/f1", "val/em", "val/acc"]
ROLLOUT_KEYS = [
    "question_id",
    "node_id",
    "parent_id",
    "agent",
    "group_id",
    "trained",
    "reward_shared",
    "reward_specific",
    "reward",
    "advantage",
    "output",
]


def test_run_directory_holds_config_metrics_rollouts_events_and_checkpoints(reference_run) -> None:
    cfg, out, trainer = reference_run
    assert trainer.step == 4
    assert load_config(TrainConfig, out / "config.yaml") == trainer.cfg  # the settled config, as it ran
    assert cfg.precision == "auto" and trainer.cfg.precision in ("fp32", "bf16-mixed")  # the given one unchanged

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        missing = [k for k in STEP_KEYS + AGENT_KEYS if k not in r]
        assert missing == [], f"step {r['step']} lacks {missing}"
        has_val = [k in r for k in VAL_KEYS]
        assert has_val == [r["step"] % 2 == 0] * 3, f"step {r['step']}: val keys {has_val}"
    assert [h["step"] for h in trainer.val_history] == [2, 4]
    assert trainer.val_history[-1] == {
        "step": 4,
        **{k: v for k, v in rows[-1].items() if k.startswith("val/")},  # F1 by question form with the scores
        "cpu_minutes": rows[-1]["seconds/cpu_steps"] / 60,
    }
    assert sum(rows[-1].get(f"val/form/{f}/n", 0) for f in ("yes_no", "choice", "other")) == cfg.val_limit
    # each validation's questions, as `mhgpo eval` writes its predictions
    assert sorted(p.name for p in (out / "validation").iterdir()) == ["step_000002.jsonl", "step_000004.jsonl"]
    for step in (2, 4):
        questions = [json.loads(x) for x in (out / "validation" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert {"id", "prediction", "f1", "em", "acc", "trace"} <= set(questions[0])
        row = next(r for r in rows if r["step"] == step)
        assert 100 * sum(q["f1"] for q in questions) / len(questions) == pytest.approx(row["val/f1"], abs=1e-9)
    assert questions == json.loads(json.dumps(trainer.last_eval[1].predictions))
    assert 0 < rows[0]["seconds/cpu_steps"] < rows[1]["seconds/cpu_steps"] < rows[3]["seconds/cpu_steps"]
    assert all(0 <= r["seconds/reference"] < r["seconds/train"] for r in rows)
    assert any(r[f"{a}/advantage_abs"] > 0 for r in rows for a in ("rewriter", "reranker", "answerer"))
    assert any(r["loss"] != 0 for r in rows)

    for r in rows:
        path = out / "rollouts" / f"step_{r['step']:06d}.jsonl"
        nodes = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        for n in nodes:
            missing = [k for k in ROLLOUT_KEYS if k not in n]
            assert missing == [], f"{path.name} node {n.get('node_id')} lacks {missing}"
            assert n["trained"] == (n["group_id"] >= 0)
            assert n["reward"] == n["reward_shared"] + n["reward_specific"]
        assert [n["node_id"] for n in nodes] == list(range(len(nodes)))
        assert all(-1 <= n["parent_id"] < n["node_id"] for n in nodes)
        llm = [n for n in nodes if n["agent"] != "retriever"]
        assert len(llm) == r["llm_calls"]
        assert sum(n["trained"] for n in llm) == r["samples"]
        groups: dict[int, list[dict]] = {}
        for n in llm:
            if n["trained"]:
                groups.setdefault(n["group_id"], []).append(n)
        assert len(groups) == r["groups"]
        assert sum(len({n["reward"] for n in g}) == 1 for g in groups.values()) == r["zero_variance_groups"]
        assert all(abs(sum(n["advantage"] for n in g)) < 1e-9 for g in groups.values())  # A = (R - mean) / std
        assert all(n["advantage"] == 0 for n in nodes if not n["trained"])
        assert len({n["question_id"] for n in nodes}) == cfg.questions_per_step

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    assert [p.name for p in list_checkpoints(out)] == ["step_3", "step_4"]  # keep_checkpoints=2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_3", "step_4"]  # no temporaries
    for ckpt in list_checkpoints(out):
        assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "optimizer.safetensors", "state.json"]
        state = json.loads((ckpt / "state.json").read_text())
        step = int(ckpt.name.split("_")[1])
        assert state["step"] == step and state["position"] == step * cfg.questions_per_step
        assert state["format"] == 2
        assert state["files"] == {p.name: p.stat().st_size for p in ckpt.glob("*.safetensors")}
        umask = os.umask(0)
        os.umask(umask)
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in ckpt.iterdir()} == {
            p.name: oct(0o666 & ~umask) for p in ckpt.iterdir()
        }  # the usual permissions, as any file


def test_tensorboard_scalars_match_metrics(reference_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = reference_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    rows = read_metrics(out)
    for key in ("loss", "reward/mean", "val/f1"):
        logged = [(e.step, e.value) for e in acc.Scalars(key)]
        expected = [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-9)) for r in rows if key in r]
        assert logged == expected


def test_check_rollouts_passes_the_reference_run_and_names_a_broken_invariant(reference_run, tmp_path) -> None:
    """scripts/check_rollouts.py accepts every step of a real run, and exits non-zero naming the step file once
    one advantage no longer matches its group's rewards."""
    import shutil

    _, out, _ = reference_run
    script = [sys.executable, str(REPO / "scripts" / "check_rollouts.py")]
    ok = subprocess.run([*script, str(out), "--group-size", "2"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("step_0000") == 4  # each of the 4 steps checked
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    path = broken / "rollouts" / "step_000003.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    victim = next(r for r in rows if r["kind"] == "llm" and r["group_id"] >= 0)
    victim["advantage"] += 0.5
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = subprocess.run([*script, str(broken), "--group-size", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "step_000003" in bad.stdout + bad.stderr


# ------------------------------------------------------------------------------------------------- resume


def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(reference_run, tiny_model_dir, world, tmp_path) -> None:
    _, reference, _ = reference_run
    out = tmp_path / "resumed"
    train(make_config(tiny_model_dir, world, out, steps=2), progress=False)
    assert [p.name for p in list_checkpoints(out)] == ["step_1", "step_2"]
    trainer = resume(out, ["steps=4"], progress=False)
    assert trainer.step == 4
    assert load_config(TrainConfig, out / "config.yaml").steps == 4
    assert_same_run(out, reference)


def test_interrupt_in_the_middle_of_a_step_saves_the_last_completed_step(
    reference_run, tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    """Ctrl-C while step 2 is under way (its rollouts done, before its update): step 1 is saved (it was not
    due for a checkpoint) as it was when step 1 ended, and resuming reproduces the uninterrupted run."""
    _, reference, _ = reference_run
    out = tmp_path / "interrupted"
    real_update = Policy.update
    calls = []

    def update(self, samples, *rest):
        calls.append(len(samples))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_update(self, samples, *rest)

    monkeypatch.setattr(Policy, "update", update)
    with pytest.raises(KeyboardInterrupt):
        train(make_config(tiny_model_dir, world, out, save_every=3), progress=False)
    assert "interrupted; saved" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [1]
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    state = json.loads((out / "checkpoints" / "step_1" / "state.json").read_text())
    assert (state["step"], state["position"]) == (1, 2)

    monkeypatch.setattr(Policy, "update", real_update)
    assert resume(out, progress=False).step == 4
    assert_same_run(out, reference)


def test_signal_during_the_update_finishes_the_step_before_stopping(
    reference_run, tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    """SIGINT that arrives once step 2's weights have changed: the step is completed, logged and saved."""
    _, reference, _ = reference_run
    out = tmp_path / "signalled"
    real_update = Policy.update
    calls = []

    def update(self, samples, *rest):
        result = real_update(self, samples, *rest)
        calls.append(len(samples))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(Policy, "update", update)
    with pytest.raises(KeyboardInterrupt):
        train(make_config(tiny_model_dir, world, out, save_every=3), progress=False)
    assert "stopping after this update" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["step_2"]

    monkeypatch.setattr(Policy, "update", real_update)
    assert resume(out, progress=False).step == 4
    assert_same_run(out, reference)


def test_sigterm_to_a_training_process_saves_a_checkpoint_and_exits_nonzero(
    tiny_model_dir, world, tmp_path, cache_dir
) -> None:
    out = tmp_path / "sigterm"
    args = ["train", *train_overrides(tiny_model_dir, world, out, steps=1000, save_every=1000, eval_every=0)]
    env = {
        **os.environ,
        "MHGPO_CACHE": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mhgpo", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"

        def logged() -> bool:  # a complete line (the file may be read while a line is being appended)
            return metrics.exists() and "\n" in metrics.read_text(encoding="utf-8")

        while not logged() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        assert logged(), "no step finished within 120 s"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "Traceback" not in stderr
    assert "interrupted; saved" in stdout
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 1000
    checkpoints = list_checkpoints(out)
    assert [p.name for p in checkpoints] == [f"step_{steps[-1]}"]
    state = json.loads((checkpoints[0] / "state.json").read_text())
    assert (state["step"], state["position"]) == (steps[-1], 2 * steps[-1])


# ------------------------------------------------------------------------------------------------- errors


def test_unknown_or_mistyped_config_keys_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"optim\.lrr"):
        load_config(TrainConfig, None, ["optim.lrr=0.1"])
    with pytest.raises(InputError, match=r"unknown config key group_sizes"):
        load_config(TrainConfig, None, ["group_sizes=4"])
    with pytest.raises(InputError, match=r"^steps: expected an integer"):
        load_config(TrainConfig, None, ["steps=many"])
    config = tmp_path / "bad.yaml"
    config.write_text("steps: 2\nlora:\n  rank: 8\n")
    with pytest.raises(InputError, match=r"bad\.yaml.*lora\.rank"):
        load_config(TrainConfig, config)
    with pytest.raises(InputError, match=r"sampler: expected is, fof, rr or fof_os"):
        load_config(TrainConfig, None, ["sampler=best"])


def test_train_refuses_a_directory_with_checkpoints_and_resume_needs_one(reference_run, tmp_path) -> None:
    cfg, out, _ = reference_run
    again = load_config(TrainConfig, out / "config.yaml")
    with pytest.raises(
        InputError,
        match=r"already holds a run \(checkpoints/ \(step_3, step_4\), config\.yaml, "
        r"metrics\.jsonl \(4 lines\), .*continue it with: mhgpo train --resume",
    ):
        train(again, progress=False)
    assert [p.name for p in list_checkpoints(out)] == ["step_3", "step_4"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((out / "config.yaml").read_text())
    with pytest.raises(InputError, match="no checkpoint to resume from"):
        resume(empty, progress=False)


# ------------------------------------------------------------------------------------------ ablations, GRPO


@pytest.mark.parametrize(
    ("switch", "trained_roles"),
    [({"frozen_roles": "[reranker]"}, ["answerer", "rewriter"]), ({"train_roles": "[rewriter]"}, ["rewriter"])],
)
def test_role_ablations_train_exactly_the_chosen_roles(
    tiny_model_dir, world, tmp_path, monkeypatch, switch, trained_roles
) -> None:
    """Every role acts; only the chosen roles' samples reach the update; the loss averages over those roles."""
    from collections import Counter

    from mhgpo.rl.losses import token_weights

    seen: list[list[Sample]] = []
    real_update = Policy.update

    def update(self, samples, *rest):
        seen.append(list(samples))
        return real_update(self, samples, *rest)

    monkeypatch.setattr(Policy, "update", update)
    out = tmp_path / "run"
    train(
        make_config(tiny_model_dir, world, out, sampler="fof", steps=1, eval_every=0, save_every=0, **switch),
        progress=False,
    )
    rows = [json.loads(line) for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    llm = [r for r in rows if r["kind"] == "llm"]
    assert Counter(r["agent"] for r in llm) == {"rewriter": 4, "reranker": 4, "answerer": 4}  # all acted
    for r in llm:
        trained = r["agent"] in trained_roles
        assert (r["trained"], r["group_id"] >= 0) == (trained, trained), r
        if not trained:
            assert r["advantage"] == 0.0
    assert sorted({s.agent for s in seen[0]}) == trained_roles and len(seen[0]) == 4 * len(trained_roles)
    assert read_metrics(out)[0]["frozen_samples"] == 4.0 * (3 - len(trained_roles))
    weights = token_weights([s.agent for s in seen[0]], [len(s.output_ids) for s in seen[0]], dtype=torch.float64)
    for agent in trained_roles:  # n = the trained roles: each gets 1/n of the objective
        share = sum(float(w) * len(s.output_ids) for w, s in zip(weights, seen[0]) if s.agent == agent)
        assert share == pytest.approx(1 / len(trained_roles), abs=1e-12)


def test_single_agent_grpo_trains_groups_of_one_prompt(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    from mhgpo.team.search_system import LLMOnly

    # The tiny model's answers score F1 0: a reward read off the answer's text gives each group of two different
    # sampled answers different rewards, so the step has a learning signal.
    monkeypatch.setattr(
        LLMOnly, "reward", lambda self, state, example: sum(map(ord, self.final_answer(state))) % 101 / 100
    )
    cfg = make_config(
        tiny_model_dir, world, tmp_path / "grpo", system="llm", algo="grpo", sampler="null", steps=1, eval_every=0
    )
    assert cfg.sampler == "fof"
    trainer = trainer_for(cfg, tmp_path / "grpo")
    metrics = trainer.train_step()
    batch = trainer._last_batch
    assert {n.agent for n in batch.nodes} == {"llm"} and metrics["samples"] == 4.0 and metrics["groups"] == 2.0
    by_group: dict[int, list] = {}
    for n in batch.nodes:
        by_group.setdefault(n.group_id, []).append(n)
    for members in by_group.values():
        assert len(members) == 2 and len({tuple(m.prompt_ids) for m in members}) == 1
        assert len({m.question_index for m in members}) == 1
    assert len({n.output for n in batch.nodes}) == 4  # four different answers
    assert metrics["zero_variance_groups"] == 0.0 and metrics["grad_norm"] > 0


@pytest.mark.parametrize("lora", [True, False])
def test_gradient_checkpointing_recomputes_the_layers_and_keeps_loss_and_gradients(
    tiny_model_dir: Path, lora: bool
) -> None:
    results = []
    for checkpointing in (False, True):
        loaded = fresh_model(tiny_model_dir)
        samples = hand_samples(loaded, offsets=True)
        calls = count_forward_calls(backbone_and_head(loaded.model)[0].layers[0].mlp)  # inside a decoder layer
        torch.manual_seed(0)  # the same LoRA initialisation in both runs
        policy = Policy(
            loaded.model,
            loaded.tokenizer.pad_token_id,
            OptimConfig(lr=1e-3, kl_beta=0.05, micro_batch_tokens=64, gradient_checkpointing=checkpointing),
            LoraConfig(enabled=lora, r=4),
            10,
        )
        n_batches = len(micro_batches([s for s in samples if s.output_ids], 64))
        stats = policy.update(samples)
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad}
        results.append((calls[0], n_batches, stats, grads))
    (calls_off, n, stats_off, grads_off), (calls_on, n_on, stats_on, grads_on) = results
    assert n == n_on and n > 1
    reference_forwards = n  # kl_beta > 0: the reference log-probs, one no-grad forward per micro-batch
    assert calls_off == reference_forwards + n  # the forward of each micro-batch, kept for the backward
    assert calls_on == reference_forwards + 2 * n  # ... and with checkpointing, recomputed in the backward
    assert stats_on["loss"] == pytest.approx(stats_off["loss"], abs=1e-7)
    assert stats_on["grad_norm"] == pytest.approx(stats_off["grad_norm"], rel=1e-6)
    assert grads_on.keys() == grads_off.keys() and grads_on
    for name, g in grads_off.items():
        torch.testing.assert_close(grads_on[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_gradient_checkpointing_is_refused_by_a_model_without_it() -> None:
    from mhgpo.model.modules import enable_gradient_checkpointing

    with pytest.raises(ValueError, match="gradient_checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_zero_variance_filter_trains_only_informative_groups_and_draws_more(
    tiny_model_dir, world, tmp_path, monkeypatch
) -> None:
    """With filter_zero_variance, no group whose rewards are all equal reaches the update; questions are drawn
    `questions_per_step` at a time until the step holds as many informative groups as its first draw formed
    groups (or the cap); the data position counts every question drawn, so resume stays exact."""
    from collections import defaultdict

    seen: list[list[Sample]] = []
    real_update = Policy.update

    def update(self, samples, *rest):
        seen.append(list(samples))
        return real_update(self, samples, *rest)

    monkeypatch.setattr(Policy, "update", update)
    out = tmp_path / "run"
    train(
        make_config(
            tiny_model_dir,
            world,
            out,
            sampler="fof",
            steps=2,
            eval_every=0,
            save_every=1,
            filter_zero_variance=True,
            filter_max_questions=6,
        ),
        progress=False,
    )
    metrics = read_metrics(out)
    drawn = [m["filter/questions"] for m in metrics]
    for step, m in enumerate(metrics, start=1):
        rows = [json.loads(line) for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        llm = [r for r in rows if r["kind"] == "llm"]
        assert len({r["question_id"] for r in llm}) == m["filter/questions"]  # every drawn question is recorded
        assert m["filter/questions"] in (2, 4, 6) and m["filter/extra_questions"] == m["filter/questions"] - 2
        by_group = defaultdict(list)
        for r in llm:
            if r["trained"]:
                by_group[r["group_id"]].append(r["reward"])
        assert all(len(set(v)) > 1 for v in by_group.values())  # informative groups only
        assert m["groups"] == len(by_group) and sum(len(v) for v in by_group.values()) == len(seen[step - 1])
        groups_drawn = 3 * m["filter/questions"]  # FoF: one group per agent and question
        assert m["groups/zero_variance_frac"] == pytest.approx(m["zero_variance_groups"] / groups_drawn)
        assert m["groups"] + m["zero_variance_groups"] == groups_drawn
        assert m["groups"] >= 6 or m["filter/questions"] == 6  # as many as one draw formed, or the cap
    state = json.loads((out / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["position"] == sum(drawn)


def test_zero_variance_filter_is_refused_for_critic_algorithms(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="filter_zero_variance"):
        load_config(TrainConfig, None, ["algo=mappo", "filter_zero_variance=true"])
    with pytest.raises(InputError, match="filter_max_questions"):
        load_config(TrainConfig, None, ["questions_per_step=4", "filter_zero_variance=true", "filter_max_questions=2"])
