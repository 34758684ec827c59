"""The vocabulary of the synthetic world (`mhgpo/data/synth.py`): name parts, titles, genres, occupations, the
sentence templates of each kind of entity and the question templates of each kind of question."""

from __future__ import annotations

ONSETS = tuple("b d f g k l m n r s t v z br dr kr th tr st h j p sh c".split())
VOWELS = tuple("a e i o u a e o ae y".split())
CODAS = ("", "", "", *"n r l s k th m v".split())
SURNAME_ENDS = ("", *"in ek ov ard ane is et ur ow".split())
CITY_ENDS = ("", *"y a en or ith um ene ara".split())
COUNTRY_FORMS = tuple(
    tuple(pair.split("/"))  # country ending / demonym ending
    for pair in "ia/ian ar/ari en/eni os/osian and/andish ey/eyan ova/ovan".split()
)
NOUNS = tuple(
    "Lantern Orchard Harbor River Winter Mirror Garden Tower Crown Letter Island Shadow Bridge Voice "
    "Season Ember Meadow Signal Window Feather Anchor Candle Storm".split()
)
ADJECTIVES = tuple("Silent Hollow Distant Bright Broken Golden Quiet Northern Crimson Pale Endless Last".split())
GENRES = {
    "film": tuple("drama|comedy|thriller|science fiction|western|horror|musical|war".split("|")),
    "novel": tuple("historical|crime|fantasy|romance|science fiction|satirical|gothic|adventure".split("|")),
    "album": tuple("jazz folk rock electronic pop blues soul ambient".split()),
}
GENRES["band"] = GENRES["album"]
ROLE_OCCUPATIONS = {
    "film": ("film director",),
    "novel": ("novelist", "writer"),
    "album": ("singer", "musician"),
    "band": ("musician", "singer"),
    "company": ("entrepreneur", "engineer", "industrialist"),
    "university": ("scholar", "philanthropist", "historian"),
}
OTHER_OCCUPATIONS = tuple("painter architect journalist physician sculptor diplomat".split())
COMPANIES = {
    "Motors": "car",
    "Foods": "food",
    "Textiles": "textile",
    "Shipping": "shipping",
    "Pharma": "pharmaceutical",
    "Systems": "software",
    "Steelworks": "steel",
    "Glassworks": "glass",
}
BAND_NOUNS = tuple("Lights Tides Engines Collective Brothers Ensemble Orchestra".split())
UNIVERSITY_FORMS = ("{} University", "University of {}", "{} Institute of Technology", "{} College")
FIELDS = tuple("mining law medicine forestry music engineering history chemistry".split())
FEATURES = tuple(
    "old harbour|stone bridges|textile mills|salt marshes|glassworks|covered markets|railway works|"
    "clock tower|botanical garden|canals".split("|")
)
PLOTS = tuple(
    "a family of lighthouse keepers|two rival mapmakers|a detective in a flooded city|a travelling "
    "circus|a widowed clockmaker|three sisters on a failing farm|a young violinist|a border guard and "
    "a smuggler|a forgotten expedition".split("|")
)
QUALITIES = tuple(
    "spare style|intricate structure|vivid characters|dark humour|lyrical tone|careful research".split("|")
)
TEMPLATES = {
    "country": (
        "{name} is a country whose people are called {nationality}.",
        "Its capital and largest city is {city}, and it became independent in {year2}.",
        "The country has about {small} million inhabitants and an economy built on the {trade} industry.",
        "Its official language is {nationality}, and its currency is the {word}.",
    ),
    "city": (
        "{name} is {a_size} city in the {part} of {country}.",
        "It had about {thousands},000 inhabitants at the census of {recent}.",
        "The city is known for its {feature} and for the yearly {word} festival held every {season}.",
        "{name} received its town charter in {year2}.",
    ),
    "person": (
        "{name} (born {year} in {city}) is {a_nationality} {occupation}.",
        "{pronoun} grew up in {city2} and studied at {university}.",
        "{known}",
        "{possessive} work has received the {word} Prize and is widely admired for its {quality}.",
    ),
    "film": (
        "{name} is {a_year} {genre} film.",
        "It was directed by {person} and shot largely in {city}.",
        "The film runs for {minutes} minutes and follows {plot}.",
        "It premiered at the {word} Film Festival and was praised for its {quality}.",
    ),
    "novel": (
        "{name} is {a_genre} novel by {person}, first published in {year}.",
        "The book is set in {city} and tells the story of {plot}.",
        "It runs to {pages} pages and was issued by {word} Press.",
        "Critics praised its {quality}, and it has been translated into {small} languages.",
    ),
    "album": (
        "{name} is {a_genre} album by {person}, released in {year}.",
        "It was recorded over {small} weeks in {city} and holds {tracks} tracks.",
        'Its lead single, "{single}", reached the top {top} of the national charts.',
        "The record was mixed at {word} Studios and later reissued on vinyl.",
    ),
    "company": (
        "{name} is {a_genre} company founded in {year} by {person}.",
        "It is headquartered in {city} and employs about {staff:,} people.",
        "The company was listed on the {word} stock exchange in {later}.",
        "Its factories have long been a major employer in the region around {city2}.",
    ),
    "band": (
        "{name} is {a_genre} band formed in {year} by {person}.",
        "The group is based in {city} and has released {tracks} studio albums.",
        "Its line-up has changed several times since the {decade}s, when the band first toured abroad.",
        "Critics have praised its long live shows and its {quality} on record.",
    ),
    "university": (
        "{name} is {a_access} university founded in {year} by {person}.",
        "Its main campus is located in {city}, where about {small},000 students are enrolled.",
        "The university is known for its faculty of {field} and its library of old maps.",
        "It opened a second campus in {city2} in {later}.",
    ),
}
# Question phrasings: alternatives are separated by "|".
ROLES = {
    "film": "the director of {}|the person who directed {}",
    "novel": "the author of {}|the writer of {}|the person who wrote {}",
    "album": "the artist behind {}|the musician who recorded {}",
    "org": "the founder of {}|the person who founded {}",
}
BRIDGE_TEMPLATES = {
    "birth_city": "In which city was {p} born?|Where was {p} born?|What is the birthplace of {p}?|"
    "{P} was born in which city?",
    "birth_year": "In what year was {p} born?|When was {p} born?|What is the birth year of {p}?|"
    "{P} was born in which year?",
    "nationality": "What is the nationality of {p}?|What nationality is {p}?|{P} is of what nationality?",
    "hq_country": "In which country is {o} {verb}?|In what country is {o} {verb}?|"
    "{o} is {verb} in a city of which country?",
}
CHOICE_TEMPLATES = {
    "film": "Which film came out first, {a} or {b}?|Which film was released earlier, {a} or {b}?|"
    "Which of these films is older: {a} or {b}?",
    "novel": "Which novel was published first, {a} or {b}?|Which book came out earlier, {a} or {b}?",
    "album": "Which album was released first, {a} or {b}?|Which album came out earlier, {a} or {b}?",
    "person": "Who was born earlier, {a} or {b}?|Who is older, {a} or {b}?|Which person was born first, {a} or {b}?",
    "org": "Which was founded first, {a} or {b}?|Which organisation is older, {a} or {b}?",
}
YESNO_TEMPLATES = {
    "nationality": "Are {a} and {b} of the same nationality?|Do {a} and {b} share a nationality?|"
    "Is {a} of the same nationality as {b}?",
    "city": "Were {a} and {b} born in the same city?|Do {a} and {b} share a birthplace?",
    "genre": "Do the {kind}s {a} and {b} belong to the same genre?|Are the {kind}s {a} and {b} of the same genre?",
    "hq": "Are {a} and {b} based in the same city?|Do {a} and {b} have their headquarters in the same city?",
}
HQ_VERBS = {"company": "headquartered", "band": "based", "university": "located"}
# The sub-questions of each hop (a record's `decomposition`): what a query rewriter should search for. A hop that
# depends on an earlier answer is phrased through the question's own words, never through the hidden answer.
BRIDGE_HOPS = {
    "birth_city": "Where was {p} born?",
    "birth_year": "When was {p} born?",
    "nationality": "What is the nationality of {p}?",
}
DATE_HOPS = {
    "film": "When was {} released?",
    "novel": "When was {} published?",
    "album": "When was {} released?",
    "person": "When was {} born?",
    "org": "When was {} founded?",
}
SAME_HOPS = {
    "nationality": "What is the nationality of {}?",
    "city": "Where was {} born?",
    "genre": "What is the genre of {}?",
    "hq": "In which city is {} based?",
}
WORK_KINDS = ("film", "novel", "album")
ORG_KINDS = ("company", "band", "university")
# Which sentence of a paragraph states a fact (the templates above fix it).
CREATOR_SENTENCE = {"film": 1, "novel": 0, "album": 0, "company": 0, "band": 0, "university": 0}
HQ_SENTENCE = 1
