"""mhgpo/run/evaluate.py: a trained run is evaluated with the team settings it was trained with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mhgpo.config import EvalConfig
from mhgpo.errors import InputError
from mhgpo.run.evaluate import eval_config, trained_team

DEFAULTS = EvalConfig()


def fake_run(folder: Path, base: Path, **keys: object) -> Path:
    """A run directory as `mhgpo train` leaves one (config.yaml, one checkpoint) with `keys` in its config."""
    (folder / "checkpoints" / "step_3").mkdir(parents=True)
    (folder / "checkpoints" / "step_3" / "model.safetensors").write_bytes(b"")  # read only when loaded
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": str(base), **keys}), encoding="utf-8")
    return folder


TRAINED = {
    "system": "mas",
    "max_prompt_tokens": 1000,
    "search": {"snippet_words": 17, "reranker_penalty": 0.0, "answerer": {"max_new_tokens": 9}},
    "val_data": "synthetic:dev",  # not a team setting: the evaluation's data stays its own
    "precision": "fp32",
}


def test_a_run_is_evaluated_with_its_team_settings_under_the_callers(tmp_path, tiny_model_dir) -> None:
    run = fake_run(tmp_path / "run", tiny_model_dir, **TRAINED)
    cfg, origin = eval_config(None, [f"model={run}"])
    assert origin == run / "config.yaml"
    assert (cfg.search.snippet_words, cfg.search.reranker_penalty, cfg.search.answerer.max_new_tokens) == (17, 0.0, 9)
    assert cfg.search.rewriter == DEFAULTS.search.rewriter and cfg.max_prompt_tokens == 1000  # nested keys merge
    assert (cfg.data, cfg.precision) == (DEFAULTS.data, DEFAULTS.precision)

    # a checkpoint of the run reads the run's config; the caller's file and overrides come after the run's settings
    step = run / "checkpoints" / "step_3"
    assert trained_team(str(step)) == ({k: TRAINED[k] for k in ("system", "search", "max_prompt_tokens")}, origin)
    file = tmp_path / "eval.yaml"
    file.write_text(yaml.safe_dump({"model": str(step), "search": {"snippet_words": 23}}), encoding="utf-8")
    cfg, _ = eval_config(file, ["search.answerer.max_new_tokens=5"])
    assert (cfg.search.snippet_words, cfg.search.reranker_penalty, cfg.search.answerer.max_new_tokens) == (23, 0.0, 5)
    cfg, _ = eval_config(None, [f"model={run}"], base={"search": {"top_k": 2}})
    assert (cfg.search.top_k, cfg.search.snippet_words) == (2, 17)


def test_a_model_that_is_not_a_run_keeps_the_defaults(tiny_model_dir) -> None:
    assert trained_team(str(tiny_model_dir)) is None
    cfg, origin = eval_config(None, [f"model={tiny_model_dir}"])
    assert origin is None and cfg.search == DEFAULTS.search and cfg.max_prompt_tokens == DEFAULTS.max_prompt_tokens


def test_a_workflow_class_is_not_taken_from_the_run(tmp_path, tiny_model_dir) -> None:
    run = fake_run(tmp_path / "run", tiny_model_dir, system="my_team.py:MyTeam", team={"hops": 3}, search={"top_k": 2})
    cfg, origin = eval_config(None, [f"model={run}"])
    assert origin == run / "config.yaml"
    assert (cfg.system, cfg.team, cfg.search.top_k) == ("mas", {}, 2)


def test_a_run_config_this_version_cannot_read_is_named(tmp_path, tiny_model_dir) -> None:
    run = fake_run(tmp_path / "run", tiny_model_dir, search={"snippet_wrds": 17})
    with pytest.raises(InputError, match=rf"^{run / 'config.yaml'}: .*snippet_wrds"):
        eval_config(None, [f"model={run}"])


def test_a_model_that_cannot_be_resolved_is_left_to_the_load_to_report(tmp_path, tiny_model_dir) -> None:
    assert trained_team(str(tmp_path / "no-such-model")) is None
    (tmp_path / "run").mkdir()  # a run directory without a checkpoint: loading it names what is missing
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"model": str(tiny_model_dir)}), encoding="utf-8")
    assert trained_team(str(tmp_path / "run")) is None
