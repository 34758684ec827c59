"""Hostile numbers, sizes and disks (issue 29, part B): a diverged update never reaches a checkpoint; one oversized
question or passage cannot take the machine's memory; log appends and folder flushes that fail say so in one
line, and what an interrupted command leaves behind is cleaned by the next one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mhgpo.rl.policy as policy_module
from mhgpo.config import LoraConfig, OptimConfig
from mhgpo.errors import NotFinite
from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.rl.policy import Policy
from mhgpo.rl.runlog import read_metrics
from helpers import train_overrides
from test_faults import assert_one_line_error, cli
from test_trainer import fresh_model, hand_samples, snapshot


# ------------------------------------------------------------------------------------- non-finite updates


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_loss_is_refused_before_the_optimiser_step(tiny_model_dir, monkeypatch, bad) -> None:
    """A NaN / infinite loss raises NotFinite and leaves every weight and the optimiser state as they were."""
    loaded = fresh_model(tiny_model_dir)
    samples = hand_samples(loaded)
    policy = Policy(loaded.model, loaded.tokenizer.pad_token_id, OptimConfig(lr=1e-3), LoraConfig(r=4), 10)
    policy.update(samples)  # a good step first: the optimiser has state
    before = snapshot(policy.model)
    state_before = {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
                    for k, s in policy.optimizer.state_dict()["state"].items()}
    real = policy_module.mhgpo_policy_loss
    monkeypatch.setattr(policy_module, "mhgpo_policy_loss",
                        lambda *a, **k: (lambda out: (out[0] * bad, out[1]))(real(*a, **k)))
    with pytest.raises(NotFinite, match=r"the loss/gradient is not finite \(loss (nan|-?inf), gradient norm nan\)"):
        policy.update(samples)
    after = snapshot(policy.model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    state_after = policy.optimizer.state_dict()["state"]
    assert all(torch.equal(v, state_after[k][n]) for k, s in state_before.items() for n, v in s.items())


def test_a_diverged_step_stops_the_run_and_keeps_the_last_good_checkpoint(
    tiny_model_dir, world, tmp_path, monkeypatch, capsys
) -> None:
    """Step 2's loss is NaN with keep_checkpoints=1: the run stops with one line naming the step and the kept
    checkpoint; step_1 is not rotated away, nothing of step 2 is logged or saved, errors.jsonl says why."""
    out = tmp_path / "nan"
    real = policy_module.mhgpo_policy_loss
    calls = []

    def loss(*a, **k):
        value, stats = real(*a, **k)
        calls.append(1)
        return (value * math.nan if steps_done() >= 1 else value), stats

    steps_done = lambda: len(read_metrics(out)) if out.exists() else 0  # noqa: E731
    monkeypatch.setattr(policy_module, "mhgpo_policy_loss", loss)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, keep_checkpoints=1, eval_every=0))
    assert_one_line_error(rc, err, r"^mhgpo: error: step 2: the loss/gradient is not finite \(loss nan, gradient "
                                   r"norm nan\); the update was not applied; the last good checkpoint step_1 is kept")
    assert [p.name for p in list_checkpoints(out)] == ["step_1"]
    weights = load_file(str(out / "checkpoints" / "step_1" / "model.safetensors"))
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights.values())
    assert [r["step"] for r in read_metrics(out)] == [1]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["phase"]) for e in errors] == [(2, "train")]
    assert "not finite" in errors[0]["error"]
    assert not (out / "rollouts" / "step_000002.jsonl").exists()
