"""`mhgpo report`: plots, the results table and traces from a short run on the tiny model; missing pieces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mhgpo.rl.evaluation import EvalResult, write_eval
from mhgpo.run.report import build_report, intra_group_similarity, results_table, load_run, token_f1

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
    expected = ["reward_and_val_f1.png", "penalties.png", "behaviour.png", "intra_group_similarity.png", "cost.png"]
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
