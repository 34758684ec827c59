"""Plain records shared across the package: questions and passages."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    """One question with its gold answers (aliases included; scored against the best)."""

    id: str
    question: str
    answers: tuple[str, ...]
    type: str = ""
    # Titles of the gold (supporting) paragraphs: one per gold paragraph, in the data set's order.
    supporting_titles: tuple[str, ...] = ()
    # Paragraphs that come with the record (HotpotQA `context`), as (title, text) pairs.
    context: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # Aligned with `supporting_titles` (or empty when the record has no context): for each gold paragraph, the
    # indices in `context` of the paragraphs that count as it. A title repeated in `context` (2WikiMultihopQA)
    # gives several; a MuSiQue gold paragraph gives exactly its own; a title absent from `context` gives none.
    supporting_context: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # The question's hops as search queries, when the data knows them (the synthetic world's `decomposition`,
    # MuSiQue's `question_decomposition`): what a query rewriter should output. Empty when unknown.
    decomposition: tuple[str, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Passage:
    """One retrievable passage of a corpus."""

    id: str
    title: str
    text: str
