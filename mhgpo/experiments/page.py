"""The page of the paper's comparisons (docs/reproduction.md) from the results in an output folder.

Each table (`mhgpo.experiments.claims`) has a heading of its name, what it asks, and a part per data set where a row
of its own ran: the command, machine, seeds and budget, its rows (mean ± std over seeds, paired differences against the
reference) in up to three tables (in domain, out of domain, cost), and the paper's directions beside ours; a table
that never ran is "not run" with the command that runs it. How the tables are made is the page's last section. The
prose is in `page.md` beside this module, one block per part with `$placeholders`; the tables' cells are made here.
"""

from __future__ import annotations

import re
import string
from functools import cache
from importlib import resources
from pathlib import Path

from mhgpo.config.rows import RowTable
from mhgpo.experiments.claims import (
    METRICS,
    ORACLE_TABLE,
    ORACLE_TITLE,
    ORACLES,
    TABLES,
    Claim,
    Table,
    oracle_key,
    own_rows,
    split_key,
)
from mhgpo.experiments.curve_page import curves_markdown
from mhgpo.experiments.results import collect, data_folders, data_specs
from mhgpo.experiments.stats import (
    Results,
    fmt,
    ood_f1,
    paired,
    per_question,
    question_diffs,
    resolution,
    seconds_per_step,
    verdict,
)
from mhgpo.io import atomic_write_text

DEFAULTS = {"seeds": "0,1,2", "minutes": 10.0, "clock": "cpu", "val_limit": 100, "parallel": 2}
BLOCK = "<!-- block "
PARTIAL = "**Partial**"  # how the page marks a part run only in part (the block `partial`)
CARRIED_FROM = "*Carried over from the page as it was: "
CARRIED = CARRIED_FROM + "the results behind this part are not in the output folder.*"
CARRIED_PARTIAL = CARRIED_FROM + "the output folder holds {found} of the {needed} results of a part of its own.*"


_MARKUP = str.maketrans({c: "\\" + c for c in "\\`*_[]<>|&#~!"})


def md(value: object) -> str:
    """A string from a result file or the settings (a machine, a data spec) as page text: on one line, its markdown
    and HTML characters escaped (it can neither break a table nor add a link, an image or a tag)."""
    return " ".join(str(value).split()).translate(_MARKUP)


def code(text: str) -> str:
    """`text` as an inline code span (on one line; fenced by more backticks than any run of them inside)."""
    text = " ".join(text.split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def previous_parts(text: str | None) -> dict[str, dict[str, str]]:
    """The parts of an earlier page: {table name: {data title: its text}} (a part is a `### ` heading and what
    follows, up to the next heading), so that a part whose results are not in the output folder is kept, not
    replaced by "not run" (results run elsewhere, or before they were kept with the project)."""
    parts: dict[str, dict[str, str]] = {}
    table, title, lines = None, None, []

    def close() -> None:
        if table is not None and title is not None:
            body = "\n".join(line for line in lines if not line.startswith(CARRIED_FROM)).strip("\n")
            parts.setdefault(table, {})[title] = body

    for line in (text or "").splitlines():
        if line.startswith("## "):
            close()
            table, title, lines = line[3:].partition(":")[0].strip(), None, []
        elif line.startswith("### "):
            close()
            title, lines = line[4:].strip(), []
        elif title is not None:
            lines.append(line)
    close()
    return parts


@cache
def blocks() -> dict[str, string.Template]:
    """The template's blocks by name (`page.md`, shipped with the package)."""
    text = resources.files("mhgpo.experiments").joinpath("page.md").read_text(encoding="utf-8")
    found: dict[str, string.Template] = {}
    for part in text.split("\n" + BLOCK)[1:]:
        head, _, body = part.partition("\n")
        found[head.removesuffix(" -->").strip()] = string.Template(body.rstrip("\n"))
    return found


def fill(block: str, **values: object) -> str:
    """The template's `block` with its placeholders filled in."""
    return blocks()[block].substitute({k: str(v) for k, v in values.items()})


def contents() -> str:
    """The page's list of its tables, each with what it asks."""
    tables = [(t.name, t.title) for t in TABLES.values()] + [(ORACLE_TABLE, ORACLE_TITLE)]
    return "\n".join(fill("contents", name=name, title=title) for name, title in tables)


def _column_group(header: str) -> int:
    """Which of a part's tables a row table's column is shown in: 0 in domain (the validation), 1 out of domain
    (the other data sets), 2 cost (the rest)."""
    if header in ("seeds", "steps", "val F1", "val Acc", "val EM") or header.startswith("Δ F1"):
        return 0
    if header.endswith(" F1") or header.startswith(("OOD avg", "Δ OOD")):
        return 1
    return 2


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().removeprefix("|").removesuffix("|").split("|")]


def split_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A row table's columns as up to three tables (in domain, out of domain, cost: `_column_group`), each
    starting with the row's name, one blank line between them."""
    lines: list[str] = []
    for group in range(3):
        columns = [0, *(i for i in range(1, len(header)) if _column_group(header[i]) == group)]
        if len(columns) > 1:
            lines += ["", _line(header[i] for i in columns), "|" + "---|" * len(columns)]
            lines += [_line(row[i] for i in columns) for row in rows]
    return lines[1:]


def relayout(body: str) -> str:
    """A carried part's text with each row table that mixes the column groups (as the page had them in one table)
    split as :func:`split_table` splits a part's own; its cells as they were."""
    lines, out, i = body.split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            header = _cells(lines[i])
            if header[0] in ("row", "oracle") and len({_column_group(h) for h in header[1:]}) > 1:
                out += split_table(header, [_cells(line) for line in lines[i + 2 : end]])
            else:
                out += lines[i:end]
            i = end
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


def command(table: str, settings: dict | None, seeds: list[int] | None, out: str, evals: dict | None = None) -> str:
    """The command that (re)runs `table` under `settings` (the defaults for a table not run)."""
    s = settings or {k: DEFAULTS[k] for k in ("minutes", "clock", "val_limit")} | {"overrides": []}
    seeds_text = ",".join(map(str, seeds)) if seeds else DEFAULTS["seeds"]
    data = data_specs(s["overrides"])
    rest = [kv for kv in s["overrides"] if kv.partition("=")[0] not in ("data", "val_data")]
    flags = f" --data {data['data']} --val-data {data['val_data']}" if len(data) == 2 else ""
    flags += f" --scale {s['scale']}" if "scale" in s else ""
    more = "".join(f" --eval {name}={spec}" for name, spec in (evals or {}).items())
    more += "".join(f" {kv}" for kv in rest)
    return (
        f"mhgpo reproduce --table {table} --seeds {seeds_text} --minutes {s['minutes']:g} --clock {s['clock']} "
        f"--val-limit {s['val_limit']} --parallel {DEFAULTS['parallel']}{flags} --out {out}{more}"
    )


def data_title(settings: dict) -> str:
    """The data a folder's results were trained and validated on, in words."""
    data = data_specs(settings["overrides"])
    if not data:
        return fill("synthetic")
    return fill("data", data=md(data.get("data")), val_data=md(data.get("val_data")))


def _part(found: list[dict], settings: dict, seeds: list[int], command_text: str, budget: str) -> list[str]:
    mach = found[0].get("machine") or {}
    machine = f"{md(mach.get('cpu', 'unknown'))}, {md(mach.get('cores', '?'))} cores" + (
        f", {md(mach['gpu'])}" if mach.get("gpu") else ""
    )
    text = fill(
        "part",
        data=data_title(settings),
        command=code(command_text),
        machine=machine,
        seeds=", ".join(map(str, seeds)),
        budget=budget,
    )
    return text.split("\n")


def _settings(by_row: Results) -> dict | None:
    """The settings a data folder's results ran under (None for a folder without results)."""
    return next((res["settings"] for results in by_row.values() for res in results.values()), None)


def table_markdown(
    table: Table, by_data: list[Results], out: str, rows: RowTable | None = None, kept: dict[str, str] | None = None
) -> str:
    """One table's section: a part per data set that ran a row of its own; or "not run" and the command. `kept`:
    the parts of an earlier page by data title, kept where no result here replaces them (results that fill a part
    only in part do not replace a complete one)."""
    lines = [fill("heading", name=table.name, title=table.title), ""]
    own = own_rows(table)
    kept = {t: body for t, body in (kept or {}).items() if "Machine:" in body}
    ran, titles, markers = [], set(), {}
    for by_row in by_data:
        if not any(by_row.get(r) for r in own):
            continue
        title = data_title(_settings(by_row))
        titles.add(title)
        found, needed = _coverage(table, by_row)
        if found < needed and title in kept and PARTIAL not in kept[title]:
            # a part run only in part does not replace the complete one the page had for its data set
            markers[title] = CARRIED_PARTIAL.format(found=found, needed=needed)
        else:
            ran.append(by_row)
    carried = {t: (markers.get(t, CARRIED), body) for t, body in kept.items() if t not in titles or t in markers}
    if not ran and not carried:
        directions = "; ".join(f"{c.paper} (`{c.row}` {c.direction} `{c.than}`)" for c in table.claims)
        lines += [fill("not_run", command=command(table.name, None, None, out), directions=directions), ""]
        return "\n".join(lines)
    for title, (marker, body) in carried.items():
        lines += [f"### {title}", "", marker, "", relayout(body), ""]
    for by_row in ran:
        lines += _table_body(table, by_row, out, rows)
    not_ran = [
        data_title(_settings(by_row))
        for by_row in by_data
        if not any(by_row.get(r) for r in own) and _settings(by_row) and data_title(_settings(by_row)) not in carried
    ]
    if not_ran:
        lines += [fill("not_run_on", data="; ".join(not_ran)), ""]
    return "\n".join(lines)


def _own_budget(rows: RowTable | None, key: str) -> float | None:
    row, other = split_key(key)
    if rows is None or other or row not in rows.rows:
        return None
    return rows.row(row).overrides.get("budget_minutes")


def _evals(found: list[dict]) -> dict[str, str]:
    """The other data sets the results were evaluated on: {name: spec}, in the order first found."""
    names: dict[str, str] = {}
    for res in found:
        for name, entry in (res.get("ood") or {}).items():
            names.setdefault(name, entry["data"])
    return names


def _missing(table: Table, by_row: Results) -> list[str]:
    """The (row, seed) results of `table` a data folder lacks, over the seeds it has any of the table's rows for."""
    seeds = sorted({seed for r in table.rows for seed in by_row.get(r, {})})
    return [f"{r} seed {s}" for r in table.rows for s in seeds if s not in by_row.get(r, {})]


def _coverage(table: Table, by_row: Results) -> tuple[int, int]:
    """How many of `table`'s (row, seed) results a data folder holds, of how many its part needs."""
    found = sum(len(by_row.get(r, {})) for r in table.rows)
    return found, found + len(_missing(table, by_row))


def _table_body(table: Table, by_row: Results, out: str, rows: RowTable | None) -> list[str]:
    found = [res for r in table.rows for res in by_row.get(r, {}).values()]
    settings = found[0]["settings"]
    seeds = sorted({res["seed"] for res in found})
    missing = _missing(table, by_row)
    budgets = [(r, b) for r in table.rows if (b := _own_budget(rows, r))]
    evals = _evals(found)
    budget = fill(
        "budget",
        minutes=f"{settings['minutes']:g}",
        clock=md(settings["clock"]),
        own=f" ({'; '.join(f'`{r}`: {b:g}' for r, b in budgets)})" if budgets else "",
        val_limit=settings["val_limit"],
        partial=fill("partial", missing=", ".join(missing)) if missing else "",
    )
    lines = _part(found, settings, seeds, command(table.name, settings, seeds, out, evals), budget)
    extra = [header for header, _ in table.columns] + [f"{md(name)} F1" for name in evals]
    if evals:  # the paper's OOD average beside the validation (ID) F1, and its paired difference
        extra += [f"OOD avg F1 ({', '.join(map(md, evals))})"] if len(evals) > 1 else []
        extra += [f"Δ OOD F1 vs {table.reference} (paired)"]
    header = ["row", "seeds", "steps", "val F1", "val Acc", f"Δ F1 vs {table.reference} (paired)", "s / step"]
    header += ["peak MB", "LLM calls / question", "trained samples / question", *extra]
    lines += ["", *split_table(header, [_row_cells(table, by_row, row, list(evals)) for row in table.rows])]
    lines += ["", "| paper | comparison | ours (paired, mean ± std) | verdict |", "|---|---|---|---|"]
    for c in table.claims:
        diffs = paired(by_row, c.row, c.than, c.metric)
        left = len(paired(by_row, c.row, c.than, c.metric, finite=False)) - len(diffs)
        note = f" ({left} seed{'s' * (left > 1)} with a NaN or infinite result left out)" if left else ""
        lines.append(
            f"| {c.paper} | `{c.row}` {c.direction} `{c.than}` ({METRICS[c.metric]}) | "
            f"{fmt(diffs, 2)} | {verdict(c.direction, diffs, resolution(by_row, c), _questions(by_row, c))}{note} |"
        )
    return lines + [""]


def _questions(by_row: Results, claim: Claim) -> list[float] | None:
    """A validation claim's per-(seed, question) differences (None for a cost claim)."""
    key = {"val_f1": "f1", "val_acc": "acc"}.get(claim.metric)
    return question_diffs(by_row, claim.row, claim.than, key) if key else None


def _row_cells(table: Table, by_row: Results, row: str, evals: list[str]) -> list[str]:
    rs = list(by_row.get(row, {}).values())
    delta = "—" if row == table.reference else fmt(paired(by_row, row, table.reference))

    def values(f) -> list[float]:
        return [v for v in map(f, rs) if v is not None]

    def ood(r: dict) -> float | None:
        return ood_f1(r, evals)

    cells = [
        f"`{row}`",
        str(len(rs)),
        fmt([r["steps"] for r in rs]),
        fmt([r["val_f1"] for r in rs]),
        fmt([r["val_acc"] for r in rs]),
        delta,
        fmt(values(seconds_per_step)),
        fmt(values(lambda r: r.get("peak_mb")), 0),
        fmt(values(lambda r: per_question(r, "llm_calls")), 2),
        fmt(values(lambda r: per_question(r, "samples")), 2),
        *(fmt(values(lambda r, key=key: per_question(r, key)), 2) for _, key in table.columns),
        *(fmt(values(lambda r, n=n: ((r.get("ood") or {}).get(n) or {}).get("f1"))) for n in evals),
        *([fmt(values(ood))] if len(evals) > 1 else []),
        *(["—" if row == table.reference else fmt(paired(by_row, row, table.reference, ood))] if evals else []),
    ]
    return cells


def oracle_markdown(by_data: list[Results], out: str, kept: dict[str, str] | None = None) -> str:
    """The oracles' section: per data set, each oracle's validation (mean ± std over seeds), its paired gain over
    the team as it is, the gold paragraphs' recall in what was retrieved and in what the Answerer was shown. `kept`:
    an earlier page's parts, as for :func:`table_markdown`."""
    described = "; ".join(f"`{n}`: {text}" for n, (_, text) in ORACLES.items())
    lines = [fill("oracles", title=ORACLE_TITLE, oracles=described), ""]
    ran = [by_row for by_row in by_data if any(by_row.get(oracle_key(n)) for n in ORACLES)]
    titles = {data_title(_settings(by_row)) for by_row in ran}
    for title, body in (kept or {}).items():
        if title not in titles and "Machine:" in body:
            lines += [f"### {title}", "", CARRIED, "", relayout(body), ""]
    if not ran and len(lines) == 2:
        return "\n".join(lines + ["**Not run.** Command:", "", f"    {command(ORACLE_TABLE, None, None, out)}", ""])
    for by_row in ran:
        found = [res for n in ORACLES for res in by_row.get(oracle_key(n), {}).values()]
        settings = found[0]["settings"]
        seeds = sorted({res["seed"] for res in found})
        budget = fill("oracle_budget", val_limit=settings["val_limit"])
        lines += _part(found, settings, seeds, command(ORACLE_TABLE, settings, seeds, out), budget)
        header = ["oracle", "seeds", "val F1", "val Acc", "val EM", "Δ F1 vs none (paired)"]
        header += ["gold recall, retrieved", "gold recall, shown", "LLM calls / question"]
        cells = []
        for name in ORACLES:
            rs = list(by_row.get(oracle_key(name), {}).values())
            delta = "—" if name == "none" else fmt(paired(by_row, oracle_key(name), oracle_key("none")))

            def values(key: str, rs=rs) -> list[float]:
                return [r[key] for r in rs if r.get(key) is not None]

            cells.append(
                [f"`{name}`", str(len(rs)), fmt(values("val_f1")), fmt(values("val_acc")), fmt(values("val_em"))]
                + [delta, fmt(values("recall_retrieved")), fmt(values("recall_shown")), fmt(values("llm_calls"), 2)]
            )
        lines += ["", *split_table(header, cells)]
        lines.append("")
    return "\n".join(lines)


def page(
    out: Path,
    out_text: str | None = None,
    rows: RowTable | None = None,
    previous: str | None = None,
    images: Path | None = None,
    doc_dir: Path | None = None,
) -> str:
    """The page's text from every finished result in OUT's data folders; `out_text`: how its commands name OUT;
    `previous`: the page as it was, whose parts without results here are kept (:func:`previous_parts`); `images`:
    the folder the learning curves' plots are written into (none without it), linked relative to `doc_dir`."""
    folders = data_folders(out)
    by_data = [collect(folder) for folder in folders]
    shown = out_text or str(out)
    kept = previous_parts(previous)
    sections = "\n".join(table_markdown(t, by_data, shown, rows, kept.get(t.name)) for t in TABLES.values())
    named = [(f.name, data_title(s), r) for f, r in zip(folders, by_data) if (s := _settings(r)) is not None]
    curves = curves_markdown(named, images, doc_dir)
    oracles = oracle_markdown(by_data, shown, kept.get(ORACLE_TABLE))
    body = sections + "\n" + oracles + ("\n" + curves if curves else "")
    return fill("page", contents=contents(), sections=body)


def write_page(out: Path, doc: Path, out_text: str | None = None, rows: RowTable | None = None) -> str:
    """Write the page (:func:`page`) to `doc` atomically (a link there is replaced, not written through), keeping
    the parts of the page already there that no result in OUT replaces; the learning curves' plots beside it."""
    previous = doc.read_text(encoding="utf-8") if doc.is_file() and not doc.is_symlink() else None
    text = page(out, out_text, rows, previous, images=doc.parent / "images", doc_dir=doc.parent)
    atomic_write_text(doc, text)
    return text
