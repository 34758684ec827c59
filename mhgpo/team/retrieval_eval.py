"""Retrieval evaluation: recall@k of the gold (supporting) paragraphs of a question set.

Gold units: one per gold paragraph of an `Example` (`supporting_titles`, aligned with `supporting_context`):
a HotpotQA / 2WikiMultihopQA supporting-fact title (every context paragraph with that title counts: 2Wiki repeats
some titles), or a MuSiQue `is_supporting` paragraph (exactly that paragraph, though others may share its title).

Matching: when the corpus holds the records' own paragraphs verbatim (the context corpus) a retrieved passage
matches a unit by (title, text), so two paragraphs that share a title are told apart; against any other corpus
(Wikipedia passages) a retrieved passage matches a unit by title.

Queries: the raw question (the top k passages for it), or the Rewriter's sub-queries (greedy decoding, parsed
as the team parses them), each searched for its top `search.top_k` and merged in order, de-duplicated by passage
id, as the search system merges them; recall@k then looks at the first k passages of that merged list.

Metrics, in percent: `recall@k/all` (questions whose gold units are all found) and `recall@k/mean` (mean fraction
of a question's gold units found), over the questions that have gold units.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mhgpo.config import SearchConfig
from mhgpo.config.eval import MAX_PROMPT_TOKENS
from mhgpo.data.records import Example, Passage
from mhgpo.errors import InputError
from mhgpo.team.search_system import REWRITER, Retriever, SearchSystem, merge_candidates

__all__ = [
    "GoldUnit",
    "RetrievalEvalResult",
    "evaluate_retrieval",
    "gold_units",
    "matches_by_text",
    "recall_table",
    "rewriter_queries",
    "units_found",
]


@dataclass(frozen=True)
class GoldUnit:
    """One gold paragraph: its title, and the (title, text) of the context paragraphs that count as it."""

    title: str
    keys: frozenset[tuple[str, str]]


def gold_units(example: Example) -> list[GoldUnit]:
    """The gold units of `example` (none when it names no supporting paragraph)."""
    aligned = example.supporting_context or tuple(() for _ in example.supporting_titles)
    return [
        GoldUnit(title, frozenset(example.context[j] for j in indices))
        for title, indices in zip(example.supporting_titles, aligned)
    ]


def matches_by_text(gold: Sequence[Sequence[GoldUnit]], passages: Sequence[Passage]) -> bool:
    """True when every gold unit that has paragraphs finds one of them verbatim in `passages` (the context
    corpus), so units can be matched by (title, text); otherwise they are matched by title."""
    wanted = {key for units in gold for unit in units for key in unit.keys}
    if not wanted or any(not unit.keys for units in gold for unit in units):
        return False
    present = {(p.title, p.text) for p in passages if (p.title, p.text) in wanted}
    return all(unit.keys & present for units in gold for unit in units)


def units_found(units: Sequence[GoldUnit], passages: Sequence[Passage], by_text: bool) -> list[bool]:
    """For each unit, whether one of `passages` matches it."""
    if by_text:
        keys = {(p.title, p.text) for p in passages}
        return [bool(unit.keys & keys) for unit in units]
    titles = {p.title for p in passages}
    return [unit.title in titles for unit in units]


def rewriter_queries(
    examples: Sequence[Example],
    generator: Any,
    encode: Callable[[list[dict[str, str]]], list[int]],
    search: SearchConfig,
    chunk: int = 64,
    progress: bool = True,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> list[tuple[str, ...]]:
    """The Rewriter's sub-queries for each question: its prompt as the team builds it, greedy decoding, and the
    team's parser (a missing `### ... ###` block falls back to the question). A prompt longer than
    `max_prompt_tokens` raises InputError naming the question, before anything is generated."""
    from tqdm.auto import tqdm

    from mhgpo.model.generation import SamplingParams

    system = SearchSystem(retriever=_NoRetriever(), config=search)
    params = SamplingParams(search.rewriter.max_new_tokens, 0.0, search.rewriter.top_p, "rewriter")
    queries: list[tuple[str, ...]] = []
    with tqdm(total=len(examples), desc="rewriter", unit="q", disable=not progress, dynamic_ncols=True) as bar:
        for lo in range(0, len(examples), chunk):
            states = [system.init_state(ex) for ex in examples[lo : lo + chunk]]
            prompts = [encode(system.build_prompt(s, REWRITER)) for s in states]
            for state, ids in zip(states, prompts):
                if len(ids) > max_prompt_tokens:
                    raise InputError(
                        f"question {state.example.id}: the Rewriter's prompt is {len(ids)} tokens, more "
                        f"than max_prompt_tokens={max_prompt_tokens} (a very long question?)"
                    )
            for state, gen in zip(states, generator.generate(prompts, params)):
                queries.append(tuple(system.apply(state, REWRITER, gen.text).state.get("queries")))
            bar.update(len(states))
    return queries


class _NoRetriever:
    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]:  # pragma: no cover - never called
        raise RuntimeError("the Rewriter alone does not retrieve")


@dataclass
class RetrievalEvalResult:
    metrics: dict[str, Any]
    rows: list[dict[str, Any]]


def _merged(retriever: Retriever, queries: Sequence[Sequence[str]], depth: int, cap: int) -> list[list[Passage]]:
    flat = [q for qs in queries for q in qs]
    hits = retriever.search_batch(flat, depth) if flat else []
    merged, pos = [], 0
    for qs in queries:
        merged.append(merge_candidates(hits[pos : pos + len(qs)], cap))
        pos += len(qs)
    return merged


@dataclass(frozen=True)
class _Question:
    """A question that has gold units, and the queries it is searched with."""

    example: Example
    units: list[GoldUnit]
    queries: tuple[str, ...]


def evaluate_retrieval(
    examples: Sequence[Example],
    retriever: Retriever,
    ks: Sequence[int],
    queries: Sequence[Sequence[str]] | None = None,
    depth: int | None = None,
    passages: Sequence[Passage] | None = None,
) -> RetrievalEvalResult:
    """Recall@k for each k of `ks` over the questions of `examples` that have gold units.

    `queries`: per question, its queries (default: the question alone); each is searched for its top `depth`
    passages (default: the largest k) and the lists are merged as the search system merges them. `passages`: the
    corpus (default: `retriever.passages`), used to choose between matching by (title, text) and by title.
    """
    start = time.perf_counter()
    ks = sorted(set(int(k) for k in ks))
    corpus = passages if passages is not None else getattr(retriever, "passages", ())
    kept = _questions_with_gold(examples, queries)
    by_text = matches_by_text([q.units for q in kept], corpus)
    ranked = _merged(retriever, [q.queries for q in kept], depth or ks[-1], ks[-1])
    found = {k: [units_found(q.units, r[:k], by_text) for q, r in zip(kept, ranked)] for k in ks}
    metrics: dict[str, Any] = {"n": len(kept), "corpus_size": len(corpus), **_recalls(found)}
    metrics.update(
        without_gold=len(examples) - len(kept),
        match="title+text" if by_text else "title",
        queries_per_question=float(np.mean([len(q.queries) for q in kept])) if kept else 0.0,
        seconds=time.perf_counter() - start,
    )
    return RetrievalEvalResult(metrics, _rows(kept, ranked, found))


def _questions_with_gold(examples: Sequence[Example], queries: Sequence[Sequence[str]] | None) -> list[_Question]:
    """The examples that have gold units, each with its queries (`queries[i]` for example i, else its question)."""
    kept = []
    for i, ex in enumerate(examples):
        units = gold_units(ex)
        if units:
            kept.append(_Question(ex, units, tuple(queries[i]) if queries is not None else (ex.question,)))
    return kept


def _recalls(found: dict[int, list[list[bool]]]) -> dict[str, float]:
    """`recall@k/all` and `recall@k/mean` (percent) for each k, from each question's found flags at k."""
    out: dict[str, float] = {}
    for k, flags in found.items():
        out[f"recall@{k}/all"] = 100 * float(np.mean([all(f) for f in flags])) if flags else 0.0
        out[f"recall@{k}/mean"] = 100 * float(np.mean([np.mean(f) for f in flags])) if flags else 0.0
    return out


def _rows(
    kept: list[_Question], ranked: list[list[Passage]], found: dict[int, list[list[bool]]]
) -> list[dict[str, Any]]:
    """One row per question: its queries, gold titles, the passages retrieved and the number found at each k."""
    return [
        {
            "id": q.example.id,
            "queries": list(q.queries),
            "gold_titles": [u.title for u in q.units],
            "retrieved_ids": [p.id for p in r],
            "retrieved_titles": [p.title for p in r],
            **{f"found@{k}": int(sum(flags[row])) for k, flags in found.items()},
        }
        for row, (q, r) in enumerate(zip(kept, ranked))
    ]


def recall_table(metrics: dict[str, Any], title: str = "") -> Any:
    """A rich table: one row per cut-off k, columns recall@k (all) and recall@k (mean)."""
    from rich.table import Table

    table = Table(title=title or None)
    for col in ("k", "all gold found (%)", "mean fraction found (%)"):
        table.add_column(col, justify="right")
    ks = sorted(int(key.split("@")[1].split("/")[0]) for key in metrics if key.endswith("/all"))
    for k in ks:
        table.add_row(str(k), f"{metrics[f'recall@{k}/all']:.1f}", f"{metrics[f'recall@{k}/mean']:.1f}")
    return table
