"""`mhgpo report`: read run directories and write `report.md`, `report.html` (images embedded) and PNG plots.

What a reader looks for in an RL run of a team of agents: the team (its agents and tools by name, how often each
is called), reward and validation F1 over steps (and by question form: yes/no, "A or B?", other), each agent's
format penalty and behaviour over steps (the measures its workflow logs), how similar the outputs inside a group
are (the paper's intra-group similarity), where the time and memory go, a results table in the layout of the
paper's Table 1, and example traces from the first and the last step. Anything missing from a run directory is
reported as missing.

Run directories may come from anyone: text taken from them (questions, outputs, answers, labels, folder names) is
escaped so that it cannot make markdown or HTML structure, and the HTML page embeds only the PNG plots this module
wrote, by name.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from mhgpo.config.load import read_yaml
from mhgpo.config.tables import algo_label
from mhgpo.errors import InputError
from mhgpo.io import atomic_write_bytes, atomic_write_text, read_json, read_jsonl
from mhgpo.run.html import to_html
from mhgpo.runtime.runlog import read_metrics

# Per-agent metrics that are not behaviour (plotted elsewhere or not at all); the rest of `<agent>/<name>` is.
NOT_BEHAVIOUR = ("reward", "penalty", "advantage_abs", "samples", "penalty_rate")


@dataclass
class Run:
    path: Path
    label: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    rollout_files: list[Path]
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> metrics.json content
    missing: list[str] = field(default_factory=list)


def _label(path: Path, config: dict[str, Any]) -> str:
    if not config:
        return path.name
    name = algo_label(str(config.get("algo", "mhgpo")), config.get("sampler"))
    system = str(config.get("system", "mas")).rpartition(":")[2]  # a workflow class: its name
    return f"{name}{'' if system == 'mas' else ' (' + system + ')'} [{path.name}]"


def load_run(path: Path) -> Run:
    """A training run directory, or an evaluation output directory (metrics.json alone)."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: not a run directory")
    cfg_path = path / "config.yaml"
    try:
        config = read_yaml(cfg_path) if cfg_path.exists() else {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise InputError(f"{cfg_path}: invalid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(config or {}, dict):
        raise InputError(f"{cfg_path}: expected a mapping of config keys")
    run = Run(
        path,
        _label(path, config or {}),
        config or {},
        read_metrics(path),
        sorted(p for p in (path / "rollouts").glob("step_*.jsonl") if re.fullmatch(r"step_\d+", p.stem)),
    )
    if config or (path / "metrics.jsonl").exists():  # a training run: say what it lacks
        if not run.metrics:
            run.missing.append("training metrics (metrics.jsonl)")
        if not run.rollout_files:
            run.missing.append("rollout records (rollouts/)")
    found = [c / "metrics.json" for c in [path, *(p for p in path.iterdir() if p.is_dir())]]
    for m in sorted((f for f in found if f.exists()), key=lambda f: f.stat().st_mtime):  # in the order run
        content = read_json(m)
        if isinstance(content, dict) and all(isinstance(content.get(k), (int, float)) for k in ("acc", "em", "f1")):
            run.evals[m.parent.name if m.parent != path else "eval"] = content  # (not a retrieval evaluation)
    if not run.evals:
        run.missing.append("evaluation results (metrics.json)")
    return run


# --------------------------------------------------------------------------------------------- measures


def token_f1(a: str, b: str) -> float:
    """Token-overlap F1 of two texts (lower-cased whitespace tokens); 1.0 for two empty texts."""
    ta, tb = a.lower().split(), b.lower().split()
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    p, r = common / len(ta), common / len(tb)
    return 2 * p * r / (p + r)


def _rows(path: Path) -> list[dict[str, Any]]:
    return read_jsonl(path)[0]


def _checked(path: Path, measure, *args: Any) -> Any:
    """`measure(rows of path, *args)`, or an InputError naming a rollout file that lacks what it needs."""
    try:
        return measure(_rows(path), *args)
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise InputError(f"{path}: not a rollout record file of mhgpo ({type(e).__name__}: {e})") from None


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|&~])")


def md_text(value: Any) -> str:
    """Text from a run, made inert for markdown: one line (whitespace collapsed, so it never starts a line) with
    every character that could start inline structure (links, images, code, emphasis, tags, cells) escaped."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(str(value).split()))


def intra_group_similarity(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per agent: the mean over trained groups of the mean pairwise token F1 between the group's outputs."""
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("trained") and r.get("kind", "llm") == "llm":
            groups[r["group_id"]].append(r)
    per_agent: dict[str, list[float]] = defaultdict(list)
    for members in groups.values():
        pairs = [token_f1(a["output"], b["output"]) for a, b in itertools.combinations(members, 2)]
        if pairs:
            per_agent[members[0]["agent"]].append(float(np.mean(pairs)))
    return {agent: float(np.mean(v)) for agent, v in per_agent.items()}


def traces(rows: list[dict[str, Any]], limit: int = 2) -> list[dict[str, Any]]:
    """Up to `limit` root-to-leaf paths (one per question): each agent's output, the answer and the gold."""
    by_key = {(r["question_id"], r["node_id"]): r for r in rows}
    out, seen = [], set()
    for r in rows:
        if "final_answer" not in r or r["question_id"] in seen:
            continue
        seen.add(r["question_id"])
        chain, node = [], r
        while node is not None:
            chain.append(node)
            node = by_key.get((node["question_id"], node["parent_id"]))
        steps = [
            (n["agent"], n["output"] if isinstance(n["output"], str) else json.dumps(n["output"]))
            for n in reversed(chain)
        ]
        out.append(
            {
                "question": r.get("question", ""),
                "steps": steps,
                "answer": r["final_answer"],
                "gold": r.get("answers", []),
                "reward": r.get("terminal_reward"),
            }
        )
        if len(out) >= limit:
            break
    return out


def run_agents(run: Run) -> list[str]:
    """The run's agents in the workflow's order (the order its per-agent metrics were logged in)."""
    return list(dict.fromkeys(k[: -len("/penalty")] for m in run.metrics for k in m if k.endswith("/penalty")))


def team_summary(run: Run) -> list[str]:
    """One line per agent and tool of the run's team: calls per question and the most visits on one path, from
    the last step's rollout records."""
    if not run.rollout_files:
        return []
    return _checked(run.rollout_files[-1], _team_lines, run_agents(run))


def _team_lines(rows: list[dict[str, Any]], agents: list[str]) -> list[str]:
    questions = max(len({r["question_id"] for r in rows}), 1)
    calls: dict[str, int] = Counter(r["agent"] for r in rows)
    visits: dict[str, int] = defaultdict(int)
    kinds: dict[str, str] = {}
    for r in rows:
        visits[r["agent"]] = max(visits[r["agent"]], int(r.get("visit", 0)) + 1)
        kinds[r["agent"]] = r.get("kind", "llm")
    order = [a for a in agents if a in calls] + [a for a in calls if a not in agents]
    return [
        f"- *{md_text(a)}* ({'agent' if kinds[a] == 'llm' else 'tool'}): {calls[a] / questions:.1f} calls per "
        f"question, up to {visits[a]} per path"
        for a in order
    ]


# ------------------------------------------------------------------------------------------------ plots


def _plain(label: str) -> str:
    """A legend label that matplotlib shows as it is (a `$` would start math text)."""
    return label.replace("$", r"\$")


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    pts = [(m["step"], m[key]) for m in run.metrics if m.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(ncols: int):
    fig, axes = _grid(1, ncols)
    return fig, axes[0]


def _grid(nrows: int, ncols: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False)


def _save(fig, path: Path) -> Path:
    """The figure as a PNG at `path`, written atomically: a link planted there is replaced, never followed."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, png.getvalue())


def plot_runs(runs: list[Run], out: Path) -> dict[str, Path]:
    """Every plot the data allows; returns {name: png path}."""
    trained = [r for r in runs if r.metrics]
    if not trained:
        return {}
    agents = list(dict.fromkeys(a for r in trained for a in run_agents(r)))
    figures = {  # each drawn and saved in turn (one figure open at a time); None: nothing to plot
        "reward_and_val_f1": lambda: _plot_reward_and_val_f1(trained),
        "learning": lambda: _plot_learning(trained),
        "question_forms": lambda: _plot_forms(trained),
        "penalties": lambda: _plot_penalties(trained, agents),
        "behaviour": lambda: _plot_behaviour(trained, agents),
        "intra_group_similarity": lambda: _plot_similarity(trained),
        "cost": lambda: _plot_cost(trained),
    }
    plots: dict[str, Path] = {}
    for name, draw in figures.items():
        fig = draw()
        if fig is not None:
            plots[name] = _save(fig, out / f"{name}.png")
    return plots


def moving_average(ys: list[float], window: int) -> list[float]:
    """The mean of each value with the up to `window - 1` values before it (a trailing moving average)."""
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def smoothing_window(n: int) -> int:
    """Steps per trailing mean in the training curves and per end of the training summary: a third of the run
    (rounded up), at most half of it, at least 1."""
    return max(1, min(n // 2, math.ceil(n / 3)))


def _stage_f1(run: Run, label: str) -> float | None:
    found = [m["f1"] for m in run.evals.values() if m.get("label") == label]
    return found[0] if found else None


def _plot_reward_and_val_f1(trained: list[Run]):
    """Training reward over steps (each step's value as a point, a trailing mean as the line) and validation F1:
    the untrained team and the warm-started team as points of their own at step 0, RL's validations as a line from
    the team it started from."""
    fig, (ax1, ax2) = _figure(2)
    for r in trained:
        xs, ys = _series(r, "reward/mean")
        points = ax1.plot(xs, ys, ".", alpha=0.35)[0]
        ax1.plot(xs, moving_average(ys, smoothing_window(len(ys))), color=points.get_color(), label=_plain(r.label))
        xs, ys = _series(r, "val/f1")
        untrained, warm = _stage_f1(r, "untrained"), _stage_f1(r, "warm start")
        if warm is not None:  # RL starts from the warm-started team
            xs, ys = [0, *xs], [warm, *ys]
        line = ax2.plot(xs, ys, marker="o", label=_plain(f"{r.label}: RL"))[0] if xs else None
        color = line.get_color() if line is not None else None
        if warm is not None:
            ax2.plot(
                [0],
                [warm],
                marker="s",
                linestyle="none",
                color=color,
                markersize=8,
                label=_plain(f"{r.label}: warm start"),
            )
        if untrained is not None:
            ax2.plot(
                [0],
                [untrained],
                marker="x",
                linestyle="none",
                color=color,
                markersize=9,
                label=_plain(f"{r.label}: untrained"),
            )
    ax1.set(title="training reward (points: steps; line: trailing mean)", xlabel="RL step", ylabel="reward")
    ax2.set(title="validation F1 (step 0: before RL)", xlabel="RL step", ylabel="F1 (%)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    return fig


def training_summary(metrics: list[dict[str, Any]], key: str = "reward/mean") -> str:
    """`key` over the first and the last `smoothing_window` steps: mean ± std and the steps."""
    pts = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
    if not pts:
        return f"no {key}"
    k = smoothing_window(len(pts))

    def part(rows: list[tuple[int, float]]) -> str:
        vals = [v for _, v in rows]
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
        steps = f"step {rows[0][0]}" if len(rows) == 1 else f"steps {rows[0][0]}–{rows[-1][0]}"
        return f"{mean:.3f} ± {std:.3f} ({steps})" if len(rows) > 1 else f"{mean:.3f} ({steps})"

    return part(pts) if len(pts) == 1 else f"{part(pts[:k])} → {part(pts[-k:])}"


def budget_note(run: Run) -> str:
    """What a run's time budget (`budget_minutes`) did: stopped the run at a step, or left it to its `steps`."""
    minutes, clock = run.config.get("budget_minutes"), run.config.get("budget_clock", "cpu")
    used = [m for m in run.metrics if isinstance(m.get("budget/minutes_used"), (int, float))]
    if not isinstance(minutes, (int, float)) or not used:
        return ""
    last = used[-1]
    what = (
        f"stopped by its time budget at step {last['step']}"
        if last.get("budget/stopped")
        else f"ended within its time budget at step {last['step']}"
    )
    return f" The run {what}: {last['budget/minutes_used']:.1f} of {minutes:g} {md_text(clock)} minutes used."


def _plot_learning(trained: list[Run]):
    """Validation F1 against the steps' CPU minutes (machine time, comparable between algorithms whose steps cost
    differently), and the epoch-paired train reward: each revisited question's reward minus its first visit's, a
    rise that which questions a step drew cannot fake (None for runs logged without either)."""
    have = [r for r in trained if any("seconds/cpu_steps" in m for m in r.metrics)]
    if not have:
        return None
    fig, (ax1, ax2) = _figure(2)
    for r in have:
        cpu = {m["step"]: m["seconds/cpu_steps"] / 60 for m in r.metrics if "seconds/cpu_steps" in m}
        pts = [(cpu[m["step"]], m["val/f1"]) for m in r.metrics if "val/f1" in m and m["step"] in cpu]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=_plain(r.label))
        ax2.plot(*_series(r, "reward/revisit_delta"), marker=".", label=_plain(r.label))
    ax2.axhline(0.0, color="0.6", lw=0.8)
    ax1.set(
        title="validation F1 by CPU minutes of training", xlabel="CPU minutes (rollouts and updates)", ylabel="F1 (%)"
    )
    ax2.set(
        title="train reward on a revisit minus the first visit", xlabel="RL step", ylabel="Δ reward (same questions)"
    )
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    return fig


FORM_LINES = {"yes_no": "-", "choice": "--", "other": ":"}  # a question form's line style


def _plot_forms(trained: list[Run]):
    """Validation F1 by question form over steps (`val/form/FORM/f1`: yes/no, "A or B?", other) and the share of
    the comparison answers that are a constant ("yes", option B: `mhgpo.data.forms`); None for runs logged
    without them. A rise on the comparison questions with the share going to 1 is a constant answer, not reading."""
    have = [r for r in trained if any(k.startswith("val/form/") for m in r.metrics for k in m)]
    if not have:
        return None
    fig, (ax1, ax2) = _figure(2)
    for r in have:
        color = None
        for form, style in FORM_LINES.items():
            xs, ys = _series(r, f"val/form/{form}/f1")
            if xs:
                line = ax1.plot(xs, ys, style, marker="o", color=color, label=_plain(f"{r.label}: {form}"))[0]
                color = line.get_color()
        for key, style, what in (("yes_no/yes_share", "-", "'yes'"), ("choice/second_share", "--", "option B")):
            xs, ys = _series(r, f"val/form/{key}")
            if xs:
                line = ax2.plot(xs, ys, style, marker="o", color=color, label=_plain(f"{r.label}: {what}"))[0]
                color = line.get_color()
    ax1.set(title="validation F1 by question form", xlabel="RL step", ylabel="F1 (%)")
    ax2.set(title="share of comparison answers that are a constant", xlabel="RL step", ylabel="share", ylim=(0, 1.05))
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    return fig


def _plot_penalties(trained: list[Run], agents: list[str]):
    """Each agent's mean format penalty over steps (None without agents)."""
    if not agents:
        return None
    fig, axes = _figure(len(agents))
    for ax, agent in zip(axes, agents):
        for r in trained:
            ax.plot(*_series(r, f"{agent}/penalty"), marker=".", label=_plain(r.label))
        ax.set(title=f"{agent}: format penalty", xlabel="step", ylabel="mean penalty")
        ax.legend(fontsize=7)
    return fig


def _plot_behaviour(trained: list[Run], agents: list[str]):
    """One row per agent, one panel per behaviour measure its workflow logs (None when none does)."""
    measures = {
        a: list(
            dict.fromkeys(
                k.split("/", 1)[1]
                for r in trained
                for m in r.metrics
                for k in m
                if k.startswith(f"{a}/") and k.split("/", 1)[1] not in NOT_BEHAVIOUR
            )
        )
        for a in agents
    }
    rows = [(a, names) for a, names in measures.items() if names]
    if not rows:
        return None
    fig, axes = _grid(len(rows), max(len(names) for _, names in rows))
    for ax_row, (agent, names) in zip(axes, rows):
        for i, ax in enumerate(ax_row):
            if i >= len(names):
                ax.set_visible(False)
                continue
            for r in trained:
                ax.plot(*_series(r, f"{agent}/{names[i]}"), marker=".", label=_plain(r.label))
            ax.set(title=f"{agent}: {names[i].replace('_', ' ')}", xlabel="step")
            ax.legend(fontsize=7)
    return fig


def _plot_similarity(trained: list[Run]):
    """Each agent's intra-group similarity over the saved rollout steps (None without rollouts)."""
    sims = {
        r.label: [(int(p.stem.split("_")[1]), _checked(p, intra_group_similarity)) for p in r.rollout_files]
        for r in trained
        if r.rollout_files
    }
    sim_agents = sorted({a for v in sims.values() for _, s in v for a in s})
    if not sim_agents:
        return None
    fig, axes = _figure(len(sim_agents))
    for ax, agent in zip(axes, sim_agents):
        for label, points in sims.items():
            pts = [(step, s[agent]) for step, s in points if agent in s]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=_plain(label))
        ax.set(title=f"{agent}: intra-group similarity", xlabel="step", ylabel="mean pairwise token F1", ylim=(0, 1.05))
        ax.legend(fontsize=7)
    return fig


def _plot_cost(trained: list[Run]):
    """Seconds per step (rollout and update) per run, and peak memory over steps."""
    fig, (ax1, ax2) = _figure(2)
    labels = [_plain(r.label) for r in trained]
    roll = [float(np.mean(_series(r, "seconds/rollout")[1] or [0])) for r in trained]
    upd = [float(np.mean(_series(r, "seconds/train")[1] or [0])) for r in trained]
    x = np.arange(len(trained))
    ax1.bar(x, roll, label="rollout")
    ax1.bar(x, upd, bottom=roll, label="update")
    ax1.set_xticks(x, labels, rotation=15, fontsize=7)
    ax1.set(title="seconds per step", ylabel="s")
    ax1.legend(fontsize=7)
    for r in trained:
        ax2.plot(*_series(r, "memory/peak_mb"), marker=".", label=_plain(r.label))
    ax2.set(title="peak memory", xlabel="step", ylabel="MB")
    ax2.legend(fontsize=7)
    return fig


def results_table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """Paper Table 1 layout: one row per (run, evaluation), Acc/EM/F1 per dataset, then the averages."""
    datasets: list[str] = []
    rows: list[tuple[str, dict[str, dict[str, float]]]] = []
    for r in runs:
        for name, m in r.evals.items():
            ds = md_text(m.get("data", "data"))
            if ds not in datasets:
                datasets.append(ds)
            label = f"{r.label} / {m.get('label', name)}"
            if "checkpoint" in m and "label" not in m:  # `mhgpo eval --model RUN`: which trained model
                label += f" ({Path(str(m.get('model', ''))).name} step {m.get('step', '?')})"
            label = md_text(label)
            rows.append((label, {ds: m}))
    header = ["run"] + [f"{ds} {k}" for ds in datasets for k in ("Acc", "EM", "F1")] + ["avg Acc", "avg EM", "avg F1"]
    body = []
    for label, per_ds in rows:
        cells, acc = [label], defaultdict(list)
        for ds in datasets:
            m = per_ds.get(ds)
            for k in ("acc", "em", "f1"):
                if m is None:
                    cells.append("–")
                else:
                    cells.append(f"{m[k]:.1f}")
                    acc[k].append(m[k])
        cells += [f"{np.mean(acc[k]):.1f}" if acc[k] else "–" for k in ("acc", "em", "f1")]
        body.append(cells)
    return header, body


def _md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]  # cells are numbers or md_text
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ writer


def build_report(run_dirs: list[Path], out: Path) -> Path:
    """Write report.md, report.html and the plots for these run (or evaluation) directories into `out`."""
    runs = [load_run(Path(p)) for p in run_dirs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_runs(runs, out)
    header, body = results_table(runs)
    md = ["# mhgpo report", "", "Runs: " + ", ".join(f"{md_text(r.path)} ({md_text(r.label)})" for r in runs), ""]
    for r in runs:
        if r.missing:
            md.append(f"- {md_text(r.path.name)} has no " + "; no ".join(r.missing) + ".")
    for r in runs:
        lines = team_summary(r)
        if lines:
            step = int(r.rollout_files[-1].stem.split("_")[1])
            md += [
                "",
                f"## Team: {md_text(r.label)}",
                "",
                f"Calls in the rollouts of step {step} (sampler "
                f"{md_text(r.config.get('sampler', '?'))}, group size {md_text(r.config.get('group_size', '?'))}):",
                "",
                *lines,
            ]
    md += ["", "## Results", ""]
    md.append(_md_table(header, body) if body else "No evaluation results were found.")
    for r in runs:
        if r.metrics:
            md += [
                "",
                f"Training of {md_text(r.label)}: {len(r.metrics)} RL steps; mean reward "
                f"{training_summary(r.metrics)}." + budget_note(r),
            ]
    titles = {
        "reward_and_val_f1": "Training reward and validation F1",
        "learning": "Validation F1 by CPU time and the train reward on revisits",
        "question_forms": "Validation F1 by question form and the constant answers",
        "penalties": "Format penalty per agent",
        "behaviour": "Agent behaviour",
        "intra_group_similarity": "Intra-group similarity",
        "cost": "Time and memory",
    }
    for name, png in plots.items():
        md += ["", f"## {titles[name]}", "", f"![{titles[name]}]({png.name})"]
    if not plots:
        md += ["", "No training metrics were found, so there are no training plots."]
    for r in runs:
        if not r.rollout_files:
            continue
        for which, path in (("first", r.rollout_files[0]), ("last", r.rollout_files[-1])):
            md += ["", f"## Example traces: {md_text(r.label)}, {which} step ({path.stem})", ""]
            for t in _checked(path, traces):
                md.append(f"**Q:** {md_text(t['question'])}  ")
                for agent, text in t["steps"]:
                    md.append(f"- *{md_text(agent)}*: {md_text(str(text)[:300])}")
                reward = t["reward"] if isinstance(t["reward"], (int, float)) else float("nan")
                gold = md_text(", ".join(map(str, t["gold"])))
                md.append(f"- **answer:** {md_text(t['answer'])} — **gold:** {gold} — F1 {reward:.2f}")
                md.append("")
    text = "\n".join(md) + "\n"
    atomic_write_text(out / "report.md", text)
    atomic_write_text(out / "report.html", to_html(text, plots))
    return out / "report.md"
