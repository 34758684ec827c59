"""A training run with a warm start (`warm_start.enabled`): the warm start's run in RUN/warm_start, RL from its weights
with it as the reference, the run loading as a chain, and resuming from an interruption in either stage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import hand_samples, make_config
from safetensors.torch import load_file

from mhgpo.config import TrainConfig, load_config
from mhgpo.errors import InputError
from mhgpo.model.logprobs import output_logprobs
from mhgpo.model.trained import load_model
from mhgpo.rl.policy import Policy
from mhgpo.rl.sft import SFTTrainer
from mhgpo.run.pipeline import WARM_START_DIR, resume, train, warm_start_config
from mhgpo.runtime.runlog import read_metrics

WARM = {
    "warm_start.enabled": True,
    "warm_start.steps": 2,
    "warm_start.batch_size": 4,
    "warm_start.limit": 6,
    "warm_start.lr": 0.01,
    "warm_start.format_limit": 1,
    "search.snippet_words": 8,
    "search.max_candidates": 4,
    "precision": "fp32",
}


def warm_config(model_dir: Path, world: Path, out: Path, **extra: object) -> TrainConfig:  # noqa: F811
    return make_config(model_dir, world, out, **{"steps": 2, "save_every": 1, "eval_every": 0, **WARM, **extra})


def logprobs(model, samples) -> torch.Tensor:
    with torch.no_grad():
        logp, mask = output_logprobs(model, [s.prompt_ids for s in samples], [s.output_ids for s in samples], pad_id=3)
    return logp[mask]


def test_the_warm_start_config_is_the_runs(tiny_model_dir: Path, world: Path, tmp_path: Path) -> None:  # noqa: F811
    cfg = warm_config(tiny_model_dir, world, tmp_path / "run", **{"lora.per_role": "true", "lora.r": 8})
    sft = warm_start_config(cfg, tmp_path / "run" / WARM_START_DIR)
    assert (sft.steps, sft.batch_size, sft.limit, sft.optim.lr, sft.optim.kl_beta) == (2, 4, 6, 0.01, 0.0)
    assert (sft.data, sft.val_limit, sft.seed, sft.precision) == (cfg.data, 0, cfg.seed, "fp32")
    assert sft.search == cfg.search and sft.retrieval == cfg.retrieval  # the same prompts
    assert sft.lora.r == 8 and not sft.lora.per_role  # one shared adapter, merged before RL adds its own
    assert (sft.optim.schedule, sft.optim.warmup_steps, sft.balance_roles) == ("constant", 0, False)
    assert sft.loss_weighting == "output"
    cfg = warm_config(
        tiny_model_dir,
        world,
        tmp_path / "run2",
        **{"warm_start.schedule": "cosine", "warm_start.warmup_steps": 1, "warm_start.balance_roles": "true"},
        **{"warm_start.loss_weighting": "token"},
    )
    sft = warm_start_config(cfg, tmp_path / "run2" / WARM_START_DIR)
    assert (sft.optim.schedule, sft.optim.warmup_steps, sft.balance_roles) == ("cosine", 1, True)
    assert sft.loss_weighting == "token"
    with pytest.raises(InputError, match="warm_start.schedule: expected"):
        warm_config(tiny_model_dir, world, tmp_path / "run3", **{"warm_start.schedule": "linear"})


def test_the_warm_start_says_why_the_runs_precision_is_what_it_is(
    tiny_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # noqa: F811
    """The warm start gets the run's settled config, whose precision reads as "set in the config" when settled
    again: it is told the run's reason (`precision=auto`: what auto chose, and why) and prints that."""
    from mhgpo.model.distributed import current
    from mhgpo.model.precision import resolve_precision
    from mhgpo.rl import sft
    from mhgpo.run import pipeline
    from mhgpo.run.setup import settle

    job = settle(warm_config(tiny_model_dir, world, tmp_path / "run", precision="auto"), None, current())
    resolved, reason = resolve_precision("auto")
    assert (job.cfg.precision, job.reason) == (resolved, reason) and reason.startswith("auto: ")

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the model loaded and the precision told: nothing more is needed here

    monkeypatch.setattr(sft.SFTTrainer, "run", stop)
    with pytest.raises(KeyboardInterrupt):
        pipeline.warm_start(job, progress=False)
    assert f"mhgpo: precision {resolved} ({reason})\n" in capsys.readouterr().err


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory, tiny_model_dir, world):  # noqa: F811
    out = tmp_path_factory.mktemp("runs") / "warm"
    return out, train(warm_config(tiny_model_dir, world, out), progress=False)


def test_rl_starts_from_the_warm_start_which_is_its_reference(warm_run, tiny_model_dir) -> None:
    out, trainer = warm_run
    warm = out / WARM_START_DIR
    assert [r["step"] for r in read_metrics(warm)] == [1, 2] and (warm / "checkpoints" / "step_2").is_dir()
    assert load_config(TrainConfig, out / "config.yaml").model == f"{out.name}/{WARM_START_DIR}"
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    samples = hand_samples(load_model(str(tiny_model_dir), device="cpu"))
    warm_model = load_model(str(warm), device="cpu").model
    base = load_model(str(tiny_model_dir), device="cpu").model
    policy: Policy = trainer.setup.policy
    ref = torch.cat(policy.reference_logprobs(samples))
    torch.testing.assert_close(ref, logprobs(warm_model, samples), atol=1e-5, rtol=0)  # KL towards the warm start
    assert float((logprobs(warm_model, samples) - logprobs(base, samples)).abs().max()) > 1e-3  # it did move
    # the run loads as a chain: base, warm start merged, then RL's adapter
    torch.testing.assert_close(
        logprobs(load_model(str(out), device="cpu").model, samples), logprobs(policy.model, samples), atol=1e-5, rtol=0
    )


def test_an_interrupted_warm_start_resumes_and_the_run_ends_as_an_uninterrupted_one(
    warm_run,
    tiny_model_dir,
    world,
    tmp_path,
    monkeypatch,  # noqa: F811
) -> None:
    out, _ = warm_run
    cut = tmp_path / "cut"
    real_learn = SFTTrainer.learn

    def learn(self, samples, metrics):
        if self.step == 1:  # Ctrl-C during the warm start's second step: its first is saved
            raise KeyboardInterrupt
        return real_learn(self, samples, metrics)

    monkeypatch.setattr(SFTTrainer, "learn", learn)
    with pytest.raises(KeyboardInterrupt):
        train(warm_config(tiny_model_dir, world, cut), progress=False)
    assert (cut / WARM_START_DIR / "checkpoints" / "step_1").is_dir() and not (cut / "checkpoints").exists()
    monkeypatch.setattr(SFTTrainer, "learn", real_learn)
    assert resume(cut, progress=False).step == 2
    for sub in (WARM_START_DIR + "/checkpoints/step_2", "checkpoints/step_2"):
        a, b = load_file(str(out / sub / "model.safetensors")), load_file(str(cut / sub / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub


def test_a_run_interrupted_in_rl_resumes_rl_without_a_second_warm_start(
    warm_run,
    tiny_model_dir,
    world,
    tmp_path,  # noqa: F811
) -> None:
    out, _ = warm_run
    part = tmp_path / "part"
    train(warm_config(tiny_model_dir, world, part, steps=1), progress=False)
    before = (part / WARM_START_DIR / "metrics.jsonl").read_text()
    assert resume(part, ["steps=2"], progress=False).step == 2
    assert (part / WARM_START_DIR / "metrics.jsonl").read_text() == before  # the warm start did not run again
    a = load_file(str(out / "checkpoints" / "step_2" / "model.safetensors"))
    b = load_file(str(part / "checkpoints" / "step_2" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
