"""The bundled world's ground truth as judges: whether an answer is supported by its passage
(`WorldFactJudge`, the `SupportJudge` of `compare --world` and `bench_pipelines`) and whether a
premise entails a sentence (`WorldJudge`, the citation judge of `eval --world`). Both read the
world's entities.jsonl (and passages.jsonl), so they are exact, with no model."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass
class WorldFactJudge:
    """The bundled world's ground truth: an answer to a question about attribute a of a
    person is supported when a passage belongs to an entity whose value of a is in the
    answer, and the passage states that value. Records without `meta.attributes` (fact
    checks, no-retrieval tasks) are not judged."""

    entities: dict[str, dict[str, Any]]  # passage id -> the entity record it belongs to

    @classmethod
    def from_world(cls, world_dir: str | Path) -> "WorldFactJudge":
        path = Path(world_dir) / "entities.jsonl"
        if not path.exists():
            raise FileNotFoundError(f"{world_dir}: no entities.jsonl (a bundled-world folder)")
        entities = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                e = json.loads(line)
                entities.update({pid: e for pid in e.get("passage_ids", [])})
        return cls(entities)

    def supported(self, record: dict[str, Any], prediction: str, passages: list[dict[str, str]]) -> bool | None:
        attributes = (record.get("meta") or {}).get("attributes") or []
        if not attributes or not prediction:
            return None
        for p in passages:
            entity = self.entities.get(str(p.get("id")))
            values = [str(entity[a]) for a in attributes if entity and entity.get(a) is not None]
            if values and all(_contains(prediction, v) and _contains(p["text"], v) for v in values):
                return True
        return False


@dataclass
class WorldJudge:
    """Ground truth of the bundled world: a premise (one or more "Title: t\\ntext" blocks)
    entails a sentence when the sentence states at least one fact, every fact it states
    (an attribute value of any person: place, year, occupation, employer, instrument) is
    an attribute of a premise passage's person *and* written in that passage, and every
    person it names in full is one of those persons."""

    people: dict[str, dict[str, Any]]  # person id -> entity record
    passages: dict[str, tuple[str, str]]  # passage text -> (person id, passage text)
    values: list[str] = field(default_factory=list)  # every attribute value, longest first
    names: list[str] = field(default_factory=list)

    ATTRIBUTES = ("birthplace", "birth_year", "occupation", "employer", "instrument")

    @classmethod
    def from_world(cls, world_dir: str | Path) -> "WorldJudge":
        world_dir = Path(world_dir)
        people, by_passage = {}, {}
        for line in (world_dir / "entities.jsonl").read_text().splitlines():
            if line.strip():
                e = json.loads(line)
                if e.get("type", "person") != "person":
                    continue  # places and organisations: their names are attribute values
                people[e["id"]] = e
                for pid in e.get("passage_ids", []):
                    by_passage[pid] = e["id"]
        passages = {}
        for line in (world_dir / "passages.jsonl").read_text().splitlines():
            if line.strip():
                p = json.loads(line)
                if p["id"] in by_passage:
                    passages[p["text"].strip()] = (by_passage[p["id"]], p["text"])
        values = sorted({str(e[a]) for e in people.values() for a in cls.ATTRIBUTES if e.get(a)}, key=len, reverse=True)
        names = sorted({e["name"] for e in people.values() if e.get("name")}, key=len, reverse=True)
        return cls(people, passages, values, names)

    def entails(self, premise: str, hypothesis: str) -> bool:
        evidence = [self.passages[t] for t in self._blocks(premise) if t in self.passages]
        facts = self._found(self.values, hypothesis)
        if not evidence or not facts:
            return False
        stated = {v for pid, text in evidence for v in self._attrs(pid) if _contains(text, v)}
        named = set(self._found(self.names, hypothesis))
        return set(facts) <= stated and named <= {self.people[pid]["name"] for pid, _ in evidence}

    def _attrs(self, pid: str) -> list[str]:
        return [str(self.people[pid][a]) for a in self.ATTRIBUTES if self.people[pid].get(a)]

    @staticmethod
    def _blocks(premise: str) -> list[str]:
        """The passage texts of "Title: t\\ntext" blocks joined by newlines."""
        parts = re.split(r"(?:^|\n)Title: [^\n]*\n", premise)
        return [p.strip() for p in parts if p.strip()]

    @staticmethod
    def _found(vocabulary: Sequence[str], text: str) -> list[str]:
        found, rest = [], text
        for v in vocabulary:  # longest first, so "Teshe Works" is not also read as "Teshe"
            if _contains(rest, v):
                found.append(v)
                rest = re.sub(rf"(?<!\w){re.escape(v)}(?!\w)", " ", rest)
        return found


def _contains(text: str, value: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(value)}(?!\w)", text) is not None
