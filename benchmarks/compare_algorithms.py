"""Validation Acc / EM / F1 of training recipes at equal training time, over seeds (mean ± std).

A row is `untrained`, `warm` (the warm start alone), or an algorithm (`rr`, `fof`, `is`, `fof_os`: MHGPO with that
sampler; `mappo`; `grpo`: the single-agent baseline, `system=llm`, whose warm start is the single agent's own) with
options joined by `+`: `warm+rr` starts from the warm start, `rr+per_role` trains one adapter per agent
(`lora.per_role`), `rr+filter` drops zero-variance groups and draws more questions (`filter_zero_variance`). Every
row takes the demo's settings (`mhgpo/config/demo.yaml`, its `warm_start` section for the warm start) and
`key=value` overrides; for each seed the warm start is trained once (its own time is reported, not counted in the
rows' budget) and shared by the rows that start from it. An RL row trains for `--minutes` of its process's CPU time
(`--clock cpu`, the default: fair when runs share the machine; one thread each) or wall time, a step being started
only if the mean step so far still fits (a row's own `budget=M` gives it M minutes instead: `warm+rr@budget=30`);
then the team answers `--val-limit` validation questions greedily.
`--parallel N` runs N processes at a time, one thread each.

Each (row, seed) is written atomically to OUT/ROW-seedS.json with the settings it ran under (budget, clock,
validation size, overrides); a rerun into the same OUT skips the finished ones and reruns a missing or unreadable
(half-written) one; an OUT keeps the settings of its first run (OUT/settings.json) and refuses others.
`benchmarks/reproduce.py` runs the paper's tables with these functions.

    python benchmarks/compare_algorithms.py --rows untrained,warm,warm+rr,warm+mappo --seeds 0,1,2 --minutes 10 \\
        [--val-limit 100] [--parallel 2] [--clock cpu|wall] [--out DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mhgpo.io import atomic_write_json

ALGOS = {
    "rr": ["algo=mhgpo", "sampler=rr"],
    "fof": ["algo=mhgpo", "sampler=fof"],
    "is": ["algo=mhgpo", "sampler=is"],
    "fof_os": ["algo=mhgpo", "sampler=fof_os"],
    "mappo": ["algo=mappo", "sampler=chains"],
    "grpo": ["algo=grpo", "system=llm", "sampler=fof"],
}
OPTIONS = {"per_role": ["lora.per_role=true"], "filter": ["filter_zero_variance=true"]}
LABELS = {
    "rr": "MHGPO-RR",
    "fof": "MHGPO-FoF",
    "is": "MHGPO-IS",
    "fof_os": "MHGPO-FoF(os)",
    "mappo": "MAPPO",
    "grpo": "single-agent GRPO",
}
# What a finished result must hold; a file without them (or not JSON) was cut short and is run again.
RESULT_KEYS = ("row", "seed", "steps", "val_f1", "val_acc", "settings")


BUDGET = "budget"  # a row's own training minutes (`warm+rr@budget=30`), not a config key


def _own_items(row: str) -> list[str]:
    return [kv for kv in row.partition("@")[2].split(",") if kv]


def row_overrides(row: str) -> list[str]:
    """A row's own `key=value` settings: `warm+rr@optim.lr=3e-5,group_size=8` (its `budget=M` left out)."""
    return [kv for kv in _own_items(row) if kv.partition("=")[0] != BUDGET]


def row_budget(row: str) -> float | None:
    """A row's own training minutes (`budget=M`, minutes of the comparison's clock), or None."""
    own = [v for k, _, v in (kv.partition("=") for kv in _own_items(row)) if k == BUDGET]
    if not own:
        return None
    try:
        value = float(own[-1])
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"bad row {row!r}: {BUDGET}={own[-1]} is not a positive number of minutes")
    return value


def row_minutes(row: str, minutes: float) -> float:
    """A row's training budget: its own `budget=M`, else the comparison's `minutes`."""
    budget = row_budget(row)
    return minutes if budget is None else budget


def parse_row(row: str) -> tuple[bool, str | None, list[str]]:
    """(starts from the warm start, algorithm or None, option names) of a row name."""
    parts = row.partition("@")[0].split("+")
    warm = "warm" in parts
    algos = [p for p in parts if p in ALGOS]
    options = [p for p in parts if p in OPTIONS]
    unknown = [p for p in parts if p not in ALGOS and p not in OPTIONS and p not in ("warm", "untrained")]
    if unknown or len(algos) > 1 or (options and not algos) or (row == "untrained") != ("untrained" in parts):
        raise ValueError(
            f"bad row {row!r}: untrained, warm, or [warm+]ALGO[+OPTION...] with ALGO in "
            f"{', '.join(ALGOS)} and OPTION in {', '.join(OPTIONS)}"
        )
    if row_budget(row) is not None and not algos:
        raise ValueError(f"bad row {row!r}: {BUDGET}= is the training minutes of an RL row; this row trains nothing")
    return warm, (algos[0] if algos else None), options


def label(row: str) -> str:
    warm, algo, options = parse_row(row)
    budget = row_budget(row)
    own = ([f"{budget:g} min"] if budget is not None else []) + row_overrides(row)
    extra = f" [{', '.join(own)}]" if own else ""
    if algo is None:
        return ("warm start only" if warm else "untrained team") + extra
    return (
        ("warm start + " if warm else "") + LABELS[algo] + "".join(f" ({o.replace('_', '-')})" for o in options) + extra
    )


def demo_tree(overrides: list[str]) -> dict:
    from mhgpo.config import TrainConfig, demo_config_path, load_config, to_dict

    return to_dict(load_config(TrainConfig, demo_config_path(), overrides))


def row_system(row: str) -> str:
    """The team a row trains: the last `system=` of its algorithm's and its own settings (default mas)."""
    _, algo, _ = parse_row(row)
    systems = [kv.partition("=")[2] for kv in ALGOS.get(algo, []) + row_overrides(row) if kv.startswith("system=")]
    return systems[-1] if systems else "mas"


def warm_start_dir(out: Path, seed: int, system: str = "mas") -> Path:
    """OUT/warm_start-seedS (the team's) or OUT/warm_start-SYSTEM-seedS (another system's own warm start)."""
    tag = "" if system == "mas" else "".join(c if c.isalnum() else "_" for c in system) + "-"
    return out / f"warm_start-{tag}seed{seed}"


def result_path(out: Path, row: str, seed: int) -> Path:
    name = row.replace("/", "_").replace("@", "__").replace(",", "_")
    return out / f"{name}-seed{seed}.json"


def load_result(path: Path, settings: dict) -> dict | None:
    """The finished result in `path`, or None when it is missing or unreadable (cut short: to be run again). One
    that ran under other settings stops the run (its numbers would be mixed with these)."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(result, dict) or any(k not in result for k in RESULT_KEYS):
        return None
    if result["settings"] != settings:
        raise SystemExit(
            f"{path}: ran with {json.dumps(result['settings'])}, not {json.dumps(settings)}; "
            f"use another --out (or remove it)"
        )
    return result


def run_warm_start(out: Path, seed: int, overrides: list[str], system: str = "mas") -> dict:
    """Train (once) the warm start of `seed` and `system` into its `warm_start_dir`; its minutes. A folder without
    its `done.json` was interrupted: it is removed and trained again. Another comparison training the same warm
    start (into the same OUT) holds `FOLDER.lock`: this one waits for it, then uses its warm start."""
    folder = warm_start_dir(out, seed, system)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process ends
        return _warm_start(folder, seed, overrides, system)


def _warm_start(folder: Path, seed: int, overrides: list[str], system: str) -> dict:
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.run.pipeline import warm_start_config
    from mhgpo.run.warm_start import run_sft

    out = folder.parent
    done = load_result(folder / "done.json", {"overrides": overrides}) if folder.is_dir() else None
    if done is not None:
        return done
    if folder.exists():
        shutil.rmtree(folder)
    cfg = load_config(
        TrainConfig, demo_config_path(), overrides + [f"system={system}", f"seed={seed}", f"output_dir={out / 'x'}"]
    )
    t0, c0 = time.perf_counter(), time.process_time()
    run_sft(warm_start_config(cfg, folder), progress=False)
    result = {
        "row": "warm_start",
        "seed": seed,
        "system": system,
        "steps": cfg.warm_start.steps,
        "minutes": (time.perf_counter() - t0) / 60,
        "cpu_minutes": (time.process_time() - c0) / 60,
        "val_f1": None,
        "val_acc": None,
        "settings": {"overrides": overrides},
    }
    atomic_write_json(folder / "done.json", result)
    return result


def row_settings(row: str, seed: int, val_limit: int, out: Path, overrides: list[str], run_dir: str) -> list[str]:
    """The `key=value` list that makes the demo config into `row`'s run for `seed` (in this order: algorithm,
    options, common overrides, the row's own, its warm start as the model, the comparison's fixed keys)."""
    warm, algo, options = parse_row(row)
    model = [f"model={warm_start_dir(out, seed, row_system(row)).resolve()}"] if warm else []
    return (
        ALGOS.get(algo, [])
        + [x for o in options for x in OPTIONS[o]]
        + overrides
        + row_overrides(row)
        + model
        + [
            f"seed={seed}",
            "steps=100000",
            "eval_every=0",
            "save_every=0",
            f"val_limit={val_limit}",
            "warm_start.enabled=false",
            f"output_dir={run_dir}",
        ]
    )


def machine() -> dict:
    """The CPU model and core count (and the GPU, if any) a result was measured on."""
    import torch

    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "unknown",
        )
        if Path("/proc/cpuinfo").is_file()
        else "unknown"
    )
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "cores": os.cpu_count(), "gpu": gpu}


def one(row: str, seed: int, minutes: float, clock: str, val_limit: int, out: Path, overrides: list[str]) -> dict:
    """Train one row for the budget and validate it; the result (also written to OUT/ROW-seedS.json, with each
    step's metrics and its process's peak memory so far)."""
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.model.trained import run_model_spec
    from mhgpo.rl.policy import peak_memory_mb
    from mhgpo.run.evaluate import evaluate_validation
    from mhgpo.run.setup import build_trainer, settle

    _, algo, _ = parse_row(row)
    budget = row_minutes(row, minutes)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(TrainConfig, demo_config_path(), row_settings(row, seed, val_limit, out, overrides, run_dir))
        rows: list[dict] = []
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        train_wall = train_cpu = 0.0
        if algo is None:
            res = evaluate_validation(cfg, run_model_spec(cfg.model, Path(run_dir)), desc=row)
        else:
            trainer = build_trainer(settle(cfg), progress=False, with_val=True)
            now = time.process_time if clock == "cpu" else time.perf_counter
            start = now()
            while True:
                elapsed = now() - start
                if rows and elapsed + elapsed / len(rows) > budget * 60:
                    break
                rows.append({**trainer.train_step(), "memory/peak_mb": peak_memory_mb()})
                print(
                    f"{row} seed {seed} step {len(rows)}: reward {rows[-1].get('reward/mean', 0):.3f} "
                    f"({(time.perf_counter() - start_wall) / 60:.1f} min wall, "
                    f"{(time.process_time() - start_cpu) / 60:.1f} min CPU)",
                    file=sys.stderr,
                    flush=True,
                )
            train_wall, train_cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
            res = trainer.validate()
    result = {
        "row": row,
        "seed": seed,
        "system": cfg.system,
        "steps": len(rows),
        "budget_minutes": budget,
        "questions_per_step": cfg.questions_per_step,
        "train_minutes": train_wall / 60,
        "train_cpu_minutes": train_cpu / 60,
        "val_f1": res.metrics["f1"],
        "val_em": res.metrics["em"],
        "val_acc": res.metrics["acc"],
        "val_n": res.metrics["n"],
        "peak_mb": peak_memory_mb(),
        "machine": machine(),
        "settings": settings_of(minutes, clock, val_limit, overrides),
        **{k: v for k, v in res.metrics.items() if "/" in k},
    }
    per_question = [{"id": p["id"], "f1": p["f1"], "acc": p["acc"]} for p in res.predictions]  # for paired tests
    atomic_write_json(result_path(out, row, seed), {**result, "steps_metrics": rows, "val_questions": per_question})
    return result


def settings_of(minutes: float, clock: str, val_limit: int, overrides: list[str]) -> dict:
    """What a result depends on beyond its row and seed (a rerun may reuse it only under the same)."""
    return {"minutes": minutes, "clock": clock, "val_limit": val_limit, "overrides": list(overrides)}


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=env
    )


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


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof 1; None for one value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def fmt(values: list[float], digits: int = 1) -> str:
    """`mean ± std` (sample std) of `values`; the mean alone for one value; — for none."""
    if not values:
        return "—"
    m, s = mean_std(values)
    return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def summary(results: list[dict], minutes: float, clock: str) -> str:
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    lines = [
        f"validation after {minutes:g} {clock} min of training each, or a row's own budget (demo settings, "
        f"{results[0]['val_n']} questions; mean ± std over seeds)",
        "",
        f"| run | {clock} min | seeds | steps | val F1 | val EM | val Acc | answers starting 'Document' | "
        "Rewriter penalty rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, rs in by_row.items():

        def ms(key: str, scale: float = 1.0, rs=rs) -> str:
            return fmt([r.get(key, float("nan")) * scale for r in rs])

        trained = f"{row_minutes(row, minutes):g}" if parse_row(row)[1] else "—"
        lines.append(
            f"| {label(row)} | {trained} | {len(rs)} | {np.mean([r['steps'] for r in rs]):.1f} | "
            f"{ms('val_f1')} | "
            f"{ms('val_em')} | {ms('val_acc')} | {ms('answerer/starts_with_document', 100)}% | "
            f"{ms('rewriter/penalty_rate', 100)}% |"
        )
    return "\n".join(lines)


def plan(
    rows: list[str], seeds: list[int], out: Path, settings: dict
) -> tuple[list[tuple[int, str]], list[tuple[str, int]]]:
    """What is still to run: the warm starts (seed, system) that unfinished rows start from, and the (row, seed)
    results without a finished file."""
    todo = [(r, s) for r in rows for s in seeds if load_result(result_path(out, r, s), settings) is None]
    needed = sorted({(s, row_system(r)) for r, s in todo if parse_row(r)[0]})
    warm = [
        (s, system)
        for s, system in needed
        if load_result(warm_start_dir(out, s, system) / "done.json", {"overrides": settings["overrides"]}) is None
    ]
    return warm, todo


def run_rows(
    rows: list[str],
    seeds: list[int],
    out: Path,
    settings: dict,
    parallel: int,
    runner: Callable[[list[list[str]], int, Path], list[dict]] | None = None,
) -> list[dict]:
    """Every (row, seed) result under `settings` (see `settings_of`), row by row: the finished ones read from OUT,
    the others run (their warm starts first), `parallel` processes at a time, by `runner` (default `run_all`)."""
    runner = runner or run_all
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    common = [
        "--out",
        str(out),
        "--minutes",
        str(settings["minutes"]),
        "--clock",
        settings["clock"],
        "--val-limit",
        str(settings["val_limit"]),
    ]
    pinned = out / "settings.json"  # one OUT, one budget: every result in it comparable with the others
    if pinned.is_file() and json.loads(pinned.read_text(encoding="utf-8")) != settings:
        raise SystemExit(
            f"{out} holds results run with {pinned.read_text(encoding='utf-8').strip()}, not "
            f"{json.dumps(settings)}; use another --out"
        )
    warm, todo = plan(rows, seeds, out, settings)  # (refuses results that ran under other settings)
    atomic_write_json(pinned, settings)
    if len(todo) < len(rows) * len(seeds):
        print(f"{len(rows) * len(seeds) - len(todo)} finished results in {out} reused", flush=True)
    if warm:
        done = runner(
            [["--warm", "--seed", str(s), "--system", system, *common, *settings["overrides"]] for s, system in warm],
            parallel,
            log,
        )
        print(
            "warm start: " + ", ".join(f"seed {w['seed']} ({w['system']}) {w['minutes']:.1f} min" for w in done),
            flush=True,
        )
    if todo:
        runner([["--one", r, "--seed", str(s), *common, *settings["overrides"]] for r, s in todo], parallel, log)
    results = [load_result(result_path(out, r, s), settings) for r in rows for s in seeds]
    missing = [f"{r} seed {s}" for (r, s), res in zip([(r, s) for r in rows for s in seeds], results) if res is None]
    if missing:
        raise SystemExit(f"no result written for {', '.join(missing)}; see {log}")
    return results  # type: ignore[return-value]


def split_rows(items: list[str]) -> list[str]:
    """Rows given comma- or space-separated (a row with its own settings after @ is one item)."""
    return [r for item in items for r in ([item] if "@" in item else item.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["untrained,warm,warm+rr,warm+mappo"],
        help="rows, comma- or space-separated; a row's own settings after @: warm+rr@optim.lr=3e-5",
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    parser.add_argument("--val-limit", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--system", default="mas", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.warm or args.one:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        result = (
            run_warm_start(out, args.seed, args.overrides, args.system)
            if args.warm
            else one(args.one, args.seed, args.minutes, args.clock, args.val_limit, out, args.overrides)
        )
        print(json.dumps(result))
        return
    rows = split_rows(args.rows)
    for row in rows:
        try:
            parse_row(row)
        except ValueError as e:
            parser.error(str(e))
    seeds = [int(s) for s in args.seeds.split(",")]
    results = run_rows(
        rows, seeds, out, settings_of(args.minutes, args.clock, args.val_limit, args.overrides), args.parallel
    )
    table = summary(results, args.minutes, args.clock)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
