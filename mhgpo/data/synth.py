"""A seeded, deterministic fictional "mini-wiki": the embedded default data of the package.

The world holds invented countries, cities, people, creative works (films, novels, albums) and organisations
(companies, bands, universities). Every name is built from syllables, so no answer can be recalled from
real-world knowledge: a system has to read the corpus. The links are:

* a person has a birth city, a birth year, a nationality (a country's demonym) and an occupation;
* a city lies in a country; a country has a capital;
* a work has a creator (its director, author or artist), a year and a genre;
* an organisation has a founder, a founding year and a headquarters city.

Some names are confusable on purpose: near-twins ("Velmora Daskin" and "Velmora Daskins", "The Lantern of
Orvik" and "The Lanterns of Orvik", "Tessor Motors" and "Tessor Foods") and relatives who share a surname.
They are put beside the gold paragraphs as distractors, so retrieval has to be precise.

Each entity is one encyclopedia paragraph of four short sentences (40-90 words) titled with its name.
Questions use the HotpotQA layout: `bridge` questions follow a link (the director of a film, then the
director's birth city); `comparison` questions weigh two entities (which came first; are they of the same
nationality?). As in HotpotQA, every sentence after a paragraph's first starts with a space, so joining the
sentences of a `context` paragraph gives exactly the corpus text.

Everything is drawn from one `random.Random(seed)`: the same seed gives byte-identical files
(`mhgpo.data.synth_files` writes them, and the default world into the cache).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mhgpo.data.synth_vocab import (
    ADJECTIVES,
    BAND_NOUNS,
    BRIDGE_HOPS,
    BRIDGE_TEMPLATES,
    CHOICE_TEMPLATES,
    CITY_ENDS,
    CODAS,
    COMPANIES,
    COUNTRY_FORMS,
    CREATOR_SENTENCE,
    DATE_HOPS,
    FEATURES,
    FIELDS,
    GENRES,
    HQ_SENTENCE,
    HQ_VERBS,
    NOUNS,
    ONSETS,
    ORG_KINDS,
    OTHER_OCCUPATIONS,
    PLOTS,
    QUALITIES,
    ROLE_OCCUPATIONS,
    ROLES,
    SAME_HOPS,
    SURNAME_ENDS,
    TEMPLATES,
    UNIVERSITY_FORMS,
    VOWELS,
    WORK_KINDS,
    YESNO_TEMPLATES,
)
from mhgpo.errors import InputError

__all__ = [
    "Entity",
    "World",
    "generate_world",
    "VERSION",
    "DEFAULT_N_TRAIN",
    "DEFAULT_N_DEV",
    "DEFAULT_MORE_DEV",
]

VERSION = 3  # 2: records carry `decomposition` (the sub-questions of each hop); 3: the default dev set of 500
DEFAULT_N_TRAIN = 2000
DEFAULT_N_DEV = 200
# The default world's dev questions beyond its first 200, drawn after the corpus is laid out, so that its train
# questions, corpus and first 200 dev questions are those of version 2: 500 in all, enough to resolve 1 F1 between
# two teams validated on the same questions (paired), where 100 resolved 2-3.
DEFAULT_MORE_DEV = 300
MIN_ENTITIES = 60
MAX_CONTEXT = 10
FILES = ("corpus.jsonl", "train.jsonl", "dev.jsonl", "world.json")


@dataclass
class Entity:
    """One thing of the world with its facts. `city`: birth city (person), headquarters (organisation),
    capital (country), setting (work); `country`: nationality (person) or location (city); `person`: the
    creator or founder; `genre`: the genre of a work or band, the trade of a company."""

    kind: str
    name: str
    year: int = 0
    city: str = ""
    country: str = ""
    nationality: str = ""
    person: str = ""
    genre: str = ""
    occupation: str = ""
    pronoun: str = "He"
    sentences: tuple[str, ...] = ()


@dataclass
class World:
    """A generated world: `corpus` rows (`id`, `title`, `text`), HotpotQA-layout `train` and `dev`
    questions, and the ground-truth `entities` behind them."""

    corpus: list[dict]
    train: list[dict]
    dev: list[dict]
    seed: int = 0
    entities: list[Entity] = field(default_factory=list, repr=False)


def _pick(rng: random.Random, alternatives: str) -> str:
    return rng.choice(alternatives.split("|"))


def _a(word: str) -> str:
    return f"{'an' if word[0].lower() in 'aeiou' else 'a'} {word}"


# --- names ---------------------------------------------------------------------------------------------------


class _Names:
    """Unique invented names built from syllables (unique regardless of case)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def claim(self, name: str) -> bool:
        if name.lower() in self.used:
            return False
        self.used.add(name.lower())
        return True

    def word(self, syllables: int, ends: Sequence[str] = CODAS) -> str:
        while True:
            parts = [self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables)]
            word = ("".join(parts) + self.rng.choice(ends)).capitalize()
            if 4 <= len(word) <= 9 and not re.search(r"(.)\1|[aeiouy]{3}", word.lower()):
                return word

    def unique(self, make: Callable[[], str]) -> str:
        for _ in range(1000):
            name = make()
            if self.claim(name):
                return name
        raise InputError("could not draw a fresh name; the world is too large")

    def variant(self, name: str) -> str | None:
        """A near-identical spelling of `name` (its last word changed by a letter), if still free."""
        head, _, last = name.rpartition(" ")
        options = [last + "s"] if last in NOUNS else [last + "s", last + "e", last[:-1] + "ae"[last[-1] == "a"]]
        for option in self.rng.sample(options, len(options)):
            if self.claim(f"{head} {option}".strip()):
                return f"{head} {option}".strip()
        return None


# --- building the world --------------------------------------------------------------------------------------


class _Builder:
    """Draws entities, renders paragraphs and asks questions, all from one `random.Random`."""

    def __init__(self, seed: int, n_entities: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.names = _Names(self.rng)
        kinds = ("country", "city", "person", *WORK_KINDS, *ORG_KINDS)
        self.by_kind: dict[str, list[Entity]] = {kind: [] for kind in kinds}
        self.by_name: dict[str, Entity] = {}
        self.confusable: dict[str, list[str]] = {}
        self.used_keys: set[tuple] = set()
        self.groups: dict[str, list[list[Entity]]] = {}
        self.creators: dict[str, list[Entity]] = {}
        self.yes_next = True
        self._populate(n_entities)
        self.everything = list(self.by_name.values())
        self.orgs = [e for kind in ORG_KINDS for e in self.by_kind[kind]]

    def _add(self, entity: Entity, twin_of: str = "") -> Entity:
        self.by_kind[entity.kind].append(entity)
        self.by_name[entity.name] = entity
        if twin_of:
            self.confusable.setdefault(twin_of, []).append(entity.name)
            self.confusable.setdefault(entity.name, []).append(twin_of)
        return entity

    def _populate(self, n: int) -> None:
        n_countries = min(16, max(6, n // 150))
        rest = n - n_countries
        shares = {"city": 15, "film": 12, "novel": 10, "album": 8, "company": 7, "band": 4, "university": 4}
        counts = {kind: rest * share // 100 for kind, share in shares.items()}
        counts["person"] = rest - sum(counts.values())
        for _ in range(n_countries):
            self._country()
        for _ in range(counts["city"]):
            self._city()
        for country in self.by_kind["country"]:
            local = [c for c in self.by_kind["city"] if c.country == country.name] or self.by_kind["city"]
            country.city = self.rng.choice(local).name
        while len(self.by_kind["person"]) < counts["person"]:
            self._person_group(counts, counts["person"] - len(self.by_kind["person"]))
        for kind in WORK_KINDS + ORG_KINDS:
            made = 0
            while made < counts[kind]:
                made += self._creation(kind, counts[kind] - made)

    def _country(self) -> None:
        while True:
            stem = self.names.word(2, ("",))
            end, demonym_end = self.rng.choice(COUNTRY_FORMS)
            if self.names.claim(stem + end) and self.names.claim(stem + demonym_end):
                break
        self._add(Entity("country", stem + end, nationality=stem + demonym_end))

    def _city(self) -> None:
        name = self.names.unique(lambda: self.names.word(self.rng.choice((1, 2, 2)), CITY_ENDS))
        self._add(Entity("city", name, country=self.rng.choice(self.by_kind["country"]).name))

    def _person(self, name: str, occupation: str, twin_of: str = "") -> None:
        country = self.rng.choice(self.by_kind["country"])
        self._add(
            Entity(
                "person",
                name,
                year=self.rng.randint(1880, 1985),
                city=self.rng.choice(self.by_kind["city"]).name,
                country=country.name,
                nationality=country.nationality,
                occupation=occupation,
                pronoun=self.rng.choice(("He", "She")),
            ),
            twin_of,
        )

    def _occupation(self, counts: dict[str, int]) -> str:
        roles = list(ROLE_OCCUPATIONS)
        weights = [counts[r] for r in roles] + [max(1, counts["person"] // 8)]
        pick = self.rng.choices(roles + ["other"], weights=weights)[0]
        return self.rng.choice(OTHER_OCCUPATIONS if pick == "other" else ROLE_OCCUPATIONS[pick])

    def _person_group(self, counts: dict[str, int], room: int) -> None:
        """One person; sometimes with a near-twin or a relative sharing the surname (room permitting)."""
        last = self.names.word(self.rng.choice((1, 2)), SURNAME_ENDS)
        name = self.names.unique(lambda: f"{self.names.word(self.rng.choice((2, 2, 3)))} {last}")
        self._person(name, self._occupation(counts))
        roll = self.rng.random() if room > 1 else 1.0
        if roll < 0.12:
            twin = self.names.variant(name)
            if twin:
                same_job = self.rng.random() < 0.5
                self._person(twin, self.by_name[name].occupation if same_job else self._occupation(counts), name)
        elif roll < 0.27:
            relative = self.names.unique(lambda: f"{self.names.word(2)} {last}")
            self._person(relative, self._occupation(counts), name)

    def _title(self, kind: str) -> str:
        rng, word = self.rng, self.names.word
        if kind in WORK_KINDS:
            forms = (
                lambda: f"The {rng.choice(NOUNS)} of {word(2)}",
                lambda: f"{word(2)}'s {rng.choice(NOUNS)}",
                lambda: f"{rng.choice(ADJECTIVES)} {word(2, CITY_ENDS)}",
                lambda: f"A{_a(rng.choice(NOUNS))[1:]} for {word(2)}",
            )
            return self.names.unique(lambda: rng.choice(forms)())
        if kind == "company":
            return self.names.unique(lambda: f"{word(2)} {rng.choice(list(COMPANIES))}")
        if kind == "band":
            return self.names.unique(lambda: f"The {word(2)} {rng.choice(BAND_NOUNS)}")
        return self.names.unique(lambda: rng.choice(UNIVERSITY_FORMS).format(word(2)))

    def _twin_title(self, kind: str, title: str) -> str | None:
        """A confusable title: a noun made plural, a letter changed, or another suffix on the same stem."""
        words = title.split(" ")
        if kind in WORK_KINDS:
            nouns = [i for i, w in enumerate(words) if w in NOUNS]
            if not nouns or words[0] in ("A", "An"):
                return self.names.variant(title)
            candidate = " ".join(w + "s" if i == nouns[0] else w for i, w in enumerate(words))
        elif kind in ("company", "band"):
            pool = list(COMPANIES) if kind == "company" else list(BAND_NOUNS)
            candidate = " ".join(words[:-1] + [self.rng.choice([p for p in pool if p != words[-1]])])
        else:
            stem = next(w for w in words if w not in ("University", "of", "Institute", "Technology", "College"))
            candidate = self.rng.choice([f.format(stem) for f in UNIVERSITY_FORMS if f.format(stem) != title])
        return candidate if self.names.claim(candidate) else None

    def _creation(self, kind: str, room: int) -> int:
        """One work or organisation, sometimes with a confusable twin; returns how many were made."""
        first = self._made(kind, self._title(kind))
        twin = self._twin_title(kind, first.name) if room > 1 and self.rng.random() < 0.15 else None
        if twin:
            self._made(kind, twin, twin_of=first.name)
        return 2 if twin else 1

    def _made(self, kind: str, title: str, twin_of: str = "") -> Entity:
        if kind not in self.creators:
            fit = [p for p in self.by_kind["person"] if p.occupation in ROLE_OCCUPATIONS[kind]]
            self.creators[kind] = fit or self.by_kind["person"]
        creator = self.rng.choice(self.creators[kind])
        gap = self.rng.randint(22, 55) if kind in WORK_KINDS else self.rng.randint(25, 60)
        genre = COMPANIES[title.split(" ")[-1]] if kind == "company" else self.rng.choice(GENRES.get(kind, ("",)))
        return self._add(
            Entity(
                kind,
                title,
                year=min(creator.year + gap, 2023),
                person=creator.name,
                genre=genre,
                city=self.rng.choice(self.by_kind["city"]).name,
            ),
            twin_of,
        )

    # --- paragraphs ------------------------------------------------------------------------------------------

    def render(self) -> None:
        known: dict[str, list[str]] = {}
        for entity in self.everything:
            if entity.person:
                known.setdefault(entity.person, []).append(entity.name)
        for entity in self.everything:
            values = self._values(entity, known.get(entity.name, []))
            entity.sentences = tuple(t.format(**values) for t in TEMPLATES[entity.kind])

    def _values(self, e: Entity, known: list[str]) -> dict[str, object]:
        """The facts of `e` and the filler of its paragraph (drawn the same way for every kind)."""
        r = self.rng
        city2 = r.choice([c.name for c in r.sample(self.by_kind["city"], 2) if c.name != e.city])
        return {
            **e.__dict__,
            "a_year": _a(str(e.year)),
            "a_genre": _a(e.genre or "x"),
            "a_nationality": _a(e.nationality or "x"),
            "a_size": _a(r.choice(("small", "large", "coastal", "hillside", "river"))),
            "a_access": _a(r.choice(("public", "private"))),
            "possessive": {"He": "His"}.get(e.pronoun, "Her"),
            "part": r.choice(("north", "south", "east", "west", "centre")),
            "word": self.names.word(2),
            "season": r.choice(("spring", "summer", "autumn")),
            "feature": r.choice(FEATURES),
            "plot": r.choice(PLOTS),
            "quality": r.choice(QUALITIES),
            "field": r.choice(FIELDS),
            "trade": r.choice(list(COMPANIES.values())),
            "staff": r.randint(2, 900) * 100,
            "single": f"{r.choice(ADJECTIVES)} {r.choice(NOUNS)}",
            "top": r.choice((5, 10, 20, 40)),
            "small": r.randint(3, 40),
            "tracks": r.randint(8, 16),
            "minutes": r.randint(78, 175),
            "pages": r.randint(150, 900),
            "thousands": r.randint(2, 900),
            "recent": r.randint(1990, 2020),
            "year2": r.randint(1200, 1960),
            "later": min(e.year + r.randint(5, 60), 2023),
            "decade": min(e.year + r.randint(0, 30), 2010) // 10 * 10,
            "city2": city2,
            "university": r.choice(self.by_kind["university"]).name,
            "known": f"{e.pronoun} is best known for {' and '.join(known[:2])}."
            if known
            else f"{e.pronoun} spent most of {'his' if e.pronoun == 'He' else 'her'} working life in {city2}.",
        }

    # --- questions -------------------------------------------------------------------------------------------

    def questions(self, sizes: Sequence[int]) -> list[list[dict]]:
        """One shuffled list of questions per size; the slots cycle bridge, choice, bridge, yes/no, bridge."""
        bridges = [
            (relation, e)
            for kind in WORK_KINDS + ORG_KINDS
            for e in self.by_kind[kind]
            for relation in ("birth_city", "birth_year", "nationality")
        ]
        bridges += [("hq_country", e) for e in self.orgs]
        self.rng.shuffle(bridges)
        splits = []
        for n in sizes:
            rows = [self._ask(("bridge", "choice", "bridge", "yesno", "bridge")[i % 5], bridges) for i in range(n)]
            self.rng.shuffle(rows)
            splits.append(rows)
        return splits

    def _ask(self, slot: str, bridges: list[tuple[str, Entity]]) -> dict:
        for _ in range(1000):
            if slot == "bridge" and not bridges:
                break
            row = (
                self._bridge(*bridges.pop())
                if slot == "bridge"
                else self._choice()
                if slot == "choice"
                else self._yesno()
            )
            if row is not None:
                return row
        raise InputError("the world is too small for this many questions; raise n_entities")

    def _fresh(self, key: tuple) -> bool:
        if key in self.used_keys:
            return False
        self.used_keys.add(key)
        return True

    def _bridge(self, relation: str, host: Entity) -> dict | None:
        if not self._fresh(("bridge", relation, host.name)):
            return None
        template = _pick(self.rng, BRIDGE_TEMPLATES[relation])
        if relation == "hq_country":
            city = self.by_name[host.city]
            verb = HQ_VERBS[host.kind]
            question = template.format(o=host.name, verb=verb)
            hops = [
                f"In which city is {host.name} {verb}?",
                f"In which country is the city where {host.name} is {verb}?",
            ]
            return self._record(question, city.country, "bridge", [(host, HQ_SENTENCE), (city, 0)], hops)
        person = self.by_name[host.person]
        phrase = _pick(self.rng, ROLES[host.kind if host.kind in WORK_KINDS else "org"]).format(host.name)
        question = template.format(p=phrase, P=phrase[0].upper() + phrase[1:])
        answer = {"birth_city": person.city, "birth_year": str(person.year), "nationality": person.nationality}
        gold = [(host, CREATOR_SENTENCE[host.kind]), (person, 0)]
        hops = [f"Who is {phrase}?", BRIDGE_HOPS[relation].format(p=phrase)]
        return self._record(question, answer[relation], "bridge", gold, hops)

    def _choice(self) -> dict | None:
        family = self.rng.choice(("film", "novel", "album", "person", "person", "org"))
        a, b = self.rng.sample(self.orgs if family == "org" else self.by_kind[family], 2)
        if a.year == b.year or not self._fresh(("choice", *sorted((a.name, b.name)))):
            return None
        question = _pick(self.rng, CHOICE_TEMPLATES[family]).format(a=a.name, b=b.name)
        hops = [DATE_HOPS[family].format(a.name), DATE_HOPS[family].format(b.name)]
        return self._record(question, a.name if a.year < b.year else b.name, "comparison", [(a, 0), (b, 0)], hops)

    def _yesno(self) -> dict | None:
        """A yes/no comparison; the answers alternate yes, no, yes, ... so that they stay balanced."""
        family = self.rng.choice(("nationality", "nationality", "city", "genre", "hq"))
        kind = self.rng.choice(WORK_KINDS) if family == "genre" else ""
        pool = {"genre": self.by_kind.get(kind, []), "hq": self.orgs}.get(family, self.by_kind["person"])
        attr = "city" if family == "hq" else family
        if self.yes_next:
            groups = self._groups(f"{family}:{kind}", pool, attr)
            if not groups:
                return None
            a, b = self.rng.sample(self.rng.choice(groups), 2)
        else:
            a, b = self.rng.sample(pool, 2)
            if getattr(a, attr) == getattr(b, attr):
                return None
        if not self._fresh(("yesno", *sorted((a.name, b.name)))):
            return None
        question = _pick(self.rng, YESNO_TEMPLATES[family]).format(a=a.name, b=b.name, kind=kind)
        sentence = HQ_SENTENCE if family == "hq" else 0
        answer, self.yes_next = ("yes" if self.yes_next else "no"), not self.yes_next
        hops = [SAME_HOPS[family].format(a.name), SAME_HOPS[family].format(b.name)]
        return self._record(question, answer, "comparison", [(a, sentence), (b, sentence)], hops)

    def _groups(self, key: str, pool: list[Entity], attr: str) -> list[list[Entity]]:
        """The entities of `pool` that share a value of `attr`, in groups of two or more (cached)."""
        if key not in self.groups:
            by_value: dict[str, list[Entity]] = {}
            for entity in pool:
                by_value.setdefault(getattr(entity, attr), []).append(entity)
            self.groups[key] = [g for g in by_value.values() if len(g) > 1]
        return self.groups[key]

    def _record(self, question: str, answer: str, qtype: str, gold: list[tuple[Entity, int]], hops: list[str]) -> dict:
        distractors, hard = self._distractors([e for e, _ in gold])
        paragraphs = [e for e, _ in gold] + distractors
        self.rng.shuffle(paragraphs)
        digest = hashlib.sha1(f"{self.seed}\n{question}".encode()).hexdigest()[:24]
        return {
            "_id": digest,
            "question": question,
            "answer": answer,
            "type": qtype,
            "supporting_facts": [[e.name, i] for e, i in gold],
            "context": [[e.name, _hotpot_sentences(e.sentences)] for e in paragraphs],
            "level": "hard" if hard else "medium",
            "decomposition": hops,
        }

    def _distractors(self, gold: list[Entity]) -> tuple[list[Entity], bool]:
        """Confusable names of the gold entities first, then entities of the same kinds, then any."""
        taken = {e.name for e in gold}
        chosen: list[Entity] = []

        def take(entity: Entity) -> None:
            if entity.name not in taken and len(chosen) < MAX_CONTEXT - len(gold):
                taken.add(entity.name)
                chosen.append(entity)

        for name in [n for e in gold for n in self.confusable.get(e.name, [])][:3]:
            take(self.by_name[name])
        hard = bool(chosen)
        for e in gold:
            for other in self.rng.sample(self.by_kind[e.kind], min(3, len(self.by_kind[e.kind]))):
                take(other)
        while len(chosen) < MAX_CONTEXT - len(gold):
            take(self.rng.choice(self.everything))
        return chosen, hard


def _hotpot_sentences(sentences: Sequence[str]) -> list[str]:
    """The HotpotQA convention: every sentence after the first starts with a space."""
    return [s if i == 0 else " " + s for i, s in enumerate(sentences)]


# --- public API ----------------------------------------------------------------------------------------------


def _check_size(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name} must be an integer >= {minimum}, got {value!r}")


def generate_world(
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_dev: int = DEFAULT_N_DEV,
    n_entities: int | None = None,
    more_dev: int = 0,
) -> World:
    """Build the world of `seed`: about `n_entities` paragraphs (default: one per question of `n_train` + `n_dev`,
    at least 120) and `n_train` + `n_dev` questions, then `more_dev` dev questions more (drawn after the corpus, so
    that the rest of the world is the one without them); no question (nor a rephrasing of it) is in two splits."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be an integer, got {seed!r}")
    _check_size("n_train", n_train, 0)
    _check_size("n_dev", n_dev, 0)
    _check_size("more_dev", more_dev, 0)
    n_entities = max(120, n_train + n_dev) if n_entities is None else n_entities
    _check_size("n_entities", n_entities, MIN_ENTITIES)
    builder = _Builder(seed, n_entities)
    builder.render()
    train, dev = builder.questions((n_train, n_dev))
    entities = builder.everything
    order = list(range(len(entities)))
    builder.rng.shuffle(order)
    width = max(5, len(str(len(entities))))
    corpus = [
        {"id": f"w{n:0{width}d}", "title": entities[i].name, "text": " ".join(entities[i].sentences)}
        for n, i in enumerate(order)
    ]
    if more_dev:
        dev = dev + builder.questions((more_dev,))[0]
    return World(corpus=corpus, train=train, dev=dev, seed=seed, entities=entities)
