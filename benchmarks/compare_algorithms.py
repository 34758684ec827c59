"""Validation F1 after training each algorithm for the same time budget, against the untrained team.

Each algorithm trains with the demo settings (`mhgpo/demo.yaml`) from the same initial model and the same question
order, in its own process, for `--minutes` of training (rollouts and updates): wall-clock minutes, or with
`--clock cpu` the process's CPU minutes (fairer when other jobs share the machine). A step is started only if the
mean step so far still fits in the budget. Then the team answers the demo's validation questions greedily. MAPPO
keeps the demo's critic settings (lr 1e-3, one warm-up step in which only the critic learns).

    python benchmarks/compare_algorithms.py [--algos untrained,fof,rr,mappo] [--minutes 8] [--clock wall|cpu]
        [--out DIR] [key=value ...]
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
    "untrained": [],
    "fof": ["algo=mhgpo", "sampler=fof"],
    "rr": ["algo=mhgpo", "sampler=rr"],
    "is": ["algo=mhgpo", "sampler=is"],
    "mappo": ["algo=mappo", "sampler=chains"],
}
LABELS = {"untrained": "untrained team", "fof": "MHGPO-FoF", "rr": "MHGPO-RR", "is": "MHGPO-IS", "mappo": "MAPPO"}


def one(name: str, minutes: float, overrides: list[str], out: Path | None, clock: str = "wall") -> dict:
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.evaluate import evaluate_examples
    from mhgpo.train_cli import demo_config_path
    from mhgpo.trainer import Trainer, build_team

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(TrainConfig, demo_config_path(),
                          ALGOS[name] + ["steps=100000", "eval_every=0", "save_every=0", f"output_dir={run_dir}"]
                          + overrides)
        team = build_team(cfg, with_val=True)
        trainer = Trainer(cfg, team, Path(run_dir), progress=False)
        rows: list[dict] = []
        now = time.process_time if clock == "cpu" else time.perf_counter  # cpu: this process's CPU seconds
        start, start_wall, start_cpu = now(), time.perf_counter(), time.process_time()
        while name != "untrained":
            elapsed = now() - start
            if rows and elapsed + elapsed / len(rows) > minutes * 60:
                break
            rows.append(trainer.train_step())
            print(f"{name} step {len(rows)}: reward {rows[-1]['reward/mean']:.3f} "
                  f"({time.perf_counter() - start_wall:.0f} s wall, {time.process_time() - start_cpu:.0f} s CPU)",
                  file=sys.stderr, flush=True)
        train_s, train_cpu_s = time.perf_counter() - start_wall, time.process_time() - start_cpu
        res = evaluate_examples(team.val, team.val_workflow, team.generator, team.encode, cfg.eval_batch_size,
                                progress=False)
    result = {"algo": name, "steps": len(rows), "train_minutes": train_s / 60 if rows else 0.0,
              "train_cpu_minutes": train_cpu_s / 60 if rows else 0.0,
              "val_f1": res.metrics["f1"], "val_em": res.metrics["em"], "val_acc": res.metrics["acc"],
              "val_n": res.metrics["n"], "eval_seconds": res.metrics["seconds"],
              "train_reward_first": rows[0]["reward/mean"] if rows else None,
              "train_reward_last": rows[-1]["reward/mean"] if rows else None}
    result.update({k: v for k, v in res.metrics.items() if "/" in k})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({**result, "steps_metrics": rows}, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="untrained,fof,rr,mappo")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="budget in wall-clock minutes, or in CPU minutes of the process (a shared machine)")
    parser.add_argument("--out", help="write one JSON file per algorithm (with its per-step metrics) here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    if args.one:
        print(json.dumps(one(args.one, args.minutes, args.overrides, out, args.clock)))
        return
    results = []
    for name in args.algos.split(","):
        if name not in ALGOS:
            parser.error(f"unknown algorithm {name!r} (choose from {', '.join(ALGOS)})")
        cmd = [sys.executable, __file__, "--one", name, "--minutes", str(args.minutes), "--clock", args.clock,
               *args.overrides]
        if out is not None:
            cmd[2:2] = ["--out", str(out)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{LABELS[name]}: {r['steps']} steps in {r['train_minutes']:.1f} min, val F1 {r['val_f1']:.1f}",
              flush=True)
    print(f"\nvalidation after {args.minutes:g} {args.clock} min of training each (demo settings, "
          f"{results[0]['val_n']} questions)")
    print(f"{'':15} {'steps':>6} {'wall min':>9} {'CPU min':>8} {'val F1':>7} {'val EM':>7} {'val Acc':>8}")
    for r in results:
        print(f"{LABELS[r['algo']]:15} {r['steps']:6d} {r['train_minutes']:9.1f} {r['train_cpu_minutes']:8.1f} "
              f"{r['val_f1']:7.1f} {r['val_em']:7.1f} {r['val_acc']:8.1f}")


if __name__ == "__main__":
    main()
