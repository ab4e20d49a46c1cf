"""The candidate table and the one rule that chooses an answer from it (docs/method.md section 5).

Every way of answering ends here: short form and its baselines, corrective rounds, long
form's per-step scores, `generate --cache` and `sweep`. The table is struct-of-arrays:
question arrays [Q] and candidate arrays [C] grouped by question (each question's `start`
and `count`); a `--cache` folder is its file form (`cache.py`, the same names with q_/c_).

The choice is written once, over operations numpy and jax.numpy share (`keep_mask`,
`select`, `scoring.combine`): `choose` runs it in numpy (float64) for one setting, the
sweep's kernel in jax.numpy (float32) for a grid of settings on a trailing axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from selfrag_jax.inference import scoring
from selfrag_jax.inference.scoring import RefuseOptions, RetrieveOptions, ScoreOptions


@dataclass
class Row:
    """One decoded candidate: its suffix ids, passage(s), and what the engine returned."""

    suffix: list[int]
    passage: dict[str, str] | None = None  # None for the no-retrieval row; the first one for naive
    passages: list[dict[str, str]] | None = None  # naive: every passage in the row
    dropped: int = 0  # passage tokens cut to fit the model
    ids: list[int] = field(default_factory=list)
    seq: float = 0.0
    rel_probs: np.ndarray = field(default_factory=lambda: np.zeros(2))
    sup_probs: np.ndarray = field(default_factory=lambda: np.zeros(3))
    sup_found: bool = False
    use_probs: np.ndarray = field(default_factory=lambda: np.zeros(5))
    use_found: bool = False
    rel_label: int = -1  # index in IsRel of the first generated token, -1 if not an IsRel token
    text: str = ""
    pruned: bool = False  # read (rel_probs set) but not decoded: `keep_top` kept better rows

    @property
    def sup_label(self) -> int:
        return int(np.argmax(self.sup_probs)) if self.sup_found else -1


@dataclass(frozen=True)
class ChoiceOptions:
    """Everything the choice depends on: the task (closed sets aggregate per answer), when to
    retrieve, the score and its hard constraints, refusal, and the depth (`ndocs`: each
    question's first K candidates, the retriever's top K; 0: all of them)."""

    task: str = "open"
    retrieve: RetrieveOptions = field(default_factory=RetrieveOptions)
    score: ScoreOptions = field(default_factory=ScoreOptions)
    refuse: RefuseOptions = field(default_factory=RefuseOptions)
    ndocs: int = 0

    def __post_init__(self):
        if self.ndocs < 0:
            raise ValueError(f"ndocs must not be negative, got {self.ndocs}")


@dataclass
class Table:
    """Questions [Q] and their candidates [C], grouped by question."""

    retrieve_logprobs: np.ndarray  # [Q, 3] f32 log p of (No Retrieval, Retrieval, Continue)
    greedy_retrieval: np.ndarray  # [Q] bool: the argmax first token is [Retrieval]
    cand_start: np.ndarray  # [Q] int32
    cand_count: np.ndarray  # [Q] int32
    nr_seq: np.ndarray  # [Q] f32 mean log-prob of the no-retrieval answer (NaN: not decoded)
    question: np.ndarray  # [C] int32
    seq: np.ndarray  # [C] f32 mean log-prob of the generated tokens
    rel_probs: np.ndarray  # [C, 2] f32
    sup_probs: np.ndarray  # [C, 3] f32 (0s where no IsSup token was generated)
    sup_found: np.ndarray  # [C] bool
    use_probs: np.ndarray  # [C, 5] f32 (0s where no Utility token was generated)
    use_found: np.ndarray  # [C] bool
    rel_label: np.ndarray  # [C] int8 group index of the generated IsRel token, -1 none
    sup_label: np.ndarray  # [C] int8 group index of the generated IsSup token, -1 none
    ret_score: np.ndarray  # [C] the retriever's score of the passage, NaN if none (f64 as read, f32 in a cache)
    answer: np.ndarray  # [C] int32 id of the normalised answer within its question
    pruned: np.ndarray  # [C] bool: read but not decoded (`keep_top`)
    has_passage: np.ndarray  # [C] bool: a no-retrieval row (long form) has nothing to judge
    name_cover: np.ndarray  # [C] `scoring.coverage` of the question by the passage: its names
    word_cover: np.ndarray  # [C] and its words (NaN: unknown, no question or passage at hand)

    # what a `--cache` folder's arrays.npz stores, as q_<name> and c_<name>; `answer`, `pruned`
    # and `has_passage` are not stored (a cache's candidates all have passages and are decoded;
    # its answers come from its index)
    QUESTION_ARRAYS = ("retrieve_logprobs", "greedy_retrieval", "cand_start", "cand_count", "nr_seq")
    CANDIDATE_ARRAYS = ("question", "seq", "rel_probs", "sup_probs", "sup_found", "use_probs", "use_found",
                        "rel_label", "sup_label", "ret_score", "name_cover", "word_cover")

    @classmethod
    def from_rows(cls, groups: Sequence[Sequence[Row]], task: str, retrieve_logprobs: np.ndarray | None = None,
                  greedy_retrieval: Sequence[bool] | None = None, no_retrieval: Sequence[Row | None] | None = None,
                  questions: Sequence[str] | None = None) -> "Table":
        """The table of decoded rows, one group per question (or per beam, in long form)."""
        q_n = len(groups)
        rows = [row for group in groups for row in group]
        cover = np.array([scoring.coverage(q, row.passage) for q, group in zip(questions, groups) for row in group]
                         if questions is not None else np.full((len(rows), 2), np.nan), np.float32).reshape(-1, 2)
        counts = np.array([len(g) for g in groups], np.int32)
        lp = np.zeros((q_n, 3), np.float32) if retrieve_logprobs is None else retrieve_logprobs
        nr = [None] * q_n if no_retrieval is None else no_retrieval
        return cls(
            retrieve_logprobs=np.asarray(lp, np.float32).reshape(q_n, 3),
            greedy_retrieval=np.zeros(q_n, bool) if greedy_retrieval is None else np.asarray(greedy_retrieval, bool),
            cand_start=np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32), cand_count=counts,
            nr_seq=np.array([np.nan if r is None else r.seq for r in nr], np.float32),
            question=np.repeat(np.arange(q_n), counts).astype(np.int32),
            seq=np.array([r.seq for r in rows], np.float32),
            rel_probs=np.array([r.rel_probs for r in rows], np.float32).reshape(-1, 2),
            sup_probs=np.array([r.sup_probs for r in rows], np.float32).reshape(-1, 3),
            sup_found=np.array([r.sup_found for r in rows], bool),
            use_probs=np.array([r.use_probs for r in rows], np.float32).reshape(-1, 5),
            use_found=np.array([r.use_found for r in rows], bool),
            rel_label=np.array([r.rel_label for r in rows], np.int8),
            sup_label=np.array([r.sup_label for r in rows], np.int8),
            ret_score=np.array([scoring.passage_score(r.passage) for r in rows], np.float64),
            answer=answer_ids([[r.text for r in g] for g in groups], task),
            pruned=np.array([r.pruned for r in rows], bool),
            has_passage=np.array([r.passage is not None for r in rows], bool),
            name_cover=cover[:, 0], word_cover=cover[:, 1])

    @classmethod
    def from_results(cls, results: Sequence, task: str) -> "Table":
        """The table of short-form results (`selfrag.QuestionResult`), one group per question."""
        return cls.from_rows([r.candidates for r in results], task,
                             np.array([r.retrieve_logprobs for r in results], np.float32).reshape(-1, 3),
                             [r.greedy_retrieval for r in results], [r.no_retrieval for r in results],
                             [r.item.question for r in results])

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], norms: Sequence[Sequence[str]]) -> "Table":
        """A `--cache` folder's arrays and its candidates' normalised answers. A cache written
        before `c_ret_score` reads as NaN scores: no retriever prior; before the coverage
        arrays, as NaN coverage."""
        n_c = len(arrays["c_seq"])
        got = {name: arrays[f"q_{name}"] for name in cls.QUESTION_ARRAYS}
        got.update({name: arrays[f"c_{name}"] for name in cls.CANDIDATE_ARRAYS if f"c_{name}" in arrays})
        for name in ("ret_score", "name_cover", "word_cover"):
            got.setdefault(name, np.full(n_c, np.nan, np.float32))
        return cls(**got, answer=answer_ids(norms, None), pruned=np.zeros(n_c, bool), has_passage=np.ones(n_c, bool))

    def to_arrays(self) -> dict[str, np.ndarray]:
        """A `--cache` folder's arrays.npz (schema in `cache.py`)."""
        out = {f"q_{name}": getattr(self, name) for name in self.QUESTION_ARRAYS}
        out.update({f"c_{name}": getattr(self, name) for name in self.CANDIDATE_ARRAYS})
        out["c_ret_score"] = self.ret_score.astype(np.float32)
        out["q_retrieve_probs"] = np.exp(self.retrieve_logprobs)
        out["c_rel"] = scoring.rel_score(self.rel_probs).astype(np.float32)
        return out

    @property
    def n_questions(self) -> int:
        return len(self.cand_count)

    @property
    def width(self) -> int:
        """K: the most candidates any question has (at least 1, so padded arrays are never empty)."""
        return max(int(self.cand_count.max(initial=0)), 1)

    def rows(self, q: int, ndocs: int = 0) -> slice:
        """Question q's candidate rows, its first `ndocs` only (0: all)."""
        start, count = int(self.cand_start[q]), int(self.cand_count[q])
        return slice(start, start + (min(count, ndocs) if ndocs else count))

    @cached_property
    def grid(self) -> tuple[np.ndarray, np.ndarray]:
        """([Q, K] candidate row of each cell (0 in padding), [Q, K] bool valid): computed once,
        every padded array of the table is read through it."""
        k = np.arange(self.width)
        valid = k[None, :] < self.cand_count[:, None]
        return np.where(valid, self.cand_start[:, None] + k[None, :], 0), valid

    def padded(self, values: np.ndarray, fill=0) -> np.ndarray:
        """Per-candidate `values` [C, ...] as [Q, K, ...] (`fill` in padding)."""
        rows, valid = self.grid
        values = np.asarray(values)
        if len(values) == 0:
            return np.full(valid.shape + values.shape[1:], fill, values.dtype)
        mask = valid.reshape(valid.shape + (1,) * (values.ndim - 1))
        return np.where(mask, values[rows], fill)


def answer_ids(answers: Sequence[Sequence[str]], task: str | None) -> np.ndarray:
    """[C] id of each candidate's normalised answer within its question, in order of first
    appearance; `task` None: the answers are normalised already (a cache's `norm`)."""
    out = []
    for group in answers:
        ids: dict[str, int] = {}
        out += [ids.setdefault(a if task is None else scoring.answer_group(a, task), len(ids)) for a in group]
    return np.array(out, np.int32)


# --- scores -----------------------------------------------------------------------------
def retriever_probs(table: Table, temperature: float, ndocs: int = 0) -> np.ndarray:
    """[C] `scoring.retriever_prob` of each candidate among its question's first `ndocs` (0:
    all; 0 beyond them, and for every candidate of a question with a missing score)."""
    out = np.zeros(len(table.seq))
    for q in range(table.n_questions):
        rows = table.rows(q, ndocs)
        out[rows] = scoring.retriever_prob(table.ret_score[rows], temperature)
    return out


def candidate_scores(table: Table, opts: ScoreOptions, ndocs: int = 0) -> dict[str, np.ndarray]:
    """[C] seq, rel, sup, use, ret and final as docs/method.md section 5 defines them (float64).
    A row without a passage (long form's no-retrieval step) has nothing to judge: rel = sup = 0."""
    rel = np.where(table.has_passage, scoring.rel_score(table.rel_probs), 0.0)
    sup = np.where(table.has_passage, scoring.sup_score(table.sup_probs, table.sup_found), 0.0)
    use = scoring.use_score(table.use_probs, table.use_found)
    ret = retriever_probs(table, opts.ret_temperature, ndocs)
    seq = table.seq.astype(np.float64)
    return {"seq": seq, "rel": rel, "sup": sup, "use": use, "ret": ret,
            "final": scoring.final_score(seq, rel, sup, use, opts, ret)}


def bar_features(table: Table, sc: dict[str, np.ndarray]) -> np.ndarray:
    """[C, F] `scoring.bar_features` of the table's candidates (`sc`: `candidate_scores`)."""
    return scoring.bar_features(sc["rel"], sc["sup"], sc["use"], table.ret_score, sc["seq"],
                                table.retrieve_logprobs[table.question], table.name_cover, table.word_cover)


# --- the choice, written once for numpy and jax.numpy -----------------------------------
def keep_mask(valid, in_depth, pruned, irrelevant, no_support, drop_irrelevant, drop_no_support, passing, refuse):
    """Which candidates may be chosen: real, within the depth, decoded, not dropped by a hard
    constraint, and (with refusal) past the support bar. Arguments broadcast."""
    return (valid & in_depth & ~pruned & ~(irrelevant & drop_irrelevant) & ~(no_support & drop_no_support)
            & (passing | ~refuse))


def select(xp, final, keep, answer, closed: bool):
    """[Q, K, G] scores and keep mask, [Q, K] answer ids -> [Q, G] chosen index, -1 if none kept.

    Open tasks: the best kept candidate. Closed sets: final scores summed per normalised
    answer over the kept candidates; the answer with the highest total wins (ties: the answer
    whose first kept candidate comes first), then its best candidate. Ties: the first index."""
    k = keep.shape[1]
    if closed:
        onehot = (answer[..., None] == xp.arange(k)).astype(final.dtype)  # [Q, K, A]
        totals = xp.einsum("qka,qkg->qag", onehot, xp.where(keep, final, 0.0))
        mine = xp.take_along_axis(totals, xp.broadcast_to(answer[..., None], final.shape), axis=1)
        best = xp.max(xp.where(keep, mine, -xp.inf), axis=1, keepdims=True)
        first = xp.argmax(keep & (mine == best), axis=1)[:, None, :]  # [Q, 1, G]
        winner = xp.take_along_axis(xp.broadcast_to(answer[..., None], final.shape), first, axis=1)
        keep = keep & (answer[..., None] == winner)
    chosen = xp.argmax(xp.where(keep, final, -xp.inf), axis=1)
    return xp.where(keep.any(axis=1), chosen, -1)


@dataclass
class Choice:
    """Per question: whether candidates were used, the chosen one, refusal; per candidate its scores."""

    retrieved: np.ndarray  # [Q] bool: decided, and candidates within the depth exist
    chosen: np.ndarray  # [Q] int: index among the question's candidates, -1: the no-retrieval answer
    refused: np.ndarray  # [Q] bool
    reasons: list[str | None]  # why each refused question was refused
    scores: dict[str, np.ndarray]  # [C] candidate_scores
    table: Table = field(repr=False)

    def index(self, q: int) -> int | None:
        return None if self.chosen[q] < 0 else int(self.chosen[q])

    def question_scores(self, q: int) -> dict[str, np.ndarray]:
        """Question q's candidates' scores, in its candidates' order."""
        rows = self.table.rows(q)
        return {k: v[rows] for k, v in self.scores.items()}


def choose(table: Table, opts: ChoiceOptions) -> Choice:
    """The answer of every question under `opts` (docs/method.md section 5)."""
    decided = scoring.decide_retrieve(table.retrieve_logprobs, table.greedy_retrieval, opts.retrieve)
    sc = candidate_scores(table, opts.score, opts.ndocs)
    passing = scoring.passes_bar(sc["rel"], sc["sup"], sc["use"], table.sup_label, table.ret_score, opts.refuse,
                                 bar_features(table, sc) if opts.refuse.combination else None)
    _, valid = table.grid
    depth = opts.ndocs or table.width
    keep = keep_mask(valid, np.arange(table.width)[None, :] < depth, table.padded(table.pruned, False),
                     table.padded(table.rel_label == scoring.IRRELEVANT, False),
                     table.padded(table.sup_label == scoring.NO_SUPPORT, False),
                     opts.score.hard.drops_irrelevant, opts.score.hard.drops_no_support,
                     table.padded(passing, False), opts.refuse.enabled)
    chosen = select(np, table.padded(sc["final"], 0.0)[..., None], keep[..., None], table.padded(table.answer),
                    opts.task in scoring.CLOSED_TASKS)[:, 0]
    retrieved = decided & (table.cand_count > 0)
    chosen = np.where(retrieved, chosen, -1)
    refused = opts.refuse.enabled & decided & (chosen < 0)
    reasons = [refusal_reason(table, q, sc, passing, opts) if refused[q] else None for q in range(table.n_questions)]
    return Choice(retrieved, chosen, refused, reasons, sc, table)


def refusal_reason(table: Table, q: int, sc: dict[str, np.ndarray], passing: np.ndarray, opts: ChoiceOptions) -> str:
    rows = table.rows(q, opts.ndocs)
    if rows.stop == rows.start:
        return "no passages were found"
    if passing[rows].any():
        return "the hard constraints dropped every supported candidate"
    return scoring.refusal_reason(sc["rel"][rows], sc["sup"][rows], sc["use"][rows], table.sup_label[rows],
                                  table.ret_score[rows], opts.refuse)

