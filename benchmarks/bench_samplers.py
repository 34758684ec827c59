"""Seconds per training step (rollout vs update) and peak memory for each MHGPO sampler.

Runs `--steps` training steps per sampler with the demo settings (`mhgpo/demo.yaml`) on the same questions,
each sampler in its own process so that peak memory is its own, and prints a table.

    python benchmarks/bench_samplers.py [--samplers rr,fof,is,fof_os] [--steps 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one(sampler: str, steps: int, overrides: list[str]) -> dict:
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.policy import peak_memory_mb
    from mhgpo.train_cli import demo_config_path
    from mhgpo.trainer import Trainer, build_team

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            [f"sampler={sampler}", f"steps={steps}", "eval_every=0", "save_every=0", f"output_dir={run_dir}"]
            + overrides,
        )
        t = time.perf_counter()
        team = build_team(cfg)
        load_s = time.perf_counter() - t
        trainer = Trainer(cfg, team, Path(run_dir), progress=False)
        rows = [trainer.train_step() for _ in range(steps)]
    keys = ("seconds/rollout", "seconds/train", "samples", "llm_calls", "tokens_generated")
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    out.update(sampler=sampler, load_s=load_s, peak_mb=peak_memory_mb())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samplers", default="rr,fof,is,fof_os")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.overrides)))
        return
    results = []
    for sampler in args.samplers.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--one", sampler, "--steps", str(args.steps), *args.overrides],
            capture_output=True, text=True, check=True,
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{sampler}: {r['seconds/rollout']:.1f} s rollout + {r['seconds/train']:.1f} s update per step", flush=True)
    print(f"\nper step, mean of {args.steps} steps (demo settings, {len(results)} samplers)")
    header = f"{'sampler':8} {'rollout s':>10} {'update s':>9} {'total s':>8} {'LLM calls':>10} {'samples':>8} " \
             f"{'new tokens':>11} {'peak MB':>8}"
    print(header)
    for r in results:
        total = r["seconds/rollout"] + r["seconds/train"]
        print(f"{r['sampler']:8} {r['seconds/rollout']:10.1f} {r['seconds/train']:9.1f} {total:8.1f} "
              f"{r['llm_calls']:10.1f} {r['samples']:8.1f} {r['tokens_generated']:11.0f} {r['peak_mb']:8.0f}")


if __name__ == "__main__":
    main()
