"""`World`: the knowledge base plus its passages and the look-ups every data builder needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .kb import OCCUPATIONS, KnowledgeBase, Person, make_knowledge_base
from .passages import WorldPassage, make_passages


@dataclass
class World:
    kb: KnowledgeBase
    passages: list[WorldPassage]
    by_entity: dict[str, list[WorldPassage]] = field(default_factory=dict, repr=False)
    by_id: dict[str, WorldPassage] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for p in self.passages:
            self.by_entity.setdefault(p.entity_id, []).append(p)
            self.by_id[p.id] = p

    def passage_with(self, person: Person, attribute: str) -> WorldPassage:
        """The one passage of `person` that states `attribute` (the gold passage)."""
        return next(p for p in self.by_entity[person.id] if attribute in p.facts)

    def passage_without(self, person: Person, attribute: str) -> WorldPassage | None:
        """A passage of `person` that does not state `attribute` (None for one-passage people)."""
        return next((p for p in self.by_entity[person.id] if attribute not in p.facts), None)

    def values(self, attribute: str) -> list[str]:
        """Every possible value of an attribute, for false claims and wrong answer choices."""
        if attribute == "birthplace":
            return [p.name for p in self.kb.places]
        if attribute == "employer":
            return [o.name for o in self.kb.orgs]
        if attribute == "occupation":
            return list(OCCUPATIONS)
        if attribute == "instrument":
            return list(self.kb.instruments)
        first, last = self.kb.birth_years
        return [str(y) for y in range(first, last + 1)]


def make_world(seed: int = 0, n_people: int = 2000, **kb_options) -> World:
    """The deterministic world of `seed`: knowledge base and passages."""
    kb = make_knowledge_base(seed, n_people, **kb_options)
    return World(kb, make_passages(kb, seed))
