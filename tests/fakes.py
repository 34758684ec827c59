"""Fakes that rollouts run on without a model: a generator and a retriever that record their calls, the search team
recording its tool calls, looping workflows of two agents, and the queries the rollout tests make of the trees they
grow. The token ids of a chat are the code points of its text, so that the fake generator reads its prompts back."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from mhgpo.config import SearchConfig
from mhgpo.data.records import Example, Passage
from mhgpo.model.generation import Generation, SamplingParams
from mhgpo.rl.rollout import run_rollouts
from mhgpo.rl.tree import RolloutBatch, RolloutSpec
from mhgpo.team.search_system import ANSWERER, RERANKER, REWRITER, SearchSystem
from mhgpo.team.workflow import State, StepResult, Workflow

G = 4
AGENTS = (REWRITER, RERANKER, ANSWERER)

EXAMPLES = [
    Example("q0", "Which city is the capital of France?", ("Paris",)),
    Example("q1", "Which city is the capital of Germany?", ("Berlin", "Berlin city")),
    Example("q2", "Which city is the capital of Italy?", ("Rome",)),
    Example("q3", "Which city is the capital of Spain?", ("Madrid",)),
    Example("q4", "Which city is the capital of Japan?", ("Tokyo",)),
    Example("q5", "Which city is the capital of Peru?", ("Lima",)),
]

# Outputs cycle with a global generation counter, so consecutive samples (one group) differ.
SEARCH_OUTPUTS = {
    REWRITER: ["### capital city; country ###", "capital city of the country", "### a; b; c; d; e ###"],
    RERANKER: ["0, 1", "2", "1, 1", "0, 2, 1", "no ids"],
    ANSWERER: ["Paris", "Answer: Berlin", "Paris and Berlin", "Rome", " ".join(["word"] * 30 + ["Paris"])],
}

# rr_probs that force the fork at the first, second or third agent
RR_FIRST, RR_SECOND, RR_THIRD = (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)


# ----------------------------------------------------------------------------------------------------------- fakes


def encode(messages: list[dict[str, str]]) -> list[int]:
    """Deterministic token ids of a chat: the code points of its text (decodable by the fake generator)."""
    return [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def search_agent_of(text: str) -> str:
    if "Original question is" in text:
        return REWRITER
    if "Do not output anything else." in text:
        return RERANKER
    if "Now, answer the Question" in text:
        return ANSWERER
    raise AssertionError(f"unrecognised prompt: {text[:80]!r}")


@dataclass
class Call:
    agents: list[str]
    params: SamplingParams
    prompts: list[list[int]]


class FakeGenerator:
    """Deterministic, varied outputs; records every `generate` call and every generation in order."""

    def __init__(self, agent_of, respond):
        self.agent_of = agent_of
        self.respond = respond  # (agent, k, prompt text) -> output text
        self.calls: list[Call] = []
        self.generated: list[Generation] = []
        self.k = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        texts = [decode(p) for p in prompts]
        agents = [self.agent_of(t) for t in texts]
        self.calls.append(Call(agents, params, [list(p) for p in prompts]))
        out = []
        for prompt, text, agent in zip(prompts, texts, agents):
            k = self.k
            self.k += 1
            length = 1 + k % 3
            gen = Generation(
                prompt_ids=list(prompt),
                output_ids=[10_000 + k] * length,
                logprobs=[-0.01 * (k + 1)] * length,
                text=self.respond(agent, k, text),
                finished=True,
            )
            out.append(gen)
            self.generated.append(gen)
        return out


def search_generator() -> FakeGenerator:
    return FakeGenerator(search_agent_of, lambda agent, k, text: SEARCH_OUTPUTS[agent][k % len(SEARCH_OUTPUTS[agent])])


class FakeRetriever:
    def __init__(self):
        self.calls: list[list[str]] = []

    def search_batch(self, queries: list[str], k: int) -> list[list[Passage]]:
        self.calls.append(list(queries))
        return [[Passage(f"{q}#{i}", f"{q} {i}", f"passage {i} about {q}") for i in range(k)] for q in queries]


class RecordingSearch(SearchSystem):
    """The search system, recording each batched tool call as (tool, number of states)."""

    tool_calls: list[tuple[str, int]]

    def call_tools(self, tool, states):
        self.tool_calls.append((tool, len(states)))
        return super().call_tools(tool, states)


def search_system() -> RecordingSearch:
    system = RecordingSearch(FakeRetriever(), SearchConfig())
    system.tool_calls = []
    return system


# -------------------------------------------------------------------- rollouts of the search team, and their trees


def rollout(sampler, n_questions=3, rr_probs=(0.7, 0.1, 0.2), seed=0, regroup="fork", greedy=False, max_rounds=64):
    system, gen = search_system(), search_generator()
    spec = RolloutSpec(sampler=sampler, group_size=G, rr_probs=rr_probs, rr_regroup=regroup, greedy=greedy)
    batch = run_rollouts(
        EXAMPLES[:n_questions], system, gen, encode, spec, np.random.default_rng(seed), max_rounds=max_rounds
    )
    return batch, system, gen


def groups(batch: RolloutBatch) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for n in batch.nodes:
        if n.trained:
            out[n.group_id].append(n)
    return dict(out)


def children(batch: RolloutBatch) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for n in batch.nodes:
        if n.parent_id >= 0:
            out[n.parent_id].append(n)
    return out


def ancestor(batch: RolloutBatch, node, agent: str):
    while node.agent != agent:
        node = batch.nodes[node.parent_id]
    return node


def hand_f1(prediction: str, answers: tuple[str, ...]) -> float:
    """Token F1 (best over aliases) for the punctuation- and article-free strings used here."""
    best = 0.0
    for gold in answers:
        p_tok, g_tok = prediction.lower().split(), gold.lower().split()
        same = sum((Counter(p_tok) & Counter(g_tok)).values())
        if same:
            precision, recall = same / len(p_tok), same / len(g_tok)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ----------------------------------------------------------------------------------------------- looping workflows


class SolverJudge(Workflow):
    """solver -> judge -> (judge says "retry": solver -> judge) -> done. The solver's last attempt is the answer."""

    agents = ("solver", "judge")

    def next_agent(self, state: State) -> str | None:
        attempts, verdicts = state.get("attempts", ()), state.get("verdicts", ())
        if not attempts:
            return "solver"
        if len(verdicts) < len(attempts):
            return "judge"
        if verdicts[-1] == "retry" and len(attempts) < 2:
            return "solver"
        return None

    def build_prompt(self, state: State, agent: str) -> list[dict[str, str]]:
        attempts = state.get("attempts", ())
        return [{"role": "user", "content": f"[{agent}] {state.example.question} | {' / '.join(attempts)}"}]

    def apply(self, state: State, agent: str, output: str) -> StepResult:
        if agent == "solver":
            return StepResult(
                state.with_values(attempts=state.get("attempts", ()) + (output,)), 0.0, {"answer": output}
            )
        verdict = "retry" if "retry" in output else "accept"
        return StepResult(
            state.with_values(verdicts=state.get("verdicts", ()) + (verdict,)),
            -0.1 if verdict == "retry" else 0.0,
            {"verdict": verdict},
        )

    def final_answer(self, state: State) -> str:
        return state.get("attempts")[-1]


# Questions of the looping workflows.
LOOP_EXAMPLES = [Example("a", "Solve A", ("right answer",)), Example("b", "Solve B", ("right answer",))]

# Two that a looping workflow answers, and one that a buggy workflow fails on.
GOOD = [Example("a", "Solve A", ("right answer",)), Example("c", "Solve C", ("right",))]
BAD = Example("bad", "Solve Bad", ("right answer",))


def loop_agent_of(text: str) -> str:
    return text[len("<user>[") : text.index("]")]


class LookupSolverJudge(SolverJudge):
    """SolverJudge with a batched tool called before every solver attempt."""

    tools = ("lookup",)

    def __init__(self):
        self.tool_calls: list[int] = []

    def next_agent(self, state: State) -> str | None:
        agent = super().next_agent(state)
        if agent == "solver" and len(state.get("lookups", ())) == len(state.get("attempts", ())):
            return "lookup"
        return agent

    def call_tools(self, tool: str, states: list[State]) -> list[StepResult]:
        assert tool == "lookup"
        self.tool_calls.append(len(states))
        return [
            StepResult(s.with_values(lookups=s.get("lookups", ()) + ("fact",)), 0.0, {"batch": len(states)})
            for s in states
        ]
