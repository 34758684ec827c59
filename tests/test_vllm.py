"""generation.engine=vllm: the engine samples from the policy being trained (run with a venv that has vLLM:
`bash scripts/setup.sh --vllm`; skipped without it).

Each test trains one step of a tiny team whose model vLLM's CPU attention takes (heads of 32 dimensions), in fp32,
at a large learning rate, and compares the engine's log-probs of fixed outputs (the step's own) with the trainer's,
before and after the update: LoRA shared by the agents, one adapter per agent, full fine-tuning.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import build_tiny_model  # noqa: E402
from helpers import make_config  # noqa: E402

from mhgpo.rl.engine_sync import EngineOutOfSync, checked  # noqa: E402

TOLERANCE = 1e-4  # fp32 on both sides


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny-vllm"), hidden_size=64, heads=2, kv_heads=1, max_positions=4096
    )


def _trainer(model_dir: Path, world: Path, out: Path, **extra: object):
    from helpers import trainer_for

    settings = {
        "generation.engine": "vllm",
        "generation.kv_cache_gb": 1,
        "precision": "fp32",
        "eval_every": 0,
        "optim.lr": 0.05,
        "questions_per_step": 2,
        "group_size": 2,
        **extra,
    }
    cfg = make_config(model_dir, world, out, **settings)
    return trainer_for(cfg, out)


def _engine_logprobs(trainer, fixed) -> list[list[float]]:
    engine, per_role = trainer.setup.generator, bool(trainer.setup.policy.roles)
    return [engine.score([s.prompt_ids], [s.output_ids], s.agent if per_role else None)[0] for s in fixed]


def _gap(a: list[list[float]], b: list) -> float:
    return max(abs(x - float(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _close_engine(trainer) -> None:
    trainer.setup.generator.close()


@pytest.mark.parametrize(
    "extra", [{}, {"lora.per_role": True}, {"lora.enabled": False}], ids=["lora", "lora-per-role", "full"]
)
def test_engine_follows_the_update(vllm_model_dir: Path, world: Path, tmp_path: Path, extra: dict) -> None:
    trainer = _trainer(vllm_model_dir, world, tmp_path / "run", **extra)
    try:
        policy = trainer.setup.policy
        batch, samples, metrics = trainer.collect()
        fixed = checked(samples, 6)  # the step's outputs, scored at temperature 1
        assert len(fixed) >= 2 and len({s.agent for s in fixed}) >= 2
        before = policy.current_logprobs(fixed)
        assert _gap(_engine_logprobs(trainer, fixed), before) < TOLERANCE  # the initial weights (the base)
        # what the engine sampled at temperature 1: its log-probs are the trainer's
        hot = [s for s in samples if s.output_ids and s.temperature == 1.0]
        assert metrics["engine/old_logprob_gap"] < TOLERANCE and hot
        metrics = trainer.learn(samples, metrics)
        after = policy.current_logprobs(fixed)
        assert _gap([b.tolist() for b in before], after) > 0.05  # the update moved them
        assert _gap(_engine_logprobs(trainer, fixed), after) < TOLERANCE  # and the engine with them
        assert metrics["engine/sync_logprob_gap"] < TOLERANCE
        if extra.get("lora.per_role"):
            assert set(trainer.setup.generator.adapters) == set(trainer.setup.workflow.agents)
    finally:
        _close_engine(trainer)


def test_a_skipped_sync_stops_the_run(
    vllm_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mhgpo.rl import engine_sync

    trainer = _trainer(vllm_model_dir, world, tmp_path / "run")
    try:
        batch, samples, metrics = trainer.collect()  # the first rollouts sync the engine
        monkeypatch.setattr(engine_sync, "sync", lambda engine, policy, scratch: None)
        with pytest.raises(EngineOutOfSync, match=r"step 1 .* differ from the trainer's by .*sync_tolerance=0\.001"):
            trainer.learn(samples, metrics)
    finally:
        _close_engine(trainer)


def test_greedy_generation_matches_the_trainer(vllm_model_dir: Path, tmp_path: Path) -> None:
    """Greedy decoding (evaluation): the same tokens as HFGenerator and log-probs within fp32 rounding."""
    import torch

    from mhgpo.model.generation import HFGenerator, SamplingParams
    from mhgpo.model.pretrained import stop_token_ids
    from mhgpo.model.trained import load_model
    from mhgpo.model.vllm_engine import VLLMGenerator

    lm = load_model(str(vllm_model_dir), device="cpu")
    prompts = [lm.tokenizer(text)["input_ids"] for text in ("Who wrote the novel Dune?", "The answer is", "Paris")]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    hf = HFGenerator(lm.model, lm.tokenizer).generate(prompts, params)
    setter, threads = torch.set_num_threads, torch.get_num_threads()
    engine = VLLMGenerator(vllm_model_dir, lm.tokenizer, stop_token_ids(lm.tokenizer, lm.model), kv_cache_gb=1)
    # vLLM's worker pins torch to one thread and disables torch.set_num_threads: undone for the trainer's passes
    assert torch.set_num_threads is setter and torch.get_num_threads() == threads
    try:
        ours = engine.generate(prompts, params)
    finally:
        engine.close()
    assert [g.output_ids for g in ours] == [g.output_ids for g in hf]
    assert [g.text for g in ours] == [g.text for g in hf] and [g.finished for g in ours] == [g.finished for g in hf]
    assert _gap([g.logprobs for g in ours], [g.logprobs for g in hf]) < TOLERANCE


def test_evaluation_on_the_engine_answers_as_on_the_trainers_loop(vllm_model_dir: Path, world: Path) -> None:
    """`mhgpo.evaluate` with generation.engine=vllm: greedy, so the same predictions as generation.engine=hf."""
    from mhgpo.api import evaluate

    settings = [
        f"model={vllm_model_dir}",
        f"data=hotpotqa:{world / 'dev.jsonl'}",
        "limit=3",
        "precision=fp32",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        "search.rewriter.max_new_tokens=8",
        "search.reranker.max_new_tokens=4",
        "search.answerer.max_new_tokens=6",
        "generation.kv_cache_gb=1",
    ]
    hf = evaluate(overrides=settings, progress=False)
    ours = evaluate(overrides=[*settings, "generation.engine=vllm"], progress=False)
    gc.collect()
    assert [p["prediction"] for p in ours.predictions] == [p["prediction"] for p in hf.predictions]
    assert ours.metrics["f1"] == hf.metrics["f1"]


def test_a_run_logs_the_gap_and_a_resumed_run_starts_from_its_checkpoints_weights(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """`train` then `resume`: every step logs its sync check, and the resumed run's engine is handed the
    checkpoint's adapter before its first rollouts (else its first check would fail)."""
    import json

    from mhgpo.run.pipeline import resume, train

    out = tmp_path / "run"
    cfg = make_config(
        vllm_model_dir,
        world,
        out,
        **{"generation.engine": "vllm", "generation.kv_cache_gb": 1, "precision": "fp32", "eval_every": 0, "steps": 2},
    )
    train(cfg, progress=False).setup.generator.close()
    resume(out, ["steps=3"], progress=False).setup.generator.close()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 <= r["engine/sync_logprob_gap"] < TOLERANCE for r in rows)
    assert all(r["engine/old_logprob_gap"] < TOLERANCE for r in rows)
