"""A Solver answers from retrieved documents; a Verifier checks the answer and may send it back once.

    mhgpo train --system examples/solver_verifier.py:SolverVerifier --steps 2

Retriever (the question) → Solver → Verifier → if the Verifier says "Wrong: <reason>", the Solver answers once
more, with its first answer and the reason in its prompt. The Solver's last answer is the team's. An unclear
verdict counts as "wrong" and is penalised, so the Verifier learns a format as well as when to reject.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mhgpo.config import AgentSampling
from mhgpo.team.search_system import format_documents, parse_answer
from mhgpo.team.workflow import State, StepResult, Workflow, mean_of

WRONG = re.compile(r"\b(wrong|incorrect|no)\b\W*", re.IGNORECASE)
RIGHT = re.compile(r"\b(correct|right|yes)\b", re.IGNORECASE)


@dataclass
class SolverVerifierConfig:
    top_k: int = 4  # passages retrieved for the question
    snippet_words: int = 40
    max_answer_words: int = 10
    answer_penalty: float = -0.5  # Solver: an answer longer than max_answer_words
    verdict_penalty: float = -0.5  # Verifier: neither "Correct" nor "Wrong: ..."
    solver: AgentSampling = field(default_factory=lambda: AgentSampling(max_new_tokens=16))
    verifier: AgentSampling = field(default_factory=lambda: AgentSampling(max_new_tokens=24))


class SolverVerifier(Workflow):
    agents = ("solver", "verifier")
    tools = ("retriever",)
    config_class = SolverVerifierConfig

    def __init__(self, config: SolverVerifierConfig, retriever):
        self.config, self.retriever = config, retriever

    def next_agent(self, state: State) -> str | None:
        attempts, verdicts = state.get("attempts", ()), state.get("verdicts", ())
        if "documents" not in state:
            return "retriever"
        if not attempts or (len(attempts) == 1 and verdicts == ("wrong",)):
            return "solver"
        return "verifier" if not verdicts else None

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        hits = self.retriever.search_batch([s.example.question for s in states], self.config.top_k)
        return [
            StepResult(s.with_values(documents=tuple(found)), info={"titles": [p.title for p in found]})
            for s, found in zip(states, hits)
        ]

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        docs = format_documents(
            list(state.get("documents")), "Document{index} ({title}): {snippet}", self.config.snippet_words
        )
        attempts = state.get("attempts", ())
        if agent == "solver":
            task = "Answer the question in a few words."
            if attempts:
                task = (
                    f"Your answer '{attempts[-1]}' was judged wrong: {state.get('reason')}. "
                    f"Answer again in a few words."
                )
        else:
            task = (
                f"Proposed answer: {attempts[-1]}\nReply 'Correct' if the documents support it, else 'Wrong: ' and why."
            )
        return [{"role": "user", "content": f"{docs}\n\nQuestion: {state.example.question}\n{task}"}]

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        cfg = self.config
        if agent == "solver":
            answer, too_long = parse_answer(output, cfg.max_answer_words)
            return StepResult(
                state.with_values(attempts=state.get("attempts", ()) + (answer,)),
                cfg.answer_penalty if too_long else 0.0,
                {"answer": answer},
            )
        wrong, right = WRONG.search(output), RIGHT.search(output)
        verdict = "correct" if right and not wrong else "wrong"
        reason = output[wrong.end() :].strip() if wrong else "the verifier was not convinced"
        return StepResult(
            state.with_values(verdicts=(verdict,), reason=reason or "no reason given"),
            0.0 if (wrong or right) else cfg.verdict_penalty,
            {"verdict": verdict, "reason": reason},
        )

    def final_answer(self, state: State) -> str:
        return state.get("attempts", ("",))[-1]

    def sampling(self, agent: str) -> AgentSampling:
        return getattr(self.config, agent)

    def behaviour(self, agent: str, calls: list) -> dict[str, float]:
        if agent == "verifier":
            return {"reject_rate": mean_of(calls, lambda n: n.info["verdict"] == "wrong")}
        return {
            "answer_words": mean_of(calls, lambda n: len(n.info["answer"].split())),
            "second_attempts": mean_of(calls, lambda n: n.visit == 1),
        }
