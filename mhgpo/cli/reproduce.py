"""`mhgpo reproduce`: rows of the table of rows over seeds, each trained for a time budget from a shared warm start
and validated (`mhgpo.experiments`), and the page of the paper's comparisons from the results."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mhgpo.experiments.claims import ORACLE_TABLE, TABLES

ROWS_FILE = "experiments/rows.yaml"
DEFAULT_OUT = "experiments/results"  # beside the table of rows: the results (not the runs) are kept with the project


MAX_SEEDS = 1000  # seeds in one command (each row runs once per seed)


def _seeds(text: str) -> list[int]:
    """`--seeds`: distinct seeds in the order given (a seed given twice runs once)."""
    from mhgpo.config.load import MAX_SEED, shown
    from mhgpo.errors import InputError

    parts = [s for s in text.split(",") if s.strip()]
    if len(parts) > MAX_SEEDS:
        raise InputError(f"--seeds: {len(parts)} seeds; at most {MAX_SEEDS} in one command")
    try:
        seeds = list(dict.fromkeys(int(s) for s in parts))
    except ValueError:
        raise InputError(f"--seeds: expected comma-separated integers, got {shown(text)}") from None
    if not seeds:
        raise InputError("--seeds: no seed given")
    if bad := [s for s in seeds if not 0 <= s <= MAX_SEED]:
        raise InputError(f"--seeds: a seed is between 0 and {MAX_SEED} (2**32 - 1), got {bad[0]}")
    return seeds


def _check_numbers(args: argparse.Namespace) -> None:
    """`--minutes`, `--val-limit` and `--parallel` that no row could run with, refused before anything is written."""
    import math

    from mhgpo.errors import InputError

    if not (math.isfinite(args.minutes) and args.minutes > 0):
        raise InputError(f"--minutes: expected a positive number of minutes, got {args.minutes}")
    for flag, value in (("--val-limit", args.val_limit), ("--parallel", args.parallel)):
        if value < 1:
            raise InputError(f"{flag}: must be at least 1, got {value}")


def _keys(args: argparse.Namespace) -> tuple[list[str], bool]:
    """The table rows to run (`--rows`, or the rows of `--table`), and whether the oracles run."""
    from mhgpo.errors import InputError
    from mhgpo.experiments.claims import table_rows

    if args.rows:
        return [r.strip() for item in args.rows for r in item.split(",") if r.strip()], False
    names = [n for n in (args.table or ",".join([*TABLES, ORACLE_TABLE])).split(",") if n]
    unknown = [n for n in names if n not in TABLES and n != ORACLE_TABLE]
    if unknown or not names:
        choices = ", ".join([*TABLES, ORACLE_TABLE])
        raise InputError(f"--table: unknown {', '.join(unknown) or '(none)'}; choose from {choices}")
    return table_rows([n for n in names if n != ORACLE_TABLE]), ORACLE_TABLE in names


def oversubscribed(parallel: int, clock: str, cores: int) -> str | None:
    """The warning for more rows at a time than cores under the CPU clock, else None: rows sharing a core still get
    their CPU minutes, but a step then takes more of them (caches and memory bandwidth are shared), so they fit fewer
    steps than rows run one to a core (measured: 3 rows on 2 cores, +22% CPU time a step, 7 steps instead of 8)."""
    if clock != "cpu" or parallel <= cores:
        return None
    return (
        f"mhgpo reproduce: --parallel {parallel} runs more rows at a time than this machine's {cores} cores; under "
        "--clock cpu a step then costs more CPU time, so rows fit fewer steps than they would one to a core"
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cmd_reproduce(args: argparse.Namespace) -> int:
    from mhgpo.config.rows import load_rows
    from mhgpo.errors import InputError
    from mhgpo.experiments.page import write_page
    from mhgpo.experiments.results import data_folders, data_overrides, data_tag, recorded_overrides, settings_of
    from mhgpo.experiments.runner import check_evals, run_rows
    from mhgpo.io import check_output_dir

    out = check_output_dir(Path(args.out), "results' folder, --out")
    rows = load_rows(args.rows_file)
    doc = Path(args.doc) if args.doc else out / "reproduction.md"
    if args.table and args.rows:
        raise InputError("--rows: runs the rows named, --table those of the tables; give one of them")
    _check_doc(doc, [*data_folders(out), out / data_tag(args.data, args.val_data)])
    if not args.doc_only:
        _check_numbers(args)
        seeds, evals = _seeds(args.seeds), check_evals(args.eval or [])
        keys, oracles = _keys(args)
        overrides = recorded_overrides(data_overrides(args.data, args.val_data) + list(args.overrides))
        if args.val_every is not None and args.val_every < 1:
            raise InputError(f"--val-every: expected a number of steps >= 1, got {args.val_every}")
        settings = settings_of(args.minutes, args.clock, args.val_limit, overrides, args.scale, args.val_every)
        rows.scale(args.scale)
        if warning := oversubscribed(args.parallel, args.clock, _cores()):
            print(warning, file=sys.stderr)
        folder = out / data_tag(args.data, args.val_data)
        results = run_rows(rows, keys, seeds, folder, settings, args.parallel, evals, oracles)
        _print_summary(rows, results)
    write_page(out, doc, args.out, rows)
    print(f"wrote {doc}")
    return 0


def _check_doc(doc: Path, folders: list[Path]) -> None:
    """The page is a file of its own: not a folder, and not inside a data folder (whose files are the results)."""
    from mhgpo.errors import InputError

    if doc.is_dir():
        raise InputError(f"--doc {doc}: is a folder; name the page's file")
    where = Path(os.path.realpath(doc))
    for folder in folders:
        if where.is_relative_to(os.path.realpath(folder)):
            raise InputError(
                f"--doc {doc}: inside the data folder {folder}, whose files are the results; write it elsewhere"
            )


def _print_summary(rows, results: dict[str, dict[int, dict]]) -> None:
    """One line per row: its label, seeds, steps, val F1 and Acc (mean ± std), and its other data sets' F1."""
    from rich.console import Console
    from rich.table import Table

    from mhgpo.experiments.claims import split_key
    from mhgpo.experiments.stats import fmt

    names = list(dict.fromkeys(n for rs in results.values() for r in rs.values() for n in r.get("ood") or {}))
    table = Table(title="validation (mean ± std over seeds)")
    for column in ["row", "", "seeds", "steps", "val F1", "val Acc", *(f"{n} F1" for n in names)]:
        table.add_column(column)
    for key, by_seed in results.items():
        rs = list(by_seed.values())
        row, other = split_key(key)
        label = rows.label(row) + (f" for the steps of {other}" if other else "")
        ood = [fmt([r["ood"][n]["f1"] for r in rs if n in (r.get("ood") or {})]) for n in names]
        table.add_row(
            key,
            label,
            str(len(rs)),
            fmt([r["steps"] for r in rs]),
            fmt([r["val_f1"] for r in rs]),
            fmt([r["val_acc"] for r in rs]),
            *ood,
        )
    Console(highlight=False).print(table)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `mhgpo reproduce`."""
    names = ", ".join([*TABLES, ORACLE_TABLE])
    p = sub.add_parser(
        "reproduce",
        help="run rows of experiments/rows.yaml over seeds for a time budget each, and write the comparisons' page",
    )
    p.add_argument("--table", metavar="T[,T]", help=f"the tables to run (default: all): {names}")
    p.add_argument(
        "--rows",
        nargs="+",
        metavar="ROW",
        help="run these rows instead (comma- or space-separated; ROW~OTHER: ROW for the steps OTHER reached)",
    )
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--minutes", type=float, default=10.0, help="each row's training budget (budget_minutes)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="the budget's clock (budget_clock)")
    p.add_argument("--val-limit", type=int, default=100, help="validation questions per row")
    p.add_argument(
        "--val-every",
        type=int,
        metavar="N",
        help="also validate each training row every N steps, from its starting model on (its learning curve)",
    )
    p.add_argument("--data", default="synthetic", metavar="SPEC", help="training questions (a data SPEC)")
    p.add_argument("--val-data", metavar="SPEC", help="validation questions (with --data other than synthetic)")
    p.add_argument(
        "--eval",
        action="append",
        metavar="NAME=SPEC",
        help="also evaluate each row's kept run on this data set (e.g. 2wiki=2wiki:data/2wiki/val.jsonl)",
    )
    p.add_argument(
        "--parallel", type=int, default=2, help="processes at a time (one thread each; under --clock cpu one to a core)"
    )
    p.add_argument("--scale", default="demo", metavar="NAME", help="the scale of the table of rows (default demo)")
    p.add_argument("--rows-file", default=ROWS_FILE, metavar="FILE", help=f"the table of rows (default {ROWS_FILE})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the results' folder (default {DEFAULT_OUT})")
    p.add_argument("--doc", metavar="FILE", help="the page written (default OUT/reproduction.md)")
    p.add_argument("--doc-only", action="store_true", help="only write the page from the results in OUT")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides of every row")
    p.set_defaults(func=cmd_reproduce)
