"""The training commands of the CLI: `mhgpo train` and `mhgpo demo`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mhgpo.cli.common import ROW_CONFIG_HELP, SCALE_HELP, TRUST_HELP, add_common_flags, flag_overrides
from mhgpo.config import demo_config_path
from mhgpo.config.samplers import train_samplers
from mhgpo.config.tables import ALGORITHMS, algo_label

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


def train_config(args: argparse.Namespace):
    """The config `mhgpo train` runs: `--config FILE` (or a row of a table of rows, `--config ROWS.yaml:ROW`, at
    `--scale NAME`; mhgpo/config/rows.py) with the flags and `key=value` overrides last."""
    from mhgpo.config import TrainConfig, load_config
    from mhgpo.config.rows import row_spec
    from mhgpo.errors import InputError

    spec = row_spec(args.config, args.scale)
    if spec is None:
        return load_config(TrainConfig, args.config, _overrides(args))
    table, name = spec
    if not table.row(name).train:
        raise InputError(
            f"{args.config}: row {name} is validated without RL: mhgpo eval --config {args.config}"
            + (f" --scale {args.scale}" if args.scale else "")
        )
    return table.config(name, args.scale, _overrides(args))


def cmd_train(args: argparse.Namespace) -> int:
    from mhgpo.errors import InputError
    from mhgpo.run.pipeline import resume, train

    if args.from_step is not None and not args.resume:
        raise InputError("--from-step: only with --resume RUN_DIR")
    if args.resume:
        trainer = resume(Path(args.resume), _overrides(args), from_step=args.from_step, trust_code=args.trust_code)
    else:
        trainer = train(train_config(args))
    # a data-parallel run: every rank got here (a failure raises before); a separate engine ends before the ranks
    trainer.ranks.close(trainer.setup.generator if trainer.setup.engine_scratch is not None else None)
    if not trainer.ranks.is_main:  # rank 0 reports
        return 0
    if getattr(trainer, "stopped_on_budget", False):  # (a trainer stopped by `budget_minutes`)
        print(
            f"stopped by the time budget after {trainer.step} of {trainer.cfg.steps} steps "
            f"({trainer.budget.describe()} used); run directory: {trainer.run_dir}"
        )
    else:
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
    """Evaluate the untrained team on the dev set, train it (a warm start, then MHGPO-IS in the demo's config),
    evaluate after each stage, compare: the train pipeline with an evaluation between its stages
    (:class:`DemoStages`)."""
    from mhgpo.config import TrainConfig, is_custom, load_config
    from mhgpo.errors import InputError
    from mhgpo.run.pipeline import train

    cfg = load_config(TrainConfig, args.config or demo_config_path(), _overrides(args))
    if is_custom(cfg.system):
        raise InputError(
            f"system: mhgpo demo runs the built-in team; train {cfg.system} with `mhgpo train --system {cfg.system}`"
        )
    stages = DemoStages()
    train(cfg, stages=stages)
    stages.summary()
    return 0


class DemoStages:
    """`mhgpo demo`'s evaluations between the stages of a training run: the untrained team, the warm-started team
    (the RL team before its first update) and the trained team, each validated on `val_data` and written to
    RUN/eval_before, eval_warm_start and eval_after; then a table of the three and the run's report."""

    with_val = True

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self.rows: dict[str, dict] = {}
        self.started = time.perf_counter()
        self.marks: list[tuple[str, float]] = []  # (the stage that just ended, when), in order
        self.job = None

    def mark(self, stage: str) -> None:
        self.marks.append((stage, time.perf_counter()))

    def stages(self, now: float) -> str:
        """Where the demo's minutes went: each stage's, in order, then what is left (loading, the report)."""
        parts, last = [], self.started
        for stage, at in self.marks:
            parts.append(f"{stage} {(at - last) / 60:.1f}")
            last = at
        parts.append(f"the rest {(now - last) / 60:.1f}")
        return ", ".join(parts)

    def before_warm_start(self, job) -> None:
        from mhgpo.model.trained import run_model_spec
        from mhgpo.rl.evaluation import metrics_table, write_eval
        from mhgpo.run.evaluate import evaluate_validation
        from mhgpo.run.setup import initial_model

        self.job, cfg = job, job.cfg
        warm = f"a warm start of {cfg.warm_start.steps} steps, then " if cfg.warm_start.enabled else ""
        base = initial_model(cfg)
        steps = f"{cfg.steps} steps × {cfg.questions_per_step} questions"
        if cfg.budget_minutes is not None:  # `budget_minutes` ends the RL stage first if it runs out first
            clock = {"cpu": "CPU", "wall": "wall-clock"}.get(cfg.budget_clock, cfg.budget_clock)
            steps += f" (fewer if {cfg.budget_minutes:g} {clock} minutes of RL run out first)"
        self.console.print(
            f"[bold]mhgpo demo[/]: {warm}{algo_label(cfg.algo, cfg.sampler)} on {cfg.data}, model {base}, "
            f"{steps}, G={cfg.group_size}; run dir {job.run_dir}"
        )
        before = evaluate_validation(
            cfg, run_model_spec(base, job.run_dir), "eval untrained", workflow=job.team, reason=job.reason
        )
        write_eval(before, job.run_dir / "eval_before", {"data": cfg.val_data, "model": base, "label": "untrained"})
        self.rows["untrained team"] = before.metrics
        self.console.print(metrics_table({"untrained team": before.metrics}))
        self.mark("untrained evaluation")

    def before_rl(self, job, trainer) -> None:
        from mhgpo.rl.evaluation import metrics_table, write_eval

        cfg = job.cfg
        if not cfg.warm_start.enabled:
            return
        self.mark("warm start")
        warmed = trainer.validate(desc="eval warm start")  # the RL team before its first update
        write_eval(
            warmed, job.run_dir / "eval_warm_start", {"data": cfg.val_data, "model": cfg.model, "label": "warm start"}
        )
        self.rows[f"warm start ({cfg.warm_start.steps} steps)"] = warmed.metrics
        self.console.print(metrics_table({"warm start": warmed.metrics}))
        self.mark("its evaluation")

    def after_rl(self, job, trainer) -> None:
        from mhgpo.rl.evaluation import write_eval

        cfg = job.cfg
        if trainer.last_eval is not None and trainer.last_eval[0] == trainer.step:  # validated on the last step
            after = trainer.last_eval[1]
        else:
            after = trainer.validate(desc="eval after")
        write_eval(after, job.run_dir / "eval_after", {"data": cfg.val_data, "model": cfg.model, "label": "trained"})
        stage = "+ " if cfg.warm_start.enabled else "after "
        self.rows[f"{stage}{algo_label(cfg.algo, cfg.sampler)} ({trainer.step} steps)"] = after.metrics
        self.questions = len(trainer.setup.val)
        self.mark(f"{algo_label(cfg.algo, cfg.sampler)} with its evaluation")

    def summary(self) -> None:
        from mhgpo.rl.evaluation import metrics_table
        from mhgpo.run.report import build_report

        cfg, run_dir = self.job.cfg, self.job.run_dir
        self.console.print(metrics_table(self.rows, title=f"{cfg.val_data}, {self.questions} questions"))
        _print_behaviour(self.console, self.rows)
        report = build_report([run_dir], run_dir / "report")
        self.console.print(f"report: {report} and {report.with_suffix('.html')}")
        now = time.perf_counter()
        self.console.print(
            f"total {(now - self.started) / 60:.1f} min ({self.stages(now)}); run directory {run_dir} "
            f"(metrics.jsonl, rollouts/, checkpoints/, eval_*/)"
        )


FORM_ROWS = (  # (metric, label, format) of the demo's F1-by-question-form table
    ("form/yes_no/f1", "yes/no questions: F1", "{:.1f}"),
    ("form/yes_no/yes_share", "  share answered 'yes'", "{:.2f}"),
    ("form/choice/f1", "'A or B?' questions: F1", "{:.1f}"),
    ("form/choice/second_share", "  share answered B", "{:.2f}"),
    ("form/other/f1", "other questions: F1", "{:.1f}"),
)


def _print_behaviour(console, rows: dict[str, dict]) -> None:
    from rich.table import Table

    from mhgpo.data.forms import is_form_metric

    first = next(iter(rows.values()))
    keys = [k for k in first if "/" in k and not is_form_metric(k) and all(k in m for m in rows.values())]
    table = Table(title="agent behaviour (dev set)")
    table.add_column("")
    for name in rows:
        table.add_column(name, justify="right")
    for k in keys:
        table.add_row(k, *(f"{m[k]:.2f}" for m in rows.values()))
    console.print(table)
    forms = [(k, label, f) for k, label, f in FORM_ROWS if all(k in m for m in rows.values())]
    if not forms:
        return
    table = Table(title="F1 by question form (dev set)", caption="a constant answer scores ~50 on the first two")
    table.add_column("")
    for name in rows:
        table.add_column(name, justify="right")
    for k, label, f in forms:
        if k.endswith("/f1"):
            label += f" ({int(first[k[: -len('f1')] + 'n'])} q)"
        table.add_row(label, *(f.format(m[k]) for m in rows.values()))
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
        (
            "demo",
            cmd_demo,
            "evaluate, warm-start, train with MHGPO-IS, evaluate after each stage (the embedded default)",
        ),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument(
            "--sampler",
            choices=train_samplers(),
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
                "--algo",
                choices=tuple(ALGORITHMS),
                help="mhgpo (default) or mappo for the team; grpo or ppo with --system llm",
            )
            p.add_argument("--scale", metavar="NAME", help=SCALE_HELP)
        add_common_flags(p, ROW_CONFIG_HELP if name == "train" else "a YAML config file")
        p.set_defaults(func=func)
