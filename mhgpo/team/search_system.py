"""The default multi-agent search system: Rewriter → Retriever (tool) → Reranker → Answerer.

Prompts come from `prompts.yaml` (the paper's appendix); parsers are pure functions that never raise on model
output and return what they parsed plus the agent-specific penalty. `LLMOnly` is the single-agent baseline
(the model answers directly, no retrieval).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Protocol

import yaml

from mhgpo.config import AgentSampling, SearchConfig
from mhgpo.data.metrics import normalize_answer
from mhgpo.data.records import Example, Passage
from mhgpo.errors import InputError
from mhgpo.team.workflow import State, StepResult, Workflow, breaks_format, mean_of

REWRITER, RETRIEVER, RERANKER, ANSWERER = "rewriter", "retriever", "reranker", "answerer"
LLM = "llm"

_BLOCK = re.compile(r"###(.*?)###", re.DOTALL)
_INT = re.compile(r"\d+")


@cache
def load_prompts() -> dict[str, dict[str, str]]:
    """The agent prompt templates, read once from the package's `prompts.yaml`."""
    text = resources.files("mhgpo.team").joinpath("prompts.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


class Retriever(Protocol):
    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]: ...


# ------------------------------------------------------------------------------------------------- parsers


@dataclass(frozen=True)
class RewriterParse:
    queries: tuple[str, ...]
    penalised: bool
    reason: str = ""


def parse_rewriter(output: str, question: str, max_queries: int = 4, max_chars: int = 300) -> RewriterParse:
    """`### q1; q2; ... ###` → sub-queries. No block (or an empty one) falls back to the raw question.

    Penalised when there is no `### ... ###` block, more than `max_queries` sub-queries, or more than
    `max_chars` characters of sub-queries in all. All parsed sub-queries are kept (the penalty is the signal).
    """
    match = _BLOCK.search(output)
    if match is None:
        return RewriterParse((question,), True, "no ### block")
    queries = tuple(q.strip().strip("<>\"'").strip() for q in match.group(1).split(";"))
    queries = tuple(q for q in queries if q)
    if not queries:
        return RewriterParse((question,), True, "empty ### block")
    if len(queries) > max_queries:
        return RewriterParse(queries, True, f"{len(queries)} sub-queries")
    if sum(len(q) for q in queries) > max_chars:
        return RewriterParse(queries, True, "sub-queries too long")
    return RewriterParse(queries, False)


@dataclass(frozen=True)
class RerankerParse:
    selected: tuple[int, ...]  # valid ids, first occurrence order
    invalid: int  # duplicated or out-of-range ids dropped
    penalised: bool
    reason: str = ""


_NONE = re.compile(r"^\W*none\W*$", re.IGNORECASE)


def parse_reranker(output: str, num_candidates: int) -> RerankerParse:
    """The integers in the output, in order, are the selected document ids.

    Duplicates and out-of-range ids are dropped and penalised; text that holds no integer at all is penalised
    (non-numeric words around the ids are ignored), except the single word `None`: no document is useful.
    """
    ids = [int(m) for m in _INT.findall(output) if len(m) <= 6]
    if not ids and _NONE.match(output):
        return RerankerParse((), 0, False)
    if not ids:
        return RerankerParse((), 0, True, "no document id")
    selected: list[int] = []
    invalid = 0
    for i in ids:
        if i >= num_candidates or i in selected:
            invalid += 1
        else:
            selected.append(i)
    reason = f"{invalid} invalid id(s)" if invalid else ""
    return RerankerParse(tuple(selected), invalid, invalid > 0, reason)


_ANSWER_PREFIX = re.compile(r"^\s*(the\s+)?(final\s+)?answer\s*(is)?\s*[:\-]?\s*", re.IGNORECASE)


def parse_answer(output: str, max_words: int = 30) -> tuple[str, bool]:
    """The answer text (a leading "Answer:" dropped); penalised when longer than `max_words` words."""
    text = output.strip()
    stripped = _ANSWER_PREFIX.sub("", text, count=1).strip()
    answer = stripped or text
    return answer, len(answer.split()) > max_words


def _title_stem(title: str) -> str:
    """A title without a trailing disambiguation in brackets: `Big Stone Gap (film)` → `Big Stone Gap`."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", title).strip() or title


def gold_queries(example: Example, max_queries: int = 4) -> tuple[str, ...]:
    """The sub-queries a good Rewriter writes for `example`: its `decomposition` when the data has one; else the
    supporting titles that the question itself names (without a bracketed disambiguation), in the question's
    order, followed by the question when fewer than two titles are named. Titles the question does not name are
    never used: they are hidden intermediate answers the Rewriter cannot know."""
    if example.decomposition:
        return tuple(example.decomposition[:max_queries])
    lowered = example.question.lower()
    named = []
    for stem in dict.fromkeys(_title_stem(t) for t in example.supporting_titles):
        at = lowered.find(stem.lower())
        if stem and at >= 0:
            named.append((at, stem))
    queries = [stem for _, stem in sorted(named)][:max_queries]
    if len(queries) < 2:
        queries = (queries + [example.question])[:max_queries]
    return tuple(queries)


def format_queries(queries: Sequence[str]) -> str:
    """The Rewriter's output format: `### q1; q2 ###`."""
    return f"### {'; '.join(queries)} ###"


def format_ids(ids: Sequence[int]) -> str:
    """The Reranker's output format: `2, 5`, or `None` for an empty selection."""
    return ", ".join(str(i) for i in ids) if ids else "None"


def gold_ids(candidates: Sequence[Passage], supporting_titles: Sequence[str]) -> tuple[int, ...]:
    """The candidates whose title is a supporting title, in retrieval order."""
    gold = set(supporting_titles)
    return tuple(i for i, p in enumerate(candidates) if p.title in gold)


def grounded(answer: str, question: str, passages: Sequence[Passage]) -> bool:
    """Whether `answer` can be read off the question or the passages (or is yes / no): the condition for an
    Answerer demonstration, so that a warm start never teaches answering from nothing."""
    norm = normalize_answer(answer)
    if norm in ("yes", "no"):
        return True
    return bool(norm) and any(norm in normalize_answer(text) for text in [question, *(p.text for p in passages)])


def format_documents(passages: list[Passage], template: str, snippet_words: int, snippet_chars: int = 600) -> str:
    """The documents block of a prompt: each passage's title and first `snippet_words` words, both cut at
    `snippet_chars` characters (a passage without spaces is one "word"), with " ..." where something was cut."""
    parts = []
    for i, p in enumerate(passages):
        words = p.text.split()
        snippet = _cut(" ".join(words[:snippet_words]), snippet_chars, len(words) > snippet_words)
        parts.append(template.format(index=i, title=_cut(p.title, snippet_chars), snippet=snippet))
    return "\n\n".join(parts)


def _cut(text: str, chars: int, cut: bool = False) -> str:
    if len(text) > chars:
        text, cut = text[:chars], True
    return text + " ..." if cut else text


def merge_candidates(results: list[list[Passage]], cap: int) -> list[Passage]:
    """Top-k lists of the sub-queries merged in order, de-duplicated by passage id, capped."""
    seen: set[str] = set()
    merged: list[Passage] = []
    for passages in results:
        for p in passages:
            if p.id not in seen:
                seen.add(p.id)
                merged.append(p)
    return merged[:cap]


# ------------------------------------------------------------------------------------------------ systems


def _answer_words(node: Any) -> int:
    return len(node.info.get("answer", "").split())


def _copies_document(node: Any) -> bool:
    return node.info.get("answer", "").lower().startswith("document")


def _messages(agent: str, **fields: str) -> list[dict[str, str]]:
    prompt = load_prompts()[agent]
    return [
        {"role": "system", "content": prompt["system"].format(**fields)},
        {"role": "user", "content": prompt["user"].format(**fields)},
    ]


@dataclass
class SearchSystem(Workflow):
    """Rewriter → Retriever → Reranker → Answerer, with the composite (format) rewards of the paper."""

    retriever: Retriever
    config: SearchConfig = field(default_factory=SearchConfig)

    agents = (REWRITER, RERANKER, ANSWERER)
    tools = (RETRIEVER,)
    config_class = SearchConfig
    # The gold-context oracle (`oracle=[context]`, mhgpo/team/oracle.py): the tool it replaces and the roles whose
    # gold outputs pass the gold paragraphs through unchanged.
    retrieval_tool = RETRIEVER
    context_oracle_roles = (REWRITER, RERANKER)

    def next_agent(self, state: State) -> str | None:
        if "queries" not in state:
            return REWRITER
        if "candidates" not in state:
            return RETRIEVER
        if "selected" not in state:
            return RERANKER
        if "answer" not in state:
            return ANSWERER
        return None

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        question = state.example.question
        if agent == REWRITER:
            return _messages(agent, question=question)
        if agent == RERANKER:
            docs = state.get("candidates")
        elif agent == ANSWERER:
            docs = [state.get("candidates")[i] for i in state.get("selected")]
        else:
            raise ValueError(f"unknown agent {agent!r}")
        template = load_prompts()[agent]["document"]
        return _messages(
            agent,
            question=question,
            documents=format_documents(docs, template, self.config.snippet_words, self.config.snippet_chars),
        )

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        cfg = self.config
        if agent == REWRITER:
            p = parse_rewriter(output, state.example.question, cfg.max_subqueries, cfg.max_query_chars)
            return StepResult(
                state.with_values(queries=p.queries),
                cfg.rewriter_penalty if p.penalised else 0.0,
                {"queries": list(p.queries), "reason": p.reason},
            )
        if agent == RERANKER:
            candidates = state.get("candidates")
            p = parse_reranker(output, len(candidates))
            info = {"selected": list(p.selected), "invalid": p.invalid, "reason": p.reason}
            if state.example.supporting_titles:  # how many gold passages were retrieved, and how many passed on
                gold = gold_ids(candidates, state.example.supporting_titles)
                info.update(gold=len(gold), gold_selected=len(set(gold) & set(p.selected)))
            return StepResult(
                state.with_values(selected=p.selected), cfg.reranker_penalty if p.penalised else 0.0, info
            )
        if agent == ANSWERER:
            answer, long = parse_answer(output, cfg.max_answer_words)
            return StepResult(
                state.with_values(answer=answer),
                cfg.answerer_penalty if long else 0.0,
                {"answer": answer, "reason": "answer too long" if long else ""},
            )
        raise ValueError(f"unknown agent {agent!r}")

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        if tool != RETRIEVER:
            return super().call_tools(tool, states)
        flat = [q for s in states for q in s.get("queries")]
        hits = self.retriever.search_batch(flat, self.config.top_k) if flat else []
        results, pos = [], 0
        for s in states:
            n = len(s.get("queries"))
            candidates = merge_candidates(hits[pos : pos + n], self.config.max_candidates)
            pos += n
            results.append(
                StepResult(
                    s.with_values(candidates=tuple(candidates)),
                    0.0,
                    {"ids": [p.id for p in candidates], "titles": [p.title for p in candidates]},
                )
            )
        return results

    def gold_context_results(self, states: list[State]) -> list[StepResult]:
        """The retriever's step under the gold-context oracle: each question's gold paragraphs (the first
        paragraph of its record's `context` that counts as each gold one) as the candidates."""
        results = []
        for s in states:
            example = s.example
            indices = [found[0] for found in example.supporting_context if found]
            if not indices:
                raise InputError(
                    f"oracle=context: question {example.id!r} has no gold paragraphs in its record's "
                    f"context (the oracle needs records that carry their paragraphs: HotpotQA, "
                    f"2WikiMultihopQA, MuSiQue)"
                )
            gold = tuple(
                Passage(id=f"{example.id}:gold{j}", title=example.context[j][0], text=example.context[j][1])
                for j in dict.fromkeys(indices)
            )
            results.append(
                StepResult(
                    s.with_values(candidates=gold),
                    0.0,
                    {"ids": [p.id for p in gold], "titles": [p.title for p in gold]},
                )
            )
        return results

    def final_answer(self, state: State) -> str:
        return state.get("answer", "")

    def demonstration(self, state: State, agent: str) -> str | None:
        """Gold outputs for a warm start: the Rewriter's `gold_queries`; the Reranker's gold candidates (the
        retrieved passages whose title is a supporting title, in retrieval order; `None` when none was retrieved);
        the Answerer's first gold answer when it can be read off the documents it is shown (else no
        demonstration)."""
        example = state.example
        if agent == REWRITER:
            return format_queries(gold_queries(example, self.config.max_subqueries))
        candidates = state.get("candidates") or ()
        if agent == RERANKER:
            return format_ids(gold_ids(candidates, example.supporting_titles))
        if agent == ANSWERER and example.answers:
            shown = [candidates[i] for i in state.get("selected") or ()]
            return example.answers[0] if grounded(example.answers[0], example.question, shown) else None
        return None

    def sampling(self, agent: str) -> AgentSampling:
        return getattr(self.config, agent)

    def behaviour(self, agent: str, calls: list) -> dict[str, float]:
        if agent == REWRITER:
            return {"num_subqueries": mean_of(calls, lambda n: len(n.info.get("queries", [])))}
        if agent == RERANKER:  # invalid: a duplicated or out-of-range id, or no id at all
            out = {
                "num_selected": mean_of(calls, lambda n: len(n.info.get("selected", []))),
                "invalid_rate": mean_of(calls, breaks_format),
            }
            # gold_recall: of the gold passages retrieved, the share the Reranker passes on (calls that retrieved
            # one; a Reranker that drops the second hop's passage starves the Answerer without breaking a format)
            found = [n for n in calls if n.info.get("gold")]
            if found:
                out["gold_recall"] = mean_of(found, lambda n: n.info["gold_selected"] / n.info["gold"])
            return out
        # starts_with_document: answers that open like a Reranker's candidate list ("Document 0: ..."), the sign
        # of one role's format leaking into another through the shared weights
        return {"answer_words": mean_of(calls, _answer_words), "starts_with_document": mean_of(calls, _copies_document)}

    def trace(self, state: State) -> dict[str, Any]:
        candidates = state.get("candidates") or ()
        selected = state.get("selected") or ()
        return {
            "subqueries": list(state.get("queries") or ()),
            "retrieved_ids": [p.id for p in candidates],
            "retrieved_titles": [p.title for p in candidates],
            "selected_ids": list(selected),
            "selected_titles": [candidates[i].title for i in selected if i < len(candidates)],
            "answer": state.get("answer", ""),
        }


@dataclass
class LLMOnly(Workflow):
    """Single-agent baseline: the model answers the question directly, with no retrieval."""

    config: SearchConfig = field(default_factory=SearchConfig)

    agents = (LLM,)
    config_class = SearchConfig

    def next_agent(self, state: State) -> str | None:
        return None if "answer" in state else LLM

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        return _messages(LLM, question=state.example.question)

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        answer, long = parse_answer(output, self.config.max_answer_words)
        return StepResult(
            state.with_values(answer=answer),
            self.config.answerer_penalty if long else 0.0,
            {"answer": answer, "reason": "answer too long" if long else ""},
        )

    def final_answer(self, state: State) -> str:
        return state.get("answer", "")

    def demonstration(self, state: State, agent: str) -> str | None:
        return state.example.answers[0] if state.example.answers else None

    def sampling(self, agent: str) -> AgentSampling:
        return self.config.answerer

    def behaviour(self, agent: str, calls: list) -> dict[str, float]:
        return {"answer_words": mean_of(calls, _answer_words)}

    def trace(self, state: State) -> dict[str, Any]:
        return {"answer": state.get("answer", "")}
