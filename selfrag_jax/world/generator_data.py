"""Generator training data in the Self-RAG `output` format, labelled from ground truth.

The answer text is fixed by the task (as GPT-4's output is in the paper's data) and the
evidence varies: the gold passage gives `[Relevant]..[Fully supported]`, a look-alike's
passage gives `[Irrelevant]` (no IsSup), the person's other passage gives `[Relevant]..
[No support / Contradictory]`, and a two-fact answer against a passage holding one fact
gives `[Partially supported]`. `parse_output` checks the format and is what the tests use.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from ..tokens import (
    CONTINUE_EVIDENCE, FULLY_SUPPORTED, IRRELEVANT, ISSUP_GROUP, ISUSE_GROUP, NO_RETRIEVAL, NO_SUPPORT,
    PARAGRAPH_CLOSE, PARAGRAPH_OPEN, PARTIALLY_SUPPORTED, REFLECTION_TOKENS, RELEVANT, RETRIEVAL, passage_text,
)
from .core import World
from .kb import Person
from .passages import WorldPassage
from .tasks import REFUSAL, UNRECORDED_YEARS, Task, unrecorded_question


@dataclass(frozen=True)
class GeneratorConfig:
    """Mix of evidence cases for retrieval tasks (the rest use the gold passage)."""

    p_irrelevant: float = 0.35  # docs/tiny-models.md: balance relevant and look-alike passages
    p_no_support: float = 0.12  # only where the person has a second passage
    p_longform_distractor: float = 0.25  # one long-form segment shown a look-alike instead
    irrelevant_answer: str = "gold"  # "gold" (paper: the output text is fixed) or "refuse"


def paragraph(p: WorldPassage) -> str:
    return f"{RETRIEVAL}{PARAGRAPH_OPEN}{passage_text(p.title, p.text)}{PARAGRAPH_CLOSE}"


def utility(k: int) -> str:
    return ISUSE_GROUP[k - 1]


def lookalike_passage(world: World, person: Person, rng: random.Random, split: str = "train") -> WorldPassage:
    """A passage about someone else who shares a first name (preferred), occupation or birthplace."""
    groups = world.kb.lookalikes(person, split)
    if not any(groups.values()) and split != "train":  # a small world; borrowing never leaks held-out people
        groups = world.kb.lookalikes(person, None)
    kind = "first" if rng.random() < 0.6 or not (groups["occupation"] or groups["birthplace"]) else \
        rng.choice([k for k in ("occupation", "birthplace") if groups[k]])
    pool = groups[kind] or groups["occupation"] or groups["birthplace"]
    return rng.choice(world.by_entity[rng.choice(pool).id])


@dataclass
class GeneratorExample:
    record: dict
    meta: dict = field(default_factory=dict)


def oracle_output(world: World, task: Task, rng: random.Random, cfg: GeneratorConfig = GeneratorConfig()) -> tuple[str, dict]:
    """The Self-RAG `output` for a task and the labels chosen (for the meta file)."""
    if not task.needs_retrieval:
        return f"{NO_RETRIEVAL}{task.answer}{utility(5)}", {"case": "no_retrieval"}
    if task.kind == "unanswerable":
        ghost = next(g for g in world.kb.ghosts if g.id == task.entity_ids[0])
        student = next(p for p in world.kb.people if p.id == ghost.student_id)
        if rng.random() < 0.5:  # the passage naming the ghost: it matches the name but is about someone else
            shown = next(p for p in world.by_entity[student.id] if ghost.name in p.text)
        else:
            same_first = [p for p in world.kb.people if p.first == ghost.first and p.split == student.split]
            shown = rng.choice(world.by_entity[rng.choice(same_first).id])
        return f"{paragraph(shown)}{IRRELEVANT}{REFUSAL}{utility(1)}", {"case": "unanswerable", "passage_ids": [shown.id]}
    if task.kind in ("longform", "compare"):
        return _longform_output(world, task, rng, cfg)

    person = next(p for p in world.kb.people if p.id == task.entity_ids[0])
    r = rng.random()
    if r < cfg.p_irrelevant:
        shown = lookalike_passage(world, person, rng, person.split)
        answer, use = task.answer, 5
        if cfg.irrelevant_answer == "refuse" and task.kind in ("qa", "pair_qa"):
            answer, use = REFUSAL, 1
        return f"{paragraph(shown)}{IRRELEVANT}{answer}{utility(use)}", {"case": "irrelevant", "passage_ids": [shown.id]}
    golds = [world.by_id[i] for i in task.gold_passage_ids]
    if task.kind == "pair_qa":
        shown = rng.choice(golds)
        sup = FULLY_SUPPORTED if len(golds) == 1 else PARTIALLY_SUPPORTED
        case = "fully" if len(golds) == 1 else "partial"
    elif r < cfg.p_irrelevant + cfg.p_no_support and world.passage_without(person, task.attributes[0]):
        shown, sup, case = world.passage_without(person, task.attributes[0]), NO_SUPPORT, "no_support"
    else:
        shown, sup, case = golds[0], FULLY_SUPPORTED, "fully"
    return f"{paragraph(shown)}{RELEVANT}{task.answer}{sup}{utility(5)}", {"case": case, "passage_ids": [shown.id]}


def _longform_output(world: World, task: Task, rng: random.Random, cfg: GeneratorConfig) -> tuple[str, dict]:
    """One segment per sentence: retrieve when the sentence rests on a passage not yet shown,
    continue when it rests on the one shown, no retrieval when it rests on none."""
    people = {p.id: p for p in world.kb.people if p.id in task.entity_ids}
    retrieving = [i for i, s in enumerate(task.sentences) if s.passage_id is not None]
    swap = rng.choice(retrieving) if rng.random() < cfg.p_longform_distractor else -1
    parts, held, shown_ids, cases = [], None, [], []
    for i, s in enumerate(task.sentences):
        if s.passage_id is None:
            parts.append(f"{NO_RETRIEVAL}{s.text}")
            cases.append("no_retrieval")
        elif s.passage_id == held:
            parts.append(f"{CONTINUE_EVIDENCE}{s.text}")
            cases.append("continue")
        elif i == swap:
            owner = people[world.by_id[s.passage_id].entity_id]
            shown = lookalike_passage(world, owner, rng, owner.split)
            parts.append(f"{paragraph(shown)}{IRRELEVANT}{s.text}")
            held = shown.id
            shown_ids.append(shown.id)
            cases.append("irrelevant")
        else:
            parts.append(f"{paragraph(world.by_id[s.passage_id])}{RELEVANT}{s.text}{FULLY_SUPPORTED}")
            held = s.passage_id
            shown_ids.append(held)
            cases.append("fully")
    return "".join(parts) + utility(5), {"case": "longform", "segment_cases": cases, "passage_ids": shown_ids}


def make_generator_example(world: World, task: Task, rng: random.Random, cfg: GeneratorConfig = GeneratorConfig()) -> GeneratorExample:
    output, labels = oracle_output(world, task, rng, cfg)
    rec = task.record()
    rec["output"] = output
    return GeneratorExample(rec, {**task.meta(), "labels": labels})


CONTRAST_SUFFIX = "_contrast"


def contrast_pairs(records: list[dict], metas: list[dict], share: float, seed: int = 0) -> list[dict]:
    """Copies of a `share` of the single-attribute questions whose output is another question's
    value of the same attribute (ids end `CONTRAST_SUFFIX`): once the critic annotates them they pair
    a relevant passage with a value it does not state, the `[No support / Contradictory]` case
    the world's fixed answers never give (beyond the paper; trained with the answer text
    weighted 0, `MaskConfig.unsupported_weight`)."""
    values: dict[str, list[str]] = {}
    for m in metas:
        if m["kind"] == "qa":
            values.setdefault(m["attributes"][0], []).append(m["answers"][0])
    rng, out = random.Random(seed), []
    for r, m in zip(records, metas):
        if m["kind"] != "qa" or rng.random() >= share:
            continue
        pool = sorted(set(values[m["attributes"][0]]) - set(m["answers"]))
        if pool:
            out.append({**r, "output": rng.choice(pool), "id": r["id"] + CONTRAST_SUFFIX})
    return out


KIND_SUFFIX = "_kind"


def kind_contrast_pairs(records: list[dict], metas: list[dict], share: float, seed: int = 1,
                        unrecorded_share: float = 0.5) -> list[dict]:
    """Copies of a `share` of the single-attribute questions answered with another attribute of
    the same person (ids end `KIND_SUFFIX`): annotated, they pair a passage that states the value
    with an answer to another question, `[Fully supported]` and, from a critic that reads the
    question, `[Utility:2]`, the case of a birthplace asked and a birth year answered that IsUse
    exists to catch (beyond the paper; the answer is weighted 0, `MaskConfig.unhelpful_weight`).
    An `unrecorded_share` of the copies ask instead what no passage records (`tasks.UNRECORDED`),
    answered with any of the person's values, or with the birth year where a year is asked
    (`UNRECORDED_YEARS`): no value answers those."""
    rng, out = random.Random(seed), []
    for r, m in zip(records, metas):
        if m["kind"] != "qa" or rng.random() >= share or not m.get("other_values"):
            continue
        other = m["other_values"]
        copy = {**r, "output": other[rng.choice(sorted(other))], "id": r["id"] + KIND_SUFFIX}
        if rng.random() < unrecorded_share and m.get("name"):
            attribute, question = unrecorded_question(rng, m["name"])
            values = {**other, m["attributes"][0]: m["answers"][0]}
            answer = (values["birth_year"] if attribute in UNRECORDED_YEARS and "birth_year" in values
                      else rng.choice([*sorted(other.values()), *m["answers"]]))
            copy.update(instruction=question, output=answer)
        out.append(copy)
    return out


# --- parsing --------------------------------------------------------------------------
@dataclass
class ParsedSegment:
    retrieve: str
    passage: str | None  # "title\ntext" between <paragraph> and </paragraph>
    isrel: str | None
    text: str
    issup: str | None


@dataclass
class ParsedOutput:
    segments: list[ParsedSegment]
    utility: str


_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in REFLECTION_TOKENS) + ")")


def parse_output(output: str) -> ParsedOutput:
    """Splits a Self-RAG output into segments, raising ValueError if it breaks the grammar of
    docs/method.md section 2 (every segment opens with a Retrieve token; `[Retrieval]` carries
    a paragraph and an IsRel token; IsSup only after `[Relevant]`; one utility at the end)."""
    parts = [p for p in _SPLIT.split(output) if p != ""]
    if not parts or parts[-1] not in ISUSE_GROUP:
        raise ValueError("output must end with one [Utility:k] token")
    util, parts, segments, i = parts[-1], parts[:-1], [], 0

    def take(expected: tuple[str, ...] | None = None) -> str:
        nonlocal i
        if i >= len(parts):
            raise ValueError(f"output ends early, expected {expected or 'text'}")
        p = parts[i]
        if expected is not None and p not in expected:
            raise ValueError(f"expected one of {expected}, got {p!r}")
        if expected is None and p in REFLECTION_TOKENS:
            raise ValueError(f"expected text, got {p!r}")
        i += 1
        return p

    while i < len(parts):
        retrieve = take((NO_RETRIEVAL, RETRIEVAL, CONTINUE_EVIDENCE))
        passage = isrel = issup = None
        if retrieve == RETRIEVAL:
            take((PARAGRAPH_OPEN,))
            passage = take()
            take((PARAGRAPH_CLOSE,))
            isrel = take((RELEVANT, IRRELEVANT))
        text = take()
        if isrel == RELEVANT:
            issup = take(ISSUP_GROUP)
        segments.append(ParsedSegment(retrieve, passage, isrel, text, issup))
    return ParsedOutput(segments, util)
