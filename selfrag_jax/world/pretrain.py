"""Base-model pretraining text: the world's passages, plain question-answer look-ups, and
"reading" documents (a passage or two, then questions answered from it).

docs/tiny-models.md: a model that never trained on passage text does not learn to read it,
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
from .critic_data import isrel_input
from .generator_data import lookalike_passage
from .kb import INSTRUMENTS, MORE_INSTRUMENTS
from .tasks import QUESTIONS, REFUSAL, TaskMaker


@dataclass(frozen=True)
class PretrainConfig:
    n_lookups: int = 3000  # "Question: ..\nAnswer: .." lines, grouped into documents of a few
    n_reading: int = 2500  # passage(s) followed by questions about them
    # Reading documents about *fresh* people drawn from a separate knowledge base, each used
    # once: nothing about them can be memorised, so answering needs reading the passage.
    # docs/tiny-models.md: with a fixed set of people a tiny model memorises them instead of
    # reading; fresh entities are what made it read.
    n_fresh_reading: int = 60000
    n_no_retrieval: int = 1000  # copy / reverse / count / sum, as plain question-answer text
    questions_per_reading: int = 3
    # The anneal set (`anneal.jsonl`): reading exercises with hard look-alikes about yet
    # another set of fresh people, mixed 1:1 with the pretraining text for a short final
    # stage at a lower learning rate: only the name tells which passage answers. 400 such
    # steps took held-out reading with the gold passage from 0.60 to 0.76.
    n_anneal_reading: int = 10000
    # The relevance set (`relevance.jsonl`), also mixed into the anneal stage: the question
    # first, then one passage, then the answer, or REFUSAL when the passage is a look-alike's
    # that states the asked attribute. This is the order the critic and the generator see
    # (instruction, then evidence, then [IsRel]); the look-alike pairs of the reading
    # documents come question-last, and a base that matched names there did not carry it to
    # the instruction-first order (docs/experiments/default-models.md).
    n_relevance: int = 30000
    relevance_lookalike_share: float = 0.5
    # The second anneal's relevance documents (`relevance_forms.jsonl`, four surface forms)
    # can also ask about facts the person's shown passage does not state (REFUSAL); a base
    # taught that refused well but its generators lost IsRel, so the shipped models keep 0.5 / 0.0
    # (docs/experiments/default-models.md).
    relevance_forms_lookalike_share: float = 0.5
    relevance_forms_lacking_share: float = 0.0  # of all documents; people with one passage have no lacking case (~12% in all)
    # The fresh people's instruments and birth years: wider than the world's own sets, so that
    # no prior answers for the passage and only reading does (docs/experiments/default-models.md,
    # "The reduced base").
    fresh_instruments: tuple[str, ...] = INSTRUMENTS + MORE_INSTRUMENTS
    fresh_birth_years: tuple[int, int] = (1000, 1999)
    # The repeat set (`repeat.jsonl`): 10-40 of the world's name words in random order, a
    # newline, the same words again. Only copying by content predicts the second half, the
    # skill a critic needs to tell a passage that states the answer's value from one that
    # states another (IsSup), and one the world's text alone never formed in the base
    # (docs/experiments/default-models.md, "Induction heads").
    n_repeat: int = 20000
    repeat_words: tuple[int, int] = (10, 40)


def qa_text(q: str, a: str) -> str:
    """One question-answer pair as pretraining text; `qa_text(q, "")` is the prompt that asks
    for the answer (the reading probe, selfrag_jax/demo/probe.py)."""
    return f"Question: {q}\nAnswer: {a}"


def reading_doc(world: World, person, rng: random.Random, split: str, n_questions: int, hard: bool = False) -> str:
    """One of the person's passages (beside a look-alike half of the time: answer from the
    passage with the right name), then questions about facts it states; `hard`: the
    look-alike's passage that shares the most attributes, asked about the shared ones first."""
    own = rng.choice(world.by_entity[person.id])
    shown, attrs = [own], sorted(own.facts)
    if rng.random() < 0.5:
        at = rng.randrange(2)
        other = lookalike_passage(world, person, rng, split)
        if hard:
            other = max(world.by_entity[other.entity_id], key=lambda p: len(set(p.facts) & set(own.facts)))
            shared = [a for a in attrs if a in other.facts]
            rest = [a for a in attrs if a not in other.facts]
            attrs = rng.sample(shared, len(shared)) + rng.sample(rest, len(rest))
        shown.insert(at, other)
    if not (hard and len(shown) == 2):
        attrs = rng.sample(attrs, min(n_questions, len(attrs)))
    attrs = attrs[:n_questions]
    qs = [qa_text(rng.choice(QUESTIONS[a]).format(name=person.name), own.facts[a]) for a in attrs]
    return "\n\n".join([*(passage_text(s.title, s.text) for s in shown), *qs])


# The surface forms of the relevance documents. The first stage of the anneal uses the
# first form only; the second, all four. A base trained on one form matched names in that
# form only ("I don't know." for 97% of look-alike passages after "Question: ..", but 61% of
# look-alikes and 54% of own passages after "Task instruction: .. Evidence: .."), and the
# critic and the generator fine-tuned from it rated look-alikes relevant. Four forms from the
# start, same budget, gave no name matching in any form. A pretrained Llama has seen
# question-then-document text in countless forms; these stand in for that. No reflection or
# passage token ever appears here.
RELEVANCE_FORMS = (
    "Question: {q}\n\n{p}\n\nAnswer: {a}",
    isrel_input("{q}", "{p}") + "\nAnswer: {a}",  # the critic's own IsRel fields
    "### Instruction:\n{q}\n\n### Input:\n{p}\n\n### Response:\n{a}",
    "### Instruction:\nAnswer the question from the evidence.\n\n### Input:\nQuestion: {q}\nEvidence: {p}\n\n### Response:\n{a}",
)


def relevance_doc(world: World, person, rng: random.Random, split: str, lookalike_share: float = 0.5,
                  forms: tuple[str, ...] = RELEVANCE_FORMS[:1], lacking_share: float = 0.0) -> str:
    """The question about one fact of the person's, then their passage that states it and the
    answer, or (`lookalike_share` of the time) a look-alike's passage stating the same kind of
    fact and REFUSAL: only the name tells them apart; or (`lacking_share`) the person's own
    passage asked about a fact another of their passages states, and REFUSAL: the right name
    is not enough, the passage must state what is asked. One of `forms`, at random."""
    own = rng.choice(world.by_entity[person.id])
    attr = rng.choice(sorted(own.facts))
    shown, answer = own, own.facts[attr]
    if rng.random() < lookalike_share:
        other = lookalike_passage(world, person, rng, split)
        stating = [p for p in world.by_entity[other.entity_id] if attr in p.facts]
        shown, answer = (rng.choice(stating) if stating else other), REFUSAL
    elif lacking_share and rng.random() < lacking_share / (1 - lookalike_share):
        missing = sorted(set().union(*(p.facts for p in world.by_entity[person.id])) - set(own.facts))
        if missing:  # no draw is taken from rng when lacking_share is 0: relevance.jsonl stays as it was
            attr, answer = rng.choice(missing), REFUSAL
    q = rng.choice(QUESTIONS[attr]).format(name=person.name)
    form = forms[0] if len(forms) == 1 else rng.choice(forms)
    return form.format(q=q, p=passage_text(shown.title, shown.text), a=answer)


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
            lines.append(qa_text(rng.choice(QUESTIONS[a]).format(name=p.name), p.value(a)))
        docs.append("\n\n".join(lines))
    for pl in world.kb.places:
        docs.append(qa_text(f"In which province is {pl.name}?", pl.province))
    for o in world.kb.orgs:
        docs.append(qa_text(f"Where is {o.name} based?", o.town))

    for _ in range(cfg.n_reading):
        docs.append(reading_doc(world, rng.choice(people), rng, "train", cfg.questions_per_reading))

    docs.extend(fresh_reading(world, seed, cfg))
    for _ in range(cfg.n_no_retrieval):
        t = tasks.no_retrieval()
        docs.append(qa_text(t.instruction, t.answer))
    rng.shuffle(docs)
    yield from docs


def fresh_reading(world: World, seed: int, cfg: PretrainConfig) -> list[str]:
    """Reading documents about people of a separate, never-reused knowledge base, with a
    look-alike beside the passage half of the time."""
    return _fresh_docs(world, seed + 1_000_003, random.Random(seed * 7 + 11), cfg.n_fresh_reading, cfg,
                       lambda w, p, rng: reading_doc(w, p, rng, p.split, cfg.questions_per_reading))


def anneal_texts(world: World, seed: int, cfg: PretrainConfig) -> list[str]:
    """The anneal stage's reading documents: fresh people again, every look-alike hard."""
    return _fresh_docs(world, seed + 5_000_011, random.Random(seed * 7 + 13), cfg.n_anneal_reading, cfg,
                       lambda w, p, rng: reading_doc(w, p, rng, p.split, cfg.questions_per_reading, hard=True))


def relevance_texts(world: World, seed: int, cfg: PretrainConfig, all_forms: bool = False) -> list[str]:
    """The relevance documents: fresh people of their own knowledge base. `all_forms`: the
    second anneal's set (relevance_forms.jsonl), four forms, look-alike and lacking shares."""
    if all_forms:
        forms, lookalike, lacking = RELEVANCE_FORMS, cfg.relevance_forms_lookalike_share, cfg.relevance_forms_lacking_share
    else:
        forms, lookalike, lacking = RELEVANCE_FORMS[:1], cfg.relevance_lookalike_share, 0.0
    return _fresh_docs(world, seed + 7_000_003, random.Random(seed * 7 + 17), cfg.n_relevance, cfg,
                       lambda w, p, rng: relevance_doc(w, p, rng, p.split, lookalike, forms, lacking))


def repeat_texts(world: World, seed: int, cfg: PretrainConfig) -> list[str]:
    """The repeat documents: words of the training people's names and of places and
    organisations (held-out names stay unseen), drawn with replacement."""
    words = sorted({w for name in [*(p.name for p in world.kb.train_people), *(pl.name for pl in world.kb.places),
                                   *(o.name for o in world.kb.orgs)] for w in name.split() if w[:1].isupper()})
    rng, (lo, hi) = random.Random(seed * 7 + 19), cfg.repeat_words
    docs = []
    for _ in range(cfg.n_repeat):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))
        docs.append(f"{line}\n{line}")
    return docs


def _fresh_docs(world: World, kb_seed: int, rng: random.Random, n: int, cfg: PretrainConfig, doc) -> list[str]:
    """`doc(fresh_world, person, rng)` for n people of knowledge base `kb_seed`. Names that
    collide with the main world's (first or last name of anyone there) are skipped, so
    held-out people stay unseen."""
    if not n:
        return []
    from .core import make_world

    taken = {part for p in world.kb.people for part in (p.first, p.last)}
    fresh = make_world(kb_seed, n + n // 4, instruments=cfg.fresh_instruments, birth_years=cfg.fresh_birth_years)
    people = [p for p in fresh.kb.people if p.first not in taken and p.last not in taken]
    return [doc(fresh, p, rng) for p in people[:n]]
