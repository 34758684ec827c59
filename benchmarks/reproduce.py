"""The paper's comparisons as named tables, run at equal CPU time over seeds, written to docs/reproduction.md.

Each table is one claim of the paper: its rows (`benchmarks/compare_algorithms.py` rows: `untrained`, `warm`,
`[warm+]ALGO[+OPTION][@key=value,...]`), the reference row the others are compared with, and the paper's direction
for each comparison (`>`, `≥`, `≈`, `<`, `≤` on validation F1, or on LLM calls per question for a cost claim).
The rows run through `compare_algorithms.run_rows`: every (row, seed) trains for `--minutes` of its process's CPU
time from that seed's warm start (shared by every row and table that starts from it), is validated greedily on
`--val-limit` questions, and is written atomically to OUT/DATA/ROW-seedS.json (DATA: `synthetic`, or a name for
`--data` and `--val-data`); a rerun skips what is finished and reruns what was cut short. A row shared by several
tables runs once.

The `oracles` table is not a claim of the paper but where a team's headroom is: each seed's warm-started team
validated with per-role oracles (`mhgpo eval --oracle`): the Rewriter's gold queries, the Reranker keeping the
retrieved gold paragraphs, both, and the gold paragraphs shown to the Answerer (`context`). The `groups` table is
not the paper's claim either: MHGPO's advantage groups against two peer systems' schemes (`advantage=agent`,
`advantage=prompt_agent_turn`) on MHGPO-RR's rollouts. Nor is `recipes`: RL aimed at the role the oracles find the
headroom in (the Reranker trained alone, its row's own `budget=30` minutes), against as many minutes of every role.

    python benchmarks/reproduce.py --table algorithms,aggregators --seeds 0,1,2 --minutes 10 [--parallel 2] \\
        [--data synthetic | --data hotpotqa:TRAIN --val-data hotpotqa:VAL] [--val-limit 100] [--out DIR] [--doc FILE] \\
        [key=value ...]
    python benchmarks/reproduce.py --doc-only [--out DIR]      # rewrite the document from the results in OUT

The document (default docs/reproduction.md) holds every table, per data set: run ones with their numbers, the
others as "not run" with the command that runs them. Agreement rule (`verdict`): per seed, d = row − compared row;
with n ≥ 2 seeds, the difference is *within noise* when |mean d| ≤ std d (sample std) or ≤ what one validation
question can move the metric (100 / questions validated), otherwise its sign is our direction; `>` / `<` agree
with that sign, `≥` / `≤` also with within noise, `≈` only with within noise; one seed gives no noise estimate
(`n/a`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_algorithms as ca  # noqa: E402  (benchmarks/ is not a package)

from mhgpo.io import atomic_write_json, atomic_write_text  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "reproduction.md"
DEFAULTS = {"seeds": "0,1,2", "minutes": 10.0, "clock": "cpu", "val_limit": 100, "parallel": 2}
ROLES = ("rewriter", "reranker", "answerer")
# The observed directions each of the paper's directions agrees with (≈: within noise).
AGREES = {">": {">"}, "<": {"<"}, "≥": {">", "≈"}, "≤": {"<", "≈"}, "≈": {"≈"}}
METRICS = {"val_f1": "val F1", "llm_calls": "LLM calls / question"}


@dataclasses.dataclass(frozen=True)
class Claim:
    """The paper's direction of `row` against `than` on `metric` (`val_f1`, or `llm_calls` per question)."""

    row: str
    direction: str  # > ≥ ≈ < ≤
    than: str
    paper: str  # the claim in words
    metric: str = "val_f1"


@dataclasses.dataclass(frozen=True)
class Table:
    name: str
    title: str
    reference: str  # the row every other row's paired differences are taken against
    rows: tuple[str, ...]
    claims: tuple[Claim, ...]
    columns: tuple[tuple[str, str], ...] = ()  # (header, training metric): more columns, per question drawn


SINGLE_WARM = "warm@system=llm"  # the model alone, from its own warm start: where single-agent GRPO starts
RERANKER_RECIPE = "warm+rr@budget=30,train_roles=[reranker]"
RECIPE_CONTROL = "warm+rr@budget=30"  # every role for the recipe's minutes: the budget's share of its gain
MHGPO_ROWS = ["warm+rr", "warm+fof", "warm+is", "warm+fof_os"]  # MHGPO with each sampler, from the warm start


def _rl_beats(rows: list[str], than: str, paper: str) -> tuple[Claim, ...]:
    return tuple(Claim(r, ">", than, paper) for r in rows)


TABLES = {
    t.name: t
    for t in (
        Table(
            "algorithms",
            "MHGPO (each sampler) against MAPPO and single-agent GRPO",
            "warm+mappo",
            ("untrained", "warm", *MHGPO_ROWS, "warm+mappo", SINGLE_WARM, "warm+grpo"),
            (
                *_rl_beats(MHGPO_ROWS, "warm", "RL improves on its starting point"),
                Claim("warm+grpo", ">", SINGLE_WARM, "RL improves on its starting point (single agent)"),
                *_rl_beats(MHGPO_ROWS, "warm+mappo", "MHGPO > MAPPO"),
                *_rl_beats(MHGPO_ROWS, "warm+grpo", "the trained team > single-agent GRPO"),
                Claim("warm+fof", "≈", "warm+is", "FoF ≈ IS in quality ..."),
                Claim("warm+fof", "<", "warm+is", "... at lower cost", "llm_calls"),
            ),
        ),
        # the paper's two branched samplers; under RR only prefix singletons carry an aggregated reward, and at 4
        # questions a step they seldom fill a regrouped group, so FoF(os) (every prefix node aggregated) is the test
        Table(
            "aggregators",
            "Aggr of backward reward propagation (MHGPO-RR and MHGPO-FoF(os)): mean against max, min, rand",
            "warm+rr",
            tuple(
                f"{s}{a}"
                for s in ("warm+rr", "warm+fof_os")
                for a in ("", "@reward.aggr=max", "@reward.aggr=min", "@reward.aggr=rand")
            ),
            tuple(
                Claim(s, "≥", f"{s}@reward.aggr={a}", f"mean aggr ≥ {a} ({name})")
                for s, name in (("warm+rr", "RR"), ("warm+fof_os", "FoF(os)"))
                for a in ("max", "min", "rand")
            ),
            (("aggregated samples / question", "aggregated_samples"),),
        ),
        Table(
            "reward",
            "Composite reward (final + agent-specific penalties) against the final reward alone",
            "warm+rr",
            ("warm+rr", "warm+rr@reward.penalties=false", "warm+mappo", "warm+mappo@reward.penalties=false"),
            (
                Claim("warm+rr", ">", "warm+rr@reward.penalties=false", "composite > final-only (MHGPO-RR)"),
                Claim("warm+mappo", ">", "warm+mappo@reward.penalties=false", "composite > final-only (MAPPO)"),
            ),
        ),
        Table(
            "roles",
            "Role-wise training (MHGPO-FoF): every role against one role alone or one role frozen",
            "warm+fof",
            (
                "warm+fof",
                *(f"warm+fof@train_roles=[{r}]" for r in ROLES),
                *(f"warm+fof@frozen_roles=[{r}]" for r in ROLES),
            ),
            (
                *(Claim("warm+fof", "≥", f"warm+fof@train_roles=[{r}]", f"all roles ≥ {r} alone") for r in ROLES),
                *(Claim("warm+fof", "≥", f"warm+fof@frozen_roles=[{r}]", f"all roles ≥ {r} frozen") for r in ROLES),
            ),
        ),
        Table(
            "groups",
            "Advantage groups on MHGPO-RR's rollouts: MHGPO's heterogeneous groups against two peer schemes "
            "(agent-wise normalisation as Dr.MAS; (prompt, agent, turn) groups as AT-GRPO)",
            "warm+rr",
            ("warm+rr", "warm+rr@advantage=agent", "warm+rr@advantage=prompt_agent_turn"),
            (
                Claim("warm+rr", "≥", "warm+rr@advantage=agent", "(not the paper's) MHGPO groups ≥ agent-wise"),
                Claim(
                    "warm+rr",
                    "≥",
                    "warm+rr@advantage=prompt_agent_turn",
                    "(not the paper's) MHGPO groups ≥ (prompt, agent, turn)",
                ),
            ),
        ),
        Table(
            "recipes",
            "RL aimed at the role with the headroom (the oracles' Reranker): MHGPO-RR training the Reranker "
            "alone for 30 CPU minutes, against the warm start and 10 or 30 minutes of every role (not the paper's)",
            "warm",
            ("warm", "warm+rr", RERANKER_RECIPE, RECIPE_CONTROL),
            (
                Claim(
                    RERANKER_RECIPE,
                    ">",
                    "warm",
                    "(not the paper's) RL aimed at the Reranker improves on the warm start",
                ),
                Claim(RERANKER_RECIPE, ">", "warm+rr", "(not the paper's) ... and on 10 minutes of every role"),
                Claim(
                    RERANKER_RECIPE, ">", RECIPE_CONTROL, "(not the paper's) ... and on as many minutes of every role"
                ),
            ),
        ),
    )
}


ORACLE_TABLE = "oracles"
# name: (the oracle roles, what they mean)
ORACLES = {
    "none": ((), "the warm-started team as it is"),
    "rewriter": (("rewriter",), "the Rewriter writes the gold queries"),
    "reranker": (("reranker",), "the Reranker keeps exactly the retrieved gold paragraphs"),
    "rewriter+reranker": (("rewriter", "reranker"), "both"),
    "context": (("context",), "the Answerer is shown the gold paragraphs (retrieval bypassed)"),
}


# ---- numbers from results ---------------------------------------------------------------------------------------


def per_question(result: dict, key: str) -> float | None:
    """A training metric summed over the row's steps per question drawn (None for a row without steps or one run
    before the metric was logged)."""
    steps = result.get("steps_metrics") or []
    if not any(key in m for m in steps):
        return None
    questions = sum(m.get("filter/questions", result["questions_per_step"]) for m in steps)
    return sum(m.get(key, 0.0) for m in steps) / questions


def seconds_per_step(result: dict) -> float | None:
    """Mean rollout + update seconds of the row's steps (model loading and validation left out)."""
    steps = result.get("steps_metrics") or []
    if not steps:
        return None
    return float(np.mean([m.get("seconds/rollout", 0.0) + m.get("seconds/train", 0.0) for m in steps]))


def metric(result: dict, key: str) -> float | None:
    """A result's value of a claim's metric: a stored key, or `llm_calls` per training question."""
    return per_question(result, "llm_calls") if key == "llm_calls" else result.get(key)


def paired(by_row: dict[str, dict[int, dict]], row: str, than: str, key: str = "val_f1") -> list[float]:
    """row − than on `key`, per seed that both have (same seed: same warm start and data order)."""
    a, b = by_row.get(row, {}), by_row.get(than, {})
    diffs = [(metric(a[s], key), metric(b[s], key)) for s in sorted(set(a) & set(b))]
    return [x - y for x, y in diffs if x is not None and y is not None]


def resolution(by_row: dict[str, dict[int, dict]], claim: Claim) -> float:
    """The most one validation question moves a claim's validation metric (F1, Acc: 100 / questions validated, on
    the fewest any of its two rows validated); 0 for a cost metric."""
    if claim.metric == "llm_calls":
        return 0.0
    ns = [r["val_n"] for row in (claim.row, claim.than) for r in by_row.get(row, {}).values() if r.get("val_n")]
    return 100.0 / min(ns) if ns else 0.0


def verdict(direction: str, diffs: list[float], resolution: float = 0.0) -> str:
    """agrees / disagrees / within noise (|mean| ≤ the larger of the paired differences' std and `resolution`, the
    most one validation question can move the metric) / n/a (fewer than 2 seeds)."""
    if len(diffs) < 2:
        return "n/a (1 seed)" if diffs else "not run"
    m, s = ca.mean_std(diffs)
    ours = "≈" if abs(m) <= max(s, resolution) + 1e-9 else (">" if m > 0 else "<")  # F1s are sums of floats
    if ours in AGREES[direction]:
        return "agrees"
    return "within noise" if ours == "≈" else "disagrees"


# ---- the document -----------------------------------------------------------------------------------------------


def data_specs(overrides: list[str]) -> dict[str, str]:
    """The `data` and `val_data` of a result's settings (empty for the synthetic world)."""
    return {k: v for k, _, v in (kv.partition("=") for kv in overrides) if k in ("data", "val_data")}


def data_flags(overrides: list[str]) -> tuple[str, list[str]]:
    """(`--data ... --val-data ...` or "", the other overrides) of a result's settings."""
    data = data_specs(overrides)
    rest = [kv for kv in overrides if kv.partition("=")[0] not in ("data", "val_data")]
    flags = f" --data {data['data']} --val-data {data['val_data']}" if len(data) == 2 else ""
    return flags, rest


def command(table: str, settings: dict | None, seeds: list[int] | None, out: str) -> str:
    """The command that (re)runs `table` under `settings` (the defaults for a table not run)."""
    s = settings or {
        "minutes": DEFAULTS["minutes"],
        "clock": DEFAULTS["clock"],
        "val_limit": DEFAULTS["val_limit"],
        "overrides": [],
    }
    seeds_text = ",".join(map(str, seeds)) if seeds else DEFAULTS["seeds"]
    flags, rest = data_flags(s["overrides"])
    extra = "".join(f" {kv}" for kv in rest)
    return (
        f"python benchmarks/reproduce.py --table {table} --seeds {seeds_text} --minutes {s['minutes']:g} "
        f"--clock {s['clock']} --val-limit {s['val_limit']} --parallel {DEFAULTS['parallel']}{flags} "
        f"--out {out}{extra}"
    )


def data_title(settings: dict) -> str:
    """The data a folder's results were trained and validated on, in words."""
    data = data_specs(settings["overrides"])
    if not data:
        return "synthetic world (synthetic:train, validated on synthetic:dev)"
    return f"{data.get('data')}, validated on {data.get('val_data')}"


def _header(found: list[dict], settings: dict, seeds: list[int], command_text: str, budget: str) -> list[str]:
    mach = found[0].get("machine") or {}
    return [
        f"### {data_title(settings)}",
        "",
        f"Command: `{command_text}`",
        "",
        f"Machine: {mach.get('cpu', 'unknown')}, {mach.get('cores', '?')} cores"
        + (f", {mach['gpu']}" if mach.get("gpu") else "")
        + f". Seeds: {', '.join(map(str, seeds))}. "
        + budget,
    ]


def table_markdown(table: Table, by_data: list[dict[str, dict[int, dict]]], out: str) -> str:
    """One table's section: per data set that ran it, its rows (mean ± std over seeds, paired differences against
    the reference), the paper's directions beside ours, and the command, machine, seeds and budget; or "not run"
    and the command."""
    lines = [f"## {table.name}: {table.title}", ""]
    own = own_rows(table)
    ran = [by_row for by_row in by_data if any(by_row.get(r) for r in own)]
    if not ran:
        lines += ["**Not run.** Command:", "", f"    {command(table.name, None, None, out)}", ""]
        lines += [
            "Paper's directions: "
            + "; ".join(f"{c.paper} (`{c.row}` {c.direction} `{c.than}`)" for c in table.claims)
            + ".",
            "",
        ]
        return "\n".join(lines)
    for by_row in ran:
        lines += _table_body(table, by_row, out)
    not_ran = [
        data_title(_settings(by_row)) for by_row in by_data if not any(by_row.get(r) for r in own) and _settings(by_row)
    ]
    if not_ran:
        lines += [f"Not run on {'; '.join(not_ran)} (its rows of other tables aside).", ""]
    return "\n".join(lines)


def own_rows(table: Table) -> list[str]:
    """The rows `table` adds to the tables before it (a data set's part is shown where one of them ran)."""
    names = list(TABLES)
    earlier = {r for name in names[: names.index(table.name)] for r in TABLES[name].rows}
    return [r for r in table.rows if r not in earlier]


def _settings(by_row: dict[str, dict[int, dict]]) -> dict | None:
    """The settings a data folder's results ran under (None for a folder without results)."""
    return next((res["settings"] for results in by_row.values() for res in results.values()), None)


def _table_body(table: Table, by_row: dict[str, dict[int, dict]], out: str) -> list[str]:
    found = [res for r in table.rows for res in by_row.get(r, {}).values()]
    settings = found[0]["settings"]
    seeds = sorted({res["seed"] for res in found})
    missing = [f"{r} seed {s}" for r in table.rows for s in seeds if s not in by_row.get(r, {})]
    own_budgets = [f"`{r}`: {ca.row_budget(r):g}" for r in table.rows if ca.row_budget(r)]
    lines = _header(
        found,
        settings,
        seeds,
        command(table.name, settings, seeds, out),
        f"Budget: {settings['minutes']:g} {settings['clock']} minutes of training per row"
        + (f" ({'; '.join(own_budgets)})" if own_budgets else "")
        + ", "
        f"{settings['val_limit']} validation questions."
        + (f" **Partial**: missing {', '.join(missing)}." if missing else ""),
    )
    lines += [
        "",
        f"| row | seeds | steps | val F1 | val Acc | Δ F1 vs {table.reference} (paired) | s / step | "
        "peak MB | LLM calls / question | trained samples / question |"
        + "".join(f" {header} |" for header, _ in table.columns),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(table.columns),
    ]
    for row in table.rows:
        rs = list(by_row.get(row, {}).values())
        delta = "—" if row == table.reference else ca.fmt(paired(by_row, row, table.reference))

        def values(f, rs=rs) -> list[float]:
            return [v for v in map(f, rs) if v is not None]

        lines.append(
            f"| `{row}` | {len(rs)} | {ca.fmt([r['steps'] for r in rs])} | "
            f"{ca.fmt([r['val_f1'] for r in rs])} | "
            f"{ca.fmt([r['val_acc'] for r in rs])} | {delta} | {ca.fmt(values(seconds_per_step))} | "
            f"{ca.fmt(values(lambda r: r.get('peak_mb')), 0)} | "
            f"{ca.fmt(values(lambda r: per_question(r, 'llm_calls')), 2)} | "
            f"{ca.fmt(values(lambda r: per_question(r, 'samples')), 2)} |"
            + "".join(f" {ca.fmt(values(lambda r, key=key: per_question(r, key)), 2)} |" for _, key in table.columns)
        )
    lines += ["", "| paper | comparison | ours (paired, mean ± std) | verdict |", "|---|---|---|---|"]
    for c in table.claims:
        diffs = paired(by_row, c.row, c.than, c.metric)
        lines.append(
            f"| {c.paper} | `{c.row}` {c.direction} `{c.than}` ({METRICS[c.metric]}) | "
            f"{ca.fmt(diffs, 2)} | {verdict(c.direction, diffs, resolution(by_row, c))} |"
        )
    return lines + [""]


def oracle_row(name: str) -> str:
    return f"oracle:{name}"


def oracle_markdown(by_data: list[dict[str, dict[int, dict]]], out: str) -> str:
    """The oracles' section: per data set, each oracle's validation (mean ± std over seeds), its paired gain over
    the team as it is, the gold paragraphs' recall in what was retrieved and in what the Answerer was shown."""
    lines = [
        f"## {ORACLE_TABLE}: where the warm-started team's headroom is (per-role oracles)",
        "",
        "Each seed's warm-started team validated with roles replaced by their gold output (`mhgpo eval "
        "--oracle ROLE`; docs/learning.md): "
        + "; ".join(f"`{n}`: {text}" for n, (_, text) in ORACLES.items())
        + ". Gold recall: the share of a question's gold paragraphs among those retrieved and among those "
        "the Answerer was shown, mean over questions. `context` needs validation records that carry their "
        "paragraphs (HotpotQA, 2WikiMultihopQA, MuSiQue; not the synthetic world).",
        "",
    ]
    ran = [by_row for by_row in by_data if any(by_row.get(oracle_row(n)) for n in ORACLES)]
    if not ran:
        return "\n".join(lines + ["**Not run.** Command:", "", f"    {command(ORACLE_TABLE, None, None, out)}", ""])
    for by_row in ran:
        found = [res for n in ORACLES for res in by_row.get(oracle_row(n), {}).values()]
        settings = found[0]["settings"]
        seeds = sorted({res["seed"] for res in found})
        lines += _header(
            found,
            settings,
            seeds,
            command(ORACLE_TABLE, settings, seeds, out),
            f"{settings['val_limit']} validation questions, greedy.",
        )
        lines += [
            "",
            "| oracle | seeds | val F1 | val Acc | val EM | Δ F1 vs none (paired) | gold recall, retrieved | "
            "gold recall, shown | LLM calls / question |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in ORACLES:
            rs = list(by_row.get(oracle_row(name), {}).values())
            delta = "—" if name == "none" else ca.fmt(paired(by_row, oracle_row(name), oracle_row("none")))

            def values(key: str, rs=rs) -> list[float]:
                return [r[key] for r in rs if r.get(key) is not None]

            lines.append(
                f"| `{name}` | {len(rs)} | {ca.fmt(values('val_f1'))} | {ca.fmt(values('val_acc'))} | "
                f"{ca.fmt(values('val_em'))} | {delta} | {ca.fmt(values('recall_retrieved'))} | "
                f"{ca.fmt(values('recall_shown'))} | {ca.fmt(values('llm_calls'), 2)} |"
            )
        lines.append("")
    return "\n".join(lines)


INTRO = """# Reproduction of the paper's comparisons

`benchmarks/reproduce.py` runs each of the paper's comparisons as a table of rows trained for the same CPU time
from the same per-seed warm start (the demo's settings: `mhgpo/config/demo.yaml`), validated greedily, over seeds;
this page is written by it from the results it finds (`--doc-only` rewrites it without running anything). Numbers:
mean ± sample std over seeds. Δ: per-seed (paired) differences against the table's reference row, mean ± std,
over the seeds both ran (a row run on fewer seeds than its reference is read by its Δ, not by the means).
s / step: rollout + update wall seconds per RL step; peak MB: the row process's peak resident memory (on a GPU, its
peak allocated GPU memory); LLM calls and trained samples per training question, from the steps' metrics (the
aggregators table adds the trained samples whose reward the aggregator decides: those above leaves with different
rewards; — for results logged before the count was). `warm@system=llm` is the model alone from its own warm start,
where single-agent GRPO starts. The peak MB column is each row's own process at its budget; the paper's memory
claim, MHGPO against MAPPO with a critic of its own base, is measured step for step at equal work in
[benchmarks.md](benchmarks.md#algorithms-step-time-and-memory) (`bench_algorithms.py --algos fof,rr,mappo,mappo_own`).

Verdict rule: with n ≥ 2 seeds, a paired difference is *within noise* when |mean| ≤ std, or when it is no larger
than one validation question can make it (1 point of F1 on 100 questions); otherwise its sign is our direction.
The paper's `>` / `<` agree with that sign; `≥` / `≤` agree with it or with within noise; `≈` agrees only with
within noise. Fewer than 2 seeds: n/a. A table without results is listed as "not run" with the
command that runs it; a partly run one names what is missing. A table run on several data sets (the synthetic
world; a HotpotQA split with `--data hotpotqa:TRAIN --val-data hotpotqa:VAL`) has one part per data set where a row
of its own ran (not only rows it shares with an earlier table), each with its command, the machine it ran on, its
seeds and budget. Budgets are CPU time per process: rows that shared the machine with other work ran the same amount
of training, only their seconds per step grew; a row named with `budget=M` trains M minutes instead. Three tables are
not claims of the paper: `groups` sets MHGPO's heterogeneous advantage groups against two peer systems' schemes on
the same sampler (`advantage=agent`: one group per agent across the step, as Dr.MAS normalises;
`prompt_agent_turn`: samples sharing prompt, agent and visit, as AT-GRPO groups); `recipes` aims RL at the role the
oracles find the headroom in; the last, `oracles`, shows where the warm-started team's headroom is. The HotpotQA
parts use the 300-record dev sample split by `mhgpo data split --data hotpotqa:PATH/hotpotqa_dev.jsonl --out
data/hotpotqa --sizes 200,100 --seed 0`. (A smoke test writes its page elsewhere: `--doc FILE`.)
"""


def write_doc(out: Path, doc: Path, out_text: str | None = None) -> str:
    """Write `doc` from every finished result in OUT's data folders; its text."""
    by_data = [collect(folder) for folder in data_folders(out)]
    text = INTRO + "\n" + "\n".join(table_markdown(t, by_data, out_text or str(out)) for t in TABLES.values())
    text += "\n" + oracle_markdown(by_data, out_text or str(out))
    atomic_write_text(doc, text)
    return text


def data_tag(data: str, val_data: str | None) -> str:
    """OUT's folder for the results on one data set: `synthetic`, or the kind of `data` and a hash of both specs."""
    if data == "synthetic" and val_data is None:
        return "synthetic"
    digest = hashlib.sha1(f"{data}|{val_data}".encode()).hexdigest()[:8]
    return f"{data.partition(':')[0]}-{digest}"


def data_folders(out: Path) -> list[Path]:
    """OUT's data folders (those a run has pinned its settings in), the synthetic world's first."""
    found = [p for p in out.iterdir() if (p / "settings.json").is_file()] if out.is_dir() else []
    return sorted(found, key=lambda p: (p.name != "synthetic", p.name))


def collect(folder: Path) -> dict[str, dict[int, dict]]:
    """{row: {seed: result}} of the finished results in a data folder (unreadable or cut-short files left out)."""
    by_row: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob("*-seed*.json")):
        try:
            res = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(res, dict) and all(k in res for k in ca.RESULT_KEYS) and res["row"] != "warm_start":
            by_row.setdefault(res["row"], {})[res["seed"]] = res
    return by_row


def oracle_result(name: str, seed: int, result, examples: dict, settings: dict) -> dict:
    """One oracle's validation as a result record: metrics, gold recall retrieved / shown, LLM calls per question."""
    preds = result.predictions

    def recall(key: str) -> float | None:
        shares = [
            len(set(examples[p["id"]].supporting_titles) & set(p["trace"].get(key) or []))
            / len(set(examples[p["id"]].supporting_titles))
            for p in preds
            if examples[p["id"]].supporting_titles
        ]
        return 100 * float(np.mean(shares)) if shares else None

    calls = sum(1 for p in preds for step in p["trace"]["steps"] if "tool" not in step)
    m = result.metrics
    return {
        "row": oracle_row(name),
        "seed": seed,
        "steps": 0,
        "val_f1": m["f1"],
        "val_em": m["em"],
        "val_acc": m["acc"],
        "val_n": m["n"],
        "recall_retrieved": recall("retrieved_titles"),
        "recall_shown": recall("selected_titles"),
        "llm_calls": calls / max(len(preds), 1),
        "machine": ca.machine(),
        "settings": settings,
    }


def has_gold_paragraphs(settings: dict) -> bool:
    """Whether the validation records of `settings` carry their gold paragraphs (the `context` oracle needs them;
    the synthetic world's records do not: its paragraphs are only in its corpus)."""
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.data.spec import load_data

    cfg = load_config(TrainConfig, demo_config_path(), settings["overrides"])
    return any(any(found) for e in load_data(cfg.val_data)[: settings["val_limit"]] for found in e.supporting_context)


def run_oracles(folder: Path, seeds: list[int], settings: dict, parallel: int) -> None:
    """Each seed's warm start (trained first where missing) validated under each oracle, in this process; a
    finished oracle is not run again."""
    from mhgpo.config import TrainConfig, demo_config_path, load_config
    from mhgpo.data.spec import load_data
    from mhgpo.model.trained import run_model_spec
    from mhgpo.run.evaluate import evaluate_validation

    ca.run_rows(["warm"], seeds, folder, settings, parallel)
    carries_paragraphs = has_gold_paragraphs(settings)  # the same validation records for every seed
    examples: dict | None = None
    for seed in seeds:
        for name, (roles, _) in ORACLES.items():
            path = ca.result_path(folder, oracle_row(name), seed)
            if ca.load_result(path, settings) is not None:
                continue
            if "context" in roles and not carries_paragraphs:
                print(f"oracle {name}: left out, the validation records carry no paragraphs", flush=True)
                continue
            with tempfile.TemporaryDirectory() as run_dir:
                cfg = load_config(
                    TrainConfig,
                    demo_config_path(),
                    ca.row_settings("warm", seed, settings["val_limit"], folder, settings["overrides"], run_dir),
                )
                model = run_model_spec(cfg.model, Path(run_dir))
                result = evaluate_validation(cfg, model, desc=f"oracle {name} seed {seed}", oracle=roles)
            examples = examples or {e.id: e for e in load_data(cfg.val_data)}
            atomic_write_json(path, oracle_result(name, seed, result, examples, settings))
            print(f"oracle {name} seed {seed}: F1 {result.metrics['f1']:.1f}", flush=True)


def table_rows(names: list[str]) -> list[str]:
    """The rows of the named tables, each once, in table order."""
    rows: list[str] = []
    for name in names:
        rows += [r for r in TABLES[name].rows if r not in rows]
    return rows


def data_overrides(data: str, val_data: str | None) -> list[str]:
    """`--data synthetic` (the demo's synthetic:train and synthetic:dev) or `--data TRAIN --val-data VAL`."""
    if data == "synthetic" and val_data is None:
        return []
    if val_data is None:
        raise ValueError(
            f"--data {data}: give the validation questions too (--val-data SPEC; `mhgpo data split` "
            "cuts disjoint parts of one file)"
        )
    return [f"data={data}", f"val_data={val_data}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names_all = [*TABLES, ORACLE_TABLE]
    parser.add_argument("--table", default=",".join(names_all), help=f"comma-separated: {', '.join(names_all)}")
    parser.add_argument(
        "--rows",
        nargs="+",
        help="run only these of the tables' rows (comma- or space-separated; a "
        "row with its own settings after @ is one item; e.g. a smoke test)",
    )
    parser.add_argument("--seeds", default=DEFAULTS["seeds"])
    parser.add_argument("--minutes", type=float, default=DEFAULTS["minutes"])
    parser.add_argument("--clock", choices=["cpu", "wall"], default=DEFAULTS["clock"])
    parser.add_argument("--val-limit", type=int, default=DEFAULTS["val_limit"])
    parser.add_argument("--data", default="synthetic", metavar="SPEC", help="training questions (a data SPEC)")
    parser.add_argument("--val-data", metavar="SPEC", help="validation questions (with --data other than synthetic)")
    parser.add_argument("--parallel", type=int, default=DEFAULTS["parallel"])
    parser.add_argument("--out", default="runs/reproduce")
    parser.add_argument("--doc", default=str(DOC), help="the document written (default docs/reproduction.md)")
    parser.add_argument("--doc-only", action="store_true", help="only rewrite the document from OUT's results")
    parser.add_argument("overrides", nargs="*", help="key=value settings of every row")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.doc_only:
        names = [n for n in args.table.split(",") if n]
        unknown = [n for n in names if n not in names_all]
        if unknown or not names:
            parser.error(f"--table: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(names_all)}")
        try:
            overrides = data_overrides(args.data, args.val_data) + args.overrides
            seeds = [int(s) for s in args.seeds.split(",")]
        except ValueError as e:
            parser.error(str(e))
        settings = ca.settings_of(args.minutes, args.clock, args.val_limit, overrides)
        folder = out / data_tag(args.data, args.val_data)
        rows = table_rows([n for n in names if n != ORACLE_TABLE])
        if args.rows:
            only = ca.split_rows(args.rows)
            if any(r not in rows for r in only):
                parser.error(f"--rows: {', '.join(r for r in only if r not in rows)} not in the tables' rows")
            rows = [r for r in rows if r in only]
        if rows:
            ca.run_rows(rows, seeds, folder, settings, args.parallel)
        if ORACLE_TABLE in names and not args.rows:
            run_oracles(folder, seeds, settings, args.parallel)
    text = write_doc(out, Path(args.doc), args.out)
    print(text)


if __name__ == "__main__":
    main()
