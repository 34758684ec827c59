"""How long loading a model takes: the default model read from its GGUF file against its de-quantised copy in the
cache (`MHGPO_CACHE/models/`, written by the first load), each in a fresh process, with a cache folder of the
script's own (the user's cache is not touched):

    python benchmarks/bench_load.py [--model smollm2-135m] [--rounds 3] [--dtype float32]

It prints the wall and CPU seconds of `load_model` in each setting (the median over the rounds), the first load
that writes the copy, and whether the loaded weights are equal bit for bit (a hash of every tensor's bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import hashlib, json, sys, time
import torch
from mhgpo.model.trained import load_model
wall, cpu = time.perf_counter(), time.process_time()
loaded = load_model(sys.argv[1], device="cpu", dtype=getattr(torch, sys.argv[2]))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
digest = hashlib.sha256()
for name, tensor in sorted(loaded.model.state_dict().items()):
    digest.update(name.encode())
    digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"wall": wall, "cpu": cpu, "hash": digest.hexdigest()}))
"""


def load_once(model: str, dtype: str, cache: Path, use_cache: bool) -> dict:
    env = {**os.environ, "MHGPO_CACHE": str(cache), "MHGPO_MODEL_CACHE": "1" if use_cache else "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, dtype], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"bench_load: the load failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as folder:
        cache = Path(folder)
        first = load_once(args.model, args.dtype, cache, use_cache=True)  # reads the file, writes the copy
        runs = {"the file": [], "the copy": []}
        for _ in range(args.rounds):
            runs["the file"].append(load_once(args.model, args.dtype, cache, use_cache=False))
            runs["the copy"].append(load_once(args.model, args.dtype, cache, use_cache=True))
    print(f"{args.model} in {args.dtype}, median of {args.rounds} loads, each in a fresh process")
    print(f"  first load (reads the file, writes the copy): {first['wall']:.1f} s wall, {first['cpu']:.1f} s CPU")
    for what, rows in runs.items():
        wall = statistics.median(r["wall"] for r in rows)
        cpu = statistics.median(r["cpu"] for r in rows)
        print(f"  from {what}: {wall:.2f} s wall, {cpu:.2f} s CPU")
    hashes = {r["hash"] for rows in runs.values() for r in rows} | {first["hash"]}
    print(f"  the same weights bit for bit: {len(hashes) == 1}")


if __name__ == "__main__":
    main()
