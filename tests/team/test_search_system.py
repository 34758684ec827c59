"""Parsers of the three-agent search system (property-based on arbitrary strings) and its workflow."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mhgpo.config import SearchConfig
from mhgpo.data.records import Example, Passage
from mhgpo.team.search_system import (
    ANSWERER,
    RERANKER,
    RETRIEVER,
    REWRITER,
    SearchSystem,
    format_documents,
    format_ids,
    format_queries,
    gold_ids,
    gold_queries,
    grounded,
    load_prompts,
    merge_candidates,
    parse_answer,
    parse_reranker,
    parse_rewriter,
)

Q = "Who directed Blue Harbor?"


def test_rewriter_parses_block():
    p = parse_rewriter("Sure! ### who directed Blue Harbor; where was he born ### done", Q)
    assert p.queries == ("who directed Blue Harbor", "where was he born")
    assert not p.penalised


def test_rewriter_strips_angle_brackets_and_empties():
    p = parse_rewriter("### <q1>; ; <q2> ###", Q)
    assert p.queries == ("q1", "q2")
    assert not p.penalised


def test_rewriter_without_block_falls_back_to_question_and_is_penalised():
    p = parse_rewriter("who directed Blue Harbor?", Q)
    assert p.queries == (Q,)
    assert p.penalised


def test_rewriter_empty_block_falls_back():
    assert parse_rewriter("###   ###", Q).queries == (Q,)
    assert parse_rewriter("###   ###", Q).penalised


def test_rewriter_too_many_queries_penalised_but_kept():
    p = parse_rewriter("### a; b; c; d; e ###", Q, max_queries=4)
    assert p.queries == ("a", "b", "c", "d", "e")
    assert p.penalised
    assert not parse_rewriter("### a; b; c; d ###", Q, max_queries=4).penalised


def test_rewriter_too_long_penalised():
    long = "x" * 301
    assert parse_rewriter(f"### {long} ###", Q, max_chars=300).penalised
    assert not parse_rewriter(f"### {'x' * 300} ###", Q, max_chars=300).penalised


@given(st.text())
@settings(max_examples=300)
def test_rewriter_never_raises_and_always_has_a_query(text):
    p = parse_rewriter(text, Q)
    assert len(p.queries) >= 1
    assert all(q.strip() for q in p.queries)
    if "###" not in text:
        assert p.penalised and p.queries == (Q,)


def test_reranker_valid_ids():
    p = parse_reranker("2, 0, 5", 10)
    assert p.selected == (2, 0, 5) and p.invalid == 0 and not p.penalised


def test_reranker_document_prefix_and_words_ignored():
    p = parse_reranker("Document3 and Document1 are useful", 5)
    assert p.selected == (3, 1) and not p.penalised


def test_reranker_duplicate_and_out_of_range_dropped_and_penalised():
    p = parse_reranker("1, 1, 12, 4", 10)
    assert p.selected == (1, 4)
    assert p.invalid == 2
    assert p.penalised


def test_reranker_none_is_a_valid_empty_selection():
    for text in ("None", " none.", "NONE\n"):
        p = parse_reranker(text, 5)
        assert p.selected == () and not p.penalised
    assert parse_rewriter(format_queries(["a b", "c"]), "Q").queries == ("a b", "c")
    assert format_ids([2, 0]) == "2, 0" and parse_reranker(format_ids([2, 0]), 3).selected == (2, 0)
    assert format_ids([]) == "None"


def test_gold_queries_use_the_decomposition_else_the_titles_the_question_names():
    ex = Example(
        "q",
        "Which was founded first, Arda Motors or Tel Foods?",
        ("Arda Motors",),
        supporting_titles=("Tel Foods", "Arda Motors"),
    )
    assert gold_queries(ex) == ("Arda Motors", "Tel Foods")  # the question's order
    bridge = Example(
        "q",
        "The director of 'Big Stone Gap' is based in what New York city?",
        ("Greenwich Village",),
        supporting_titles=("Big Stone Gap (film)", "Adriana Trigiani"),
    )
    assert gold_queries(bridge) == ("Big Stone Gap", bridge.question)  # the hidden bridge title is never used
    nothing = Example("q", "Who?", ("x",), supporting_titles=("Alpha",))
    assert gold_queries(nothing) == ("Who?",)
    hops = Example("q", "Q?", ("x",), supporting_titles=("A",), decomposition=("h1?", "h2?", "h3?"))
    assert gold_queries(hops) == ("h1?", "h2?", "h3?") and gold_queries(hops, max_queries=2) == ("h1?", "h2?")


def test_gold_ids_and_grounded_answers():
    passages = [
        Passage("a", "Alpha", "Alpha was born in 1918."),
        Passage("b", "Beta", "beta"),
        Passage("c", "Gamma", "gamma"),
    ]
    assert gold_ids(passages, ("Gamma", "Alpha")) == (0, 2)  # retrieval order
    assert gold_ids(passages, ("Delta",)) == ()
    assert grounded("1918", "When?", passages[:1]) and not grounded("1918", "When?", passages[1:])
    assert grounded("yes", "Same city?", []) and grounded("Beta", "Alpha or Beta?", [])
    assert not grounded("", "Q?", passages)


def test_demonstrations_walk_the_pipeline_with_gold_outputs():
    passages = [
        Passage("a", "Alpha", "Alpha is a film by Beta."),
        Passage("b", "Beta", "Beta was born in Gam."),
        Passage("c", "Gamma", "gamma"),
    ]
    system = SearchSystem(FakeRetriever(passages), SearchConfig(top_k=2))
    ex = Example(
        "q1",
        "Where was the director of Alpha born?",
        ("Gam",),
        supporting_titles=("Alpha", "Beta"),
        decomposition=("Who directed Alpha?", "Where was the director of Alpha born?"),
    )
    s = system.init_state(ex)
    assert system.demonstration(s, REWRITER) == "### Who directed Alpha?; Where was the director of Alpha born? ###"
    s = system.apply(s, REWRITER, system.demonstration(s, REWRITER)).state
    [r] = system.call_tools(RETRIEVER, [s])
    s = r.state
    assert system.demonstration(s, RERANKER) == "0, 1"
    s = system.apply(s, RERANKER, "1").state  # a Reranker that kept only Beta: the answer is still shown
    assert system.demonstration(s, ANSWERER) == "Gam"
    s = system.apply(s, RERANKER, "None").state  # nothing shown: no Answerer demonstration
    assert system.demonstration(s, ANSWERER) is None


def test_reranker_nothing_parseable():
    p = parse_reranker("none of them", 10)
    assert p.selected == () and p.penalised


@given(st.text(), st.integers(min_value=0, max_value=12))
@settings(max_examples=300)
def test_reranker_never_raises_and_selection_is_valid(text, n):
    p = parse_reranker(text, n)
    assert len(set(p.selected)) == len(p.selected)
    assert all(0 <= i < n for i in p.selected)
    said_none = text.strip(" .!\n\t").lower() == "none" and not any(c.isdigit() for c in text)
    no_id = not any(c.isdigit() for c in text) and not said_none
    assert p.penalised == (p.invalid > 0 or no_id or p.reason == "no document id")


def test_answer_prefix_and_length():
    assert parse_answer("Answer: Paris") == ("Paris", False)
    assert parse_answer("The answer is: 1931") == ("1931", False)
    words = " ".join(["w"] * 31)
    assert parse_answer(words, max_words=30) == (words, True)
    assert parse_answer(" ".join(["w"] * 30), max_words=30)[1] is False


@given(st.text())
@settings(max_examples=300)
def test_answer_never_raises(text):
    answer, long = parse_answer(text, 30)
    assert isinstance(answer, str)
    assert long == (len(answer.split()) > 30)


def _p(i, title=None):
    return Passage(f"p{i}", title or f"T{i}", f"text {i} " * 5)


def test_merge_candidates_dedup_order_cap():
    a, b, c, d = _p(1), _p(2), _p(3), _p(4)
    assert merge_candidates([[a, b], [b, c], [d, a]], cap=10) == [a, b, c, d]
    assert merge_candidates([[a, b], [b, c], [d, a]], cap=3) == [a, b, c]


def test_format_documents_truncates_snippets():
    p = Passage("x", "Title", "one two three four five")
    text = format_documents([p], "Document{index}: title: {title}, snippet: {snippet}", 3)
    assert text == "Document0: title: Title, snippet: one two three ..."


def test_prompts_are_the_papers():
    prompts = load_prompts()
    assert "### <query1>; <query2>; <query3>; ... ###" in prompts["rewriter"]["system"]
    assert prompts["rewriter"]["user"] == "Original question is {question}"
    assert "Do not output anything else." in prompts["reranker"]["user"]


class FakeRetriever:
    def __init__(self, passages):
        self.passages = passages
        self.calls = []

    def search_batch(self, queries, k):
        self.calls.append(list(queries))
        return [[p for p in self.passages if any(w in p.text for w in q.split())][:k] for q in queries]


def test_search_system_runs_the_pipeline_by_hand():
    passages = [Passage("a", "Alpha", "alpha fact"), Passage("b", "Beta", "beta fact"), Passage("c", "Gamma", "gamma")]
    retriever = FakeRetriever(passages)
    system = SearchSystem(retriever, SearchConfig(top_k=2))
    ex = Example("q1", "alpha or beta?", ("alpha",))
    s = system.init_state(ex)
    assert system.next_agent(s) == REWRITER
    r = system.apply(s, REWRITER, "### alpha; beta ###")
    assert r.penalty == 0.0
    s = r.state
    assert system.next_agent(s) == RETRIEVER and system.is_tool(RETRIEVER)
    [r] = system.call_tools(RETRIEVER, [s])
    assert retriever.calls == [["alpha", "beta"]]
    s = r.state
    assert [p.id for p in s.get("candidates")] == ["a", "b"]
    assert system.next_agent(s) == RERANKER
    msgs = system.build_prompt(s, RERANKER)
    assert "Document0: title: Alpha, snippet: alpha fact" in msgs[1]["content"]
    assert "Document1: title: Beta" in msgs[1]["content"]
    r = system.apply(s, RERANKER, "1, 1, 7")
    assert r.penalty == -0.5 and r.state.get("selected") == (1,)
    s = r.state
    msgs = system.build_prompt(s, ANSWERER)
    assert "Document 0: title: Beta" in msgs[1]["content"] and "Alpha" not in msgs[1]["content"]
    r = system.apply(s, ANSWERER, "beta")
    assert system.next_agent(r.state) is None
    assert system.final_answer(r.state) == "beta"
    trace = system.trace(r.state)
    assert trace["selected_titles"] == ["Beta"] and trace["subqueries"] == ["alpha", "beta"]


def test_penalty_values_come_from_config():
    system = SearchSystem(FakeRetriever([]), SearchConfig(rewriter_penalty=-0.25, answerer_penalty=-2.0))
    s = system.init_state(Example("q", "Q?", ("a",)))
    assert system.apply(s, REWRITER, "no block").penalty == -0.25
    assert system.apply(s, ANSWERER, " ".join(["w"] * 40)).penalty == -2.0


def test_the_reranker_behaviour_counts_the_retrieved_gold_passages_it_keeps():
    """gold_recall: over the calls that retrieved a gold passage, the mean share of them the Reranker selected;
    absent where no call retrieved one (or the data names no gold titles)."""
    from types import SimpleNamespace

    passages = [Passage("a", "Alpha", "x a"), Passage("b", "Beta", "x b"), Passage("c", "Gamma", "x c")]
    system = SearchSystem(FakeRetriever(passages), SearchConfig(top_k=3))

    def reranked(example: Example, output: str) -> SimpleNamespace:
        s = system.apply(system.init_state(example), REWRITER, "### x ###").state
        [r] = system.call_tools(RETRIEVER, [s])
        step = system.apply(r.state, RERANKER, output)
        return SimpleNamespace(info=step.info, penalty=step.penalty)

    two = Example("q1", "Q?", ("a",), supporting_titles=("Alpha", "Gamma"))  # gold candidates 0 and 2
    none = Example("q2", "Q?", ("a",), supporting_titles=("Delta",))  # no gold passage retrieved
    plain = Example("q3", "Q?", ("a",))  # no gold titles at all
    both, first, wrong = reranked(two, "0, 2"), reranked(two, "0, 1"), reranked(two, "1")
    assert (both.info["gold"], both.info["gold_selected"], first.info["gold_selected"]) == (2, 2, 1)
    assert "gold" not in reranked(plain, "0").info and reranked(none, "0").info["gold"] == 0
    calls = [both, first, wrong, reranked(none, "0"), reranked(plain, "0")]
    b = system.behaviour(RERANKER, calls)
    assert b["gold_recall"] == (1.0 + 0.5 + 0.0) / 3 and b["num_selected"] == (2 + 2 + 1 + 1 + 1) / 5
    assert b["invalid_rate"] == 0.0
    assert "gold_recall" not in system.behaviour(RERANKER, [reranked(none, "0"), reranked(plain, "1")])
