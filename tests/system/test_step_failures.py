"""An exception in the middle of a step is a saving stop, as Ctrl-C is: in the step's rollouts (an engine dying, out
of memory in generation, a bug in a team's tool) or its validation the completed steps are checkpointed, the error
is one line naming the step, and `--resume` continues to the run an uninterrupted one gives. In the update the
weights belong to no step: nothing is saved and the last checkpoint is kept."""

from __future__ import annotations

import json
import re

import pytest
from helpers import assert_one_line_error, assert_same_run, cli, train_overrides

from mhgpo.model.checkpoint import list_checkpoints
from mhgpo.model.generation import HFGenerator
from mhgpo.rl.policy import Policy
from mhgpo.rl.trainer import Trainer
from mhgpo.runtime.runlog import read_metrics
from mhgpo.runtime.stopguard import error_text


class EngineDeadError(RuntimeError):
    """What vLLM raises when its engine core process has died (its name is what the trainer recognises)."""


def fail_in_rollouts_of(monkeypatch, step: int, error: BaseException) -> None:
    """Step `step`'s rollouts raise `error` from inside generation, after some of its calls were made."""
    collect, generate, calls = Trainer.collect, HFGenerator.generate, {"in": False, "n": 0}

    def watched_collect(self):
        calls["in"], calls["n"] = self.step + 1 == step, 0
        return collect(self)

    def failing_generate(self, prompts, params):
        if calls["in"]:
            calls["n"] += 1
            if calls["n"] == 2:  # the step's first agent has generated: the data position has moved on
                raise error
        return generate(self, prompts, params)

    monkeypatch.setattr(Trainer, "collect", watched_collect)
    monkeypatch.setattr(HFGenerator, "generate", failing_generate)


@pytest.mark.parametrize(
    "error, said",
    [
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), r"out of memory \(CUDA out of memory\. "),
        (EngineDeadError("EngineCore encountered an issue"), r"the generation engine died \(EngineDeadError: "),
        (KeyError("a team's tool read a key it lacks"), r"KeyError: \"a team's tool read a key it lacks\""),
    ],
    ids=["out-of-memory", "engine-died", "a-bug"],
)
def test_an_error_in_the_rollouts_saves_the_completed_steps_and_resume_continues(
    error, said, reference_run, tiny_model_dir, world, tmp_path, capsys, monkeypatch
) -> None:
    """No checkpoint is due (save_every=10): step 3's rollouts fail, steps 1 and 2 are saved as step_2 (step 3's
    questions rewound), and the resumed run is the uninterrupted reference run."""
    _, reference, _ = reference_run
    out = tmp_path / "run"
    fail_in_rollouts_of(monkeypatch, 3, error)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, save_every=10))
    assert_one_line_error(
        rc,
        err,
        rf"^mhgpo: error: step 3: {said}.* \(in its rollouts\); the run stops at step 2; its completed steps are "
        rf"saved \(its last checkpoint is step_2\); continue with: mhgpo train --resume {re.escape(str(out))}$",
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_2"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert [(e["step"], e["phase"]) for e in errors] == [(3, "rollouts")]
    assert type(error).__name__ in errors[0]["traceback"]
    monkeypatch.undo()
    assert cli(capsys, "train", "--resume", out)[0] == 0
    assert_same_run(out, reference)


def test_an_error_in_the_update_saves_nothing_of_it(tiny_model_dir, world, tmp_path, capsys, monkeypatch) -> None:
    """Step 2's update raises half-way: its weights are no step's, so step_1 stays the last checkpoint."""
    out = tmp_path / "run"
    update, calls = Policy.update, []

    def failing_update(self, samples, *rest):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory in the backward pass")
        return update(self, samples, *rest)

    monkeypatch.setattr(Policy, "update", failing_update)
    rc, _, err = cli(capsys, "train", *train_overrides(tiny_model_dir, world, out, save_every=1))
    assert_one_line_error(
        rc,
        err,
        r"^mhgpo: error: step 2: out of memory \(CUDA out of memory in the backward pass\).* \(in its update\); "
        r"the run stops at step 1; the update's weights belong to no step and are not saved; its last checkpoint "
        r"is step_1; continue with",
    )
    assert [p.name for p in list_checkpoints(out)] == ["step_1"] and [r["step"] for r in read_metrics(out)] == [1]


def test_error_text_is_one_printable_line() -> None:
    assert error_text(MemoryError()).startswith("out of memory (MemoryError); lower gen_batch_size")
    assert error_text(ValueError("bad\x1b[31m value\nsecond line")) == "ValueError: bad\\x1b[31m value"
    assert error_text(RuntimeError()) == "RuntimeError"


ON_RANK_ONE = """
import os

if os.environ.get("RANK") == "1":  # this rank's rollouts of step FAIL_AT_STEP run out of memory
    import mhgpo.rl.trainer as trainer

    grow = trainer.Trainer._grow

    def failing(self, questions, rng):
        if self.step + 1 == int(os.environ["FAIL_AT_STEP"]):
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return grow(self, questions, rng)

    trainer.Trainer._grow = failing
"""


def test_an_error_on_one_rank_stops_every_rank_with_the_completed_steps_saved(tiny_model_dir, world, tmp_path) -> None:
    """Two ranks; rank 1's rollouts of step 2 fail: every rank stops there (none waits for it), step 1 is saved,
    rank 0 says so in one line, and `--resume` on two ranks finishes the run."""
    from helpers import REPO, launch

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(ON_RANK_ONE)
    out = tmp_path / "run"
    p = launch(
        out,
        tiny_model_dir,
        world,
        "steps=3",
        "save_every=10",
        env={"PYTHONPATH": f"{hook}:{REPO}", "FAIL_AT_STEP": "2"},
    )
    log, _ = p.communicate(timeout=600)
    assert p.returncode != 0, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("mhgpo: error:")]
    assert errors == [
        f"mhgpo: error: step 2: rank 1: out of memory (CUDA out of memory. Tried to allocate 1.00 GiB); "
        f"lower gen_batch_size, optim.micro_batch_tokens or generation.gpu_memory_utilization before resuming (in "
        f"its rollouts); the run stops at step 1; its completed steps are saved (its last checkpoint is step_1); "
        f"continue with: mhgpo train --resume {out}"
    ], log[-3000:]
    assert [c.name for c in list_checkpoints(out)] == ["step_1"] and [r["step"] for r in read_metrics(out)] == [1]
    p = launch(out, tiny_model_dir, world, resume=True)
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
