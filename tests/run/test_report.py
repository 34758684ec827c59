"""`mhgpo report`: plots, the results table and traces from a short run on the tiny model; missing pieces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mhgpo.rl.evaluation import EvalResult, write_eval
from mhgpo.run.report import Run, build_report, intra_group_similarity, load_run, results_table, token_f1

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory, reference_run) -> Path:
    """A copy of the session's reference run (4 steps, validated at steps 2 and 4), with an evaluation added."""
    out = tmp_path_factory.mktemp("runs") / "short"
    shutil.copytree(reference_run[1], out)
    metrics = {"n": 10, "acc": 30.0, "em": 20.0, "f1": 25.0, "seconds": 1.0, "data": "hotpotqa:dev"}
    write_eval(EvalResult(metrics, []), out / "eval_after")
    return out


def test_report_from_a_short_run(short_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    md = build_report([short_run], out).read_text()
    expected = ["reward_and_val_f1.png", "learning.png", "question_forms.png", "penalties.png", "behaviour.png"]
    expected += ["intra_group_similarity.png", "cost.png"]
    for name in expected:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert f"]({name})" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(expected)
    assert "src='reward_and_val_f1.png'" not in html  # images are inlined, the page stands alone
    # the table's numbers are the metrics file's
    row = next(line for line in md.splitlines() if line.startswith("| MHGPO-RR"))
    assert row.split("|")[2:5] == [" 30.0 ", " 20.0 ", " 25.0 "]
    assert "Example traces" in md and "first step (step_000001)" in md and "last step (step_000004)" in md
    assert "has no" not in md


def test_table_numbers_equal_the_metrics_files(short_run: Path) -> None:
    run = load_run(short_run)
    header, body = results_table([run])
    saved = json.loads((short_run / "eval_after" / "metrics.json").read_text())
    assert header[:4] == ["run", "hotpotqa:dev Acc", "hotpotqa:dev EM", "hotpotqa:dev F1"]
    assert body[0][1:4] == [f"{saved['acc']:.1f}", f"{saved['em']:.1f}", f"{saved['f1']:.1f}"]
    assert body[0][4:] == body[0][1:4]  # one dataset: the averages are its numbers


def test_report_says_what_is_missing(short_run: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(short_run, bare, ignore=shutil.ignore_patterns("rollouts", "eval_after", "checkpoints"))
    md = build_report([bare], tmp_path / "r").read_text()
    assert "has no rollout records (rollouts/); no evaluation results (metrics.json)." in md
    assert "No evaluation results were found." in md
    assert (tmp_path / "r" / "reward_and_val_f1.png").exists()
    assert not (tmp_path / "r" / "intra_group_similarity.png").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    md = build_report([empty], tmp_path / "r2").read_text()
    assert "No training metrics were found" in md and "No evaluation results were found." in md


def test_token_f1_and_intra_group_similarity() -> None:
    assert token_f1("a b c", "a b d") == pytest.approx(2 / 3, abs=1e-12)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0
    rows = [
        {"trained": True, "group_id": 0, "agent": "answerer", "output": "paris"},
        {"trained": True, "group_id": 0, "agent": "answerer", "output": "paris"},
        {"trained": True, "group_id": 0, "agent": "answerer", "output": "rome"},
        {"trained": True, "group_id": 1, "agent": "rewriter", "output": "a b"},
        {"trained": True, "group_id": 1, "agent": "rewriter", "output": "a c"},
        {"trained": False, "group_id": -1, "agent": "rewriter", "output": "zzz"},
    ]
    sims = intra_group_similarity(rows)
    assert sims["answerer"] == pytest.approx(1 / 3, abs=1e-12)  # pairs: 1, 0, 0
    assert sims["rewriter"] == pytest.approx(0.5, abs=1e-12)


def _staged_run() -> Run:

    metrics = [
        {"step": s, "reward/mean": r, **({"val/f1": v} if v is not None else {})}
        for s, r, v in [
            (1, 0.125, None),
            (2, 0.0, 50.0),
            (3, 0.25, None),
            (4, 0.5, 55.0),
            (5, 0.0, None),
            (6, 0.0, 57.3),
        ]
    ]
    evals = {
        "eval_before": {"label": "untrained", "f1": 4.3, "acc": 23.0, "em": 0.0},
        "eval_warm_start": {"label": "warm start", "f1": 51.3, "acc": 51.0, "em": 51.0},
    }
    return Run(Path("runs/demo"), "demo", {}, metrics, [], evals)


def test_validation_plot_gives_the_warm_start_its_own_point() -> None:
    """The untrained team is a point of its own, not the start of RL's line; RL's line starts at the warm start."""
    from mhgpo.run.report import _plot_reward_and_val_f1

    fig = _plot_reward_and_val_f1([_staged_run()])
    ax = fig.axes[1]
    lines = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle()) for line in ax.lines
    }
    assert lines["demo: RL"][:2] == ([0, 2, 4, 6], [51.3, 50.0, 55.0, 57.3])
    assert lines["demo: warm start"] == ([0], [51.3], "None")
    assert lines["demo: untrained"] == ([0], [4.3], "None")
    reward = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert reward["demo"] == pytest.approx([0.125, 0.0625, 0.125, 0.375, 0.25, 0.0])  # trailing means of 2 steps


def test_training_summary_uses_the_first_and_last_third_with_their_spread() -> None:
    from mhgpo.run.report import moving_average, smoothing_window, training_summary

    assert [smoothing_window(n) for n in (1, 2, 3, 4, 6, 10, 12)] == [1, 1, 1, 2, 2, 4, 4]
    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    steps = [{"step": s, "reward/mean": r} for s, r in enumerate([0.0, 0.2, 0.1, 0.1, 0.3, 0.5, 0.4, 0.4, 0.6, 0.8], 1)]
    assert training_summary(steps) == "0.100 ± 0.071 (steps 1–4) → 0.550 ± 0.166 (steps 7–10)"
    assert training_summary(steps[:1]) == "0.000 (step 1)"
