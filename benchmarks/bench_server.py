"""Wall seconds per RL step on a generation server (`generation.engine=vllm_server`), synchronous
(`rollout.max_staleness=0`) against one step off-policy (`rollout.max_staleness=1`): the server pinned to some CPU
cores and the trainer to the others (`taskset`), the demo's config without its warm start (the default model, 4
questions and G=4 a step, LoRA), the same seed. Run it in an environment with vLLM (`bash scripts/setup.sh
--vllm`):

    python benchmarks/bench_server.py --steps 4 --server-cpus 0 --trainer-cpus 1 [key=value ...]

It prints one row per setting: the mean over the steps after the first (the first step of a run one step off-policy
has nothing grown ahead) of `seconds/step`, `seconds/rollout` (the rollouts, or the wait for those grown ahead),
`seconds/train` and the idle fractions, and writes the rows as JSON (`--out`).
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
KEYS = ("seconds/step", "seconds/rollout", "seconds/train", "idle/trainer", "idle/server", "staleness/mean")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = ["taskset", "-c", args.server_cpus, sys.executable, "-m", "mhgpo", "serve-generation"]
    command += ["--model", args.model, "--precision", args.precision, "--port", str(port)]
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


def train(args: argparse.Namespace, url: str, staleness: int, out: Path) -> dict[str, float]:
    command = ["taskset", "-c", args.trainer_cpus, sys.executable, "-m", "mhgpo", "train"]
    command += ["--config", str(REPO / "mhgpo" / "config" / "demo.yaml"), "--output-dir", str(out)]
    command += [f"steps={args.steps}", "warm_start.enabled=false", "eval_every=0", "save_every=0", "report_to=[]"]
    command += [f"precision={args.precision}", "generation.engine=vllm_server", f"generation.server_urls=[{url}]"]
    command += [f"rollout.max_staleness={staleness}", "optim.gradient_checkpointing=false", *args.overrides]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "TQDM_DISABLE": "1"})
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    result = {key: sum(r[key] for r in later) / len(later) for key in KEYS}
    result.update(staleness=float(staleness), steps=float(len(rows)), total_seconds=total)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--server-cpus", default="0")
    parser.add_argument("--trainer-cpus", default="1")
    parser.add_argument("--out", default="bench_server.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides of both runs")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-server-"))
    process, url = start_server(args, work / "server.log")
    try:
        rows = [train(args, url, staleness, work / f"run-{staleness}") for staleness in (0, 1)]
    finally:
        process.terminate()
        process.wait(60)
    print("| max_staleness | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for row in rows:
        print(f"| {int(row['staleness'])} | " + " | ".join(f"{row[k]:.3g}" for k in KEYS) + " |")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
