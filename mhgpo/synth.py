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

Everything is drawn from one `random.Random(seed)`: the same seed gives byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from mhgpo.records import InputError

__all__ = ["Entity", "World", "generate_world", "write_world", "default_world_dir", "ensure_default_world",
           "VERSION", "DEFAULT_N_TRAIN", "DEFAULT_N_DEV"]

VERSION = 2  # 2: records carry `decomposition` (the sub-questions of each hop)
DEFAULT_N_TRAIN = 2000
DEFAULT_N_DEV = 200
MIN_ENTITIES = 60
MAX_CONTEXT = 10
FILES = ("corpus.jsonl", "train.jsonl", "dev.jsonl", "world.json")

# --- vocabulary ----------------------------------------------------------------------------------------------

_ONSETS = tuple("b d f g k l m n r s t v z br dr kr th tr st h j p sh c".split())
_VOWELS = tuple("a e i o u a e o ae y".split())
_CODAS = ("", "", "", *"n r l s k th m v".split())
_SURNAME_ENDS = ("", *"in ek ov ard ane is et ur ow".split())
_CITY_ENDS = ("", *"y a en or ith um ene ara".split())
_COUNTRY_FORMS = tuple(tuple(pair.split("/"))  # country ending / demonym ending
                       for pair in "ia/ian ar/ari en/eni os/osian and/andish ey/eyan ova/ovan".split())
_NOUNS = tuple("Lantern Orchard Harbor River Winter Mirror Garden Tower Crown Letter Island Shadow Bridge Voice "
               "Season Ember Meadow Signal Window Feather Anchor Candle Storm".split())
_ADJECTIVES = tuple("Silent Hollow Distant Bright Broken Golden Quiet Northern Crimson Pale Endless Last".split())
_GENRES = {"film": tuple("drama|comedy|thriller|science fiction|western|horror|musical|war".split("|")),
           "novel": tuple("historical|crime|fantasy|romance|science fiction|satirical|gothic|adventure".split("|")),
           "album": tuple("jazz folk rock electronic pop blues soul ambient".split())}
_GENRES["band"] = _GENRES["album"]
_ROLE_OCCUPATIONS = {"film": ("film director",), "novel": ("novelist", "writer"), "album": ("singer", "musician"),
                     "band": ("musician", "singer"), "company": ("entrepreneur", "engineer", "industrialist"),
                     "university": ("scholar", "philanthropist", "historian")}
_OTHER_OCCUPATIONS = tuple("painter architect journalist physician sculptor diplomat".split())
_COMPANIES = {"Motors": "car", "Foods": "food", "Textiles": "textile", "Shipping": "shipping",
              "Pharma": "pharmaceutical", "Systems": "software", "Steelworks": "steel", "Glassworks": "glass"}
_BAND_NOUNS = tuple("Lights Tides Engines Collective Brothers Ensemble Orchestra".split())
_UNIVERSITY_FORMS = ("{} University", "University of {}", "{} Institute of Technology", "{} College")
_FIELDS = tuple("mining law medicine forestry music engineering history chemistry".split())
_FEATURES = tuple("old harbour|stone bridges|textile mills|salt marshes|glassworks|covered markets|railway works|"
                  "clock tower|botanical garden|canals".split("|"))
_PLOTS = tuple("a family of lighthouse keepers|two rival mapmakers|a detective in a flooded city|a travelling "
               "circus|a widowed clockmaker|three sisters on a failing farm|a young violinist|a border guard and "
               "a smuggler|a forgotten expedition".split("|"))
_QUALITIES = tuple("spare style|intricate structure|vivid characters|dark humour|lyrical tone|careful research"
                   .split("|"))
_TEMPLATES = {
    "country": ("{name} is a country whose people are called {nationality}.",
                "Its capital and largest city is {city}, and it became independent in {year2}.",
                "The country has about {small} million inhabitants and an economy built on the {trade} industry.",
                "Its official language is {nationality}, and its currency is the {word}."),
    "city": ("{name} is {a_size} city in the {part} of {country}.",
             "It had about {thousands},000 inhabitants at the census of {recent}.",
             "The city is known for its {feature} and for the yearly {word} festival held every {season}.",
             "{name} received its town charter in {year2}."),
    "person": ("{name} (born {year} in {city}) is {a_nationality} {occupation}.",
               "{pronoun} grew up in {city2} and studied at {university}.", "{known}",
               "{possessive} work has received the {word} Prize and is widely admired for its {quality}."),
    "film": ("{name} is {a_year} {genre} film.", "It was directed by {person} and shot largely in {city}.",
             "The film runs for {minutes} minutes and follows {plot}.",
             "It premiered at the {word} Film Festival and was praised for its {quality}."),
    "novel": ("{name} is {a_genre} novel by {person}, first published in {year}.",
              "The book is set in {city} and tells the story of {plot}.",
              "It runs to {pages} pages and was issued by {word} Press.",
              "Critics praised its {quality}, and it has been translated into {small} languages."),
    "album": ("{name} is {a_genre} album by {person}, released in {year}.",
              "It was recorded over {small} weeks in {city} and holds {tracks} tracks.",
              "Its lead single, \"{single}\", reached the top {top} of the national charts.",
              "The record was mixed at {word} Studios and later reissued on vinyl."),
    "company": ("{name} is {a_genre} company founded in {year} by {person}.",
                "It is headquartered in {city} and employs about {staff:,} people.",
                "The company was listed on the {word} stock exchange in {later}.",
                "Its factories have long been a major employer in the region around {city2}."),
    "band": ("{name} is {a_genre} band formed in {year} by {person}.",
             "The group is based in {city} and has released {tracks} studio albums.",
             "Its line-up has changed several times since the {decade}s, when the band first toured abroad.",
             "Critics have praised its long live shows and its {quality} on record."),
    "university": ("{name} is {a_access} university founded in {year} by {person}.",
                   "Its main campus is located in {city}, where about {small},000 students are enrolled.",
                   "The university is known for its faculty of {field} and its library of old maps.",
                   "It opened a second campus in {city2} in {later}."),
}
# Question phrasings: alternatives are separated by "|".
_ROLES = {"film": "the director of {}|the person who directed {}",
          "novel": "the author of {}|the writer of {}|the person who wrote {}",
          "album": "the artist behind {}|the musician who recorded {}",
          "org": "the founder of {}|the person who founded {}"}
_BRIDGE_TEMPLATES = {
    "birth_city": "In which city was {p} born?|Where was {p} born?|What is the birthplace of {p}?|"
                  "{P} was born in which city?",
    "birth_year": "In what year was {p} born?|When was {p} born?|What is the birth year of {p}?|"
                  "{P} was born in which year?",
    "nationality": "What is the nationality of {p}?|What nationality is {p}?|{P} is of what nationality?",
    "hq_country": "In which country is {o} {verb}?|In what country is {o} {verb}?|"
                  "{o} is {verb} in a city of which country?"}
_CHOICE_TEMPLATES = {
    "film": "Which film came out first, {a} or {b}?|Which film was released earlier, {a} or {b}?|"
            "Which of these films is older: {a} or {b}?",
    "novel": "Which novel was published first, {a} or {b}?|Which book came out earlier, {a} or {b}?",
    "album": "Which album was released first, {a} or {b}?|Which album came out earlier, {a} or {b}?",
    "person": "Who was born earlier, {a} or {b}?|Who is older, {a} or {b}?|"
              "Which person was born first, {a} or {b}?",
    "org": "Which was founded first, {a} or {b}?|Which organisation is older, {a} or {b}?"}
_YESNO_TEMPLATES = {
    "nationality": "Are {a} and {b} of the same nationality?|Do {a} and {b} share a nationality?|"
                   "Is {a} of the same nationality as {b}?",
    "city": "Were {a} and {b} born in the same city?|Do {a} and {b} share a birthplace?",
    "genre": "Do the {kind}s {a} and {b} belong to the same genre?|Are the {kind}s {a} and {b} of the same genre?",
    "hq": "Are {a} and {b} based in the same city?|Do {a} and {b} have their headquarters in the same city?"}
_HQ_VERBS = {"company": "headquartered", "band": "based", "university": "located"}
# The sub-questions of each hop (a record's `decomposition`): what a query rewriter should search for. A hop that
# depends on an earlier answer is phrased through the question's own words, never through the hidden answer.
_BRIDGE_HOPS = {"birth_city": "Where was {p} born?", "birth_year": "When was {p} born?",
                "nationality": "What is the nationality of {p}?"}
_DATE_HOPS = {"film": "When was {} released?", "novel": "When was {} published?", "album": "When was {} released?",
              "person": "When was {} born?", "org": "When was {} founded?"}
_SAME_HOPS = {"nationality": "What is the nationality of {}?", "city": "Where was {} born?",
              "genre": "What is the genre of {}?", "hq": "In which city is {} based?"}
_WORK_KINDS = ("film", "novel", "album")
_ORG_KINDS = ("company", "band", "university")
# Which sentence of a paragraph states a fact (the templates above fix it).
CREATOR_SENTENCE = {"film": 1, "novel": 0, "album": 0, "company": 0, "band": 0, "university": 0}
HQ_SENTENCE = 1


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

    def word(self, syllables: int, ends: Sequence[str] = _CODAS) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables)]
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
        options = [last + "s"] if last in _NOUNS else [last + "s", last + "e", last[:-1] + "ae"[last[-1] == "a"]]
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
        kinds = ("country", "city", "person", *_WORK_KINDS, *_ORG_KINDS)
        self.by_kind: dict[str, list[Entity]] = {kind: [] for kind in kinds}
        self.by_name: dict[str, Entity] = {}
        self.confusable: dict[str, list[str]] = {}
        self.used_keys: set[tuple] = set()
        self.groups: dict[str, list[list[Entity]]] = {}
        self.creators: dict[str, list[Entity]] = {}
        self.yes_next = True
        self._populate(n_entities)
        self.everything = list(self.by_name.values())
        self.orgs = [e for kind in _ORG_KINDS for e in self.by_kind[kind]]

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
        for kind in _WORK_KINDS + _ORG_KINDS:
            made = 0
            while made < counts[kind]:
                made += self._creation(kind, counts[kind] - made)

    def _country(self) -> None:
        while True:
            stem = self.names.word(2, ("",))
            end, demonym_end = self.rng.choice(_COUNTRY_FORMS)
            if self.names.claim(stem + end) and self.names.claim(stem + demonym_end):
                break
        self._add(Entity("country", stem + end, nationality=stem + demonym_end))

    def _city(self) -> None:
        name = self.names.unique(lambda: self.names.word(self.rng.choice((1, 2, 2)), _CITY_ENDS))
        self._add(Entity("city", name, country=self.rng.choice(self.by_kind["country"]).name))

    def _person(self, name: str, occupation: str, twin_of: str = "") -> None:
        country = self.rng.choice(self.by_kind["country"])
        self._add(Entity("person", name, year=self.rng.randint(1880, 1985),
                         city=self.rng.choice(self.by_kind["city"]).name, country=country.name,
                         nationality=country.nationality, occupation=occupation,
                         pronoun=self.rng.choice(("He", "She"))), twin_of)

    def _occupation(self, counts: dict[str, int]) -> str:
        roles = list(_ROLE_OCCUPATIONS)
        weights = [counts[r] for r in roles] + [max(1, counts["person"] // 8)]
        pick = self.rng.choices(roles + ["other"], weights=weights)[0]
        return self.rng.choice(_OTHER_OCCUPATIONS if pick == "other" else _ROLE_OCCUPATIONS[pick])

    def _person_group(self, counts: dict[str, int], room: int) -> None:
        """One person; sometimes with a near-twin or a relative sharing the surname (room permitting)."""
        last = self.names.word(self.rng.choice((1, 2)), _SURNAME_ENDS)
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
        if kind in _WORK_KINDS:
            forms = (lambda: f"The {rng.choice(_NOUNS)} of {word(2)}", lambda: f"{word(2)}'s {rng.choice(_NOUNS)}",
                     lambda: f"{rng.choice(_ADJECTIVES)} {word(2, _CITY_ENDS)}",
                     lambda: f"A{_a(rng.choice(_NOUNS))[1:]} for {word(2)}")
            return self.names.unique(lambda: rng.choice(forms)())
        if kind == "company":
            return self.names.unique(lambda: f"{word(2)} {rng.choice(list(_COMPANIES))}")
        if kind == "band":
            return self.names.unique(lambda: f"The {word(2)} {rng.choice(_BAND_NOUNS)}")
        return self.names.unique(lambda: rng.choice(_UNIVERSITY_FORMS).format(word(2)))

    def _twin_title(self, kind: str, title: str) -> str | None:
        """A confusable title: a noun made plural, a letter changed, or another suffix on the same stem."""
        words = title.split(" ")
        if kind in _WORK_KINDS:
            nouns = [i for i, w in enumerate(words) if w in _NOUNS]
            if not nouns or words[0] in ("A", "An"):
                return self.names.variant(title)
            candidate = " ".join(w + "s" if i == nouns[0] else w for i, w in enumerate(words))
        elif kind in ("company", "band"):
            pool = list(_COMPANIES) if kind == "company" else list(_BAND_NOUNS)
            candidate = " ".join(words[:-1] + [self.rng.choice([p for p in pool if p != words[-1]])])
        else:
            stem = next(w for w in words if w not in ("University", "of", "Institute", "Technology", "College"))
            candidate = self.rng.choice([f.format(stem) for f in _UNIVERSITY_FORMS if f.format(stem) != title])
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
            fit = [p for p in self.by_kind["person"] if p.occupation in _ROLE_OCCUPATIONS[kind]]
            self.creators[kind] = fit or self.by_kind["person"]
        creator = self.rng.choice(self.creators[kind])
        gap = self.rng.randint(22, 55) if kind in _WORK_KINDS else self.rng.randint(25, 60)
        genre = _COMPANIES[title.split(" ")[-1]] if kind == "company" else self.rng.choice(_GENRES.get(kind, ("",)))
        return self._add(Entity(kind, title, year=min(creator.year + gap, 2023), person=creator.name, genre=genre,
                                city=self.rng.choice(self.by_kind["city"]).name), twin_of)

    # --- paragraphs ------------------------------------------------------------------------------------------

    def render(self) -> None:
        known: dict[str, list[str]] = {}
        for entity in self.everything:
            if entity.person:
                known.setdefault(entity.person, []).append(entity.name)
        for entity in self.everything:
            values = self._values(entity, known.get(entity.name, []))
            entity.sentences = tuple(t.format(**values) for t in _TEMPLATES[entity.kind])

    def _values(self, e: Entity, known: list[str]) -> dict[str, object]:
        """The facts of `e` and the filler of its paragraph (drawn the same way for every kind)."""
        r = self.rng
        city2 = r.choice([c.name for c in r.sample(self.by_kind["city"], 2) if c.name != e.city])
        return {**e.__dict__, "a_year": _a(str(e.year)), "a_genre": _a(e.genre or "x"),
                "a_nationality": _a(e.nationality or "x"), "a_size": _a(r.choice(("small", "large", "coastal",
                                                                                  "hillside", "river"))),
                "a_access": _a(r.choice(("public", "private"))), "possessive": {"He": "His"}.get(e.pronoun, "Her"),
                "part": r.choice(("north", "south", "east", "west", "centre")), "word": self.names.word(2),
                "season": r.choice(("spring", "summer", "autumn")), "feature": r.choice(_FEATURES),
                "plot": r.choice(_PLOTS), "quality": r.choice(_QUALITIES), "field": r.choice(_FIELDS),
                "trade": r.choice(list(_COMPANIES.values())), "staff": r.randint(2, 900) * 100,
                "single": f"{r.choice(_ADJECTIVES)} {r.choice(_NOUNS)}", "top": r.choice((5, 10, 20, 40)),
                "small": r.randint(3, 40), "tracks": r.randint(8, 16), "minutes": r.randint(78, 175),
                "pages": r.randint(150, 900), "thousands": r.randint(2, 900), "recent": r.randint(1990, 2020),
                "year2": r.randint(1200, 1960), "later": min(e.year + r.randint(5, 60), 2023),
                "decade": min(e.year + r.randint(0, 30), 2010) // 10 * 10, "city2": city2,
                "university": r.choice(self.by_kind["university"]).name,
                "known": f"{e.pronoun} is best known for {' and '.join(known[:2])}." if known else
                f"{e.pronoun} spent most of {'his' if e.pronoun == 'He' else 'her'} working life in {city2}."}

    # --- questions -------------------------------------------------------------------------------------------

    def questions(self, sizes: Sequence[int]) -> list[list[dict]]:
        """One shuffled list of questions per size; the slots cycle bridge, choice, bridge, yes/no, bridge."""
        bridges = [(relation, e) for kind in _WORK_KINDS + _ORG_KINDS for e in self.by_kind[kind]
                   for relation in ("birth_city", "birth_year", "nationality")]
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
            row = self._bridge(*bridges.pop()) if slot == "bridge" else \
                self._choice() if slot == "choice" else self._yesno()
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
        template = _pick(self.rng, _BRIDGE_TEMPLATES[relation])
        if relation == "hq_country":
            city = self.by_name[host.city]
            verb = _HQ_VERBS[host.kind]
            question = template.format(o=host.name, verb=verb)
            hops = [f"In which city is {host.name} {verb}?",
                    f"In which country is the city where {host.name} is {verb}?"]
            return self._record(question, city.country, "bridge", [(host, HQ_SENTENCE), (city, 0)], hops)
        person = self.by_name[host.person]
        phrase = _pick(self.rng, _ROLES[host.kind if host.kind in _WORK_KINDS else "org"]).format(host.name)
        question = template.format(p=phrase, P=phrase[0].upper() + phrase[1:])
        answer = {"birth_city": person.city, "birth_year": str(person.year), "nationality": person.nationality}
        gold = [(host, CREATOR_SENTENCE[host.kind]), (person, 0)]
        hops = [f"Who is {phrase}?", _BRIDGE_HOPS[relation].format(p=phrase)]
        return self._record(question, answer[relation], "bridge", gold, hops)

    def _choice(self) -> dict | None:
        family = self.rng.choice(("film", "novel", "album", "person", "person", "org"))
        a, b = self.rng.sample(self.orgs if family == "org" else self.by_kind[family], 2)
        if a.year == b.year or not self._fresh(("choice", *sorted((a.name, b.name)))):
            return None
        question = _pick(self.rng, _CHOICE_TEMPLATES[family]).format(a=a.name, b=b.name)
        hops = [_DATE_HOPS[family].format(a.name), _DATE_HOPS[family].format(b.name)]
        return self._record(question, a.name if a.year < b.year else b.name, "comparison", [(a, 0), (b, 0)], hops)

    def _yesno(self) -> dict | None:
        """A yes/no comparison; the answers alternate yes, no, yes, ... so that they stay balanced."""
        family = self.rng.choice(("nationality", "nationality", "city", "genre", "hq"))
        kind = self.rng.choice(_WORK_KINDS) if family == "genre" else ""
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
        question = _pick(self.rng, _YESNO_TEMPLATES[family]).format(a=a.name, b=b.name, kind=kind)
        sentence = HQ_SENTENCE if family == "hq" else 0
        answer, self.yes_next = ("yes" if self.yes_next else "no"), not self.yes_next
        hops = [_SAME_HOPS[family].format(a.name), _SAME_HOPS[family].format(b.name)]
        return self._record(question, answer, "comparison", [(a, sentence), (b, sentence)], hops)

    def _groups(self, key: str, pool: list[Entity], attr: str) -> list[list[Entity]]:
        """The entities of `pool` that share a value of `attr`, in groups of two or more (cached)."""
        if key not in self.groups:
            by_value: dict[str, list[Entity]] = {}
            for entity in pool:
                by_value.setdefault(getattr(entity, attr), []).append(entity)
            self.groups[key] = [g for g in by_value.values() if len(g) > 1]
        return self.groups[key]

    def _record(self, question: str, answer: str, qtype: str, gold: list[tuple[Entity, int]],
                hops: list[str]) -> dict:
        distractors, hard = self._distractors([e for e, _ in gold])
        paragraphs = [e for e, _ in gold] + distractors
        self.rng.shuffle(paragraphs)
        digest = hashlib.sha1(f"{self.seed}\n{question}".encode("utf-8")).hexdigest()[:24]
        return {"_id": digest, "question": question, "answer": answer, "type": qtype,
                "supporting_facts": [[e.name, i] for e, i in gold],
                "context": [[e.name, _hotpot_sentences(e.sentences)] for e in paragraphs],
                "level": "hard" if hard else "medium", "decomposition": hops}

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


def generate_world(seed: int = 0, n_train: int = DEFAULT_N_TRAIN, n_dev: int = DEFAULT_N_DEV,
                   n_entities: int | None = None) -> World:
    """Build the world of `seed`: about `n_entities` paragraphs (default: one per question, at least 120) and
    `n_train` + `n_dev` questions; no question (nor a rephrasing of it) is in both splits."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError(f"seed must be an integer, got {seed!r}")
    _check_size("n_train", n_train, 0)
    _check_size("n_dev", n_dev, 0)
    n_entities = max(120, n_train + n_dev) if n_entities is None else n_entities
    _check_size("n_entities", n_entities, MIN_ENTITIES)
    builder = _Builder(seed, n_entities)
    builder.render()
    train, dev = builder.questions((n_train, n_dev))
    entities = builder.everything
    order = list(range(len(entities)))
    builder.rng.shuffle(order)
    width = max(5, len(str(len(entities))))
    corpus = [{"id": f"w{n:0{width}d}", "title": entities[i].name, "text": " ".join(entities[i].sentences)}
              for n, i in enumerate(order)]
    return World(corpus=corpus, train=train, dev=dev, seed=seed, entities=entities)


def _jsonl(rows: Sequence[dict]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def _write_atomic(path: Path, data: bytes) -> Path:
    """Write `data` to a temporary file beside `path`, then rename it onto `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_world(out_dir: str | os.PathLike[str], seed: int = 0, n_train: int = DEFAULT_N_TRAIN,
                n_dev: int = DEFAULT_N_DEV, n_entities: int | None = None) -> dict[str, Path]:
    """Generate a world and write `corpus.jsonl`, `train.jsonl`, `dev.jsonl` and, last, `world.json` (the
    seed and the counts) into `out_dir`. Returns the paths by name: corpus, train, dev, world."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a folder")
    world = generate_world(seed=seed, n_train=n_train, n_dev=n_dev, n_entities=n_entities)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: _write_atomic(out / f"{name}.jsonl", _jsonl(rows))
             for name, rows in (("corpus", world.corpus), ("train", world.train), ("dev", world.dev))}
    meta = {"version": VERSION, "seed": seed, "n_train": len(world.train), "n_dev": len(world.dev),
            "n_passages": len(world.corpus)}
    paths["world"] = _write_atomic(out / "world.json", (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
    return paths


def default_world_dir() -> Path:
    """The cache folder of the default world: `$MHGPO_CACHE` (else `~/.cache/mhgpo`) / `world-seed0-v<VERSION>`."""
    root = os.environ.get("MHGPO_CACHE") or str(Path("~") / ".cache" / "mhgpo")
    return Path(root).expanduser() / f"world-seed0-v{VERSION}"


def _is_complete(folder: Path) -> bool:
    try:
        meta = json.loads((folder / "world.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("version") == VERSION and all((folder / f).is_file() for f in FILES)


def ensure_default_world() -> Path:
    """The default world's folder, generated on first use. The world is written into a temporary folder beside
    it and renamed into place, so no reader ever sees half a world."""
    target = default_world_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write_world(tmp, seed=0, n_train=DEFAULT_N_TRAIN, n_dev=DEFAULT_N_DEV)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target)  # left incomplete by something else
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # unless another process has just put a world in place
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
