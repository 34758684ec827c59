"""Speed of shared-prefix computation (`optim.share_prefix`) on the default model: one update micro-batch of forked
groups, the prompt computed once per group against once per sample.

Each precision runs in its own process and builds what training builds (the model stored as the precision asks, a
LoRA policy with r = 16 on every projection, gradient checkpointing as in training). A micro-batch holds `--groups`
forked groups of `--group-size` samples; the samples of a group share one prompt of `--prompt-len` tokens and have
outputs of `--output-len` tokens (a Reranker's or Answerer's call: a prompt of ~500 tokens, an output of 12-32). It
times, best of `--repeats` after one warm-up, with the prompts shared and with one row per sample:

- forward + backward of the training log-probs (`Policy._logprobs` with dropout off, then `.backward()`);
- the same forward without gradients (the reference pass, `Policy.reference_logprobs`);

and prints the largest gap between the two ways' log-probs.

    python benchmarks/bench_update.py [--model smollm2-135m] [--precisions fp32,bf16-mixed] [--groups 1]
        [--group-size 4] [--prompt-len 500] [--output-len 32] [--repeats 2] [--no-gradient-checkpointing]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from bench_generation import PeakRSS
from bench_precision import best_of, common_arguments, dispatch


def one(precision: str, args: argparse.Namespace) -> dict[str, Any]:
    from mhgpo.config import LoraConfig, OptimConfig
    from mhgpo.model.modules import no_dropout
    from mhgpo.model.precision import weight_dtype
    from mhgpo.model.trained import load_model
    from mhgpo.rl.policy import Policy, Sample

    with PeakRSS() as peak:
        loaded = load_model(args.model, dtype=weight_dtype(precision, trainable=False))  # LoRA: a frozen base
        rows = args.groups * args.group_size
        optim = OptimConfig(
            micro_batch_tokens=rows * (args.prompt_len + args.output_len), gradient_checkpointing=args.checkpointing
        )
        policy = Policy(
            loaded.model, loaded.tokenizer.pad_token_id, optim, LoraConfig(r=args.lora_r), 10, precision=precision
        )
        gen = torch.Generator().manual_seed(0)
        vocab = loaded.model.config.vocab_size
        samples = []
        for _ in range(args.groups):
            prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
            for _ in range(args.group_size):
                output = torch.randint(0, vocab, (args.output_len,), generator=gen).tolist()
                samples.append(Sample(prompt, output, [0.0] * args.output_len, 1.0, "a"))

        def forward_backward() -> None:
            with no_dropout(policy.model):
                logp, mask = policy._logprobs(policy.model, samples)  # (B, T) (B, T)
                (logp * mask).sum().backward()
            policy.model.zero_grad(set_to_none=True)

        out: dict[str, Any] = {"precision": precision, "threads": torch.get_num_threads()}
        refs = {}
        for share in (True, False):
            optim.share_prefix = share
            key = "shared" if share else "alone"
            out[f"{key}_fwd_bwd_wall"], out[f"{key}_fwd_bwd_cpu"] = best_of(forward_backward, args.repeats)
            out[f"{key}_forward_wall"], out[f"{key}_forward_cpu"] = best_of(
                lambda: policy.reference_logprobs(samples), args.repeats
            )
            refs[key] = policy.reference_logprobs(samples)
        out["max_gap"] = max(float((a - b).abs().max()) for a, b in zip(refs["shared"], refs["alone"]))
    out["peak_mb"] = peak.peak / 2**20
    return out


def main() -> None:
    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_arguments(parser)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=500)
    parser.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    results = dispatch(__file__, args, one, ["--groups", "--group-size", "--prompt-len", "--output-len"])
    if results is None:
        return
    print(
        f"\n{args.model}, LoRA r={args.lora_r}, gradient checkpointing {'on' if args.checkpointing else 'off'}, "
        f"{results[0]['threads']} thread(s); one micro-batch of {args.groups} group(s) x {args.group_size} samples, "
        f"prompts of {args.prompt_len} tokens, outputs of {args.output_len}. Each cell: wall / CPU seconds"
    )
    print(f"{'precision':11} {'prompts':7} {'fwd+bwd s':>15} {'forward s':>15}")
    for r in results:
        for key in ("alone", "shared"):
            cells = [f"{r[f'{key}_{what}_wall']:.2f} / {r[f'{key}_{what}_cpu']:.2f}" for what in ("fwd_bwd", "forward")]
            print(f"{r['precision']:11} {key:7} {cells[0]:>15} {cells[1]:>15}")
        speed = [r[f"alone_{what}_wall"] / r[f"shared_{what}_wall"] for what in ("fwd_bwd", "forward")]
        print(
            f"{r['precision']:11} speed-up of sharing (wall): fwd+bwd {speed[0]:.2f}x, forward {speed[1]:.2f}x; "
            f"largest log-prob gap {r['max_gap']:.2e}; peak {r['peak_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()
