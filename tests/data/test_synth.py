"""Tests of the synthetic mini-wiki (mhgpo/data/synth.py): determinism, the HotpotQA layout, answerability, splits,
sizes (its files: test_synth_files.py)."""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter

import pytest

from mhgpo.data import synth, synth_vocab
from mhgpo.errors import InputError

KEYS = {"_id", "question", "answer", "type", "supporting_facts", "context", "level", "decomposition"}


@pytest.fixture(scope="module")
def small() -> synth.World:
    return synth.generate_world(seed=3, n_train=150, n_dev=40)


@pytest.fixture(scope="module")
def default() -> synth.World:
    return synth.generate_world()


def questions(world: synth.World) -> list[dict]:
    return world.train + world.dev


# --- determinism ------------------------------------------------------------------------------------------


def test_generation_leaves_global_random_state_alone() -> None:
    state = random.getstate()
    random.seed(1)
    a = synth.generate_world(seed=2, n_train=20, n_dev=5)
    random.seed(99)
    b = synth.generate_world(seed=2, n_train=20, n_dev=5)
    assert (a.corpus, a.train, a.dev) == (b.corpus, b.train, b.dev)
    random.setstate(state)
    synth.generate_world(seed=2, n_train=20, n_dev=5)
    assert random.getstate() == state


# --- layout -----------------------------------------------------------------------------------------------


def test_corpus_rows_ids_and_paragraph_shape(default: synth.World) -> None:
    assert 1000 <= len(default.corpus) <= 5000
    ids = [row["id"] for row in default.corpus]
    titles = [row["title"] for row in default.corpus]
    assert len(set(ids)) == len(ids) and len(set(titles)) == len(titles)
    for row in default.corpus:
        assert set(row) == {"id", "title", "text"}
        assert re.fullmatch(r"w\d{5}", row["id"])
        assert row["text"].startswith(row["title"])
        assert 40 <= len(row["text"].split()) <= 90, row
    for entity in default.entities:
        assert 2 <= len(entity.sentences) <= 4


def test_hotpotqa_layout(small: synth.World) -> None:
    ids = [q["_id"] for q in questions(small)]
    assert len(set(ids)) == len(ids)
    for q in questions(small):
        assert set(q) == KEYS
        assert all(isinstance(q[k], str) and q[k] for k in ("_id", "question", "answer", "type", "level"))
        assert q["type"] in ("bridge", "comparison")
        assert q["level"] in ("medium", "hard")
        assert len(q["context"]) == synth.MAX_CONTEXT
        for title, sentences in q["context"]:
            assert isinstance(title, str) and isinstance(sentences, list)
            assert sentences and all(isinstance(s, str) for s in sentences)
        assert len({title for title, _ in q["context"]}) == len(q["context"])
        assert len(q["supporting_facts"]) == 2
        for fact in q["supporting_facts"]:
            assert isinstance(fact, list) and isinstance(fact[0], str) and type(fact[1]) is int


def test_decomposition_names_only_what_the_question_names(small: synth.World) -> None:
    """Two hops per question, each a question; a hop never names a gold entity the question does not name (the
    bridge entity is the hidden intermediate answer), and each entity the question names is searched for."""
    for q in questions(small):
        hops = q["decomposition"]
        assert len(hops) == 2 and all(isinstance(h, str) and h.endswith("?") for h in hops)
        for title, _ in q["supporting_facts"]:
            if title in q["question"]:
                assert any(title in h for h in hops), (q["question"], hops)
            else:
                assert not any(title in h for h in hops), (q["question"], hops)


def test_context_paragraphs_are_corpus_paragraphs(small: synth.World) -> None:
    text_of = {row["title"]: row["text"] for row in small.corpus}
    for q in questions(small):
        for title, sentences in q["context"]:
            assert "".join(sentences) == text_of[title]
            assert all(s.startswith(" ") for s in sentences[1:]) and not sentences[0].startswith(" ")


def test_supporting_facts_point_at_sentences_of_distinct_context_paragraphs(small: synth.World) -> None:
    for q in questions(small):
        context = dict((title, sentences) for title, sentences in q["context"])
        gold = [title for title, _ in q["supporting_facts"]]
        assert len(set(gold)) == 2
        for title, index in q["supporting_facts"]:
            assert title in context
            assert 0 <= index < len(context[title])


# --- answerability ----------------------------------------------------------------------------------------


def check_answerable(world: synth.World) -> None:
    """Every answer can be read off the gold sentences (checked against the ground truth)."""
    entity = {e.name: e for e in world.entities}
    corpus_titles = {row["title"] for row in world.corpus}
    for q in questions(world):
        context = dict((title, sentences) for title, sentences in q["context"])
        (first, i), (second, j) = q["supporting_facts"]
        assert first in corpus_titles and second in corpus_titles
        hop1, hop2 = context[first][i], context[second][j]
        a, b = entity[first], entity[second]
        if q["type"] == "bridge":
            assert first in q["question"] and second not in q["question"]
            assert second in hop1  # the first paragraph names the bridge entity ...
            assert q["answer"] in hop2  # ... whose paragraph states the answer
            assert q["answer"] in {b.city, str(b.year), b.nationality, b.country}
            assert b.name in (a.person, a.city)
        elif q["answer"] in ("yes", "no"):
            assert first in q["question"] and second in q["question"]
            attr = next(word for word in ("nationality", "genre", "city", "birthplace") if word in q["question"])
            attr = "city" if attr == "birthplace" else attr
            assert getattr(a, attr) in hop1 and getattr(b, attr) in hop2
            assert a.kind == b.kind or {a.kind, b.kind} <= {"company", "band", "university"}
            assert (q["answer"] == "yes") == (getattr(a, attr) == getattr(b, attr))
        else:
            assert q["answer"] in (first, second) and first in q["question"] and second in q["question"]
            assert str(a.year) in hop1 and str(b.year) in hop2 and a.year != b.year
            assert q["answer"] == (first if a.year < b.year else second)


def test_every_question_of_a_small_world_is_answerable(small: synth.World) -> None:
    check_answerable(small)


def test_every_question_of_the_default_world_is_answerable(default: synth.World) -> None:
    assert (len(default.train), len(default.dev)) == (synth.DEFAULT_N_TRAIN, synth.DEFAULT_N_DEV)
    check_answerable(default)


def test_answerability_check_catches_a_wrong_answer(small: synth.World) -> None:
    broken = synth.World(
        corpus=small.corpus, train=[dict(q) for q in small.train[:30]], dev=[], entities=small.entities
    )
    for q in broken.train:
        q["answer"] = {"yes": "no", "no": "yes"}.get(q["answer"], "Nowhere")
        with pytest.raises(AssertionError):
            check_answerable(synth.World(corpus=small.corpus, train=[q], dev=[], entities=small.entities))


# --- splits and mix ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["small", "default"])
def test_train_and_dev_do_not_overlap(fixture: str, request: pytest.FixtureRequest) -> None:
    world = request.getfixturevalue(fixture)
    train = [q["question"] for q in world.train]
    dev = [q["question"] for q in world.dev]
    assert len(set(train)) == len(train) and len(set(dev)) == len(dev)
    assert not set(train) & set(dev)
    facts = [
        {(frozenset(t for t, _ in q["supporting_facts"]), q["answer"]) for q in rows}
        for rows in (world.train, world.dev)
    ]
    assert not facts[0] & facts[1]  # not even rephrased


@pytest.mark.parametrize("fixture", ["small", "default"])
def test_both_types_present_and_yes_no_balanced(fixture: str, request: pytest.FixtureRequest) -> None:
    world = request.getfixturevalue(fixture)
    for split in (world.train, world.dev):
        types = Counter(q["type"] for q in split)
        assert types["bridge"] > 0 and types["comparison"] > 0
        assert abs(types["bridge"] / len(split) - 0.6) <= 0.05
        answers = Counter(q["answer"] for q in split if q["answer"] in ("yes", "no"))
        total = answers["yes"] + answers["no"]
        assert total >= 0.15 * len(split)
        assert abs(answers["yes"] / total - 0.5) <= 0.15


def test_question_templates_vary(default: synth.World) -> None:
    def template(q: dict) -> str:
        text = q["question"]
        for title, _ in q["supporting_facts"]:
            text = text.replace(title, "X")
        return text

    templates = Counter(template(q) for q in default.train)
    assert len(templates) >= 40
    assert max(templates.values()) < 0.05 * len(default.train)


def test_confusable_names_exist_and_serve_as_distractors(default: synth.World) -> None:
    people = [e.name for e in default.entities if e.kind == "person"]
    by_first: dict[str, list[str]] = {}
    by_last: dict[str, list[str]] = {}
    for name in people:
        first, last = name.split(" ")
        by_first.setdefault(first, []).append(last)
        by_last.setdefault(last, []).append(first)
    near_twins = [
        (f, a, b)
        for f, lasts in by_first.items()
        for a in lasts
        for b in lasts
        if a != b and (b == a + "s" or b == a + "e" or (len(a) == len(b) and a[:-1] == b[:-1]))
    ]
    assert len(near_twins) >= 20
    assert sum(len(firsts) > 1 for firsts in by_last.values()) >= 100  # about 60 by chance alone
    titles = {e.name for e in default.entities if e.kind in ("film", "novel", "album")}
    assert sum(1 for t in titles if any(t.replace(n, n + "s") in titles for n in synth_vocab.NOUNS if n in t)) >= 10
    hard = [q for q in default.train if q["level"] == "hard"]
    assert len(hard) >= 0.2 * len(default.train)
    for q in hard:  # a hard question has a confusable of a gold paragraph among its distractors
        gold = [title for title, _ in q["supporting_facts"]]
        assert any(confusable(g, title) for g in gold for title, _ in q["context"] if title not in gold), q


COMMON = {
    *synth_vocab.NOUNS,
    *(n + "s" for n in synth_vocab.NOUNS),
    *synth_vocab.ADJECTIVES,
    *synth_vocab.COMPANIES,
    *synth_vocab.BAND_NOUNS,
    "The",
    "A",
    "An",
    "of",
    "for",
    "University",
    "Institute",
    "Technology",
    "College",
}


def confusable(a: str, b: str) -> bool:
    """Same invented word (a surname, a first name, a stem), or the same words but a letter or two."""
    wa, wb = a.split(" "), b.split(" ")
    if (set(wa) & set(wb)) - COMMON:
        return True
    if len(wa) != len(wb):
        return False
    differ = [(x, y) for x, y in zip(wa, wb) if x != y]
    return len(differ) == 1 and len(os.path.commonprefix(differ[0])) >= min(map(len, differ[0])) - 1


def test_confusable_helper() -> None:
    assert confusable("Velmora Daskin", "Velmora Daskins") and confusable("Orlen Vask", "Tira Vask")
    assert confusable("Silent Tessaly", "Silent Tessala") and confusable("Tessor Motors", "Tessor Foods")
    assert confusable("The Lantern of Orvik", "The Lanterns of Orvik")
    assert not confusable("The Lantern of Orvik", "The Lantern of Tessaly")
    assert not confusable("Orlen Vask", "Tira Dusk") and not confusable("Tessor Motors", "Brakel Motors")


# --- sizes and errors -------------------------------------------------------------------------------------


def test_sizes_scale_and_bad_sizes_are_rejected() -> None:
    assert len(synth.generate_world(n_train=10, n_dev=2).corpus) == 120
    assert len(synth.generate_world(n_train=10, n_dev=2, n_entities=300).corpus) == 300
    for kwargs in ({"n_train": -1}, {"n_dev": 1.5}, {"n_entities": 10}, {"seed": "x"}, {"n_train": True}):
        with pytest.raises(InputError):
            synth.generate_world(**kwargs)
    with pytest.raises(InputError, match="raise n_entities"):
        synth.generate_world(n_train=2000, n_dev=0, n_entities=60)


def test_more_dev_questions_leave_the_rest_of_the_world_as_it_was():
    """The default world's dev set grew from 200 to 500 questions this way: train, corpus and the first dev
    questions are those of the world without them, and no added question is in train or twice in dev."""
    small = synth.generate_world(seed=4, n_train=150, n_dev=20)
    grown = synth.generate_world(seed=4, n_train=150, n_dev=20, more_dev=30)
    assert (grown.train, grown.corpus, grown.dev[:20]) == (small.train, small.corpus, small.dev)
    assert len(grown.dev) == 50
    train = {r["question"] for r in grown.train}
    assert not train & {r["question"] for r in grown.dev} and len({r["_id"] for r in grown.dev}) == 50
    with pytest.raises(InputError, match="more_dev must be an integer >= 0"):
        synth.generate_world(n_train=10, n_dev=2, more_dev=-1)


def test_the_default_world_has_500_dev_questions(tmp_path, monkeypatch):
    from mhgpo.data import synth_files

    monkeypatch.setenv("MHGPO_CACHE", str(tmp_path))
    folder = synth_files.ensure_default_world()
    dev = (folder / "dev.jsonl").read_text().splitlines()
    assert len(dev) == 500 and json.loads((folder / "world.json").read_text())["n_dev"] == 500
    assert [json.loads(r) for r in dev[:200]] == synth.generate_world(seed=0).dev
