"""Recall@5/@10 of the gold paragraphs with the raw question, over each question set's own context corpus.

For each data SPEC (`hotpotqa:PATH`, `2wiki:PATH`, `musique:PATH`) this prints, side by side:

- an independent plain `bm25s` run: the file read with `json` only, the corpus built here (paragraphs de-duplicated
  by title and text, indexed as `title text`, English stop words, no stemming), top 10 for the raw question;
- mhgpo's BM25 retriever and its dense retriever (the default encoder, flat FAISS index), through
  `mhgpo.team.retrieval_eval.evaluate_retrieval`, as `mhgpo eval-retrieval --corpus context` computes them;

with the corpus sizes and the index build times (wall seconds, and CPU seconds of this process, which depend
less on other jobs sharing the machine). Recall is in percent: `all` = questions whose gold paragraphs
are all in the top k, `mean` = mean fraction of a question's gold paragraphs in the top k.

    python benchmarks/bench_retrieval.py hotpotqa:PATH 2wiki:PATH musique:PATH [--no-dense] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

KS = (5, 10)


# --- the independent run: no mhgpo code ---------------------------------------------------------


def _raw_records(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8").lstrip("\ufeff")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _plain_questions(layout: str, path: Path) -> tuple[list[str], list[list[set]], list[tuple[str, str]]]:
    """(questions, gold units as sets of (title, text) keys, corpus keys in first-seen order)."""
    questions, golds, corpus = [], [], {}
    for record in _raw_records(path):
        if layout == "musique":
            if record.get("answerable") is False:
                continue
            paragraphs = [(p["title"], p["paragraph_text"].strip()) for p in record["paragraphs"]]
            gold = [{key} for key, p in zip(paragraphs, record["paragraphs"]) if p["is_supporting"]]
        else:
            paragraphs = [(title, "".join(sentences).strip()) for title, sentences in record["context"]]
            titles = dict.fromkeys(fact[0] for fact in record["supporting_facts"])
            gold = [{key for key in paragraphs if key[0] == title} for title in titles]
        for key in paragraphs:
            corpus.setdefault(key, None)
        if gold:
            questions.append(record["question"])
            golds.append(gold)
    return questions, golds, list(corpus)


def plain_bm25s(layout: str, path: Path) -> dict:
    import bm25s

    questions, golds, corpus = _plain_questions(layout, path)
    started = time.perf_counter()
    retriever = bm25s.BM25()
    retriever.index(
        bm25s.tokenize([f"{t} {x}" for t, x in corpus], stopwords="en", show_progress=False), show_progress=False
    )
    build_s = time.perf_counter() - started
    docs, _ = retriever.retrieve(
        bm25s.tokenize(questions, stopwords="en", show_progress=False), k=max(KS), show_progress=False
    )
    out = {"n": len(questions), "corpus_size": len(corpus), "build_s": build_s}
    for k in KS:
        found = [[bool(unit & {corpus[d] for d in row[:k]}) for unit in gold] for row, gold in zip(docs, golds)]
        out[f"recall@{k}/all"] = 100 * float(np.mean([all(f) for f in found]))
        out[f"recall@{k}/mean"] = 100 * float(np.mean([np.mean(f) for f in found]))
    return out


# --- mhgpo --------------------------------------------------------------------------------------


def mhgpo_recall(spec: str, dense: bool) -> dict[str, dict]:
    from mhgpo.data.formats import context_corpus
    from mhgpo.data.spec import load_data
    from mhgpo.retrieval.bm25 import BM25Retriever
    from mhgpo.team.retrieval_eval import evaluate_retrieval

    examples = load_data(spec)
    passages = context_corpus(examples)
    builders = {"bm25": lambda: BM25Retriever.build(passages)}
    if dense:
        from mhgpo.retrieval.dense import DenseRetriever

        builders["dense"] = lambda: DenseRetriever.build(passages, progress=False)
    results = {}
    for name, build in builders.items():
        started, cpu = time.perf_counter(), time.process_time()
        retriever = build()
        build_s, build_cpu_s = time.perf_counter() - started, time.process_time() - cpu
        started = time.perf_counter()
        metrics = evaluate_retrieval(examples, retriever, KS).metrics
        results[name] = {
            **metrics,
            "build_s": build_s,
            "build_cpu_s": build_cpu_s,
            "search_s": time.perf_counter() - started,
        }
    return results


def _cell(m: dict) -> str:
    return " / ".join(f"{m[f'recall@{k}/all']:.1f} ({m[f'recall@{k}/mean']:.1f})" for k in KS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", help="hotpotqa:PATH, 2wiki:PATH or musique:PATH")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense retriever")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    rows = {}
    for spec in args.specs:
        layout, _, path = spec.partition(":")
        plain = plain_bm25s(layout, Path(path).expanduser())
        ours = mhgpo_recall(spec, dense=not args.no_dense)
        rows[layout] = {"plain_bm25s": plain, **ours}
        print(
            f"{layout}: {plain['n']} questions, corpus {plain['corpus_size']} passages (mhgpo: "
            f"{ours['bm25']['corpus_size']}); build s: plain bm25s {plain['build_s']:.2f}, "
            + ", ".join(f"{name} {m['build_s']:.2f} ({m['build_cpu_s']:.2f} CPU s)" for name, m in ours.items()),
            flush=True,
        )

    names = ["plain_bm25s", "bm25"] + ([] if args.no_dense else ["dense"])
    print()
    print("recall@5 / recall@10, % of questions with all gold paragraphs found (mean % of gold paragraphs found)")
    print(f"| data | n | corpus | {' | '.join(names)} |")
    print("|---|---|---|" + "---|" * len(names))
    for layout, r in rows.items():
        print(
            f"| {layout} | {r['bm25']['n']} | {r['bm25']['corpus_size']} | "
            + " | ".join(_cell(r[name]) for name in names)
            + " |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
