"""Critic training data for the four reflection-token types, labelled from ground truth.

Inputs use the released critic's field layouts (docs/method.md section 4, written out in the
functions below); the target is the label string (the
critic writes it as plain text). Each type is balanced: the label is drawn first, in turn,
then an example with that label is built, so every class has the same count.

With `issup_reading` (beyond the paper), an IsSup example whose output is a short answer
gets a line before its label, `Answer: <what the evidence answers to the instruction>`:
the values the passage states about the person asked after, or "I don't know." The critic
then decides support by comparing that reading with the output (`data.annotate.read_support`)
instead of by its label: the bundled 1.2M-parameter critic reads a passage's value well but
cannot compare two values (docs/experiments/default-models.md), the way QA-based consistency checks
(QAGS, QuestEval) split reading from matching. Choice letters and fact-check verdicts are
short too but state no value, so with the flag a share of IsSup examples are those, without a
line: a critic that wrote one for "B" or "true" would rate every passage unsupported.
"""

from __future__ import annotations

import random
from typing import Sequence

from ..data.critic_prompts import INSTRUCTIONS, LABELS, isrel_input, issup_input, isuse_input, retrieve_input, retrieve_sentence_input
from ..tokens import (
    CONTINUE_EVIDENCE, FULLY_SUPPORTED, IRRELEVANT, ISUSE_GROUP, NO_RETRIEVAL, PARTIALLY_SUPPORTED, RELEVANT,
    RETRIEVAL, passage_text,
)
from .core import World
from .generator_data import lookalike_passage
from .kb import ATTRIBUTES, Person, article
from .passages import WorldPassage
from .tasks import REFUSAL, TaskMaker, claim_text, unrecorded_question


def _ev(p: WorldPassage | None) -> str:
    return passage_text(p.title, p.text) if p is not None else ""


def evidence_answer(passage: WorldPassage, person: Person, attributes: Sequence[str]) -> str:
    """What `passage` answers about `attributes` of `person`: the values it states, comma
    separated, or REFUSAL when it states none (a passage about someone else states none)."""
    stated = [passage.facts[a] for a in attributes if passage.entity_id == person.id and a in passage.facts]
    return ", ".join(stated) or REFUSAL


class CriticMaker:
    """Builds one example of a given type and label; training people only."""

    def __init__(self, world: World, rng: random.Random, split: str = "train", issup_reading: bool = False) -> None:
        self.world, self.rng, self.issup_reading = world, rng, issup_reading
        self.tasks = TaskMaker(world, split, rng, prefix="critic")
        self.people = {p.id: p for p in world.kb.people}

    def _subject(self, task) -> Person:
        """The person a task asks about."""
        return self.people[task.entity_ids[0]]

    def _person(self, two_passages: bool = False) -> Person:
        while True:
            p = self.tasks.person()
            if p.n_passages == 2 or not two_passages:
                return p

    def _own_or_other(self, p: Person, attribute: str) -> str:
        """The person's value, or (half the time) another person's value of that attribute."""
        return p.value(attribute) if self.rng.random() < 0.5 else self.tasks.wrong_values(p, attribute, 1)[0]

    def retrieve_input(self, label: str) -> str:
        t = self.tasks
        task = t.no_retrieval() if label == NO_RETRIEVAL else \
            self.rng.choice((t.qa, t.qa, t.pair_qa, t.factcheck, t.mc, t.longform, t.compare, t.unanswerable))()
        return retrieve_input(task.instruction)

    def retrieve_sentence(self, label: str) -> str:
        t, r = self.tasks, self.rng
        if label == NO_RETRIEVAL:
            if r.random() < 0.5:
                task = t.no_retrieval()
                return retrieve_sentence_input(task.instruction, "", "", task.answer)
            task = t.compare()
            s = task.sentences
            return retrieve_sentence_input(task.instruction, f"{s[0].text} {s[1].text}", _ev(self.world.by_id[s[1].passage_id]), s[2].text)
        # walk a long-form answer, collecting (preceding, held evidence, sentence) with this label
        while True:
            task = r.choice((t.longform, t.longform, t.compare))()
            held, cands = None, []
            for i, s in enumerate(task.sentences):
                if s.passage_id is None:
                    continue
                lab = CONTINUE_EVIDENCE if s.passage_id == held else RETRIEVAL
                if lab == label:
                    prev = " ".join(x.text for x in task.sentences[:i])
                    cands.append(retrieve_sentence_input(task.instruction, prev, _ev(self.world.by_id.get(held or "")), s.text))
                held = s.passage_id
            if label == RETRIEVAL and r.random() < 0.3:  # a short question, nothing retrieved yet
                task = t.qa()
                cands = [retrieve_sentence_input(task.instruction, "", "", task.answer)]
            if cands:
                return r.choice(cands)

    def isrel(self, label: str) -> str:
        t, r = self.tasks, self.rng
        if label == IRRELEVANT and r.random() < 0.15:  # a question about a name-only person
            ghost = r.choice(t.ghosts)
            task = t.unanswerable(ghost)
            shown = next(p for p in self.world.by_entity[ghost.student_id] if ghost.name in p.text)
            return isrel_input(task.instruction, _ev(shown))
        task = r.choice((t.qa, t.qa, t.qa, t.pair_qa, t.factcheck, t.mc, t.longform))()
        person = self._subject(task)
        if label == RELEVANT:
            shown = r.choice(self.world.by_entity[person.id])
        elif r.random() < 0.1:
            shown = r.choice(self.world.passages[-len(self.world.kb.places) - len(self.world.kb.orgs):])
        else:
            shown = lookalike_passage(self.world, person, r, person.split)
        return isrel_input(task.instruction, _ev(shown))

    def issup(self, label: str) -> tuple[str, str | None]:
        """(input, reading): reading is `evidence_answer` for short answers, None for sentences,
        choice letters and verdicts."""
        t, r, w = self.tasks, self.rng, self.world

        def short(task, p: Person, output: str, shown: WorldPassage) -> tuple[str, str]:
            return (issup_input(task.instruction, "", output, _ev(shown)), evidence_answer(shown, p, task.attributes))

        if label == PARTIALLY_SUPPORTED:
            p = self._person(two_passages=True)
            if r.random() < 0.5:
                task = t.pair_qa(p)
                return short(task, p, task.answer, w.by_id[r.choice(task.gold_passage_ids)])
            task = t.longform(p)
            sentence = r.choice((f"{p.name} was born in {p.birthplace} in {p.birth_year}.",
                                 f"{p.name} worked as {article(p.occupation)} {p.occupation} for {p.employer}."))
            return issup_input(task.instruction, "", sentence, _ev(r.choice(w.by_entity[p.id]))), None
        if self.issup_reading and r.random() < 0.25:
            return self._issup_verdict(label), None
        if r.random() < 0.6:
            task = t.qa()
            p = self._subject(task)
            a = task.attributes[0]
            if label == FULLY_SUPPORTED:
                return short(task, p, task.answer, w.passage_with(p, a))
            case = r.random()
            if case < 0.35 and w.passage_without(p, a):  # the person's passage that lacks the fact
                return short(task, p, task.answer, w.passage_without(p, a))
            if case < 0.7:  # a wrong value against the gold passage: contradicted
                return short(task, p, t.wrong_values(p, a, 1)[0], w.passage_with(p, a))
            # a look-alike's passage: about someone else, even when it names the same value
            return short(task, p, task.answer, lookalike_passage(w, p, r, p.split))
        task = t.longform()
        p = self._subject(task)
        i = r.randrange(len(task.sentences))
        s, prev = task.sentences[i], " ".join(x.text for x in task.sentences[:i])
        if label == FULLY_SUPPORTED:
            return issup_input(task.instruction, prev, s.text, _ev(w.by_id[s.passage_id])), None
        if r.random() < 0.5:  # claims with wrong values against the gold passage
            a = r.choice(("birthplace", "birth_year", "employer", "instrument", "occupation"))
            wrong = claim_text(p.name, a, t.wrong_values(p, a, 1)[0])
            return issup_input(task.instruction, prev, wrong, _ev(w.passage_with(p, a))), None
        other = [q for q in w.by_entity[p.id] if q.id != s.passage_id and not set(s.facts) & set(q.facts)]
        shown = r.choice(other) if other else lookalike_passage(w, p, r, p.split)
        return issup_input(task.instruction, prev, s.text, _ev(shown)), None

    def _issup_verdict(self, label: str) -> str:
        """A multiple-choice letter or a fact check's verdict: short outputs that are no value
        of the passage, so they get no reading line (with one, "B" or "true" would never match).
        Supported when the gold passage decides it that way; not when the letter or verdict is
        wrong, or the passage lacks the fact or is a look-alike's."""
        t, r, w = self.tasks, self.rng, self.world
        task = t.mc() if r.random() < 0.5 else t.factcheck()
        p = self._subject(task)
        a = task.attributes[0]
        if label == FULLY_SUPPORTED:
            return issup_input(task.instruction, "", task.answer, _ev(w.passage_with(p, a)))
        case = r.random()
        if case < 0.5:  # the wrong letter or verdict against the gold passage
            wrong = r.choice([x for x in task.extra["choices"]["label"] if x != task.answer]) if task.kind == "mc" \
                else {"true": "false", "false": "true"}[task.answer]
            return issup_input(task.instruction, "", wrong, _ev(w.passage_with(p, a)))
        shown = w.passage_without(p, a) if case < 0.75 and w.passage_without(p, a) else lookalike_passage(w, p, r, p.split)
        return issup_input(task.instruction, "", task.answer, _ev(shown))

    def isuse(self, label: str) -> str:
        t, r = self.tasks, self.rng
        k = ISUSE_GROUP.index(label) + 1
        # A bare value answering one question is as often [Utility:5] (the asked kind of fact) as
        # [Utility:2] (another kind): with most bare values rated 2, a small critic rated every
        # answer 2 and IsUse told generators nothing (docs/experiments/default-models.md, "v13").
        # Half of either side is the person's own value and half another person's, so that
        # neither the truth nor the person's known facts decide it, only the value's kind.
        if k == 5:
            choice = r.random()
            if choice < 0.8:
                task = t.qa()
                p = self._subject(task)
                return isuse_input(task.instruction, self._own_or_other(p, task.attributes[0]))  # the right kind, true or not
            task = r.choice((t.longform, t.pair_qa, t.no_retrieval, t.compare))()
            return isuse_input(task.instruction, task.answer)
        if k == 4:  # a long answer missing one sentence
            task = r.choice((t.longform, t.compare))()
            drop = r.randrange(len(task.sentences))
            keep = [s.text for j, s in enumerate(task.sentences) if j != drop]
            return isuse_input(task.instruction, " ".join(keep))
        if k == 3:  # half an answer
            if r.random() < 0.5:
                task = t.pair_qa()
                return isuse_input(task.instruction, task.answer.split(", ")[r.randrange(2)])
            task = t.longform()
            return isuse_input(task.instruction, r.choice(task.sentences).text)
        if k == 2:  # the right person, the wrong kind of fact
            if r.random() < 0.3:  # asked what no passage records: every recorded value is the wrong kind
                p = self._person()
                _, question = unrecorded_question(r, p.name)
                a = r.choice(ATTRIBUTES)
                return isuse_input(question, self._own_or_other(p, a))
            task = t.qa() if r.random() < 0.8 else t.pair_qa()
            p = self._subject(task)
            others = r.sample([a for a in ATTRIBUTES if a not in task.attributes], len(task.attributes))
            own = r.random() < 0.5
            return isuse_input(task.instruction, ", ".join(p.value(a) if own else t.wrong_values(p, a, 1)[0] for a in others))
        task = r.choice((t.qa, t.qa, t.longform, t.no_retrieval))()  # k == 1: no answer at all
        out = REFUSAL if r.random() < 0.6 or not task.needs_retrieval else t.no_retrieval("copy").answer
        return isuse_input(task.instruction, out)


def make_critic_records(world: World, n_per_type: int, seed: int, split: str = "train",
                        id_prefix: str = "critic", issup_reading: bool = False) -> list[dict]:
    """n_per_type balanced examples for each of the five input types; with `issup_reading`,
    short-answer IsSup targets start with their `Answer:` line (module docstring), and a
    quarter of the Fully / No-support examples are choice letters and verdicts, without one."""
    rng = random.Random(seed * 7919 + 5)
    maker = CriticMaker(world, rng, split, issup_reading)
    records = []
    for kind, labels in LABELS.items():
        build = getattr(maker, kind)
        for i in range(n_per_type):
            label = labels[i % len(labels)]
            text, reading = build(label) if kind == "issup" else (build(label), None)
            output = f"Answer: {reading}\n{label}" if issup_reading and reading is not None else label
            records.append({"instruction": INSTRUCTIONS[kind], "input": text, "output": output,
                            "id": f"{id_prefix}_{kind}_{i:05d}", "dataset_name": f"critic_{kind}"})
    return records
