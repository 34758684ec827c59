"""How close a training step comes to this machine's limits: measured GEMM and copy rates, and the FLOP/s that
generation and the update achieve in a step with the demo settings, as fractions of them.

Limits (measured here, `torch.matmul` on random matrices, best of a few runs): GEMM GFLOP/s in float32 and
bfloat16 at the default model's shapes (M×K×N: 2048×576×1536, a 2,048-token micro-batch through an MLP projection;
512×576×49152, the LM head over 512 positions; 16×576×1536, one decoding step of 16 sequences), and the copy
bandwidth (GB/s read + written by `Tensor.copy_` of 256 MiB).

Then `--steps` steps (default 1) with the demo settings (`mhgpo/config/demo.yaml`: the default model, LoRA r16, 4
questions, G = 4, RR sampler, no warm start, no validation; `--short`: 2 questions, G = 2), timing every
`generate` call and the update (with its reference pass), and counting the FLOPs the computation needs,
analytically, from the model's dimensions and the step's token counts (padding and finished rows left out, so what
padding costs shows as lost efficiency); the table holds the means per step, and each step's rollout and update
seconds are printed:

- a forward pass over a token: 2 × (the decoder layers' weights + the LoRA adapters'), plus attention 4 × hidden ×
  (keys attended, causal) per layer, plus 2 × vocabulary × hidden for the LM head where logits are taken
  (generation: the last prompt position and every decoding step; the update: the output positions);
- generation: the prompt once (prefill) and each generated token after the first;
- the update: the reference pass (a forward, when `optim.kl_beta` is not 0), the forward, the forward again when
  `optim.gradient_checkpointing` recomputes it, and the backward: the gradient of every activation (as much as the
  forward, attention twice) plus the trainable weights' gradients (as much as their forward). With LoRA and
  checkpointing this is about 3 forwards per token, the usual 6 × parameters × tokens of training.

It prints a markdown table: seconds, GFLOP, achieved GFLOP/s, and that as a percentage of the float32 and bfloat16
GEMM rates at the training shape (and, for generation, at the decoding shape), plus generation's bandwidth bound
(the weight bytes read by every decoder call over the copy bandwidth).

    python benchmarks/roofline.py [--threads N] [--short] [--steps N] [--precision auto] [key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = {"training": (2048, 576, 1536), "LM head": (512, 576, 49152), "decoding": (16, 576, 1536)}


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, seconds: float) -> float:
    """Best GFLOP/s of ``(m, k) @ (k, n)`` in ``dtype`` over about ``seconds`` of runs."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        torch.matmul(a, b, out=out)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return 2 * m * k * n / best / 1e9


def copy_gbs(seconds: float, mib: int = 256) -> float:
    """Best GB/s (bytes read + written) of copying ``mib`` MiB between two float32 tensors."""
    src = torch.randn(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return 2 * src.numel() * 4 / best / 1e9


class Dims:
    """The FLOP counts of a decoder-only model's passes, from its dimensions (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        from mhgpo.model.logprobs import causal_lm

        config = causal_lm(model).config
        self.hidden, self.layers, self.vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
        self.body = self.lora = self.lora_trainable = 0
        for name, p in model.named_parameters():
            if "lora_" in name:
                self.lora += p.numel()
                self.lora_trainable += p.numel() if p.requires_grad else 0
            elif ".layers." in name and p.dim() == 2:
                self.body += p.numel()

    def forward(self, tokens: int, attended: int, head_tokens: int) -> float:
        """FLOPs of a forward over ``tokens`` positions attending ``attended`` keys in all (summed over positions),
        with logits at ``head_tokens`` positions."""
        return (
            2 * (self.body + self.lora) * tokens
            + 4 * self.hidden * self.layers * attended
            + 2 * self.vocab * self.hidden * head_tokens
        )

    def backward(self, tokens: int, attended: int, head_tokens: int) -> float:
        """Activation gradients (as much as the forward, attention twice) plus the trainable weights' gradients."""
        return self.forward(tokens, 2 * attended, head_tokens) + 2 * self.lora_trainable * tokens


def causal_keys(start: int, count: int) -> int:
    """Keys attended by positions ``start .. start + count - 1`` of a causal sequence (position p sees p + 1)."""
    return count * start + count * (count + 1) // 2


def generation_flops(dims: Dims, prompt: int, output: int) -> float:
    """Prefill of the prompt (logits at its last position), then one decoding step per later output token."""
    flops = dims.forward(prompt, causal_keys(0, prompt), 1)
    steps = max(output - 1, 0)
    return flops + dims.forward(steps, causal_keys(prompt, steps), steps)


def update_flops(dims: Dims, samples: list[Any], reference: bool, checkpointing: bool) -> tuple[float, float]:
    """(reference-pass FLOPs, forward + backward FLOPs) of the update over ``samples``."""
    ref = train = 0.0
    for s in samples:
        n, out = len(s.prompt_ids) + len(s.output_ids), len(s.output_ids)
        keys = causal_keys(0, n)
        forward = dims.forward(n, keys, out)
        ref += forward if reference else 0.0
        train += forward * (2 if checkpointing else 1) + dims.backward(n, keys, out)
    return ref, train


class StepMeter:
    """What a step spends in generation and in the update, by wrapping the generator's ``generate``, the policy's
    ``reference_logprobs`` and ``update``: ``gen`` holds generation's seconds, FLOPs (:func:`generation_flops`), new
    and prompt tokens and decoder calls; ``ref_seconds`` the reference pass's seconds; ``update_seconds`` the policy
    update's (reference pass included) and ``updated`` the samples it trained on (those with an output). ``sync`` is
    called before each clock reading (``torch.cuda.synchronize`` on a GPU, whose kernels run asynchronously).
    :meth:`reset` zeroes the counts (between steps), :meth:`close` unwraps."""

    def __init__(self, generator: Any, policy: Any, dims: Dims, sync: Any = None) -> None:
        from mhgpo.model.logprobs import causal_lm

        self.dims, self._sync = dims, sync or (lambda: None)
        self._generator, self._policy = generator, policy
        self._originals = (generator.generate, policy.reference_logprobs, policy.update)
        generator.generate, policy.reference_logprobs, policy.update = self._generate, self._reference, self._update
        self._generating = False
        decoder = causal_lm(policy.model).get_decoder()
        self._hook = decoder.register_forward_pre_hook(self._count_call, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.gen = {"seconds": 0.0, "flops": 0.0, "tokens": 0, "prompt_tokens": 0, "calls": 0}
        self.ref_seconds = self.update_seconds = 0.0
        self.updated: list[Any] = []

    def close(self) -> None:
        self._hook.remove()
        self._generator.generate, self._policy.reference_logprobs, self._policy.update = self._originals

    def _count_call(self, module: Any, args: Any, kwargs: Any) -> None:
        self.gen["calls"] += int(self._generating)

    def _timed(self, fn: Any, *args: Any) -> tuple[Any, float]:
        self._sync()
        t = time.perf_counter()
        out = fn(*args)
        self._sync()
        return out, time.perf_counter() - t

    def _generate(self, prompts: list[list[int]], params: Any) -> Any:
        self._generating = True
        try:
            out, seconds = self._timed(self._originals[0], prompts, params)
        finally:
            self._generating = False
        self.gen["seconds"] += seconds
        for g in out:
            self.gen["flops"] += generation_flops(self.dims, len(g.prompt_ids), len(g.output_ids))
            self.gen["tokens"] += len(g.output_ids)
            self.gen["prompt_tokens"] += len(g.prompt_ids)
        return out

    def _reference(self, samples: list[Any], *known: Any) -> Any:
        out, seconds = self._timed(self._originals[1], samples, *known)
        self.ref_seconds += seconds
        return out

    def _update(self, samples: list[Any], *known: Any) -> Any:
        out, seconds = self._timed(self._originals[2], samples, *known)
        self.update_seconds += seconds
        self.updated += [s for s in samples if s.output_ids]
        return out


def measure_step(args: argparse.Namespace) -> dict[str, Any]:
    """One demo-settings step: generation and update seconds, FLOPs and decoder calls."""
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.rl.trainer import Trainer
    from mhgpo.run.setup import build_training, settle

    size = ["questions_per_step=2", "group_size=2"] if args.short else []
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(
            TrainConfig,
            demo_config_path(),
            [
                "steps=1",
                "eval_every=0",
                "save_every=0",
                "warm_start.enabled=false",
                f"output_dir={run_dir}",
                f"precision={args.precision}",
                *size,
                *args.overrides,
            ],
        )
        job = settle(cfg)
        team = build_training(job)
        trainer = Trainer(job.cfg, team, Path(run_dir), progress=False)
        dims = Dims(team.policy.model)
        meter = StepMeter(team.generator, team.policy, dims)
        per_step: list[tuple[float, float]] = []  # (rollout, update) seconds of each step
        samples_with_output: list[Any] = []
        ref_flops = train_flops = 0.0
        for _ in range(args.steps):
            t = time.perf_counter()
            batch, samples, metrics = trainer.collect()
            rollout_seconds = time.perf_counter() - t
            trained = [s for s in samples if s.output_ids]
            t = time.perf_counter()
            trainer.learn(samples, metrics)
            trainer.step += 1
            per_step.append((rollout_seconds, time.perf_counter() - t))
            ref, train = update_flops(dims, trained, cfg.optim.kl_beta != 0, cfg.optim.gradient_checkpointing)
            ref_flops, train_flops = ref_flops + ref, train_flops + train
            samples_with_output += trained
        meter.close()
    weight_bytes = sum(
        p.numel() * p.element_size()
        for n, p in team.policy.model.named_parameters()
        if "lora_" not in n or p.requires_grad
    )
    n = len(per_step)  # every figure below is a mean over the steps
    gen = {k: v / n for k, v in meter.gen.items()}
    return {
        "precision": cfg.precision,
        "gen": gen,
        "per_step": per_step,
        "rollout_seconds": sum(r for r, _ in per_step) / n,
        "update_seconds": sum(u for _, u in per_step) / n,
        "ref_seconds": meter.ref_seconds / n,
        "ref_flops": ref_flops / n,
        "train_flops": train_flops / n,
        "trained_tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in samples_with_output) / n,
        "samples": len(samples_with_output) / n,
        "weight_bytes": weight_bytes,
        "settings": f"{cfg.questions_per_step} questions, G = {cfg.group_size}, sampler {cfg.sampler}, "
        f"LoRA r{cfg.lora.r}, kl_beta {cfg.optim.kl_beta}, gradient checkpointing "
        f"{cfg.optim.gradient_checkpointing}, gen_batch_size {cfg.gen_batch_size}",
    }


def main() -> None:
    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--short", action="store_true", help="shorter limit timings, 2 questions × G = 2")
    parser.add_argument("--precision", default="auto", help="the step's precision (fp32, bf16-mixed, auto)")
    parser.add_argument("--limits-only", action="store_true", help="measure the machine's limits only")
    parser.add_argument("--steps", type=int, default=1, help="steps measured; the figures are means over them")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    seconds = 0.5 if args.short else 2.0
    limits = {
        (name, dtype): gemm_gflops(*shape, dtype, seconds)
        for name, shape in SHAPES.items()
        for dtype in (torch.float32, torch.bfloat16)
    }
    bandwidth = copy_gbs(seconds)
    threads = torch.get_num_threads()
    print(f"\nMachine limits, {threads} thread(s), torch {torch.__version__}\n")
    print("| GEMM M×K×N | what | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for name, (m, k, n) in SHAPES.items():
        f32, b16 = limits[(name, torch.float32)], limits[(name, torch.bfloat16)]
        print(f"| {m}×{k}×{n} | {name} | {f32:.0f} | {b16:.0f} | {b16 / f32:.1f}× |")
    print(f"\ncopy bandwidth (read + write): {bandwidth:.1f} GB/s")
    if args.limits_only:
        return
    r = measure_step(args)
    gen = r["gen"]
    train_f32, train_b16 = limits[("training", torch.float32)], limits[("training", torch.bfloat16)]
    dec_f32, dec_b16 = limits[("decoding", torch.float32)], limits[("decoding", torch.bfloat16)]
    bound = gen["calls"] * r["weight_bytes"] / (bandwidth * 1e9)
    train_seconds = r["update_seconds"] - r["ref_seconds"]
    rows = [
        (
            "generation",
            gen["seconds"],
            gen["flops"],
            f"{gen['prompt_tokens']:.0f} prompt + {gen['tokens']:.0f} new",
            f"{100 * gen['flops'] / gen['seconds'] / 1e9 / dec_f32:.0f}% / "
            f"{100 * gen['flops'] / gen['seconds'] / 1e9 / dec_b16:.0f}%",
        ),
        ("update: reference pass", r["ref_seconds"], r["ref_flops"], f"{r['trained_tokens']:.0f}", "—"),
        ("update: forward + backward", train_seconds, r["train_flops"], f"{r['trained_tokens']:.0f}", "—"),
        ("update (all)", r["update_seconds"], r["ref_flops"] + r["train_flops"], f"{r['trained_tokens']:.0f}", "—"),
    ]
    steps = "; ".join(f"{a:.1f} + {b:.1f} s" for a, b in r["per_step"])
    print(
        f"\n{args.steps} step(s), demo settings ({r['settings']}), precision {r['precision']}, {threads} thread(s); "
        f"mean per step: rollout {r['rollout_seconds']:.1f} s (generation {gen['seconds']:.1f} s, "
        f"{gen['calls']:.0f} decoder calls), update {r['update_seconds']:.1f} s, {r['samples']:.0f} trained "
        f"samples; each step's rollout + update: {steps}\n"
    )
    print(
        "| phase | s | tokens | GFLOP | GFLOP/s | % of fp32 GEMM (training shape) | "
        "% of bf16 GEMM (training shape) | % of fp32 / bf16 GEMM (decoding shape) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, secs, flops, tokens, decoding in rows:
        rate = flops / secs / 1e9 if secs > 0 else 0.0
        print(
            f"| {name} | {secs:.1f} | {tokens} | {flops / 1e9:.0f} | {rate:.0f} | {100 * rate / train_f32:.0f}% | "
            f"{100 * rate / train_b16:.0f}% | {decoding} |"
        )
    print(
        f"\ngeneration's bandwidth bound: {gen['calls']:.0f} decoder calls × {r['weight_bytes'] / 1e6:.0f} MB of "
        f"weights / {bandwidth:.1f} GB/s = {bound:.1f} s ({100 * bound / gen['seconds']:.0f}% of the measured "
        f"generation time)"
    )


if __name__ == "__main__":
    main()
