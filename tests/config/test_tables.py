"""The extension axes are tables (mhgpo/config/tables.py): an entry the code has never seen (an algorithm, an
advantage scheme, a policy loss, a generation engine) is one entry plus its function, and a run trains with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import make_config

from mhgpo.config import samplers, tables
from mhgpo.errors import InputError
from mhgpo.model.generation import HFGenerator
from mhgpo.rl.losses import mhgpo_policy_loss
from mhgpo.run.pipeline import train
from mhgpo.runtime.runlog import read_metrics

CALLS: dict[str, int] = {}


def everyone_keys(agents: np.ndarray, prompt_keys: np.ndarray, visits: np.ndarray) -> np.ndarray:
    """An advantage scheme of the test: every trained sample of the step in one group."""
    return np.zeros((len(agents), 1), dtype=np.int64)  # (N, 1)


def unclipped_loss(logp, old_logp, ref_logp, advantages, weights, mask, clip_eps, kl_beta):
    """A policy loss of the test: the ratio unclipped (a large clip range), counted when called."""
    CALLS["loss"] = CALLS.get("loss", 0) + 1
    return mhgpo_policy_loss(logp, old_logp, ref_logp, advantages, weights, mask, 100.0, kl_beta)


class CountingGenerator(HFGenerator):
    def generate(self, prompts, params):
        CALLS["generate"] = CALLS.get("generate", 0) + len(prompts)
        return super().generate(prompts, params)


def counting_engine(*, model, loaded, batch_size, precision, select=None, **_):
    """A generation engine of the test: mhgpo's own loop, counting the prompts it completes."""
    return CountingGenerator(model, loaded.tokenizer, batch_size=batch_size, precision=precision, select=select)


def one_step(tiny_model_dir: Path, world: Path, out: Path, **extra: object) -> list[dict]:
    cfg = make_config(tiny_model_dir, world, out, steps=1, eval_every=0, save_every=1, **extra)
    train(cfg, progress=False)
    return read_metrics(out)


@pytest.fixture(autouse=True)
def _counts():
    CALLS.clear()


def test_a_new_algorithm_is_one_table_entry(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    """An algorithm the code has never seen, with its own default sampler (IS), trains the team; its label names
    it with its sampler, and the CLI offers it."""
    entry = tables.Algorithm("teamgrpo", "TeamGRPO", sampler="is", label_sampler=True)
    monkeypatch.setitem(tables.ALGORITHMS, "teamgrpo", entry)
    rows = one_step(tiny_model_dir, world, tmp_path / "run", algo="teamgrpo", sampler="null")
    assert rows[0]["step"] == 1 and rows[0]["samples"] > 0 and rows[0]["grad_norm"] > 0
    assert "sampler: is" in (tmp_path / "run" / "config.yaml").read_text()
    assert tables.algo_label("teamgrpo", "is") == "TeamGRPO-IS"
    assert samplers.trains_with(entry, samplers.sampler("rr")) and not samplers.trains_with(
        entry, samplers.sampler("chains")
    )
    from mhgpo.cli.main import build_parser

    assert build_parser().parse_args(["train", "--algo", "teamgrpo"]).algo == "teamgrpo"


def test_a_new_policy_loss_is_one_table_entry(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(
        tables.POLICY_LOSSES, "unclipped", tables.PolicyLoss("unclipped", "test_tables:unclipped_loss", "no clip")
    )
    rows = one_step(tiny_model_dir, world, tmp_path / "run", **{"optim.loss": "unclipped"})
    assert CALLS["loss"] >= 1 and rows[0]["clip_fraction"] == 0.0 and rows[0]["grad_norm"] > 0
    with pytest.raises(
        InputError, match=r"^optim.loss: expected clipped, icepop or unclipped \(or null\), got 'nope'$"
    ):
        make_config(tiny_model_dir, world, tmp_path / "x", **{"optim.loss": "nope"})


def test_a_new_advantage_scheme_is_one_table_entry(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    """A scheme of one group for the whole step: every trained sample normalised together (mean 0 over the
    step's samples)."""
    scheme = tables.AdvantageScheme("everyone", "test_tables:everyone_keys", "one group a step")
    monkeypatch.setitem(tables.ADVANTAGE_SCHEMES, "everyone", scheme)
    rows = one_step(tiny_model_dir, world, tmp_path / "run", advantage="everyone")
    assert rows[0]["groups"] == 1.0 and rows[0]["samples"] > 2
    records = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    trained = [r for r in records if r["trained"]]
    assert len(trained) == rows[0]["samples"] and {r["group_id"] for r in trained} == {0}
    assert abs(sum(r["advantage"] for r in trained)) < 1e-6 * len(trained)


def test_a_new_engine_is_one_table_entry(tiny_model_dir, world, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(tables.ENGINES, "counting", tables.Engine("counting", "test_tables:counting_engine"))
    rows = one_step(tiny_model_dir, world, tmp_path / "run", **{"generation.engine": "counting"})
    assert CALLS["generate"] == rows[0]["llm_calls"] > 0


def test_tables_reject_unknown_names_naming_the_key(tiny_model_dir, world, tmp_path) -> None:
    for key, value, message in (
        ("algo", "dpo", r"^algo: expected mhgpo, grpo, mappo or ppo, got 'dpo'$"),
        ("advantage", "x", r"^advantage: expected mhgpo, mhgpo_mean, agent or prompt_agent_turn, got 'x'$"),
        ("generation.engine", "x", r"^generation.engine: expected hf, vllm or vllm_server, got 'x'$"),
    ):
        with pytest.raises(InputError, match=message):
            make_config(tiny_model_dir, world, tmp_path / "x", **{key: value})
