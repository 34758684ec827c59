"""The `mhgpo` command line: data, ask, eval, train, demo, export, report, index build, eval-retrieval,
serve-retriever, reproduce.

Flags are shortcuts for config keys; any config key can also be set with a trailing `key=value`.
Bad input ends with one line naming the file, line or key, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from mhgpo.cli import reproduce as reproduce_cli
from mhgpo.cli import retrieval as retrieval_cli
from mhgpo.cli import serve as serve_cli
from mhgpo.cli import train as train_cli
from mhgpo.cli.common import DATA_HELP, ROW_CONFIG_HELP, SCALE_HELP, TRUST_HELP, add_common_flags, flag_overrides
from mhgpo.config.choices import EXPORT_DTYPES, redact_text
from mhgpo.model.allocator import keep_freed_memory


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


# ------------------------------------------------------------------------------------------------- commands


def cmd_data_synth(args: argparse.Namespace) -> int:
    from mhgpo.data.synth_files import write_world
    from mhgpo.errors import InputError
    from mhgpo.io import prepare_output_dir

    for flag, value in (("--train", args.train), ("--dev", args.dev)):
        if value < 1:
            raise InputError(f"{flag}: must be at least 1, got {value}")
    paths = write_world(
        prepare_output_dir(Path(args.out)), seed=args.seed, n_train=args.train, n_dev=args.dev, overwrite=args.overwrite
    )
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def cmd_data_split(args: argparse.Namespace) -> int:
    from mhgpo.data.split import split_data

    sizes = _int_list(args.sizes, "--sizes")
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    for name, (spec, count) in split_data(
        args.data, Path(args.out), sizes, args.seed, names, overwrite=args.overwrite
    ).items():
        print(f"{name}: {count} records, --data {spec}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    from mhgpo.errors import InputError

    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def cmd_export(args: argparse.Namespace) -> int:
    from mhgpo.run.export import export

    out = export(args.model, Path(args.out), dtype=args.dtype, lora_only=args.lora_only)
    what = "PEFT adapter" if args.lora_only else "model"
    print(f"wrote the {what} folder {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.markup import escape

    from mhgpo.data.records import Example
    from mhgpo.errors import printable
    from mhgpo.rl.rollout import run_rollouts
    from mhgpo.rl.tree import RolloutSpec
    from mhgpo.run.setup import build_generation, settle

    overrides = flag_overrides(
        args,
        {
            "model": "model",
            "corpus": "retrieval.corpus",
            "retriever": "retrieval.retriever",
            "index": "retrieval.index",
            "system": "system",
        },
    )
    cfg, note = _trained_team_config(args.config, overrides + list(args.overrides))
    job = settle(cfg)
    cfg = job.cfg
    console = _console()
    with console.status(f"loading {cfg.model} ..."):
        gen = build_generation(job)
    if note:
        console.print(note)
    workflow, generator, encode = gen.workflow, gen.generator, gen.encode
    example = Example(id="ask", question=args.question, answers=tuple(args.gold or ()))
    batch = run_rollouts(
        [example],
        workflow,
        generator,
        encode,
        RolloutSpec(greedy=True, max_prompt_tokens=cfg.max_prompt_tokens),
        np.random.default_rng(0),
    )
    for node in batch.nodes:
        if node.kind == "tool":
            console.rule(f"[bold]{node.agent}[/] (tool)")
            for i, title in enumerate(node.info.get("titles", [])):  # (a corpus's or a service's text)
                console.print(f"  Document{i}: {printable(str(title))}", markup=False)
            for k, v in node.info.items():
                if k not in ("titles", "ids"):
                    console.print(f"  {k}: {printable(str(v))}", markup=False)
            continue
        console.rule(f"[bold]{node.agent}[/]")
        console.print(printable(node.output), markup=False)
        details = {k: v for k, v in node.info.items() if v not in ("", [], None)}
        if node.agent == "reranker" and batch.leaves()[0].trace.get("selected_titles"):
            details["selected_titles"] = batch.leaves()[0].trace["selected_titles"]
        if node.penalty:
            details["penalty"] = node.penalty
        for k, v in details.items():
            console.print(f"  [dim]{escape(str(k))}:[/] {escape(printable(str(v)))}", markup=True, highlight=False)
    leaf = batch.leaves()[0]
    console.rule("[bold]answer[/]")
    console.print(printable(leaf.final_answer), markup=False)
    if args.gold:
        from mhgpo.data.metrics import score

        f1 = score(leaf.final_answer, tuple(args.gold))["f1"]
        console.print(f"[dim]F1 against the gold answer:[/] {f1:.2f}")
        if leaf.terminal != f1:  # a team that scores itself otherwise
            console.print(f"[dim]the team's reward:[/] {leaf.terminal:.2f}")
    return 0


EVAL_FLAGS = {
    "data": "data",
    "model": "model",
    "limit": "limit",
    "batch_size": "batch_size",
    "corpus": "retrieval.corpus",
    "retriever": "retrieval.retriever",
    "index": "retrieval.index",
    "system": "system",
    "seed": "seed",
    "output_dir": "output_dir",
}


def _eval_config(args: argparse.Namespace):
    """The evaluation's config and a line to show about it; with `--resume DIR`, the saved one, which the command
    line may repeat but not change (the first differing key is named)."""
    from mhgpo.errors import InputError
    from mhgpo.run.evaluate import resumed_config

    overrides = flag_overrides(args, EVAL_FLAGS) + list(args.overrides)
    if args.oracle is not None:
        overrides.append(f"oracle=[{args.oracle}]")
    if not args.resume:
        row = _row_eval_config(args, overrides)
        return (row, None) if row is not None else _trained_team_config(args.config, overrides)
    folder = Path(args.resume)
    if args.output_dir and Path(args.output_dir).resolve() != folder.resolve():
        raise InputError(f"--output-dir: {args.output_dir} is not the folder being continued ({folder})")
    return resumed_config(folder, args.config, overrides, trust_code=args.trust_code), None


def _trained_team_config(path: str | None, overrides: list[str]):
    """The config with a trained run's team settings under it (:func:`mhgpo.run.evaluate.eval_config`), and a line
    that says so (None when the model is not a run)."""
    from mhgpo.run.evaluate import TEAM_KEYS, eval_config

    cfg, origin = eval_config(path, overrides)
    note = None if origin is None else f"the team as trained: {', '.join(TEAM_KEYS)} from {origin} unless set here"
    return cfg, note


def _row_eval_config(args: argparse.Namespace, overrides: list[str]):
    """`--config ROWS.yaml:ROW [--scale NAME]`: the row's validation (its `val_data`, `val_limit` questions, team,
    generation and precision) as an evaluation config, with the flags and overrides last; None for another
    config."""
    from mhgpo.config import EvalConfig, load_config, to_dict
    from mhgpo.config.rows import row_spec
    from mhgpo.run.setup import validation_config

    spec = row_spec(args.config, args.scale)
    if spec is None:
        return None
    table, name = spec
    cfg = table.config(name, args.scale)
    return load_config(EvalConfig, None, overrides, base=to_dict(validation_config(cfg, cfg.model)))


def cmd_eval(args: argparse.Namespace) -> int:
    from mhgpo.data.forms import form_line, is_form_metric
    from mhgpo.rl.evaluation import METRICS, PREDICTIONS, metrics_table
    from mhgpo.run.evaluate import EvalInterrupted, run_evaluation

    cfg, note = _eval_config(args)
    console = _console()
    notes = [note] if note else []

    def say(text: str) -> None:  # the note after the model loaded: a run that fails to load prints one error line
        while notes:
            console.print(notes.pop())
        console.print(text)

    try:
        result = run_evaluation(cfg, resume=bool(args.resume), say=say, status=console.status)
    except EvalInterrupted as e:
        print(f"mhgpo: {e.message}", file=sys.stderr)
        return 130
    if result.complete_before:
        return 0
    metrics = result.metrics
    console.print(metrics_table({f"{cfg.system} / {cfg.data}": metrics}))
    behaviour = {k: v for k, v in metrics.items() if "/" in k and not is_form_metric(k)}
    console.print("  ".join(f"{k} {v:.2f}" for k, v in behaviour.items()))
    if forms := form_line(metrics):
        console.print(f"by question form: {forms}", soft_wrap=True)
    new = len(result.predictions) - metrics.get("resumed", 0)
    console.print(
        f"{new} questions in {metrics['seconds']:.1f} s ({new / max(metrics['seconds'], 1e-9):.2f} "
        f"questions/s)" + (f"; {metrics['resumed']} from earlier sessions" if "resumed" in metrics else "")
    )
    if cfg.output_dir:
        out = Path(cfg.output_dir).expanduser()
        console.print(f"wrote {out / METRICS} and {out / PREDICTIONS}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from mhgpo.errors import InputError
    from mhgpo.io import prepare_output_dir
    from mhgpo.run.report import build_report

    runs = [Path(p) for p in args.runs] + [Path(p) for p in args.eval or []]
    for run in runs:
        if not run.is_dir():
            raise InputError(f"{run}: not a run or evaluation directory")
    out = Path(args.out) if args.out else (runs[0] / "report" if len(runs) == 1 else Path("report"))
    if not args.out and out.is_symlink():  # a run folder from elsewhere must not choose where the report goes
        raise InputError(f"{out}: is a link; pass --out to say where the report goes")
    out = prepare_output_dir(out, "report folder")
    path = build_report(runs, out)
    print(f"wrote {path}, {out / 'report.html'} and the plots in {out}")
    return 0


# --------------------------------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands'), whose errors, which quote the argument, redact a URL's password."""

    def error(self, message: str) -> NoReturn:
        super().error(redact_text(message))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mhgpo",
        description="Train and evaluate LLM multi-agent search systems with MHGPO.",
        epilog="Errors in the input end with one line (exit status 2); --debug (anywhere on the line) shows the "
        "traceback instead.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="data utilities")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    synth = data_sub.add_parser("synth", help="write a synthetic mini-wiki world (corpus, train, dev)")
    synth.add_argument("--out", required=True, help="output folder")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--train", type=int, default=2000, help="number of training questions")
    synth.add_argument("--dev", type=int, default=200, help="number of dev questions")
    synth.add_argument("--overwrite", action="store_true", help="replace the files of an earlier world in --out")
    synth.set_defaults(func=cmd_data_synth)
    split = data_sub.add_parser("split", help="disjoint seeded parts of a question file, as its original records")
    split.add_argument(
        "--data", required=True, help="hotpotqa:PATH, 2wiki:PATH, musique:PATH, jsonl:PATH or synthetic:train|dev"
    )
    split.add_argument("--out", required=True, help="output folder")
    split.add_argument("--sizes", required=True, help="records per part, e.g. 200,100")
    split.add_argument("--names", help="file names of the parts (default train,val,test)")
    split.add_argument("--seed", type=int, default=0)
    split.add_argument(
        "--overwrite", action="store_true", help="replace existing part files in --out (never the source file)"
    )
    split.set_defaults(func=cmd_data_split)

    ask = sub.add_parser("ask", help="run the team on one question and show what each agent did")
    ask.add_argument("question")
    ask.add_argument("--gold", action="append", help="a gold answer (to print the F1)")
    add_common_flags(ask)
    ask.set_defaults(func=cmd_ask)

    ev = sub.add_parser("eval", help="evaluate the team on a data set (Acc / EM / F1)")
    ev.add_argument("--data", help=DATA_HELP)
    ev.add_argument("--limit", type=int, help="evaluate the first N questions")
    ev.add_argument("--batch-size", type=int, help="questions per breadth-first batch")
    ev.add_argument("--seed", type=int)
    ev.add_argument(
        "--output-dir", help="where to write metrics.json and predictions.jsonl (appended as questions finish)"
    )
    ev.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the interrupted evaluation in DIR (same config; finished questions are skipped)",
    )
    ev.add_argument(
        "--oracle",
        metavar="ROLE[,ROLE]",
        help="roles that give their gold output instead of calling "
        "the model (rewriter, reranker; context: the gold paragraphs shown to the Answerer), to measure "
        "a role's headroom",
    )
    ev.add_argument("--trust-code", action="store_true", help=TRUST_HELP)
    ev.add_argument("--scale", metavar="NAME", help=SCALE_HELP)
    add_common_flags(ev, ROW_CONFIG_HELP)
    ev.set_defaults(func=cmd_eval)

    rep = sub.add_parser("report", help="plots and tables (report.md, report.html) from run directories")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="training run or evaluation output directories")
    rep.add_argument("--eval", action="append", metavar="DIR", help="an evaluation output directory to tabulate")
    rep.add_argument("--out", help="output folder (default: RUN_DIR/report for one run, else ./report)")
    rep.set_defaults(func=cmd_report)

    exp = sub.add_parser("export", help="a trained run as a Hugging Face model folder (or its PEFT adapter)")
    exp.add_argument(
        "model", metavar="RUN_OR_CHECKPOINT", help="a run directory, RUN/checkpoints/step_N, or any --model"
    )
    exp.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    exp.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="weights' dtype (float32)")
    exp.add_argument("--lora-only", action="store_true", help="write the LoRA adapter as a PEFT folder instead")
    exp.set_defaults(func=cmd_export)

    train_cli.add_commands(sub)
    retrieval_cli.add_commands(sub)
    serve_cli.add_commands(sub)
    reproduce_cli.add_commands(sub)
    return parser


MAX_ERROR_CHARS = 2000


def error_line(e: BaseException) -> str | None:
    """The one line the CLI prints for an error that is the input's or the machine's (not a bug), else None."""
    import json

    import yaml
    from safetensors import SafetensorError

    from mhgpo.errors import InputError, RunError, printable

    if isinstance(e, (InputError, RunError)):
        text = str(e)
    elif isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        text = f"{where}{e.strerror}" if e.strerror else str(e)
    elif isinstance(e, json.JSONDecodeError):
        text = f"invalid JSON at line {e.lineno} column {e.colno} ({e.msg})"
    elif isinstance(e, yaml.YAMLError):
        text = f"invalid YAML ({e})"
    elif isinstance(e, SafetensorError):
        text = f"safetensors: {e}"
    elif isinstance(e, ValueError):
        text = str(e) or type(e).__name__
    else:
        return None
    if len(text) > MAX_ERROR_CHARS:  # (a message that quotes a huge value is cut, not printed whole)
        text = text[:MAX_ERROR_CHARS] + f"... ({len(text) - MAX_ERROR_CHARS} more characters)"
    return printable(redact_text(" ".join(text.split())))  # (no password of a URL, no escape sequence shown)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # what reads the command line later (W&B records it) sees a service's password redacted
        argv, sys.argv[1:] = sys.argv[1:], [redact_text(a) for a in sys.argv[1:]]
    argv = list(argv)
    debug = "--debug" in argv or os.environ.get("MHGPO_DEBUG") not in (None, "", "0")
    argv = [a for a in argv if a != "--debug"]  # accepted anywhere on the line
    _quiet_libraries()
    keep_freed_memory()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills the `key=value` positionals of `ask` together with its question, so trailing overrides
    # after an option (`mhgpo ask "..." --model M top_k=5`) come back unparsed: they are overrides too.
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.func.__name__ != "cmd_train":
            from mhgpo.errors import InputError

            raise InputError(f"{args.command}: only `mhgpo train` runs on several processes (accelerate launch)")
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            print("mhgpo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - bad input and machine errors become one line; bugs keep their traceback
        line = None if debug else error_line(e)
        if line is None:
            raise
        if os.environ.get("RANK", "0") == "0":  # a data-parallel run: rank 0 says it once
            print(f"mhgpo: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
