"""Wall seconds per RL step on a generation server (`generation.engine=vllm_server`), synchronous
(`rollout.max_staleness=0`) against one step off-policy (`rollout.max_staleness=1`), and the validation F1 each
reaches after the same steps: the server pinned to some CPU cores and the trainer to the others (`taskset`), the
demo's config (the default model, 4 questions and G=4 a step, LoRA), the same seeds. Run it in an environment with
vLLM (`bash scripts/setup.sh --vllm`):

    python benchmarks/bench_server.py --steps 4 --server-cpus 0 --trainer-cpus 1 [key=value ...]
    python benchmarks/bench_server.py --steps 10 --seeds 0,1,2 --start RUN0 --start RUN1 --start RUN2 \\
        --val-limit 200

`--start`: the trained model each seed's runs start from (a warm start: an `mhgpo sft` run or a run's
`warm_start/` folder; one for every seed, or one for all); without it the runs start from the config's model with
its warm start off. It prints one row per seed and setting: the mean over the steps between the first and the
last (a run one step off-policy grows nothing ahead before its first step's rollouts, and nothing during its last
step's update) of `seconds/step`, `seconds/rollout` (the rollouts, or the wait for those grown ahead),
`seconds/train` and the idle fractions, and the training command's wall time (`total_seconds`); with `--val-limit N` each trained run is
evaluated greedily on the first N questions of `--val-data` (`mhgpo eval`, in the trainer's process on its cores)
and the off-policy run's F1 is compared with the synchronous one's question by question (mean paired difference and
its 95% bootstrap interval, per seed and over all seeds' questions). The rows go to `--out` as JSON.

`--compare pipeline`: both runs synchronous, with `rollout.pipeline` off and then on (the tool calls, rewards and
reference pass beside the rollouts): `seconds/reference` is what the update still spends on the reference pass,
`reference/ahead` the share of the trained samples whose reference came from beside the rollouts.

    python benchmarks/bench_server.py --compare pipeline --steps 4 --start RUN
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = (
    "seconds/step",
    "seconds/rollout",
    "seconds/train",
    "seconds/handover_wait",
    "idle/trainer",
    "idle/server",
    "staleness/mean",
    "seconds/reference",
    "reference/ahead",
)
# what each run of a seed sets, by --compare: (label, overrides) of the first and the second run
SETTINGS = {
    "staleness": (("max_staleness 0", ["rollout.max_staleness=0"]), ("max_staleness 1", ["rollout.max_staleness=1"])),
    "pipeline": (
        ("pipeline off", ["rollout.max_staleness=0", "rollout.pipeline=false"]),
        ("pipeline on", ["rollout.max_staleness=0", "rollout.pipeline=true"]),
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, model: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A generation server of `model` (the runs' own model: a server holds the weights they start from)."""
    port = free_port()
    command = ["taskset", "-c", args.server_cpus, sys.executable, "-m", "mhgpo", "serve-generation"]
    command += ["--model", model, "--precision", args.precision, "--port", str(port)]
    command += ["--kv-cache-gb", str(args.kv_cache_gb), "--seed", "0"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    from mhgpo.errors import ServiceError
    from mhgpo.model.vllm_server import wait_until_serving

    try:
        wait_until_serving(process, url, 900, log)
    except ServiceError as e:
        raise SystemExit(str(e)) from None
    return process, url


def train(args: argparse.Namespace, url: str, seed: int, start: str | None, setting: int, out: Path) -> dict:
    label, overrides = SETTINGS[args.compare][setting]
    command = ["taskset", "-c", args.trainer_cpus, sys.executable, "-m", "mhgpo", "train"]
    command += ["--config", str(args.config), "--output-dir", str(out)]
    command += [f"steps={args.steps}", f"seed={seed}", "warm_start.enabled=false", "eval_every=0", "report_to=[]"]
    command += [f"model={start}"] if start else []
    command += [f"save_every={args.steps}", f"precision={args.precision}", "generation.engine=vllm_server"]
    command += [f"generation.server_urls=[{url}]", *overrides]
    command += ["optim.gradient_checkpointing=false", *args.overrides]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"})
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:-1] or rows[1:] or rows  # the steady state: neither the first step nor the last
    result: dict = {key: sum(r.get(key, 0.0) for r in later) / len(later) for key in KEYS}
    result.update(seed=seed, setting=setting, label=label, steps=len(rows), total_seconds=total, start=start)
    result["per_step"] = [{key: r.get(key) for key in ("step", *KEYS, "staleness/max", "reward/mean")} for r in rows]
    if args.val_limit:
        result.update(validate(args, seed, out))
    return result


def validate(args: argparse.Namespace, seed: int, run: Path) -> dict:
    """The trained run's greedy validation on the first `--val-limit` questions, in the trainer's process."""
    out = run / "eval_after"
    command = ["taskset", "-c", args.trainer_cpus, sys.executable, "-m", "mhgpo", "eval", "--model", str(run)]
    command += ["--data", args.val_data, "--limit", str(args.val_limit), "--seed", str(seed), "--output-dir", str(out)]
    command += [f"precision={args.precision}", "generation.engine=hf"]
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"})
    metrics = json.loads((out / "metrics.json").read_text())
    questions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    return {
        "val/f1": metrics["f1"],
        "val/em": metrics["em"],
        "val/acc": metrics["acc"],
        "val/questions": [{"id": q["id"], "f1": q["f1"]} for q in questions],
    }


def compare(rows: list[dict]) -> list[str]:
    """Lines of a table: per seed and over all seeds, the second setting's validation F1 minus the first's (off-policy
    minus synchronous), paired by question."""
    from mhgpo.experiments.stats import paired_bootstrap, paired_questions

    first, second = (rows[0]["label"], next(r["label"] for r in rows if r["setting"] == 1))
    lines = [
        f"| seed | F1, {first} | F1, {second} | paired Δ (95% interval) | questions |",
        "|---|---|---|---|---|",
    ]
    pooled: list[float] = []
    for seed in sorted({r["seed"] for r in rows}):
        sync, stale = (next(r for r in rows if r["seed"] == seed and r["setting"] == k) for k in (0, 1))
        diffs = [100 * d for d in paired_questions(stale["val/questions"], sync["val/questions"])]
        pooled += diffs
        mean, low, high = paired_bootstrap(diffs)
        lines.append(
            f"| {seed} | {sync['val/f1']:.1f} | {stale['val/f1']:.1f} | {mean:+.1f} ({low:+.1f}, {high:+.1f}) "
            f"| {len(diffs)} |"
        )
    if len({r["seed"] for r in rows}) > 1:
        mean, low, high = paired_bootstrap(pooled)
        lines.append(f"| all | | | {mean:+.1f} ({low:+.1f}, {high:+.1f}) | {len(pooled)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--compare",
        choices=sorted(SETTINGS),
        default="staleness",
        help="what a seed's two runs differ in: max_staleness 0 / 1, or synchronous with rollout.pipeline off / on",
    )
    parser.add_argument("--config", default=str(REPO / "mhgpo" / "config" / "demo.yaml"))
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each runs both settings")
    parser.add_argument("--start", action="append", default=[], help="a warm start (once, or once per seed)")
    parser.add_argument("--model", default="smollm2-135m", help="the runs' model without --start")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--trainer-cpus", default="1")
    parser.add_argument("--val-limit", type=int, default=0, help="validate each trained run on N questions (0: not)")
    parser.add_argument("--val-data", default="synthetic:dev")
    parser.add_argument("--out", default="bench_server.json")
    parser.add_argument("--keep", help="keep the runs in this folder (default: a temporary one, removed)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides of every run")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.start and len(args.start) not in (1, len(seeds)):
        parser.error(f"--start: once, or once per seed ({len(seeds)}), got {len(args.start)}")
    starts = [str(Path(s).resolve()) for s in args.start] * (len(seeds) if len(args.start) == 1 else 1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-server-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for i, seed in enumerate(seeds):
        start = starts[i] if starts else None
        process, url = start_server(args, start or args.model, work / f"server-seed{seed}.log")
        try:
            for setting in (0, 1):
                rows.append(train(args, url, seed, start, setting, work / f"seed{seed}-{args.compare}{setting}"))
                Path(args.out).write_text(json.dumps(rows, indent=1))  # what finished, if a later run fails
        finally:
            process.terminate()
            process.wait(60)
    print("| seed | setting | " + " | ".join(KEYS) + " | val F1 |")
    print("|---" * (len(KEYS) + 3) + "|")
    for row in rows:
        val = f"{row['val/f1']:.1f}" if "val/f1" in row else ""
        print(f"| {row['seed']} | {row['label']} | " + " | ".join(f"{row[k]:.3g}" for k in KEYS) + f" | {val} |")
    if args.val_limit:
        print("\n".join(["", *compare(rows)]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
