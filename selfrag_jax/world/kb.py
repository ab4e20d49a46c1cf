"""The fictional knowledge base: people, places, organisations and name-only "ghosts".

Everything is invented from syllables so that no pretrained model can know it, and drawn
from one `random.Random(seed)` so the same seed gives the same world. People share first
names, occupations and birthplaces on purpose: those look-alikes are the distractor passages
that teach `[Irrelevant]`. A fixed fraction of people is held out: their passages are in the
corpus (retrieval finds them) but they appear in no training file.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# The five attributes of a person, in the order passages and templates list them.
ATTRIBUTES = ("birthplace", "birth_year", "occupation", "employer", "instrument")

OCCUPATIONS = (
    "baker", "glassblower", "weaver", "potter", "carpenter", "cartographer", "engraver",
    "astronomer", "beekeeper", "bookbinder", "blacksmith", "shipwright", "tailor", "miller",
    "apothecary", "surveyor", "chemist", "sculptor", "printer", "clockmaker", "gardener",
    "architect", "botanist", "painter", "jeweller", "mason", "brewer", "fisher", "teacher",
    "librarian",
)
INSTRUMENTS = (
    "lute", "harp", "flute", "drum", "fiddle", "horn", "zither", "oboe", "cello", "piano",
    "organ", "trumpet", "bagpipe", "mandolin", "clarinet", "viola",
)
BIRTH_YEARS = (1780, 1960)  # inclusive
# More instruments for the fresh reading people only (pretrain.py): with 16 values a base that
# had not learnt to copy them answered one instrument for every question.
MORE_INSTRUMENTS = (
    "accordion", "balalaika", "banjo", "bassoon", "bouzouki", "bugle", "carillon", "celesta",
    "cimbalom", "cittern", "clavichord", "concertina", "cornet", "cymbal", "dulcimer", "euphonium",
    "fife", "flugelhorn", "glockenspiel", "gong", "guitar", "harmonica", "harmonium", "harpsichord",
    "kazoo", "lyre", "marimba", "melodeon", "ocarina", "piccolo", "psaltery", "rebec", "recorder",
    "sackbut", "sarangi", "saxophone", "shawm", "sitar", "spinet", "tabla", "tambourine", "theorbo",
    "timpani", "triangle", "trombone", "tuba", "ukulele", "vibraphone", "viol", "virginal",
    "xylophone", "bodhran", "crumhorn", "gittern", "kalimba", "koto", "oud", "shamisen", "erhu",
    "bandura", "kantele", "guzheng",
)
TRAITS = (
    "patience", "humour", "kindness", "courage", "curiosity", "precision", "generosity",
    "stubbornness", "modesty", "energy", "honesty", "charm",
)
ORG_KINDS = (
    ("Works", "workshop", "tools"), ("Guild", "guild", "apprentices"),
    ("Company", "trading company", "ships"), ("Foundry", "foundry", "bells"),
    ("Press", "printing house", "almanacs"), ("Mills", "mill", "flour"),
    ("Academy", "academy", "lectures"), ("Observatory", "observatory", "star charts"),
)
PLACE_FEATURES = (
    "its market", "its old bridge", "its harbour", "its orchards", "its stone walls",
    "its clock tower", "its salt mines", "its festivals", "its vineyards", "its library",
)

_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "tr", "st", "th", "sh", "ch", "fl", "pl", "sk", "w")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou", "y")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "st", "x", "v")
_SURNAME_ENDS = ("ar", "en", "is", "ow", "ick", "mont", "ard", "ell", "ey", "ander", "ton", "ski")
_PLACE_ENDS = ("holm", "mere", "ford", "wick", "dun", "vale", "stead", "gard", "by", "port")


@dataclass(frozen=True)
class Person:
    """A person with five attributes; `mentor` is a ghost named in one of their passages."""

    id: str
    first: str
    last: str
    gender: str  # "f" or "m": chooses the pronoun in passages
    birthplace: str
    birth_year: int
    occupation: str
    employer: str
    instrument: str
    split: str  # "train" or "heldout"
    n_passages: int  # 1 or 2
    mentor: str = ""
    trait: str = ""

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"

    @property
    def pronoun(self) -> str:
        return "she" if self.gender == "f" else "he"

    @property
    def possessive(self) -> str:
        return "her" if self.gender == "f" else "his"

    def value(self, attribute: str) -> str:
        """An attribute's value exactly as passages spell it (the gold answer string)."""
        return str(getattr(self, attribute))


@dataclass(frozen=True)
class Place:
    id: str
    name: str
    province: str
    river: str
    founded: int
    known_for: str


@dataclass(frozen=True)
class Org:
    id: str
    name: str
    kind: str
    town: str
    founded: int
    product: str


@dataclass(frozen=True)
class Ghost:
    """A person who exists only as a name in someone else's passage: nothing about them is
    in the corpus, so questions about them are unanswerable (the honest-refusal tests)."""

    id: str
    first: str
    last: str
    student_id: str  # the one person whose passage names this ghost
    split: str  # the student's split: a held-out student's passage must not reach training

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"


@dataclass
class KnowledgeBase:
    seed: int
    people: list[Person]
    places: list[Place]
    orgs: list[Org]
    ghosts: list[Ghost]
    instruments: tuple[str, ...] = INSTRUMENTS  # the values people drew from (World.values)
    birth_years: tuple[int, int] = BIRTH_YEARS
    _by_value: dict[tuple[str, str], list[Person]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:  # people by (attribute, value), for `lookalikes`
        for p in self.people:
            for attr in ("first", "occupation", "birthplace"):
                self._by_value.setdefault((attr, getattr(p, attr)), []).append(p)

    @property
    def train_people(self) -> list[Person]:
        return [p for p in self.people if p.split == "train"]

    @property
    def heldout_people(self) -> list[Person]:
        return [p for p in self.people if p.split == "heldout"]

    def lookalikes(self, person: Person, split: str | None = "train") -> dict[str, list[Person]]:
        """Other people sharing the first name, occupation or birthplace with `person`,
        restricted to one split (training data may only use training people)."""
        return {attr: [p for p in self._by_value[(attr, getattr(person, attr))]
                       if p.id != person.id and (split is None or p.split == split)]
                for attr in ("first", "occupation", "birthplace")}


def article(word: str) -> str:
    """'a' or 'an' before a word (occupations are written with their article)."""
    return "an" if word[0] in "aeiou" else "a"


class _NameMaker:
    """Invents capitalised words from syllables, never the same word twice."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def _syllable(self, coda: bool) -> str:
        r = self.rng
        return r.choice(_ONSETS) + r.choice(_VOWELS) + (r.choice(_CODAS) if coda else "")

    def make(self, n_syllables: int, ending: str = "", min_len: int = 4, max_len: int = 11) -> str:
        while True:
            word = "".join(self._syllable(coda=i == n_syllables - 1) for i in range(n_syllables))
            word = (word + ending).capitalize()
            if min_len <= len(word) <= max_len and word.lower() not in self.used:
                self.used.add(word.lower())
                return word


def make_knowledge_base(
    seed: int = 0,
    n_people: int = 2000,
    n_places: int = 50,
    n_orgs: int = 40,
    n_ghosts: int = 200,
    n_first_names: int = 160,
    heldout_fraction: float = 0.15,
    two_passage_fraction: float = 0.6,
    instruments: tuple[str, ...] = INSTRUMENTS,
    birth_years: tuple[int, int] = BIRTH_YEARS,
) -> KnowledgeBase:
    """Draws the whole knowledge base from `seed`. First names are dealt round-robin so each
    is shared by at least two people (look-alikes always exist). `instruments` and
    `birth_years` (inclusive) are the values people draw from."""
    rng = random.Random(seed)
    names = _NameMaker(rng)
    provinces = [names.make(2) for _ in range(8)]
    rivers = [names.make(2) for _ in range(12)]
    places = [
        Place(f"place-{i:03d}", names.make(rng.choice((1, 2)), rng.choice(_PLACE_ENDS), 6, 12),
              rng.choice(provinces), rng.choice(rivers), rng.randint(900, 1700), rng.choice(PLACE_FEATURES))
        for i in range(n_places)
    ]
    orgs = []
    for i in range(n_orgs):
        suffix, kind, product = rng.choice(ORG_KINDS)
        orgs.append(Org(f"org-{i:03d}", f"{names.make(2)} {suffix}", kind, rng.choice(places).name,
                        rng.randint(1600, 1850), product))

    firsts = [(names.make(2, max_len=8), rng.choice("fm")) for _ in range(n_first_names)]
    dealt = [firsts[i % n_first_names] for i in range(n_people)]
    rng.shuffle(dealt)
    ghost_names = [(rng.choice(firsts)[0], names.make(rng.choice((2, 3)), rng.choice(_SURNAME_ENDS), max_len=12))
                   for _ in range(n_ghosts)]
    mentor_of = set(rng.sample(range(n_people), min(n_ghosts, n_people)))
    n_heldout = round(n_people * heldout_fraction)
    heldout = set(rng.sample(range(n_people), n_heldout))
    people, ghosts = [], []
    for i, (first, gender) in enumerate(dealt):
        split = "heldout" if i in heldout else "train"
        mentor = ""
        if i in mentor_of:
            g_first, g_last = ghost_names[len(ghosts)]
            ghosts.append(Ghost(f"ghost-{len(ghosts):04d}", g_first, g_last, f"person-{i:04d}", split))
            mentor = ghosts[-1].name
        people.append(Person(
            id=f"person-{i:04d}", first=first, gender=gender,
            last=names.make(rng.choice((2, 2, 3)), rng.choice(_SURNAME_ENDS) if rng.random() < 0.5 else "", max_len=12),
            birthplace=rng.choice(places).name, birth_year=rng.randint(*birth_years),
            occupation=rng.choice(OCCUPATIONS), employer=rng.choice(orgs).name,
            instrument=rng.choice(instruments), split=split,
            n_passages=2 if rng.random() < two_passage_fraction else 1,
            mentor=mentor, trait=rng.choice(TRAITS),
        ))
    return KnowledgeBase(seed, people, places, orgs, ghosts, tuple(instruments), tuple(birth_years))
