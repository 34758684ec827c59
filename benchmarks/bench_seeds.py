"""What per-request sampling seeds (`generation.seeded`) cost in sampling speed, on the in-process vLLM engine and
on a generation server: one agent call of the demo's shape (4 prompts of about 250 tokens, each sampled G=4 times,
up to 32 new tokens at temperature 1.0 and top-p 0.9) on the default model, seeded and unseeded calls in turn.
Seeded, each prompt samples from a generator of its own in vLLM's sampler, and on a server each prompt is a request
of its own (the completions API takes one seed a request); unseeded, vLLM draws from its process's generator and a
server gets the call as one request. Run it in an environment with vLLM (`bash scripts/setup.sh --vllm`):

    python benchmarks/bench_seeds.py [--rounds 8] [--engines vllm,vllm_server] [--precision bf16-mixed]

It prints, per engine and setting, the median over the rounds of the new tokens per second and of the seconds per
call, and the ratio seeded / unseeded (the first call of each engine, a warm-up, is left out).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PASSAGE = (
    "The Berlin Wall was a guarded concrete barrier that encircled West Berlin from 1961 to 1989, separating it "
    "from East Berlin and East Germany. Construction began on 13 August 1961. The fall of the wall on 9 November "
    "1989 paved the way for German reunification in October 1990. "
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(tokenizer: Any, questions: int, group: int) -> list[list[int]]:
    """``questions`` prompts of about 250 tokens, each ``group`` times (the G samples of a fork)."""
    out = []
    for q in range(questions):
        ids = tokenizer.encode(PASSAGE * 4 + f"Question {q}: when did construction of the wall begin? Answer:")
        out += [ids] * group
    return out


def timed(generator: Any, batch: list[list[int]], params: Any, key: tuple[int, ...] | None) -> tuple[float, int]:
    """Seconds of one call and the new tokens it sampled (seeded from the stream of ``key``, or not)."""
    started = time.perf_counter()
    if key is None:
        done = generator.generate(batch, params)
    else:
        with generator.seeded(key):
            done = generator.generate(batch, params)
    return time.perf_counter() - started, sum(len(g.output_ids) for g in done)


def measure(generator: Any, batch: list[list[int]], params: Any, rounds: int) -> dict[str, list[tuple[float, int]]]:
    timed(generator, batch, params, None)  # warm-up
    runs: dict[str, list[tuple[float, int]]] = {"unseeded": [], "seeded": []}
    for r in range(rounds):  # in turn, so that a change of the machine's load falls on both
        runs["unseeded"].append(timed(generator, batch, params, None))
        runs["seeded"].append(timed(generator, batch, params, (0, r, 0)))
    return runs


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "mhgpo", "serve-generation", "--model", args.model]
    command += ["--precision", args.precision, "--port", str(port), "--kv-cache-gb", str(args.kv_cache_gb)]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    from mhgpo.errors import ServiceError
    from mhgpo.model.vllm_server import wait_until_serving

    try:
        wait_until_serving(process, url, 900, log)
    except ServiceError as e:
        raise SystemExit(str(e)) from None
    return process, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--engines", default="vllm,vllm_server")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    args = parser.parse_args()

    from mhgpo.cli.serve import _engine_folder
    from mhgpo.model.generation import SamplingParams
    from mhgpo.model.pretrained import stop_token_ids
    from mhgpo.model.trained import load_model
    from mhgpo.model.vllm_engine import ENGINE_DTYPES, VLLMGenerator
    from mhgpo.model.vllm_server import ServerGenerator

    dtype = ENGINE_DTYPES[args.precision]
    folder = _engine_folder(args.model, args.precision, dtype)
    loaded = load_model(args.model)
    tokenizer, eos = loaded.tokenizer, stop_token_ids(loaded.tokenizer, loaded.model)
    del loaded
    batch = prompts(tokenizer, 4, 4)
    params = SamplingParams(max_new_tokens=32, temperature=1.0, top_p=0.9)
    results = {}
    for engine in args.engines.split(","):
        if engine == "vllm":
            generator = VLLMGenerator(folder, tokenizer, eos, dtype=dtype, kv_cache_gb=args.kv_cache_gb)
            results[engine] = measure(generator, batch, params, args.rounds)
            generator.close()
            gc.collect()
        elif engine == "vllm_server":
            work = Path(tempfile.mkdtemp(prefix="bench-seeds-"))
            process, url = start_server(args, work / "server.log")
            try:
                generator = ServerGenerator([url], tokenizer, eos, vocab_size=len(tokenizer))
                results[engine] = measure(generator, batch, params, args.rounds)
            finally:
                process.terminate()
                process.wait(60)
        else:
            raise SystemExit(f"--engines: expected vllm and/or vllm_server, got {engine!r}")
    load = os.getloadavg()
    print(f"{len(batch)} prompts a call, {args.rounds} rounds, {args.precision}; load average {load[0]:.1f}")
    print("| engine | setting | new tokens/s | s per call | seeded / unseeded (tokens/s) |")
    print("|---|---|---|---|---|")
    for engine, runs in results.items():
        speed = {k: statistics.median(n / s for s, n in v) for k, v in runs.items()}
        for setting, v in runs.items():
            ratio = f"{speed['seeded'] / speed['unseeded']:.2f}" if setting == "seeded" else ""
            seconds = statistics.median(s for s, _ in v)
            print(f"| {engine} | {setting} | {speed[setting]:.1f} | {seconds:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
