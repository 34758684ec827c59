"""The vLLM sync check's figures on the default model, after healthy hand-overs and after a skipped one.

Runs ``--steps`` steps of the RL stage of `mhgpo demo` (its config without the warm start) with
``generation.engine=vllm``, printing after each update the sync check's figures (the per-token log-prob gap's mean
and largest value, the k3 KL estimate, the mean of exp(gap)); then one more step whose hand-over is skipped on
purpose, printing what the check measures of the stale engine (the same figures, and what the engine holds) and the
error that stops the run. Needs ``bash scripts/setup.sh --vllm``.

    python benchmarks/bench_sync_check.py [--steps 2] [precision=bf16-mixed optim.lr=1e-5 ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from mhgpo.rl import engine_sync

FIGURES = ("engine/logprob_gap_mean", "engine/logprob_gap_max", "engine/kl_k3", "engine/mult_prob_error")


def _row(label: str, figures: dict[str, float]) -> str:
    return f"{label:<28}" + "  ".join(f"{k.split('/')[1]} {figures[k]:.3g}" for k in FIGURES)


def main() -> None:
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.rl.trainer import Trainer, build_team

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="healthy steps before the skipped hand-over")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = parser.parse_args()
    out = tempfile.mkdtemp(prefix="bench-sync-check-")
    cfg = load_config(
        TrainConfig,
        demo_config_path(),
        ["warm_start.enabled=false", "eval_every=0", f"output_dir={out}", "generation.engine=vllm", *args.overrides],
    )
    trainer = Trainer(cfg, build_team(cfg), out, progress=False)
    engine, policy = trainer.setup.generator, trainer.setup.policy
    print(f"precision {cfg.precision}, optim.lr {cfg.optim.lr:g}, tolerance {engine_sync.tolerance(cfg):g}")
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        metrics = trainer.train_step()
        took = f"the step {time.perf_counter() - t:.0f} s, the check {metrics['seconds/engine_check']:.1f} s"
        print(_row(f"step {step}, synced", metrics) + f"  ({took})", flush=True)
    batch, samples, metrics = trainer.collect()
    handed = engine_sync.sync
    engine_sync.sync = lambda *args: None  # the next hand-over is skipped
    try:
        trainer.learn(samples, metrics)
        print("the skipped hand-over went unseen")
    except engine_sync.EngineOutOfSync as stop:
        step, t = args.steps + 1, time.perf_counter()
        check = engine_sync.check_sync(engine, policy, samples, cfg.generation.sync_check, step)
        print(
            _row(f"step {step}, hand-over skipped", check.figures) + f"  (the check: {time.perf_counter() - t:.1f} s)"
        )
        print(f"what the engine holds: {check.stale}")
        print(f"the run stops: {stop}")
    finally:
        engine_sync.sync = handed
        engine.close()


if __name__ == "__main__":
    main()
