"""The training commands of the CLI: `mhgpo train` and `mhgpo demo`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mhgpo.cli.common import TRUST_HELP, add_common_flags, flag_overrides
from mhgpo.config import demo_config_path
from mhgpo.config.choices import ALGOS, SAMPLERS
from mhgpo.config.experiments import SCALES, scaled_tree

TRAIN_FLAGS = {
    "sampler": "sampler",
    "steps": "steps",
    "questions_per_step": "questions_per_step",
    "group_size": "group_size",
    "model": "model",
    "data": "data",
    "seed": "seed",
    "output_dir": "output_dir",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "index": "retrieval.index",
    "system": "system",
    "algo": "algo",
}


def _overrides(args: argparse.Namespace) -> list[str]:
    return flag_overrides(args, TRAIN_FLAGS) + list(args.overrides)


def cmd_train(args: argparse.Namespace) -> int:
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.errors import InputError
    from mhgpo.run.pipeline import resume, train

    if args.from_step is not None and not args.resume:
        raise InputError("--from-step: only with --resume RUN_DIR")
    if args.resume:
        trainer = resume(Path(args.resume), _overrides(args), from_step=args.from_step, trust_code=args.trust_code)
    elif getattr(args, "scale", None):  # the row's switches at a smaller scale (mhgpo/config/experiments.py)
        cfg = load_config(TrainConfig, None, _overrides(args), base=scaled_tree(args.config, args.scale))
        trainer = train(cfg)
    else:
        cfg = load_config(TrainConfig, args.config, _overrides(args))
        trainer = train(cfg)
    trainer.ranks.close()  # a data-parallel run: every rank got here (a failure raises before)
    if not trainer.ranks.is_main:  # rank 0 reports
        return 0
    print(f"finished {trainer.step} steps; run directory: {trainer.run_dir}")
    if trainer.val_history:
        last = trainer.val_history[-1]
        print(f"val F1 {last['val/f1']:.1f}  EM {last['val/em']:.1f}  Acc {last['val/acc']:.1f} (step {last['step']})")
    return 0


SFT_FLAGS = {
    "steps": "steps",
    "batch_size": "batch_size",
    "model": "model",
    "data": "data",
    "seed": "seed",
    "output_dir": "output_dir",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "index": "retrieval.index",
    "system": "system",
}


def cmd_sft(args: argparse.Namespace) -> int:
    """Supervised warm start of every role on its gold outputs (`mhgpo/rl/sft.py`)."""
    from mhgpo.config import SFTConfig, load_config
    from mhgpo.errors import InputError
    from mhgpo.run.warm_start import resume_sft, run_sft

    overrides = flag_overrides(args, SFT_FLAGS) + list(args.overrides)
    if args.from_step is not None and not args.resume:
        raise InputError("--from-step: only with --resume RUN_DIR")
    if args.resume:
        trainer = resume_sft(Path(args.resume), overrides, from_step=args.from_step, trust_code=args.trust_code)
    else:
        trainer = run_sft(load_config(SFTConfig, args.config, overrides))
    print(
        f"finished {trainer.step} steps; run directory: {trainer.run_dir} (start from it with --model "
        f"{trainer.run_dir})"
    )
    if trainer.val_history:
        last = trainer.val_history[-1]
        print(f"val F1 {last['val/f1']:.1f}  EM {last['val/em']:.1f}  Acc {last['val/acc']:.1f} (step {last['step']})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Evaluate the untrained team on the dev set, train with MHGPO (RR), evaluate again, compare."""
    from mhgpo.config import TrainConfig, is_custom, load_config
    from mhgpo.errors import InputError
    from mhgpo.run.rundir import RunLock, require_empty_run_dir

    cfg = load_config(TrainConfig, args.config or demo_config_path(), _overrides(args))
    if is_custom(cfg.system):
        raise InputError(
            f"system: mhgpo demo runs the built-in team; train {cfg.system} with `mhgpo train --system {cfg.system}`"
        )
    run_dir = Path(cfg.output_dir)
    require_empty_run_dir(run_dir)
    with RunLock(run_dir, "demo"):
        require_empty_run_dir(run_dir)
        return _demo(cfg, run_dir)


def _demo(cfg, run_dir: Path) -> int:
    """The untrained team's validation; the warm start (when `warm_start.enabled`) and the warm-started team's
    validation; MHGPO; the trained team's validation; a table of the three and a report."""
    from rich.console import Console

    from mhgpo.config import dump_config
    from mhgpo.model.distributed import Single
    from mhgpo.model.trained import portable_model_spec
    from mhgpo.rl.evaluation import metrics_table, write_eval
    from mhgpo.rl.trainer import Trainer, build_team, check_engine
    from mhgpo.run.pipeline import evaluate_model, warm_start

    check_engine(cfg, Single())  # generation.engine=vllm without vLLM: said before the untrained team's evaluation
    console = Console(highlight=False)
    cfg.model = portable_model_spec(cfg.model, run_dir)
    started = time.perf_counter()
    algo = f"MHGPO-{cfg.sampler.upper()}" if cfg.algo == "mhgpo" else cfg.algo.upper()
    warm = f"a warm start of {cfg.warm_start.steps} steps, then " if cfg.warm_start.enabled else ""
    console.print(
        f"[bold]mhgpo demo[/]: {warm}{algo} on {cfg.data}, model {cfg.model}, {cfg.steps} steps × "
        f"{cfg.questions_per_step} questions, G={cfg.group_size}; run dir {run_dir}"
    )
    dump_config(cfg, run_dir / "config.yaml")
    rows: dict[str, dict] = {}
    before = evaluate_model(cfg, run_dir, desc="eval untrained")
    write_eval(before, run_dir / "eval_before", {"data": cfg.val_data, "model": cfg.model, "label": "untrained"})
    rows["untrained team"] = before.metrics
    console.print(metrics_table({"untrained team": before.metrics}))
    if cfg.warm_start.enabled:
        cfg.model = warm_start(cfg, run_dir)
    with console.status("loading the model, data and index ..."):
        setup = build_team(cfg, with_val=True)
    trainer = Trainer(cfg, setup, run_dir)
    if cfg.warm_start.enabled:  # the RL team before its first update: the warm-started team
        warmed = trainer.validate(desc="eval warm start")
        write_eval(
            warmed, run_dir / "eval_warm_start", {"data": cfg.val_data, "model": cfg.model, "label": "warm start"}
        )
        rows[f"warm start ({cfg.warm_start.steps} steps)"] = warmed.metrics
        console.print(metrics_table({"warm start": warmed.metrics}))
    trainer.run()
    if trainer.last_eval is not None and trainer.last_eval[0] == cfg.steps:  # validated on the last step
        after = trainer.last_eval[1]
    else:
        after = trainer.validate(desc="eval after")
    write_eval(after, run_dir / "eval_after", {"data": cfg.val_data, "model": cfg.model, "label": "trained"})
    rows[f"{'+ ' if cfg.warm_start.enabled else 'after '}{algo} ({cfg.steps} steps)"] = after.metrics
    console.print(metrics_table(rows, title=f"{cfg.val_data}, {len(setup.val)} questions"))
    _print_behaviour(console, rows)
    from mhgpo.run.report import build_report

    report = build_report([run_dir], run_dir / "report")
    console.print(f"report: {report} and {report.with_suffix('.html')}")
    console.print(
        f"total {(time.perf_counter() - started) / 60:.1f} min; run directory {run_dir} "
        f"(metrics.jsonl, rollouts/, checkpoints/, eval_*/)"
    )
    return 0


def _print_behaviour(console, rows: dict[str, dict]) -> None:
    from rich.table import Table

    first = next(iter(rows.values()))
    keys = [k for k in first if "/" in k and all(k in m for m in rows.values())]
    table = Table(title="agent behaviour (dev set)")
    table.add_column("")
    for name in rows:
        table.add_column(name, justify="right")
    for k in keys:
        table.add_row(k, *(f"{m[k]:.2f}" for m in rows.values()))
    console.print(table)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the training sub-commands on the `mhgpo` parser."""
    sft = sub.add_parser("sft", help="supervised warm start: every role learns its gold outputs (then --model DIR)")
    sft.add_argument("--steps", type=int)
    sft.add_argument("--batch-size", type=int, help="demonstrations per optimiser step")
    sft.add_argument("--data", help="synthetic:train (default), hotpotqa:PATH, 2wiki:PATH, musique:PATH")
    sft.add_argument("--seed", type=int)
    sft.add_argument("--output-dir", help="the run directory")
    sft.add_argument("--resume", metavar="RUN_DIR", help="continue the warm start in RUN_DIR from its last checkpoint")
    sft.add_argument("--from-step", type=int, metavar="N", help="with --resume: continue from step N's checkpoint")
    sft.add_argument("--trust-code", action="store_true", help=TRUST_HELP)
    add_common_flags(sft)
    sft.set_defaults(func=cmd_sft)
    for name, func, help_text in (
        (
            "train",
            cmd_train,
            "train the team (or --system FILE.py:Class, a team of your own) with MHGPO, or a "
            "baseline: --algo mappo, --system llm --algo grpo|ppo",
        ),
        ("demo", cmd_demo, "evaluate, train with MHGPO (RR) on CPU, evaluate again (the embedded default)"),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--sampler",
            choices=SAMPLERS,
            help="rollout sampler (default: rr for mhgpo, fof for grpo, chains for mappo/ppo)",
        )
        p.add_argument("--steps", type=int)
        p.add_argument("--questions-per-step", type=int)
        p.add_argument("--group-size", type=int)
        p.add_argument("--data", help="synthetic:train (default) or hotpotqa:PATH")
        p.add_argument("--seed", type=int)
        p.add_argument("--output-dir", help="the run directory")
        if name == "train":
            p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
            p.add_argument(
                "--from-step",
                type=int,
                metavar="N",
                help="with --resume: continue from the checkpoint of step N (later ones are set aside)",
            )
            p.add_argument("--trust-code", action="store_true", help=TRUST_HELP)
            p.add_argument(
                "--algo", choices=ALGOS, help="mhgpo (default) or mappo for the team; grpo or ppo with --system llm"
            )
            p.add_argument(
                "--scale",
                choices=SCALES,
                help="run the --config row with the demo's model, data, steps, batch, tokens and LoRA",
            )
        add_common_flags(p)
        p.set_defaults(func=func)
