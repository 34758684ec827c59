"""Seconds per training step in one process against N ranks (`accelerate launch`, gloo on CPU), and the time the
ranks spend in the update's all-reduces.

Each setting trains a fresh run (no warm start, no validation, no checkpoints) and reads its `metrics.jsonl`: the
step's rollout seconds, update seconds and `seconds/train_communication` (rank 0's time in the update's
all-reduces of gradients and statistics), averaged over the steps after the first (the first pays for one-time
set-up). Settings: one process with 1 thread, one process with N threads, N ranks of 1 thread each (each holding the
whole model), N ranks of 1 thread each under FSDP (the actor's decoder layers sharded:
configs/accelerate/cpu_fsdp.yaml).

    python benchmarks/bench_distributed.py [--model smollm2-135m] [--ranks 2] [--steps 3] [--questions 2]
        [--group-size 2] [--settings one,threads,ranks,fsdp] [extra key=value overrides ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(label: str, command: list[str], out: Path, threads: int) -> dict[str, float | str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, text=True, capture_output=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{label}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:] or [{}]
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    return {
        "setting": label,
        "wall_s": wall,
        "rollout_s": mean("seconds/rollout"),
        "train_s": mean("seconds/train"),
        "step_s": mean("seconds/rollout") + mean("seconds/train"),
        "communication_s": mean("seconds/train_communication"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument(
        "--settings",
        default="one,threads,ranks",
        help="which of: one (1 process, 1 thread), threads (1 process, N threads), ranks (N ranks), "
        "fsdp (N ranks, FSDP)",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    train = [
        "-m",
        "mhgpo",
        "train",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--questions-per-step",
        str(args.questions),
        "--group-size",
        str(args.group_size),
        "warm_start.enabled=false",
        "eval_every=0",
        "save_every=0",
        *args.overrides,
    ]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.ranks), "--config_file"]
    ddp, fsdp = (str(REPO / "configs" / "accelerate" / name) for name in ("cpu_ddp.yaml", "cpu_fsdp.yaml"))
    settings = {
        "one": ("1 process, 1 thread", [sys.executable, *train], 1),
        "threads": (f"1 process, {args.ranks} threads", [sys.executable, *train], args.ranks),
        "ranks": (f"{args.ranks} ranks x 1 thread", [*launch, ddp, *train], 1),
        "fsdp": (f"{args.ranks} ranks x 1 thread, FSDP", [*launch, fsdp, *train], 1),
    }
    settings = [settings[name] for name in args.settings.split(",")]
    results = []
    for i, (label, command, threads) in enumerate(settings):
        out = tmp / f"run{i}"
        results.append(run(label, [*command, "--output-dir", str(out)], out, threads))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{'setting':<24}{'s/step':>9}{'rollout':>9}{'update':>9}{'all-reduce':>12}{'wall':>8}")
    for r in results:
        print(
            f"{r['setting']:<24}{r['step_s']:>9.2f}{r['rollout_s']:>9.2f}{r['train_s']:>9.2f}"
            f"{r['communication_s']:>12.3f}{r['wall_s']:>8.1f}"
        )


if __name__ == "__main__":
    main()
