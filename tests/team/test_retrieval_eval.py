"""Tests for mhgpo.team.retrieval_eval: gold units, matching by title or by title+text, recall@k, Rewriter queries."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mhgpo.config import SearchConfig
from mhgpo.data.formats import context_corpus
from mhgpo.data.records import Example, Passage
from mhgpo.retrieval.bm25 import BM25Retriever
from mhgpo.team.retrieval_eval import (
    GoldUnit,
    evaluate_retrieval,
    gold_units,
    matches_by_text,
    recall_table,
    rewriter_queries,
    units_found,
)

# Two questions over a context corpus where two paragraphs share the title "Lumen Valley" (MuSiQue style) and one
# title is repeated with the same text (2WikiMultihopQA style).
MUSIQUE = Example(
    "m",
    "What is the seat of the region where Ostrava Mills lies?",
    ("Pella",),
    supporting_titles=("Ostrava Mills", "Lumen Valley"),
    context=(
        ("Lumen Valley", "Lumen Valley is a wine region."),
        ("Ostrava Mills", "Ostrava Mills lies in Lumen."),
        ("Lumen Valley", "The seat of Lumen Valley is Pella."),
    ),
    supporting_context=((1,), (2,)),
)
TWOWIKI = Example(
    "w",
    "Where was the father of Carl Brant buried?",
    ("Kiel",),
    supporting_titles=("Carl Brant", "Otto Brant"),
    context=(
        ("Carl Brant", "Carl Brant was a judge."),
        ("Otto Brant", "Otto Brant was buried in Kiel."),
        ("Carl Brant", "Carl Brant was a judge."),
    ),
    supporting_context=((0, 2), (1,)),
)
CORPUS = context_corpus([MUSIQUE, TWOWIKI])  # ctx0 Lumen(wine) ctx1 Ostrava ctx2 Lumen(seat) ctx3 Carl ctx4 Otto
P = {p.id: p for p in CORPUS}


@dataclass
class FixedRetriever:
    """Returns a fixed ranking per query (the first k of it), and records what it was asked."""

    rankings: dict[str, list[str]]
    passages: tuple = tuple(CORPUS)

    def __post_init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []

    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append((list(queries), k))
        by_id = {p.id: p for p in self.passages}
        return [[by_id[i] for i in self.rankings.get(q, [])[:k]] for q in queries]


def test_gold_units() -> None:
    assert [(u.title, sorted(u.keys)) for u in gold_units(MUSIQUE)] == [
        ("Ostrava Mills", [("Ostrava Mills", "Ostrava Mills lies in Lumen.")]),
        ("Lumen Valley", [("Lumen Valley", "The seat of Lumen Valley is Pella.")]),
    ]
    assert gold_units(TWOWIKI)[0] == GoldUnit("Carl Brant", frozenset({("Carl Brant", "Carl Brant was a judge.")}))
    assert gold_units(Example("x", "q", ("a",), supporting_titles=("T",))) == [GoldUnit("T", frozenset())]
    assert gold_units(Example("x", "q", ("a",))) == []


def test_a_paragraph_that_only_shares_the_title_counts_by_title_but_not_by_text() -> None:
    units = gold_units(MUSIQUE)
    assert units_found(units, [P["ctx0"]], by_text=True) == [False, False]
    assert units_found(units, [P["ctx0"]], by_text=False) == [False, True]
    assert units_found(units, [P["ctx2"], P["ctx1"]], by_text=True) == [True, True]


def test_matching_by_text_only_when_the_corpus_holds_the_gold_paragraphs() -> None:
    gold = [gold_units(MUSIQUE), gold_units(TWOWIKI)]
    assert matches_by_text(gold, CORPUS) is True
    wiki = [Passage("9", "Lumen Valley", "Another text about the valley."), *CORPUS[:2], *CORPUS[3:]]
    assert matches_by_text(gold, wiki) is False  # the seat paragraph is missing: Wikipedia-like corpus
    assert matches_by_text([[GoldUnit("T", frozenset())]], CORPUS) is False


def test_recall_at_k_exact_values_with_the_question_as_query() -> None:
    retriever = FixedRetriever(
        {
            MUSIQUE.question: [
                "ctx1",
                "ctx0",
                "ctx4",
                "ctx2",
            ],  # @1: 1/2, @2: 1/2 (ctx0 only shares the title), @4: 2/2
            TWOWIKI.question: ["ctx3", "ctx4", "ctx0", "ctx1"],  # @1: 1/2, @2: 2/2
        }
    )
    result = evaluate_retrieval([MUSIQUE, TWOWIKI, Example("none", "q", ("a",))], retriever, [4, 1, 2])
    m = result.metrics
    assert retriever.calls == [([MUSIQUE.question, TWOWIKI.question], 4)]
    assert (m["n"], m["corpus_size"], m["without_gold"], m["match"]) == (2, 5, 1, "title+text")
    assert (m["recall@1/all"], m["recall@1/mean"]) == (0.0, 50.0)
    assert (m["recall@2/all"], m["recall@2/mean"]) == (50.0, 75.0)
    assert (m["recall@4/all"], m["recall@4/mean"]) == (100.0, 100.0)
    assert m["queries_per_question"] == 1.0
    assert result.rows[0] == {
        "id": "m",
        "queries": [MUSIQUE.question],
        "gold_titles": ["Ostrava Mills", "Lumen Valley"],
        "retrieved_ids": ["ctx1", "ctx0", "ctx4", "ctx2"],
        "retrieved_titles": ["Ostrava Mills", "Lumen Valley", "Otto Brant", "Lumen Valley"],
        "found@1": 1,
        "found@2": 1,
        "found@4": 2,
    }


def test_title_matching_against_another_corpus() -> None:
    wiki = (Passage("w1", "Lumen Valley", "Unrelated text."), Passage("w2", "Ostrava Mills", "Other text."))
    retriever = FixedRetriever({MUSIQUE.question: ["w1", "w2"]}, passages=wiki)
    m = evaluate_retrieval([MUSIQUE], retriever, [1, 2]).metrics
    assert (m["match"], m["corpus_size"]) == ("title", 2)
    assert (m["recall@1/all"], m["recall@1/mean"], m["recall@2/all"]) == (0.0, 50.0, 100.0)


def test_sub_queries_are_searched_at_depth_and_merged_like_the_search_system() -> None:
    retriever = FixedRetriever(
        {
            "q1": ["ctx3", "ctx0", "ctx1"],
            "q2": ["ctx3", "ctx4", "ctx2"],  # ctx3 again: de-duplicated, so ctx4 moves up
        }
    )
    result = evaluate_retrieval([TWOWIKI], retriever, [2, 3], queries=[("q1", "q2")], depth=2)
    assert retriever.calls == [(["q1", "q2"], 2)]
    assert result.rows[0]["retrieved_ids"] == ["ctx3", "ctx0", "ctx4"]  # q1's top 2, then q2's new one; cap 3
    m = result.metrics
    assert (m["recall@2/mean"], m["recall@3/all"], m["queries_per_question"]) == (50.0, 100.0, 2.0)


def test_bm25_over_the_context_corpus() -> None:
    retriever = BM25Retriever.build(CORPUS)
    m = evaluate_retrieval([MUSIQUE, TWOWIKI], retriever, [1, 5]).metrics
    assert (m["recall@5/all"], m["recall@5/mean"]) == (100.0, 100.0)
    assert m["recall@1/mean"] == 50.0


@dataclass
class Gen:
    text: str


class CannedGenerator:
    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs
        self.params: list = []

    def generate(self, prompts: list[list[int]], params) -> list[Gen]:  # type: ignore[no-untyped-def]
        self.params.append(params)
        return [Gen(self.outputs[bytes(p).decode()]) for p in prompts]


def test_rewriter_queries_use_the_team_prompt_greedy_decoding_and_parser() -> None:
    def encode(messages: list[dict[str, str]]) -> list[int]:
        user = messages[-1]["content"]
        return list((MUSIQUE.question if MUSIQUE.question in user else TWOWIKI.question).encode())

    generator = CannedGenerator(
        {MUSIQUE.question: "### Ostrava Mills region; seat of Lumen Valley ###", TWOWIKI.question: "no block here"}
    )
    search = SearchConfig()
    queries = rewriter_queries([MUSIQUE, TWOWIKI], generator, encode, search, chunk=1, progress=False)
    assert queries == [("Ostrava Mills region", "seat of Lumen Valley"), (TWOWIKI.question,)]
    assert [(p.temperature, p.max_new_tokens) for p in generator.params] == [(0.0, 48), (0.0, 48)]


def test_recall_table_rows() -> None:
    table = recall_table({"recall@10/all": 12.5, "recall@10/mean": 40.0, "recall@5/all": 0.0, "recall@5/mean": 25.25})
    assert [c.header for c in table.columns] == ["k", "all gold found (%)", "mean fraction found (%)"]
    assert [list(c._cells) for c in table.columns] == [["5", "10"], ["0.0", "12.5"], ["25.2", "40.0"]]


@pytest.mark.parametrize("ks", [[5], [1, 1, 3]])
def test_metrics_hold_each_k_once(ks: list[int]) -> None:
    m = evaluate_retrieval([MUSIQUE], FixedRetriever({}), ks).metrics
    assert sorted(k for k in m if k.startswith("recall@")) == sorted(
        f"recall@{k}/{s}" for k in set(ks) for s in ("all", "mean")
    )
