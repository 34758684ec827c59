"""TRL's GRPOTrainer against `mhgpo train --system llm --algo grpo` on the same single-agent job, side by side.

Both sides train the same model (default: the packaged SmolLM2-135M-Instruct GGUF, loaded by mhgpo's loader for
both) on the same prompts (the single-agent prompt of `--system llm` rendered with mhgpo's chat template, for the
first synthetic dev questions), with the same number of questions per step, generations per question (G), new
tokens, sampling (temperature 1, top-p 0.9), LoRA (r, alpha, dropout 0, every linear projection of the decoder),
learning rate (constant, no warm-up), KL coefficient β, clip range 0.2, gradient clipping 1.0, gradient
checkpointing on, one optimiser step per step, and the same reward (F1 of the answer against the gold answers,
with mhgpo's penalty for an answer over `search.max_answer_words` words). Precision: mhgpo's `precision=auto` as
resolved on this machine; TRL with `bf16=True` (its own default, autocast) where that is bf16-mixed, else fp32, and
the frozen base stored in the same dtype on both sides. TRL runs on the CPU as its docs describe (`use_cpu=True`,
no vLLM), with its own defaults otherwise (loss `dapo`, group-scaled rewards); every setting that differs is
printed. Both processes run with the allocator settings of the `mhgpo` command (`mhgpo.model.allocator`).

Each side runs in its own process; the parent prints per side: seconds per step (mean over the steps after the
first; both sides' first step is printed apart), tokens generated per second of generation, tokens trained
(prompt + completion of every trained sample) per second of step, and the process's peak RSS (`wait4`), plus the
mean prompt and completion lengths (the same prompts give the same prompt lengths).

Needs the optional extra: `pip install -e '.[bench]'` (TRL).

    python benchmarks/bench_trl.py [--model smollm2-135m] [--steps 4] [--questions 4] [--group 4]
        [--max-new-tokens 24] [--lr 1e-4] [--beta 0.001] [--lora-r 16] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ALPHA_PER_R = 2  # LoRA alpha = 2 r, mhgpo's default ratio (r 16, alpha 32)


def run_mhgpo(args: argparse.Namespace) -> dict[str, Any]:
    """`mhgpo train --system llm --algo grpo` in a child process, its figures read from the run directory."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "mhgpo",
            "train",
            "--system",
            "llm",
            "--algo",
            "grpo",
            "--model",
            args.model,
            "data=synthetic:dev",
            f"steps={args.steps}",
            f"questions_per_step={args.questions}",
            f"group_size={args.group}",
            f"search.answerer.max_new_tokens={args.max_new_tokens}",
            "search.answerer.temperature=1.0",
            "search.answerer.top_p=0.9",
            f"lora.r={args.lora_r}",
            f"lora.alpha={ALPHA_PER_R * args.lora_r}",
            "lora.dropout=0.0",
            f"optim.lr={args.lr}",
            f"optim.kl_beta={args.beta}",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "optim.clip_eps=0.2",
            "optim.max_grad_norm=1.0",
            "optim.ppo_epochs=1",
            "optim.gradient_checkpointing=true",
            "eval_every=0",
            "save_every=0",
            "warm_start.enabled=false",
            f"output_dir={run_dir}/run",
        ]
        peak_kb, wall = _child(cmd, args)
        run = Path(run_dir) / "run"
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        config = (run / "config.yaml").read_text()
        per_step = []
        for i, row in enumerate(steps, 1):
            nodes = [json.loads(line) for line in (run / "rollouts" / f"step_{i:06d}.jsonl").read_text().splitlines()]
            llm = [n for n in nodes if n["kind"] == "llm"]
            trained = [n for n in llm if n["trained"]]
            per_step.append(
                {
                    "seconds": row["seconds/rollout"] + row["seconds/train"],
                    "gen_seconds": row["seconds/rollout"],
                    "generated": sum(n["output_tokens"] for n in llm),
                    "trained": sum(n["prompt_tokens"] + n["output_tokens"] for n in trained),
                    "prompt": [n["prompt_tokens"] for n in llm],
                    "completion": [n["output_tokens"] for n in llm],
                    "questions": list(dict.fromkeys(n["question"] for n in llm if "question" in n)),
                }
            )
    precision = next(line.split(":", 1)[1].strip() for line in config.splitlines() if line.startswith("precision:"))
    return {"side": "mhgpo", "steps": per_step, "peak_kb": peak_kb, "wall": wall, "precision": precision}


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer in this process (the child), timed by step and by generation."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mhgpo.config import LoraConfig as MhgpoLora
    from mhgpo.config import SearchConfig
    from mhgpo.data.metrics import score
    from mhgpo.model.allocator import keep_freed_memory
    from mhgpo.model.precision import resolve_precision, weight_dtype
    from mhgpo.model.pretrained import encode_chat
    from mhgpo.model.trained import load_model
    from mhgpo.team.build import load_examples
    from mhgpo.team.search_system import LLM, LLMOnly, parse_answer
    from mhgpo.team.workflow import State

    keep_freed_memory()  # the allocator settings the mhgpo command runs with, so that both sides have them
    precision, _ = resolve_precision("auto")
    questions = json.loads(Path(args.trl_side).read_text())  # mhgpo's questions, in the order it drew them
    examples = {e.question: e for e in load_examples("synthetic:dev")}
    workflow = LLMOnly(SearchConfig())
    loaded = load_model(args.model, dtype=weight_dtype(precision, trainable=False))
    if getattr(loaded.model, "hf_quantizer", None) is not None:
        # A GGUF checkpoint keeps its packed weights frozen under the adapters, as in mhgpo; the Trainer refuses a
        # model whose quantizer does not declare training support, although only the adapters train.
        loaded.model.hf_quantizer, loaded.model.is_quantized = None, False
    tokenizer = loaded.tokenizer
    prompts = [
        tokenizer.decode(encode_chat(tokenizer, workflow.build_prompt(State(example=examples[q]), LLM)))
        for q in questions
    ]
    config = workflow.config
    data = Dataset.from_dict({"prompt": prompts, "answers": [list(examples[q].answers) for q in questions]})

    def reward(completions: list[str], answers: list[list[str]], **_: Any) -> list[float]:
        out = []
        for text, gold in zip(completions, answers):
            answer, long = parse_answer(text, config.max_answer_words)
            out.append(score(answer, gold)["f1"] + (config.answerer_penalty if long else 0.0))
        return out

    with tempfile.TemporaryDirectory() as out_dir:
        grpo = GRPOConfig(
            output_dir=out_dir,
            use_cpu=True,
            bf16=precision == "bf16-mixed",
            fp16=False,
            max_steps=args.steps,
            per_device_train_batch_size=args.questions * args.group,
            gradient_accumulation_steps=1,
            num_generations=args.group,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=0.9,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            beta=args.beta,
            epsilon=0.2,
            max_grad_norm=1.0,
            num_iterations=1,
            gradient_checkpointing=True,
            shuffle_dataset=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_dropout=True,
            seed=0,
            dataloader_num_workers=0,
        )
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=ALPHA_PER_R * args.lora_r,
            lora_dropout=0.0,
            target_modules=list(MhgpoLora().target_modules),
            task_type="CAUSAL_LM",
        )
        steps: list[dict[str, Any]] = []

        class Timed(GRPOTrainer):
            def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                out = super()._generate_single_turn(*a, **k)
                steps[-1]["gen_seconds"] += time.perf_counter() - t
                steps[-1]["completion"] += [len(c) for c in out[0]]
                return out

            def _generate_and_score_completions(self, inputs: Any) -> Any:
                out = super()._generate_and_score_completions(inputs)
                prompt, completion = out["prompt_mask"].sum(1), out["completion_mask"].sum(1)
                steps[-1]["prompt"] += [int(p) for p in prompt]
                steps[-1]["trained"] += int(prompt.sum() + completion.sum())
                return out

        class StepClock(TrainerCallback):
            def on_step_begin(self, *a: Any, **k: Any) -> None:
                steps.append(
                    {"start": time.perf_counter(), "gen_seconds": 0.0, "completion": [], "prompt": [], "trained": 0}
                )

            def on_step_end(self, *a: Any, **k: Any) -> None:
                steps[-1]["seconds"] = time.perf_counter() - steps[-1].pop("start")

        trainer = Timed(
            model=loaded.model,
            reward_funcs=reward,
            args=grpo,
            train_dataset=data,
            processing_class=tokenizer,
            peft_config=lora,
            callbacks=[StepClock()],
        )
        trainer.train()
        stored = next(p for p in trainer.model.parameters() if not p.requires_grad).dtype
    for s in steps:
        s["generated"] = sum(s["completion"])
    return {
        "side": "trl",
        "steps": steps,
        "precision": precision,
        "threads": torch.get_num_threads(),
        "base_dtype": str(stored),
        "loss_type": grpo.loss_type,
        "scale_rewards": str(grpo.scale_rewards),
    }


def _child(cmd: list[str], args: argparse.Namespace) -> tuple[int, float]:
    """Run ``cmd``; return its peak RSS in KiB and wall seconds (exit on failure, with its stderr's end)."""
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if proc.returncode:
            err.seek(0)
            sys.exit(f"{' '.join(cmd[:5])} ... failed:\n{err.read()[-4000:]}")
    return usage.ru_maxrss, wall


def _row(name: str, r: dict[str, Any]) -> str:
    steps = r["steps"][1:] or r["steps"]
    step_s = sum(s["seconds"] for s in steps) / len(steps)
    gen_s = sum(s["gen_seconds"] for s in steps)
    generated = sum(s["generated"] for s in steps)
    trained = sum(s["trained"] for s in steps)
    prompts = [p for s in r["steps"] for p in s["prompt"]]
    completions = [c for s in r["steps"] for c in s["completion"]]
    return (
        (
            f"| {name} | {r['steps'][0]['seconds']:.1f} | {step_s:.1f} | {generated / gen_s:.0f} | "
            f"{trained / sum(s['seconds'] for s in steps):.0f} | {r['peak_kb'] / 1024:.0f} | "
            f"{sum(prompts) / len(prompts):.1f} | {sum(completions) / len(completions):.1f} |"
        ),
        step_s,
        trained / sum(s["seconds"] for s in steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--questions", type=int, default=4, help="questions (prompts) per step")
    parser.add_argument("--group", type=int, default=4, help="generations per question (G)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.001, help="KL coefficient")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of both children")
    parser.add_argument("--trl-side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_side:  # the questions come in this file, the figures go back in it
        result = run_trl(args)
        Path(args.trl_side).write_text(json.dumps(result))
        return
    try:
        import trl
    except ImportError:
        sys.exit("bench_trl.py needs TRL: pip install -e '.[bench]'")
    passed = [
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--questions",
        str(args.questions),
        "--group",
        str(args.group),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--lr",
        str(args.lr),
        "--beta",
        str(args.beta),
        "--lora-r",
        str(args.lora_r),
    ]
    mine = run_mhgpo(args)
    print(f"mhgpo: done in {mine['wall']:.0f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "trl.json"
        result.write_text(json.dumps([q for s in mine["steps"] for q in s["questions"]]))
        peak_kb, wall = _child([sys.executable, __file__, *passed, "--trl-side", str(result)], args)
        theirs = json.loads(result.read_text())
    theirs["peak_kb"] = peak_kb
    print(f"TRL: done in {wall:.0f} s", flush=True)
    print(
        f"\nSingle-agent GRPO, {args.model}, {args.steps} steps × {args.questions} questions × G = {args.group}, "
        f"{args.max_new_tokens} new tokens, LoRA r{args.lora_r} alpha {ALPHA_PER_R * args.lora_r} on every "
        f"linear projection, lr {args.lr} constant, β {args.beta}, precision {mine['precision']} (TRL: bf16="
        f"{theirs['precision'] == 'bf16-mixed'}, frozen base {theirs['base_dtype']}), "
        f"{theirs['threads']} thread(s); TRL {trl.__version__}\n"
    )
    print(
        "| trainer | first step s | s/step | tokens generated/s | tokens trained/s | peak RSS MB | "
        "prompt tokens | completion tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    row_m, step_m, rate_m = _row("mhgpo train --system llm --algo grpo", mine)
    row_t, step_t, rate_t = _row(f"TRL GRPOTrainer {trl.__version__}", theirs)
    print(row_m)
    print(row_t)
    print(
        f"\nmhgpo / TRL: {step_t / step_m:.2f}× faster per step, {rate_m / rate_t:.2f}× the tokens trained per "
        f"second (s/step and rates: mean over steps 2..{args.steps}; generation: TRL's generate calls, mhgpo's "
        f"rollout phase)"
    )
    print(
        "\nSettings that differ: TRL's loss is its default "
        f"`{theirs['loss_type']}` with rewards scaled `{theirs['scale_rewards']}` (mhgpo: its GRPO loss, "
        "group-normalised advantages, step-wide token weights); TRL computes the reference log-probs in its "
        "generation phase and mhgpo in its update; TRL samples through `generate`'s own top-p warper, mhgpo through "
        "its logits processor; mhgpo splits the update into micro-batches of `optim.micro_batch_tokens`, TRL "
        "trains the step's completions as one batch."
    )


if __name__ == "__main__":
    main()
