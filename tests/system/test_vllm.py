"""generation.engine=vllm: the engine samples from the policy being trained (run with a venv that has vLLM:
`bash scripts/setup.sh --vllm`; skipped without it).

Each test trains one step of a tiny team whose model vLLM's CPU attention takes (heads of 32 dimensions): in fp32,
at a large learning rate, the engine's log-probs of fixed outputs (the step's own) are the trainer's before and after
the update, LoRA shared by the agents, one adapter per agent, full fine-tuning; the sync check stops the run when
the hand-over is skipped after a small update (fp32, bf16-mixed), when stale weights are handed over and when a
log-prob is NaN; agents at other temperatures with top-p get the trainer's log-probs from the engine. Two launches
of 2 ranks (gloo) give each rank an engine of its own: with plain data parallelism (one adapter per agent; against
the hf engine, and resumed) and with FSDP (full fine-tuning; a hand-over skipped on one rank).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from conftest import build_tiny_model  # noqa: E402
from helpers import REPO, comparable, launch, long_prompts, make_config  # noqa: E402

from mhgpo.rl import engine_sync  # noqa: E402
from mhgpo.rl.engine_sync import DEFAULT_TOLERANCE, EngineGapNotFinite, EngineOutOfSync, checked  # noqa: E402

TOLERANCE = 1e-4  # fp32 on both sides
# one update at it moves the log-probs by less than the sync check's gap tolerance (1e-3 in fp32, 0.1 in bf16-mixed),
# yet by more than nothing. The move depends on the rollouts a CPU's rounding samples: on a CPU with AVX2 only the
# stale engine's mean gap in fp32 was 1.4e-3 (per-role LoRA) and 5.6e-3 (full) at 1e-5, 1.4e-4 and 5.7e-4 at 1e-6;
# in bf16-mixed 1e-6 moves a LoRA model's log-probs by nothing (lost in the bfloat16 base's rounding)
SMALL_LR = {"fp32": 3e-7, "bf16-mixed": 1e-5}
# the tests of an update need step 1 to have a gradient: seed 0's draws from the process's generator give one; those
# of the per-request seeds (generation.seeded) leave every group of the tiny world's step 1 at equal rewards
A_GRADIENT = {"generation.seeded": False}


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
    return [
        engine.score([s.prompt_ids], [s.output_ids], s.agent if per_role else None, s.temperature)[0] for s in fixed
    ]


def _gap(a: list[list[float]], b: list) -> float:
    return max(abs(x - float(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _close_engine(trainer) -> None:
    trainer.setup.generator.close()


MODES = {"lora": {}, "lora-per-role": {"lora.per_role": True}, "full": {"lora.enabled": False}}
FIGURES = ("engine/logprob_gap_mean", "engine/logprob_gap_max", "engine/kl_k3", "engine/mult_prob_error")


@pytest.mark.parametrize("mode", MODES)
def test_engine_follows_the_update(vllm_model_dir: Path, world: Path, tmp_path: Path, mode: str) -> None:
    trainer = _trainer(vllm_model_dir, world, tmp_path / "run", **MODES[mode], **A_GRADIENT)
    try:
        policy = trainer.setup.policy
        batch, samples, metrics = trainer.collect()
        fixed = checked(samples, 6)  # the step's outputs
        assert len(fixed) >= 2 and len({s.agent for s in fixed}) >= 2
        before = policy.current_logprobs(fixed)
        assert _gap(_engine_logprobs(trainer, fixed), before) < TOLERANCE  # the initial weights (the base)
        # what the engine sampled: its log-probs are the trainer's
        assert metrics["engine/old_logprob_gap"] < TOLERANCE
        metrics = trainer.learn(samples, metrics)
        after = policy.current_logprobs(fixed)
        assert _gap([b.tolist() for b in before], after) > 0.05  # the update moved them
        assert _gap(_engine_logprobs(trainer, fixed), after) < TOLERANCE  # and the engine with them
        assert metrics["engine/logprob_gap_mean"] <= metrics["engine/logprob_gap_max"] < TOLERANCE
        assert 0 <= metrics["engine/kl_k3"] < TOLERANCE**2 and 1 <= metrics["engine/mult_prob_error"] < 1 + TOLERANCE
        engine = trainer.setup.generator
        assert engine.version == 1 and engine_sync.stale(engine, policy, 1) is None
        if mode == "lora-per-role":
            assert set(engine.adapters) == set(engine.held().adapters) == set(trainer.setup.workflow.agents)
        if mode == "full":  # the engine's own tensors that keep the trainer's layout are compared: which
            shapes = {n: tuple(t.shape) for n, t in policy.model.state_dict().items()}
            assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(engine.held(shapes).tensors)
    finally:
        _close_engine(trainer)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_skipped_sync_after_one_small_update_stops_the_run(
    vllm_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, precision: str, mode: str
) -> None:
    """The update moves the log-probs by less than the gap tolerance: the engine's version and digests catch it."""
    trainer = _trainer(
        vllm_model_dir,
        world,
        tmp_path / "run",
        precision=precision,
        **{"optim.lr": SMALL_LR[precision]},
        **MODES[mode],
        **A_GRADIENT,
    )
    try:
        policy, engine = trainer.setup.policy, trainer.setup.generator
        batch, samples, metrics = trainer.collect()  # the first rollouts sync the engine
        assert engine_sync.stale(engine, policy, 0) is None  # in sync: the digests agree in the engine's dtype
        fixed = checked(samples, 6)
        before = policy.current_logprobs(fixed)
        monkeypatch.setattr(engine_sync, "sync", lambda *args: None)
        with pytest.raises(
            EngineOutOfSync,
            match=r"^generation\.engine=vllm: after the update of step 1 the engine does not hold the trained "
            r"weights \(it holds the weights of update 0, the trainer those of update 1\); the run stops; it has no "
            r"checkpoint yet$",
        ):
            trainer.learn(samples, metrics)
        moved = _gap([b.tolist() for b in before], policy.current_logprobs(fixed))
        alone = engine_sync.check_sync(engine, policy, samples, 4, 1)  # what the gap alone would say
        print(
            f"{precision} {mode}: the update moved the log-probs by {moved:.3g}, the stale engine's gap {alone.figures}"
        )
        assert 0 < moved and alone.figures["engine/logprob_gap_mean"] < DEFAULT_TOLERANCE[precision]
        assert alone.stale is not None
    finally:
        _close_engine(trainer)


@pytest.mark.parametrize("mode", MODES)
def test_a_hand_over_of_stale_weights_stops_the_run(
    vllm_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The hand-over happens with the right version but stale content (the adapter's files not written again; the
    full weights not loaded): the digests of what the engine loaded catch it."""
    trainer = _trainer(vllm_model_dir, world, tmp_path / "run", **MODES[mode], **A_GRADIENT)
    try:
        policy, engine = trainer.setup.policy, trainer.setup.generator
        batch, samples, metrics = trainer.collect()
        if mode == "full":
            monkeypatch.setattr(engine, "load_weights", lambda named, version: setattr(engine, "version", version))
            what = r"its model\.\S+ differs from the trainer's"
        else:
            monkeypatch.setattr(policy.model, "save_pretrained", lambda *args, **kwargs: None)
            agent = "the agents" if mode == "lora" else "|".join(policy.roles)  # (the first whose adapter moved)
            what = f"the adapter it loaded for ({agent}) differs from the trainer's"
        with pytest.raises(EngineOutOfSync, match=rf"step 1 the engine does not hold the trained weights \({what}\)"):
            trainer.learn(samples, metrics)
    finally:
        _close_engine(trainer)


def test_a_log_prob_that_is_not_finite_stops_the_run(
    vllm_model_dir: Path, world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _trainer(vllm_model_dir, world, tmp_path / "run")
    try:
        engine = trainer.setup.generator
        batch, samples, metrics = trainer.collect()
        score, calls = engine.score, []

        def one_nan(*args: object) -> list[list[float]]:  # the first token the check scores
            rows = score(*args)
            if not calls:
                rows[0][0] = float("nan")
            calls.append(args)
            return rows

        monkeypatch.setattr(engine, "score", one_nan)
        with pytest.raises(
            EngineGapNotFinite,
            match=r"^generation\.engine=vllm: after the update of step 1 the log-probs of the step's outputs are not "
            r"finite \(NaN or infinite at 1 of \d+ tokens on the engine's side, 0 on the trainer's\); the run stops; "
            r"it has no checkpoint yet$",
        ):
            trainer.learn(samples, metrics)
    finally:
        _close_engine(trainer)


def test_engine_log_probs_are_the_trainers_at_any_temperature_and_top_p(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """Agents at temperatures 0.7 and 1.3 with top-p 0.8: the engine's log-probs of what it sampled are the
    trainer's, ``log_softmax(logits / T)`` before top-p (no log of the kept mass in them), so that the ratio is 1
    on-policy with optim.old_logprobs=engine, and the truncated importance weight is 1 with trainer."""
    hot = {
        "search.rewriter.temperature": 0.7,
        "search.reranker.temperature": 1.3,
        "search.answerer.temperature": 0.7,
        **{f"search.{agent}.top_p": 0.8 for agent in ("rewriter", "reranker", "answerer")},
    }
    trainer = _trainer(vllm_model_dir, world, tmp_path / "run", **{"optim.engine_is_cap": 2.0}, **hot)
    try:
        batch, samples, metrics = trainer.collect()  # optim.old_logprobs=trainer: recomputed, the engine's kept
        drawn = [s for s in samples if s.output_ids]
        assert {s.temperature for s in drawn} == {0.7, 1.3}
        assert metrics["engine/old_logprob_gap"] < TOLERANCE
        assert all(_gap([s.engine_logprobs], [s.old_logprobs]) < TOLERANCE for s in drawn)
        metrics = trainer.learn(samples, metrics)
        assert abs(metrics["engine/is_weight"] - 1) < TOLERANCE and metrics["engine/is_clipped"] == 0.0
        assert metrics["engine/logprob_gap_mean"] < TOLERANCE  # the check scores at the samples' temperatures
    finally:
        _close_engine(trainer)
    trainer = _trainer(vllm_model_dir, world, tmp_path / "engine", **{"optim.old_logprobs": "engine"}, **hot)
    try:
        batch, samples, metrics = trainer.collect()
        assert "engine/old_logprob_gap" not in metrics  # the engine's log-probs, as it reported them
        metrics = trainer.learn(samples, metrics)  # one epoch: the ratio of the weights that sampled
        assert abs(metrics["ratio"] - 1) < TOLERANCE and metrics["clip_fraction"] == 0.0
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


def test_the_rollouts_pipeline_gets_each_engine_steps_finished_requests_with_the_same_results(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """rollout.pipeline on the in-process engine: a call's requests are reported as the engine finishes them, in
    more than one chunk, each prompt once, and the generations are those of the call without the reports; a step's
    rollouts and samples with the pipeline are those without it."""
    from mhgpo.model.generation import SamplingParams

    trainer = _trainer(vllm_model_dir, world, tmp_path / "off", **{"rollout.pipeline": False})
    try:
        engine = trainer.setup.generator
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]] * 2
        params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
        chunks: list = []
        with engine.seeded((1, 2, 3)):
            plain = engine.generate(prompts, params)
        with engine.seeded((1, 2, 3)):
            reported = engine.generate(prompts, params, on_chunk=lambda idx, gens: chunks.append((idx, gens)))
        assert [(g.output_ids, g.logprobs) for g in reported] == [(g.output_ids, g.logprobs) for g in plain]
        assert len({len(g.output_ids) for g in plain}) > 1 and len(chunks) > 1  # (lengths differ: several chunks)
        assert sorted(i for idx, _ in chunks for i in idx) == list(range(len(prompts)))
        for idx, gens in chunks:
            assert [reported[i] for i in idx] == gens
        off = trainer.collect()[1]
    finally:
        _close_engine(trainer)
        del trainer
        gc.collect()
    trainer = _trainer(vllm_model_dir, world, tmp_path / "on", **{"rollout.pipeline": True})
    try:
        on = trainer.collect()[1]
    finally:
        _close_engine(trainer)
    assert on == off and len(on) > 4 and len({tuple(s.output_ids) for s in on}) > 1


def test_seeded_requests_whose_prompts_overflow_one_prefill_budget_sample_and_repeat(vllm_model_dir: Path) -> None:
    """A prompt prefilled in chunks draws a token that vLLM discards, rewinding the seeded request's generator by an
    offset that a CPU generator has not: the engine died on the demo's batches. Whole-prompt prefills sample, and the
    same seeds draw the same tokens."""
    from mhgpo.model.generation import SamplingParams
    from mhgpo.model.pretrained import stop_token_ids
    from mhgpo.model.trained import load_model
    from mhgpo.model.vllm_engine import VLLMGenerator

    lm = load_model(str(vllm_model_dir), device="cpu")
    engine = VLLMGenerator(vllm_model_dir, lm.tokenizer, stop_token_ids(lm.tokenizer, lm.model), kv_cache_gb=1)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9)
    try:
        runs = []
        for _ in range(2):
            with engine.seeded((1, 2, 3)):
                runs.append([g.output_ids for g in engine.generate(long_prompts(), params)])
    finally:
        engine.close()
    assert runs[0] == runs[1] and len(runs[0]) == 16 and all(len(o) > 0 for o in runs[0])
    assert len({tuple(o) for o in runs[0]}) > 1


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
    assert all(0 <= r["engine/logprob_gap_mean"] < TOLERANCE for r in rows)
    assert all(r["engine/old_logprob_gap"] < TOLERANCE for r in rows)


# ------------------------------------------------------------------- an engine on every rank of a launch (2, gloo)

ENGINE = ("generation.engine=vllm", "generation.kv_cache_gb=1", "precision=fp32")
IN_SYNC = 1e-4  # fp32 on both sides


def _launch(out: Path, model_dir: Path, world: Path, *extra: str, **kwargs: object) -> str:
    """`accelerate launch ... -m mhgpo train` on 2 ranks (`helpers.launch`) for 2 steps, validated at
    step 2; its log, after it ends."""

    p = launch(out, model_dir, world, "steps=2", *extra, **kwargs)
    log, _ = p.communicate(timeout=600)
    return log if p.returncode == 0 else f"exit {p.returncode}\n{log}"


def _questions_by_rank(out: Path) -> list[dict[int, list[str]]]:
    """Each step's questions (rollout file), by the rank that grew their trees, in order."""
    import json

    steps = []
    for path in sorted((out / "rollouts").glob("step_*.jsonl")):
        by_rank: dict[int, list[str]] = {}
        for node in map(json.loads, path.read_text().splitlines()):
            asked = by_rank.setdefault(node["rank"], [])
            if node["question_id"] not in asked:
                asked.append(node["question_id"])
        steps.append(by_rank)
    return steps


def _assert_in_sync(rows: list[dict]) -> None:
    for r in rows:
        assert 0 <= r["engine/old_logprob_gap"] < IN_SYNC, r
        assert 0 <= r["engine/logprob_gap_mean"] <= r["engine/logprob_gap_max"] < IN_SYNC, r
        assert 0 <= r["engine/kl_k3"] < IN_SYNC**2 and 1 <= r["engine/mult_prob_error"] < 1 + IN_SYNC, r


def test_two_ranks_each_sample_their_share_on_their_own_engine_and_resume_as_uninterrupted(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """Two ranks (plain data parallelism), one adapter per agent, each rank with its own engine: the same questions
    on the same ranks at every step as the hf engine under the same launch, every rank's engine in sync after every
    update (its adapters handed over and checked; the figures pooled over both ranks' tokens), validation on both
    engines; resumed from step 1, the run's step 2 is the uninterrupted one's (each rank draws from its own streams,
    seeded by the data position and the rank)."""
    from mhgpo.runtime.runlog import read_metrics

    hf, ours = tmp_path / "hf", tmp_path / "vllm"
    assert "finished 2 steps" in _launch(hf, vllm_model_dir, world, "precision=fp32", "lora.per_role=true")
    log = _launch(ours, vllm_model_dir, world, *ENGINE, "lora.per_role=true")
    assert log.count("finished 2 steps") == 1, log[-3000:]
    asked = _questions_by_rank(ours)
    assert asked == _questions_by_rank(hf) and len(asked) == 2
    assert all(sorted(by_rank) == [0, 1] and [len(q) for q in by_rank.values()] == [2, 2] for by_rank in asked)
    rows = read_metrics(ours)
    assert [r["step"] for r in rows] == [1, 2] and "val/f1" in rows[1] and all(r["samples"] > 0 for r in rows)
    _assert_in_sync(rows)

    log = _launch(ours, vllm_model_dir, world, "--from-step", "1", resume=True)
    assert "finished 2 steps" in log, log[-3000:]
    again = read_metrics(ours)
    assert [r["step"] for r in again] == [1, 2]
    # the engine's own log-probs round with its state (its prefix cache, warm in the uninterrupted run, is cold after
    # the resume): its gap to the trainer's agrees to float rounding (4.16e-7 against 4.23e-7 on a CPU with AVX2
    # only), and so do the roles' sampled-token entropies (means of the engine's log-probs); every other figure
    # exactly
    rounded = ["engine/old_logprob_gap", *(k for k in rows[0] if k.endswith("/entropy"))]
    assert len(rounded) > 1
    for key in rounded:
        assert [r[key] for r in again] == pytest.approx([r[key] for r in rows], abs=1e-6), key
    assert [{k: v for k, v in r.items() if k not in rounded} for r in comparable(again)] == [
        {k: v for k, v in r.items() if k not in rounded} for r in comparable(rows)
    ]


SKIP_ON_RANK_1 = """
import os

if os.environ.get("RANK") == "1":  # this rank's hand-over after the update of step SKIP_FROM on is skipped
    from mhgpo.rl import engine_sync

    handed = engine_sync.sync

    def skipping(engine, policy, scratch, version, weights=None):
        if version < int(os.environ["SKIP_FROM"]):
            handed(engine, policy, scratch, version, weights)

    engine_sync.sync = skipping
"""


def test_fsdp_ranks_hand_the_gathered_weights_to_their_engines_and_a_skipped_hand_over_on_one_stops_both(
    vllm_model_dir: Path, world: Path, tmp_path: Path
) -> None:
    """FSDP (the actor's layers sharded over 2 ranks), full fine-tuning: each rank's engine is handed all the
    weights, gathered from the shards, and is in sync at step 1 (a rank that loaded other initial weights than its
    engine would show at once); rank 1 skips its hand-over after the update of step 2: both ranks stop there, rank 0
    saying in one line which rank's engine holds what, and step 1's checkpoint is kept."""

    from mhgpo.model.checkpoint import list_checkpoints
    from mhgpo.runtime.runlog import read_metrics

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKIP_ON_RANK_1)
    out, env = tmp_path / "run", {"PYTHONPATH": f"{hook}:{REPO}", "SKIP_FROM": "2"}
    log = _launch(
        out, vllm_model_dir, world, *ENGINE, "lora.enabled=false", "eval_every=0", config="cpu_fsdp.yaml", env=env
    )
    assert log.startswith("exit ") and log.count("decoder layers sharded over 2 ranks") == 1, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("mhgpo: error:")]
    assert errors == [
        "mhgpo: error: generation.engine=vllm: after the update of step 2, on rank 1, the engine does not hold the "
        "trained weights (it holds the weights of update 1, the trainer those of update 2); the run stops; its last "
        "checkpoint is step_1"
    ], log[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1] and [c.name for c in list_checkpoints(out)] == ["step_1"]
    _assert_in_sync(rows)
