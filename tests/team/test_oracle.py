"""Per-role oracles (mhgpo/team/oracle.py): a replaced role gives its gold output and costs no LLM call; the gold
context shows the Answerer exactly the gold paragraphs; bad names are refused."""

from __future__ import annotations

import pytest

from mhgpo.config import EvalConfig, SearchConfig, load_config
from mhgpo.data.records import Example, Passage
from mhgpo.errors import InputError
from mhgpo.model.generation import Generation
from mhgpo.rl.evaluation import evaluate_examples
from mhgpo.team.oracle import with_oracles
from mhgpo.team.search_system import ANSWERER, RERANKER, REWRITER, SearchSystem

PASSAGES = [
    Passage("a", "Alpha", "Alpha is a film directed by Beta."),
    Passage("b", "Beta", "Beta was born in Gam."),
    Passage("c", "Delta", "Delta is a river."),
    Passage("d", "Epsilon", "Epsilon film."),
]
CONTEXT = (
    ("Delta", "Delta is a river."),
    ("Alpha", "Alpha is a film directed by Beta."),
    ("Beta", "Beta was born in Gam."),
)
EXAMPLE = Example(
    "q1",
    "Where was the director of Alpha born?",
    ("Gam",),
    supporting_titles=("Alpha", "Beta"),
    context=CONTEXT,
    supporting_context=((1,), (2,)),
)


class WordRetriever:
    """Passages sharing a word (4+ letters) with the query, in corpus order."""

    def __init__(self):
        self.queries: list[str] = []

    def search_batch(self, queries, k):
        self.queries += queries
        words = [{w.strip("?.,").lower() for w in q.split() if len(w) > 3} for q in queries]
        return [[p for p in PASSAGES if ws & {w.strip(".").lower() for w in p.text.split()}][:k] for ws in words]


def encode(messages):
    return [ord(c) for m in messages for c in m["content"]]


class RoleGenerator:
    """A fixed output per role (recognised from its prompt); records which roles it was asked for."""

    OUTPUTS = {REWRITER: "### Delta river ###", RERANKER: "0", ANSWERER: "Gam"}

    def __init__(self):
        self.roles: list[str] = []

    def generate(self, prompts, params):
        out = []
        for ids in prompts:
            text = "".join(map(chr, ids))
            role = (
                REWRITER
                if "Original question is" in text
                else RERANKER
                if "Do not output anything else." in text
                else ANSWERER
            )
            self.roles.append(role)
            out.append(Generation(list(ids), [1], [-0.5], self.OUTPUTS[role], True))
        return out


def evaluate(oracles):
    retriever = WordRetriever()
    team = with_oracles(SearchSystem(retriever, SearchConfig(top_k=2, max_candidates=4)), oracles)
    generator = RoleGenerator()
    result = evaluate_examples([EXAMPLE], team, generator, encode, progress=False)
    [prediction] = result.predictions
    return prediction, generator.roles, retriever.queries


def test_without_oracles_the_team_is_unchanged():
    team = SearchSystem(WordRetriever())
    assert with_oracles(team, []) is team
    prediction, roles, queries = evaluate([])
    assert roles == [REWRITER, RERANKER, ANSWERER]
    assert queries == ["Delta river"]
    assert prediction["trace"]["selected_titles"] == ["Delta"]


def test_rewriter_oracle_writes_the_gold_queries_without_a_call():
    prediction, roles, queries = evaluate([REWRITER])
    assert roles == [RERANKER, ANSWERER]  # the Rewriter costs no LLM call
    # gold_queries: the supporting title the question names, then the question (fewer than two titles named)
    assert queries == ["Alpha", EXAMPLE.question]
    assert prediction["trace"]["subqueries"] == queries


def test_reranker_oracle_keeps_the_retrieved_gold_paragraphs():
    prediction, roles, _ = evaluate([REWRITER, RERANKER])
    assert roles == [ANSWERER]
    assert prediction["trace"]["retrieved_titles"][:1] == ["Alpha"]
    assert prediction["trace"]["selected_titles"] == [
        t for t in prediction["trace"]["retrieved_titles"] if t in ("Alpha", "Beta")
    ]
    assert prediction["trace"]["selected_titles"]  # something gold was retrieved


def test_context_oracle_shows_the_answerer_exactly_the_gold_paragraphs():
    prediction, roles, queries = evaluate(["context"])
    assert roles == [ANSWERER] and queries == []  # nothing is retrieved
    assert prediction["trace"]["retrieved_titles"] == ["Alpha", "Beta"]
    assert prediction["trace"]["selected_titles"] == ["Alpha", "Beta"]
    assert prediction["prediction"] == "Gam" and prediction["f1"] == 1.0


def test_context_oracle_needs_records_with_their_paragraphs():
    team = with_oracles(SearchSystem(WordRetriever()), ["context"])
    bare = Example("q2", "Where?", ("Gam",), supporting_titles=("Alpha",))
    with pytest.raises(InputError, match="q2.*no gold paragraphs"):
        evaluate_examples([bare], team, RoleGenerator(), encode, progress=False)


@pytest.mark.parametrize("name, message", [("answerer", "final agent"), ("critic", "unknown role 'critic'")])
def test_bad_oracles_are_refused(name, message):
    with pytest.raises(InputError, match=message):
        with_oracles(SearchSystem(WordRetriever()), [name])


def test_eval_config_takes_oracles():
    cfg = load_config(EvalConfig, None, ["oracle=[reranker,context]"])
    assert cfg.oracle == ["reranker", "context"]
    assert load_config(EvalConfig, None, ["oracle=reranker"]).oracle == ["reranker"]
    with pytest.raises(InputError, match="oracle: expected a list of role names"):
        load_config(EvalConfig, None, ['oracle=[""]'])
