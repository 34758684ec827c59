"""Seconds per training step and peak memory of MHGPO-FoF, MHGPO-RR, MHGPO-IS and MAPPO, and their ratios to MAPPO
(and of MHGPO-FoF(os) with `--algos fof_os`; of MAPPO whose critic has a frozen base of its own, the paper's two
models, with `--algos mappo_own`).

Every algorithm runs `--steps` steps with the demo settings (`mhgpo/config/demo.yaml`: the default model, LoRA, 4 questions
per step, G = 4, short generations) on the same questions, each in its own process so that its peak memory is its
own (CPU: peak RSS of the process, model loading included; CUDA: peak allocated). MAPPO's critic warm-up is set to
0 so that every timed step updates both the critic and the actor. Per step: wall seconds (rollout, update) and the
process's CPU seconds, which other jobs on a shared machine do not inflate. Paper Figure 4 compares the same things.

    python benchmarks/bench_algorithms.py [--algos fof,rr,is,mappo] [--steps 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALGOS = {  # name -> overrides
    "fof": ["algo=mhgpo", "sampler=fof"],
    "rr": ["algo=mhgpo", "sampler=rr"],
    "is": ["algo=mhgpo", "sampler=is"],
    "fof_os": ["algo=mhgpo", "sampler=fof_os"],
    "mappo": ["algo=mappo", "sampler=chains", "critic.warmup_steps=0"],
    "mappo_own": ["algo=mappo", "sampler=chains", "critic.warmup_steps=0", "critic.own_base=true"],
}
LABELS = {
    "fof": "MHGPO-FoF",
    "rr": "MHGPO-RR",
    "is": "MHGPO-IS",
    "fof_os": "MHGPO-FoF(os)",
    "mappo": "MAPPO",
    "mappo_own": "MAPPO (critic's own base)",
}


def one(name: str, steps: int, overrides: list[str]) -> dict:
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.rl.policy import peak_memory_mb
    from mhgpo.rl.trainer import Trainer
    from mhgpo.run.setup import build_training, settle

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            ALGOS[name] + [f"steps={steps}", "eval_every=0", "save_every=0", f"output_dir={run_dir}"] + overrides,
        )
        t = time.perf_counter()
        job = settle(cfg)
        team = build_training(job)
        load_s = time.perf_counter() - t
        trainer = Trainer(job.cfg, team, Path(run_dir), progress=False)
        rows = []
        for _ in range(steps):
            cpu = time.process_time()
            rows.append(trainer.train_step())
            rows[-1]["cpu_s"] = time.process_time() - cpu  # this process's CPU seconds (all its threads)
    keys = ("seconds/rollout", "seconds/train", "cpu_s", "samples", "llm_calls", "tokens_generated")
    out = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    out.update(algo=name, load_s=load_s, peak_mb=peak_memory_mb())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="fof,rr,is,mappo")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.steps, args.overrides)))
        return
    results = []
    for name in args.algos.split(","):
        if name not in ALGOS:
            parser.error(f"unknown algorithm {name!r} (choose from {', '.join(ALGOS)})")
        proc = subprocess.run(
            [sys.executable, __file__, "--one", name, "--steps", str(args.steps), *args.overrides],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"{LABELS[name]}: {r['seconds/rollout']:.1f} s rollout + {r['seconds/train']:.1f} s update per step, "
            f"peak {r['peak_mb']:.0f} MB",
            flush=True,
        )
    base = next((r for r in results if r["algo"] == "mappo"), None)
    extra = f", {' '.join(args.overrides)}" if args.overrides else ""
    print(f"\nper step, mean of {args.steps} steps (demo settings{extra})")
    print(
        f"{'algorithm':25} {'rollout s':>10} {'update s':>9} {'step s':>7} {'CPU s':>7} {'LLM calls':>10} "
        f"{'samples':>8} {'peak MB':>8}   ratios to MAPPO: step s, CPU s, peak MB"
    )
    for r in results:
        step = r["seconds/rollout"] + r["seconds/train"]
        ratios = ""
        if base is not None:
            base_step = base["seconds/rollout"] + base["seconds/train"]
            ratios = f"{step / base_step:6.2f} {r['cpu_s'] / base['cpu_s']:6.2f} {r['peak_mb'] / base['peak_mb']:6.2f}"
        print(
            f"{LABELS[r['algo']]:25} {r['seconds/rollout']:10.1f} {r['seconds/train']:9.1f} {step:7.1f} "
            f"{r['cpu_s']:7.1f} {r['llm_calls']:10.1f} {r['samples']:8.1f} {r['peak_mb']:8.0f}   {ratios}"
        )


if __name__ == "__main__":
    main()
