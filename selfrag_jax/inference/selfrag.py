"""Short-form Self-RAG over batches of questions (self-rag.md section 5).

Per batch: one prefill of all prompts gives each question's retrieve decision; then one
segment step decodes every candidate row together: K passage rows for each question that
retrieves, and a `prompt + [No Retrieval]` row only where that answer is needed (no
retrieval, hard constraints that may drop every candidate, or `--cache`, which keeps both
paths). Scores, constraints and the choice of answer follow `scoring`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from selfrag_jax import tokens as T
from selfrag_jax.inference import scoring
from selfrag_jax.inference.engine import Engine, Segments
from selfrag_jax.inference.items import Item, passage
from selfrag_jax.inference.scoring import RetrieveOptions, ScoreOptions

RetrieveFn = Callable[[list[str], int], list[list[dict[str, Any]]]]
PASSAGE_MARKERS = 3  # [Retrieval] <paragraph> ... </paragraph>


@dataclass(frozen=True)
class GenerateOptions:
    task: str = "open"
    ndocs: int = 5
    retrieve: RetrieveOptions = field(default_factory=RetrieveOptions)
    score: ScoreOptions = field(default_factory=ScoreOptions)
    trace: bool = False
    keep_both_paths: bool = False  # decode retrieval and no-retrieval paths for every question
    # long form
    beam_width: int = 2
    max_depth: int = 7
    static_passages: bool = False


@dataclass
class Row:
    """One decoded candidate: its suffix ids, passage, and what the engine returned."""

    suffix: list[int]
    passage: dict[str, str] | None = None  # None for the no-retrieval row
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

    @property
    def sup_label(self) -> int:
        return int(np.argmax(self.sup_probs)) if self.sup_found else -1


@dataclass
class QuestionResult:
    """Everything decided and decoded for one question (the output record and cache read it)."""

    item: Item
    prompt: list[int]
    retrieve_logprobs: np.ndarray
    greedy_retrieval: bool  # the argmax first token is [Retrieval]
    retrieved: bool
    candidates: list[Row] = field(default_factory=list)
    no_retrieval: Row | None = None
    chosen: int | None = None
    prediction: str = ""


class ShortForm:
    def __init__(self, engine: Engine, tokenizer, opts: GenerateOptions, retrieve_fn: RetrieveFn | None = None):
        self.engine = engine
        self.tok = tokenizer
        self.opts = opts
        self.retrieve_fn = retrieve_fn
        self.max_len = engine.config.max_position_embeddings

    def run(self, items: Sequence[Item]) -> list[QuestionResult]:
        prompts = [self.prompt_ids(it) for it in items]
        state = self.engine.prefill(prompts)
        greedy_retrieval = state.greedy == self.tok.control_id(T.RETRIEVAL)
        retrieve = scoring.decide_retrieve(state.retrieve_logprobs, greedy_retrieval, self.opts.retrieve)
        results = [QuestionResult(it, p, state.retrieve_logprobs[i], bool(greedy_retrieval[i]), bool(retrieve[i]))
                   for i, (it, p) in enumerate(zip(items, prompts))]
        self._attach_rows(results)
        src, rows = [], []
        for i, r in enumerate(results):
            for row in r.candidates + ([r.no_retrieval] if r.no_retrieval else []):
                src.append(i)
                rows.append(row)
        limits = [min(self.engine.max_new_tokens, self.max_len - len(results[i].prompt) - len(row.suffix))
                  for i, row in zip(src, rows)]
        fill_rows(rows, self.engine.decode(state, src, [row.suffix for row in rows], limits), self.tok)
        for r in results:
            self._choose(r)
        return results

    def record(self, r: QuestionResult) -> dict[str, Any]:
        return output_record(r, self.opts)

    def prompt_ids(self, item: Item) -> list[int]:
        ids = self.tok.encode_prompt(item.instruction, item.input)
        if len(ids) + PASSAGE_MARKERS + 1 > self.max_len:
            raise ValueError(f"{item.where}: prompt of {len(ids)} tokens leaves no room to answer "
                             f"(the model allows {self.max_len})")
        return ids

    def _attach_rows(self, results: list[QuestionResult]) -> None:
        both = self.opts.keep_both_paths
        need = [r for r in results if r.retrieved or both]
        for r, ctxs in zip(need, self.passages([r.item for r in need])):
            r.candidates = [self.passage_row(r.prompt, passage(c, f"{r.item.id}:{j}")) for j, c in enumerate(ctxs)]
            if not r.candidates:
                r.retrieved = False
        sc = self.opts.score
        for r in results:
            if both or not r.retrieved or sc.drop_irrelevant or sc.drop_no_support:
                r.no_retrieval = Row([self.tok.control_id(T.NO_RETRIEVAL)])

    def passages(self, items: Sequence[Item]) -> list[list[dict[str, Any]]]:
        """Top `ndocs` passages per item: its `ctxs`, else the retriever's."""
        out = [it.ctxs[: self.opts.ndocs] if it.ctxs is not None else None for it in items]
        missing = [i for i, c in enumerate(out) if c is None]
        if missing and self.retrieve_fn is None:
            raise ValueError(f"{items[missing[0]].where}: no 'ctxs' and no retriever (--index or --retriever-url)")
        if missing:
            for i, hits in zip(missing, self.retrieve_fn([items[i].question for i in missing], self.opts.ndocs)):
                out[i] = hits
        return out

    def passage_row(self, context: list[int], psg: dict[str, str]) -> Row:
        """`[Retrieval]<paragraph>title\\ntext</paragraph>`, the text cut (never the context)
        so that context + passage + max_new_tokens fits the model."""
        ids = self.tok.encode_passage(psg["title"], psg["text"])
        budget = max(0, self.max_len - len(context) - self.engine.max_new_tokens - PASSAGE_MARKERS)
        body = ids[2:-1]
        return Row(ids[:2] + body[:budget] + ids[-1:], psg, dropped=max(0, len(body) - budget))

    def _choose(self, r: QuestionResult) -> None:
        if r.retrieved:
            finals = candidate_scores(r.candidates, self.opts.score)["final"]
            keep = scoring.allowed(np.array([c.rel_label for c in r.candidates]),
                                   np.array([c.sup_label for c in r.candidates]), self.opts.score)
            r.chosen = scoring.choose([c.text for c in r.candidates], finals, keep, self.opts.task)
        r.prediction = r.candidates[r.chosen].text if r.chosen is not None else r.no_retrieval.text


def fill_rows(rows: list[Row], seg: Segments, tok) -> None:
    """Copy the engine's per-row results into the rows."""
    isrel = tok.isrel_ids
    for i, row in enumerate(rows):
        row.ids = seg.ids(i)
        row.seq = float(seg.seq[i])
        row.rel_probs, row.sup_probs, row.use_probs = seg.rel_probs[i], seg.sup_probs[i], seg.use_probs[i]
        row.sup_found, row.use_found = bool(seg.sup_found[i]), bool(seg.use_found[i])
        row.rel_label = isrel.index(row.ids[0]) if row.ids and row.ids[0] in isrel else -1
        row.text = tok.decode(row.ids, skip_control=True).strip()


def candidate_scores(rows: Sequence[Row], opts: ScoreOptions) -> dict[str, np.ndarray]:
    """seq, rel, sup, use and final per row, as self-rag.md section 5 defines them."""
    seq = np.array([r.seq for r in rows])
    rel = scoring.rel_score(np.array([r.rel_probs for r in rows]).reshape(-1, 2))
    sup = scoring.sup_score(np.array([r.sup_probs for r in rows]).reshape(-1, 3), np.array([r.sup_found for r in rows]))
    use = scoring.use_score(np.array([r.use_probs for r in rows]).reshape(-1, 5), np.array([r.use_found for r in rows]))
    return {"seq": seq, "rel": rel, "sup": sup, "use": use, "final": scoring.final_score(seq, rel, sup, use, opts)}


def output_record(r: QuestionResult, opts: GenerateOptions) -> dict[str, Any]:
    """The JSON line of interfaces.md (`generate`)."""
    scores = candidate_scores(r.candidates, opts.score)
    cands = []
    for j, c in enumerate(r.candidates):
        cand = {"passage": c.passage, "text": c.text,
                "scores": {k: float(v[j]) for k, v in scores.items()}}
        if opts.trace:
            cand.update(prompt_token_ids=r.prompt + c.suffix, token_ids=c.ids, passage_tokens_dropped=c.dropped)
        cands.append(cand)
    out = {"id": r.item.id, "question": r.item.question, "prediction": r.prediction, "retrieved": r.retrieved,
           "p_retrieve": float(scoring.paper_ratio(r.retrieve_logprobs)), "candidates": cands, "chosen": r.chosen}
    if opts.trace:
        out["prompt_token_ids"] = r.prompt
        out["retrieve_probs"] = dict(zip(T.RETRIEVE_GROUP, np.exp(r.retrieve_logprobs).tolist()))
        if r.no_retrieval is not None:
            nr = r.no_retrieval
            out["no_retrieval"] = {"text": nr.text, "prompt_token_ids": r.prompt + nr.suffix, "token_ids": nr.ids}
    return out
