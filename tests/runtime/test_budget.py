"""`budget_minutes` / `budget_clock`: `mhgpo train` stops before the step that would not fit, validates and saves
at the step it stops at, keeps the time used in its checkpoints, and says so in its metrics, summary and report.
The clock is replaced by one that each update advances by 50 seconds, so the steps are decided exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import train_overrides, write_echo_world

from mhgpo.config import TrainConfig, load_config
from mhgpo.errors import InputError
from mhgpo.rl.trainer import Trainer
from mhgpo.runtime import budget as budget_module
from mhgpo.runtime.budget import Budget

STEP_SECONDS = 50.0


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_echo_world(tmp_path_factory.mktemp("world"), seed=3, n_train=12, n_dev=3)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """The budget's cpu clock, advanced by STEP_SECONDS inside every update."""
    clock = {"t": 1000.0}
    monkeypatch.setitem(budget_module.CLOCKS, "cpu", lambda: clock["t"])
    learn = Trainer.learn

    def timed_learn(self, samples, metrics):
        clock["t"] += STEP_SECONDS
        return learn(self, samples, metrics)

    monkeypatch.setattr(Trainer, "learn", timed_learn)
    return clock


def mhgpo(*args: object) -> int:
    from mhgpo.cli.main import main

    return main([str(a) for a in args])


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoint_state(run: Path, step: int) -> dict:
    return json.loads((run / "checkpoints" / f"step_{step}" / "state.json").read_text())


def test_the_budget_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"t": 0.0}
    monkeypatch.setitem(budget_module.CLOCKS, "cpu", lambda: clock["t"])
    b = Budget(2.5)  # 150 s
    assert b.fits() and b.metrics(stopping=False) == {"budget/minutes_used": 0.0}  # the first step always runs
    decisions = []
    for _ in range(3):  # steps of 50 s: used + mean = 100, 150, 200 against 150
        start = b.now()
        clock["t"] += STEP_SECONDS
        b.spend(start)
        decisions.append(b.fits())
    assert decisions == [True, True, False] and (b.used, b.steps) == (150.0, 3)
    assert b.metrics(stopping=True) == {"budget/minutes_used": 2.5, "budget/stopped": 1.0}
    assert Budget(None).metrics(stopping=False) == {} and Budget(None).fits()
    restored = Budget(2.5)
    restored.restore({"seconds": 150.0, "steps": 3, "clock": "cpu"})
    assert (restored.used, restored.steps, restored.fits()) == (150.0, 3, False)
    restored.restore({"seconds": 100.0, "steps": 2, "clock": "cpu"})
    assert restored.fits()
    restored.restore({"seconds": 150.0, "steps": 3, "clock": "wall"})  # another clock's seconds are not mixed in
    assert (restored.used, restored.steps, restored.fits()) == (0.0, 0, True)


def test_budget_keys_are_validated_naming_the_key() -> None:
    with pytest.raises(InputError, match=r"^budget_minutes: must be positive \(or null: no budget\), got 0$"):
        load_config(TrainConfig, None, ["budget_minutes=0"])
    with pytest.raises(InputError, match=r"^budget_clock: expected cpu or wall, got 'gpu'$"):
        load_config(TrainConfig, None, ["budget_minutes=3", "budget_clock=gpu"])
    with pytest.raises(InputError, match=r"^budget_minutes: expected a number"):
        load_config(TrainConfig, None, ["budget_minutes=soon"])
    cfg = load_config(TrainConfig, None, ["budget_minutes=2.5", "budget_clock=wall"])
    assert (cfg.budget_minutes, cfg.budget_clock) == (2.5, "wall")
    assert load_config(TrainConfig).budget_minutes is None


def test_train_stops_before_the_step_that_would_not_fit(world, tiny_model_dir, tmp_path, fake_clock, capsys) -> None:
    run = tmp_path / "run"
    settings = train_overrides(tiny_model_dir, world, run, steps=10, eval_every=100, save_every=100)
    assert mhgpo("train", *settings, "budget_minutes=2.5") == 0
    out = capsys.readouterr().out
    assert "stopped by the time budget after 3 of 10 steps (2.5 of 2.5 cpu minutes used)" in out
    assert "(step 3)" in out  # validated at the step it stopped at
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["budget/minutes_used"] for r in rows] == pytest.approx([50 / 60, 100 / 60, 150 / 60])
    assert [r.get("budget/stopped") for r in rows] == [None, None, 1.0]
    assert ["val/f1" in r for r in rows] == [False, False, True]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_3"]  # saved as at a last step
    assert checkpoint_state(run, 3)["budget"] == {"seconds": 150.0, "steps": 3, "clock": "cpu"}

    from mhgpo.run.report import build_report

    report = build_report([run], tmp_path / "report").read_text()
    assert "The run stopped by its time budget at step 3: 2.5 of 2.5 cpu minutes used." in report

    assert mhgpo("train", "--resume", run) == 0  # resumed, it is still out of time: no step runs
    assert "stopped by the time budget after 3 of 10 steps" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert mhgpo("train", "--resume", run, "budget_minutes=3.4") == 0  # more time: step 4 fits (200 of 204 s)
    assert "stopped by the time budget after 4 of 10 steps" in capsys.readouterr().out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_resume_keeps_the_time_used(world, tiny_model_dir, tmp_path, fake_clock, capsys) -> None:
    run = tmp_path / "run"
    settings = train_overrides(tiny_model_dir, world, run, steps=2, eval_every=100, save_every=1)
    assert mhgpo("train", *settings, "budget_minutes=2.5") == 0  # `steps` ends it first: 100 of 150 s used
    assert "finished 2 steps" in capsys.readouterr().out
    assert "budget/stopped" not in metrics(run)[-1] and checkpoint_state(run, 2)["budget"]["seconds"] == 100.0
    from mhgpo.run.report import build_report

    report = build_report([run], tmp_path / "report").read_text()
    assert "The run ended within its time budget at step 2: 1.7 of 2.5 cpu minutes used." in report
    assert mhgpo("train", "--resume", run, "steps=10") == 0  # step 3 fits (100 + 50), step 4 would not
    assert "stopped by the time budget after 3 of 10 steps (2.5 of 2.5 cpu minutes used)" in capsys.readouterr().out
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["budget/stopped"] == 1.0
    assert checkpoint_state(run, 3)["budget"] == {"seconds": 150.0, "steps": 3, "clock": "cpu"}
