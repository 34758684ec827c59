"""Speed of `precision=fp32` against `precision=bf16-mixed` on the default model: the update's forward + backward,
the reference pass, and generation.

Each precision runs in its own process (so that its peak RSS is its own) and builds what training builds: the model
stored as the precision asks (LoRA: the frozen base in bfloat16 under bf16-mixed), a LoRA policy (r = 16 on every
projection by default), gradient checkpointing as in the demo. It times, best of `--repeats` after one warm-up:

- forward + backward of the training log-probs (`Policy._logprobs` with dropout off, then `.backward()`) on
  `--batch` sequences of `--length` tokens, the last `--output-len` of them output tokens (one micro-batch);
- the same forward without gradients (the reference pass, `Policy.reference_logprobs`);
- generation of `--new-tokens` tokens for each of `--gen` sequences (prompts of about `--prompt-len` tokens, all in
  one batch), in new tokens per second.

    python benchmarks/bench_precision.py [--model smollm2-135m] [--precisions fp32,bf16-mixed] [--batch 8]
        [--length 512] [--gen 4,16] [--repeats 2] [--no-gradient-checkpointing]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_generation import PeakRSS, make_prompts, release_freed_memory


def best_of(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """The least wall seconds and the least CPU seconds of this process (all its threads) of `repeats` runs of
    `fn` after a warm-up; on a busy machine the CPU seconds are the steadier figure."""
    fn()  # warm-up (oneDNN kernels, allocator)
    wall, cpu = [], []
    for _ in range(repeats):
        release_freed_memory()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def one(precision: str, args: argparse.Namespace) -> dict[str, Any]:
    from mhgpo.config import LoraConfig, OptimConfig
    from mhgpo.model.generation import HFGenerator, SamplingParams
    from mhgpo.model.modules import no_dropout
    from mhgpo.model.precision import weight_dtype
    from mhgpo.model.trained import load_model
    from mhgpo.rl.policy import Policy, Sample

    with PeakRSS() as peak:
        loaded = load_model(args.model, dtype=weight_dtype(precision, trainable=False))  # LoRA: a frozen base
        optim = OptimConfig(micro_batch_tokens=args.batch * args.length, gradient_checkpointing=args.checkpointing)
        policy = Policy(
            loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=args.lora_r), 10, precision=precision
        )
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, loaded.model.config.vocab_size, (args.batch, args.length), generator=gen)  # (B, L)
        cut = args.length - args.output_len
        samples = [Sample(row[:cut].tolist(), row[cut:].tolist(), [0.0] * args.output_len, 1.0, "a") for row in ids]

        def forward_backward() -> None:
            with no_dropout(policy.model):
                logp, mask = policy._logprobs(policy.model, samples)  # (B, T) (B, T)
                (logp * mask).sum().backward()
            policy.model.zero_grad(set_to_none=True)

        out: dict[str, Any] = {"precision": precision, "threads": torch.get_num_threads()}
        out["fwd_bwd_wall"], out["fwd_bwd_cpu"] = best_of(forward_backward, args.repeats)
        out["forward_wall"], out["forward_cpu"] = best_of(lambda: policy.reference_logprobs(samples), args.repeats)
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
        for n in args.gen:
            prompts = make_prompts(loaded.tokenizer, count=n, target=args.prompt_len)
            generator = HFGenerator(policy.model, loaded.tokenizer, batch_size=n, precision=precision)
            made: list[int] = []

            def generate(made=made, generator=generator, prompts=prompts) -> None:
                torch.manual_seed(0)
                made.append(sum(len(g.output_ids) for g in generator.generate(prompts, params)))

            seconds, cpu = best_of(generate, args.repeats)
            out[f"gen{n}_wall"], out[f"gen{n}_cpu"] = made[-1] / seconds, made[-1] / cpu  # new tokens per second
    out["peak_mb"] = peak.peak / 2**20
    return out


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every precision benchmark takes (and `--one`, the precision a child process measures)."""
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-gradient-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--one", help=argparse.SUPPRESS)


def in_own_processes(script: str, args: argparse.Namespace, passed: list[str]) -> list[dict[str, Any]]:
    """Run `script --one PRECISION` for each of `args.precisions`, each in a process of its own (its peak RSS its
    own), with the common options and `passed`; their results, in order."""
    passed = (
        passed
        + ["--model", args.model, "--lora-r", str(args.lora_r), "--repeats", str(args.repeats)]
        + ([] if args.checkpointing else ["--no-gradient-checkpointing"])
    )
    results = []
    for precision in args.precisions.split(","):
        proc = subprocess.run(
            [sys.executable, script, "--one", precision, *passed], capture_output=True, text=True, check=True
        )
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{precision}: done", flush=True)
    return results


def dispatch(
    script: str, args: argparse.Namespace, one: Callable[[str, argparse.Namespace], dict[str, Any]], options: list[str]
) -> list[dict[str, Any]] | None:
    """With `--one PRECISION`: print `one`'s result as JSON and return None (a child's run). Else run `script` once
    per precision in processes of their own, passing on the common options and the script's own `options` (flag
    names; list values joined by commas), and return their results."""
    if args.one:
        print(json.dumps(one(args.one, args)))
        return None
    passed = []
    for flag in options:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        passed += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return in_own_processes(script, args, passed)


def main() -> None:
    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--gen", default="4,16", help="generation batch sizes")
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    args.gen = [int(n) for n in str(args.gen).split(",")]
    results = dispatch(
        __file__, args, one, ["--batch", "--length", "--output-len", "--gen", "--prompt-len", "--new-tokens"]
    )
    if results is None:
        return
    print(
        f"\n{args.model}, LoRA r={args.lora_r}, gradient checkpointing {'on' if args.checkpointing else 'off'}, "
        f"{results[0]['threads']} thread(s); forward+backward and forward: {args.batch} x {args.length} tokens "
        f"({args.output_len} output tokens each); generation: {args.new_tokens} new tokens per sequence, "
        f"prompts of ~{args.prompt_len} tokens. Each cell: wall / CPU (seconds, or new tokens per second)"
    )
    columns = [("fwd+bwd s", "fwd_bwd"), ("forward s", "forward")] + [(f"gen x{n} tok/s", f"gen{n}") for n in args.gen]
    print(f"{'precision':11} " + " ".join(f"{name:>15}" for name, _ in columns) + f" {'peak MB':>8}")
    for r in results:
        cells = [f"{r[key + '_wall']:.2f} / {r[key + '_cpu']:.2f}" for _, key in columns]
        print(f"{r['precision']:11} " + " ".join(f"{c:>15}" for c in cells) + f" {r['peak_mb']:8.0f}")
    base = results[0]
    for r in results[1:]:
        ratios = []
        for name, key in columns:  # seconds: base / r; tokens per second: r / base
            wall, cpu = r[key + "_wall"] / base[key + "_wall"], r[key + "_cpu"] / base[key + "_cpu"]
            if not key.startswith("gen"):
                wall, cpu = 1 / wall, 1 / cpu
            ratios.append(f"{name.rsplit(' ', 1)[0]} {wall:.2f}x / {cpu:.2f}x")
        print(f"speed-up of {r['precision']} over {base['precision']} (wall / CPU): " + ", ".join(ratios))


if __name__ == "__main__":
    main()
