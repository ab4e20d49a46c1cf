"""Base-model pretraining text: the world's passages, plain question-answer look-ups, and
"reading" documents (a passage or two, then questions answered from it).

small-models.md: a model that never trained on passage text does not learn to read it,
and Self-RAG starts from a base model that already can. The reading documents are the
in-context copying the generator later relies on; the look-alike pairs make the model
match the question's name to the passage's title. Held-out people appear nowhere here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from ..tokens import passage_text
from .core import World
from .generator_data import lookalike_passage
from .tasks import QUESTIONS, TaskMaker


@dataclass(frozen=True)
class PretrainConfig:
    n_lookups: int = 3000  # "Question: ..\nAnswer: .." lines, grouped into documents of a few
    n_reading: int = 2500  # passage(s) followed by questions about them
    n_no_retrieval: int = 1000  # copy / reverse / count / sum, as plain question-answer text
    questions_per_reading: int = 2


def _qa(q: str, a: str) -> str:
    return f"Question: {q}\nAnswer: {a}"


def pretrain_texts(world: World, seed: int, cfg: PretrainConfig = PretrainConfig()) -> Iterator[str]:
    """Yields the pretraining documents in a fixed, shuffled order."""
    rng = random.Random(seed * 104729 + 3)
    tasks = TaskMaker(world, "train", rng, prefix="pretrain")
    train_ids = {p.id for p in world.kb.train_people}
    docs = [passage_text(p.title, p.text) for p in world.passages
            if p.entity_id in train_ids or not p.entity_id.startswith("person-")]

    people = tasks.people
    for start in range(0, cfg.n_lookups, 4):
        lines = []
        for _ in range(min(4, cfg.n_lookups - start)):
            p, a = rng.choice(people), rng.choice(list(QUESTIONS))
            lines.append(_qa(rng.choice(QUESTIONS[a]).format(name=p.name), p.value(a)))
        docs.append("\n\n".join(lines))
    for pl in world.kb.places:
        docs.append(_qa(f"In which province is {pl.name}?", pl.province))
    for o in world.kb.orgs:
        docs.append(_qa(f"Where is {o.name} based?", o.town))

    for _ in range(cfg.n_reading):
        p = rng.choice(people)
        own = rng.choice(world.by_entity[p.id])
        shown = [own]
        if rng.random() < 0.5:  # a look-alike beside it: answer from the passage with the right name
            shown.insert(rng.randrange(2), lookalike_passage(world, p, rng, "train"))
        attrs = rng.sample(sorted(own.facts), min(cfg.questions_per_reading, len(own.facts)))
        qs = [_qa(rng.choice(QUESTIONS[a]).format(name=p.name), own.facts[a]) for a in attrs]
        docs.append("\n\n".join([*(passage_text(s.title, s.text) for s in shown), *qs]))

    for _ in range(cfg.n_no_retrieval):
        t = tasks.no_retrieval()
        docs.append(_qa(t.instruction, t.answer))
    rng.shuffle(docs)
    yield from docs
