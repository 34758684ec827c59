"""Batched evaluation against one question at a time: the same questions, the same model, greedy decoding.

For each precision (each in its own process, the model loaded once), `mhgpo eval`'s loop (`evaluate_examples`)
answers `--questions` synthetic dev questions with the default team twice: one question at a time (`batch_size=1`,
one sequence per generate call) and breadth-first in one batch (`batch_size=--questions`, `gen_batch_size=
--gen-batch-size`). It prints questions per second (wall and the process's CPU seconds, best of `--repeats`), the
speed-up, and whether the predictions and whole traces (every agent's output ids) are identical between the two;
with `--check`, it exits with status 1 when they are not. `--profile` prints the top operators of one batched pass
(torch.profiler).

    python benchmarks/bench_eval.py [--questions 32] [--precisions fp32,auto] [--gen-batch-size 32]
        [--repeats 1] [--warmup] [--model smollm2-135m] [--check] [--profile]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(precision: str, args: argparse.Namespace) -> dict:
    import torch

    from mhgpo.config import EvalConfig, RetrievalConfig, SearchConfig
    from mhgpo.model.generation import HFGenerator
    from mhgpo.model.precision import resolve_precision
    from mhgpo.rl.evaluation import evaluate_examples
    from mhgpo.run.setup import load_generator
    from mhgpo.team.build import build_workflow, load_examples

    precision, reason = resolve_precision(precision)
    examples = load_examples("synthetic:dev", args.questions)
    workflow = build_workflow("mas", "synthetic:dev", RetrievalConfig(), SearchConfig())
    loaded, _, encode = load_generator(EvalConfig(model=args.model, gen_batch_size=1, precision=precision), reason)
    out: dict = {"precision": precision, "threads": torch.get_num_threads()}
    results = {}
    for name, batch, gen_batch in (("one", 1, 1), ("batched", len(examples), args.gen_batch_size)):
        generator = HFGenerator(
            loaded.model, loaded.tokenizer, batch_size=gen_batch, precision=precision, select=loaded.select
        )

        def run(generator: HFGenerator = generator, batch: int = batch):
            return evaluate_examples(examples, workflow, generator, encode, batch, progress=False)

        if args.repeats > 1 or args.warmup:
            run()
        walls, cpus = [], []
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = run()
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - start_cpu)
        out[f"{name}_wall"], out[f"{name}_cpu"] = min(walls), min(cpus)
        if name == "batched" and args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)
    one_p, batched_p = results["one"].predictions, results["batched"].predictions
    out["same_predictions"] = sum(a["prediction"] == b["prediction"] for a, b in zip(one_p, batched_p))
    out["same_traces"] = sum(a["trace"] == b["trace"] for a, b in zip(one_p, batched_p))
    out["f1_one"], out["f1_batched"] = results["one"].metrics["f1"], results["batched"].metrics["f1"]
    out["output_tokens"] = sum(s.get("output_tokens", 0) for p in batched_p for s in p["trace"]["steps"])
    return out


def main() -> None:
    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--questions", type=int, default=32)
    parser.add_argument("--precisions", default="fp32,auto", help="comma-separated: fp32, bf16-mixed, bf16, auto")
    parser.add_argument("--gen-batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", action="store_true", help="one untimed pass first (always with --repeats > 1)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every trace is identical")
    parser.add_argument("--profile", action="store_true", help="print the top operators of a batched pass")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args)))
        return
    passed = [
        "--model",
        args.model,
        "--questions",
        str(args.questions),
        "--gen-batch-size",
        str(args.gen_batch_size),
        "--repeats",
        str(args.repeats),
    ]
    passed += [flag for flag, on in (("--warmup", args.warmup), ("--profile", args.profile)) if on]
    n = args.questions
    print(
        f"`mhgpo eval` loop, {n} synthetic dev questions, default team, {args.model}, greedy; batched = all {n} "
        f"questions breadth-first, gen_batch_size {args.gen_batch_size}; best of {args.repeats}; questions/s wall "
        f"(CPU)\n"
    )
    print(
        "| precision | threads | one at a time q/s | batched q/s | speed-up | identical predictions | "
        "identical traces | F1 one / batched | output tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for precision in args.precisions.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", precision, *passed], capture_output=True, text=True)
        if args.profile:
            print(proc.stderr, file=sys.stderr)
        if proc.returncode:
            sys.exit(f"{precision} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(r)
        one_q, bat_q = n / r["one_wall"], n / r["batched_wall"]
        one_c, bat_c = n / r["one_cpu"], n / r["batched_cpu"]
        print(
            f"| {r['precision']} | {r['threads']} | {one_q:.2f} ({one_c:.2f}) | {bat_q:.2f} ({bat_c:.2f}) | "
            f"{bat_q / one_q:.1f}× ({bat_c / one_c:.1f}×) | {r['same_predictions']}/{n} | {r['same_traces']}/{n} | "
            f"{r['f1_one']:.1f} / {r['f1_batched']:.1f} | {r['output_tokens']} |",
            flush=True,
        )
    if args.check and any(r["same_traces"] != n for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
