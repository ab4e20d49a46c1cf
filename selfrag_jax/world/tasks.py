"""Tasks over the world, with their ground truth.

A `Task` is what a user would ask (instruction and input), the plain answer an ideal
assistant gives, and the ground truth evaluation needs (gold answers, entities, gold
passages, and for long-form answers which passage each sentence rests on). The Self-RAG
outputs, critic examples and eval files are all derived from tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..tokens import REFUSAL
from .core import World
from .kb import Ghost, Person, article


# Released evaluation instructions (docs/method.md section 2), folded into `instruction`.
FACTCHECK_INSTRUCTION = "Is the following statement correct or not? Say true if it's correct; otherwise say false."
MC_INSTRUCTION = "Given four answer candidates, A, B, C and D, choose the best answer choice."
MC_LABELS = ("A", "B", "C", "D")

# Many wordings per attribute (questions, requests, the name first, bare labels), so a model
# learns to answer the attribute asked rather than a template's position; the held-out wordings
# below share no template with these (nor their opening verbs "Name" and "Tell").
QUESTIONS = {
    "birthplace": ("Where was {name} born?", "In which town was {name} born?", "What is the birthplace of {name}?",
                   "Where is {name} from?", "Which town is {name} from?", "What town was {name} born in?",
                   "Give the birthplace of {name}.", "State where {name} was born.", "Say which town {name} was born in.",
                   "{name} was born in what town?", "{name} comes from which town?", "Birthplace of {name}?",
                   "{name}'s birthplace?", "Identify the town where {name} was born.", "Which town is the hometown of {name}?"),
    "birth_year": ("In what year was {name} born?", "When was {name} born?", "What year was {name} born in?",
                   "What is the year of birth of {name}?", "Which year was {name} born in?", "What is {name}'s year of birth?",
                   "Give the birth year of {name}.", "State the year {name} was born.", "Say when {name} was born.",
                   "{name} was born when?", "{name}, born in what year?", "Year of birth of {name}?",
                   "{name}'s birth year?", "Identify the year in which {name} was born.", "Which year saw the birth of {name}?"),
    "occupation": ("What is the occupation of {name}?", "What did {name} do for a living?", "What was the profession of {name}?",
                   "What was {name}'s job?", "What job did {name} have?", "What was {name} by profession?",
                   "Give the occupation of {name}.", "State what {name} did for a living.", "Say what the job of {name} was.",
                   "{name} had what job?", "{name} did what for a living?", "Occupation of {name}?",
                   "{name}'s profession?", "Identify the profession of {name}.", "What line of work was {name} in?"),
    "employer": ("Who did {name} work for?", "Which organisation employed {name}?", "Where did {name} work?",
                 "Who employed {name}?", "Who was the employer of {name}?", "What organisation was {name} employed by?",
                 "Give the employer of {name}.", "State who employed {name}.", "Say which organisation {name} worked for.",
                 "{name} worked for whom?", "{name} worked for which organisation?", "Employer of {name}?",
                 "{name}'s employer?", "Identify the organisation that employed {name}.", "For whom did {name} work?"),
    "instrument": ("What instrument did {name} play?", "Which instrument was {name} known for playing?",
                   "Which instrument did {name} play?", "What musical instrument did {name} play?", "What did {name} play?",
                   "Give the instrument that {name} played.", "State which instrument {name} played.",
                   "Say what instrument {name} played.", "{name} played what?", "{name} was known for playing which instrument?",
                   "Instrument of {name}?", "{name}'s instrument?", "Identify the instrument of {name}.",
                   "On which instrument did {name} make music?", "What did {name} play music on?"),
}
PAIR_QUESTIONS = {
    ("birthplace", "birth_year"): ("Where and in what year was {name} born?", "In which town and in what year was {name} born?"),
    ("occupation", "employer"): ("What was the job of {name}, and who employed {name}?", "What did {name} do, and for which organisation?"),
}
# Wordings no training file uses: imperatives, the name first, other verbs. Only the
# `world_qa_wordings` eval set asks them, to measure whether a generator answers the question
# rather than the template (kept apart from every training and critic template above).
HELDOUT_WORDINGS = {
    "birthplace": ("Name the town where {name} was born.", "{name} was born where?", "Tell me the birthplace of {name}.",
                   "{name}: place of birth?", "In what place did {name} come into the world?"),
    "birth_year": ("Give the year of {name}'s birth.", "{name} was born in which year?",
                   "Tell me the year {name} was born.", "{name}: year of birth?", "What was the birth year of {name}?"),
    "occupation": ("Name the occupation of {name}.", "{name} worked as what?", "Tell me what job {name} had.",
                   "{name}: occupation?", "What kind of work did {name} do?"),
    "employer": ("Name the organisation {name} worked for.", "{name} was employed by whom?",
                 "Tell me who employed {name}.", "{name}: employer?", "For which organisation did {name} work?"),
    "instrument": ("Name the instrument {name} played.", "{name} played which instrument?",
                   "Tell me the instrument {name} played.", "{name}: instrument?", "{name} made music on what?"),
}
# Questions about things no passage states (fillers included, passages.py), asked in training
# only with a recorded value as the answer, rated unhelpful: so IsUse learns that a value of
# another kind than asked does not answer, for any asked kind, not only the five recorded ones.
# The `unstated` unanswerable sets ask other things (unanswerable.UNSTATED), to measure that.
UNRECORDED = {
    "retirement_year": ("In what year did {name} retire?", "When did {name} retire?"),
    "school": ("Which school did {name} attend?", "Where did {name} go to school?"),
    "later_home": ("Which town did {name} move to later in life?", "Where did {name} live in old age?"),
    "father_occupation": ("What was the occupation of {name}'s father?", "What did {name}'s father do for a living?"),
    "sport": ("Which sport did {name} play?", "What sport was {name} good at?"),
    "eye_colour": ("What colour were {name}'s eyes?", "What was {name}'s eye colour?"),
    "nickname": ("What was {name}'s nickname?", "What did friends call {name}?"),
    "pet": ("What pet did {name} keep?", "Which animal did {name} keep as a pet?"),
    "weight": ("How heavy was {name}?", "What did {name} weigh?"),
    "favourite_colour": ("What was {name}'s favourite colour?", "Which colour did {name} like best?"),
    "favourite_book": ("What was {name}'s favourite book?", "Which book did {name} love most?"),
    "hair_colour": ("What colour was {name}'s hair?", "What was {name}'s hair colour?"),
    "shoe_size": ("What shoe size did {name} wear?", "How big were {name}'s feet?"),
    "car": ("What car did {name} drive?", "Which car did {name} own?"),
    "religion": ("What religion did {name} follow?", "What faith did {name} hold?"),
    "mother_birthplace": ("Where was {name}'s mother born?", "Which town was {name}'s mother from?"),
    "first_concert_year": ("In what year did {name} first perform in public?", "When did {name} give a first concert?"),
    "wedding_year": ("In what year did {name} wed?", "When was {name}'s wedding?"),
    "graduation_year": ("In what year did {name} graduate?", "When did {name} graduate?"),
}
# Those asking for a year: a recorded year (the birth year) is the value of the asked kind that
# still does not answer them, the confusion an IsUse that only checks the kind would miss.
UNRECORDED_YEARS = ("retirement_year", "first_concert_year", "wedding_year", "graduation_year")


def unrecorded_question(rng: random.Random, name: str) -> tuple[str, str]:
    """(attribute, question): one of UNRECORDED's questions about `name`, its attribute and
    wording drawn from `rng`."""
    attribute = rng.choice(sorted(UNRECORDED))
    return attribute, rng.choice(UNRECORDED[attribute]).format(name=name)


LONGFORM_REQUESTS = ("Tell me about {name}.", "Write a short biography of {name}.", "Who was {name}?")
COMPARE_REQUESTS = ("Compare {a} and {b}.", "What do {a} and {b} have in common?")

# Real, common words for the no-retrieval tasks: the point is the operation, not the words.
WORDS = (
    "red", "cup", "owl", "sun", "tree", "stone", "lamp", "river", "bread", "chair", "cloud",
    "dog", "cat", "fish", "book", "door", "hill", "moon", "rain", "salt", "ship", "star",
    "wind", "boat", "bird", "milk", "road", "snow", "leaf", "bell", "coat", "fire", "gold",
    "rope", "ring", "sand", "song", "wall", "wolf", "corn",
)


@dataclass(frozen=True)
class Sentence:
    """One sentence of an answer and the passage it rests on (None: it needs no evidence)."""

    text: str
    passage_id: str | None
    facts: tuple[str, ...] = ()


@dataclass
class Task:
    id: str
    kind: str  # qa, pair_qa, factcheck, mc, longform, compare, copy, reverse, count, sum, unanswerable
    dataset_name: str
    instruction: str
    input: str
    answer: str  # the plain output text
    answers: list[str]  # gold answers (eval: any one as a substring is a match)
    needs_retrieval: bool
    entity_ids: list[str] = field(default_factory=list)
    attributes: list[str] = field(default_factory=list)
    gold_passage_ids: list[str] = field(default_factory=list)
    sentences: list[Sentence] = field(default_factory=list)  # how `answer` splits over passages
    extra: dict = field(default_factory=dict)  # question, claim, choices, answerKey, label...

    def record(self) -> dict:
        """The released instruction-data layout (no reflection tokens)."""
        return {"instruction": self.instruction, "input": self.input, "output": self.answer,
                "id": self.id, "dataset_name": self.dataset_name}

    def meta(self) -> dict:
        """Ground truth, kept out of the training record (the texts are in the record)."""
        d = {"id": self.id, "kind": self.kind, "answers": self.answers, "entity_ids": self.entity_ids,
             "attributes": self.attributes, "gold_passage_ids": self.gold_passage_ids}
        if len(self.sentences) > 1:
            d["sentence_passage_ids"] = [s.passage_id for s in self.sentences]
        d.update({k: v for k, v in self.extra.items() if k not in ("question", "claim", "choices")})
        return d


def factcheck_instruction(claim: str) -> str:
    return f"{FACTCHECK_INSTRUCTION}\n\n## Input:\n\n{claim}"


def mc_instruction(question: str, choices: list[str]) -> str:
    lines = "\n".join(f"{label}: {text}" for label, text in zip(MC_LABELS, choices))
    return f"{MC_INSTRUCTION}\n\n### Input:\n{question}\n{lines}"


def plural(word: str) -> str:
    return word[:-1] + "ies" if word.endswith("y") else word + "s"


def claim_text(name: str, attribute: str, value: str) -> str:
    return {
        "birthplace": f"{name} was born in {value}.", "birth_year": f"{name} was born in {value}.",
        "occupation": f"{name} worked as {article(value)} {value}.", "employer": f"{name} worked for {value}.",
        "instrument": f"{name} played the {value}.",
    }[attribute]


class TaskMaker:
    """Makes tasks about one split of people; ids count per kind so they are stable."""

    def __init__(self, world: World, split: str, rng: random.Random, prefix: str = "world") -> None:
        self.world, self.split, self.rng, self.prefix = world, split, rng, prefix
        self.people = [p for p in world.kb.people if p.split == split]
        self.ghosts = [g for g in world.kb.ghosts if g.split == split]
        self.counts: dict[str, int] = {}

    def _id(self, kind: str) -> str:
        n = self.counts.get(kind, 0)
        self.counts[kind] = n + 1
        return f"{self.prefix}_{self.split}_{kind}_{n:05d}"

    def person(self) -> Person:
        return self.rng.choice(self.people)

    def wrong_values(self, person: Person, attribute: str, k: int) -> list[str]:
        """k distinct wrong values, preferring look-alikes' values (harder to tell apart)."""
        right = person.value(attribute)
        near = [q.value(attribute) for q in self.world.kb.lookalikes(person, None)["first"]]
        pool = list(dict.fromkeys(v for v in near if v != right))
        self.rng.shuffle(pool)
        others = [v for v in self.world.values(attribute) if v != right and v not in pool]
        return (pool + self.rng.sample(others, k))[:k]

    # --- questions that need retrieval -------------------------------------------------
    def qa(self, person: Person | None = None, attribute: str | None = None) -> Task:
        p = person or self.person()
        a = attribute or self.rng.choice(list(QUESTIONS))
        q = self.rng.choice(QUESTIONS[a]).format(name=p.name)
        gold = self.world.passage_with(p, a)
        return Task(self._id("qa"), "qa", "world_qa", q, "", p.value(a), [p.value(a)], True, [p.id], [a],
                    [gold.id], [Sentence(p.value(a), gold.id, (a,))],
                    {"question": q, "name": p.name, "other_values": {b: p.value(b) for b in QUESTIONS if b != a}})

    def pair_qa(self, person: Person | None = None) -> Task:
        p = person or self.person()
        attrs = self.rng.choice(list(PAIR_QUESTIONS))
        q = self.rng.choice(PAIR_QUESTIONS[attrs]).format(name=p.name)
        ans = ", ".join(p.value(a) for a in attrs)
        golds = list(dict.fromkeys(self.world.passage_with(p, a).id for a in attrs))
        return Task(self._id("pair_qa"), "pair_qa", "world_pair_qa", q, "", ans, [ans], True, [p.id], list(attrs),
                    golds, [Sentence(ans, golds[0] if len(golds) == 1 else None, attrs)], {"question": q})

    def factcheck(self, person: Person | None = None, truth: bool | None = None) -> Task:
        p = person or self.person()
        a = self.rng.choice(list(QUESTIONS))
        truth = self.rng.random() < 0.5 if truth is None else truth
        value = p.value(a) if truth else self.wrong_values(p, a, 1)[0]
        claim = claim_text(p.name, a, value)
        label = "true" if truth else "false"
        gold = self.world.passage_with(p, a)
        return Task(self._id("factcheck"), "factcheck", "world_factcheck", factcheck_instruction(claim), "", label,
                    [label], True, [p.id], [a], [gold.id], [Sentence(label, gold.id, (a,))],
                    {"question": claim, "claim": claim, "claimed_value": value})

    def mc(self, person: Person | None = None) -> Task:
        p = person or self.person()
        a = self.rng.choice(list(QUESTIONS))
        q = self.rng.choice(QUESTIONS[a]).format(name=p.name)
        choices = [p.value(a), *self.wrong_values(p, a, 3)]
        self.rng.shuffle(choices)
        key = MC_LABELS[choices.index(p.value(a))]
        gold = self.world.passage_with(p, a)
        return Task(self._id("mc"), "mc", "world_mc", mc_instruction(q, choices), "", key, [key], True, [p.id], [a],
                    [gold.id], [Sentence(key, gold.id, (a,))],
                    {"question": q, "choices": {"label": list(MC_LABELS), "text": choices}, "answerKey": key})

    def longform(self, person: Person | None = None) -> Task:
        """A three-sentence biography; each sentence names the passage that states it."""
        p = person or self.person()
        pw = self.world.passage_with
        P = p.pronoun.capitalize()
        sents = [
            Sentence(f"{p.name}, {article(p.occupation)} {p.occupation}, was born in {p.birthplace}.",
                     pw(p, "birthplace").id, ("occupation", "birthplace")),
            Sentence(f"{p.last} was born in {p.birth_year} and worked for {p.employer}.",
                     pw(p, "birth_year").id, ("birth_year", "employer")),
            Sentence(f"{P} played the {p.instrument}.", pw(p, "instrument").id, ("instrument",)),
        ]
        q = self.rng.choice(LONGFORM_REQUESTS).format(name=p.name)
        values = [p.value(a) for a in ("occupation", "birthplace", "birth_year", "employer", "instrument")]
        return Task(self._id("longform"), "longform", "world_longform", q, "", " ".join(s.text for s in sents),
                    values, True, [p.id], ["occupation", "birthplace", "birth_year", "employer", "instrument"],
                    list(dict.fromkeys(s.passage_id for s in sents)), sents, {"question": q})

    def compare(self) -> Task:
        """Two people who share an occupation or a birthplace; the last sentence needs no evidence."""
        a = self.person()
        shared = self.rng.choice(("occupation", "birthplace"))
        pool = [q for q in self.world.kb.lookalikes(a, self.split)[shared]]
        if not pool:
            shared, pool = "first", self.world.kb.lookalikes(a, self.split)["first"]
        b = self.rng.choice(pool)
        sents = [Sentence(f"{x.name}, {article(x.occupation)} {x.occupation}, was born in {x.birthplace}.",
                          self.world.passage_with(x, "birthplace").id, ("occupation", "birthplace")) for x in (a, b)]
        closing = {"occupation": f"Both of them were {plural(a.occupation)}.",
                   "birthplace": f"Both of them were born in {a.birthplace}.",
                   "first": f"Both of them are called {a.first}."}[shared]
        sents.append(Sentence(closing, None, ()))
        q = self.rng.choice(COMPARE_REQUESTS).format(a=a.name, b=b.name)
        return Task(self._id("compare"), "compare", "world_compare", q, "", " ".join(s.text for s in sents),
                    [a.value(shared) if shared != "first" else a.first], True, [a.id, b.id],
                    ["occupation", "birthplace"], [s.passage_id for s in sents[:2]], sents,
                    {"question": q, "shared": shared})

    def unanswerable(self, ghost: Ghost | None = None) -> Task:
        """A question about a name-only person: no passage holds the answer."""
        g = ghost or self.rng.choice(self.ghosts)
        a = self.rng.choice(list(QUESTIONS))
        q = self.rng.choice(QUESTIONS[a]).format(name=g.name)
        return Task(self._id("unanswerable"), "unanswerable", "world_unanswerable", q, "", REFUSAL, [], True,
                    [g.id], [a], [], [Sentence(REFUSAL, None, ())], {"question": q, "answerable": False,
                                                                     "mentioned_by": g.student_id})

    # --- tasks a small model can do from the prompt alone -------------------------------
    def no_retrieval(self, kind: str | None = None) -> Task:
        r = self.rng
        kind = kind or r.choice(("copy", "reverse", "count", "sum"))
        if kind == "sum":
            x, y = r.randint(0, 9), r.randint(0, 9)
            inst, ans = f"What is {x} + {y}?", str(x + y)
        else:
            words = r.sample(WORDS, r.randint(2, 6) if kind == "count" else r.randint(3, 5))
            text = " ".join(words)
            inst, ans = {
                "copy": (f"Copy the following words exactly: {text}", text),
                "reverse": (f"Reverse the order of these words: {text}", " ".join(reversed(words))),
                "count": (f"How many words are in this list: {text}?", str(len(words))),
            }[kind]
        return Task(self._id(kind), kind, f"world_{kind}", inst, "", ans, [ans], False,
                    sentences=[Sentence(ans, None, ())], extra={"question": inst})


RETRIEVAL_KINDS = ("qa", "pair_qa", "factcheck", "mc", "longform", "compare", "unanswerable")
NO_RETRIEVAL_KINDS = ("copy", "reverse", "count", "sum")
