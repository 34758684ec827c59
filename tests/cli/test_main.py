"""Smoke tests of the `mhgpo` command line, each command in a subprocess (`python -m mhgpo ...`) with the tiny model,
a small synthetic world and a private MHGPO_CACHE."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mhgpo.data.formats import context_corpus, load_corpus_jsonl, load_hotpotqa
from mhgpo.data.forms import form_line, form_metrics, is_form_metric
from mhgpo.data.metrics import score

REPO = Path(__file__).resolve().parents[2]
SMALL_SEARCH = [
    "search.rewriter.max_new_tokens=8",
    "search.reranker.max_new_tokens=4",
    "search.answerer.max_new_tokens=4",
]


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory):
    """`cli(*args)` runs `python -m mhgpo *args` in a scratch folder; returns the CompletedProcess."""
    cache = tmp_path_factory.mktemp("mhgpo-cache")
    cwd = tmp_path_factory.mktemp("cwd")
    env = {
        **os.environ,
        "MHGPO_CACHE": str(cache),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }

    def run(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mhgpo", *map(str, args)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    run.cache = cache  # type: ignore[attr-defined]
    return run


@pytest.fixture(scope="module")
def world(cli, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("world")
    res = cli("data", "synth", "--out", folder, "--seed", 1, "--train", 20, "--dev", 5)
    assert res.returncode == 0, res.stderr
    assert [line.split(":")[0] for line in res.stdout.splitlines()] == ["corpus", "train", "dev", "world"]
    return folder


@pytest.fixture(scope="module")
def dev_file(world: Path) -> Path:
    """The world's dev questions, every other one answered "assistant" (what the tiny model likes to say),
    so that the scores are not all zero."""
    rows = [json.loads(line) for line in (world / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    for i, row in enumerate(rows):
        if i % 2 == 0:
            row["answer"] = "assistant"
    path = world / "dev_mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------------ data


def test_data_synth_writes_the_world_and_the_same_seed_gives_the_same_bytes(cli, world, tmp_path) -> None:
    names = ["corpus.jsonl", "dev.jsonl", "train.jsonl", "world.json"]
    assert all((world / name).is_file() for name in names)
    meta = json.loads((world / "world.json").read_text())
    assert (meta["seed"], meta["n_train"], meta["n_dev"]) == (1, 20, 5)
    assert len((world / "train.jsonl").read_text().splitlines()) == 20
    assert len((world / "dev.jsonl").read_text().splitlines()) == 5
    assert len(load_corpus_jsonl(world / "corpus.jsonl")) == meta["n_passages"]

    again = tmp_path / "again"
    assert cli("data", "synth", "--out", again, "--seed", 1, "--train", 20, "--dev", 5).returncode == 0
    for name in names:
        assert (again / name).read_bytes() == (world / name).read_bytes(), name
    other = tmp_path / "other"
    assert cli("data", "synth", "--out", other, "--seed", 2, "--train", 20, "--dev", 5).returncode == 0
    assert (other / "train.jsonl").read_bytes() != (world / "train.jsonl").read_bytes()


# ------------------------------------------------------------------------------------------------------- ask

_RULE = re.compile(r"^─+ (.+?) ─+$")


def test_ask_shows_every_agent_and_the_answer(cli, world, tiny_model_dir) -> None:
    res = cli(
        "ask",
        "Who founded the company in the old harbour?",
        "--model",
        tiny_model_dir,
        "--corpus",
        world / "corpus.jsonl",
        "--gold",
        "assistant",
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rules = [(i, m.group(1)) for i, line in enumerate(lines) if (m := _RULE.match(line.strip()))]
    assert [title for _, title in rules] == ["rewriter", "retriever (tool)", "reranker", "answerer", "answer"]

    start = rules[1][0] + 1
    documents = [line.strip() for line in lines[start : rules[2][0]]]
    titles = {p.title for p in load_corpus_jsonl(world / "corpus.jsonl")}
    assert documents and all(d.startswith(f"Document{i}: ") for i, d in enumerate(documents))
    assert all(d.split(": ", 1)[1] in titles for d in documents)

    tail = lines[rules[-1][0] + 1 :]
    assert tail[-1].startswith("F1 against the gold answer: ")
    answer = "\n".join(tail[:-1]).strip()
    assert tail[-1] == f"F1 against the gold answer: {score(answer, ('assistant',))['f1']:.2f}"


# ------------------------------------------------------------------------------------------------------ eval

BEHAVIOUR = [
    "rewriter/num_subqueries",
    "rewriter/penalty_rate",
    "reranker/num_selected",
    "reranker/invalid_rate",
    "answerer/answer_words",
    "answerer/starts_with_document",
    "answerer/penalty_rate",
]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_scores_recomputed(metrics: dict, predictions: list[dict]) -> None:
    for p in predictions:
        s = score(p["prediction"], p["answers"])
        assert (p["acc"], p["em"], p["f1"]) == (s["acc"], s["em"], s["f1"])
    for key in ("acc", "em", "f1"):
        assert metrics[key] == 100 * float(np.mean([score(p["prediction"], p["answers"])[key] for p in predictions]))


def test_eval_writes_metrics_and_predictions_that_agree(cli, world, dev_file, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "eval"
    res = cli(
        "eval",
        "--data",
        f"hotpotqa:{dev_file}",
        "--corpus",
        world / "corpus.jsonl",
        "--model",
        tiny_model_dir,
        "--limit",
        4,
        "--output-dir",
        out,
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["eval_config.yaml", "metrics.json", "predictions.jsonl"]
    metrics = json.loads((out / "metrics.json").read_text())
    missing = [k for k in ["n", "acc", "em", "f1", "seconds", *BEHAVIOUR] if k not in metrics]
    assert missing == []
    assert metrics["n"] == 4 and metrics["seconds"] > 0

    predictions = read_jsonl(out / "predictions.jsonl")
    questions = load_hotpotqa(dev_file)[:4]
    assert [p["id"] for p in predictions] == [q.id for q in questions]
    assert [p["question"] for p in predictions] == [q.question for q in questions]
    assert [tuple(p["answers"]) for p in predictions] == [q.answers for q in questions]
    corpus = {p.id: p.title for p in load_corpus_jsonl(world / "corpus.jsonl")}
    for p in predictions:
        trace = p["trace"]
        assert p["prediction"] == trace["answer"]
        assert trace["subqueries"] and all(isinstance(q, str) and q for q in trace["subqueries"])
        assert trace["retrieved_ids"] and trace["retrieved_titles"] == [corpus[i] for i in trace["retrieved_ids"]]
        assert all(0 <= i < len(trace["retrieved_ids"]) for i in trace["selected_ids"])
        assert [s["agent"] for s in trace["steps"]] == ["rewriter", "retriever", "reranker", "answerer"]
    assert_scores_recomputed(metrics, predictions)
    assert metrics["answerer/answer_words"] == float(np.mean([len(p["prediction"].split()) for p in predictions]))
    assert metrics["answerer/starts_with_document"] == float(
        np.mean([p["prediction"].lower().startswith("document") for p in predictions])
    )
    assert metrics["rewriter/num_subqueries"] == float(np.mean([len(p["trace"]["subqueries"]) for p in predictions]))
    # F1 by question form, from the predictions alone; printed on a line of its own, not among the behaviour
    assert {k: v for k, v in metrics.items() if is_form_metric(k)} == form_metrics(predictions)
    line = next(x for x in res.stdout.splitlines() if x.startswith("by question form: "))
    assert line == "by question form: " + form_line(metrics) and "form/" not in res.stdout


def test_eval_without_corpus_searches_the_records_paragraphs(cli, dev_file, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "eval-context"
    res = cli(
        "eval",
        "--data",
        f"hotpotqa:{dev_file}",
        "--model",
        tiny_model_dir,
        "--limit",
        2,
        "--output-dir",
        out,
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    paragraphs = {p.id: p.title for p in context_corpus(load_hotpotqa(dev_file))}
    predictions = read_jsonl(out / "predictions.jsonl")
    assert len(predictions) == 2
    for p in predictions:
        ids = p["trace"]["retrieved_ids"]
        assert ids and all(i in paragraphs for i in ids)
        assert p["trace"]["retrieved_titles"] == [paragraphs[i] for i in ids]
    assert_scores_recomputed(json.loads((out / "metrics.json").read_text()), predictions)
    assert list((cli.cache / "indexes").glob("context-*"))


def test_eval_with_the_gold_context_oracle_shows_the_answerer_the_gold_paragraphs(
    cli, dev_file, tiny_model_dir, tmp_path
) -> None:
    out = tmp_path / "eval-oracle"
    res = cli(
        "eval",
        "--data",
        f"hotpotqa:{dev_file}",
        "--model",
        tiny_model_dir,
        "--limit",
        2,
        "--oracle",
        "context",
        "--output-dir",
        out,
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    assert "oracle:\n- context" in (out / "eval_config.yaml").read_text()
    questions = load_hotpotqa(dev_file)[:2]
    for p, q in zip(read_jsonl(out / "predictions.jsonl"), questions):
        assert p["trace"]["selected_titles"] == list(dict.fromkeys(q.supporting_titles))
        assert [s["agent"] for s in p["trace"]["steps"] if "tool" not in s] == ["answerer"]  # one LLM call
    bad = cli(
        "eval",
        "--data",
        f"hotpotqa:{dev_file}",
        "--model",
        tiny_model_dir,
        "--limit",
        2,
        "--oracle",
        "answerer",
        *SMALL_SEARCH,
    )
    assert bad.returncode == 2 and "oracle: answerer is the final agent" in bad.stderr


# ---------------------------------------------------------------------------------------------------- errors


def _bad_json(folder: Path, dev_file: Path) -> Path:
    lines = dev_file.read_text(encoding="utf-8").splitlines()
    path = folder / "bad.jsonl"
    path.write_text("\n".join(lines[:2] + ['{"question": "Who?", "answer": "x",'] + lines[2:]) + "\n")
    return path


def _no_answer(folder: Path, dev_file: Path) -> Path:
    rows = [json.loads(line) for line in dev_file.read_text(encoding="utf-8").splitlines()]
    del rows[1]["answer"]
    path = folder / "noanswer.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ERRORS = {  # case: the whole of stderr
    "missing data": r"^mhgpo: error: \S*missing\.jsonl: file not found$",
    "invalid json": r"^mhgpo: error: \S*bad\.jsonl:3: invalid JSON \(.*\)$",
    "no answer": r"^mhgpo: error: \S*noanswer\.jsonl:2: missing key 'answer'$",
    "unknown model": r"^mhgpo: error: Could not load model '\S*no-such-model': [^\n]*$",
    "unknown key": r"^mhgpo: error: unknown config key optim\.lrr; valid keys here: optim\.clip_eps, ",
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_one_line_with_exit_status_2_and_write_nothing(
    cli, world, dev_file, tiny_model_dir, tmp_path, case
) -> None:
    out = tmp_path / "out"
    corpus = ["--corpus", world / "corpus.jsonl"]
    if case == "missing data":
        args = ["eval", "--data", f"hotpotqa:{tmp_path / 'missing.jsonl'}", "--model", tiny_model_dir, *corpus]
    elif case == "invalid json":
        args = ["eval", "--data", f"hotpotqa:{_bad_json(tmp_path, dev_file)}", "--model", tiny_model_dir, *corpus]
    elif case == "no answer":
        args = ["eval", "--data", f"hotpotqa:{_no_answer(tmp_path, dev_file)}", "--model", tiny_model_dir, *corpus]
    elif case == "unknown model":
        args = ["eval", "--data", f"hotpotqa:{dev_file}", "--model", tmp_path / "no-such-model", *corpus]
    else:
        args = ["train", "--data", f"hotpotqa:{dev_file}", "--model", tiny_model_dir, *corpus, "optim.lrr=0.1"]
    res = cli(*args, "--output-dir", out)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert re.match(ERRORS[case], res.stderr.strip()), res.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------------------------- train, demo


def test_train_command_completes_a_run_directory(cli, world, dev_file, tiny_model_dir, tmp_path) -> None:
    run = tmp_path / "run"
    res = cli(
        "train",
        "--model",
        tiny_model_dir,
        "--sampler",
        "fof",
        "--steps",
        1,
        "--questions-per-step",
        2,
        "--group-size",
        2,
        "--data",
        f"hotpotqa:{world / 'train.jsonl'}",
        "--corpus",
        world / "corpus.jsonl",
        "--output-dir",
        run,
        f"val_data=hotpotqa:{dev_file}",
        "val_limit=2",
        "eval_every=1",
        "lora.r=4",
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    assert f"finished 1 steps; run directory: {run}" in res.stdout
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    assert re.search(
        rf"val F1 {rows[0]['val/f1']:.1f}  EM {rows[0]['val/em']:.1f}  Acc {rows[0]['val/acc']:.1f}"
        r" \(step 1\)",
        res.stdout,
    )
    cfg = (run / "config.yaml").read_text()
    assert "sampler: fof" in cfg and "steps: 1" in cfg
    nodes = read_jsonl(run / "rollouts" / "step_000001.jsonl")
    assert len([n for n in nodes if n["agent"] != "retriever"]) == rows[0]["llm_calls"]
    # FoF forks the first agent: G rewriter samples per question, each continued one-to-one
    assert sum(n["agent"] == "rewriter" for n in nodes) == 2 * 2
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1"]
    assert sorted(p.name for p in (run / "checkpoints" / "step_1").iterdir()) == [
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
    ]


def _table_row(stdout: str, label: str) -> list[str]:
    rows = [line for line in stdout.splitlines() if line.startswith("│") and label in line]
    assert rows, f"no table row {label!r} in:\n{stdout}"
    return [cell.strip() for cell in rows[-1].strip("│").split("│")]


def test_demo_prints_a_before_and_after_table(cli, world, dev_file, tiny_model_dir, tmp_path) -> None:
    run = tmp_path / "demo"
    res = cli(
        "demo",
        f"model={tiny_model_dir}",
        "steps=1",
        "questions_per_step=2",
        "group_size=2",
        f"data=hotpotqa:{world / 'train.jsonl'}",
        f"val_data=hotpotqa:{dev_file}",
        f"retrieval.corpus={world / 'corpus.jsonl'}",
        "val_limit=2",
        f"output_dir={run}",
        "lora.r=4",
        "eval_every=0",  # no validation during training: the demo still evaluates before and after
        "warm_start.steps=2",
        "warm_start.limit=4",
        "budget_minutes=60",  # more than the step needs: said in the header, not reached
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    header = " ".join(res.stdout.split("run dir")[0].split())
    assert header.endswith("1 steps × 2 questions (fewer if 60 CPU minutes of RL run out first), G=2;"), header
    for label, folder in (
        ("untrained team", "eval_before"),
        ("warm start (2 steps)", "eval_warm_start"),
        ("+ MHGPO-IS (1 steps)", "eval_after"),
    ):  # the demo's recipe: a warm start, then RL
        m = json.loads((run / folder / "metrics.json").read_text())
        assert m["n"] == 2
        assert _table_row(res.stdout, label) == [label, "2", f"{m['acc']:.1f}", f"{m['em']:.1f}", f"{m['f1']:.1f}"]
    assert "agent behaviour" in res.stdout and "form/" not in res.stdout  # F1 by form: a table of its own
    assert "F1 by question form (dev set)" in res.stdout and " questions:" in res.stdout
    # the demo's `precision: auto`: each stage (the validations, the warm start, RL) says what auto decided, and why
    said = [line for line in res.stderr.splitlines() if line.startswith("mhgpo: precision ")]
    assert len(said) >= 3 and all("(auto: " in line for line in said), said
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]
    assert (run / "checkpoints" / "step_1" / "model.safetensors").is_file()
    # the last line splits the total into the stages, in order, each in minutes
    total = re.search(
        r"total (\d+\.\d) min \(untrained evaluation (\d+\.\d), warm start (\d+\.\d), its evaluation (\d+\.\d), "
        r"MHGPO-IS with its evaluation (\d+\.\d), the rest (\d+\.\d)\); run directory",
        " ".join(res.stdout.split()),
    )
    assert total is not None, res.stdout[-600:]
    minutes = [float(x) for x in total.groups()]
    assert abs(sum(minutes[1:]) - minutes[0]) <= 0.05 * len(minutes), minutes  # each rounded to 0.1


def test_ask_prints_text_with_markup_characters_as_text(cli, world, tiny_model_dir) -> None:
    """A question (and so the Rewriter's fallback query shown in its details) holding rich markup is printed as it
    is, not parsed: `[/x]` alone would be a markup error."""
    question = "Who [/x] founded [bold]the company[/bold] in the old harbour?"
    res = cli("ask", question, "--model", tiny_model_dir, "--corpus", world / "corpus.jsonl", *SMALL_SEARCH)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "MarkupError" not in res.stderr
    assert "[/x] founded [bold]the company[/bold]" in res.stdout
