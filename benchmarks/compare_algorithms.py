"""Validation Acc / EM / F1 of training recipes at equal training time, over seeds (mean ± std).

A row is `untrained`, `warm` (the warm start alone), or an algorithm (`rr`, `fof`, `is`, `fof_os`: MHGPO with that
sampler; `mappo`) with options joined by `+`: `warm+rr` starts from the warm start, `rr+per_role` trains one adapter
per agent (`lora.per_role`), `rr+filter` drops zero-variance groups and draws more questions
(`filter_zero_variance`). Every row takes the demo's settings (`mhgpo/config/demo.yaml`, its `warm_start` section for the
warm start) and `key=value` overrides; for each seed the warm start is trained once (its own time is reported, not
counted in the rows' budget) and shared by the rows that start from it. An RL row trains for `--minutes` of its
process's CPU time (`--clock cpu`, the default: fair when runs share the machine; one thread each) or wall time, a
step being started only if the mean step so far still fits; then the team answers `--val-limit` validation
questions greedily. `--parallel N` runs N processes at a time, one thread each.

    python benchmarks/compare_algorithms.py --rows untrained,warm,warm+rr,warm+mappo --seeds 0,1,2 --minutes 10 \\
        [--val-limit 100] [--parallel 2] [--clock cpu|wall] [--out DIR] [key=value ...]
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

import numpy as np

ALGOS = {"rr": ["algo=mhgpo", "sampler=rr"], "fof": ["algo=mhgpo", "sampler=fof"], "is": ["algo=mhgpo", "sampler=is"],
         "fof_os": ["algo=mhgpo", "sampler=fof_os"], "mappo": ["algo=mappo", "sampler=chains"]}
OPTIONS = {"per_role": ["lora.per_role=true"], "filter": ["filter_zero_variance=true"]}
LABELS = {"rr": "MHGPO-RR", "fof": "MHGPO-FoF", "is": "MHGPO-IS", "fof_os": "MHGPO-FoF(os)", "mappo": "MAPPO"}


def row_overrides(row: str) -> list[str]:
    """A row's own `key=value` settings: `warm+rr@optim.lr=3e-5,group_size=8`."""
    return [kv for kv in row.partition("@")[2].split(",") if kv]


def parse_row(row: str) -> tuple[bool, str | None, list[str]]:
    """(starts from the warm start, algorithm or None, option names) of a row name."""
    parts = row.partition("@")[0].split("+")
    warm = "warm" in parts
    algos = [p for p in parts if p in ALGOS]
    options = [p for p in parts if p in OPTIONS]
    unknown = [p for p in parts if p not in ALGOS and p not in OPTIONS and p not in ("warm", "untrained")]
    if unknown or len(algos) > 1 or (options and not algos) or (row == "untrained") != ("untrained" in parts):
        raise ValueError(f"bad row {row!r}: untrained, warm, or [warm+]ALGO[+OPTION...] with ALGO in "
                         f"{', '.join(ALGOS)} and OPTION in {', '.join(OPTIONS)}")
    return warm, (algos[0] if algos else None), options


def label(row: str) -> str:
    warm, algo, options = parse_row(row)
    if algo is None:
        return "warm start only" if warm else "untrained team"
    extra = f" [{', '.join(row_overrides(row))}]" if row_overrides(row) else ""
    return ("warm start + " if warm else "") + LABELS[algo] + "".join(f" ({o.replace('_', '-')})" for o in options) + extra


def demo_tree(overrides: list[str]) -> dict:
    from mhgpo.config import TrainConfig, load_config, to_dict
    from mhgpo.config import demo_config_path

    return to_dict(load_config(TrainConfig, demo_config_path(), overrides))


def warm_start_dir(out: Path, seed: int) -> Path:
    return out / f"warm_start-seed{seed}"


def run_warm_start(out: Path, seed: int, overrides: list[str]) -> dict:
    """Train (once) the warm start of `seed` into OUT/warm_start-seedS; its minutes."""
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.run.pipeline import warm_start_config
    from mhgpo.run.warm_start import run_sft
    from mhgpo.config import demo_config_path

    folder = warm_start_dir(out, seed)
    done = folder / "done.json"
    if done.is_file():
        return json.loads(done.read_text())
    cfg = load_config(TrainConfig, demo_config_path(), overrides + [f"seed={seed}", f"output_dir={out / 'x'}"])
    t0, c0 = time.perf_counter(), time.process_time()
    run_sft(warm_start_config(cfg, folder), progress=False)
    result = {"seed": seed, "minutes": (time.perf_counter() - t0) / 60, "cpu_minutes": (time.process_time() - c0) / 60}
    done.write_text(json.dumps(result))
    return result


def one(row: str, seed: int, minutes: float, clock: str, val_limit: int, out: Path, overrides: list[str]) -> dict:
    """Train one row for the budget and validate it; the result (also written to OUT/ROW-seedS.json)."""
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.run.pipeline import evaluate_model
    from mhgpo.config import demo_config_path
    from mhgpo.rl.trainer import Trainer, build_team

    warm, algo, options = parse_row(row)
    model = [f"model={warm_start_dir(out, seed).resolve()}"] if warm else []
    with tempfile.TemporaryDirectory() as run_dir:
        extra = (ALGOS.get(algo, []) + [x for o in options for x in OPTIONS[o]] + overrides + row_overrides(row) + model
                 + [f"seed={seed}", "steps=100000", "eval_every=0", "save_every=0", f"val_limit={val_limit}",
                    "warm_start.enabled=false", f"output_dir={run_dir}"])
        cfg = load_config(TrainConfig, demo_config_path(), extra)
        rows: list[dict] = []
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        train_wall = train_cpu = 0.0
        if algo is None:
            res = evaluate_model(cfg, Path(run_dir), desc=row)
        else:
            team = build_team(cfg, with_val=True)
            trainer = Trainer(cfg, team, Path(run_dir), progress=False)
            now = time.process_time if clock == "cpu" else time.perf_counter
            start = now()
            while True:
                elapsed = now() - start
                if rows and elapsed + elapsed / len(rows) > minutes * 60:
                    break
                rows.append(trainer.train_step())
                print(f"{row} seed {seed} step {len(rows)}: reward {rows[-1].get('reward/mean', 0):.3f} "
                      f"({(time.perf_counter() - start_wall) / 60:.1f} min wall, "
                      f"{(time.process_time() - start_cpu) / 60:.1f} min CPU)", file=sys.stderr, flush=True)
            train_wall, train_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
            res = trainer.validate()
    result = {"row": row, "seed": seed, "steps": len(rows),
              "train_minutes": train_wall / 60, "train_cpu_minutes": train_cpu / 60,
              "val_f1": res.metrics["f1"], "val_em": res.metrics["em"], "val_acc": res.metrics["acc"],
              "val_n": res.metrics["n"],
              **{k: v for k, v in res.metrics.items() if "/" in k}}
    name = row.replace("/", "_").replace("@", "__").replace(",", "_")
    (out / f"{name}-seed{seed}.json").write_text(json.dumps({**result, "steps_metrics": rows}, indent=1))
    return result


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=log.open("a"),
                            text=True, env=env)


def run_all(jobs: list[list[str]], parallel: int, log: Path) -> list[dict]:
    """Run the `--one`/`--warm` jobs, `parallel` at a time; their JSON results in job order."""
    results: list[dict | None] = [None] * len(jobs)
    running: list[tuple[int, subprocess.Popen]] = []
    pending = list(range(len(jobs)))
    while pending or running:
        while pending and len(running) < parallel:
            i = pending.pop(0)
            running.append((i, _spawn(jobs[i], log)))
        time.sleep(2)
        for i, proc in list(running):
            if proc.poll() is not None:
                running.remove((i, proc))
                out = proc.stdout.read()
                if proc.returncode != 0:
                    raise SystemExit(f"job {' '.join(jobs[i])} failed (exit {proc.returncode}); see {log}")
                results[i] = json.loads(out.strip().splitlines()[-1])
                brief = {k: v for k, v in results[i].items() if k in ("val_f1", "steps", "minutes")}
                print(f"done: {' '.join(jobs[i][:4])} -> {json.dumps(brief)}", flush=True)
    return results  # type: ignore[return-value]


def summary(results: list[dict], minutes: float, clock: str) -> str:
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    lines = [f"validation after {minutes:g} {clock} min of training each (demo settings, "
             f"{results[0]['val_n']} questions; mean ± std over seeds)", "",
             "| run | seeds | steps | val F1 | val EM | val Acc | answers starting 'Document' | Rewriter penalty rate |",
             "|---|---|---|---|---|---|---|---|"]
    for row, rs in by_row.items():
        def ms(key: str, scale: float = 1.0) -> str:
            v = np.array([r.get(key, float("nan")) for r in rs]) * scale
            return f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if len(v) > 1 else f"{v.mean():.1f}"
        lines.append(f"| {label(row)} | {len(rs)} | {np.mean([r['steps'] for r in rs]):.1f} | {ms('val_f1')} | "
                     f"{ms('val_em')} | {ms('val_acc')} | {ms('answerer/starts_with_document', 100)}% | "
                     f"{ms('rewriter/penalty_rate', 100)}% |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["untrained,warm,warm+rr,warm+mappo"],
                        help="rows, comma- or space-separated; a row's own settings after @: warm+rr@optim.lr=3e-5")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--val-limit", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.warm or args.one:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        result = run_warm_start(out, args.seed, args.overrides) if args.warm else \
            one(args.one, args.seed, args.minutes, args.clock, args.val_limit, out, args.overrides)
        print(json.dumps(result))
        return
    rows = [r for item in args.rows for r in ([item] if "@" in item else item.split(","))]
    for row in rows:
        try:
            parse_row(row)
        except ValueError as e:
            parser.error(str(e))
    seeds = [int(s) for s in args.seeds.split(",")]
    log = out / "log.txt"
    common = ["--out", str(out), "--minutes", str(args.minutes), "--clock", args.clock, "--val-limit",
              str(args.val_limit)]
    if any(parse_row(r)[0] for r in rows):
        warm = run_all([["--warm", "--seed", str(s), *common, *args.overrides] for s in seeds], args.parallel, log)
        print("warm start: " + ", ".join(f"seed {w['seed']} {w['minutes']:.1f} min" for w in warm), flush=True)
    jobs = [["--one", row, "--seed", str(s), *common, *args.overrides] for row in rows for s in seeds]
    results = run_all(jobs, args.parallel, log)
    table = summary(results, args.minutes, args.clock)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
