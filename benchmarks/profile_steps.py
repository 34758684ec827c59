"""Where the CPU seconds of a training step go: the warm start's supervised step and the RL step, by phase.

Both steps run with the demo's settings (`mhgpo/config/demo.yaml`, seed 0): the warm-start step (`mhgpo/rl/sft.py`: 16
demonstrations, one optimiser step) and the RL step (`mhgpo/rl/trainer.py`, MHGPO-IS, 4 questions, G = 4, no warm
start before it, as in `roofline.py`: the rollouts through `mhgpo/model/generation.py`, then `Policy.update`), each in
a process of its own per precision (`--precisions`, default fp32 and bf16-mixed). Timers around the phases (no
profiler, whose per-operator cost would swamp decoding's small operators) split each step into exclusive shares: a
phase inside another is taken out of it. The timers wrap what every version of mhgpo has (the model's modules,
`Tensor.backward`, the optimiser, the generator's prefill and decoding, the policy's reference pass, the encoder and
the tools), so the same script profiles another checkout:

- rollouts: prefill (the prompts' KV caches), decoding (the decoder over the new tokens; its LM head apart),
  sampling (the rest of decoding: softmax, top-p, the draw, dropping finished rows), tokenisation (chat prompts
  encoded, outputs decoded), tools (retrieval), the rest of the rollout (workflow, prompts, rewards, Python);
- update (and the warm start's step): the reference pass (the adapter off, no gradient; its LM head apart), the
  forward (the decoder), LM head and loss (the LM head, log-softmax and the objective at the output positions), the
  backward, the gradient-checkpointing recomputation (decoder layers run again inside the backward), the LM head's
  recomputation inside the backward, the optimiser (gradient clipping and the step), the rest (packing, Python).

Each phase's CPU seconds are the process's (all threads, `time.process_time`), so other jobs on a shared machine
move them less than wall seconds. A table per step kind and precision: seconds per step and share of the step. With
`--ref DIR` the same runs are made with another checkout's `mhgpo` (its path put first on `PYTHONPATH`), the two
alternating (ref, this, ref, this... for `--repeats`), and the table gives both, medians over the repeats, with the
ratio of CPU seconds per step, and each step's metrics (loss, KL, grad norm, rewards...) and a fingerprint of the
trained weights side by side: what a change of speed must keep.

    python benchmarks/profile_steps.py [--threads 2] [--precisions fp32,bf16-mixed] [--kinds sft,rl]
        [--sft-steps 3] [--rl-steps 2] [--repeats 1] [--ref DIR] [--out DIR] [key=value ...]

`--out DIR` writes `profile_steps.json` (every run) and `profile_steps.md` (the tables) there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROLLOUT_PHASES = ("prefill", "decoding", "decoding: LM head", "sampling", "tokenisation", "tools", "rollout: rest")
UPDATE_PHASES = (
    "reference pass",
    "reference pass: LM head",
    "forward",
    "LM head and loss",
    "backward",
    "checkpointing recomputation",
    "LM head recomputation",
    "optimiser",
    "update: rest",
)
PHASES = ROLLOUT_PHASES + UPDATE_PHASES
METRICS = {  # the metrics shown side by side (when a step has them)
    "rl": ("reward/mean", "loss", "kl", "grad_norm", "ratio", "clip_fraction", "tokens_generated", "samples"),
    "sft": ("loss", "grad_norm", "sft/rewriter/nll", "sft/reranker/nll", "sft/answerer/nll"),
}


class Phases:
    """Exclusive CPU and wall seconds per phase: entering a phase stops the clock of the one it is inside."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []  # [name, cpu at (re)start, wall at (re)start]

    @property
    def current(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    def _charge(self) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        if self.stack:
            name, c, w = self.stack[-1]
            self.cpu[name] += cpu - c
            self.wall[name] += wall - w
        return cpu, wall

    @contextmanager
    def phase(self, name: str | None) -> Iterator[None]:
        if name is None or name == self.current:
            yield
            return
        self.stack.append([name, *self._charge()])
        try:
            yield
        finally:
            self._charge()
            self.stack.pop()
            if self.stack:
                self.stack[-1][1:] = [time.process_time(), time.perf_counter()]

    def wrap(self, fn: Callable, name: str | Callable[[str | None], str | None]) -> Callable:
        """`fn` timed as phase `name` (or the name `name(current phase)` gives; None: the current phase)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name(self.current) if callable(name) else name):
                return fn(*args, **kwargs)

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def reset(self) -> None:
        self.cpu.clear()
        self.wall.clear()


def _backbone_name(current: str | None) -> str | None:
    if current in ("reference pass", "prefill", "decoding"):
        return None  # the decoder inside those phases is those phases
    return "forward"  # the update's forward (the policy's log-probs)


def _head_name(current: str | None) -> str | None:
    return {
        "decoding": "decoding: LM head",
        "reference pass": "reference pass: LM head",
        "backward": "LM head recomputation",
        "prefill": None,
    }.get(current or "", "LM head and loss")


def _layer_name(current: str | None) -> str | None:
    return "checkpointing recomputation" if current in ("backward", "LM head recomputation") else None


def instrument(phases: Phases, policy: Any, generator: Any, setup: Any, trainer: Any) -> None:
    """Wrap the step's pieces in `phases`' timers (see the module's docstring)."""
    import torch

    from mhgpo.model import generation
    from mhgpo.model.logprobs import backbone_and_head

    backbone, head = backbone_and_head(policy.model)
    backbone.forward = phases.wrap(backbone.forward, _backbone_name)
    head.forward = phases.wrap(head.forward, _head_name)
    layer = backbone.layers[0]  # what a checkpointed decoder layer runs again: its norms, attention and MLP
    for part in dict.fromkeys(type(m) for m in (layer.input_layernorm, layer.self_attn, layer.mlp)):
        part.forward = phases.wrap(part.forward, _layer_name)
    torch.Tensor.backward = phases.wrap(torch.Tensor.backward, "backward")
    policy.optimizer.step = phases.wrap(policy.optimizer.step, "optimiser")
    import mhgpo.rl.policy as policy_module

    policy_module.clip_grad_norm = phases.wrap(policy_module.clip_grad_norm, "optimiser")
    torch.nn.utils.clip_grad_norm_ = phases.wrap(torch.nn.utils.clip_grad_norm_, "optimiser")
    policy.reference_logprobs = phases.wrap(policy.reference_logprobs, "reference pass")
    policy.loss = phases.wrap(policy.loss, "LM head and loss")
    import mhgpo.model.logprobs as logprobs_module
    import mhgpo.rl.sft as sft_module

    sft_module.sft_loss = phases.wrap(sft_module.sft_loss, "LM head and loss")
    if hasattr(logprobs_module, "_token_logprobs"):  # the LM head's log-softmax at the output positions
        logprobs_module._token_logprobs = phases.wrap(logprobs_module._token_logprobs, _head_name)
    generation.prefill = phases.wrap(generation.prefill, "prefill")
    if hasattr(generator, "_decode"):
        generator._decode = phases.wrap(generator._decode, "sampling")
        model = generator.model
        model.forward = phases.wrap(model.forward, lambda c: "decoding" if c == "sampling" else None)
    generator.tokenizer.decode = phases.wrap(generator.tokenizer.decode, "tokenisation")
    setup.encode = phases.wrap(setup.encode, "tokenisation")
    setup.workflow.call_tools = phases.wrap(setup.workflow.call_tools, "tools")
    trainer.collect = phases.wrap(trainer.collect, "rollout: rest")
    trainer.learn = phases.wrap(trainer.learn, "update: rest")


def fingerprint(params: list[Any]) -> str:
    """A hash of the trained weights' bytes (equal only when every bit is)."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One process's runs: `spec["kind"]` steps (sft or rl) in `spec["precision"]`."""
    import resource

    import torch

    from mhgpo.model.allocator import keep_freed_memory

    keep_freed_memory()  # as the mhgpo command does
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.run.setup import build_sft, build_training, settle

    with tempfile.TemporaryDirectory() as run_dir:
        base = [
            "eval_every=0",
            "save_every=0",
            "report_to=[]",
            f"output_dir={run_dir}/run",
            f"precision={spec['precision']}",
            *spec["overrides"],
        ]
        if spec["kind"] == "sft":
            from mhgpo.rl.sft import SFTTrainer
            from mhgpo.run.pipeline import warm_start_config

            cfg = load_config(TrainConfig, demo_config_path(), base)
            sft_cfg = warm_start_config(cfg, Path(run_dir) / "warm_start")
            job = settle(sft_cfg)
            setup, demos, held, skipped = build_sft(job)
            trainer: Any = SFTTrainer(job.cfg, setup, job.run_dir, demos, held, progress=False, skipped=skipped)
            steps = spec["sft_steps"]
        else:
            from mhgpo.rl.trainer import Trainer

            cfg = load_config(TrainConfig, demo_config_path(), [*base, "warm_start.enabled=false"])
            job = settle(cfg)
            setup = build_training(job)
            trainer = Trainer(job.cfg, setup, job.run_dir, progress=False)
            steps = spec["rl_steps"]
        phases = Phases()
        instrument(phases, setup.policy, setup.generator, setup, trainer)
        per_step = []
        for _ in range(steps):
            phases.reset()
            cpu, wall = time.process_time(), time.perf_counter()
            _, samples, metrics = trainer.collect()
            metrics = trainer.learn(samples, metrics)
            trainer.step += 1
            per_step.append(
                {
                    "cpu": time.process_time() - cpu,
                    "wall": time.perf_counter() - wall,
                    "phases_cpu": dict(phases.cpu),
                    "phases_wall": dict(phases.wall),
                    "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                    "tokens": sum(len(s.prompt_ids) + len(s.output_ids) for s in samples if s.output_ids),
                }
            )
        return {
            "kind": spec["kind"],
            "precision": job.cfg.precision,
            "tree": spec["tree"],
            "threads": torch.get_num_threads(),
            "steps": per_step,
            "weights": fingerprint(setup.policy.params),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "settings": f"gradient checkpointing {job.cfg.optim.gradient_checkpointing}, micro_batch_tokens "
            f"{job.cfg.optim.micro_batch_tokens}",
        }


def commit_of(root: Path) -> str:
    """The checkout's commit (short), with ``+`` when its files differ from it; ``?`` outside git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True, text=True
        )
    except OSError:
        return "?"
    return (head.stdout.strip() or "?") + ("+" if dirty.stdout.strip() else "")


def run_child(tree: str | None, spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` in a process of its own, with the `mhgpo` of checkout `tree` (None: this one)."""
    env = dict(os.environ)
    root = Path(tree).resolve() if tree else Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    spec = {**spec, "tree": commit_of(root)}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"the run {spec} failed ({done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeated runs of one tree, kind and precision: CPU and wall seconds per step (means over the
    run's steps) and per phase."""
    per_run = []
    for r in runs:
        n = len(r["steps"])
        per_run.append(
            {
                "cpu": sum(s["cpu"] for s in r["steps"]) / n,
                "wall": sum(s["wall"] for s in r["steps"]) / n,
                **{p: sum(s["phases_cpu"].get(p, 0.0) for s in r["steps"]) / n for p in PHASES},
            }
        )
    return {k: statistics.median(x[k] for x in per_run) for k in per_run[0]}


def profile_table(label: str, kind: str, precision: str, columns: dict[str, dict[str, Any]]) -> list[str]:
    """The per-phase markdown table of one kind and precision, one column pair (s, share) per tree."""
    names = list(columns)
    head = " | ".join(f"{n} CPU s | {n} share" for n in names)
    lines = [
        f"\n{label}: {'warm-start step' if kind == 'sft' else 'RL step'}, {precision}, CPU seconds per step "
        f"(medians of the runs' per-step means)\n",
        f"| phase | {head} |",
        "|---|" + "---|---|" * len(names),
    ]
    phases = UPDATE_PHASES if kind == "sft" else PHASES
    for p in phases:
        if all(columns[n][p] < 0.005 for n in names):
            continue
        cells = " | ".join(f"{columns[n][p]:.2f} | {100 * columns[n][p] / columns[n]['cpu']:.0f}%" for n in names)
        lines.append(f"| {p} | {cells} |")
    total = " | ".join(f"**{columns[n]['cpu']:.2f}** | 100%" for n in names)
    lines.append(f"| step (CPU) | {total} |")
    lines.append("| step (wall) | " + " | ".join(f"{columns[n]['wall']:.2f} | " for n in names) + "|")
    return lines


def metrics_table(kind: str, precision: str, runs: dict[str, dict[str, Any]]) -> list[str]:
    """Each step's metrics and the trained weights' fingerprint, one column per tree (the first run of each)."""
    names = list(runs)
    lines = [
        f"\nmetrics, {'warm-start' if kind == 'sft' else 'RL'} steps, {precision}\n",
        "| step | metric | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for i, _ in enumerate(runs[names[0]]["steps"]):
        for key in METRICS[kind]:
            values = [runs[n]["steps"][i]["metrics"].get(key) for n in names]
            if all(v is None for v in values):
                continue
            lines.append(f"| {i + 1} | {key} | " + " | ".join("—" if v is None else f"{v:.9g}" for v in values) + " |")
    lines.append("| end | weights (sha256 of the bytes) | " + " | ".join(runs[n]["weights"] for n in names) + " |")
    lines.append("| end | peak RSS MB | " + " | ".join(f"{runs[n]['peak_rss_mb']:.0f}" for n in names) + " |")
    return lines


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--kinds", default="sft,rl", help="the steps profiled: sft (warm start), rl")
    parser.add_argument("--sft-steps", type=int, default=3, help="warm-start steps per run")
    parser.add_argument("--rl-steps", type=int, default=2, help="RL steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each tree, kind and precision")
    parser.add_argument("--ref", default=None, help="another checkout of mhgpo to run alternately with this one")
    parser.add_argument("--out", default=None, help="a folder for profile_steps.json and profile_steps.md")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (both steps)")
    args = parser.parse_args()
    trees = ([args.ref] if args.ref else []) + [None]
    names = {args.ref: "ref", None: "this"}
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for kind in args.kinds.split(","):
            for precision in args.precisions.split(","):
                for tree in trees:  # alternating: ref, this, ref, this...
                    spec = {
                        "kind": kind,
                        "precision": precision,
                        "threads": args.threads,
                        "sft_steps": args.sft_steps,
                        "rl_steps": args.rl_steps,
                        "overrides": args.overrides,
                    }
                    r = run_child(tree, spec)
                    r["name"], r["repeat"] = names[tree], repeat
                    results.append(r)
                    step_cpu = [round(s["cpu"], 1) for s in r["steps"]]
                    print(f"[{repeat}] {names[tree]} {kind} {r['precision']}: CPU s per step {step_cpu}", flush=True)
    lines = [
        f"profile_steps.py: {args.threads or 'default'} thread(s), demo settings, seed 0; "
        + " and ".join(
            f"{args.sft_steps} warm-start step(s)" if k == "sft" else f"{args.rl_steps} RL step(s)"
            for k in args.kinds.split(",")
        )
        + f" per run, {args.repeats} run(s) each"
        + (f"; ref = commit {results[0]['tree']}, this = commit {results[-1]['tree']}" if args.ref else "")
    ]
    for kind in args.kinds.split(","):
        for precision in args.precisions.split(","):
            mine = [r for r in results if r["kind"] == kind and r["precision"] == precision]
            columns = {n: summary([r for r in mine if r["name"] == n]) for n in dict.fromkeys(names[t] for t in trees)}
            lines += profile_table("profile", kind, precision, columns)
            if args.ref:
                ratio = columns["ref"]["cpu"] / columns["this"]["cpu"]
                wall = columns["ref"]["wall"] / columns["this"]["wall"]
                lines.append(f"\nref / this, CPU seconds per step: **{ratio:.2f}×** (wall: {wall:.2f}×)")
            first = {n: next(r for r in mine if r["name"] == n) for n in columns}
            settings = ", ".join(f"{n}: {first[n]['settings']}" for n in first)
            lines.append(f"\nsettings: {settings}")
            lines += metrics_table(kind, precision, first)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_steps.json").write_text(json.dumps(results, indent=1))
        (out / "profile_steps.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
