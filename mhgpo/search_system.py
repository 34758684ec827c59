"""The default multi-agent search system (DESIGN §2): Rewriter → Retriever (tool) → Reranker → Answerer.

Prompts come from `prompts.yaml` (the paper's appendix); parsers are pure functions that never raise on model
output and return what they parsed plus the agent-specific penalty. `LLMOnly` is the single-agent baseline
(the model answers directly, no retrieval).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Protocol

import yaml

from mhgpo.config import AgentSampling, SystemConfig
from mhgpo.records import Passage
from mhgpo.workflow import State, StepResult, Workflow

REWRITER, RETRIEVER, RERANKER, ANSWERER = "rewriter", "retriever", "reranker", "answerer"
LLM = "llm"

_BLOCK = re.compile(r"###(.*?)###", re.DOTALL)
_INT = re.compile(r"\d+")


@lru_cache(maxsize=None)
def load_prompts() -> dict[str, dict[str, str]]:
    """The agent prompt templates, read once from the package's `prompts.yaml`."""
    text = resources.files("mhgpo").joinpath("prompts.yaml").read_text(encoding="utf-8")
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


def parse_reranker(output: str, num_candidates: int) -> RerankerParse:
    """The integers in the output, in order, are the selected document ids.

    Duplicates and out-of-range ids are dropped and penalised; text that holds no integer at all is penalised
    (non-numeric words around the ids are ignored).
    """
    ids = [int(m) for m in _INT.findall(output) if len(m) <= 6]
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


def format_documents(passages: list[Passage], template: str, snippet_words: int) -> str:
    parts = []
    for i, p in enumerate(passages):
        words = p.text.split()
        snippet = " ".join(words[:snippet_words]) + (" ..." if len(words) > snippet_words else "")
        parts.append(template.format(index=i, title=p.title, snippet=snippet))
    return "\n\n".join(parts)


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


def _messages(agent: str, **fields: str) -> list[dict[str, str]]:
    prompt = load_prompts()[agent]
    return [
        {"role": "system", "content": prompt["system"].format(**fields)},
        {"role": "user", "content": prompt["user"].format(**fields)},
    ]


@dataclass
class SearchSystem(Workflow):
    """Rewriter → Retriever → Reranker → Answerer, with the composite (format) rewards of DESIGN §2."""

    retriever: Retriever
    config: SystemConfig = field(default_factory=SystemConfig)

    agents = (REWRITER, RERANKER, ANSWERER)
    tools = (RETRIEVER,)

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
        return _messages(agent, question=question, documents=format_documents(docs, template, self.config.snippet_words))

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
            p = parse_reranker(output, len(state.get("candidates")))
            return StepResult(
                state.with_values(selected=p.selected),
                cfg.reranker_penalty if p.penalised else 0.0,
                {"selected": list(p.selected), "invalid": p.invalid, "reason": p.reason},
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

    def final_answer(self, state: State) -> str:
        return state.get("answer", "")

    def sampling(self, agent: str) -> AgentSampling:
        return getattr(self.config, agent)

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

    config: SystemConfig = field(default_factory=SystemConfig)

    agents = (LLM,)

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

    def sampling(self, agent: str) -> AgentSampling:
        return self.config.answerer

    def trace(self, state: State) -> dict[str, Any]:
        return {"answer": state.get("answer", "")}
