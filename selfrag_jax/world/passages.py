"""Encyclopedia-style passages (title = entity name, ~30-60 words) and JSON-lines writing.

A person gets one passage stating all five attributes, or two: the first states birthplace
and occupation, the second birth year, employer and instrument. The split matters: a
two-passage person has passages that are relevant but lack the asked fact (the
`[No support / Contradictory]` and `[Partially supported]` cases). Attribute values are
written verbatim, so the gold answer is always a substring of its gold passage, and a
lower-case value is always followed by punctuation (see tokenizer.py for why).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Iterable

from .kb import KnowledgeBase, Person, article

FIRST_PASSAGE_FACTS = ("birthplace", "occupation")
SECOND_PASSAGE_FACTS = ("birth_year", "employer", "instrument")

_GENERIC = (
    "{P} kept a small garden behind the house.", "{L} travelled widely as a young adult.",
    "{P} wrote many letters to friends.", "{L} rarely left home in winter.",
    "{P} had two brothers and a sister.", "{L} was fond of long walks by the water.",
    "{P} never married.", "{L} owned a large collection of maps.",
    "{P} spoke three languages.", "{L} often visited the coast in summer.",
    "{P} trained several apprentices over the years.", "{L} kept careful notes of every day.",
)


@dataclass(frozen=True)
class WorldPassage:
    """One retrievable passage plus the ground truth of what it states (`facts`)."""

    id: str
    title: str
    text: str
    entity_id: str
    facts: dict[str, str] = field(default_factory=dict, hash=False)

    def record(self) -> dict:
        return {"id": self.id, "title": self.title, "text": self.text}


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _sentences(p: Person, rng: random.Random) -> dict[str, str]:
    """One sentence per fact (and fillers), each template picked at random."""
    P, L, poss, pr = _cap(p.pronoun), p.last, p.possessive, p.pronoun
    a_occ = f"{article(p.occupation)} {p.occupation}"
    fill = dict(P=P, L=L)
    return {
        "intro": rng.choice((
            f"{p.name}, {a_occ}, was born in {p.birthplace}.",
            f"{p.name} was born in {p.birthplace}. {P} worked as {a_occ}.",
            f"{p.name} was born in {p.birthplace}, and became {a_occ}.",
        )),
        "birth_year": rng.choice((
            f"{L} was born in {p.birth_year}.", f"{P} was born in the year {p.birth_year}.",
            f"{L} was born in {p.birth_year}, the youngest of three children.",
        )),
        "employer": rng.choice((
            f"For many years {pr} worked for {p.employer}.",
            f"{L} spent most of {poss} working life at {p.employer}.",
            f"Later {pr} joined {p.employer}.",
        )),
        "instrument": rng.choice((
            f"In {poss} spare time {pr} played the {p.instrument}.",
            f"{L} was also known for playing the {p.instrument}.",
            f"At local festivals {pr} played the {p.instrument}.",
        )),
        "trait": rng.choice((f"{P} was known for {poss} {p.trait}.", f"Friends remembered {L} for {poss} {p.trait}.")),
        "mentor": f"{L} studied under {p.mentor}." if p.mentor else "",
        **{f"generic{i}": g.format(**fill) for i, g in enumerate(rng.sample(_GENERIC, 3))},
    }


def person_passages(p: Person, rng: random.Random) -> list[tuple[str, dict[str, str]]]:
    """(text, facts) for each of a person's passages."""
    s = _sentences(p, rng)
    facts = {a: p.value(a) for a in ("birthplace", "birth_year", "occupation", "employer", "instrument")}
    extras = [x for x in (s["trait"], s["mentor"]) if x]
    if p.n_passages == 1:
        body = [s["birth_year"], s["employer"], s["instrument"], *extras, s["generic0"]]
        rng.shuffle(body)
        return [(" ".join([s["intro"], *body]), facts)]
    rest = [*extras, s["generic0"], s["generic1"]]
    rng.shuffle(rest)
    first = [s["intro"], *rest]
    second = [s["birth_year"], s["employer"], s["instrument"]]
    rng.shuffle(second)
    second.append(s["generic2"])
    return [
        (" ".join(first), {a: facts[a] for a in FIRST_PASSAGE_FACTS}),
        (" ".join(second), {a: facts[a] for a in SECOND_PASSAGE_FACTS}),
    ]


def make_passages(kb: KnowledgeBase, seed: int) -> list[WorldPassage]:
    """All passages of the world in a fixed order: people, then places, then organisations."""
    rng = random.Random(seed * 1000003 + 1)
    out: list[WorldPassage] = []

    def add(title: str, text: str, entity_id: str, facts: dict[str, str]) -> None:
        out.append(WorldPassage(f"w{len(out):05d}", title, text, entity_id, facts))

    for p in kb.people:
        for text, facts in person_passages(p, rng):
            add(p.name, text, p.id, facts)
    for pl in kb.places:
        add(pl.name, (
            f"{pl.name} is a town in the province of {pl.province}. It lies on the river {pl.river} "
            f"and was founded in {pl.founded}. {pl.name} is known for {pl.known_for}, and many "
            f"craftspeople have lived there."
        ), pl.id, {"province": pl.province, "river": pl.river, "founded": str(pl.founded)})
    for o in kb.orgs:
        add(o.name, (
            f"{o.name} is {article(o.kind)} {o.kind} based in {o.town}. It was founded in {o.founded} "
            f"and is best known for its {o.product}. {o.name} has employed many people from the region."
        ), o.id, {"town": o.town, "founded": str(o.founded), "product": o.product})
    return out


def write_jsonl(path: str, records: Iterable[dict]) -> int:
    """Writes records as UTF-8 JSON lines (fixed key order, so output is byte-reproducible);
    returns the count. Written to a temporary name first, then renamed."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
