"""Iterative retrieval: a Planner reads what was found so far, then either searches again or answers.

    mhgpo train --system examples/iterative_search.py:IterativeSearch --steps 2 team.max_rounds=3

The question itself is searched first; then the Planner writes `Search: <query>` (another search) or
`Answer: <answer>`, at most `max_rounds` times. The routing depends on its output and the Planner is visited
several times per rollout: MHGPO groups its samples per visit and propagates the answer's F1 back to each turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mhgpo.config import AgentSampling
from mhgpo.data.metrics import normalize_answer
from mhgpo.errors import InputError
from mhgpo.team.search_system import format_documents, merge_candidates, parse_answer
from mhgpo.team.workflow import State, StepResult, Workflow, mean_of

SEARCH = re.compile(r"^\W*search\b\s*(for\b)?\s*[:\-]?\s*", re.IGNORECASE)
ANSWER = re.compile(r"^\W*(the\s+)?(final\s+)?answer\b(?:[^:\n]*:|\s*(?:is\b)?)\s*", re.IGNORECASE)
SYSTEM = (
    "You answer questions with a search engine. Reply with one line: 'Search: <query>' to look for what is "
    "missing, or 'Answer: <answer>' in a few words once the documents give it. For example 'Search: birthplace "
    "of Ann Lee' or 'Answer: Paris'."
)


@dataclass
class IterativeSearchConfig:
    max_rounds: int = 3  # Planner turns per question; the last one answers
    top_k: int = 3  # passages per search
    max_documents: int = 6  # passages shown to the Planner (the first found)
    snippet_words: int = 40
    max_answer_words: int = 10
    format_penalty: float = -0.5  # neither "Search: ..." nor "Answer: ...", or an empty or too long answer
    planner: AgentSampling = field(default_factory=lambda: AgentSampling(max_new_tokens=32))

    def validate(self) -> None:
        if self.max_rounds < 1:
            raise InputError(f"team.max_rounds: must be at least 1, got {self.max_rounds}")


class IterativeSearch(Workflow):
    agents = ("planner",)
    tools = ("retriever",)
    config_class = IterativeSearchConfig

    def __init__(self, config: IterativeSearchConfig, retriever):
        self.config, self.retriever = config, retriever

    def init_state(self, example) -> State:
        return State(example).with_values(queries=(example.question,), searched=0, documents=(), turns=0)

    def next_agent(self, state: State) -> str | None:
        if "answer" in state:
            return None
        return "retriever" if state.get("searched") < len(state.get("queries")) else "planner"

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        hits = self.retriever.search_batch([s.get("queries")[-1] for s in states], self.config.top_k)
        out = []
        for s, found in zip(states, hits):
            documents = merge_candidates([list(s.get("documents")), found], 10**6)
            out.append(
                StepResult(
                    s.with_values(documents=tuple(documents), searched=s.get("searched") + 1),
                    info={"query": s.get("queries")[-1], "titles": [p.title for p in found]},
                )
            )
        return out

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        shown = state.get("documents")[: self.config.max_documents]
        docs = format_documents(list(shown), "Document{index} ({title}): {snippet}", self.config.snippet_words)
        last = state.get("turns") + 1 >= self.config.max_rounds
        ask = "This is your last turn: reply 'Answer: <answer>'." if last else "Reply 'Answer: ...' or 'Search: ...'."
        queries = "; ".join(state.get("queries"))
        return [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"{docs}\n\nQueries so far: {queries}\n\nQuestion: {state.example.question}\n{ask}",
            },
        ]

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        cfg, turns = self.config, state.get("turns") + 1
        search = SEARCH.match(output)
        if search and turns < cfg.max_rounds:
            query = output[search.end() :].strip() or state.example.question
            return StepResult(
                state.with_values(queries=state.get("queries") + (query,), turns=turns),
                0.0,
                {"action": "search", "query": query},
            )
        answer = ANSWER.match(output)
        if answer or turns >= cfg.max_rounds:  # the last turn answers whatever it says
            prefix = answer or search
            text, too_long = parse_answer(output[prefix.end() if prefix else 0 :], cfg.max_answer_words)
            hollow = not set(normalize_answer(text).split()) - {"answer"}  # "Answer:", "Answer: answer."
            penalty = cfg.format_penalty if too_long or hollow or not answer else 0.0
            info = {"action": "answer", "answer": text}
            return StepResult(state.with_values(answer=text, turns=turns), penalty, info)
        query = output.strip() or state.example.question  # no format: searched as it is, penalised
        return StepResult(
            state.with_values(queries=state.get("queries") + (query,), turns=turns),
            cfg.format_penalty,
            {"action": "search", "query": query, "reason": "no Search:/Answer:"},
        )

    def final_answer(self, state: State) -> str:
        return state.get("answer", "")

    def sampling(self, agent: str) -> AgentSampling:
        return self.config.planner

    def behaviour(self, agent: str, calls: list) -> dict[str, float]:
        answered = [n for n in calls if n.info.get("action") == "answer"]
        return {
            "search_rate": mean_of(calls, lambda n: n.info.get("action") == "search"),
            "answer_turn": mean_of(answered, lambda n: n.visit + 1),
        }

    def trace(self, state: State) -> dict:
        return {
            "queries": list(state.get("queries")),
            "titles": [p.title for p in state.get("documents")],
            "answer": state.get("answer", ""),
        }
