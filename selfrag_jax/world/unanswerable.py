"""Unanswerable questions of four kinds, each with a dev and a test split, for honest refusal.

A refusal rule tuned on one kind of unanswerable question can fail on another (a support bar
fitted to name-only people refused only 43% of questions about recombined names), so the
rule's settings are chosen on the dev splits of every kind and reported on the test splits:

- `unseen_name`: a name whose first and last parts no one in the world has.
- `recombined`: one real person's first name with another's last name (no one has both): the
  retriever finds people sharing either part, look-alikes on both sides.
- `unstated`: a held-out person asked for something no passage states about anyone (the
  year they died, their height, their favourite food).
- `others_only`: a name-only person (`kb.Ghost`) whose name stands in another person's passage,
  so retrieval returns only other people's passages (the world's `world_unanswerable`).

Every question is about held-out people or names nobody in training has, in the world's own
question wordings (`tasks.QUESTIONS`), except `unstated`'s, which no training file asks.
"""

from __future__ import annotations

import random

from .core import World
from .kb import _NameMaker
from .tasks import QUESTIONS

KINDS = ("unseen_name", "recombined", "unstated", "others_only")
SPLITS = {"dev": 100, "test": 150}

UNSTATED = {  # nothing in any passage, fillers included (passages.py), says these
    "death_year": ("In what year did {name} die?", "When did {name} die?", "What year did {name} pass away?"),
    "height": ("How tall was {name}?", "What was {name}'s height?"),
    "favourite_food": ("What was {name}'s favourite food?", "Which dish did {name} like best?"),
}


def _record(kind: str, split: str, i: int, question: str, name: str, entity_ids: list[str], attribute: str) -> dict:
    return {"id": f"unanswerable_{kind}_{split}_{i:05d}", "question": question, "answers": [], "instruction": question,
            "answerable": False, "meta": {"kind": "unanswerable", "unanswerable_kind": kind, "name": name,
                                          "entity_ids": entity_ids, "attributes": [attribute], "gold_passage_ids": []}}


def unanswerable_sets(world: World, seed: int) -> dict[str, list[dict]]:
    """`{kind}_{split}` -> eval records (the `world_unanswerable` layout, `meta.unanswerable_kind` set)."""
    rng = random.Random(seed * 7717 + 3)
    kb = world.kb
    heldout = [p for p in kb.people if p.split == "heldout"]
    firsts = sorted({p.first for p in kb.people} | {g.first for g in kb.ghosts})
    lasts = sorted({p.last for p in kb.people} | {g.last for g in kb.ghosts})
    taken = {p.name for p in kb.people} | {g.name for g in kb.ghosts}
    names = _NameMaker(rng)
    # every word the world already names (an organisation's name is a word and its kind)
    names.used |= {w.lower() for w in (*firsts, *lasts, *(p.name for p in kb.places), *(o.name.split()[0] for o in kb.orgs))}
    # dev and test ask about different held-out people and name-only people
    people = {"dev": heldout[0::2], "test": heldout[1::2]}
    ghosts = [g for g in kb.ghosts if g.split == "heldout"]
    ghosts = {"dev": ghosts[0::2], "test": ghosts[1::2]}

    def asked(name: str, ids: list[str]) -> tuple[str, str, list[str], str]:
        a = rng.choice(list(QUESTIONS))
        return rng.choice(QUESTIONS[a]).format(name=name), name, ids, a

    def recombined(split: str, i: int) -> tuple[str, str, list[str], str]:
        while True:  # the last name a held-out person's, so the retriever finds a held-out look-alike
            a, b = rng.choice(kb.people), rng.choice(people[split])
            if f"{a.first} {b.last}" not in taken and a.first != b.first:
                return asked(f"{a.first} {b.last}", [a.id, b.id])

    def unstated(split: str, i: int) -> tuple[str, str, list[str], str]:
        p, a = rng.choice(people[split]), rng.choice(list(UNSTATED))
        return rng.choice(UNSTATED[a]).format(name=p.name), p.name, [p.id], a

    def others_only(split: str, i: int) -> tuple[str, str, list[str], str]:
        g = ghosts[split][i % len(ghosts[split])]
        return asked(g.name, [g.id])

    def unseen_name(split: str, i: int) -> tuple[str, str, list[str], str]:
        return asked(f"{names.make(2, max_len=8)} {names.make(rng.choice((2, 3)), max_len=12)}", [])

    make = {"unseen_name": unseen_name, "recombined": recombined, "unstated": unstated, "others_only": others_only}
    return {f"{kind}_{split}": [_record(kind, split, i, *fn(split, i)) for i in range(size)]
            for kind, fn in make.items() for split, size in SPLITS.items()}
